//! `frontdoor-load`: closed-loop load on the agent's front doors, side by side with the
//! baselines users actually face, in one run on one machine:
//!
//! - `bursar-rls`: the agent's Envoy RLS service (three rules, three dimensions per
//!   decision: requests admitted, input and output tokens charged);
//! - `bursar-http`: the agent's `POST /v1/admit` (same three rules, leases);
//! - `redis-rls`: a gRPC RLS server of the shape of envoyproxy/ratelimit that answers
//!   each decision with one Redis call: a GCRA Lua script over the same three keys;
//! - `nowork-rls`: a gRPC RLS server that does no work (the ceiling of gRPC itself);
//! - `redis-direct`: the client calling the GCRA script on Redis directly (no gRPC: a
//!   bare round trip, like redis-benchmark).
//!
//! Servers run as separate processes (`frontdoor-load serve-...` for the baselines), so
//! client and servers share the machine's cores as a real deployment's sidecar would.
//! Run through `bench/run.sh`, which installs and starts Redis.

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bursar_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use bursar_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use bursar_proto::rls::rate_limit_response::Code;
use bursar_proto::rls::rate_limit_service_client::RateLimitServiceClient;
use bursar_proto::rls::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use bursar_proto::rls::{RateLimitRequest, RateLimitResponse};
use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

#[derive(Parser)]
#[command(
    about = "Load on Bursar's front doors beside a Redis GCRA baseline: closed loop, or paced at a fixed rate"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run every target and print the table.
    Run {
        /// The agent binary (release build).
        #[arg(long, default_value = "target/release/bursar-agent")]
        agent: String,
        /// A running redis-server.
        #[arg(long, default_value = "127.0.0.1:6390")]
        redis: SocketAddr,
        /// Seconds measured per configuration (after 1 s of warm-up).
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Concurrent callers, comma-separated.
        #[arg(long, default_value = "1,8,50")]
        callers: String,
        /// Distinct keys the load spreads over.
        #[arg(long, default_value_t = 10_000)]
        keys: u32,
        /// Only the targets whose name starts with one of these (comma-separated).
        #[arg(long, default_value = "")]
        only: String,
        /// Pace every target at this many decisions per second in total (spread over
        /// the callers) instead of a closed loop: latency compared at equal load. A
        /// target that cannot keep up shows it in its decisions/s.
        #[arg(long)]
        rate: Option<u32>,
    },
    /// Serve a no-work RLS server (baseline process).
    ServeNowork {
        #[arg(long)]
        addr: SocketAddr,
    },
    /// Serve an RLS server that makes one Redis GCRA call per decision.
    ServeRedis {
        #[arg(long)]
        addr: SocketAddr,
        #[arg(long)]
        redis: SocketAddr,
    },
}

/// GCRA over every key in KEYS, all-or-nothing, with Redis's own clock (TIME).
/// ARGV: emission interval (us per unit), tolerance (us), cost.
const GCRA_LUA: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local tau = tonumber(ARGV[2])
local cost = tonumber(ARGV[3])
local news = {}
for i, k in ipairs(KEYS) do
  local tat = tonumber(redis.call('GET', k) or now)
  if tat < now then tat = now end
  local new = tat + interval * cost
  if new - now > tau then return 0 end
  news[i] = new
end
for i, k in ipairs(KEYS) do redis.call('SET', k, news[i], 'PX', 60000) end
return 1
"#;

const RULES: &str = r#"
[engine]
max_keys = 200_000
max_leases = 1_000_000
lease_ttl_ms = 1_000

[[rule]]
name = "rps"
domain = "bench"
match = { k = "*" }
dimension = "requests"
rate = 1_000_000_000
per = "second"

[[rule]]
name = "input-tps"
domain = "bench"
match = { k = "*" }
dimension = "input_tokens"
rate = 1_000_000_000
per = "second"

[[rule]]
name = "output-tps"
domain = "bench"
match = { k = "*" }
dimension = "output_tokens"
rate = 1_000_000_000
per = "second"
"#;

/// A minimal RESP client: one connection, one command at a time.
struct Redis {
    conn: BufReader<TcpStream>,
    sha: String,
}

impl Redis {
    async fn connect(addr: SocketAddr) -> Result<Redis> {
        let s = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to redis at {addr}"))?;
        s.set_nodelay(true)?;
        let mut r = Redis {
            conn: BufReader::new(s),
            sha: String::new(),
        };
        let sha = r.command(&["SCRIPT", "LOAD", GCRA_LUA]).await?;
        r.sha = sha;
        Ok(r)
    }

