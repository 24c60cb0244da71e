//! Test support for the tests that run the real binaries: the `bursar-allocator`
//! process on free loopback ports (killed on drop), its JSON admin endpoint, the
//! workspace's other binaries beside it, and an agent's side of the stream.
#![allow(dead_code)] // each test binary uses a different subset

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bursar_proto::allocator as pb;
use pb::allocator_client::AllocatorClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// The rules the allocator starts with: one limit, `org-rps`, 100 requests per
/// second with a burst of 20.
pub const RULES: &str = r#"
[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 20
"#;

/// A child process, killed and reaped on drop; derefs to the `Child`.
pub struct Proc(pub Child);

impl Deref for Proc {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for Proc {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The value of `name` (e.g. `grpc=`) in a line of `name=value` words.
pub fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

/// A running `bursar-allocator`; the process is killed, then its rules file removed,
/// on drop.
pub struct Allocator {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    // Declared before `_dir`: the process is gone before its directory is removed.
    pub child: Proc,
    /// The rules file it was started with (`RULES`), in a directory of its own.
    pub config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Allocator {
    /// Starts the allocator with `RULES`, gRPC and admin on free loopback ports, and
    /// `extra` arguments; returns once it has printed its listening line.
    pub fn start<S: AsRef<OsStr>>(extra: &[S]) -> Allocator {
        let dir = tempfile::Builder::new()
            .prefix("bursar-alloc-test-")
            .tempdir()
            .expect("temp dir");
        let config = dir.path().join("rules.toml");
        std::fs::write(&config, RULES).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-allocator"))
            .arg("--config")
            .arg(&config)
            .args(["--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bursar-allocator");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let child = Proc(child);
        assert!(line.starts_with("bursar-allocator listening: "), "{line:?}");
        let addr = |name: &str| -> SocketAddr {
            field(&line, name)
                .parse()
                .unwrap_or_else(|_| panic!("no {name} in {line:?}"))
        };
        Allocator {
            grpc: addr("grpc="),
            admin: addr("admin="),
            child,
            config,
            _dir: dir,
        }
    }

    /// A GET on the admin endpoint that must answer 200; its JSON body.
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let (status, v) = self.request("GET", path);
        assert_eq!(status, 200, "{v}");
        v
    }

    /// Polls `GET /v1/status` until `pred` holds (10 s at most, then fails naming
    /// `what`); the status that satisfied it.
    pub fn wait_status(
        &self,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let start = std::time::Instant::now();
        loop {
            let v = self.get_json("/v1/status");
            if pred(&v) {
                return v;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "{what}: {v}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One admin request: the status code and the JSON body.
    pub fn request(&self, method: &str, path: &str) -> (u16, serde_json::Value) {
        let mut s = TcpStream::connect(self.admin).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{head}"));
        let v = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        (status, v)
    }
}

/// Another binary of the workspace, built beside `bursar-allocator`.
pub fn sibling_bin(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_bursar-allocator")).with_file_name(name);
    assert!(
        p.exists(),
        "{} is missing: `cargo test --workspace` (or `cargo build`) builds it",
        p.display()
    );
    p
}

/// An agent's hello: incarnation 1, weight 1, holding nothing.
pub fn hello(agent: &str, version: u32, time: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        msg: Some(pb::agent_message::Msg::Hello(pb::Hello {
            protocol_version: version,
            agent: agent.into(),
            incarnation: 1,
            weight: 1,
            agent_time_ns: time,
            held: vec![],
            config_version: String::new(),
            report_interval_ms: 250,
            grants_by_handle: false,
            rule_shapes: Vec::new(),
        })),
    }
}

/// Opens a stream to `addr` (plain HTTP/2) that sends `first`; the sender for the
/// rest and the allocator's answer to the call.
pub async fn open(
    addr: SocketAddr,
    first: pb::AgentMessage,
) -> (
    mpsc::Sender<pb::AgentMessage>,
    Result<tonic::Streaming<pb::AllocatorMessage>, tonic::Status>,
) {
    let mut client = AllocatorClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(pb::MAX_MESSAGE_BYTES)
        // Lenient on purpose: the server's bound is under test, not the client's.
        .max_encoding_message_size(4 * pb::MAX_MESSAGE_BYTES);
    let (tx, rx) = mpsc::channel(16);
    tx.send(first).await.unwrap();
    let r = client
        .sync(ReceiverStream::new(rx))
        .await
        .map(|r| r.into_inner());
    (tx, r)
}
