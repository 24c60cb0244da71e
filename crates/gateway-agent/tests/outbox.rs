//! The durable usage outbox against real processes: real `bursar-ledger` binaries and
//! real `bursar-agent` binaries on loopback, completions through the agent's HTTP API,
//! and the ledgers' own export to see what arrived.
//!
//! The ledger binary is the one cargo built beside the agent (`target/*/bursar-ledger`);
//! if it is missing the test builds it with `cargo build -p bursar-ledger`. Set
//! `BURSAR_LEDGER_BIN` to use another.
//!
//! Run with `--nocapture` to see the counts each test prints.

mod common;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

const RULES: &str = r#"
[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 10000000
per = "minute"

[[rule]]
name = "model-tpm"
match = { org = "*", model = "*" }
dimension = "input_tokens"
rate = 100000000000
per = "minute"
"#;

/// A temporary directory, removed when dropped (the tests used to leave theirs in
/// /tmp); derefs to its path.
struct TempDir(tempfile::TempDir);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<std::ffi::OsStr> for TempDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.path().as_os_str()
    }
}

fn tempdir(name: &str) -> TempDir {
    TempDir(
        tempfile::Builder::new()
            .prefix(&format!("bursar-outbox-it-{name}-"))
            .tempdir()
            .expect("temp dir"),
    )
}

fn ledger_bin() -> PathBuf {
    if let Ok(p) = std::env::var("BURSAR_LEDGER_BIN") {
        return PathBuf::from(p);
    }
    let bin = Path::new(env!("CARGO_BIN_EXE_bursar-agent")).with_file_name("bursar-ledger");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = Command::new(cargo)
            .args(["build", "-p", "bursar-ledger", "--bin", "bursar-ledger"])
            .status()
            .expect("run cargo build -p bursar-ledger");
        assert!(st.success(), "cargo build -p bursar-ledger failed");
    }
    assert!(bin.exists(), "no ledger binary at {}", bin.display());
    bin
}

/// A real ledger process on loopback; SIGKILLed on drop.
struct Ledger {
    child: Option<Child>,
    addr: SocketAddr,
    dir: PathBuf,
    node_id: String,
    /// More flags, kept for restarts.
    extra: Vec<String>,
    /// The data directory's owner, when the ledger made it (removed on drop).
    _tmp: Option<TempDir>,
}

impl Ledger {
    fn start(node_id: &str) -> Ledger {
        Ledger::start_with(node_id, &[])
    }

    fn start_with(node_id: &str, extra: &[&str]) -> Ledger {
        let tmp = tempdir(node_id);
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut l = Ledger::start_at(&tmp, node_id, "127.0.0.1:0", &extra);
        l._tmp = Some(tmp);
        l
    }

    fn start_at(dir: &Path, node_id: &str, http: &str, extra: &[String]) -> Ledger {
        let mut child = Command::new(ledger_bin())
            .arg("--data-dir")
            .arg(dir)
            .args(["--node-id", node_id, "--http", http])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bursar-ledger");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the ledger's stdout");
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("bursar-ledger did not start: {line:?}"))
            .parse()
            .expect("address");
        Ledger {
            child: Some(child),
            addr,
            dir: dir.to_path_buf(),
            node_id: node_id.to_string(),
            extra: extra.to_vec(),
            _tmp: None,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Restarts on the same data dir and the same port (the agent knows this URL).
    fn restart(&mut self) {
        self.kill9();
        let http = self.addr.to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // The port may linger briefly after the kill.
            let r = std::panic::catch_unwind(|| {
                Ledger::start_at(&self.dir, &self.node_id, &http, &self.extra)
            });
            match r {
                Ok(mut l) => {
                    self.child = l.child.take();
                    return;
                }
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                Err(_) => panic!("the ledger did not restart on {http}"),
            }
        }
    }

    /// Loses every byte of its data (the whole data dir, marker included, as a
    /// replaced disk would) and starts empty under the same node id and port.
    fn wipe_and_restart(&mut self) {
        self.kill9();
        std::fs::remove_dir_all(&self.dir).expect("wipe the data dir");
        std::fs::create_dir(&self.dir).expect("recreate the data dir");
        self.restart();
    }

    /// Every event the ledger holds, as exported (all pages).
    fn export(&self) -> Vec<Value> {
        let h = now_ms() / 3_600_000;
        let (from, to) = ((h - 3) * 3_600_000, (h + 2) * 3_600_000);
        let mut out = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut path = format!("/v1/export?from={from}&to={to}&limit=5000");
            if let Some(a) = &after {
                path.push_str(&format!("&after={a}"));
            }
            let r = try_request(self.addr, "GET", &path, b"").expect("export");
            assert_eq!(r.status, 200, "{}", r.body);
            for line in r.body.lines() {
                out.push(serde_json::from_str(line).expect("a JSON line"));
            }
            match r.header("x-bursar-next-after") {
                Some(n) => after = Some(n.to_string()),
                None => return out,
            }
        }
    }

    fn events(&self) -> u64 {
        let r = try_request(self.addr, "GET", "/v1/digest", b"").expect("digest");
        r.json()["root"]["events"].as_u64().expect("root events")
    }

    fn metric(&self, prefix: &str) -> u64 {
        let r = try_request(self.addr, "GET", "/metrics", b"").expect("metrics");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("ledger metric {prefix:?} missing"))
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A real agent process with a durable outbox; SIGKILLed on drop.
struct AgentProc {
    child: Option<Child>,
    http: SocketAddr,
    config: PathBuf,
}

