//! The sync client's session (`sync_session`) on a real engine, without a network:
//! what it sends at each of its moments, and how long it waits to reconnect. The tonic
//! client and the simulator both run it, so these hold for both.

use bursar_agent::engine::KeyDemand;
use bursar_agent::sync_core::Line;
use bursar_agent::sync_session::{MeasureMark, Outgoing, SessionConfig, SyncSession};
use bursar_agent::testing::engine;
use bursar_agent::{AdmitRequest, Cost, Engine, SliceUpdate};

const MS: u64 = 1_000_000;
const SEC: u64 = 1_000 * MS;

fn key_of(d: &KeyDemand) -> Option<String> {
    Some(format!("{}/{}", d.rule, d.values()[0]))
}

fn line(l: Line<'_, String>) -> String {
    l.key.clone()
}

fn touch(e: &Engine, now: u64, id: &str, org: &str) {
    e.admit(
        now,
        &AdmitRequest {
            request_id: id,
            domain: None,
            descriptors: &[("org", org)],
            cost: Cost::ONE_REQUEST,
            ttl_ms: Some(60_000),
        },
    )
    .unwrap();
}

/// Each message as (kind, lines or acks, stamp).
fn summary(out: &[Outgoing<String, String>]) -> Vec<(&'static str, Vec<String>)> {
    out.iter()
        .map(|o| match o {
            Outgoing::Report { lines, measure, .. } => (
                match measure {
                    MeasureMark::None => "report",
                    MeasureMark::Start => "start",
                    MeasureMark::End => "end",
                },
                lines.clone(),
            ),
            Outgoing::Acks(a) => ("acks", a.iter().map(|a| a.key.clone()).collect()),
        })
        .collect()
}

fn stamps(out: &[Outgoing<String, String>]) -> Vec<u64> {
    out.iter()
        .filter_map(|o| match o {
            Outgoing::Report { agent_time_ns, .. } => Some(*agent_time_ns),
            Outgoing::Acks(_) => None,
        })
        .collect()
}

fn cfg() -> SessionConfig {
    SessionConfig {
        full_report_every: 4,
        ..SessionConfig::default()
    }
}

/// A session through its hello and welcome at `now` (lines per message `max_keys`).
fn welcomed(
    e: &Engine,
    now: u64,
    max_keys: usize,
) -> (SyncSession<String>, Vec<Outgoing<String, String>>) {
    let mut s = SyncSession::new(0, cfg());
    let mut buf = Vec::new();
    s.open(e, now, &mut buf, key_of);
    assert!(s.is_opening() && !s.is_up());
    let out = s.welcome(e, now, 10_000, max_keys, &mut buf, key_of, line);
    assert!(s.is_up());
    (s, out)
}

#[test]
fn the_welcome_reports_everything_at_once_in_messages_of_its_bound() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    for (i, org) in ["a", "b", "c"].iter().enumerate() {
        touch(&e, 0, &format!("r{i}"), org);
    }
    let (_, out) = welcomed(&e, SEC, 2);
    assert_eq!(
        summary(&out),
        [
            ("report", vec!["org-rps/a".into(), "org-rps/b".into()]),
            ("report", vec!["org-rps/c".into()]),
        ]
    );
    let st = stamps(&out);
    assert!(st[0] >= SEC && st[1] > st[0], "stamps increase: {st:?}");
}

