//! The real `bursar-allocator` process on loopback, driven by a tonic client speaking
//! `bursar.allocator.v1` as an agent would: the listening line, hello checks, grants
//! after the learning period, acks, and the JSON admin endpoint.
#![cfg(feature = "shell")]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bursar_proto::allocator as pb;
use pb::agent_message::Msg;
use pb::allocator_client::AllocatorClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const RULES: &str = r#"
[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 20
"#;

struct Allocator {
    grpc: SocketAddr,
    admin: SocketAddr,
    child: Child,
    config: std::path::PathBuf,
}

impl Allocator {
    fn start(extra: &[&str]) -> Allocator {
        static N: AtomicU64 = AtomicU64::new(0);
        let config = std::env::temp_dir().join(format!(
            "bursar-alloc-test-{}-{}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
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
        assert!(line.starts_with("bursar-allocator listening: "), "{line:?}");
        let field = |name: &str| -> SocketAddr {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|a| a.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
        };
        Allocator {
            grpc: field("grpc="),
            admin: field("admin="),
            child,
            config,
        }
    }

    fn get_json(&self, path: &str) -> serde_json::Value {
        let mut s = TcpStream::connect(self.admin).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw);
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

fn hello(agent: &str, version: u32, time: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        msg: Some(Msg::Hello(pb::Hello {
            protocol_version: version,
            agent: agent.into(),
            incarnation: 1,
            weight: 1,
            agent_time_ns: time,
            held: vec![],
            config_version: String::new(),
        })),
    }
}

async fn open(
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

#[tokio::test]
async fn a_hello_with_another_protocol_version_or_no_hello_first_is_refused() {
    let a = Allocator::start(&["--term", "5"]);
    let (_tx, r) = open(a.grpc, hello("node-a", 99, 10)).await;
    let status = r.expect_err("version 99 must be refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status}");
    assert!(status.message().contains("protocol version 99"));

    let report = pb::AgentMessage {
        msg: Some(Msg::Report(pb::Report {
            agent_time_ns: 1,
            keys: vec![],
        })),
    };
    let (_tx, r) = open(a.grpc, report).await;
    assert_eq!(
        r.expect_err("no hello").code(),
        tonic::Code::InvalidArgument
    );

    let (_tx, r) = open(a.grpc, hello("", pb::PROTOCOL_VERSION, 10)).await;
    assert_eq!(
        r.expect_err("empty id").code(),
        tonic::Code::InvalidArgument
    );
}

#[tokio::test]
async fn an_agent_gets_a_welcome_then_a_grant_within_the_limit_and_the_admin_endpoint_shows_it() {
    let a = Allocator::start(&[
        "--term",
        "7",
        "--lease-ms",
        "1000",
        "--reclaim-margin-ms",
        "200",
    ]);
    let (tx, r) = open(a.grpc, hello("node-a", pb::PROTOCOL_VERSION, 1_000)).await;
    let mut inbound = r.expect("hello accepted");
    let first = inbound.message().await.unwrap().unwrap();
    let Some(pb::allocator_message::Msg::Welcome(w)) = first.msg else {
        panic!("first message must be a welcome: {first:?}");
    };
    assert_eq!(w.term, 7);
    assert_eq!(w.protocol_version, pb::PROTOCOL_VERSION);
    assert_eq!(w.lease_ms, 1000);
    assert!(w.max_keys_per_message > 0);

    // Demand: rejecting 50 requests on a key with no grant.
    let mut t = 2_000u64;
    let report = |t: u64| pb::AgentMessage {
        msg: Some(Msg::Report(pb::Report {
            agent_time_ns: t,
            keys: vec![pb::KeyReport {
                key: Some(pb::Key {
                    rule: "org-rps".into(),
                    values: vec!["acme".into()],
                }),
                admitted: 0,
                rejected: 50,
                counting_since_ns: 1_000,
                in_flight: 0,
                held: None,
            }],
        })),
    };
    tx.send(report(t)).await.unwrap();
    // The new term learns for lease + margin (1.2 s) before its first grant; keep
    // reporting (renewals anchor on the latest report).
    let grant = loop {
        tokio::select! {
            m = inbound.message() => {
                let m = m.unwrap().expect("stream open");
                if let Some(pb::allocator_message::Msg::Grants(g)) = m.msg {
                    break g.grants[0].clone();
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(250)) => {
                t += 250_000_000;
                tx.send(report(t)).await.unwrap();
            }
        }
    };
    assert_eq!(grant.epoch, 7);
    assert!(grant.rate > 0 && grant.rate <= 100, "{grant:?}");
    assert!(grant.burst <= 20);
    assert!(grant.lease_expires_at_ns > t - 250_000_000);
    assert!(grant.lease_expires_at_ns <= t + 1_000_000_000);

    tx.send(pb::AgentMessage {
        msg: Some(Msg::Ack(pb::Ack {
            slices: vec![pb::SliceAck {
                key: grant.key.clone(),
                epoch: grant.epoch,
                seq: grant.seq,
                released_tokens: 0,
                in_flight: 0,
            }],
        })),
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let keys = tokio::task::spawn_blocking(move || {
        let v = a.get_json("/v1/keys");
        (a, v)
    })
    .await
    .unwrap();
    let (a, v) = keys;
    assert_eq!(v["term"], 7);
    assert_eq!(v["learning"], false);
    assert_eq!(v["connected"], 1);
    let k = &v["keys"][0];
    assert_eq!(k["key"], "org-rps{acme}");
    assert_eq!(k["limit"]["rate"], 100);
    assert_eq!(k["limit"]["burst"], 20);
    assert!(k["committed"]["rate"].as_u64().unwrap() <= 100);
    assert_eq!(k["agents"][0]["agent"], "node-a");
    assert!(k["agents"][0]["granted"]["rate"].as_u64().unwrap() > 0);
    assert_eq!(k["bound"]["rate"], 0, "no partition: bound 0");
    assert!(v["counters"]["acks"].as_u64().unwrap() >= 1, "{v}");

    // A second live stream claiming the same id with a new incarnation is refused.
    let mut dup = hello("node-a", pb::PROTOCOL_VERSION, 5);
    if let Some(Msg::Hello(h)) = &mut dup.msg {
        h.incarnation = 2;
    }
    let (_tx2, r2) = open(a.grpc, dup).await;
    assert_eq!(
        r2.expect_err("duplicate").code(),
        tonic::Code::AlreadyExists
    );
    drop(tx);
}

#[tokio::test]
async fn each_start_with_a_term_file_serves_a_higher_term() {
    let file = std::env::temp_dir().join(format!("bursar-term-{}", std::process::id()));
    let _ = std::fs::remove_file(&file);
    let path = file.to_str().unwrap().to_string();
    let mut terms = Vec::new();
    for _ in 0..2 {
        let a = Allocator::start(&["--term-file", &path]);
        let (_tx, r) = open(a.grpc, hello("node-t", pb::PROTOCOL_VERSION, 1)).await;
        let m = r.unwrap().message().await.unwrap().unwrap();
        let Some(pb::allocator_message::Msg::Welcome(w)) = m.msg else {
            panic!("{m:?}");
        };
        terms.push(w.term);
    }
    let _ = std::fs::remove_file(&file);
    assert_eq!(terms, vec![1, 2]);
}

#[tokio::test]
async fn a_report_over_the_key_bound_or_the_size_bound_ends_the_stream_and_changes_nothing() {
    let a = Allocator::start(&["--term", "9"]);
    let key_report = |i: usize, len: usize| pb::KeyReport {
        key: Some(pb::Key {
            rule: "org-rps".into(),
            values: vec![format!("{i:0>len$}")],
        }),
        admitted: 0,
        rejected: 1,
        counting_since_ns: 1,
        in_flight: 0,
        held: None,
    };
    // More keys than MAX_KEYS_PER_MESSAGE.
    let (tx, r) = open(a.grpc, hello("node-big", pb::PROTOCOL_VERSION, 1)).await;
    let mut inbound = r.unwrap();
    inbound.message().await.unwrap().unwrap(); // welcome
    tx.send(pb::AgentMessage {
        msg: Some(Msg::Report(pb::Report {
            agent_time_ns: 2,
            keys: (0..pb::MAX_KEYS_PER_MESSAGE + 1)
                .map(|i| key_report(i, 8))
                .collect(),
        })),
    })
    .await
    .unwrap();
    let end = inbound.message().await.expect_err("stream must end");
    assert_eq!(end.code(), tonic::Code::InvalidArgument, "{end}");
    // Larger than MAX_MESSAGE_BYTES: refused by the transport.
    let (tx, r) = open(a.grpc, hello("node-huge", pb::PROTOCOL_VERSION, 1)).await;
    let mut inbound = r.unwrap();
    inbound.message().await.unwrap().unwrap();
    let _ = tx
        .send(pb::AgentMessage {
            msg: Some(Msg::Report(pb::Report {
                agent_time_ns: 2,
                keys: (0..2_000).map(|i| key_report(i, 4_000)).collect(),
            })),
        })
        .await;
    let r = tokio::time::timeout(Duration::from_secs(10), inbound.message())
        .await
        .expect("answered");
    let status = r.expect_err("the server refuses an oversized message");
    eprintln!("oversized report: {status}");
    assert!(
        matches!(
            status.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted | tonic::Code::Internal
        ),
        "{status}"
    );
    drop((tx, inbound));
    let v = tokio::task::spawn_blocking(move || a.get_json("/v1/keys"))
        .await
        .unwrap();
    assert_eq!(v["key_count"], 0, "nothing was recorded: {v}");
}

#[tokio::test]
async fn a_restarted_agent_releases_its_old_grants_at_once() {
    let a = Allocator::start(&[
        "--term",
        "11",
        "--lease-ms",
        "600",
        "--reclaim-margin-ms",
        "100",
    ]);
    let demand = |t: u64| pb::AgentMessage {
        msg: Some(Msg::Report(pb::Report {
            agent_time_ns: t,
            keys: vec![pb::KeyReport {
                key: Some(pb::Key {
                    rule: "org-rps".into(),
                    values: vec!["acme".into()],
                }),
                admitted: 0,
                rejected: t,
                counting_since_ns: 1,
                in_flight: 0,
                held: None,
            }],
        })),
    };
    let (tx, r) = open(a.grpc, hello("node-r", pb::PROTOCOL_VERSION, 10)).await;
    let mut inbound = r.unwrap();
    inbound.message().await.unwrap().unwrap(); // welcome
    let mut t = 1_000u64;
    tx.send(demand(t)).await.unwrap();
    loop {
        tokio::select! {
            m = inbound.message() => {
                if let Some(pb::allocator_message::Msg::Grants(_)) = m.unwrap().unwrap().msg {
                    break;
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(100)) => {
                t += 100_000_000;
                tx.send(demand(t)).await.unwrap();
            }
        }
    }
    let a = tokio::task::spawn_blocking(move || {
        let v = a.get_json("/v1/keys");
        assert!(
            v["keys"][0]["committed"]["rate"].as_u64().unwrap() > 0,
            "{v}"
        );
        a
    })
    .await
    .unwrap();
    // The process dies (its stream closes), and a new incarnation says hello, holding
    // nothing: the old grants are released at once, not after their lease.
    drop((tx, inbound));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut again = hello("node-r", pb::PROTOCOL_VERSION, 5);
    if let Some(Msg::Hello(h)) = &mut again.msg {
        h.incarnation = 2;
    }
    // The old incarnation was heard from within agent_silence_ms (1 s): the allocator
    // refuses a second live claimant until then, so retry as an agent would.
    let started = std::time::Instant::now();
    let (_tx2, mut inbound2) = loop {
        let (tx2, r2) = open(a.grpc, again.clone()).await;
        match r2 {
            Ok(s) => break (tx2, s),
            Err(s) if s.code() == tonic::Code::AlreadyExists => {
                assert!(started.elapsed() < Duration::from_secs(3), "{s}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(s) => panic!("{s}"),
        }
    };
    inbound2.message().await.unwrap().unwrap(); // welcome
    let v = tokio::task::spawn_blocking(move || a.get_json("/v1/keys"))
        .await
        .unwrap();
    // The key is either forgotten or holds nothing.
    assert!(
        v["keys"]
            .as_array()
            .unwrap()
            .iter()
            .all(|k| k["committed"]["rate"] == 0 && k["committed"]["burst"] == 0),
        "old grants still counted: {v}"
    );
    assert_eq!(v["counters"]["hellos"], 2, "{v}");
    assert!(
        started.elapsed() < Duration::from_millis(600),
        "released only after the lease ({:?})",
        started.elapsed()
    );
}