impl AgentProc {
    fn start(outbox: &Path, ledgers: &[String], extra: &[&str]) -> AgentProc {
        let config = outbox.join("rules.toml");
        std::fs::write(&config, RULES).expect("write rules");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_bursar-agent"));
        cmd.arg("--config")
            .arg(&config)
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
            .arg("--outbox-dir")
            .arg(outbox)
            .args([
                "--agent-id",
                "agent-under-test",
                "--ledger-backoff-max-ms",
                "500",
            ]);
        for l in ledgers {
            cmd.args(["--ledger", l]);
        }
        let mut child = cmd
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn bursar-agent");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the agent's stdout");
        let http = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("http="))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("the agent did not start: {line:?}"));
        AgentProc {
            child: Some(child),
            http,
            config,
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn metric(&self, prefix: &str) -> u64 {
        self.try_metric(prefix)
            .unwrap_or_else(|| panic!("agent metric {prefix:?} missing"))
    }

    /// The metric, `None` while it is not shown yet (a ledger's rows appear once its
    /// forwarder has started).
    fn try_metric(&self, prefix: &str) -> Option<u64> {
        let r = try_request(self.http, "GET", "/metrics", b"").expect("metrics");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
    }

    fn pending(&self) -> u64 {
        self.metric("bursar_outbox_pending_events ")
    }

    /// Admits and completes one request; `Some(status)` of the completion, `None` if
    /// the admission failed or the agent did not answer.
    fn admit_complete(&self, id: &str, org: &str, input: u64, output: u64) -> Option<Resp> {
        let a = try_request(
            self.http,
            "POST",
            "/v1/admit",
            json!({"request_id": id, "descriptors": {"org": org, "model": "m1"},
                   "cost": {"requests": 1, "input_tokens": input, "output_tokens": output}})
            .to_string()
            .as_bytes(),
        )?;
        assert_eq!(a.status, 200, "admit: {}", a.body);
        try_request(
            self.http,
            "POST",
            "/v1/complete",
            json!({"request_id": id, "usage": {"input_tokens": input, "output_tokens": output}})
                .to_string()
                .as_bytes(),
        )
    }
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_file(&self.config);
    }
}

use common::Resp;

/// One HTTP/1.1 request; `None` if the connection failed or broke (a killed process).
fn try_request(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Option<Resp> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    // Chunked bodies (export) are de-chunked; the agent's are plain.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Some(Resp {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Request id -> how many times it is in the export, and (origin, seq) pairs seen.
fn tally(events: &[Value]) -> (HashMap<String, u32>, HashMap<(String, u64), u32>) {
    let mut ids = HashMap::new();
    let mut seqs = HashMap::new();
    for e in events {
        *ids.entry(e["request_id"].as_str().expect("request_id").to_string())
            .or_insert(0) += 1;
        *seqs
            .entry((
                e["origin"].as_str().expect("origin").to_string(),
                e["seq"].as_u64().expect("seq"),
            ))
            .or_insert(0) += 1;
    }
    (ids, seqs)
}

#[test]
fn completions_reach_both_ledgers_exactly_once_and_catch_up_after_an_outage() {
    let a = Ledger::start("ledger-a");
    let mut b = Ledger::start("ledger-b");
    let outbox = tempdir("agent");
    let agent = AgentProc::start(&outbox, &[a.url(), b.url()], &[]);

    // Phase 1: both ledgers up.
    let mut sent: HashMap<String, (u64, u64)> = HashMap::new();
    for i in 0..300u64 {
        let id = format!("p1-{i}");
        let (input, output) = (100 + i, 7 + i % 13);
        let r = agent
            .admit_complete(&id, "acme", input, output)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["result"], "settled");
        if i < 20 {
            // Answered only after its record reached the file.
            assert!(agent.metric("bursar_outbox_events_total{kind=\"committed\"} ") > i);
        }
        sent.insert(id, (input, output));
    }
    wait_until("delivery to both ledgers", Duration::from_secs(30), || {
        agent.pending() == 0
    });
    assert_eq!(a.events(), 300);
    assert_eq!(b.events(), 300);

    // Phase 2: ledger b down; completions go on and are held for it.
    b.kill9();
    for i in 0..300u64 {
        let id = format!("p2-{i}");
        let (input, output) = (200 + i, 3 + i % 5);
        let r = agent
            .admit_complete(&id, "acme", input, output)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
        sent.insert(id, (input, output));
    }
    wait_until("ledger a to take phase 2", Duration::from_secs(30), || {
        a.events() == 600
    });
    let held = agent.pending();
    assert_eq!(
        held, 300,
        "one ledger of two acknowledged phase 2: every event is still held"
    );
    let failures_during_outage = agent.metric(&format!(
        "bursar_ledger_failures_total{{ledger=\"{}\"}} ",
        b.url()
    ));
    assert!(failures_during_outage > 0);

    // Phase 3: ledger b is back on the same port and data; delivery catches up.
    let t = Instant::now();
    b.restart();
    wait_until("ledger b to catch up", Duration::from_secs(60), || {
        agent.pending() == 0
    });
    let catch_up = t.elapsed();

    for (name, l) in [("a", &a), ("b", &b)] {
        let events = l.export();
        let (ids, seqs) = tally(&events);
        let missing = sent.keys().filter(|id| !ids.contains_key(*id)).count();
        let duplicated = ids.values().filter(|&&n| n > 1).count();
        let phantom = ids.keys().filter(|id| !sent.contains_key(*id)).count();
        println!(
            "ledger {name}: sent={} present={} missing={missing} duplicated={duplicated} \
             phantom={phantom} distinct_seqs={} duplicate_events_received={}",
            sent.len(),
            ids.len(),
            seqs.len(),
            l.metric(&format!(
                "bursar_ledger_events_duplicate_total{{node=\"{}\"}} ",
                l.node_id
            ))
        );
        assert_eq!((missing, duplicated, phantom), (0, 0, 0));
        assert_eq!(seqs.len(), sent.len(), "every event has its own seq");
        for e in &events {
            let id = e["request_id"].as_str().unwrap();
            let (input, output) = sent[id];
            assert_eq!(e["input_tokens"].as_u64(), Some(input), "{e}");
            assert_eq!(e["output_tokens"].as_u64(), Some(output), "{e}");
            assert_eq!(e["tenant"], "acme");
            assert_eq!(e["model"], "m1");
            assert_eq!(e["origin"], "agent-under-test");
            assert_eq!(e["status"], "ok");
        }
    }
    println!(
        "outage: held {held} events for ledger b; caught up {:?} after its restart",
        catch_up
    );
}

