//! Three real ledger processes on loopback, clustered over QUIC with mutual TLS: they
//! converge after a partition heals, a node killed with SIGKILL during ingest loses
//! nothing it acknowledged, a peer from another CA is refused, and a corrupt frame
//! from an authenticated peer is refused without harm.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{HOUR_MS, Node, export_all, now_ms, usage_json, window};
use serde_json::{Value, json};

fn certs(dir: &Path, nodes: &[&str]) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_bursar-ledger"));
    cmd.arg("certs").arg("--out").arg(dir);
    for n in nodes {
        cmd.args(["--node", n]);
    }
    let out = cmd.output().expect("run certs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn start(root: &Path, certs: &Path, id: &str, gossip: &str, peers: &[String]) -> Node {
    let mut args: Vec<String> = vec![
        "--gossip".into(),
        gossip.into(),
        "--tls-dir".into(),
        certs.display().to_string(),
        "--fault-injection".into(),
        "--sync-interval-ms".into(),
        "300".into(),
    ];
    for p in peers {
        args.push("--peer".into());
        args.push(p.clone());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Node::start_named(&root.join(id), id, &args)
}

fn cluster(node: &Node) -> Value {
    let r = node.get("/v1/cluster");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn root(node: &Node) -> Value {
    node.get("/v1/digest").json()["root"].clone()
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    t0.elapsed()
}

fn converged(nodes: &[&Node]) -> bool {
    let r0 = root(nodes[0]);
    nodes[1..].iter().all(|n| root(n) == r0)
}

fn events(prefix: &str, origin: &str, n: usize, t: u64) -> Value {
    Value::Array(
        (0..n)
            .map(|i| {
                let mut e = usage_json(
                    &format!("{prefix}-{i}"),
                    &format!("tenant-{}", i % 4),
                    if i % 2 == 0 { "gpt-4o" } else { "claude" },
                    t - (i as u64 % 50) * 60_000,
                    100 + i as u64,
                    10 + (i as u64 % 7),
                );
                e["origin"] = json!(origin);
                e["seq"] = json!(i + 1);
                e
            })
            .collect(),
    )
}

fn post_ok(node: &Node, body: &Value) -> Value {
    let r = node.post_json("/v1/events", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

fn isolate(node: &Node, on: bool) {
    let r = node.post(&format!("/v1/cluster/isolate?on={on}"), b"");
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn three_nodes_converge_after_a_partition_heals() {
    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "b", "c"]);
    let a = start(tmp.path(), &cdir, "a", "127.0.0.1:0", &[]);
    let seed = vec![a.gossip.unwrap().to_string()];
    let b = start(tmp.path(), &cdir, "b", "127.0.0.1:0", &seed);
    // c names its seed by host name (resolved by the node, again every 2 s).
    let by_name = vec![format!("localhost:{}", a.gossip.unwrap().port())];
    let c = start(tmp.path(), &cdir, "c", "127.0.0.1:0", &by_name);
    let all = [&a, &b, &c];
    let joined = wait_until("three members", Duration::from_secs(20), || {
        all.iter()
            .all(|n| cluster(n)["members"].as_array().unwrap().len() == 2)
    });
    println!("membership: all three see each other after {joined:?}");

    let t = now_ms();
    post_ok(&a, &events("before", "agent-a", 300, t));
    let pushed = wait_until("push to every node", Duration::from_secs(20), || {
        converged(&all)
    });
    println!("300 events written to a reached b and c in {pushed:?}");

    // Cut c off; keep writing on both sides, including a conflict (one request id,
    // two payloads) and a duplicate of an event both sides already hold.
    isolate(&c, true);
    post_ok(&a, &events("side-a", "agent-a", 400, t));
    post_ok(&b, &events("side-b", "agent-b", 300, t));
    post_ok(&c, &events("side-c", "agent-c", 300, t));
    let mut dup_a = usage_json("clash-1", "tenant-0", "gpt-4o", t, 111, 11);
    dup_a["origin"] = json!("agent-a");
    let mut dup_c = usage_json("clash-1", "tenant-0", "gpt-4o", t, 999, 99);
    dup_c["origin"] = json!("agent-c");
    post_ok(&a, &json!([dup_a]));
    post_ok(&c, &json!([dup_c]));
    let again = post_ok(&c, &events("before", "agent-a", 300, t));
    assert_eq!(again["duplicate"], 300, "{again}");
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        converged(&[&a, &b]),
        "a and b stay in sync while c is cut off"
    );
    assert_ne!(root(&a), root(&c), "c saw none of the other side's writes");
    assert_eq!(root(&c)["events"], 300 + 300 + 1);

    isolate(&c, false);
    let healed = wait_until(
        "convergence after the heal",
        Duration::from_secs(60),
        || converged(&all),
    );
    println!(
        "after the heal, all three digests equal in {healed:?}; c's sync counters {}",
        cluster(&c)["sync"]
    );
    let r = root(&a);
    assert_eq!(r["events"], 300 + 400 + 300 + 300 + 1, "{r}");

    // Identical exports (the same events, the same conflict winner) on every node.
    let (from, to) = window();
    let exports: Vec<Vec<Value>> = all
        .iter()
        .map(|n| {
            let mut v = export_all(n, from, to, 10_000);
            v.sort_by_key(|e| e["request_id"].as_str().unwrap().to_string());
            v
        })
        .collect();
    assert_eq!(exports[0].len(), 1301);
    assert_eq!(exports[0], exports[1]);
    assert_eq!(exports[0], exports[2]);
    let conflicts: usize = all
        .iter()
        .map(|n| {
            n.get("/v1/conflicts").json()["conflicts"]
                .as_array()
                .unwrap()
                .len()
        })
        .sum();
    assert!(conflicts >= 1, "the conflict is recorded where it was seen");
    // Totals per tenant agree to the token.
    for tenant in ["tenant-0", "tenant-1", "tenant-2", "tenant-3"] {
        let q = format!("/v1/usage?tenant={tenant}&from={from}&to={to}");
        let u: Vec<Value> = all.iter().map(|n| n.get(&q).json()).collect();
        assert_eq!(u[0], u[1]);
        assert_eq!(u[0], u[2]);
    }
    let m = a.get("/metrics").text();
    assert!(
        m.contains("bursar_ledger_cluster_members{node=\"a\"} 2"),
        "{m}"
    );
}

#[test]
fn a_node_killed_during_ingest_loses_nothing_it_acknowledged() {
    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "b", "c"]);
    let a = start(tmp.path(), &cdir, "a", "127.0.0.1:0", &[]);
    let seed = vec![a.gossip.unwrap().to_string()];
    let mut b = start(tmp.path(), &cdir, "b", "127.0.0.1:0", &seed);
    let b_gossip = b.gossip.unwrap().to_string();
    let c = start(tmp.path(), &cdir, "c", "127.0.0.1:0", &seed);
    wait_until("three members", Duration::from_secs(20), || {
        [&a, &b, &c]
            .iter()
            .all(|n| cluster(n)["members"].as_array().unwrap().len() == 2)
    });

    // A client writes batches to b; b is killed mid-stream.
    let t = now_ms();
    let b_addr = b.addr;
    let acked = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let attempted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let acked = acked.clone();
        let attempted = attempted.clone();
        std::thread::spawn(move || {
            for batch in 0..400 {
                let body = events(&format!("k{batch}"), "agent-k", 50, t);
                attempted.fetch_add(50, std::sync::atomic::Ordering::SeqCst);
                match common::request(b_addr, "POST", "/v1/events", body.to_string().as_bytes()) {
                    Ok(r) if r.status == 200 => {
                        let ids = body.as_array().unwrap().iter();
                        acked
                            .lock()
                            .unwrap()
                            .extend(ids.map(|e| e["request_id"].as_str().unwrap().to_string()));
                    }
                    _ => return,
                }
            }
        })
    };
    wait_until("some acknowledged writes", Duration::from_secs(30), || {
        acked.lock().unwrap().len() >= 2_000
    });
    b.kill9();
    writer.join().unwrap();
    let b = start(tmp.path(), &cdir, "b", &b_gossip, &seed);
    let all = [&a, &b, &c];
    let healed = wait_until(
        "convergence after the restart",
        Duration::from_secs(60),
        || converged(&all),
    );
    let acked = acked.lock().unwrap().clone();
    let (from, to) = (
        t / HOUR_MS * HOUR_MS - 2 * HOUR_MS,
        (t / HOUR_MS + 2) * HOUR_MS,
    );
    for n in all {
        let mut count: HashMap<String, usize> = HashMap::new();
        for e in export_all(n, from, to, 10_000) {
            *count
                .entry(e["request_id"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
        let lost = acked.iter().filter(|id| !count.contains_key(*id)).count();
        let duplicated = count.values().filter(|&&c| c > 1).count();
        println!(
            "node {}: attempted {}, acknowledged {}, present {}, lost {lost}, duplicated {duplicated} \
             (converged {healed:?} after the restart)",
            n.get("/healthz").json()["node_id"],
            attempted.load(std::sync::atomic::Ordering::SeqCst),
            acked.len(),
            count.len()
        );
        assert_eq!(lost, 0);
        assert_eq!(duplicated, 0);
        // Unacknowledged writes may or may not have landed, but only whole batches.
        assert_eq!(count.len() % 50, 0, "a batch is all or nothing");
    }
}

#[test]
fn a_peer_with_a_certificate_from_another_ca_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ours = tmp.path().join("ours");
    let theirs = tmp.path().join("theirs");
    certs(&ours, &["a"]);
    certs(&theirs, &["x"]);
    let a = start(tmp.path(), &ours, "a", "127.0.0.1:0", &[]);
    let x = start(
        tmp.path(),
        &theirs,
        "x",
        "127.0.0.1:0",
        &[a.gossip.unwrap().to_string()],
    );
    post_ok(&x, &events("foreign", "agent-x", 50, now_ms()));
    wait_until("a refused handshake", Duration::from_secs(20), || {
        cluster(&a)["handshakes_failed"].as_u64().unwrap() >= 1
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        root(&a)["events"],
        0,
        "nothing crossed from the foreign node"
    );
    assert!(cluster(&a)["members"].as_array().unwrap().is_empty());
    assert!(cluster(&x)["members"].as_array().unwrap().is_empty());
}

/// A peer with a valid certificate that sends garbage: the exchange ends with an
/// error frame, the counter moves, nothing is stored, and the node keeps serving.
#[test]
fn a_corrupt_frame_from_a_peer_is_refused_and_changes_nothing() {
    use bursar_ledger::cluster::frame::{self, Msg};
    use bursar_ledger::cluster::tls::{self, TlsFiles};

    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "probe"]);
    let a = start(tmp.path(), &cdir, "a", "127.0.0.1:0", &[]);
    let target = a.gossip.unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let node_tls = tls::load(&TlsFiles::in_dir(&cdir, "probe")).unwrap();
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(node_tls.client);
        let conn = ep
            .connect(target, tls::CLUSTER_SERVER_NAME)
            .unwrap()
            .await
            .expect("a certificate from the cluster CA is accepted");
        let good = frame::encode(&Msg::Push(frame::encode_events(
            &bursar_ledger::testing::usage_stream(1, "p", "agent-p", 20, now_ms()),
        )));
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("truncated", good[..good.len() / 2].to_vec()),
            ("bad magic", {
                let mut b = good.clone();
                b[0] = b'Z';
                b
            }),
            ("corrupt payload", {
                let mut b = good.clone();
                let n = b.len();
                for byte in &mut b[frame::HEADER_BYTES + 8..n - 4] {
                    *byte ^= 0x5a;
                }
                b
            }),
            ("the largest length, then nothing", {
                let mut b = good[..frame::HEADER_BYTES].to_vec();
                let max = (frame::FRAME_MAX_DEFAULT - frame::HEADER_BYTES) as u32;
                b[8..12].copy_from_slice(&max.to_le_bytes());
                b
            }),
            ("absurd length", {
                let mut b = good[..frame::HEADER_BYTES].to_vec();
                b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
                b
            }),
        ];
        for (what, bytes) in cases {
            let (mut send, mut recv) = conn.open_bi().await.unwrap();
            send.write_all(&bytes).await.unwrap();
            send.finish().unwrap();
            let answer = tokio::time::timeout(Duration::from_secs(10), recv.read_to_end(1 << 20))
                .await
                .expect("an answer in time")
                .unwrap_or_default();
            let msg = frame::decode(&answer, frame::FRAME_MAX_DEFAULT);
            assert!(matches!(msg, Ok(Msg::Error(_))), "{what}: {msg:?}");
        }
        // And a well-formed push on the same connection still works.
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&good).await.unwrap();
        send.finish().unwrap();
        let answer = recv.read_to_end(1 << 20).await.unwrap();
        assert!(matches!(
            frame::decode(&answer, frame::FRAME_MAX_DEFAULT),
            Ok(Msg::PushAck { new: 20, .. })
        ));
    });
    let c = cluster(&a);
    assert!(c["frames_rejected"].as_u64().unwrap() >= 3, "{c}");
    assert_eq!(
        root(&a)["events"],
        20,
        "only the well-formed push was stored"
    );
}

