//! The real `bursar-ledger` binary over HTTP on loopback: ingest, queries, export,
//! bad input, bounds, start-up refusal of a corrupt data file.

mod common;

use common::{HOUR_MS, Node, export_all, now_ms, usage_json, window};
use serde_json::{Value, json};

fn hour_start(t: u64) -> u64 {
    t / HOUR_MS * HOUR_MS
}

#[test]
fn posting_events_answers_new_and_duplicate_counts() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let store = node.get("/healthz").json()["store_id"].clone();
    let t = now_ms() - 1000;
    let a = usage_json("r1", "acme", "gpt-4o", t, 100, 10);
    let b = usage_json("r2", "acme", "gpt-4o", t, 200, 20);
    let c = usage_json("r3", "acme", "claude", t, 300, 30);
    let r = node.post_json("/v1/events", &json!([a, b, c]));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.json(),
        json!({"events": 3, "new": 3, "duplicate": 0, "conflict": 0, "node_id": "test-node", "store_id": store})
    );
    let d = usage_json("r4", "acme", "claude", t, 1, 1);
    let r = node.post_json("/v1/events", &json!([a, d, c, d]));
    assert_eq!(
        r.json(),
        json!({"events": 4, "new": 1, "duplicate": 3, "conflict": 0, "node_id": "test-node", "store_id": store})
    );
    let mut a2 = a.clone();
    a2["output_tokens"] = json!(11);
    let r = node.post_json("/v1/events", &json!([a2]));
    assert_eq!(r.json()["conflict"], json!(1));
    let conflicts = node.get("/v1/conflicts").json();
    assert_eq!(conflicts["conflicts"].as_array().unwrap().len(), 1);
    let r = node.post_json("/v1/events", &json!([]));
    assert_eq!(r.json()["events"], json!(0));
}

#[test]
fn usage_totals_are_exact_per_model_with_corrections_and_their_digest() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let t = now_ms() - 1000;
    let events = json!([
        usage_json("u1", "acme", "gpt-4o", t, 100, 10),
        usage_json("u2", "acme", "gpt-4o", t, 200, 20),
        usage_json("u3", "acme", "claude", t, 1000, 1),
        usage_json("other", "globex", "claude", t, 5, 5),
        {"request_id": "fix-u2", "origin": "billing", "seq": 1, "tenant": "acme",
         "time_ms": t, "kind": "adjust", "target": "u2", "output_tokens": -5},
        {"request_id": "void-u3", "origin": "billing", "seq": 2, "tenant": "acme",
         "time_ms": t, "kind": "void", "target": "u3"},
    ]);
    assert_eq!(node.post_json("/v1/events", &events).status, 200);
    let (from, to) = (hour_start(t), hour_start(t) + HOUR_MS);
    let u = node
        .get(&format!(
            "/v1/usage?tenant=acme&from={from}&to={to}&group_by=model"
        ))
        .json();
    assert_eq!(
        u["groups"],
        json!([{"model": "gpt-4o", "requests": 2, "input_tokens": 300,
                "cached_input_tokens": 0, "output_tokens": 25}])
    );
    assert_eq!(u["total"]["requests"], json!(2));
    assert_eq!(u["voided"], json!(1));
    assert_eq!(u["adjusted"], json!(1));
    assert_eq!(u["unresolved_corrections"], json!(0));
    assert_eq!(u["digest"]["events"], json!(5));
    assert_eq!(u["digest"]["corrections"], json!(2));
    let d = node
        .get(&format!("/v1/digest?tenant=acme&from={from}&to={to}"))
        .json();
    assert_eq!(d["buckets"][0]["hash"], u["digest"]["hash"]);
    assert_eq!(d["root"]["events"], json!(6));
    let ungrouped = node
        .get(&format!("/v1/usage?tenant=acme&from={from}&to={to}"))
        .json();
    assert_eq!(ungrouped["groups"][0]["model"], json!(""));
    assert_eq!(ungrouped["total"], u["total"]);
}