#[test]
fn acknowledged_completions_survive_kill_9_of_the_agent() {
    const CYCLES: usize = 3;
    const CLIENTS: usize = 3;
    let a = Ledger::start("ledger-a");
    let b = Ledger::start("ledger-b");
    let ledgers = [a.url(), b.url()];
    let outbox = tempdir("crash");
    let attempted = Arc::new(Mutex::new(HashSet::<String>::new()));
    let acked = Arc::new(Mutex::new(HashSet::<String>::new()));
    let mut indeterminate = 0usize;
    for cycle in 0..CYCLES {
        let mut agent = AgentProc::start(&outbox, &ledgers, &[]);
        let addr = agent.http;
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let (attempted, acked, stop) = (
                Arc::clone(&attempted),
                Arc::clone(&acked),
                Arc::clone(&stop),
            );
            clients.push(std::thread::spawn(move || {
                let probe = AgentProc {
                    child: None,
                    http: addr,
                    config: PathBuf::from("/nonexistent"),
                };
                let mut lost_answers = 0;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let id = format!("c{cycle}-t{c}-{i}");
                    i += 1;
                    attempted.lock().unwrap().insert(id.clone());
                    match probe.admit_complete(&id, "crashco", 10 + i % 90, i % 40) {
                        Some(r) if r.status == 200 => {
                            acked.lock().unwrap().insert(id);
                        }
                        Some(r) => panic!("completion answered {}: {}", r.status, r.body),
                        None => {
                            lost_answers += 1;
                            break; // the agent died
                        }
                    }
                }
                lost_answers
            }));
        }
        // Let the clients run, then kill -9 the agent mid-traffic.
        std::thread::sleep(Duration::from_millis(1500));
        agent.kill9();
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            indeterminate += c.join().expect("client thread");
        }
    }
    // The last restart delivers whatever the killed agents had not.
    let agent = AgentProc::start(&outbox, &ledgers, &[]);
    wait_until(
        "delivery after the last restart",
        Duration::from_secs(60),
        || agent.pending() == 0,
    );
    let attempted = attempted.lock().unwrap().clone();
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() > 100,
        "the clients made progress: {}",
        acked.len()
    );
    for (name, l) in [("a", &a), ("b", &b)] {
        let events = l.export();
        let (ids, seqs) = tally(&events);
        let lost = acked.iter().filter(|id| !ids.contains_key(*id)).count();
        let duplicated = ids.values().filter(|&&n| n > 1).count();
        let phantom = ids.keys().filter(|id| !attempted.contains(*id)).count();
        let seq_reused = seqs.values().filter(|&&n| n > 1).count();
        println!(
            "agent crash test, ledger {name}: cycles={CYCLES} attempted={} acknowledged={} \
             indeterminate_at_kill={indeterminate} present={} lost={lost} \
             duplicated={duplicated} phantom={phantom} seq_reused={seq_reused} \
             resent_after_restart={}",
            attempted.len(),
            acked.len(),
            ids.len(),
            l.metric(&format!(
                "bursar_ledger_events_duplicate_total{{node=\"{}\"}} ",
                l.node_id
            ))
        );
        assert_eq!(lost, 0, "an acknowledged completion is missing");
        assert_eq!(duplicated, 0);
        assert_eq!(phantom, 0);
        assert_eq!(seq_reused, 0, "the durable seq counter went back");
    }
}

