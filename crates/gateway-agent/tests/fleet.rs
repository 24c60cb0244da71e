//! A real fleet on loopback: the `bursar-allocator` binary and three `bursar-agent`
//! processes (`--allocator`), driven through the agents' HTTP API (`/v1/admit`,
//! `/v1/complete`) with skewed load that shifts between agents, then an allocator
//! killed mid-run and restarted.
//!
//! # What is checked
//!
//! - **Zero overshoot with O = 0.** Every admission is logged with one clock, the test
//!   process's, and replayed through a verifier token bucket `(R, B)` over the whole
//!   fleet, from start to end (kill and restart included). Its level must never go
//!   below zero, up to one honest margin: the test cannot see the instant an agent
//!   admitted, only that it lies between sending the request and reading the answer.
//!   Logging each admission at the answer shifts it later by at most the largest
//!   round trip `L_max`; a sequence that conforms to `(R, B)` at its true times
//!   conforms to `(R, B + R * L_max)` at the shifted times (the admissions in any
//!   observed window happened in a window at most `L_max` longer). So the verifier's
//!   burst is `B + R * (L_max + 1 ms)`; the extra millisecond covers the agents'
//!   coarse 100 us clocks. Report latency needs no margin: it delays grants, and the
//!   allocator counts a grant until it is acknowledged or expired, so late reports
//!   cost utilization, never budget. `L_max` and the verifier's minimum with and
//!   without the margin are printed.
//! - **Utilization** against one ideal global bucket `(R, B)` offered the same
//!   requests at the same times, and the **time to move a slice** (from a demand shift
//!   until the allocator grants the hot agent 90 % of the rate it ends the phase
//!   with, read from the admin endpoint every 100 ms), printed and bounded.
//! - **The allocator killed** (`SIGKILL`): every agent keeps admitting within its
//!   grant while its lease lasts, then follows the rule's `conservative` posture (its
//!   slice falls to at most `min(grant, B / N)`, seen in the `limit` the agents
//!   answer with). A restarted allocator (a higher term, from its term file) learns the
//!   grants agents hold, and resumes: the hot agent's slice grows again.
//!
//! The allocator binary is found next to this package's `bursar-agent` binary
//! (target/debug/bursar-allocator): `cargo test --workspace` builds both; with
//! `cargo test -p bursar-agent` alone, build it first (`cargo build -p
//! bursar-allocator`). Run with `--nocapture` to see the figures.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Agent;

/// Tokens per second and burst of the one limit under test.
const R: u64 = 10_000;
const B: u64 = 2_000;
const AGENTS: usize = 3;
const LEASE_MS: u64 = 2_000;
const RECLAIM_MS: u64 = 500;

const RULES: &str = r#"
[[rule]]
name = "org-itps"
match = { org = "*" }
dimension = "input_tokens"
rate = 10_000
per = "second"
burst = 2_000
posture = "conservative"
"#;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
/// Demand phases (before the kill), in order, each `PHASE_NS` long: offered load per
/// agent as a fraction of R.
const PHASES: [[f64; AGENTS]; 4] = [
    [0.9, 0.1, 0.1],
    [0.1, 0.1, 0.9],
    [0.0, 1.2, 0.0],
    [0.5, 0.5, 0.5],
];
const PHASE_NS: u64 = 3 * SEC;
/// Load while the allocator is down.
const OUTAGE: [f64; AGENTS] = [0.5, 0.5, 0.5];
const OUTAGE_NS: u64 = 3_500 * MS;
/// Load once it is back: one hot agent, so a resumed allocator visibly grows it.
const AFTER: [f64; AGENTS] = [1.2, 0.0, 0.0];
const AFTER_NS: u64 = 6_500 * MS;

/// Offered fractions of R at `t` ns after the load started.
fn offered(t: u64) -> [f64; AGENTS] {
    let before_kill = PHASE_NS * PHASES.len() as u64;
    if t < before_kill {
        PHASES[(t / PHASE_NS) as usize]
    } else if t < before_kill + OUTAGE_NS {
        OUTAGE
    } else {
        AFTER
    }
}

struct Allocator {
    child: Child,
    grpc: SocketAddr,
    admin: SocketAddr,
}