#[test]
fn a_35_day_old_event_lands_in_its_own_hour_and_its_resend_a_week_later_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let late = now_ms() - 35 * 24 * HOUR_MS;
    let e = usage_json("late-1", "acme", "m", late, 7, 3);
    assert_eq!(
        node.post_json("/v1/events", &json!([e])).json()["new"],
        json!(1)
    );
    // The resend (as a retry a week later would be) is a duplicate.
    let r = node.post_json(
        "/v1/events",
        &json!([e, usage_json("now-1", "acme", "m", now_ms(), 1, 1)]),
    );
    assert_eq!(r.json()["duplicate"], json!(1));
    let h = hour_start(late);
    let u = node
        .get(&format!(
            "/v1/usage?tenant=acme&from={h}&to={}",
            h + HOUR_MS
        ))
        .json();
    assert_eq!(u["total"]["requests"], json!(1));
    assert_eq!(u["total"]["input_tokens"], json!(7));
    assert_eq!(u["buckets"], json!(1));
}

fn assert_400(node: &Node, body: &[u8], want: &str) {
    let r = node.post("/v1/events", body);
    assert_eq!(r.status, 400, "{}", r.text());
    let msg = r.json()["error"].as_str().unwrap().to_string();
    assert!(msg.contains(want), "{msg:?} does not contain {want:?}");
}

#[test]
fn bad_input_gets_a_400_naming_the_problem_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let ok = usage_json("r1", "acme", "m", now_ms(), 1, 1);
    let with = |field: &str, raw: &str| {
        let mut v = ok.clone();
        v[field] = json!("PLACEHOLDER");
        format!("[{}, {}]", ok, v).replace("\"PLACEHOLDER\"", raw)
    };
    assert_400(&node, b"[{\"request_id\": ", "malformed JSON");
    assert_400(&node, b"{\"request_id\": \"x\"}", "must be a JSON array");
    let mut missing = ok.clone();
    missing.as_object_mut().unwrap().remove("tenant");
    assert_400(
        &node,
        json!([ok, missing]).to_string().as_bytes(),
        "event 1: missing field \"tenant\"",
    );
    assert_400(
        &node,
        with("input_tokens", "-3").as_bytes(),
        "-3 is negative",
    );
    assert_400(
        &node,
        with("output_tokens", "18446744073709551616").as_bytes(),
        "is not an integer in 0..=",
    );
    assert_400(
        &node,
        with("output_tokens", "99999999999999").as_bytes(),
        "is not an integer in 0..=",
    );
    assert_400(&node, with("seq", "-1").as_bytes(), "is negative");
    assert_400(
        &node,
        with("input_tokens", "1.5").as_bytes(),
        "is not an integer",
    );
    assert_400(
        &node,
        with("status", "\"great\"").as_bytes(),
        "unknown value",
    );
    assert_400(
        &node,
        with("time_ms", &(now_ms() + 48 * HOUR_MS).to_string()).as_bytes(),
        "time_ms",
    );
    assert_400(&node, with("tenant", "\"\"").as_bytes(), "length 0");
    // All or nothing: the valid first event of each refused batch was not stored.
    let d = node.get("/v1/digest").json();
    assert_eq!(d["root"]["events"], json!(0), "{d}");
    let m = node.get("/metrics").text();
    assert!(
        m.contains("bursar_ledger_requests_invalid_total{node=\"test-node\"} 11"),
        "{m}"
    );
}

#[test]
fn bad_queries_get_a_400_naming_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let h = hour_start(now_ms());
    for (path, want) in [
        (
            format!("/v1/usage?from={h}&to={}", h + HOUR_MS),
            "tenant is required",
        ),
        (
            format!("/v1/usage?tenant=a&from={}&to={}", h + 1, h + HOUR_MS),
            "whole hours",
        ),
        (format!("/v1/usage?tenant=a&from={h}&to={h}"), "before"),
        (
            format!("/v1/usage?tenant=a&from=x&to={h}"),
            "not a unix time",
        ),
        (
            format!(
                "/v1/usage?tenant=a&from={h}&to={}&group_by=key",
                h + HOUR_MS
            ),
            "group_by",
        ),
        (
            format!("/v1/export?from={h}&to={}&after=nope", h + HOUR_MS),
            "cursor",
        ),
        (
            format!("/v1/export?from={h}&to={}&limit=0", h + HOUR_MS),
            "limit=0",
        ),
        ("/v1/export".to_string(), "required"),
    ] {
        let r = node.get(&path);
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let msg = r.json()["error"].as_str().unwrap().to_string();
        assert!(msg.contains(want), "{path}: {msg:?}");
    }
}

