//! The allocator sync client (`shell::sync`) against a scripted allocator: a real tonic
//! server on loopback speaking `bursar.allocator.v1`, whose every stream the test
//! reads and writes by hand. Checks the hello, the out-of-band report of a new key,
//! grants applied to the real engine and acknowledged, a concurrency shrink
//! acknowledged only once drained, and reconnection with the held grants.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bursar_agent::clock::Clock;
use bursar_agent::shell::AgentState;
use bursar_agent::shell::sync::{self, SyncConfig};
use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, Decision, DiscardSink, Engine, Usage,
};
use bursar_proto::allocator as pb;
use pb::agent_message::Msg;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

const RULES: &str = bursar_agent::testing::ALLOCATED_SYNC;

/// One agent stream as the scripted allocator sees it.
struct Conn {
    hello: pb::Hello,
    from_agent: mpsc::Receiver<pb::AgentMessage>,
    to_agent: mpsc::Sender<Result<pb::AllocatorMessage, tonic::Status>>,
}

#[derive(Clone)]
struct Scripted {
    conns: mpsc::Sender<Conn>,
    /// The term its welcomes carry.
    term: Arc<std::sync::atomic::AtomicU64>,
}

#[tonic::async_trait]
impl pb::allocator_server::Allocator for Scripted {
    type SyncStream = ReceiverStream<Result<pb::AllocatorMessage, tonic::Status>>;

    async fn sync(
        &self,
        req: tonic::Request<tonic::Streaming<pb::AgentMessage>>,
    ) -> Result<tonic::Response<Self::SyncStream>, tonic::Status> {
        let mut inbound = req.into_inner();
        let Some(pb::AgentMessage {
            msg: Some(Msg::Hello(hello)),
        }) = inbound.message().await?
        else {
            return Err(tonic::Status::invalid_argument("hello first"));
        };
        let (to_agent, rx) = mpsc::channel(64);
        to_agent
            .send(Ok(pb::AllocatorMessage {
                msg: Some(pb::allocator_message::Msg::Welcome(pb::Welcome {
                    protocol_version: pb::PROTOCOL_VERSION,
                    term: self.term.load(std::sync::atomic::Ordering::Relaxed),
                    config_version: String::new(),
                    max_keys_per_message: 100,
                    max_message_bytes: pb::MAX_MESSAGE_BYTES as u32,
                    // Longer than any lease the tests grant (from the hello, up to
                    // 90 s): the client cuts a lease past its latest stamp plus this.
                    lease_ms: 120_000,
                })),
            }))
            .await
            .unwrap();
        let (tx, from_agent) = mpsc::channel(1024);
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if tx.send(m).await.is_err() {
                    break;
                }
            }
        });
        let _ = self
            .conns
            .send(Conn {
                hello,
                from_agent,
                to_agent: to_agent.clone(),
            })
            .await;
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

async fn scripted_allocator() -> (std::net::SocketAddr, mpsc::Receiver<Conn>) {
    let (addr, rx, _) = scripted_allocator_at(5).await;
    (addr, rx)
}

/// A scripted allocator whose welcomes carry the term the returned cell holds.
async fn scripted_allocator_at(
    term: u64,
) -> (
    std::net::SocketAddr,
    mpsc::Receiver<Conn>,
    Arc<std::sync::atomic::AtomicU64>,
) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (conns, rx) = mpsc::channel(8);
    let term = Arc::new(std::sync::atomic::AtomicU64::new(term));
    let cell = Arc::clone(&term);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(pb::allocator_server::AllocatorServer::new(Scripted {
                conns,
                term,
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
            .await
            .unwrap();
    });
    (addr, rx, cell)
}

fn key(rule: &str, v: &str) -> Option<pb::Key> {
    Some(pb::Key {
        rule: rule.into(),
        values: vec![v.into()],
    })
}

fn grant(
    rule: &str,
    v: &str,
    rate: u64,
    burst: u64,
    seq: u64,
    lease_end: u64,
) -> pb::AllocatorMessage {
    pb::AllocatorMessage {
        msg: Some(pb::allocator_message::Msg::Grants(pb::Grants {
            grants: vec![pb::Grant {
                key: key(rule, v),
                rate,
                burst,
                epoch: 5,
                seq,
                lease_expires_at_ns: lease_end,
                fleet_size: 1,
                transfer_tokens: 0,
                key_handle: 8,
            }],
        })),
    }
}

