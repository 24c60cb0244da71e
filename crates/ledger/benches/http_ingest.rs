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

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BATCH: u64 = 1_000;
static NEXT: AtomicU64 = AtomicU64::new(0);

struct Server(Child, SocketAddr);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(dir: &std::path::Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-ledger"))
        .arg("--data-dir")
        .arg(dir)
        .args(["--node-id", "bench", "--http", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn bursar-ledger");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read");
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .expect("listening line")
        .parse()
        .expect("address");
    Server(child, addr)
}

/// A batch body with request ids never used before in this process.
fn body() -> Vec<u8> {
    let b = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut random = std::env::var_os("BURSAR_BENCH_RANDOM_IDS")
        .is_some()
        .then_some(bursar_ledger::testing::SplitMix64(b));
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
        - 1_000;
    let mut s = String::with_capacity(260 * BATCH as usize);
    s.push('[');
    for i in 0..BATCH {
        if i > 0 {
            s.push(',');
        }
        let id = match &mut random {
            Some(r) => format!("{:016x}{:016x}", r.next_u64(), r.next_u64()),
            None => format!("node-{b:09}-{i:04}"),
        };
        s.push_str(&format!(
            r#"{{"request_id":"{id}","origin":"agent-a","seq":{i},"tenant":"t{}","descriptors":[["key","k{}"]],"model":"gpt-4o","time_ms":{t},"status":"ok","input_tokens":{},"cached_input_tokens":0,"output_tokens":{}}}"#,
            i % 8,
            i % 10,
            100 + i,
            i % 500
        ));
    }
    s.push(']');
    s.into_bytes()
}

fn post(addr: SocketAddr, body: &[u8]) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let head = format!(
        "POST /v1/events HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(body).expect("write");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    assert!(
        out.starts_with(b"HTTP/1.0 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
}

/// One HTTP/1.1 connection, reused for every request.
struct Conn {
    s: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        s.set_nodelay(true).expect("nodelay");
        Conn {
            s: BufReader::new(s),
        }
    }

    fn post(&mut self, body: &[u8]) {
        let head = format!(
            "POST /v1/events HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let w = self.s.get_mut();
        w.write_all(head.as_bytes()).expect("write");
        w.write_all(body).expect("write");
        let mut status = String::new();
        self.s.read_line(&mut status).expect("read");
        assert!(status.starts_with("HTTP/1.1 200"), "{status}");
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            self.s.read_line(&mut line).expect("read");
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                len = v.trim().parse().expect("content-length");
            }
        }
        let mut answer = vec![0u8; len];
        self.s.read_exact(&mut answer).expect("read");
    }
}

fn http_ingest(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = start(dir.path());
    let addr = server.1;
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
                                        None => post(addr, b),
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