#[test]
fn a_full_outbox_answers_503_and_leaves_the_lease_live() {
    // A ledger URL where nothing listens: nothing is ever delivered.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let outbox = tempdir("full");
    let agent = AgentProc::start(
        &outbox,
        &[format!("http://{dead}")],
        &["--outbox-events-max", "20", "--outbox-queue-max", "16"],
    );
    // Admitted while there is room; completed once there is none.
    let admit = |id: &str| {
        try_request(
            agent.http,
            "POST",
            "/v1/admit",
            json!({"request_id": id, "descriptors": {"org": "acme", "model": "m1"},
                   "cost": {"requests": 1, "input_tokens": 10, "output_tokens": 1}})
            .to_string()
            .as_bytes(),
        )
        .expect("answer")
    };
    assert_eq!(admit("f-early").status, 200);
    for i in 0..20 {
        let r = agent
            .admit_complete(&format!("f{i}"), "acme", 10, 1)
            .expect("answer");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(agent.pending(), 20);
    // A new admission is refused before it takes a lease.
    let r = admit("f-over");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "outbox_full");
    assert_eq!(r.header("retry-after"), Some("1"));
    // The earlier one's completion is refused and changes nothing: its lease is still
    // live and completes once there is room.
    let r = try_request(
        agent.http,
        "POST",
        "/v1/complete",
        json!({"request_id": "f-early", "usage": {"input_tokens": 10, "output_tokens": 1}})
            .to_string()
            .as_bytes(),
    )
    .expect("answer");
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.json()["error"], "outbox_full");
    assert_eq!(agent.metric("bursar_leases_in_flight "), 1);
    assert_eq!(
        agent.metric("bursar_outbox_refused_total{reason=\"full\"} "),
        2
    );
    assert_eq!(
        agent.metric("bursar_outbox_events_total{kind=\"dropped\"} "),
        0
    );
}

/// Runs an agent on `outbox` (its rules written to `rules_file` there) that is expected
/// to refuse to start; returns how it ended.
fn start_expecting_refusal(outbox: &Path, rules_file: &str) -> std::process::Output {
    let config = outbox.join(rules_file);
    std::fs::write(&config, RULES).unwrap();
    Command::new(env!("CARGO_BIN_EXE_bursar-agent"))
        .arg("--config")
        .arg(&config)
        .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .arg("--outbox-dir")
        .arg(outbox)
        .args(["--ledger", "http://127.0.0.1:9"])
        .output()
        .expect("run bursar-agent")
}

#[test]
fn a_corrupt_outbox_file_stops_the_start_with_a_clear_error() {
    let outbox = tempdir("corrupt");
    std::fs::write(outbox.join("outbox.redb"), vec![0x5Au8; 16384]).unwrap();
    let out = start_expecting_refusal(&outbox, "rules.toml");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started over a corrupt outbox");
    assert!(
        stderr.contains("outbox.redb") && stderr.contains("corrupt or not a redb database"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing was served");
    // The file was left as it was.
    assert_eq!(
        std::fs::read(outbox.join("outbox.redb")).unwrap(),
        vec![0x5Au8; 16384]
    );
}

#[test]
fn a_late_completion_corrects_the_expired_event_to_the_actual_usage_in_the_ledger() {
    let a = Ledger::start("ledger-a");
    let outbox = tempdir("late");
    let agent = AgentProc::start(&outbox, &[a.url()], &[]);
    let r = try_request(
        agent.http,
        "POST",
        "/v1/admit",
        json!({"request_id": "slow-1", "descriptors": {"org": "lateco", "model": "m1"},
               "cost": {"requests": 1, "input_tokens": 500, "output_tokens": 100},
               "ttl_ms": 100})
        .to_string()
        .as_bytes(),
    )
    .expect("admit");
    assert_eq!(r.status, 200, "{}", r.body);
    // The maintenance ticker (every 100 ms) expires the lease.
    wait_until("the lease to expire", Duration::from_secs(10), || {
        agent.metric("bursar_leases_in_flight ") == 0
    });
    let r = try_request(
        agent.http,
        "POST",
        "/v1/complete",
        json!({"request_id": "slow-1",
               "usage": {"input_tokens": 480, "cached_input_tokens": 80, "output_tokens": 60}})
        .to_string()
        .as_bytes(),
    )
    .expect("complete");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["result"], "late");
    wait_until("delivery", Duration::from_secs(30), || agent.pending() == 0);
    let events = a.export();
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0]["status"], "expired");
    assert_eq!(events[0]["input_tokens"], 500);
    assert_eq!(events[1]["kind"], "adjust");
    assert_eq!(events[1]["request_id"], "slow-1#late-completion");
    let h = now_ms() / 3_600_000;
    let r = try_request(
        a.addr,
        "GET",
        &format!(
            "/v1/usage?tenant=lateco&from={}&to={}",
            (h - 3) * 3_600_000,
            (h + 2) * 3_600_000
        ),
        b"",
    )
    .expect("usage");
    let u = r.json();
    println!(
        "ledger totals after expiry + late completion: {}",
        u["total"]
    );
    assert_eq!(
        u["total"],
        json!({"requests": 1, "input_tokens": 480, "cached_input_tokens": 80, "output_tokens": 60})
    );
    assert_eq!(u["adjusted"], 1);
    assert_eq!(u["unresolved_corrections"], 0);
}

