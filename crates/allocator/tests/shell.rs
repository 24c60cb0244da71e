//! The real `bursar-allocator` process on loopback, driven by a tonic client speaking
//! `bursar.allocator.v1` as an agent would: the listening line, hello checks, grants
//! after the learning period, acks, and the JSON admin endpoint.
#![cfg(feature = "shell")]

mod common;

use std::process::Command;
use std::time::Duration;

use bursar_proto::allocator as pb;
use common::{Allocator, RULES, hello, open};
use pb::agent_message::Msg;

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
            measure: 0,
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

    // Demand: rejecting 50 requests per report on a key with no grant (cumulative
    // counters: a report with the same counts would say the demand stopped).
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
                rejected: 50 * (1 + t / 250_000_000),
                counting_since_ns: 1_000,
                in_flight: 0,
                held: None,
                key_handle: 0,
            }],
            measure: 0,
        })),
    };
    tx.send(report(t)).await.unwrap();
    // The new term learns for lease + margin (1.2 s) before its first grant; keep
    // reporting (renewals anchor on the latest report).
    let started = std::time::Instant::now();
    let grant = loop {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no grant within 10 s"
        );
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
                key_handle: 0,
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
    assert_eq!(k["concentrated"], false, "one agent: the plain split");
    assert!(k["agents"][0]["slow_demand"].as_f64().unwrap() > 0.0, "{k}");
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
    // A file already far ahead of the wall clock keeps counting from itself.
    std::fs::write(&file, format!("{}\n", u64::MAX / 2)).unwrap();
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
    assert_eq!(terms, vec![u64::MAX / 2 + 1, u64::MAX / 2 + 2]);
    // A lost file (a pod's emptyDir) does not start the count again at 1: it starts
    // at the wall clock in ms, above any earlier run's wall-clock or file term.
    let a = Allocator::start(&["--term-file", &path]);
    let (_tx, r) = open(a.grpc, hello("node-t", pb::PROTOCOL_VERSION, 1)).await;
    let m = r.unwrap().message().await.unwrap().unwrap();
    let Some(pb::allocator_message::Msg::Welcome(w)) = m.msg else {
        panic!("{m:?}");
    };
    let wall_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    assert!(
        w.term > wall_ms - 60_000 && w.term <= wall_ms,
        "term {} at {wall_ms}",
        w.term
    );
    let _ = std::fs::remove_file(&file);
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
        key_handle: 0,
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
            measure: 0,
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
                measure: 0,
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
                key_handle: 0,
            }],
            measure: 0,
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