impl Drop for Allocator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn allocator_bin() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_bursar-agent")).with_file_name("bursar-allocator");
    assert!(
        p.exists(),
        "{} is missing: this test starts the real allocator binary, which `cargo test \
         --workspace` builds; with `cargo test -p bursar-agent` run `cargo build -p \
         bursar-allocator` first",
        p.display()
    );
    p
}

fn start_allocator(config: &Path, grpc: &str, term_file: &Path) -> Allocator {
    let mut child = Command::new(allocator_bin())
        .arg("--config")
        .arg(config)
        .args(["--grpc", grpc, "--admin", "127.0.0.1:0"])
        .arg("--term-file")
        .arg(term_file)
        .args(["--lease-ms", &LEASE_MS.to_string()])
        .args(["--reclaim-margin-ms", &RECLAIM_MS.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn bursar-allocator");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let field = |name: &str| -> SocketAddr {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {line:?}"))
    };
    Allocator {
        grpc: field("grpc="),
        admin: field("admin="),
        child,
    }
}

/// A keep-alive HTTP/1.1 client (one connection, reopened on error).
struct Http {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        Http { addr, conn: None }
    }

    fn try_request(
        &mut self,
        method: &str,
        path: &str,
        body: &str,
    ) -> std::io::Result<(u16, String)> {
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            self.conn = Some(BufReader::new(s));
        }
        let r = self.conn.as_mut().expect("connected");
        write!(
            r.get_mut(),
            "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut status_line = String::new();
        if r.read_line(&mut status_line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or(std::io::ErrorKind::InvalidData)?;
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            r.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v
                    .trim()
                    .parse()
                    .map_err(|_| std::io::ErrorKind::InvalidData)?;
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body)?;
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    fn request(&mut self, method: &str, path: &str, body: &str) -> (u16, String) {
        match self.try_request(method, path, body) {
            Ok(x) => x,
            Err(_) => {
                self.conn = None;
                self.try_request(method, path, body)
                    .unwrap_or_else(|e| panic!("{method} {path} to {}: {e}", self.addr))
            }
        }
    }
}

fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let (status, body) = Http::new(addr).request("GET", path, "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Test clock (ns) and each agent's granted rate, from the admin endpoint.
type Granted = (u64, [u64; AGENTS]);

/// One decision as the test saw it.
#[derive(Clone, Copy, Debug)]
struct Rec {
    agent: usize,
    /// Test clock (ns since load start) when the admit was sent and answered.
    sent: u64,
    answered: u64,
    cost: u64,
    admitted: bool,
    /// The slice capacity (burst) the agent answered with.
    limit: u64,
}

/// An exact token bucket in token-nanoseconds.
struct Bucket {
    level: i128,
    cap: i128,
    rate: i128,
    at: u64,
    min_level: i128,
}

impl Bucket {
    fn full(rate: u64, burst: u64) -> Bucket {
        let cap = burst as i128 * SEC as i128;
        Bucket {
            level: cap,
            cap,
            rate: rate as i128,
            at: 0,
            min_level: cap,
        }
    }

    fn refill(&mut self, now: u64) {
        let now = now.max(self.at);
        self.level = (self.level + self.rate * (now - self.at) as i128).min(self.cap);
        self.at = now;
    }

    fn debit(&mut self, now: u64, cost: u64) {
        self.refill(now);
        self.level -= cost as i128 * SEC as i128;
        self.min_level = self.min_level.min(self.level);
    }

    fn try_take(&mut self, now: u64, cost: u64) -> bool {
        self.refill(now);
        let c = cost as i128 * SEC as i128;
        if self.level >= c {
            self.level -= c;
            true
        } else {
            false
        }
    }

    fn min_tokens(&self) -> f64 {
        self.min_level as f64 / SEC as f64
    }
}

fn load(agent: usize, http: SocketAddr, start: Instant, stop: Arc<AtomicBool>) -> Vec<Rec> {
    let mut c = Http::new(http);
    let mut rng = 0x5EED_0000_u64 + agent as u64 * 7919;
    let mut recs = Vec::new();
    let mut next = 0u64;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let now = start.elapsed().as_nanos() as u64;
        let frac = offered(now)[agent];
        if frac == 0.0 {
            std::thread::sleep(Duration::from_millis(5));
            next = start.elapsed().as_nanos() as u64;
            continue;
        }
        if now < next {
            std::thread::sleep(Duration::from_nanos((next - now).min(5 * MS)));
            continue;
        }
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let cost = 20 + rng % 181; // mean 110
        next += (110.0 / (frac * R as f64) * SEC as f64) as u64;
        n += 1;
        let id = format!("a{agent}-{n}");
        let sent = start.elapsed().as_nanos() as u64;
        let (status, body) = c.request(
            "POST",
            "/v1/admit",
            &format!(
                r#"{{"request_id":"{id}","descriptors":{{"org":"acme"}},"cost":{{"input_tokens":{cost},"output_tokens":0}}}}"#
            ),
        );
        let answered = start.elapsed().as_nanos() as u64;
        let v: serde_json::Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("agent {agent}: {status} {e}: {body}"));
        let admitted = v["admitted"].as_bool().unwrap_or(false);
        assert!(
            status == 200 || status == 429 || status == 503,
            "agent {agent}: {status} {body}"
        );
        let limit = v["limits"][0]["limit"].as_u64().unwrap_or(0);
        recs.push(Rec {
            agent,
            sent,
            answered,
            cost,
            admitted,
            limit,
        });
        if admitted {
            let (s, b) = c.request(
                "POST",
                "/v1/complete",
                &format!(r#"{{"request_id":"{id}","usage":{{"input_tokens":{cost}}}}}"#),
            );
            assert_eq!(s, 200, "complete: {b}");
        }
    }
    recs
}