/// Review, thirty-first session: an accepting node checked only that a client
/// certificate chains to the cluster CA, so a certificate the same CA signed for
/// another service (no cluster name) made a full peer that could push billing events.
/// It is refused at the handshake; the same push with a node certificate is stored.
#[test]
fn a_certificate_of_the_cluster_ca_without_the_cluster_name_is_no_peer() {
    use bursar_ledger::cluster::frame::{self, Msg};
    use bursar_ledger::cluster::tls::{self, TlsFiles};

    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "probe"]);
    tls::make_cert_for_names(&cdir, "exporter", &["exporter.example".to_string()]).unwrap();
    let a = start(tmp.path(), &cdir, "a", "127.0.0.1:0", &[]);
    let target = a.gossip.unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let push = |stem: &'static str, prefix: &'static str| {
        let cdir = cdir.clone();
        rt.block_on(async move {
            let node_tls = tls::load(&TlsFiles::in_dir(&cdir, stem)).unwrap();
            let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
            ep.set_default_client_config(node_tls.client);
            let attempt = async {
                let conn = ep
                    .connect(target, tls::CLUSTER_SERVER_NAME)
                    .ok()?
                    .await
                    .ok()?;
                let good = frame::encode(&Msg::Push(frame::encode_events(
                    &bursar_ledger::testing::usage_stream(1, prefix, "agent-p", 20, now_ms()),
                )));
                let (mut send, mut recv) = conn.open_bi().await.ok()?;
                send.write_all(&good).await.ok()?;
                send.finish().ok()?;
                let answer = recv.read_to_end(1 << 20).await.ok()?;
                frame::decode(&answer, frame::FRAME_MAX_DEFAULT).ok()
            };
            tokio::time::timeout(Duration::from_secs(10), attempt)
                .await
                .ok()
                .flatten()
        })
    };
    let refused = push("exporter", "x");
    assert!(!matches!(refused, Some(Msg::PushAck { .. })), "{refused:?}");
    assert!(cluster(&a)["handshakes_failed"].as_u64().unwrap() >= 1);
    assert_eq!(root(&a)["events"], 0, "nothing crossed");
    let stored = push("probe", "p");
    assert!(
        matches!(stored, Some(Msg::PushAck { new: 20, .. })),
        "{stored:?}"
    );
    assert_eq!(root(&a)["events"], 20);
}