/// The next message matching `f`, within `secs`.
async fn next_where<T>(
    conn: &mut Conn,
    secs: u64,
    mut f: impl FnMut(&pb::AgentMessage) -> Option<T>,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = tokio::time::timeout(left, conn.from_agent.recv())
            .await
            .expect("timed out waiting for the agent")
            .expect("stream open");
        if let Some(t) = f(&m) {
            return t;
        }
    }
}

/// The next report line that names key `rule`/`v` by name, within 2 s.
async fn next_line_named(conn: &mut Conn, rule: &str, v: &str) -> pb::KeyReport {
    let want = key(rule, v);
    next_where(conn, 2, |m| match &m.msg {
        Some(Msg::Report(r)) => r.keys.iter().find(|k| k.key == want).cloned(),
        _ => None,
    })
    .await
}

fn admit(state: &AgentState, id: &str, desc: &[(&str, &str)]) -> bool {
    let d = state
        .engine
        .admit(
            state.clock.now_ns(),
            &AdmitRequest {
                request_id: id,
                domain: None,
                descriptors: desc,
                cost: Cost::ONE_REQUEST,
                ttl_ms: Some(60_000),
            },
        )
        .unwrap();
    matches!(d, Decision::Admitted(_))
}

fn start_agent(
    addr: std::net::SocketAddr,
) -> (Arc<AgentState>, Arc<sync::SyncStatus>, watch::Sender<bool>) {
    let engine = Arc::new(Engine::new(
        Config::from_toml(RULES).unwrap(),
        Arc::new(DiscardSink),
    ));
    let state = AgentState::new(engine);
    let (tx, rx) = watch::channel(false);
    let mut cfg = SyncConfig::new(addr.to_string(), "agent-under-test");
    cfg.incarnation = 42;
    cfg.backoff_min = Duration::from_millis(20);
    let (status, _) = sync::spawn(Arc::clone(&state), cfg, rx);
    (state, status, tx)
}

#[tokio::test]
async fn a_grant_by_handle_alone_is_applied_to_the_key_the_handle_was_given_to() {
    let (addr, mut conns) = scripted_allocator().await;
    let (state, status, _stop) = start_agent(addr);
    let mut conn = conns.recv().await.unwrap();
    // The client says it finds keys by handle.
    assert!(conn.hello.grants_by_handle);
    // And what each of its rules means, so that an allocator whose file gives a rule
    // another meaning ignores its lines of it.
    let rules = Config::from_toml(RULES).unwrap();
    let want: Vec<(String, u64)> = rules
        .rules
        .rules()
        .iter()
        .map(|r| (r.name.clone(), r.shape()))
        .collect();
    let got: Vec<(String, u64)> = conn
        .hello
        .rule_shapes
        .iter()
        .map(|r| (r.rule.clone(), r.shape))
        .collect();
    assert_eq!(got, want);
    assert!(!admit(&state, "r0", &[("org", "acme")]));
    next_line_named(&mut conn, "org-rps", "acme").await;
    let lease_end = conn.hello.agent_time_ns + 30_000_000_000;
    // The key's first grant names it and gives handle 8.
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 100, 10, 1, lease_end)))
        .await
        .unwrap();
    // A shrink by handle alone: applied to `acme` and acknowledged, by handle.
    let by_handle = |seq: u64, handle: u64| {
        let mut m = grant("org-rps", "acme", 50, 5, seq, lease_end);
        if let Some(pb::allocator_message::Msg::Grants(g)) = &mut m.msg {
            g.grants[0].key = None;
            g.grants[0].key_handle = handle;
        }
        m
    };
    conn.to_agent.send(Ok(by_handle(2, 8))).await.unwrap();
    let ack = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Ack(a)) => Some(a.slices[0].clone()),
        _ => None,
    })
    .await;
    assert_eq!((ack.epoch, ack.seq, ack.key_handle), (5, 2, 8));
    // A handle this stream was never given names nothing: refused, nothing applied.
    let refused =
        |s: &sync::SyncStatus| s.grants_refused.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(refused(&status), 0);
    conn.to_agent.send(Ok(by_handle(3, 99))).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while refused(&status) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(refused(&status), 1);
    // The report still holds the by-handle grant (seq 2), not the refused one.
    let kr = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Report(r)) => r.keys.iter().find(|k| k.held.is_some()).cloned(),
        _ => None,
    })
    .await;
    let held = kr.held.unwrap();
    assert_eq!((held.seq, held.rate, held.burst), (2, 50, 5));
}