/// Invariant 3 on the agent's side: a grant's lease runs from a stamp this client sent,
/// for the welcome's lease, so one that ends later (an allocator's bug) is cut to the
/// latest stamp plus the lease; it was applied as sent, and kept the grant past the
/// allocator's reclaim. The same for a lease extension.
#[test]
fn a_lease_past_the_latest_stamp_plus_the_welcome_s_lease_is_cut_to_it() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    touch(&e, 0, "r1", "a");
    let (mut s, out) = welcomed(&e, SEC, 100);
    let last = *stamps(&out).last().unwrap();
    let grant = |seq: u64, lease_end: u64| SliceUpdate {
        rule: "org-rps".into(),
        values: vec!["a".into()],
        rate: 100,
        burst: 10,
        epoch: 1,
        seq,
        lease_expires_at_ns: lease_end,
        fleet_size: 1,
        transfer_tokens: 0,
    };
    let lease_of = |e: &Engine| {
        let mut buf = Vec::new();
        e.key_demand(&mut buf);
        buf[0].slice.as_ref().unwrap().lease_expires_at_ns
    };
    let g = s.grants::<String>(
        &e,
        SEC,
        vec![grant(1, last + 60 * SEC)],
        vec!["org-rps/a".into()],
        &[7],
    );
    assert_eq!(g.applied, 1);
    assert_eq!(
        lease_of(&e),
        last + 10 * SEC,
        "cut to the stamp plus the lease"
    );
    // Within the bound: as sent.
    s.grants::<String>(
        &e,
        SEC,
        vec![grant(2, last + 4 * SEC)],
        vec!["org-rps/a".into()],
        &[7],
    );
    assert_eq!(lease_of(&e), last + 4 * SEC);
    let n = s
        .extension(
            &e,
            SEC,
            bursar_agent::engine::SliceExtension {
                epoch: 1,
                through_seq: 2,
                lease_expires_at_ns: u64::MAX - 1,
            },
        )
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(lease_of(&e), last + 10 * SEC, "an extension is cut too");
}

#[test]
fn nothing_is_reported_before_the_welcome_and_an_empty_tick_still_renews_leases() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    touch(&e, 0, "r1", "a");
    let mut s: SyncSession<String> = SyncSession::new(0, cfg());
    let mut buf = Vec::new();
    s.open(&e, 0, &mut buf, key_of);
    assert!(s.report_tick(&e, SEC, &mut buf, key_of, line).is_empty());
    assert!(!s.wants_poll(&e));
    let out = s.welcome(&e, SEC, 10_000, 100, &mut buf, key_of, line);
    assert_eq!(summary(&out), [("report", vec!["org-rps/a".to_string()])]);
    // Nothing changed: one empty report (a regular report renews the agent's leases).
    let out = s.report_tick(&e, SEC + SEC / 4, &mut buf, key_of, line);
    assert_eq!(summary(&out), [("report", vec![])]);
}

#[test]
fn a_poll_has_work_only_when_a_key_was_created_and_reports_only_new_keys() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    touch(&e, 0, "r1", "a");
    let (mut s, _) = welcomed(&e, 0, 100);
    let mut buf = Vec::new();
    assert!(!s.wants_poll(&e));
    assert!(s.poll_tick(&e, MS, &mut buf, key_of, line).is_empty());
    // Another request on a known key: still nothing for the poll.
    touch(&e, 2 * MS, "r2", "a");
    assert!(!s.wants_poll(&e));
    // A new key: the poll names it, and only it.
    touch(&e, 3 * MS, "r3", "b");
    assert!(s.wants_poll(&e));
    let out = s.poll_tick(&e, 20 * MS, &mut buf, key_of, line);
    assert_eq!(summary(&out), [("report", vec!["org-rps/b".to_string()])]);
    assert!(!s.wants_poll(&e));
    // The report tick names `a`'s new count (the poll did not), not `b` again.
    let out = s.report_tick(&e, SEC / 4, &mut buf, key_of, line);
    assert_eq!(summary(&out), [("report", vec!["org-rps/a".to_string()])]);
}

/// Review, thirty-first session: the poll looked for new keys only when the engine's
/// key count moved, so a key created while another was evicted (a full table, or the
/// idle sweep) left the count as it was and waited for the next report tick (up to a
/// report interval, every request on it refused meanwhile in allocated mode). It looks
/// at the engine's creation counter instead.
#[test]
fn a_new_key_is_polled_even_when_an_eviction_kept_the_key_count() {
    let rules =
        bursar_agent::testing::ALLOCATED_SYNC.replace("[engine]\n", "[engine]\nmax_keys = 1\n");
    let e = engine(&rules);
    touch(&e, 0, "r1", "a");
    let (mut s, _) = welcomed(&e, 0, 100);
    let mut buf = Vec::new();
    assert!(!s.wants_poll(&e));
    // `a` holds nothing (no grant: closed, at rest): `b` takes its place.
    touch(&e, 3 * MS, "r2", "b");
    assert_eq!(e.key_count(), 1);
    assert!(s.wants_poll(&e));
    let out = s.poll_tick(&e, 20 * MS, &mut buf, key_of, line);
    assert_eq!(summary(&out), [("report", vec!["org-rps/b".to_string()])]);
    assert!(!s.wants_poll(&e));
}