#[test]
fn an_oversized_body_is_refused_with_413() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &["--body-max-bytes", "4096"]);
    let events: Vec<Value> = (0..100)
        .map(|i| usage_json(&format!("r{i}"), "acme", "m", now_ms(), 1, 1))
        .collect();
    let r = node.post_json("/v1/events", &json!(events));
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(node.get("/v1/digest").json()["root"]["events"], json!(0));
}

#[test]
fn an_export_pages_by_cursor_and_posts_back_to_an_identical_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let now = now_ms();
    let events: Vec<Value> = (0..250)
        .map(|i| {
            usage_json(
                &format!("r{i}"),
                ["acme", "globex"][i % 2],
                ["m1", "m2", "m3"][i % 3],
                now - (i as u64 % 30) * HOUR_MS,
                i as u64,
                1,
            )
        })
        .chain([
            json!({"request_id": "v", "origin": "b", "seq": 9, "tenant": "acme",
                       "time_ms": now, "kind": "void", "target": "r0"}),
        ])
        .collect();
    assert_eq!(node.post_json("/v1/events", &json!(events)).status, 200);
    let (from, to) = window();
    let exported = export_all(&node, from, to, 40);
    assert_eq!(exported.len(), 251);
    let mut ids: Vec<&str> = exported
        .iter()
        .map(|e| e["request_id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 251, "the pages overlap or skip");
    let dir2 = tempfile::tempdir().unwrap();
    let other = Node::start(dir2.path(), &[]);
    let r = other.post_json("/v1/events", &json!(exported));
    assert_eq!(r.json()["new"], json!(251), "{}", r.text());
    assert_eq!(
        other.get("/v1/digest").json(),
        node.get("/v1/digest").json(),
        "the re-imported ledger has another digest"
    );
}

/// A restart keeps the store id (the data is the same); a node started on an empty
/// data dir under the same node id gets a new one (agents' outboxes must not count it
/// as holding what the old store held).
#[test]
fn the_store_id_survives_a_restart_and_is_new_after_a_wipe() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    let id = |n: &Node| n.get("/healthz").json()["store_id"].clone();
    let first = id(&node);
    assert!(first.is_string(), "{first}");
    node.kill9();
    let mut node = Node::start(dir.path(), &[]);
    assert_eq!(
        id(&node),
        first,
        "a restart on the same data keeps the store id"
    );
    node.kill9();
    std::fs::remove_dir_all(dir.path()).unwrap();
    std::fs::create_dir(dir.path()).unwrap();
    let node = Node::start(dir.path(), &[]);
    assert_ne!(id(&node), first, "an empty data dir is a new store");
}

#[test]
fn healthz_and_metrics_answer() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let h = node.get("/healthz").json();
    let store = h["store_id"].as_str().expect("a store id").to_string();
    assert_eq!(store.len(), 32, "{h}");
    assert_eq!(
        h,
        json!({"status": "ok", "node_id": "test-node", "store_id": store})
    );
    let e = usage_json("r1", "acme", "m", now_ms(), 1, 1);
    let r = node.post_json("/v1/events", &json!([e, e])).json();
    assert_eq!(
        (&r["node_id"], &r["store_id"]),
        (&json!("test-node"), &json!(store)),
        "an ingest answer names the node and store that hold it: {r}"
    );
    let m = node.get("/metrics").text();
    for line in [
        "bursar_ledger_events_received_total{node=\"test-node\"} 2",
        "bursar_ledger_events_new_total{node=\"test-node\"} 1",
        "bursar_ledger_events_duplicate_total{node=\"test-node\"} 1",
        "bursar_ledger_commits_total{node=\"test-node\"} 1",
        "bursar_ledger_stored_events{node=\"test-node\"} 1",
        "# TYPE bursar_ledger_commit_seconds histogram",
        "bursar_ledger_commit_seconds_bucket{node=\"test-node\",le=\"+Inf\"} 1",
        "bursar_ledger_commit_seconds_count{node=\"test-node\"} 1",
        // One commit of one new id: one run, nothing being merged.
        "bursar_ledger_index_runs{node=\"test-node\"} 1",
        "bursar_ledger_index_merge_ids_left{node=\"test-node\"} 0",
        "bursar_ledger_index_merged_runs_to_delete{node=\"test-node\"} 0",
    ] {
        assert!(m.contains(line), "missing {line:?} in\n{m}");
    }
}