#[tokio::test]
async fn a_new_key_is_reported_at_once_and_its_grant_is_applied_and_acknowledged() {
    let (addr, mut conns) = scripted_allocator().await;
    let (state, status, _stop) = start_agent(addr);
    let mut conn = conns.recv().await.unwrap();
    assert_eq!(conn.hello.protocol_version, pb::PROTOCOL_VERSION);
    assert_eq!(conn.hello.agent, "agent-under-test");
    assert_eq!(conn.hello.incarnation, 42);
    assert!(conn.hello.held.is_empty());

    // A cold key rejects, and is reported out of band, well before the 250 ms timer.
    let t0 = Instant::now();
    assert!(!admit(&state, "r0", &[("org", "acme")]));
    let kr = next_line_named(&mut conn, "org-rps", "acme").await;
    let waited = t0.elapsed();
    assert_eq!(kr.rejected, 1);
    assert!(kr.held.is_none());
    assert!(
        waited < Duration::from_millis(200),
        "new key reported after {waited:?}"
    );

    // A grant is applied to the engine. It lowers nothing (the key had no slice), so
    // no ack: the key's next report line carries it as held.
    let lease_end = conn.hello.agent_time_ns + 30_000_000_000;
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 100, 10, 1, lease_end)))
        .await
        .unwrap();
    let first = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Ack(_)) => Some(None),
        Some(Msg::Report(r)) => r
            .keys
            .iter()
            .find_map(|k| k.held.filter(|h| h.seq == 1))
            .map(Some),
        _ => None,
    })
    .await;
    assert!(
        first.is_some(),
        "a growth was acknowledged by an ack message"
    );
    // The slice starts empty (invariant 2) and refills at 100/s.
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert!(admit(&state, "r1", &[("org", "acme")]));
    // The next report carries the held grant and the admission, naming the key by
    // the handle the grant carried (or by name, in a full report).
    let handle = 8;
    let kr = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Report(r)) => r
            .keys
            .iter()
            .find(|k| {
                (k.key == key("org-rps", "acme") || k.key_handle == handle) && k.admitted >= 1
            })
            .cloned(),
        _ => None,
    })
    .await;
    let held = kr.held.expect("held grant reported");
    assert_eq!(
        (held.epoch, held.seq, held.rate, held.burst),
        (5, 1, 100, 10)
    );
    assert_eq!(
        kr.rejected, 1,
        "counters are cumulative across the slice change"
    );
    assert_eq!(status.term.load(std::sync::atomic::Ordering::Relaxed), 5);
    // Delta reports name it by handle alone: no strings on the wire (a full report,
    // one in eight, names it).
    let mut by_handle = false;
    for i in 0..3 {
        tokio::time::sleep(Duration::from_millis(110)).await;
        assert!(admit(&state, &format!("d{i}"), &[("org", "acme")]));
        let kr = next_where(&mut conn, 2, |m| match &m.msg {
            Some(Msg::Report(r)) => r
                .keys
                .iter()
                .find(|k| k.key == key("org-rps", "acme") || k.key_handle == handle)
                .cloned(),
            _ => None,
        })
        .await;
        if kr.key_handle == handle {
            assert_eq!(kr.key, None);
            by_handle = true;
            break;
        }
    }
    assert!(by_handle, "no delta report named the key by its handle");

    // A lease extension of the grant's term moves its lease end.
    let extended = lease_end + 60_000_000_000;
    conn.to_agent
        .send(Ok(pb::AllocatorMessage {
            msg: Some(pb::allocator_message::Msg::LeaseExtension(
                pb::LeaseExtension {
                    epoch: 5,
                    through_seq: 1,
                    lease_expires_at_ns: extended,
                },
            )),
        }))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while status
        .extensions_applied
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(Instant::now() < deadline, "extension not applied");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut demand = Vec::new();
    state.engine.key_demand(&mut demand);
    assert_eq!(
        demand[0].slice.map(|s| s.lease_expires_at_ns),
        Some(extended)
    );

    // A shrink is acknowledged at once, naming the key by the handle the grant
    // carried, not by rule and values.
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 50, 5, 2, lease_end)))
        .await
        .unwrap();
    let ack = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Ack(a)) => Some(a.slices[0].clone()),
        _ => None,
    })
    .await;
    assert_eq!((ack.epoch, ack.seq), (5, 2));
    assert_eq!((ack.key, ack.key_handle), (None, 8));

    // A stale grant (lower seq) is ignored and not acknowledged.
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 1, 1, 1, lease_end)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        status
            .grants_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );

    // The allocator says it does not know handle 8 (it forgot the key): the next
    // report names the key by name, although nothing changed.
    conn.to_agent
        .send(Ok(pb::AllocatorMessage {
            msg: Some(pb::allocator_message::Msg::UnknownKeys(pb::UnknownKeys {
                key_handles: vec![8],
            })),
        }))
        .await
        .unwrap();
    let kr = next_line_named(&mut conn, "org-rps", "acme").await;
    assert_eq!(kr.key_handle, 0);
    assert_eq!(
        status
            .unknown_handles
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test]
async fn a_concurrency_shrink_is_acknowledged_only_once_in_flight_work_fits() {
    let (addr, mut conns) = scripted_allocator().await;
    let (state, _status, _stop) = start_agent(addr);
    let mut conn = conns.recv().await.unwrap();
    let lease_end = conn.hello.agent_time_ns + 30_000_000_000;
    conn.to_agent
        .send(Ok(grant("team-conc", "red", 0, 4, 1, lease_end)))
        .await
        .unwrap();
    next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Ack(a)) if a.slices[0].seq == 1 => Some(()),
        _ => None,
    })
    .await;
    for i in 0..3 {
        assert!(admit(&state, &format!("c{i}"), &[("team", "red")]));
    }
    // Shrink to one slot while three are in flight: applied at once, not acknowledged.
    conn.to_agent
        .send(Ok(grant("team-conc", "red", 0, 1, 2, lease_end)))
        .await
        .unwrap();
    let early = tokio::time::timeout(Duration::from_millis(600), async {
        next_where(&mut conn, 1, |m| match &m.msg {
            Some(Msg::Ack(a)) if a.slices.iter().any(|s| s.seq == 2) => Some(()),
            _ => None,
        })
        .await
    })
    .await;
    assert!(
        early.is_err(),
        "a shrink was acknowledged before it drained"
    );
    assert!(
        !admit(&state, "c9", &[("team", "red")]),
        "one slot, three in flight"
    );
    // Two complete: one in flight fits one slot, and the ack follows.
    for i in 0..2 {
        state
            .engine
            .complete(
                state.clock.now_ns(),
                &format!("c{i}"),
                Usage::default(),
                CompletionStatus::Ok,
            )
            .unwrap();
    }
    let ack = next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Ack(a)) => a.slices.iter().find(|s| s.seq == 2).cloned(),
        _ => None,
    })
    .await;
    assert!(ack.in_flight <= 1, "{ack:?}");
}