    async fn command(&mut self, args: &[&str]) -> Result<String> {
        let mut out = format!("*{}\r\n", args.len());
        for a in args {
            out.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        self.conn.get_mut().write_all(out.as_bytes()).await?;
        let mut line = String::new();
        self.conn.read_line(&mut line).await?;
        match line.as_bytes().first() {
            Some(b'+') | Some(b':') => Ok(line[1..].trim().to_string()),
            Some(b'$') => {
                let mut v = String::new();
                self.conn.read_line(&mut v).await?;
                Ok(v.trim().to_string())
            }
            Some(b'-') => bail!("redis error: {}", line.trim()),
            _ => bail!("unexpected redis reply {line:?}"),
        }
    }

    /// One decision over the three keys of `k`. True if admitted.
    async fn decide(&mut self, k: u32) -> Result<bool> {
        let keys = [format!("r:{k}"), format!("i:{k}"), format!("o:{k}")];
        let sha = self.sha.clone();
        let r = self
            .command(&[
                "EVALSHA",
                &sha,
                "3",
                &keys[0],
                &keys[1],
                &keys[2],
                "1",
                "1000000000",
                "1",
            ])
            .await?;
        Ok(r == "1")
    }
}

struct NoWork;

#[tonic::async_trait]
impl RateLimitService for NoWork {
    async fn should_rate_limit(
        &self,
        _r: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            ..Default::default()
        }))
    }
}

struct RedisRls {
    pool: tokio::sync::Mutex<Vec<Redis>>,
    addr: SocketAddr,
}

#[tonic::async_trait]
impl RateLimitService for RedisRls {
    async fn should_rate_limit(
        &self,
        r: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let k: u32 = r
            .get_ref()
            .descriptors
            .first()
            .and_then(|d| d.entries.first())
            .and_then(|e| e.value.parse().ok())
            .unwrap_or(0);
        let conn = self.pool.lock().await.pop();
        let mut conn = match conn {
            Some(c) => c,
            None => Redis::connect(self.addr)
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?,
        };
        let ok = conn
            .decide(k)
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        self.pool.lock().await.push(conn);
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: if ok { Code::Ok } else { Code::OverLimit } as i32,
            ..Default::default()
        }))
    }
}

async fn serve(addr: SocketAddr, svc: impl RateLimitService) -> Result<()> {
    tonic::transport::Server::builder()
        .add_service(RateLimitServiceServer::new(svc))
        .serve(addr)
        .await?;
    Ok(())
}

fn free_addr() -> Result<SocketAddr> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[derive(Clone, Copy)]
enum Target {
    Rls(SocketAddr),
    Http(SocketAddr),
    RedisDirect(SocketAddr),
}

struct Outcome {
    decisions: u64,
    admitted: u64,
    hist: Histogram<u64>,
}

/// Paces one caller: `None` is a closed loop (the next call as soon as the last
/// answers); `Some` waits for the next slot of a fixed schedule (a late call goes at
/// once, and its latency is measured from when it was sent).
struct Pace {
    next: Instant,
    period: Option<Duration>,
}

impl Pace {
    async fn wait(&mut self) {
        if let Some(p) = self.period {
            self.next += p;
            tokio::time::sleep_until(self.next.into()).await;
        }
    }
}

async fn caller(
    target: Target,
    keys: u32,
    seed: u64,
    until: Instant,
    warm: Instant,
    mut pace: Pace,
) -> Result<Outcome> {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut decisions, mut admitted) = (0u64, 0u64);
    let mut x = seed | 1;
    let mut next_key = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % keys as u64) as u32
    };
    match target {
        Target::Rls(addr) => {
            let mut c = RateLimitServiceClient::connect(format!("http://{addr}")).await?;
            while Instant::now() < until {
                pace.wait().await;
                let k = next_key();
                let req = RateLimitRequest {
                    domain: "bench".into(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry {
                            key: "k".into(),
                            value: k.to_string(),
                        }],
                        limit: None,
                        hits_addend: None,
                    }],
                    hits_addend: 1,
                };
                let t = Instant::now();
                let r = c.should_rate_limit(req).await?.into_inner();
                if t >= warm {
                    hist.record(t.elapsed().as_micros() as u64)?;
                    decisions += 1;
                    admitted += (r.overall_code == Code::Ok as i32) as u64;
                }
            }
        }
        Target::Http(addr) => {
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .build()?;
            let url = format!("http://{addr}/v1/admit");
            let mut n = 0u64;
            while Instant::now() < until {
                pace.wait().await;
                n += 1;
                let k = next_key();
                let body = serde_json::json!({
                    "request_id": format!("{seed}-{n}"),
                    "descriptors": { "k": k.to_string() },
                    "domain": "bench",
                    "cost": { "requests": 1, "input_tokens": 1, "output_tokens": 1 },
                    "ttl_ms": 1000
                })
                .to_string();
                let t = Instant::now();
                let r = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await?;
                let ok = r.status().is_success();
                let _ = r.bytes().await?;
                if t >= warm {
                    hist.record(t.elapsed().as_micros() as u64)?;
                    decisions += 1;
                    admitted += ok as u64;
                }
            }
        }
        Target::RedisDirect(addr) => {
            let mut r = Redis::connect(addr).await?;
            while Instant::now() < until {
                pace.wait().await;
                let k = next_key();
                let t = Instant::now();
                let ok = r.decide(k).await?;
                if t >= warm {
                    hist.record(t.elapsed().as_micros() as u64)?;
                    decisions += 1;
                    admitted += ok as u64;
                }
            }
        }
    }
    Ok(Outcome {
        decisions,
        admitted,
        hist,
    })
}