/// `org-rps`'s limit as the admin endpoint shows it: in the rules in force and on the
/// tracked key.
fn shown_limits(status: &serde_json::Value, keys: &serde_json::Value) -> (u64, u64, u64, u64) {
    let rule = &status["config"]["rules"][0];
    assert_eq!(rule["name"], "org-rps", "{status}");
    let key = &keys["keys"][0];
    assert_eq!(key["key"], "org-rps{acme}", "{keys}");
    (
        rule["limit"]["rate"].as_u64().unwrap(),
        rule["limit"]["burst"].as_u64().unwrap(),
        key["limit"]["rate"].as_u64().unwrap(),
        key["limit"]["burst"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn a_malformed_rules_file_is_refused_with_the_old_limits_kept_and_a_valid_one_applies() {
    let a = Allocator::start(&["--term", "13"]);
    // An agent on the stream, with a key the allocator tracks.
    let (tx, r) = open(a.grpc, hello("node-c", pb::PROTOCOL_VERSION, 10)).await;
    let mut inbound = r.expect("hello accepted");
    let first = inbound.message().await.unwrap().unwrap();
    let Some(pb::allocator_message::Msg::Welcome(w)) = first.msg else {
        panic!("{first:?}");
    };
    let old_version = w.config_version.clone();
    assert!(!old_version.is_empty());
    tx.send(pb::AgentMessage {
        msg: Some(Msg::Report(pb::Report {
            agent_time_ns: 20,
            keys: vec![pb::KeyReport {
                key: Some(pb::Key {
                    rule: "org-rps".into(),
                    values: vec!["acme".into()],
                }),
                admitted: 5,
                rejected: 5,
                counting_since_ns: 10,
                in_flight: 0,
                held: None,
                key_handle: 0,
            }],
            measure: 0,
        })),
    })
    .await
    .unwrap();
    let pid = a.child.id().to_string();
    let config = a.config.clone();
    let a = tokio::task::spawn_blocking(move || {
        a.wait_status("the report is recorded", |v| v["keys"] == 1);
        let status = a.get_json("/v1/status");
        assert_eq!(status["config"]["version"], old_version.as_str());
        assert_eq!(
            shown_limits(&status, &a.get_json("/v1/keys")),
            (100, 20, 100, 20)
        );

        // 1. An invalid value, then SIGHUP: refused, named, logged; the old rules stay.
        std::fs::write(&config, RULES.replace("rate = 100", "rate = -5")).unwrap();
        let hup = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
        assert!(hup.success());
        let v = a.wait_status("the refused reload", |v| v["config"]["reloads_failed"] == 1);
        let err = v["config"]["last_reload_error"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(err.contains(&config.display().to_string()), "{err}");
        assert!(err.contains("org-rps") && err.contains("`rate`"), "{err}");
        assert!(err.contains("unchanged"), "{err}");
        assert_eq!(v["config"]["reloads"], 0);
        assert_eq!(v["config"]["version"], old_version.as_str());
        assert_eq!(
            shown_limits(&v, &a.get_json("/v1/keys")),
            (100, 20, 100, 20)
        );

        // 2. Not TOML at all, through the admin POST: 422, the line and the rule named.
        std::fs::write(&config, RULES.replace("burst = 20", "burst = 20 20")).unwrap();
        let (code, body) = a.request("POST", "/v1/admin/reload");
        assert_eq!(code, 422, "{body}");
        assert_eq!(body["ok"], false);
        let err = body["error"].as_str().unwrap();
        assert!(err.contains(&config.display().to_string()), "{err}");
        assert!(
            err.contains("[[rule]] #1 \"org-rps\"") && err.contains("line 8"),
            "{err}"
        );
        let v = a.get_json("/v1/status");
        assert_eq!(v["config"]["reloads_failed"], 2);
        assert_eq!(v["config"]["last_reload_error"].as_str().unwrap(), err);
        assert_eq!(
            shown_limits(&v, &a.get_json("/v1/keys")),
            (100, 20, 100, 20)
        );

        // 3. A valid file with a smaller limit, through SIGHUP: applied at once.
        std::fs::write(
            &config,
            RULES
                .replace("rate = 100", "rate = 60")
                .replace("burst = 20", "burst = 12"),
        )
        .unwrap();
        let hup = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
        assert!(hup.success());
        let v = a.wait_status("the applied reload", |v| v["config"]["reloads"] == 1);
        assert!(v["config"]["last_reload_error"].is_null(), "{v}");
        assert_ne!(v["config"]["version"], old_version.as_str());
        assert!(
            v["config"]["last_reload"]
                .as_str()
                .unwrap()
                .contains("changed: org-rps"),
            "{v}"
        );
        assert_eq!(shown_limits(&v, &a.get_json("/v1/keys")), (60, 12, 60, 12));

        // 4. The same file again through the POST: applied, nothing changed.
        let (code, body) = a.request("POST", "/v1/admin/reload");
        assert_eq!(code, 200, "{body}");
        assert_eq!(
            (body["ok"].clone(), body["changed"].clone()),
            (true.into(), false.into())
        );
        a
    })
    .await
    .unwrap();
    // The agent was told the new version, once.
    let new_version = a.get_json("/v1/status")["config"]["version"]
        .as_str()
        .unwrap()
        .to_string();
    let told = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let m = inbound.message().await.unwrap().expect("stream open");
            if let Some(pb::allocator_message::Msg::ConfigVersion(v)) = m.msg {
                break v.version;
            }
        }
    })
    .await
    .expect("a ConfigVersion message");
    assert_eq!(told, new_version);
    drop(tx);
}

/// `--watch-config-ms`: a rules file that changes under the allocator (a mounted
/// ConfigMap) is reloaded without a signal, once per change.
#[test]
fn a_watched_rules_file_reloads_when_it_changes() {
    let a = Allocator::start(&["--term", "3", "--watch-config-ms", "50"]);
    std::thread::sleep(Duration::from_millis(200));
    let v = a.get_json("/v1/status");
    assert_eq!(
        v["config"]["reloads"], 0,
        "an unchanged file is not reloaded"
    );
    let old_version = v["config"]["version"].clone();
    let tmp = a.config.with_extension("toml.new");
    std::fs::write(&tmp, RULES.replace("rate = 100", "rate = 60")).unwrap();
    std::fs::rename(&tmp, &a.config).unwrap();
    let v = a.wait_status("the watched reload", |v| v["config"]["reloads"] == 1);
    assert_ne!(v["config"]["version"], old_version);
    std::fs::write(&tmp, RULES.replace("rate = 100", "rate = -5")).unwrap();
    std::fs::rename(&tmp, &a.config).unwrap();
    a.wait_status("the refused reload", |v| v["config"]["reloads_failed"] == 1);
    std::thread::sleep(Duration::from_millis(300));
    let v = a.get_json("/v1/status");
    assert_eq!(
        v["config"]["reloads_failed"], 1,
        "a refused file is read once"
    );
    assert_eq!(v["config"]["reloads"], 1);
}

/// Agents and the allocator hash one rules file into one `config_version` (in the
/// hello, the welcome, the agent's `bursar_rules_info` and the allocator's status):
/// they warn only when the files differ.
#[test]
fn agents_and_the_allocator_give_one_file_one_version() {
    // Several rules: their name index is a hash map, whose order differs from parse
    // to parse (it was in the hashed text until the twenty-fourth session).
    let file = format!(
        "{RULES}{}",
        (1..6)
            .map(|i| {
                format!(
                    "\n[[rule]]\nname = \"team-{i}\"\nmatch = {{ team = \"*\" }}\n\
                     dimension = \"requests\"\nrate = {i}\nper = \"second\"\n"
                )
            })
            .collect::<String>()
    );
    let cfg = bursar_agent::Config::from_toml(&file).unwrap();
    for _ in 0..10 {
        let engine = bursar_agent::Engine::new(
            bursar_agent::Config::from_toml(&file).unwrap(),
            std::sync::Arc::new(bursar_agent::DiscardSink),
        );
        assert_eq!(
            bursar_allocator::shell::config_version(&cfg),
            bursar_agent::shell::sync::config_version(&engine)
        );
    }
    let engine = bursar_agent::Engine::new(
        bursar_agent::Config::from_toml(&file).unwrap(),
        std::sync::Arc::new(bursar_agent::DiscardSink),
    );
    let other = bursar_agent::Config::from_toml(&file.replace("rate = 100", "rate = 99")).unwrap();
    assert_ne!(
        bursar_allocator::shell::config_version(&other),
        bursar_agent::shell::sync::config_version(&engine)
    );
}

#[tokio::test]
async fn a_stream_past_the_pending_hello_bound_is_refused_and_one_is_served_once_a_slot_frees() {
    let a = Allocator::start(&["--term", "5", "--pending-hellos-max", "2"]);
    // Two streams that never say hello: each holds a slot until its hello timeout
    // (5 s) or until it ends.
    let mut silent = Vec::new();
    for _ in 0..2 {
        let addr = a.grpc;
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::AgentMessage>(1);
        let call = tokio::spawn(async move {
            let mut c = pb::allocator_client::AllocatorClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            c.sync(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map(|_| ())
        });
        silent.push((tx, call));
    }
    let a = std::sync::Arc::new(a);
    let pending = |a: std::sync::Arc<common::Allocator>| async move {
        tokio::task::spawn_blocking(move || a.get_json("/v1/status"))
            .await
            .unwrap()
    };
    let t0 = std::time::Instant::now();
    while pending(a.clone()).await["input"]["pending_hellos"] != 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(4),
            "both silent streams wait"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_tx, r) = open(a.grpc, hello("node-c", pb::PROTOCOL_VERSION, 1)).await;
    let status = r.expect_err("a third stream waiting for its answer is one too many");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status}");
    assert!(
        status.message().contains("--pending-hellos-max"),
        "{status}"
    );

    // The silent streams end (no hello after all): their slots free, a hello is served.
    for (tx, call) in silent {
        drop(tx);
        let r = call.await.unwrap();
        assert_eq!(
            r.expect_err("no hello").code(),
            tonic::Code::InvalidArgument
        );
    }
    let t0 = std::time::Instant::now();
    let mut inbound = loop {
        let (tx, r) = open(a.grpc, hello("node-c", pb::PROTOCOL_VERSION, 1)).await;
        match r {
            Ok(inbound) => break (tx, inbound),
            Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "slots stay held: {s}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => panic!("{s}"),
        }
    };
    let first = inbound.1.message().await.unwrap().unwrap();
    assert!(
        matches!(first.msg, Some(pb::allocator_message::Msg::Welcome(_))),
        "{first:?}"
    );
    let v = pending(a.clone()).await;
    assert!(
        v["counters"]["streams_refused"].as_u64().unwrap() >= 1,
        "{v}"
    );
    assert_eq!(v["input"]["pending_hellos_max"], 2, "{v}");
    assert_eq!(v["input"]["pending_hellos"], 0, "{v}");
    assert_eq!(v["input"]["bytes_max"], 256u64 << 20, "{v}");
}