/// The convergence benchmark (docs/BENCHMARKS.md, "Ledger cluster"): one node is cut
/// off while many events are written to another, then healed; prints the time until
/// its digest equals the others' and the frame bytes it received per event, and holds
/// the wire target (under 100 bytes per event). The suite runs 30,000 events; the
/// benchmark's million, in release:
/// `BURSAR_CONVERGE_EVENTS=1000000 cargo test --release -p bursar-ledger --test cluster -- --nocapture convergence_of_many`
#[test]
fn convergence_of_many_events_after_a_heal() {
    let n_events: usize = std::env::var("BURSAR_CONVERGE_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000);
    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "b", "c"]);
    let a = start(tmp.path(), &cdir, "a", "127.0.0.1:0", &[]);
    let seed = vec![a.gossip.unwrap().to_string()];
    let b = start(tmp.path(), &cdir, "b", "127.0.0.1:0", &seed);
    let c = start(tmp.path(), &cdir, "c", "127.0.0.1:0", &seed);
    wait_until("three members", Duration::from_secs(20), || {
        [&a, &b, &c]
            .iter()
            .all(|n| cluster(n)["members"].as_array().unwrap().len() == 2)
    });
    isolate(&c, true);
    let t = now_ms();
    let t0 = Instant::now();
    let batch = 25_000;
    for i in 0..n_events.div_ceil(batch) {
        let n = batch.min(n_events - i * batch);
        let body: Vec<Value> = (0..n)
            .map(|j| {
                let k = i * batch + j;
                let mut e = usage_json(
                    &format!("0190c3a2-7b1e-7c4d-9e8f-{k:012x}"),
                    &format!("tenant-{}", k % 8),
                    if k % 3 == 0 { "gpt-4o" } else { "claude" },
                    t - (k as u64 % 7_200) * 1_000,
                    100 + (k as u64 % 900),
                    10 + (k as u64 % 70),
                );
                e["origin"] = json!("agent-bench");
                e["seq"] = json!(k + 1);
                e
            })
            .collect();
        post_ok(&a, &Value::Array(body));
    }
    let written = t0.elapsed();
    wait_until("a and b agree", Duration::from_secs(600), || {
        converged(&[&a, &b])
    });
    println!(
        "wrote {n_events} events to a in {written:?}; b in sync after {:?}",
        t0.elapsed()
    );
    let before = cluster(&c)["bytes_received"].as_u64().unwrap();
    isolate(&c, false);
    let healed = wait_until("c converges", Duration::from_secs(1200), || {
        converged(&[&a, &c])
    });
    let got = cluster(&c)["bytes_received"].as_u64().unwrap() - before;
    let pushed = cluster(&a)["push"].clone();
    println!(
        "after the heal: c converged on {n_events} events in {healed:?} ({:.0} events/s); \
         {got} frame bytes received = {:.1} bytes/event; a's push counters {pushed}",
        n_events as f64 / healed.as_secs_f64(),
        got as f64 / n_events as f64
    );
    assert_eq!(root(&c)["events"], n_events as u64);
    assert!(
        (got as f64 / n_events as f64) < 100.0,
        "{got} bytes for {n_events} events"
    );
}