#[test]
fn three_agents_and_the_allocator_never_overshoot_one_global_bucket_even_across_a_kill_and_restart()
{
    let dir = std::env::temp_dir().join(format!("bursar-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("rules.toml");
    std::fs::write(&config, RULES).unwrap();
    let term_file = dir.join("term");
    let mut alloc = start_allocator(&config, "127.0.0.1:0", &term_file);
    let first_term: u64 = std::fs::read_to_string(&term_file)
        .expect("the term file")
        .trim()
        .parse()
        .expect("a term");
    let grpc = alloc.grpc.to_string();
    let agents: Vec<Agent> = (0..AGENTS)
        .map(|i| {
            Agent::start_with(
                RULES,
                &[
                    "--allocator",
                    &grpc,
                    "--agent-id",
                    &format!("agent-{i}"),
                    // Back within a second of the restart.
                    "--allocator-backoff-max-ms",
                    "800",
                ],
            )
        })
        .collect();
    // The first term learns for one lease before it grants anything.
    let t = Instant::now();
    loop {
        let s = get_json(alloc.admin, "/v1/status");
        if s["learning"] == false && s["connected"] == AGENTS {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "allocator not ready: {s}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Each agent's /metrics shows its sync stream up, under the allocator's term.
    for a in &agents {
        assert_eq!(a.metric("bursar_sync_connected "), 1);
        assert!(a.metric("bursar_sync_term ") > 0);
    }

    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = agents
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let (http, stop) = (a.http, Arc::clone(&stop));
            std::thread::spawn(move || load(i, http, start, stop))
        })
        .collect();
    // Grants as the allocator sees them, every 100 ms, until the kill.
    let granted: Arc<Mutex<Vec<Granted>>> = Arc::default();
    let kill_at = PHASE_NS * PHASES.len() as u64;
    let monitor = {
        let (admin, granted) = (alloc.admin, Arc::clone(&granted));
        std::thread::spawn(move || {
            while (start.elapsed().as_nanos() as u64) < kill_at - 100 * MS {
                let v = get_json(admin, "/v1/keys");
                let mut rates = [0u64; AGENTS];
                if let Some(k) = v["keys"].as_array().and_then(|k| k.first()) {
                    for a in k["agents"].as_array().unwrap() {
                        let name = a["agent"].as_str().unwrap();
                        let i: usize = name["agent-".len()..].parse().unwrap();
                        rates[i] = a["granted"]["rate"].as_u64().unwrap();
                    }
                    assert!(
                        k["committed"]["rate"].as_u64().unwrap() <= R,
                        "committed above R: {k}"
                    );
                }
                granted
                    .lock()
                    .unwrap()
                    .push((start.elapsed().as_nanos() as u64, rates));
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    std::thread::sleep(Duration::from_nanos(
        kill_at.saturating_sub(start.elapsed().as_nanos() as u64),
    ));
    monitor.join().unwrap();
    let killed = start.elapsed().as_nanos() as u64;
    drop(alloc); // SIGKILL
    std::thread::sleep(Duration::from_nanos(
        (kill_at + OUTAGE_NS).saturating_sub(start.elapsed().as_nanos() as u64),
    ));
    alloc = start_allocator(&config, &grpc, &term_file);
    let restarted = start.elapsed().as_nanos() as u64;
    std::thread::sleep(Duration::from_nanos(
        (kill_at + OUTAGE_NS + AFTER_NS).saturating_sub(start.elapsed().as_nanos() as u64),
    ));
    let status = get_json(alloc.admin, "/v1/status");
    stop.store(true, Ordering::Relaxed);
    let mut recs: Vec<Rec> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    // Leases were kept by lease extensions (a 2.5 s hold over a 25 s run), through the
    // real allocator shell, stream and sync client.
    for a in &agents {
        let (code, metrics) = Http::new(a.http).request("GET", "/metrics", "");
        assert_eq!(code, 200);
        let applied: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("bursar_sync_events_total{kind=\"extension_applied\"} "))
            .and_then(|v| v.trim().parse().ok())
            .expect("extension_applied in /metrics");
        assert!(applied > 0, "no lease extension applied:\n{metrics}");
    }
    drop(agents);
    drop(alloc);
    let _ = std::fs::remove_dir_all(&dir);

    // The verifier over the whole run, in answer order.
    recs.sort_by_key(|r| r.answered);
    let l_max = recs.iter().map(|r| r.answered - r.sent).max().unwrap_or(0);
    let margin = R as u128 * (l_max + MS) as u128 / SEC as u128;
    let mut verifier = Bucket::full(R, B + margin as u64);
    let mut plain = Bucket::full(R, B);
    for r in recs.iter().filter(|r| r.admitted) {
        verifier.debit(r.answered, r.cost);
        plain.debit(r.answered, r.cost);
    }
    // The ideal global bucket on the same offered requests, before the kill.
    let mut by_sent = recs.clone();
    by_sent.sort_by_key(|r| r.sent);
    let mut ideal = Bucket::full(R, B);
    let (mut ideal_admitted, mut fleet_admitted, mut offered_total) = (0u64, 0u64, 0u64);
    for r in by_sent.iter().filter(|r| r.sent < killed) {
        offered_total += r.cost;
        if ideal.try_take(r.sent, r.cost) {
            ideal_admitted += r.cost;
        }
        if r.admitted {
            fleet_admitted += r.cost;
        }
    }
    let utilization = fleet_admitted as f64 / ideal_admitted.max(1) as f64;

    // Time to move a slice, per phase with one hot agent.
    let granted = granted.lock().unwrap();
    let mut moves = Vec::new();
    for (p, load) in PHASES.iter().enumerate() {
        let hot = (0..AGENTS)
            .max_by(|&a, &b| load[a].total_cmp(&load[b]))
            .unwrap();
        if (0..AGENTS).any(|i| i != hot && load[i] * 1.5 > load[hot]) {
            continue;
        }
        let (p0, p1) = (p as u64 * PHASE_NS, (p as u64 + 1) * PHASE_NS);
        let in_phase: Vec<_> = granted
            .iter()
            .filter(|(t, _)| *t >= p0 && *t < p1)
            .collect();
        let Some((_, last)) = in_phase.last() else {
            continue;
        };
        let target = last[hot] * 9 / 10;
        if let Some((t, _)) = in_phase
            .iter()
            .find(|(_, g)| g[hot] >= target && g[hot] > 0)
        {
            moves.push((p, (t - p0) / MS));
        }
    }

    // During the outage: admitting within grants while leases last, then the posture.
    let lease_left = (LEASE_MS - 200 - 250) * MS; // lease - drift margin - one report
    let early: Vec<usize> = (0..AGENTS)
        .map(|i| {
            recs.iter()
                .filter(|r| {
                    r.agent == i
                        && r.admitted
                        && r.sent > killed + 100 * MS
                        && r.answered < killed + lease_left
                })
                .count()
        })
        .collect();
    let posture_from = killed + (LEASE_MS + 500) * MS;
    let late: Vec<&Rec> = recs
        .iter()
        .filter(|r| r.sent > posture_from && r.answered < restarted)
        .collect();
    let late_max_limit = late.iter().map(|r| r.limit).max().unwrap_or(0);
    let last_second_hot = recs
        .iter()
        .filter(|r| r.agent == 0 && r.sent > kill_at + OUTAGE_NS + AFTER_NS - SEC)
        .map(|r| r.limit)
        .max()
        .unwrap_or(0);

    println!(
        "fleet of {AGENTS} agents, R = {R} tokens/s, B = {B}: {} decisions over {:.1} s, \
         {} admitted",
        recs.len(),
        (kill_at + OUTAGE_NS + AFTER_NS) as f64 / SEC as f64,
        recs.iter().filter(|r| r.admitted).count()
    );
    println!(
        "verifier (R, B + R*(L_max + 1 ms)) minimum level {:.1} tokens; L_max {:.2} ms \
         (margin {margin} tokens); without the margin (R, B) minimum {:.1} tokens",
        verifier.min_tokens(),
        l_max as f64 / MS as f64,
        plain.min_tokens()
    );
    println!(
        "before the kill: offered {offered_total} tokens; ideal global bucket admitted \
         {ideal_admitted}; fleet admitted {fleet_admitted}; utilization {utilization:.3}"
    );
    println!("time to move a slice (phase, ms after the shift): {moves:?}");
    println!(
        "allocator killed at {:.1} s: admissions per agent in the next {:.2} s (leases \
         still valid): {early:?}; largest slice answered after the leases ended: \
         {late_max_limit} (conservative posture: at most B/N = {}); restarted at {:.1} s \
         (term {}), the hot agent's slice in the last second: {last_second_hot}",
        killed as f64 / SEC as f64,
        (lease_left - 100 * MS) as f64 / SEC as f64,
        B / AGENTS as u64,
        restarted as f64 / SEC as f64,
        status["term"]
    );

    assert!(
        verifier.min_level >= 0,
        "overshoot: the verifier went {:.1} tokens below zero",
        -verifier.min_tokens()
    );
    assert!(
        utilization > 0.7,
        "utilization {utilization:.3} against one global bucket"
    );
    assert!(moves.len() >= 2, "slices did not move: {moves:?}");
    assert!(
        moves.iter().all(|&(_, ms)| ms < 3_000),
        "a slice took over 3 s to move: {moves:?}"
    );
    assert!(
        early.iter().all(|&n| n > 0),
        "an agent stopped admitting while its lease lasted: {early:?}"
    );
    assert!(!late.is_empty(), "no decisions after the leases ended");
    assert!(
        late_max_limit <= B / AGENTS as u64,
        "after the leases ended a slice of {late_max_limit} was in force (conservative: \
         at most {})",
        B / AGENTS as u64
    );
    assert!(
        status["term"].as_u64().is_some_and(|t| t > first_term),
        "the restart serves a higher term than {first_term}: {status}"
    );
    assert_eq!(status["connected"], AGENTS, "{status}");
    assert!(
        last_second_hot > B / AGENTS as u64,
        "the restarted allocator did not grow the hot agent's slice ({last_second_hot})"
    );
}

/// Review (twenty-sixth session's open item): an allocator reload that removes a
/// rule, or gives it another meaning, releases its keys, but an agent still on the old
/// file kept its grants on them in force, uncounted, until it restarted (lease
/// extensions cover every grant of the term up to a seq). The allocator now revokes
/// them (`Revoke`): the agent falls to the rule's posture at once, here `strict`, so
/// the key admits nothing.
#[test]
fn an_allocator_reload_that_replaces_a_rule_revokes_the_grant_an_old_file_agent_holds() {
    let rules = RULES.replace("conservative", "strict");
    let dir = std::env::temp_dir().join(format!("bursar-revoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("rules.toml");
    std::fs::write(&config, &rules).unwrap();
    let alloc = start_allocator(&config, "127.0.0.1:0", &dir.join("term"));
    let grpc = alloc.grpc.to_string();
    let agent = Agent::start_with(&rules, &["--allocator", &grpc, "--agent-id", "old-file"]);
    let admit = |n: u64| {
        let (status, body) = Http::new(agent.http).request(
            "POST",
            "/v1/admit",
            &format!(
                r#"{{"request_id":"r{n}","descriptors":{{"org":"acme"}},"cost":{{"input_tokens":10,"output_tokens":0}}}}"#
            ),
        );
        if status == 200 {
            let (done, _) = Http::new(agent.http).request(
                "POST",
                "/v1/complete",
                &format!(
                    r#"{{"request_id":"r{n}","usage":{{"input_tokens":10,"output_tokens":0}}}}"#
                ),
            );
            assert_eq!(done, 200);
        }
        (status, body)
    };
    // Demand until the agent holds a grant on org-itps{acme} and admits under it.
    let t = Instant::now();
    let mut n = 0;
    loop {
        n += 1;
        let (status, _) = admit(n);
        if status == 200 && agent.metric("bursar_sync_events_total{kind=\"grant_applied\"} ") > 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "no grant applied");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        agent.metric("bursar_sync_events_total{kind=\"slice_revoked\"} "),
        0
    );
    // The allocator's file gives org-itps another meaning (a second `*` entry); the
    // agent keeps the old file.
    std::fs::write(
        &config,
        rules.replace(
            r#"match = { org = "*" }"#,
            r#"match = { org = "*", team = "*" }"#,
        ),
    )
    .unwrap();
    let hup = Command::new("kill")
        .args(["-HUP", &alloc.child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let revoked = agent.wait_metric("bursar_sync_events_total{kind=\"slice_revoked\"} ", 1);
    assert_eq!(revoked, 1, "the old-file agent's grant was not revoked");
    // Strict posture: the key admits nothing from now on (before, the grant stayed in
    // force, renewed by every lease extension).
    let (status, body) = admit(n + 1);
    assert_ne!(status, 200, "admitted under a revoked grant: {body}");
    std::thread::sleep(Duration::from_millis(3 * LEASE_MS));
    let (status, body) = admit(n + 2);
    assert_ne!(
        status, 200,
        "admitted under a revoked grant after a lease: {body}"
    );
    let s = get_json(alloc.admin, "/v1/status");
    assert_eq!(s["counters"]["revocations_sent"], 1, "{s}");
    assert!(s["config"]["ignored_lines"].as_u64().unwrap() > 0, "{s}");
    drop(agent);
    drop(alloc);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_local_cluster_command_runs_three_agents_shifts_load_and_reports_no_overshoot() {
    let out = Command::new(allocator_bin())
        .args([
            "local",
            "--duration-s",
            "4",
            "--shift-s",
            "2",
            "--rps",
            "200",
        ])
        .arg("--agent-bin")
        .arg(env!("CARGO_BIN_EXE_bursar-agent"))
        .stdin(Stdio::null())
        .output()
        .expect("run bursar-allocator local");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("  agent local-").count(), 3, "{stdout}");
    let last = stdout
        .rsplit("t=  4s")
        .next()
        .unwrap_or_else(|| panic!("no summary for t=4s:\n{stdout}"));
    for key in [
        "org-input-tps{acme}",
        "org-rps{acme}",
        "org-input-tps{globex}",
    ] {
        let line = last
            .lines()
            .find(|l| l.trim_start().starts_with(key))
            .unwrap_or_else(|| panic!("no {key} line:\n{stdout}"));
        // Every agent holds a slice of acme's and globex's limits by now.
        for a in ["0=", "1=", "2="] {
            assert!(line.contains(a), "{line}");
        }
    }
    assert!(
        stdout.contains("no key overshot beyond its bound."),
        "{stdout}"
    );
}