#[test]
fn every_nth_report_is_full_and_names_holders() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    touch(&e, 0, "r1", "a");
    let (mut s, _) = welcomed(&e, 0, 100);
    let mut buf = Vec::new();
    let g = SliceUpdate {
        rule: "org-rps".into(),
        values: vec!["a".into()],
        rate: 100,
        burst: 10,
        epoch: 1,
        seq: 1,
        lease_expires_at_ns: 60 * SEC,
        fleet_size: 1,
        transfer_tokens: 0,
    };
    let granted = s.grants::<String>(&e, MS, vec![g], vec!["org-rps/a".into()], &[7]);
    // A first grant shrinks nothing: no ack, the next line says it is held.
    assert_eq!((granted.applied, granted.refused.len()), (1, 0));
    assert!(granted.out.is_empty());
    let mut named = Vec::new();
    for i in 1..=4u64 {
        let out = s.report_tick(&e, i * SEC / 4, &mut buf, key_of, line);
        named.push(summary(&out)[0].1.len());
    }
    // The held line after the grant, then nothing, then the full (4th) report names
    // the holder unchanged.
    assert_eq!(named, [1, 0, 0, 1]);
}

#[test]
fn the_backoff_doubles_to_its_cap_and_starts_again_after_a_stream_that_stayed_up() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    let c = cfg();
    let mut s: SyncSession<String> = SyncSession::new(0, c);
    let mut buf = Vec::new();
    // With a draw of 0 each wait is half the backoff; with u64::MAX - 1 just under it.
    let mut waits = Vec::new();
    for _ in 0..9 {
        s.open(&e, 0, &mut buf, key_of);
        waits.push(s.lost(0, 0));
    }
    let half = c.backoff_min_ns / 2;
    assert_eq!(
        &waits[..7],
        [
            half,
            2 * half,
            4 * half,
            8 * half,
            16 * half,
            32 * half,
            50 * half
        ]
    );
    assert_eq!(waits[8], c.backoff_max_ns / 2, "capped");
    let w = s.lost(0, u64::MAX - 1);
    assert!(w >= c.backoff_max_ns / 2 && w < c.backoff_max_ns, "{w}");
    // A stream welcomed and dropped at once (an allocator that welcomes and then
    // fails): the backoff stays at its cap, no reconnect storm.
    s.open(&e, 0, &mut buf, key_of);
    s.welcome(&e, SEC, 10_000, 100, &mut buf, key_of, line);
    assert_eq!(s.lost(SEC + 10 * MS, 0), c.backoff_max_ns / 2);
    // A stream that stayed up for the backoff's cap: the next wait starts from the
    // minimum.
    s.open(&e, 2 * SEC, &mut buf, key_of);
    s.welcome(&e, 2 * SEC, 10_000, 100, &mut buf, key_of, line);
    let w = s.lost(2 * SEC + c.backoff_max_ns, 0);
    assert_eq!(w, half);
    assert!(!s.is_up());
    // A failure after that doubles it again.
    assert_eq!(s.lost(2 * SEC + c.backoff_max_ns, 0), 2 * half);
}