/// Throughput of durable completions, beside the same agent without an outbox; every
/// completion acknowledged with the outbox must reach both ledgers exactly once. The
/// suite runs it for 1 s per configuration (debug binaries: the figures mean little,
/// the delivery check holds). For figures, point it at release binaries and run longer:
///
/// ```sh
/// cargo build --release -p bursar-agent -p bursar-ledger
/// BURSAR_BENCH_SECONDS=4 BURSAR_AGENT_BIN=target/release/bursar-agent \
///   BURSAR_LEDGER_BIN=target/release/bursar-ledger \
///   cargo test -p bursar-agent --test outbox durable_completion_throughput -- --nocapture
/// ```
#[test]
fn durable_completion_throughput() {
    let seconds: u64 = std::env::var("BURSAR_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut acknowledged_with_outbox = 0u64;
    let agent_bin = std::env::var("BURSAR_AGENT_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_bursar-agent").to_string());
    let a = Ledger::start("ledger-a");
    let b = Ledger::start("ledger-b");
    for clients in [1usize, 8, 32] {
        for with_outbox in [false, true] {
            let outbox = tempdir("bench");
            let config = outbox.join("rules.toml");
            std::fs::write(&config, RULES).unwrap();
            let mut cmd = Command::new(&agent_bin);
            cmd.arg("--config").arg(&config).args([
                "--http",
                "127.0.0.1:0",
                "--grpc",
                "127.0.0.1:0",
            ]);
            if with_outbox {
                cmd.arg("--outbox-dir").arg(&outbox).args([
                    "--ledger",
                    &a.url(),
                    "--ledger",
                    &b.url(),
                ]);
            }
            let mut child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawn");
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap())
                .read_line(&mut line)
                .unwrap();
            let http: SocketAddr = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("http="))
                .and_then(|a| a.parse().ok())
                .expect("http address");
            let agent = AgentProc {
                child: Some(child),
                http,
                config,
            };
            let stop = Arc::new(AtomicBool::new(false));
            let mut threads = Vec::new();
            for c in 0..clients {
                let stop = Arc::clone(&stop);
                let tag = format!("{with_outbox}-{clients}-{c}");
                threads.push(std::thread::spawn(move || {
                    let probe = AgentProc {
                        child: None,
                        http,
                        config: PathBuf::from("/nonexistent"),
                    };
                    let mut lat = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let id = format!("b-{tag}-{i}");
                        i += 1;
                        let a = try_request(
                            http,
                            "POST",
                            "/v1/admit",
                            json!({"request_id": id, "descriptors": {"org": "bench", "model": "m"},
                                   "cost": {"requests": 1, "input_tokens": 10, "output_tokens": 5}})
                            .to_string()
                            .as_bytes(),
                        )
                        .expect("admit");
                        assert_eq!(a.status, 200);
                        let t = Instant::now();
                        let r = try_request(
                            http,
                            "POST",
                            "/v1/complete",
                            json!({"request_id": id, "usage": {"input_tokens": 10, "output_tokens": 3}})
                                .to_string()
                                .as_bytes(),
                        )
                        .expect("complete");
                        lat.push(t.elapsed());
                        assert_eq!(r.status, 200, "{}", r.body);
                    }
                    drop(probe);
                    lat
                }));
            }
            std::thread::sleep(Duration::from_secs(seconds));
            stop.store(true, Ordering::Relaxed);
            let mut lat: Vec<Duration> = threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect();
            lat.sort();
            let n = lat.len();
            if with_outbox {
                acknowledged_with_outbox += n as u64;
            }
            let pct = |p: f64| lat[((n as f64 * p) as usize).min(n - 1)].as_secs_f64() * 1e3;
            let commits = if with_outbox {
                wait_until("delivery", Duration::from_secs(120), || {
                    agent.pending() == 0
                });
                agent.metric("bursar_outbox_commits_total{result=\"ok\"} ")
            } else {
                0
            };
            println!(
                "outbox={with_outbox:<5} clients={clients:>2} completions/s={:>7.0} \
                 complete p50={:.3} ms p99={:.3} ms commits={commits}",
                n as f64 / seconds as f64,
                pct(0.5),
                pct(0.99)
            );
        }
    }
    // Every completion acknowledged with the outbox reached both ledgers, once.
    assert!(acknowledged_with_outbox > 0);
    assert_eq!(a.events(), acknowledged_with_outbox);
    assert_eq!(b.events(), acknowledged_with_outbox);
}

#[test]
fn a_second_agent_on_the_same_outbox_is_refused_with_a_clear_error() {
    let outbox = tempdir("busy");
    let first = AgentProc::start(&outbox, &["http://127.0.0.1:9".to_string()], &[]);
    let out = start_expecting_refusal(&outbox, "second.toml");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "two agents shared one outbox");
    assert!(stderr.contains("another process holds it open"), "{stderr}");
    // The first one is unaffected.
    let r = first
        .admit_complete("still-fine", "acme", 1, 1)
        .expect("answer");
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn with_three_ledgers_an_event_is_trimmed_once_two_hold_it() {
    let a = Ledger::start("ledger-a");
    let b = Ledger::start("ledger-b");
    let mut c = Ledger::start("ledger-c");
    let outbox = tempdir("three");
    let agent = AgentProc::start(&outbox, &[a.url(), b.url(), c.url()], &[]);
    c.kill9();
    for i in 0..100 {
        let r = agent
            .admit_complete(&format!("t3-{i}"), "acme", 10, 1)
            .expect("answer");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Two of three acknowledged: nothing is held for the third.
    wait_until(
        "trim after two acknowledgements",
        Duration::from_secs(30),
        || agent.pending() == 0,
    );
    assert_eq!(a.events(), 100);
    assert_eq!(b.events(), 100);
    assert_eq!(
        agent.metric(&format!("bursar_ledger_up{{ledger=\"{}\"}} ", c.url())),
        0
    );
    assert_eq!(
        agent.metric("bursar_outbox_events_total{kind=\"trimmed\"} "),
        100
    );
}

/// A stand-in for a load balancer in front of ledger `a` whose `/healthz` was answered
/// by another node (`b`): it says `b` at `/healthz` and sends every POST to `a`.
fn misrouting_balancer(a_url: String) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let client = reqwest::Client::new();
            let app = axum::Router::new()
                .route(
                    "/healthz",
                    axum::routing::get(|| async {
                        (
                            [("content-type", "application/json")],
                            json!({"status": "ok", "node_id": "ledger-b"}).to_string(),
                        )
                    }),
                )
                .route(
                    "/v1/events",
                    axum::routing::post(move |body: axum::body::Bytes| {
                        let (client, a_url) = (client.clone(), a_url.clone());
                        async move {
                            let r = client
                                .post(format!("{a_url}/v1/events"))
                                .header("content-type", "application/json")
                                .body(body)
                                .send()
                                .await
                                .expect("ledger a");
                            let status = r.status().as_u16();
                            let text = r.text().await.expect("answer");
                            (
                                axum::http::StatusCode::from_u16(status).unwrap(),
                                [("content-type", "application/json")],
                                text,
                            )
                        }
                    }),
                );
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    format!("http://{}", rx.recv().expect("balancer address"))
}

