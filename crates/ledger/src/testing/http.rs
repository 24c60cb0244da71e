//! A real `bursar-ledger` process and plain HTTP clients for it, shared by the
//! `http_ingest` benchmark and the `http_load` example (std only: no HTTP client crate
//! between the load and the server).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::SplitMix64;

/// A `bursar-ledger` child process serving HTTP on a loopback port; killed on drop.
pub struct Node {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
}

impl Node {
    /// Starts `binary` standalone on `dir` (`--http 127.0.0.1:0`) and waits for its
    /// "listening on" line.
    pub fn start(binary: &Path, dir: &Path) -> io::Result<Node> {
        let mut child = Command::new(binary)
            .arg("--data-dir")
            .arg(dir)
            .args(["--node-id", "bench", "--http", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped stdout");
        BufReader::new(stdout).read_line(&mut line)?;
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| io::Error::other(format!("no listening line: {line:?}")))?;
        Ok(Node { child, addr })
    }

    /// The process id (for [`cpu_seconds`]).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time (user + system) a process has used so far, from /proc (Linux); `None`
/// elsewhere.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces):
    // utime and stime are the 12th and 13th of them, in clock ticks (100 a second on
    // every Linux we run on).
    let mut f = stat[stat.rfind(')')? + 2..].split(' ');
    let utime: u64 = f.nth(11)?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

/// A process's peak resident memory (`VmHWM` of /proc/PID/status), in bytes; `None`
/// where there is no /proc.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A JSON array of `size` usage events for `POST /v1/events`, all at `time_ms`. Request
/// ids are `node-BATCH-INDEX` (time-ordered), or, with `random_ids`, 32 hex digits
/// drawn from a generator seeded by `batch` (UUIDv4-like). A distinct `batch` gives
/// ids never used by another.
pub fn batch_body(batch: u64, size: u64, random_ids: bool, time_ms: u64) -> Vec<u8> {
    use std::fmt::Write as _;
    let mut random = random_ids.then_some(SplitMix64(batch));
    let mut s = String::with_capacity(260 * size as usize);
    s.push('[');
    for i in 0..size {
        if i > 0 {
            s.push(',');
        }
        s.push_str(r#"{"request_id":""#);
        match &mut random {
            Some(r) => write!(s, "{:016x}{:016x}", r.next_u64(), r.next_u64()),
            None => write!(s, "node-{batch:09}-{i:04}"),
        }
        .expect("write to a String");
        write!(
            s,
            r#"","origin":"agent-a","seq":{i},"tenant":"t{}","descriptors":[["key","k{}"]],"model":"gpt-4o","time_ms":{time_ms},"status":"ok","input_tokens":{},"cached_input_tokens":0,"output_tokens":{}}}"#,
            i % 8,
            i % 10,
            100 + i,
            i % 500
        )
        .expect("write to a String");
    }
    s.push(']');
    s.into_bytes()
}

/// Posts one batch on a new HTTP/1.0 connection and checks for 200.
pub fn post_once(addr: SocketAddr, body: &[u8]) {
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
pub struct Conn {
    s: BufReader<TcpStream>,
}

impl Conn {
    /// Connects (no Nagle: a request goes out whole at once).
    pub fn open(addr: SocketAddr) -> Conn {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        s.set_nodelay(true).expect("nodelay");
        Conn {
            s: BufReader::new(s),
        }
    }

    /// Posts one batch and reads the whole answer; panics unless it is 200.
    pub fn post(&mut self, body: &[u8]) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_body_parses_as_the_server_parses_it() {
        for random in [false, true] {
            let now_ms = 1_700_000_000_000;
            let body = batch_body(7, 25, random, now_ms - 1_000);
            let limits = crate::event::Limits::default();
            let events =
                crate::wire::parse_batch(&body, now_ms, &limits, 1_000).expect("a valid batch");
            assert_eq!(events.len(), 25);
            let mut ids: Vec<_> = events.iter().map(|e| e.request_id.clone()).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), 25, "ids are distinct");
        }
        assert_ne!(batch_body(1, 3, true, 0), batch_body(2, 3, true, 0));
    }

    #[test]
    fn cpu_and_memory_are_read_for_this_process() {
        if cfg!(target_os = "linux") {
            assert!(cpu_seconds(std::process::id()).is_some());
            assert!(peak_rss_bytes(std::process::id()).is_some_and(|b| b > 0));
        }
    }
}