/// Review (twenty-seventh session): the agent fenced grants only per key, by
/// (epoch, seq). A grant of another term than its stream's was applied (a deposed
/// leader's, or a malformed epoch that then refused every later grant of the key), an
/// extension with epoch u64::MAX refused every later one until a restart, and a
/// welcome from a deposed leader (a lower term) was taken.
#[tokio::test]
async fn messages_of_another_term_are_refused_and_a_deposed_leaders_welcome_too() {
    use std::sync::atomic::Ordering::Relaxed;
    let (addr, mut conns, term) = scripted_allocator_at(5).await;
    let (state, status, _stop) = start_agent(addr);
    let conn = conns.recv().await.unwrap();
    let lease_end = conn.hello.agent_time_ns + 30_000_000_000;
    // A grant of epoch u64::MAX on this term-5 stream, and an extension of that epoch.
    let mut bogus = grant("org-rps", "acme", 100, 10, 3, lease_end);
    if let Some(pb::allocator_message::Msg::Grants(g)) = &mut bogus.msg {
        g.grants[0].epoch = u64::MAX;
    }
    conn.to_agent.send(Ok(bogus)).await.unwrap();
    conn.to_agent
        .send(Ok(pb::AllocatorMessage {
            msg: Some(pb::allocator_message::Msg::LeaseExtension(
                pb::LeaseExtension {
                    epoch: u64::MAX,
                    through_seq: 100,
                    lease_expires_at_ns: lease_end,
                },
            )),
        }))
        .await
        .unwrap();
    // Then the real ones: applied, as if the bogus ones had never come.
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 100, 10, 4, lease_end)))
        .await
        .unwrap();
    conn.to_agent
        .send(Ok(pb::AllocatorMessage {
            msg: Some(pb::allocator_message::Msg::LeaseExtension(
                pb::LeaseExtension {
                    epoch: 5,
                    through_seq: 4,
                    lease_expires_at_ns: lease_end,
                },
            )),
        }))
        .await
        .unwrap();
    let t0 = Instant::now();
    while status.extensions_applied.load(Relaxed) < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "no extension applied"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(status.grants_refused.load(Relaxed), 1);
    assert_eq!(status.grants_applied.load(Relaxed), 1);
    assert_eq!(status.extensions_refused.load(Relaxed), 1);
    // The grant starts empty (no transfer) and fills at 100 a second.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(admit(&state, "x", &[("org", "acme")]));
    // The leader is deposed; a stale node at term 4 welcomes the reconnecting agent:
    // refused, and again at each retry, until term 6 answers.
    term.store(4, Relaxed);
    conn.to_agent
        .send(Err(tonic::Status::unavailable("going away")))
        .await
        .unwrap();
    drop(conn);
    let t0 = Instant::now();
    while status.stale_terms.load(Relaxed) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a lower term was taken"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(status.connects.load(Relaxed), 1, "no stream under term 4");
    term.store(6, Relaxed);
    let t0 = Instant::now();
    while status.connects.load(Relaxed) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(5), "term 6 not taken");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(status.term.load(Relaxed), 6);
    while conns.try_recv().is_ok() {}
}