/// Regression (review, twenty-fifth session): the forwarder credited every answer to
/// the node id it learned at `/healthz`. Behind a balancer that sent the POSTs
/// elsewhere, one node held the events while two ids were credited, and the outbox
/// deleted them. It now credits the node that answered (the answer's `node_id`).
#[test]
fn events_are_credited_to_the_node_that_answered_not_the_one_learned() {
    let a = Ledger::start("ledger-a");
    let balancer = misrouting_balancer(a.url());
    let outbox = tempdir("agent-balanced");
    let agent = AgentProc::start(&outbox, &[balancer.clone(), a.url()], &[]);
    for i in 0..50u64 {
        let r = agent
            .admit_complete(&format!("lb-{i}"), "acme", 10, 1)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    wait_until(
        "ledger a to hold every event",
        Duration::from_secs(30),
        || a.events() == 50,
    );
    // Both forwarders at the end of the outbox: each has been answered for it (both by
    // ledger a, as it happens).
    wait_until(
        "both forwarders to be answered",
        Duration::from_secs(30),
        || {
            let cursor =
                |url: &str| agent.metric(&format!("bursar_ledger_cursor{{ledger=\"{url}\"}} "));
            cursor(&balancer) == 50 && cursor(&a.url()) == 50
        },
    );
    // One node holds them, whatever two URLs say: the outbox keeps every event until
    // a second node does.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(
        agent.pending(),
        50,
        "events were credited to a node that lacks them"
    );
}

