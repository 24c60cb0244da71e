//! The README's main job: `bursar-allocator local` starts a real allocator, three
//! agents with durable usage outboxes and a three-node ledger cluster, drives traffic,
//! and checks overshoot against its bound and that every acknowledged completion is
//! in every ledger exactly once. Runs the real binaries (built by
//! `cargo test --workspace`, which builds every binary of the workspace).

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::sibling_bin;

#[test]
fn the_main_job_runs_a_cluster_with_ledgers_and_stays_within_bounds() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_bursar-allocator"))
        .args(["local", "--duration-s", "6", "--rps", "150"])
        .arg("--agent-bin")
        .arg(sibling_bin("bursar-agent"))
        .arg("--ledger-bin")
        .arg(sibling_bin("bursar-ledger"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read on threads (a full pipe would stall the run) and waited for with a
    // deadline: a hang fails the test with what it printed, not the whole suite.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out_t = drain(Box::new(child.stdout.take().unwrap()));
    let err_t = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = out_t.join().unwrap();
    let stderr = err_t.join().unwrap();
    let status = status
        .unwrap_or_else(|| panic!("no exit within 180 s\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    assert!(status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("no key overshot beyond its bound"),
        "{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("ledger: all 3 nodes hold the same "))
        .unwrap_or_else(|| panic!("no ledger verdict in:\n{stdout}"));
    let n: u64 = line
        .trim_start_matches("ledger: all 3 nodes hold the same ")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n > 100, "too few completions to mean anything: {line}");
    let admitted: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("done: "))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no done line in:\n{stdout}"));
    assert_eq!(
        n, admitted,
        "every admitted request was completed and billed once"
    );
}
