//! Steady durable ingest over HTTP: starts a real `bursar-ledger` on a fresh data
//! directory, builds every body first, then `CLIENTS` keep-alive clients post
//! `BATCHES` batches of `BATCH` events as fast as the node acknowledges them (each
//! client waits for its answer, so at most `CLIENTS` requests are in flight). Prints
//! events/s, the node's CPU time per event (from /proc: the figure to compare builds
//! by, as it barely depends on the machine's phase), request latency and the node's
//! peak memory.
//!
//! Unlike the criterion bench `http_ingest` (short rounds, every client starting
//! together), this is the throughput of a node fed continuously.
//!
//! ```text
//! cargo build --release -p bursar-ledger --bin bursar-ledger --example http_load
//! target/release/examples/http_load [--binary target/release/bursar-ledger]
//!     [--batches 1500] [--clients 4] [--batch 1000] [--ordered-ids] [--seed 1]
//! ```

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bursar_ledger::testing::http::{Conn, Node, batch_body, cpu_seconds, peak_rss_bytes};

struct Opts {
    binary: PathBuf,
    batches: u64,
    clients: u64,
    batch: u64,
    random_ids: bool,
    seed: u64,
}

const USAGE: &str = "usage: http_load [--binary PATH] [--batches N] [--clients N] \
[--batch N] [--ordered-ids] [--seed N]
  --binary PATH   the bursar-ledger to start (default target/release/bursar-ledger)
  --batches N     requests in all (default 1500)
  --clients N     keep-alive connections posting at once (default 4)
  --batch N       events per request, 1..=10000 (default 1000)
  --ordered-ids   request ids node-BATCH-INDEX instead of 32 random hex digits
  --seed N        first batch number (ids are drawn from it; default 1)";

fn opts() -> Result<Opts, String> {
    let mut o = Opts {
        binary: PathBuf::from("target/release/bursar-ledger"),
        batches: 1500,
        clients: 4,
        batch: 1000,
        random_ids: true,
        seed: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|_| format!("{name}: not a number: {v}"))
        };
        match a.as_str() {
            "--binary" => {
                o.binary = args.next().ok_or("--binary needs a path")?.into();
            }
            "--batches" => o.batches = num("--batches")?,
            "--clients" => o.clients = num("--clients")?,
            "--batch" => o.batch = num("--batch")?,
            "--seed" => o.seed = num("--seed")?,
            "--ordered-ids" => o.random_ids = false,
            "-h" | "--help" => return Err(String::new()),
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    if o.batches == 0 || o.clients == 0 || !(1..=10_000).contains(&o.batch) {
        return Err("--batches and --clients must be at least 1, --batch 1..=10000".into());
    }
    Ok(o)
}

fn main() {
    let o = match opts() {
        Ok(o) => o,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("http_load: {e}");
            }
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let bodies: Vec<Vec<u8>> = (0..o.batches)
        .map(|b| batch_body(o.seed + b, o.batch, o.random_ids, now_ms - 1_000))
        .collect();
    let dir = std::env::temp_dir().join(format!("bursar-http-load-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = match Node::start(&o.binary, &dir) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("http_load: cannot start {}: {e}", o.binary.display());
            std::process::exit(1);
        }
    };
    let next = Mutex::new(bodies.iter());
    let answered = Mutex::new(Vec::with_capacity(bodies.len()));
    let cpu0 = cpu_seconds(node.pid());
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..o.clients {
            s.spawn(|| {
                let mut conn = Conn::open(node.addr);
                let mut mine = Vec::new();
                loop {
                    let Some(body) = next.lock().expect("lock").next() else {
                        break;
                    };
                    let t = Instant::now();
                    conn.post(body);
                    // Its latency, and when it was answered (from the start).
                    let took = t.elapsed();
                    mine.push((took, t - start + took));
                }
                answered.lock().expect("lock").extend(mine);
            });
        }
    });
    let wall = start.elapsed();
    let cpu = cpu_seconds(node.pid()).zip(cpu0).map(|(b, a)| b - a);
    let rss = peak_rss_bytes(node.pid());
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
    let events = o.batches * o.batch;
    let done = answered.into_inner().expect("lock");
    let mut lat: Vec<Duration> = done.iter().map(|&(l, _)| l).collect();
    lat.sort();
    // When each request was answered (from the start), to show how the rate moves as
    // the store grows.
    let mut ends: Vec<Duration> = done.iter().map(|&(_, e)| e).collect();
    ends.sort();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{events} events ({} x {}, {} clients, {} ids) in {:.2} s: {:.0} events/s",
        o.batches,
        o.batch,
        o.clients,
        if o.random_ids { "random" } else { "ordered" },
        wall.as_secs_f64(),
        events as f64 / wall.as_secs_f64()
    );
    println!(
        "request latency p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        ms(pct(0.5)),
        ms(pct(0.99)),
        ms(pct(1.0))
    );
    if ends.len() >= 10 {
        let tenth = ends.len() / 10;
        let rates: Vec<String> = (0..10)
            .map(|i| {
                let from = if i == 0 {
                    Duration::ZERO
                } else {
                    ends[i * tenth - 1]
                };
                let to = ends[(i + 1) * tenth - 1];
                let n = (tenth as u64 * o.batch) as f64;
                format!("{:.0}k", n / (to - from).as_secs_f64().max(1e-9) / 1e3)
            })
            .collect();
        println!("events/s by tenth of the run: {}", rates.join(" "));
    }
    match (cpu, rss) {
        (Some(cpu), Some(rss)) => println!(
            "node: {:.2} s of CPU, {:.2} us per event; peak RSS {} MiB",
            cpu,
            cpu * 1e6 / events as f64,
            rss >> 20
        ),
        _ => println!("node CPU and memory: not available here (no /proc)"),
    }
}