#[test]
fn a_measurement_reports_its_start_now_and_its_end_when_its_timer_fires() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    touch(&e, 0, "r1", "a");
    touch(&e, 0, "r2", "b");
    let (mut s, _) = welcomed(&e, 0, 100);
    let g = |v: &str| SliceUpdate {
        rule: "org-rps".into(),
        values: vec![v.into()],
        rate: 100,
        burst: 10,
        epoch: 1,
        seq: if v == "a" { 1 } else { 2 },
        lease_expires_at_ns: 60 * SEC,
        fleet_size: 1,
        transfer_tokens: 0,
    };
    s.grants::<String>(
        &e,
        MS,
        vec![g("a"), g("b")],
        vec!["org-rps/a".into(), "org-rps/b".into()],
        &[11, 12],
    );
    // Handle 99 is unknown to the stream: skipped.
    let (out, end) = s.measure_request(2 * MS, 500 * MS, &[12, 99], 100, line);
    assert_eq!(summary(&out), [("start", vec!["org-rps/b".to_string()])]);
    assert_eq!(end, Some(600 * MS));
    assert_eq!(s.measurement_end(), Some(600 * MS));
    // Early: nothing yet.
    assert!(s.measure_end(3 * MS, 599 * MS, line).is_empty());
    let out = s.measure_end(4 * MS, 600 * MS, line);
    assert_eq!(summary(&out), [("end", vec!["org-rps/b".to_string()])]);
    assert_eq!(s.measurement_end(), None);
}