#[test]
fn a_corrupt_data_file_stops_the_binary_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ledger.redb");
    std::fs::write(&file, vec![0x5au8; 64 * 1024]).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bursar-ledger"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["--node-id", "n", "--http", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("refusing to start"), "{err}");
    assert!(err.contains("cannot open ledger data file"), "{err}");
    assert_eq!(
        std::fs::read(&file).unwrap(),
        vec![0x5au8; 64 * 1024],
        "file changed"
    );
}

#[test]
fn help_documents_the_cluster_and_bad_cluster_flags_are_clear_errors() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_bursar-ledger"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--gossip", "--peer", "--tls-dir", "certs", "mutual TLS"] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // Each is refused before anything starts, with an error naming the problem. Every
    // case runs with the same data directory and node id; `args` are the rest.
    let refused = |args: &[&str], needle: &str| {
        let all: Vec<&str> = ["--data-dir", d, "--node-id", "n"]
            .into_iter()
            .chain(args.iter().copied())
            .collect();
        let out = run(&all);
        assert!(!out.status.success(), "{all:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{all:?}: {err}");
    };
    // --gossip without TLS material: refused before anything starts.
    refused(&["--gossip", "127.0.0.1:0"], "--tls-dir");
    // --peer without --gossip.
    refused(&["--peer", "127.0.0.1:9"], "--gossip");
    // TLS files that do not exist: the error names the file.
    refused(
        &["--gossip", "127.0.0.1:0", "--tls-dir", "/nonexistent"],
        "/nonexistent/ca.pem",
    );
    // A node may not name itself as a peer.
    refused(
        &[
            "--gossip",
            "127.0.0.1:7999",
            "--tls-dir",
            d,
            "--peer",
            "127.0.0.1:7999",
        ],
        "own --gossip",
    );
    // Every interface, and no address to be known by (foca would drop every packet
    // from a peer also calling itself 0.0.0.0:PORT).
    refused(
        &["--gossip", "0.0.0.0:7999", "--tls-dir", d],
        "--gossip-advertise",
    );
    refused(
        &[
            "--gossip",
            "0.0.0.0:7999",
            "--gossip-advertise",
            "0.0.0.0:7999",
            "--tls-dir",
            d,
        ],
        "must name one address",
    );
    refused(
        &[
            "--gossip",
            "0.0.0.0:7999",
            "--gossip-advertise",
            "10.1.2.3:7999",
            "--tls-dir",
            d,
            "--peer",
            "10.1.2.3:7999",
        ],
        "own --gossip",
    );
    // A seed that is not HOST:PORT.
    refused(
        &[
            "--gossip",
            "127.0.0.1:0",
            "--tls-dir",
            d,
            "--peer",
            "nonsense",
        ],
        "expected HOST:PORT",
    );
    // Standalone still works, and /v1/cluster says so.
    let node = Node::start(dir.path(), &[]);
    assert_eq!(node.get("/healthz").status, 200);
    assert_eq!(node.get("/v1/cluster").status, 404);
    assert_eq!(node.post("/v1/cluster/isolate?on=true", b"").status, 404);
}

