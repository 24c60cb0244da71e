//! End-to-end durable ingest through the real `bursar-ledger` binary: concurrent
//! clients `POST /v1/events` batches of 1,000 time-ordered events over loopback
//! HTTP/1.0, a new connection per request; the server parses and validates the JSON,
//! group-commits whatever batches are waiting in one fsynced transaction, and
//! answers. Throughput counts events acknowledged. Client and server share the
//! machine's cores. The `keepalive` group does the same over one HTTP/1.1 connection
//! per client (what a forwarder that reuses its connection sees).
//!
//! `cargo bench -p bursar-ledger --bench http_ingest`; figures in
//! docs/BENCHMARKS.md ("Ledger"). With `BURSAR_BENCH_RANDOM_IDS=1` the request ids
//! are 32 random hex digits (UUIDv4-like) instead of `node-BATCH-INDEX`.
#![allow(missing_docs)] // criterion_main! generates an undocumented `main`.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bursar_ledger::testing::http::{Conn, Node, batch_body, post_once};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BATCH: u64 = 1_000;
static NEXT: AtomicU64 = AtomicU64::new(0);

/// A batch body with request ids never used before in this process.
fn body() -> Vec<u8> {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
        - 1_000;
    let random = std::env::var_os("BURSAR_BENCH_RANDOM_IDS").is_some();
    batch_body(NEXT.fetch_add(1, Ordering::Relaxed), BATCH, random, t)
}

fn http_ingest(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Node::start(Path::new(env!("CARGO_BIN_EXE_bursar-ledger")), dir.path())
        .expect("start bursar-ledger");
    let addr = server.addr;
    // A new connection per request, then one HTTP/1.1 connection per client.
    for (group, keepalive) in [("http_ingest", false), ("http_ingest_keepalive", true)] {
        let mut g = c.benchmark_group(group);
        g.sample_size(10);
        g.measurement_time(Duration::from_secs(10));
        for clients in [1u64, 4] {
            g.throughput(Throughput::Elements(BATCH * clients));
            g.bench_function(format!("batch_{BATCH}_clients_{clients}"), |b| {
                b.iter_custom(|iters| {
                    // Bodies (and connections) are made before the clock starts.
                    let bodies: Vec<Vec<Vec<u8>>> = (0..clients)
                        .map(|_| (0..iters).map(|_| body()).collect())
                        .collect();
                    let mut conns: Vec<Option<Conn>> = (0..clients)
                        .map(|_| keepalive.then(|| Conn::open(addr)))
                        .collect();
                    let start = Instant::now();
                    std::thread::scope(|s| {
                        for (mine, conn) in bodies.iter().zip(&mut conns) {
                            s.spawn(move || {
                                for b in mine {
                                    match conn {
                                        Some(conn) => conn.post(b),
                                        None => post_once(addr, b),
                                    }
                                }
                            });
                        }
                    });
                    start.elapsed()
                })
            });
        }
        g.finish();
    }
    drop(server);
}

criterion_group!(benches, http_ingest);
criterion_main!(benches);