/// The stream port's connections were bounded only by the process's file descriptors:
/// clients that connect and never speak could use them all. Past `--connections-max` a
/// connection is closed at accept, counted, and an agent's is served once a place frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_the_cap_is_closed_at_once_and_an_agent_is_served_once_one_closes() {
    use tokio::io::AsyncReadExt;
    let a = std::sync::Arc::new(Allocator::start(&["--term", "5", "--connections-max", "2"]));
    let status = |a: std::sync::Arc<common::Allocator>| async move {
        tokio::task::spawn_blocking(move || a.get_json("/v1/status"))
            .await
            .unwrap()
    };
    // Two connections that never speak hold both places.
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(tokio::net::TcpStream::connect(a.grpc).await.unwrap());
    }
    let t0 = std::time::Instant::now();
    while status(a.clone()).await["input"]["connections_open"] != 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "both are counted open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A third is closed at once: its client reads end-of-stream.
    let mut third = tokio::net::TcpStream::connect(a.grpc).await.unwrap();
    let mut byte = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(5), third.read(&mut byte))
        .await
        .expect("closed at accept, not left waiting");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    let s = status(a.clone()).await;
    assert!(
        s["counters"]["connections_refused"].as_u64().unwrap() >= 1,
        "{s}"
    );
    assert_eq!(s["input"]["connections_max"], 2);
    // The idle ones go: an agent's hello is answered.
    drop(idle);
    let t0 = std::time::Instant::now();
    loop {
        let (_tx, r) = open(a.grpc, hello("node-a", pb::PROTOCOL_VERSION, 1)).await;
        if let Ok(mut inbound) = r {
            let first = tokio::time::timeout(Duration::from_secs(5), inbound.message())
                .await
                .expect("an answer")
                .expect("a message");
            assert!(first.is_some(), "the hello is answered");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "served once places free"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `--connections-max` alone let clients that connect and never open a stream hold
/// their places for ever. Now a connection that opens no stream within
/// `--first-stream-timeout-ms` is closed and counted, whether it sent nothing or only
/// the HTTP/2 preface; an agent's stream keeps its connection past the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_opens_no_stream_in_time_is_closed_and_an_agent_s_stays() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let a = std::sync::Arc::new(Allocator::start(&[
        "--term",
        "5",
        "--first-stream-timeout-ms",
        "300",
    ]));
    let status = |a: std::sync::Arc<common::Allocator>| async move {
        tokio::task::spawn_blocking(move || a.get_json("/v1/status"))
            .await
            .unwrap()
    };
    let (_tx, r) = open(a.grpc, hello("node-a", pb::PROTOCOL_VERSION, 1)).await;
    let mut inbound = r.expect("the stream opens");
    let first = inbound.message().await.unwrap().expect("welcomed");
    assert!(
        matches!(first.msg, Some(pb::allocator_message::Msg::Welcome(_))),
        "{first:?}"
    );
    let mut nothing = tokio::net::TcpStream::connect(a.grpc).await.unwrap();
    let mut preface = tokio::net::TcpStream::connect(a.grpc).await.unwrap();
    preface
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    // Each gets the server's SETTINGS (sent at accept), then its end.
    for (what, conn) in [
        ("nothing", &mut nothing),
        ("only the preface", &mut preface),
    ] {
        let mut buf = [0u8; 256];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("a connection with {what} is closed at its deadline"))
            {
                Ok(0) | Err(_) => break,
                Ok(_) => continue,
            }
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
    // The agent's stream, older than the deadline, is still served.
    let alive = tokio::time::timeout(Duration::from_millis(500), inbound.message()).await;
    assert!(
        matches!(alive, Err(_) | Ok(Ok(Some(_)))),
        "the agent's stream must stay open: {alive:?}"
    );
    let s = status(a.clone()).await;
    assert_eq!(s["counters"]["connections_silent"], 2, "{s}");
    assert_eq!(s["connected"], 1, "{s}");
    assert_eq!(s["input"]["connections_open"], 1, "{s}");
}

#[test]
fn input_bounds_out_of_range_are_refused_at_start_with_the_flag_named() {
    for (flag, value) in [
        ("--input-bytes-max", "1000"),
        ("--input-bytes-max", "4294967296"),
        ("--pending-hellos-max", "0"),
        ("--connections-max", "0"),
        ("--connections-max", "1000001"),
        ("--first-stream-timeout-ms", "99"),
        ("--first-stream-timeout-ms", "600001"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_bursar-allocator"))
            .args([
                "--grpc",
                "127.0.0.1:0",
                "--admin",
                "127.0.0.1:0",
                flag,
                value,
            ])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} must be refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}