#[tokio::test]
async fn a_lost_stream_is_reopened_with_the_same_incarnation_and_the_held_grants() {
    let (addr, mut conns) = scripted_allocator().await;
    let (state, status, _stop) = start_agent(addr);
    let conn = conns.recv().await.unwrap();
    let lease_end = conn.hello.agent_time_ns + 30_000_000_000;
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 100, 10, 3, lease_end)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The allocator ends the stream with an error.
    conn.to_agent
        .send(Err(tonic::Status::unavailable("going away")))
        .await
        .unwrap();
    drop(conn);
    let again = tokio::time::timeout(Duration::from_secs(3), conns.recv())
        .await
        .expect("reconnected")
        .unwrap();
    assert_eq!(again.hello.incarnation, 42);
    assert!(again.hello.agent_time_ns > lease_end - 30_000_000_000);
    let held: Vec<_> = again
        .hello
        .held
        .iter()
        .map(|h| (h.key.clone(), h.grant.unwrap().seq))
        .collect();
    assert_eq!(held, vec![(key("org-rps", "acme"), 3)]);
    // The scripted side hands the stream over before the agent reads the welcome.
    let t0 = Instant::now();
    while status.connects.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(2), "no second welcome");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Meanwhile the engine kept its grant.
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(admit(&state, "x", &[("org", "acme")]));
}

