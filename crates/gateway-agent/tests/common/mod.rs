//! Test support: start the real `bursar-agent` binary on loopback, and a minimal
//! HTTP/1.1 client over a real socket (so tests can also send bytes no library would).
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A running agent process; killed on drop.
pub struct Agent {
    pub http: SocketAddr,
    pub grpc: SocketAddr,
    pub proxy: Option<SocketAddr>,
    child: Child,
    config: std::path::PathBuf,
}

static N: AtomicU64 = AtomicU64::new(0);

impl Agent {
    /// Starts the agent with `rules` (TOML) on free loopback ports.
    pub fn start(rules: &str) -> Agent {
        Agent::start_with(rules, &[])
    }

    /// Starts the agent with extra command-line arguments.
    pub fn start_with(rules: &str, extra: &[&str]) -> Agent {
        let config = std::env::temp_dir().join(format!(
            "bursar-test-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&config, rules).expect("write config");
        let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-agent"))
            .arg("--config")
            .arg(&config)
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bursar-agent");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the listening line");
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        };
        let proxy = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("proxy="))
            .and_then(|a| a.parse().ok());
        Agent {
            http: field("http="),
            grpc: field("grpc="),
            proxy,
            child,
            config,
        }
    }

    /// Replaces the config file as an operator should: a new file renamed over it.
    pub fn rewrite_config(&self, rules: &str) {
        let tmp = self.config.with_extension("toml.new");
        std::fs::write(&tmp, rules).expect("write config");
        std::fs::rename(&tmp, &self.config).expect("rename config");
    }

    /// Sends the process SIGHUP (re-read the config).
    pub fn hup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .expect("kill -HUP");
        assert!(status.success(), "kill -HUP failed");
    }

    /// Waits up to 5 s for a metric to reach `want`; returns the last value.
    pub fn wait_metric(&self, prefix: &str, want: u64) -> u64 {
        for _ in 0..100 {
            let v = self.metric(prefix);
            if v == want {
                return v;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.metric(prefix)
    }

    /// `bursar_leases_in_flight` from /metrics.
    pub fn leases_in_flight(&self) -> u64 {
        self.metric("bursar_leases_in_flight ")
    }

    /// Waits up to 5 s for the leases in flight to reach zero; returns the last count.
    pub fn leases_drained(&self) -> u64 {
        for _ in 0..100 {
            let n = self.leases_in_flight();
            if n == 0 {
                return 0;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        self.leases_in_flight()
    }

    /// A metric line's value from /metrics (`prefix` includes labels and the space).
    pub fn metric(&self, prefix: &str) -> u64 {
        let r = request(self.http, "GET", "/metrics", b"");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("metric {prefix:?} missing"))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// One request on a new connection (`Connection: close`), raw body bytes.
pub fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Resp {
    request_with(addr, method, path, &[], body)
}

/// One request with extra header lines (`Name: value`).
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &[u8],
) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let extra: String = headers.iter().map(|h| format!("{h}\r\n")).collect();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         {extra}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write head");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad response: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Resp {
        status,
        headers,
        body: body.to_string(),
    }
}

pub fn post(addr: SocketAddr, path: &str, json: serde_json::Value) -> Resp {
    request(addr, "POST", path, json.to_string().as_bytes())
}