async fn measure(
    target: Target,
    callers: usize,
    keys: u32,
    seconds: u64,
    rate: Option<u32>,
) -> Result<(f64, f64, f64, f64)> {
    let start = Instant::now();
    let warm = start + Duration::from_secs(1);
    let until = warm + Duration::from_secs(seconds);
    // Each caller sends every `callers / rate` seconds, the callers' slots staggered.
    let period = rate.map(|r| Duration::from_secs_f64(callers as f64 / f64::from(r.max(1))));
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let offset = period.map_or(Duration::ZERO, |p| p.mul_f64(i as f64 / callers as f64));
            tokio::spawn(caller(
                target,
                keys,
                0x9E37_79B9 + i as u64 * 7919,
                until,
                warm,
                Pace {
                    next: start + offset,
                    period,
                },
            ))
        })
        .collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut decisions, mut admitted) = (0u64, 0u64);
    for t in tasks {
        let o = t.await??;
        decisions += o.decisions;
        admitted += o.admitted;
        hist.add(&o.hist)?;
    }
    let rate = decisions as f64 / seconds as f64;
    Ok((
        rate,
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        hist.value_at_quantile(0.99) as f64 / 1000.0,
        admitted as f64 / decisions.max(1) as f64,
    ))
}

async fn wait_port(addr: SocketAddr) -> Result<()> {
    for _ in 0..100 {
        if TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("nothing listens on {addr}")
}

async fn run(
    agent: String,
    redis: SocketAddr,
    seconds: u64,
    callers: String,
    keys: u32,
    only: String,
    rate: Option<u32>,
) -> Result<()> {
    let me = std::env::current_exe()?;
    let rules = std::env::temp_dir().join(format!("bursar-bench-{}.toml", std::process::id()));
    std::fs::write(&rules, RULES)?;
    let (a_http, a_grpc, nowork, redis_rls) =
        (free_addr()?, free_addr()?, free_addr()?, free_addr()?);
    let _agent = Proc(
        Command::new(&agent)
            .arg("--config")
            .arg(&rules)
            .args(["--http", &a_http.to_string(), "--grpc", &a_grpc.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| {
                format!("starting {agent} (build it: cargo build --release -p bursar-agent)")
            })?,
    );
    let _nowork = Proc(
        Command::new(&me)
            .args(["serve-nowork", "--addr", &nowork.to_string()])
            .spawn()?,
    );
    let _redis_rls = Proc(
        Command::new(&me)
            .args([
                "serve-redis",
                "--addr",
                &redis_rls.to_string(),
                "--redis",
                &redis.to_string(),
            ])
            .spawn()?,
    );
    for a in [a_http, a_grpc, nowork, redis_rls, redis] {
        wait_port(a).await?;
    }
    let callers: Vec<usize> = callers
        .split(',')
        .map(|c| c.trim().parse())
        .collect::<Result<_, _>>()
        .context("--callers: comma-separated numbers")?;
    let targets = [
        ("bursar-rls (3 dims)", Target::Rls(a_grpc)),
        ("redis-rls (GCRA x3)", Target::Rls(redis_rls)),
        ("nowork-rls (ceiling)", Target::Rls(nowork)),
        ("bursar-http admit (3 dims)", Target::Http(a_http)),
        ("redis-direct (GCRA x3)", Target::RedisDirect(redis)),
    ];
    let shape = match rate {
        None => "closed loop".to_string(),
        Some(r) => format!("paced at {r} decisions/s in total"),
    };
    println!("{seconds} s per row after 1 s warm-up, {keys} keys, {shape}; latency in ms\n");
    println!("| target | callers | decisions/s | p50 ms | p99 ms | admitted |");
    println!("|---|---|---|---|---|---|");
    for &c in &callers {
        for (name, t) in targets {
            if !only.is_empty() && !only.split(',').any(|o| name.starts_with(o.trim())) {
                continue;
            }
            let (done, p50, p99, adm) = measure(t, c, keys, seconds, rate).await?;
            println!(
                "| {name} | {c} | {done:.0} | {p50:.3} | {p99:.3} | {:.1} % |",
                adm * 100.0
            );
        }
    }
    let _ = std::fs::remove_file(&rules);
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Run {
            agent,
            redis,
            seconds,
            callers,
            keys,
            only,
            rate,
        } => run(agent, redis, seconds, callers, keys, only, rate).await,
        Cmd::ServeNowork { addr } => serve(addr, NoWork).await,
        Cmd::ServeRedis { addr, redis } => {
            // Fail early if Redis is not there.
            let first = Redis::connect(redis).await?;
            serve(
                addr,
                RedisRls {
                    pool: tokio::sync::Mutex::new(vec![first]),
                    addr: redis,
                },
            )
            .await
        }
    }
}
