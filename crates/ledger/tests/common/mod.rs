//! Shared helpers for the integration tests: start the real `bursar-ledger` binary on
//! a free loopback port, and a minimal HTTP/1.0 client over `std::net` (enough for
//! JSON requests; no extra dependency).
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

pub const HOUR_MS: u64 = 3_600_000;

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// A running ledger process. Killed (SIGKILL) on drop.
pub struct Node {
    pub child: Child,
    pub addr: SocketAddr,
    pub dir: PathBuf,
    /// The cluster (QUIC) address, when started with `--gossip`.
    pub gossip: Option<SocketAddr>,
}

impl Node {
    /// Starts the binary on `dir` with `--http 127.0.0.1:0` and waits for its
    /// `listening on http://ADDR` line.
    pub fn start(dir: &Path, extra: &[&str]) -> Node {
        Node::start_named(dir, "test-node", extra)
    }

    /// [`Node::start`] with a node id; with `--gossip` among `extra`, also waits for
    /// the `gossip on ADDR` line.
    pub fn start_named(dir: &Path, node_id: &str, extra: &[&str]) -> Node {
        let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-ledger"))
            .arg("--data-dir")
            .arg(dir)
            .args(["--node-id", node_id, "--http", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn bursar-ledger");
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        let mut reader = BufReader::new(stdout);
        reader.read_line(&mut line).expect("read stdout");
        let Some(addr) = line.trim().strip_prefix("listening on http://") else {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("bursar-ledger did not start: stdout {line:?}, stderr {err:?}");
        };
        let addr = addr.parse().expect("address");
        let mut gossip = None;
        if extra.contains(&"--gossip") {
            let mut g = String::new();
            reader.read_line(&mut g).expect("read stdout");
            let Some(a) = g.trim().strip_prefix("gossip on ") else {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = e.read_to_string(&mut err);
                }
                panic!("bursar-ledger did not join: stdout {g:?}, stderr {err:?}");
            };
            gossip = Some(a.parse().expect("gossip address"));
        }
        Node {
            addr,
            child,
            dir: dir.to_path_buf(),
            gossip,
        }
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        let _ = self.child.kill(); // SIGKILL on Unix
        let _ = self.child.wait();
    }

    pub fn get(&self, path: &str) -> Resp {
        request(self.addr, "GET", path, b"").expect("GET")
    }

    pub fn post(&self, path: &str, body: &[u8]) -> Resp {
        request(self.addr, "POST", path, body).expect("POST")
    }

    pub fn post_json(&self, path: &str, body: &Value) -> Resp {
        self.post(path, body.to_string().as_bytes())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }
}

/// One HTTP/1.0 request (the server closes the connection after answering, so the
/// body is everything until EOF).
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> std::io::Result<Resp> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(30)))?;
    let head = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no end of headers"))?;
    let headers = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = headers
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status"))?;
    Ok(Resp {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    })
}

/// A usage event as JSON.
pub fn usage_json(
    request_id: &str,
    tenant: &str,
    model: &str,
    time_ms: u64,
    input: u64,
    output: u64,
) -> Value {
    serde_json::json!({
        "request_id": request_id, "origin": "agent-a", "seq": 1, "tenant": tenant,
        "model": model, "time_ms": time_ms, "status": "ok",
        "input_tokens": input, "cached_input_tokens": 0, "output_tokens": output,
    })
}

/// Every exported event in hours `from..to` (ms), following the cursor.
pub fn export_all(node: &Node, from: u64, to: u64, page: usize) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut path = format!("/v1/export?from={from}&to={to}&limit={page}");
        if let Some(a) = &after {
            path.push_str(&format!("&after={a}"));
        }
        let r = node.get(&path);
        assert_eq!(r.status, 200, "{}", r.text());
        for line in r.text().lines() {
            out.push(serde_json::from_str(line).expect("a JSON line"));
        }
        match r.header("x-bursar-next-after") {
            Some(next) => after = Some(next),
            None => return out,
        }
    }
}

/// The hour-aligned window [now - 72 h, now + 2 h).
pub fn window() -> (u64, u64) {
    let h = now_ms() / HOUR_MS;
    ((h - 72) * HOUR_MS, (h + 2) * HOUR_MS)
}