/// Regression (review, twenty-fifth session's open item): the outbox credited
/// acknowledgements to a node id alone. A node that lost its data and came back empty
/// under the same id kept its old cursor, so its events were never sent to it again,
/// and one more acknowledgement elsewhere trimmed events that only one node held. The
/// ledger's answers now name its store, and a new store starts from the oldest event
/// the outbox holds.
#[test]
fn a_ledger_that_lost_its_data_gets_every_held_event_again() {
    let mut a = Ledger::start("ledger-a");
    let mut b = Ledger::start("ledger-b");
    let outbox = tempdir("agent-wiped");
    let agent = AgentProc::start(&outbox, &[a.url(), b.url()], &[]);
    b.kill9();
    for i in 0..50u64 {
        let r = agent
            .admit_complete(&format!("w-{i}"), "acme", 10, 1)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let cursor = |url: &str| agent.metric(&format!("bursar_ledger_cursor{{ledger=\"{url}\"}} "));
    wait_until(
        "ledger a to acknowledge everything",
        Duration::from_secs(30),
        || cursor(&a.url()) == 50,
    );
    assert_eq!(agent.pending(), 50, "one ledger of two holds them");

    a.wipe_and_restart();
    assert_eq!(a.events(), 0, "the wiped node starts empty");
    wait_until(
        "the wiped node to be sent every held event again",
        Duration::from_secs(30),
        || a.events() == 50,
    );
    assert_eq!(
        agent.pending(),
        50,
        "still one holder: nothing may be trimmed"
    );

    b.restart();
    wait_until("trim once both hold them", Duration::from_secs(30), || {
        agent.pending() == 0
    });
    assert_eq!((a.events(), b.events()), (50, 50));
}

/// Regression (review, twenty-eighth session): a batch the ledger refused (413 over
/// its body bound, or 400) was retried whole for ever, so delivery stopped and the
/// outbox filled. The forwarder now halves it until it fits.
#[test]
fn a_batch_over_the_ledgers_body_bound_is_split_until_it_fits() {
    let mut a = Ledger::start_with("ledger-a", &["--body-max-bytes", "16384"]);
    let outbox = tempdir("agent-small-bodies");
    let agent = AgentProc::start(&outbox, &[a.url()], &[]);
    // Held while the ledger is down, so the first batch is all 300 (~100 KB).
    a.kill9();
    for i in 0..300u64 {
        let r = agent
            .admit_complete(&format!("big-{i}"), "acme", 10, 1)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert_eq!(agent.pending(), 300);
    a.restart();
    wait_until("every event delivered", Duration::from_secs(30), || {
        agent.pending() == 0
    });
    let held = a.export();
    let ids: std::collections::HashSet<_> =
        held.iter().map(|e| e["request_id"].to_string()).collect();
    assert_eq!((held.len(), ids.len()), (300, 300), "each once");
}

/// Review, thirty-first session: an event a ledger refuses on its own (here: larger
/// than its body bound, 413 even alone) was retried forever and every event behind
/// it waited, until the outbox filled and the agent answered 503 to all work. It is
/// now set aside in the outbox's quarantine, kept for an operator, and the events
/// behind it are delivered.
#[test]
fn an_event_a_ledger_refuses_alone_is_set_aside_and_the_rest_delivered() {
    let a = Ledger::start_with("ledger-a", &["--body-max-bytes", "500"]);
    let outbox = tempdir("agent-quarantine");
    let agent = AgentProc::start(&outbox, &[a.url()], &["--outbox-quarantine-clear"]);
    let big_id = format!("big-{}", "r".repeat(120));
    let big_org = "x".repeat(250);
    for (id, org) in [
        ("ok-1", "acme"),
        (big_id.as_str(), big_org.as_str()),
        ("ok-2", "acme"),
        ("ok-3", "acme"),
    ] {
        let r = agent.admit_complete(id, org, 10, 1).expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    wait_until(
        "every event delivered or set aside",
        Duration::from_secs(30),
        || agent.pending() == 0,
    );
    let held = a.export();
    let mut ids: Vec<String> = held
        .iter()
        .map(|e| e["request_id"].as_str().unwrap_or_default().to_string())
        .collect();
    ids.sort();
    assert_eq!(ids, ["ok-1", "ok-2", "ok-3"]);
    assert_eq!(agent.metric("bursar_outbox_quarantined_events "), 1);
    let q = try_request(agent.http, "GET", "/v1/outbox/quarantine", b"").expect("list");
    assert_eq!(q.status, 200, "{}", q.body);
    let lines: Vec<Value> = q
        .body
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 1, "{}", q.body);
    assert_eq!(lines[0]["event"]["request_id"], big_id.as_str());
    assert_eq!(lines[0]["event"]["tenant"], big_org.as_str());
    assert!(
        lines[0]["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("413"),
        "{}",
        lines[0]
    );
    let seq = lines[0]["seq"].as_u64().expect("seq");
    // Clearing needs a bound, and takes only what it names.
    let r = try_request(agent.http, "DELETE", "/v1/outbox/quarantine", b"").expect("clear");
    assert_eq!(r.status, 400, "{}", r.body);
    let path = format!("/v1/outbox/quarantine?through_seq={}", seq - 1);
    let r = try_request(agent.http, "DELETE", &path, b"").expect("clear");
    assert_eq!(
        (r.status, r.body.contains("\"removed\":0")),
        (200, true),
        "{}",
        r.body
    );
    let path = format!("/v1/outbox/quarantine?through_seq={seq}");
    let r = try_request(agent.http, "DELETE", &path, b"").expect("clear");
    assert_eq!(
        (r.status, r.body.contains("\"removed\":1")),
        (200, true),
        "{}",
        r.body
    );
    assert_eq!(agent.metric("bursar_outbox_quarantined_events "), 0);
}

/// Review, thirty-first session: the ledger's `conflict` count (an event under a
/// request id it already held with another payload: billing counts one of the two)
/// was credited with no signal on the agent. Two agents bill the same id here.
#[test]
fn a_conflict_the_ledger_reports_is_counted_on_the_agent() {
    let a = Ledger::start("ledger-a");
    let (o1, o2) = (tempdir("agent-conflict-1"), tempdir("agent-conflict-2"));
    let one = AgentProc::start(&o1, &[a.url()], &[]);
    let r = one.admit_complete("dup", "acme", 10, 1).expect("complete");
    assert_eq!(r.status, 200, "{}", r.body);
    wait_until("delivered", Duration::from_secs(30), || one.pending() == 0);
    let two = AgentProc::start(&o2, &[a.url()], &[]);
    let r = two.admit_complete("dup", "acme", 20, 1).expect("complete");
    assert_eq!(r.status, 200, "{}", r.body);
    wait_until("delivered", Duration::from_secs(30), || two.pending() == 0);
    let metric = format!("bursar_ledger_conflicts_total{{ledger=\"{}\"}} ", a.url());
    assert_eq!(two.metric(&metric), 1);
    assert_eq!(one.metric(&metric), 0);
    // Without --outbox-quarantine-clear, the quarantine is not cleared over HTTP.
    let r = try_request(
        one.http,
        "DELETE",
        "/v1/outbox/quarantine?through_seq=9",
        b"",
    )
    .expect("answer");
    assert_eq!(r.status, 403, "{}", r.body);
}

/// Review, thirty-first session: a ledger's answers were read whole (`text()`), so a
/// wrong `--ledger` URL or a misbehaving endpoint could make the agent buffer without
/// bound, for as long as the 30 s request timeout. An answer is now read up to 64 KiB.
#[test]
fn an_endless_answer_from_a_ledger_url_is_cut_off() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&served);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            flag.store(true, Ordering::Relaxed);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = c.read(&mut buf);
                let _ = c.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                      transfer-encoding: chunked\r\n\r\n",
                );
                let chunk = format!("{:x}\r\n{}\r\n", 16 * 1024, " ".repeat(16 * 1024));
                // Endless, until the agent hangs up.
                while c.write_all(chunk.as_bytes()).is_ok() {}
            });
        }
    });
    let outbox = tempdir("agent-endless-answer");
    let agent = AgentProc::start(&outbox, std::slice::from_ref(&url), &[]);
    let metric = format!("bursar_ledger_failures_total{{ledger=\"{url}\"}} ");
    // Each attempt gives up after 64 KiB: failures count well before the 30 s timeout.
    wait_until("failed attempts", Duration::from_secs(10), || {
        agent.try_metric(&metric).is_some_and(|n| n >= 2)
    });
    assert!(served.load(Ordering::Relaxed));
}