/// A free UDP port on loopback (bound, then released for the node to take).
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn nodes_listening_on_every_interface_find_each_other_by_their_advertised_addresses() {
    let tmp = tempfile::tempdir().unwrap();
    let cdir = tmp.path().join("certs");
    certs(&cdir, &["a", "b"]);
    let (pa, pb) = (free_udp_port(), free_udp_port());
    let start_any = |id: &str, port: u16, peers: &[String]| {
        let mut args = vec![
            "--gossip".to_string(),
            format!("0.0.0.0:{port}"),
            "--gossip-advertise".into(),
            format!("127.0.0.1:{port}"),
            "--tls-dir".into(),
            cdir.display().to_string(),
            "--sync-interval-ms".into(),
            "300".into(),
        ];
        for p in peers {
            args.extend(["--peer".to_string(), p.clone()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Node::start_named(&tmp.path().join(id), id, &args)
    };
    let a = start_any("a", pa, &[]);
    // b's seed list names itself too (as a StatefulSet's shared list does): harmless.
    let b = start_any(
        "b",
        pb,
        &[format!("127.0.0.1:{pa}"), format!("localhost:{pb}")],
    );
    wait_until("two members", Duration::from_secs(20), || {
        [&a, &b]
            .iter()
            .all(|n| cluster(n)["members"].as_array().unwrap().len() == 1)
    });
    let seen = cluster(&a)["members"].to_string();
    assert!(seen.contains(&format!("127.0.0.1:{pb}")), "{seen}");
    // The generation a restart must beat is kept in the data directory.
    let gen_file = tmp.path().join("a").join("membership-generation");
    let generation: u64 = std::fs::read_to_string(&gen_file)
        .expect("the generation file")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(
        cluster(&a)["generation"],
        generation,
        "the one membership runs"
    );
    assert_eq!(cluster(&a)["advertise"], format!("127.0.0.1:{pa}"));
    let seen = cluster(&b)["members"].to_string();
    assert!(seen.contains(&format!("127.0.0.1:{pa}")), "{seen}");
    let t = now_ms();
    post_ok(&a, &events("any", "agent-a", 50, t));
    wait_until("push", Duration::from_secs(20), || converged(&[&a, &b]));
}
