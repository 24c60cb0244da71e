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
fn a_poll_has_work_only_when_the_key_count_moved_and_reports_only_new_keys() {
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
fn the_backoff_doubles_to_its_cap_and_starts_again_after_a_welcome() {
    let e = engine(bursar_agent::testing::ALLOCATED_SYNC);
    let c = cfg();
    let mut s: SyncSession<String> = SyncSession::new(0, c);
    let mut buf = Vec::new();
    // With a draw of 0 each wait is half the backoff; with u64::MAX - 1 just under it.
    let mut waits = Vec::new();
    for _ in 0..9 {
        s.open(&e, 0, &mut buf, key_of);
        waits.push(s.lost(0));
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
    let w = s.lost(u64::MAX - 1);
    assert!(w >= c.backoff_max_ns / 2 && w < c.backoff_max_ns, "{w}");
    // A stream that got as far as a welcome: the next wait starts from the minimum.
    s.open(&e, 0, &mut buf, key_of);
    s.welcome(&e, 0, 10_000, 100, &mut buf, key_of, line);
    let w = s.lost(0);
    assert_eq!(w, half);
    assert!(!s.is_up());
    // A failure after that doubles it again.
    assert_eq!(s.lost(0), 2 * half);
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