#[tokio::test]
async fn a_measure_request_is_answered_with_a_start_at_once_and_an_end_after_its_window() {
    let (addr, mut conns) = scripted_allocator().await;
    let (state, _status, _stop) = start_agent(addr);
    let mut conn = conns.recv().await.unwrap();
    assert!(!admit(&state, "r0", &[("org", "acme")]));
    let lease_end = conn.hello.agent_time_ns + 60_000_000_000;
    conn.to_agent
        .send(Ok(grant("org-rps", "acme", 1_000, 100, 1, lease_end)))
        .await
        .unwrap();
    // A first grant is acknowledged by the key's next report line (its held grant).
    next_where(&mut conn, 2, |m| match &m.msg {
        Some(Msg::Report(r)) => r.keys.iter().find(|k| k.held.is_some()).map(|_| ()),
        _ => None,
    })
    .await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut admitted = 0u64;
    for i in 0..3 {
        admitted += u64::from(admit(&state, &format!("a{i}"), &[("org", "acme")]));
    }
    assert!(admitted > 0);

    // Handle 8 is the key's (the grant carried it); 99 names nothing on this stream.
    let asked = Instant::now();
    conn.to_agent
        .send(Ok(pb::AllocatorMessage {
            msg: Some(pb::allocator_message::Msg::MeasureRequest(
                pb::MeasureRequest {
                    key_handles: vec![99, 8],
                    window_ms: 150,
                },
            )),
        }))
        .await
        .unwrap();
    let measured = |want: pb::Measure| {
        move |m: &pb::AgentMessage| match &m.msg {
            Some(Msg::Report(r)) if r.measure() == want => Some(r.clone()),
            _ => None,
        }
    };
    let start = next_where(&mut conn, 2, measured(pb::Measure::Start)).await;
    assert!(
        asked.elapsed() < Duration::from_millis(150),
        "the start comes at once, not after the window"
    );
    assert_eq!(start.keys.len(), 1, "only the known handle answers");
    assert_eq!(
        (start.keys[0].key_handle, start.keys[0].admitted),
        (8, admitted)
    );
    // More admissions inside the window are in its end, which waits for the window.
    let mut more = 0u64;
    for i in 0..2 {
        more += u64::from(admit(&state, &format!("b{i}"), &[("org", "acme")]));
    }
    let end = next_where(&mut conn, 2, measured(pb::Measure::End)).await;
    assert!(
        asked.elapsed() >= Duration::from_millis(150),
        "the end came {:?} after the request, inside its 150 ms window",
        asked.elapsed()
    );
    assert_eq!(end.keys.len(), 1);
    assert_eq!(end.keys[0].key_handle, 8);
    assert_eq!(end.keys[0].admitted, admitted + more);
    assert!(end.agent_time_ns > start.agent_time_ns);
}

/// An allocator that answers every stream with a redirect to itself (a standby whose
/// view of the election still names it: a leader restarted before its old election key
/// expired), counting the streams.
#[derive(Clone)]
struct SelfRedirect {
    addr: std::net::SocketAddr,
    streams: Arc<std::sync::atomic::AtomicU64>,
}

#[tonic::async_trait]
impl pb::allocator_server::Allocator for SelfRedirect {
    type SyncStream = ReceiverStream<Result<pb::AllocatorMessage, tonic::Status>>;

    async fn sync(
        &self,
        _req: tonic::Request<tonic::Streaming<pb::AgentMessage>>,
    ) -> Result<tonic::Response<Self::SyncStream>, tonic::Status> {
        self.streams
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(1);
        let _ = tx
            .send(Ok(pb::AllocatorMessage {
                msg: Some(pb::allocator_message::Msg::Redirect(pb::Redirect {
                    leader: self.addr.to_string(),
                })),
            }))
            .await;
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// Review, twenty-fifth session: redirects were followed at once, every time: a
/// standby redirecting to itself for the rest of an election TTL had every agent
/// reconnect in a tight loop (a connection, a walk of the engine, an etcd call each).
#[tokio::test]
async fn a_redirect_to_itself_is_followed_with_backoff_not_in_a_loop() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let streams = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let svc = SelfRedirect {
        addr,
        streams: Arc::clone(&streams),
    };
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(pb::allocator_server::AllocatorServer::new(svc))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l))
            .await
            .unwrap();
    });
    let (_state, status, _stop) = start_agent(addr);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let n = streams.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n >= 2, "the redirect was followed ({n} streams)");
    assert!(n < 20, "{n} streams in a second: no backoff");
    assert_eq!(
        status.connects.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