/// One step of a client's life, for the property test below.
#[derive(Clone, Debug)]
enum Op {
    /// A request on `org` (rate) or `team` (concurrency) value `v`.
    Admit(bool, u8),
    /// The `n`-th oldest request in flight completes.
    Complete(u8),
    Advance(u64),
    Open,
    /// The welcome, with this bound on lines per message.
    Welcome(usize),
    ReportTick,
    PollTick,
    /// A grant for `org`/`team` value `v` with this burst (slots), carrying a handle
    /// or not.
    Grant(bool, u8, u64, bool),
    Lost(u64),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        5 => (any::<bool>(), 0u8..6).prop_map(|(t, v)| Op::Admit(t, v)),
        2 => (0u8..8).prop_map(Op::Complete),
        3 => (1u64..300).prop_map(Op::Advance),
        1 => Just(Op::Open),
        2 => (1usize..4).prop_map(Op::Welcome),
        3 => Just(Op::ReportTick),
        3 => Just(Op::PollTick),
        2 => (any::<bool>(), 0u8..6, 0u64..12, any::<bool>())
            .prop_map(|(t, v, b, h)| Op::Grant(t, v, b, h)),
        1 => any::<u64>().prop_map(Op::Lost),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(300))]

    /// Whatever happens in whatever order: nothing is sent on a stream that is not up,
    /// no message carries more than the welcome's bound, every message's stamp is above
    /// the last one's, the welcome's full report names every key the engine holds, a
    /// poll leaves nothing for the next one unless a shrink drains, acks name only
    /// granted keys, and every reconnect wait stays within the backoff's bounds.
    #[test]
    fn the_session_keeps_its_promises_through_any_sequence(
        ops in proptest::collection::vec(op(), 1..120)
    ) {
        use std::collections::BTreeSet;
        use proptest::{prop_assert, prop_assert_eq};
        let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
        let c = cfg();
        let mut s: SyncSession<String> = SyncSession::new(0, c);
        let mut buf = Vec::new();
        let (mut now, mut last_stamp, mut seq, mut req) = (1u64, 0u64, 0u64, 0u64);
        let mut in_flight: Vec<String> = Vec::new();
        let mut granted: BTreeSet<String> = BTreeSet::new();
        for op in ops {
            let up = s.is_up();
            let max = s.max_keys();
            // Only an open stream's welcome sends before the stream is up.
            let may_send = up || (matches!(op, Op::Welcome(_)) && s.is_opening());
            let out: Vec<Outgoing<String, String>> = match op {
                Op::Admit(team, v) => {
                    req += 1;
                    let id = format!("r{req}");
                    let value = format!("v{v}");
                    let desc = [(if team { "team" } else { "org" }, value.as_str())];
                    let r = e.admit(now, &AdmitRequest {
                        request_id: &id,
                        domain: None,
                        descriptors: &desc,
                        cost: Cost::ONE_REQUEST,
                        ttl_ms: Some(60_000),
                    });
                    if matches!(r, Ok(bursar_agent::Decision::Admitted(_))) {
                        in_flight.push(id);
                    }
                    Vec::new()
                }
                Op::Complete(n) => {
                    if !in_flight.is_empty() {
                        let id = in_flight.remove(n as usize % in_flight.len());
                        let _ = e.complete(
                            now,
                            &id,
                            bursar_agent::Usage::default(),
                            bursar_agent::CompletionStatus::Ok,
                        );
                    }
                    Vec::new()
                }
                Op::Advance(ms) => {
                    now += ms * MS;
                    Vec::new()
                }
                Op::Open => {
                    if !s.is_up() && !s.is_opening() {
                        let ts = s.open(&e, now, &mut buf, key_of);
                        prop_assert!(ts > last_stamp, "hello stamp {ts} after {last_stamp}");
                        last_stamp = ts;
                        prop_assert!(s.is_opening());
                    }
                    Vec::new()
                }
                Op::Welcome(max_keys) => {
                    if s.is_opening() {
                        let out = s.welcome(&e, now, 10_000, max_keys, &mut buf, key_of, line);
                        // Everything at once: every key the engine holds is named.
                        let mut all = Vec::new();
                        e.key_demand(&mut all);
                        let held: BTreeSet<String> = all.iter().filter_map(key_of).collect();
                        let named: BTreeSet<String> = out
                            .iter()
                            .flat_map(|o| match o {
                                Outgoing::Report { lines, .. } => lines.clone(),
                                Outgoing::Acks(_) => Vec::new(),
                            })
                            .collect();
                        prop_assert_eq!(named, held);
                        prop_assert_eq!(s.max_keys(), max_keys);
                        out
                    } else {
                        Vec::new()
                    }
                }
                Op::ReportTick => {
                    let out = s.report_tick(&e, now, &mut buf, key_of, line);
                    if up {
                        // A regular report goes out even empty: it renews leases.
                        prop_assert!(!out.is_empty());
                    }
                    out
                }
                Op::PollTick => {
                    let out = s.poll_tick(&e, now, &mut buf, key_of, line);
                    if s.draining() == 0 {
                        prop_assert!(!s.wants_poll(&e), "a poll left work for the next");
                    }
                    out
                }
                Op::Grant(team, v, burst, handle) => {
                    if s.is_up() {
                        seq += 1;
                        let rule = if team { "team-conc" } else { "org-rps" };
                        let key = format!("{rule}/v{v}");
                        granted.insert(key.clone());
                        let u = SliceUpdate {
                            rule: rule.into(),
                            values: vec![format!("v{v}")],
                            rate: if team { 0 } else { 100 },
                            burst,
                            epoch: 1,
                            seq,
                            lease_expires_at_ns: now + 60 * SEC,
                            fleet_size: 1,
                            transfer_tokens: 0,
                        };
                        let h = if handle { 100 + seq } else { 0 };
                        s.grants(&e, now, vec![u], vec![key], &[h]).out
                    } else {
                        Vec::new()
                    }
                }
                Op::Lost(draw) => {
                    let w = s.lost(now, draw);
                    prop_assert!(w >= c.backoff_min_ns / 2 && w < c.backoff_max_ns, "wait {w}");
                    prop_assert!(!s.is_up() && !s.is_opening());
                    Vec::new()
                }
            };
            if !may_send {
                prop_assert!(out.is_empty(), "sent while the stream was not up: {out:?}");
            }
            for o in &out {
                match o {
                    Outgoing::Report { agent_time_ns, lines, .. } => {
                        prop_assert!(lines.len() <= s.max_keys().max(max));
                        prop_assert!(*agent_time_ns > last_stamp);
                        last_stamp = *agent_time_ns;
                    }
                    Outgoing::Acks(acks) => {
                        prop_assert!(!acks.is_empty() && acks.len() <= s.max_keys());
                        for a in acks {
                            prop_assert!(granted.contains(&a.key), "ack for {}", a.key);
                        }
                    }
                }
            }
        }
    }
}