#[test]
fn sigterm_stops_the_node_cleanly_and_a_second_node_cannot_share_its_data_dir() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    let e = usage_json("r1", "acme", "m", now_ms(), 1, 1);
    assert_eq!(node.post_json("/v1/events", &json!([e])).status, 200);
    let second = std::process::Command::new(env!("CARGO_BIN_EXE_bursar-ledger"))
        .arg("--data-dir")
        .arg(dir.path())
        .args(["--node-id", "n2", "--http", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("another process holds it open"), "{err}");
    let pid = node.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = node.child.wait().unwrap();
    assert!(status.success(), "exit status {status}");
    // A clean stop leaves a data dir the next start opens with the event in it.
    let again = Node::start(dir.path(), &[]);
    assert_eq!(again.get("/v1/digest").json()["root"]["events"], json!(1));
}

#[test]
fn concurrent_clients_sending_overlapping_batches_count_each_event_once() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path(), &[]);
    let addr = node.addr;
    let t = now_ms() - 1000;
    const THREADS: usize = 8;
    const REQUESTS: usize = 15;
    const BATCH: usize = 100;
    // Thread k sends ids shared with thread k+1: every id is sent by two threads.
    let results: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|k| {
                s.spawn(move || {
                    let (mut new, mut dup) = (0, 0);
                    for r in 0..REQUESTS {
                        let batch: Vec<Value> = (0..BATCH)
                            .map(|i| {
                                let owner = if i % 2 == 0 { k } else { (k + 1) % THREADS };
                                let id = format!("o{owner}-r{r}-j{}", i / 2);
                                usage_json(&id, "acme", "m", t, 10, 1)
                            })
                            .collect();
                        let resp = common::request(
                            addr,
                            "POST",
                            "/v1/events",
                            json!(batch).to_string().as_bytes(),
                        )
                        .unwrap();
                        assert_eq!(resp.status, 200, "{}", resp.text());
                        let v = resp.json();
                        new += v["new"].as_u64().unwrap();
                        dup += v["duplicate"].as_u64().unwrap();
                    }
                    (new, dup)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let new: u64 = results.iter().map(|r| r.0).sum();
    let dup: u64 = results.iter().map(|r| r.1).sum();
    let sent = (THREADS * REQUESTS * BATCH) as u64;
    // Odd i of thread k and even i of thread k+1 name the same (owner, j) ids.
    let distinct = sent / 2;
    assert_eq!(new + dup, sent);
    assert_eq!(new, distinct, "an event was counted twice or lost");
    let h = hour_start(t);
    let u = node
        .get(&format!(
            "/v1/usage?tenant=acme&from={h}&to={}",
            h + HOUR_MS
        ))
        .json();
    assert_eq!(u["total"]["requests"], json!(distinct));
    assert_eq!(u["total"]["input_tokens"], json!(distinct * 10));
    let m = node.get("/metrics").text();
    let commits: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("bursar_ledger_commits_total{node=\"test-node\"} "))
        .unwrap()
        .parse()
        .unwrap();
    println!("{} requests in {commits} commits", THREADS * REQUESTS);
    assert!(commits >= 1 && commits <= (THREADS * REQUESTS) as u64);
}

/// Every POST body was read whole (16 MiB) and parsed before the queue's 503, with no
/// bound on how many at once and no time limit: a few hundred agents posting together
/// held gigabytes, and a client that sent half a body held its connection for ever.
/// Past --ingest-max bodies being read a POST is 503 before its body is read; a body
/// that does not arrive within --body-timeout-ms is 408; nothing is stored either way.
#[test]
fn ingest_is_bounded_before_bodies_are_read_and_a_stalled_body_times_out() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(
        dir.path(),
        &["--ingest-max", "1", "--body-timeout-ms", "1500"],
    );
    // A body promised and never sent holds the one place.
    let mut stalled = std::net::TcpStream::connect(node.addr).unwrap();
    write!(
        stalled,
        "POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n[{{"
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let t = now_ms() - 1000;
    let r = node.post_json(
        "/v1/events",
        &json!([usage_json("b1", "acme", "m", t, 1, 1)]),
    );
    assert_eq!(r.status, 503, "{}", r.text());
    // The stalled one times out: 408, and the place is free again.
    stalled
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 512];
    let n = stalled.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    let r = node.post_json(
        "/v1/events",
        &json!([usage_json("b1", "acme", "m", t, 1, 1)]),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["new"], json!(1));
}