/// Regression (review, twenty-eighth session): one URL given twice counted as two of
/// the holders an event needs while one node answered both: nothing was ever trimmed.
#[test]
fn the_same_ledger_url_twice_is_refused_at_start() {
    let outbox = tempdir("agent-dup-ledger");
    let config = outbox.join("rules.toml");
    std::fs::write(&config, RULES).expect("write rules");
    let out = Command::new(env!("CARGO_BIN_EXE_bursar-agent"))
        .arg("--config")
        .arg(&config)
        .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .arg("--outbox-dir")
        .arg(&*outbox)
        .args([
            "--ledger",
            "http://127.0.0.1:9",
            "--ledger",
            "http://127.0.0.1:9/",
        ])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is given twice"), "{err}");
}

/// A per-request load balancer over two ledger nodes: every request (health check or
/// POST) goes to the next node in turn. Counts the POSTs.
fn round_robin_balancer(
    urls: Vec<String>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let posts = std::sync::Arc::new(AtomicU64::new(0));
    let counted = posts.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let client = reqwest::Client::new();
            let next = std::sync::Arc::new(AtomicU64::new(0));
            let app = axum::Router::new().fallback(
                move |method: axum::http::Method, uri: axum::http::Uri, body: axum::body::Bytes| {
                    let (client, urls, next, posts) =
                        (client.clone(), urls.clone(), next.clone(), counted.clone());
                    async move {
                        let i = next.fetch_add(1, Ordering::Relaxed) as usize % urls.len();
                        if method == axum::http::Method::POST {
                            posts.fetch_add(1, Ordering::Relaxed);
                        }
                        let r = client
                            .request(method, format!("{}{}", urls[i], uri))
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await
                            .expect("ledger");
                        let status = r.status().as_u16();
                        let text = r.text().await.expect("answer");
                        (
                            axum::http::StatusCode::from_u16(status).unwrap(),
                            [("content-type", "application/json")],
                            text,
                        )
                    }
                },
            );
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    (format!("http://{}", rx.recv().expect("address")), posts)
}

/// Regression (review, twenty-eighth session): behind a balancer that alternates
/// between nodes, every answer came from another node than the one learned, nothing
/// was ever credited, and the forwarder POSTed back to back with no pause. A node
/// that already held everything before the batch is now credited with it.
#[test]
fn a_round_robin_balancer_over_two_nodes_still_gets_every_event_delivered() {
    let a = Ledger::start("ledger-a");
    let b = Ledger::start("ledger-b");
    let (balancer, posts) = round_robin_balancer(vec![a.url(), b.url()]);
    let outbox = tempdir("agent-round-robin");
    let agent = AgentProc::start(&outbox, &[balancer], &[]);
    for i in 0..100u64 {
        let r = agent
            .admit_complete(&format!("rr-{i}"), "acme", 10, 1)
            .expect("complete");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    wait_until("every event delivered", Duration::from_secs(30), || {
        agent.pending() == 0
    });
    let mut ids = std::collections::HashSet::new();
    for e in a.export().into_iter().chain(b.export()) {
        ids.insert(e["request_id"].to_string());
    }
    assert_eq!(ids.len(), 100, "each event is held by a node");
    let n = posts.load(std::sync::atomic::Ordering::Relaxed);
    println!("round-robin balancer: {n} POSTs for 100 events");
    assert!(n < 1_000, "{n} POSTs: the forwarder spun");
}

/// A graceful shutdown (SIGTERM, a redeploy) ended the leases in flight with no usage
/// record at all: after the restart their completions are unknown, and nothing of them
/// reached a ledger. Each is recorded as expired (its reservation charged) before the
/// outbox's last commit now.
#[test]
fn a_lease_in_flight_at_shutdown_is_recorded_as_expired() {
    use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let outbox = tempdir("shutdown");
    let mut agent = AgentProc::start(&outbox, &[format!("http://{dead}")], &[]);
    let r = try_request(
        agent.http,
        "POST",
        "/v1/admit",
        json!({"request_id": "in-flight", "descriptors": {"org": "acme", "model": "m1"},
               "cost": {"requests": 1, "input_tokens": 100, "output_tokens": 5}})
        .to_string()
        .as_bytes(),
    )
    .expect("answer");
    assert_eq!(r.status, 200, "{}", r.body);
    let mut child = agent.child.take().expect("running");
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let ob = Outbox::open(OutboxConfig::new(outbox.to_path_buf(), 1)).expect("reopen");
    let events = ob.read_after(0, 10).expect("read");
    let ours: Vec<String> = events
        .iter()
        .filter(|(_, e)| e.request_id == "in-flight")
        .map(|(_, e)| format!("{:?}", e.body))
        .collect();
    assert_eq!(ours.len(), 1, "{events:?}");
    assert!(
        ours[0].contains("Expired") && ours[0].contains("input_tokens: 100"),
        "{}",
        ours[0]
    );
    ob.close();
}
