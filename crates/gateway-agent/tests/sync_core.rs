//! The sync client's bookkeeping (`sync_core`) on a real engine, without a network:
//! what each report names and how, and which grants are acknowledged when.

use bursar_agent::engine::KeyDemand;
use bursar_agent::sync_core::{Applied, SyncTracks};
use bursar_agent::testing::engine;
use bursar_agent::{AdmitRequest, Cost, Engine, SliceUpdate};

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

const RULES: &str = bursar_agent::testing::ALLOCATED_SYNC;

fn key_of(d: &KeyDemand) -> Option<String> {
    Some(format!("{}/{}", d.rule, d.values()[0]))
}

fn touch(e: &Engine, now: u64, id: &str, desc: &[(&str, &str)]) {
    e.admit(
        now,
        &AdmitRequest {
            request_id: id,
            domain: None,
            descriptors: desc,
            cost: Cost::ONE_REQUEST,
            ttl_ms: Some(60_000),
        },
    )
    .unwrap();
}

fn grant(rule: &str, v: &str, burst: u64, seq: u64) -> SliceUpdate {
    SliceUpdate {
        rule: rule.into(),
        values: vec![v.into()],
        rate: if rule == "org-rps" { 100 } else { 0 },
        burst,
        epoch: 1,
        seq,
        lease_expires_at_ns: 60 * SEC,
        fleet_size: 1,
        transfer_tokens: 0,
    }
}

/// `(key, by handle)` of each line of one report.
fn lines(t: &mut SyncTracks<String>, full: bool) -> Vec<(String, u64)> {
    counted(t, full)
        .into_iter()
        .map(|(k, _, _, handle)| (k, handle))
        .collect()
}

#[test]
fn reports_name_changed_keys_and_full_reports_add_holders_and_recent_changes() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    touch(&e, 0, "r1", &[("org", "a")]);
    touch(&e, 0, "r2", &[("org", "b")]);
    t.refresh(&e, 0, &mut buf, key_of);
    // Both are new to the stream: named.
    let first = lines(&mut t, false);
    assert_eq!(first, [("org-rps/a".into(), 0), ("org-rps/b".into(), 0)]);
    // Nothing changed: nothing to report.
    t.refresh(&e, SEC / 4, &mut buf, key_of);
    assert!(lines(&mut t, false).is_empty());
    // A grant with a handle for `a`, applied and acknowledged at once.
    let out = t.apply(
        &e,
        SEC / 4,
        vec![grant("org-rps", "a", 10, 1)],
        vec!["org-rps/a".into()],
        &[42],
    );
    // A key's first grant shrinks nothing: the next report's held line says it.
    assert!(matches!(&out[..], [Applied::Held]));
    // Its held grant changed: reported by handle; `b` did not change.
    t.refresh(&e, SEC / 2, &mut buf, key_of);
    assert_eq!(lines(&mut t, false), [("org-rps/a".into(), 42)]);
    // A full report names the holder and every key that changed since the last full
    // report (both: `b` was new), changed now or not; by handle where one is known.
    assert_eq!(
        lines(&mut t, true),
        [("org-rps/a".into(), 42), ("org-rps/b".into(), 0)]
    );
    // The next names the holder only: `b` had its quiet line.
    t.refresh(&e, 3 * SEC / 4, &mut buf, key_of);
    assert_eq!(lines(&mut t, true), [("org-rps/a".into(), 42)]);
    // Until it changes again: then it is in the next full report too, once more.
    touch(&e, 3 * SEC / 4, "r4", &[("org", "b")]);
    t.refresh(&e, 7 * SEC / 8, &mut buf, key_of);
    assert_eq!(lines(&mut t, false), [("org-rps/b".into(), 0)]);
    assert_eq!(
        lines(&mut t, true),
        [("org-rps/a".into(), 42), ("org-rps/b".into(), 0)]
    );
    assert_eq!(lines(&mut t, true), [("org-rps/a".into(), 42)]);
    // A new stream: everything again, and the old stream's handles are gone.
    t.new_stream();
    touch(&e, SEC, "r3", &[("org", "a")]);
    t.refresh(&e, SEC, &mut buf, key_of);
    assert_eq!(
        lines(&mut t, false),
        [("org-rps/a".into(), 0), ("org-rps/b".into(), 0)]
    );
    assert_eq!(t.held().count(), 1);
    // One report in eight is full.
    let fulls = (0..16).filter(|_| t.next_report_is_full(8)).count();
    assert_eq!(fulls, 2);
}

/// `(key, admitted + rejected, counting since, by handle)` of each line of one report.
fn counted(t: &mut SyncTracks<String>, full: bool) -> Vec<(String, u64, u64, u64)> {
    let mut out = Vec::new();
    t.report(full, false, |l| {
        out.push((
            l.key.clone(),
            l.admitted + l.rejected,
            l.counting_since_ns,
            l.key_handle,
        ))
    });
    out
}

#[test]
fn a_key_unnamed_for_half_a_lease_counts_from_when_it_was_last_named() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    // The allocator's lease is 2 s: rebase after 1 s unnamed.
    t.set_rebase_after(SEC);
    let a = "org-rps/a".to_string();
    touch(&e, 0, "r1", &[("org", "a")]);
    t.refresh(&e, 0, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 1, 0, 0)]);
    // A handle from a grant; the line that reports it goes by handle.
    t.apply(
        &e,
        SEC / 10,
        vec![grant("org-rps", "a", 10, 1)],
        vec![a.clone()],
        &[42],
    );
    touch(&e, SEC / 10, "r2", &[("org", "a")]);
    t.refresh(&e, SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 2, 0, 42)]);
    // Named again within the second: still cumulative, by handle.
    touch(&e, SEC / 2, "r3", &[("org", "a")]);
    t.refresh(&e, SEC, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 3, 0, 42)]);
    // Unnamed for 1.5 s, then two more: counted from the last line (1 s), by name
    // (the allocator may have forgotten the key, and with it the handle).
    touch(&e, 2 * SEC, "r4", &[("org", "a")]);
    touch(&e, 2 * SEC, "r5", &[("org", "a")]);
    t.refresh(&e, 5 * SEC / 2, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 2, SEC, 0)]);
    // From there it is cumulative again, from the new start.
    touch(&e, 5 * SEC / 2, "r6", &[("org", "a")]);
    t.refresh(&e, 11 * SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 3, SEC, 0)]);
    // A new stream names every key counting from its last line on the old stream
    // (thirtieth session; before, from where its counters started).
    t.new_stream();
    touch(&e, 3 * SEC, "r7", &[("org", "a")]);
    t.refresh(&e, 3 * SEC, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a, 1, 11 * SEC / 4, 0)]);
}

/// A key named in every report never rebased, so the first line to a new stream (a
/// new leader, which holds no entry for it) carried everything since the key was first
/// read: an hour of past demand read as one current sample, and for a key busy for
/// days more units than the allocator reads from a line. It counts from its last line
/// on the old stream now.
#[test]
fn a_new_stream_s_first_line_counts_from_the_old_stream_s_last() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    t.set_rebase_after(SEC);
    let a = "org-rps/a".to_string();
    // Busy for a minute, named every 250 ms: cumulative from 0 throughout.
    let mut sent = 0;
    for i in 0..240u64 {
        let now = i * SEC / 4;
        touch(&e, now, &format!("r{i}"), &[("org", "a")]);
        t.refresh(&e, now, &mut buf, key_of);
        sent += 1;
        assert_eq!(counted(&mut t, false), [(a.clone(), sent, 0, 0)]);
    }
    let last = 239 * SEC / 4;
    // The stream breaks; a new one opens a little later with two more admitted.
    t.new_stream();
    touch(&e, 60 * SEC, "x1", &[("org", "a")]);
    touch(&e, 60 * SEC, "x2", &[("org", "a")]);
    t.refresh(&e, 60 * SEC, &mut buf, key_of);
    assert_eq!(
        counted(&mut t, false),
        [(a.clone(), 2, last, 0)],
        "the new stream's first line covers only what came after the old one's last"
    );
    // And cumulative from there on the new stream.
    touch(&e, 60 * SEC + SEC / 4, "x3", &[("org", "a")]);
    t.refresh(&e, 60 * SEC + SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a, 3, last, 0)]);
}

#[test]
fn a_grant_that_shrinks_is_acknowledged_and_one_that_does_not_is_reported_as_held() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    let a = "org-rps/a".to_string();
    touch(&e, 0, "r1", &[("org", "a")]);
    t.refresh(&e, 0, &mut buf, key_of);
    lines(&mut t, false);
    let apply = |t: &mut SyncTracks<String>, rate: u64, burst: u64, seq: u64| {
        let mut g = grant("org-rps", "a", burst, seq);
        g.rate = rate;
        let out = t.apply(&e, seq * SEC / 8, vec![g], vec![a.clone()], &[42]);
        assert_eq!(out.len(), 1);
        match out.into_iter().next().unwrap() {
            Applied::Ack(x) => Some((x.seq, x.released_tokens)),
            Applied::Held => None,
            other => panic!("{other:?}"),
        }
    };
    // From nothing, then larger, then the same (a renewal): held, no ack.
    assert_eq!(apply(&mut t, 100, 10, 1), None);
    assert_eq!(apply(&mut t, 200, 20, 2), None);
    assert_eq!(apply(&mut t, 200, 20, 3), None);
    // A smaller burst: acknowledged, with the tokens it gave up (the bucket had
    // refilled to 20; the shrink to 5 gives up 15).
    assert_eq!(apply(&mut t, 200, 5, 4), Some((4, 15)));
    // A higher rate with a smaller burst shrinks too.
    assert_eq!(apply(&mut t, 300, 4, 5), Some((5, 1)));
    // A lower rate with the same burst.
    assert_eq!(apply(&mut t, 250, 4, 6), Some((6, 0)));
    // The held grant is in the key's next line.
    t.refresh(&e, SEC, &mut buf, key_of);
    let mut held = Vec::new();
    t.report(false, false, |l| {
        held.push(l.held.map(|h| (h.seq, h.rate, h.burst)))
    });
    assert_eq!(held, [Some((6, 250, 4))]);
}

#[test]
fn a_handle_the_allocator_does_not_know_is_dropped_and_the_key_named_afresh() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    let a = "org-rps/a".to_string();
    for id in ["r1", "r2", "r3"] {
        touch(&e, 0, id, &[("org", "a")]);
    }
    touch(&e, 0, "r4", &[("org", "b")]);
    t.refresh(&e, 0, &mut buf, key_of);
    counted(&mut t, false);
    t.apply(
        &e,
        SEC / 8,
        vec![grant("org-rps", "a", 10, 1)],
        vec![a.clone()],
        &[42],
    );
    t.refresh(&e, SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 3, 0, 42)]);
    // The allocator forgot the key: it ignored that line, and says so. Handles this
    // stream does not hold change nothing.
    t.forget_handles(&[99, 42]);
    // Named in the next report although nothing changed, by name, counting from the
    // ignored line (nothing since).
    t.refresh(&e, SEC / 2, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 0, SEC / 4, 0)]);
    // Then as any key: by name until a grant gives a handle again.
    touch(&e, SEC / 2, "r5", &[("org", "a")]);
    t.refresh(&e, 3 * SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 1, SEC / 4, 0)]);
    t.apply(
        &e,
        SEC,
        vec![grant("org-rps", "a", 10, 2)],
        vec![a.clone()],
        &[43],
    );
    touch(&e, SEC, "r6", &[("org", "a")]);
    t.refresh(&e, SEC, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a, 2, SEC / 4, 43)]);
}

#[test]
fn a_concurrency_shrink_is_acknowledged_once_in_flight_work_fits() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    let k = "team-conc/red".to_string();
    touch(&e, 0, "x", &[("team", "red")]);
    t.refresh(&e, 0, &mut buf, key_of);
    let out = t.apply(
        &e,
        0,
        vec![grant("team-conc", "red", 4, 1)],
        vec![k.clone()],
        &[0],
    );
    assert!(matches!(&out[..], [Applied::Ack(_)]));
    for id in ["c1", "c2", "c3"] {
        touch(&e, 0, id, &[("team", "red")]);
    }
    // Three in flight; a shrink to one slot waits for them.
    let out = t.apply(
        &e,
        0,
        vec![grant("team-conc", "red", 1, 2)],
        vec![k.clone()],
        &[0],
    );
    assert!(matches!(&out[..], [Applied::Draining]));
    assert_eq!(t.draining(), 1);
    t.refresh(&e, 1, &mut buf, key_of);
    assert!(t.drained_acks().is_empty());
    for id in ["c1", "c2", "c3"] {
        e.complete(
            1,
            id,
            bursar_agent::Usage::default(),
            bursar_agent::CompletionStatus::Ok,
        )
        .unwrap();
    }
    t.refresh(&e, 2, &mut buf, key_of);
    let acks = t.drained_acks();
    assert_eq!(acks.len(), 1);
    assert_eq!((acks[0].key.as_str(), acks[0].seq), (k.as_str(), 2));
    assert!(acks[0].in_flight <= 1);
    assert_eq!(t.draining(), 0);

    // Review (twenty-seventh session): a shrink still draining when the stream is
    // lost is not acknowledged on the next one (its handle and term were the old
    // stream's; a new leader refuses an older term's ack with the rest of its
    // message). The hello and the next report carry the held grant instead.
    t.apply(
        &e,
        3,
        vec![grant("team-conc", "red", 4, 3)],
        vec![k.clone()],
        &[0],
    );
    for id in ["d1", "d2", "d3"] {
        touch(&e, 3, id, &[("team", "red")]);
    }
    let out = t.apply(
        &e,
        3,
        vec![grant("team-conc", "red", 1, 4)],
        vec![k.clone()],
        &[0],
    );
    assert!(matches!(&out[..], [Applied::Draining]), "{out:?}");
    assert_eq!(t.draining(), 1);
    t.new_stream();
    assert_eq!(t.draining(), 0);
    for id in ["d1", "d2", "d3"] {
        e.complete(
            4,
            id,
            bursar_agent::Usage::default(),
            bursar_agent::CompletionStatus::Ok,
        )
        .unwrap();
    }
    t.refresh(&e, 5, &mut buf, key_of);
    assert!(t.drained_acks().is_empty());
}

#[test]
fn a_tracked_key_named_on_the_wire_is_the_engines_key() {
    use bursar_agent::sync_core::TrackedKey;
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<TrackedKey> = SyncTracks::new(0);
    touch(&e, 0, "r1", &[("org", "a")]);
    touch(&e, 0, "r2", &[("org", "b")]);
    t.refresh(&e, 0, &mut buf, |d| Some(TrackedKey::of(d)));
    let a = TrackedKey::named(&e, "org-rps", &["a".to_string()]);
    assert!(
        t.contains(&a),
        "a grant's key finds the track the walk made"
    );
    assert_eq!((a.rule(), &*a.values()[0]), ("org-rps", "a"));
    assert!(!t.contains(&TrackedKey::named(&e, "org-rps", &["c".to_string()])));
    assert!(
        !t.contains(&TrackedKey::named(&e, "no-such-rule", &["a".to_string()])),
        "an unknown rule names no key"
    );
    // Reports name the keys as the engine does.
    let mut named = Vec::new();
    t.report(true, false, |l| {
        named.push(format!("{}/{}", l.key.rule(), l.key.values()[0]))
    });
    named.sort();
    assert_eq!(named, ["org-rps/a", "org-rps/b"]);
}

/// Review, thirty-first session: a measurement re-reads its keys' counters now but
/// stamped them as read at the last walk, up to a report interval earlier; a rebase
/// after it (a new stream) then counted the next line from that earlier time with a
/// base that already held the newer counts: a window too long, a rate too low.
#[test]
fn a_measurement_stamps_its_lines_with_the_time_it_read_them() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    touch(&e, 0, "r0", &[("org", "a")]);
    t.refresh(&e, 0, &mut buf, key_of);
    lines(&mut t, false);
    let out = t.apply(
        &e,
        SEC / 4,
        vec![grant("org-rps", "a", 10, 1)],
        vec!["org-rps/a".into()],
        &[42],
    );
    assert!(matches!(&out[..], [Applied::Held]));
    touch(&e, SEC / 4 + 100 * MS, "r1", &[("org", "a")]);
    let read_at = SEC / 4 + 240 * MS;
    let mut n = 0;
    t.measure_report(read_at, &[42], |_| n += 1);
    assert_eq!(n, 1);
    t.new_stream();
    t.refresh(&e, SEC / 2 + 240 * MS, &mut buf, key_of);
    let mut since = Vec::new();
    t.report(true, false, |l| since.push(l.counting_since_ns));
    assert_eq!(since, [read_at]);
}

#[test]
fn a_measurement_reports_only_known_handles_with_counts_from_the_live_slot() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    touch(&e, 0, "r0", &[("org", "a")]);
    touch(&e, 0, "r1", &[("org", "b")]);
    t.refresh(&e, 0, &mut buf, key_of);
    lines(&mut t, false);
    // `a` gets a grant with handle 42, then a second one that replaces its slot: the
    // track must follow the new slot, or a read of one key sees the sealed one.
    for (seq, burst) in [(1, 10), (2, 20)] {
        let now = seq * SEC / 4;
        let out = t.apply(
            &e,
            now,
            vec![grant("org-rps", "a", burst, seq)],
            vec!["org-rps/a".into()],
            &[42],
        );
        assert!(matches!(&out[..], [Applied::Held]));
    }
    let measure = |t: &mut SyncTracks<String>| {
        let mut out = Vec::new();
        t.measure_report(SEC, &[7, 42], |l| {
            out.push((l.key.clone(), l.key_handle, l.admitted, l.rejected))
        });
        out
    };
    // Only the key with a handle on this stream answers (7 names nothing).
    let start = measure(&mut t);
    assert_eq!(start.len(), 1);
    let (k, h, admitted, rejected) = start[0].clone();
    assert_eq!((k.as_str(), h), ("org-rps/a", 42));
    // Admissions on the new slot since the start, with no walk of the engine's keys:
    // the end sees them.
    let mut admitted_now = 0;
    for i in 0..5 {
        let now = SEC + i * SEC / 10;
        let d = e
            .admit(
                now,
                &AdmitRequest {
                    request_id: &format!("m{i}"),
                    domain: None,
                    descriptors: &[("org", "a")],
                    cost: Cost::ONE_REQUEST,
                    ttl_ms: Some(60_000),
                },
            )
            .unwrap();
        admitted_now += u64::from(d.is_admitted());
    }
    assert!(admitted_now > 0, "the slice admits");
    let end = measure(&mut t);
    assert_eq!(end.len(), 1);
    assert_eq!(
        end[0].2,
        admitted + admitted_now,
        "admitted counted from the live slot"
    );
    assert_eq!(end[0].3, rejected + (5 - admitted_now));
}

/// Rules for the walk comparison: keys go idle after 50 ms (evictions every few
/// steps), a strict and an open posture (a lease ending changes the reported slice
/// with or without a new slot), and a concurrency rule (in-flight counts go down).
const WALK_RULES: &str = r#"
[engine]
slice_source = "allocated"
key_idle_ms = 50

[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 10
posture = "strict"

[[rule]]
name = "app-rps"
match = { app = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 10
posture = "open"

[[rule]]
name = "team-conc"
match = { team = "*" }
dimension = "concurrency"
max_in_flight = 8
"#;

#[derive(Clone, Debug)]
enum WalkOp {
    Admit(u8, u8),
    /// Envoy's RLS path: `decide_hits` on a rate rule (0 hits: a check).
    Hits(u8, u8, u64),
    /// Envoy's post-hoc charge on a rate rule.
    Charge(u8, u8, u64),
    /// Repeated bare checks through a worker (buffered demand), flushed or not.
    Bare(u8, u8, u8, bool),
    Complete(u8),
    Grant(u8, u8, u64, bool),
    Advance(u64),
    Report(bool, bool),
    NewStream,
}

fn walk_op() -> impl proptest::strategy::Strategy<Value = WalkOp> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0u8..3, 0u8..4).prop_map(|(r, v)| WalkOp::Admit(r, v)),
        1 => (0u8..2, 0u8..4, 0u64..3).prop_map(|(r, v, h)| WalkOp::Hits(r, v, h)),
        1 => (0u8..2, 0u8..4, 1u64..3).prop_map(|(r, v, c)| WalkOp::Charge(r, v, c)),
        1 => (0u8..2, 0u8..4, 1u8..4, any::<bool>())
            .prop_map(|(r, v, n, f)| WalkOp::Bare(r, v, n, f)),
        2 => (0u8..32).prop_map(WalkOp::Complete),
        2 => (0u8..3, 0u8..4, 0u64..12, any::<bool>())
            .prop_map(|(r, v, b, short)| WalkOp::Grant(r, v, b, short)),
        2 => (1u64..40).prop_map(WalkOp::Advance),
        3 => (any::<bool>(), any::<bool>()).prop_map(|(f, n)| WalkOp::Report(f, n)),
        1 => Just(WalkOp::NewStream),
    ]
}

type WalkLine = (
    String,
    u64,
    u64,
    u64,
    u64,
    u64,
    Option<(u64, u64, u64, u64)>,
);

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config::with_cases(200))]

    /// The report tick reads only the keys that changed (`refresh_changed`); a full
    /// walk of every key (`refresh`) must give the same report, line for line, through
    /// admissions (and Envoy's checks, hits and charges, and a worker's bare checks,
    /// whose demand it buffers), completions, grants (renewals included), leases ending on both
    /// postures, evictions of idle keys, new streams, full and new-only reports, and
    /// lines rebased after a key went unnamed.
    #[test]
    fn reading_only_changed_keys_reports_what_reading_every_key_does(
        ops in proptest::collection::vec(walk_op(), 1..80)
    ) {
        const MS: u64 = 1_000_000;
        let rules = ["org-rps", "app-rps", "team-conc"];
        let descs = ["org", "app", "team"];
        let (full_e, delta_e) = (engine(WALK_RULES), engine(WALK_RULES));
        let mut full_t: SyncTracks<String> = SyncTracks::new(0);
        let mut delta_t: SyncTracks<String> = SyncTracks::new(0);
        // Keys unnamed for 50 ms are rebased: runs of a few seconds go through many.
        full_t.set_rebase_after(50 * MS);
        delta_t.set_rebase_after(50 * MS);
        let mut buf = Vec::new();
        let mut workers = [full_e.worker(), delta_e.worker()];
        let (mut now, mut seq, mut req) = (0u64, 0u64, 0u32);
        full_t.refresh(&full_e, now, &mut buf, key_of);
        delta_t.refresh(&delta_e, now, &mut buf, key_of);
        for op in ops {
            match op {
                WalkOp::Admit(r, v) => {
                    req += 1;
                    let id = format!("q{}", req % 32);
                    let value = format!("v{v}");
                    for e in [&full_e, &delta_e] {
                        let _ = e.admit(now, &AdmitRequest {
                            request_id: &id,
                            domain: None,
                            descriptors: &[(descs[r as usize], &value)],
                            cost: Cost::ONE_REQUEST,
                            ttl_ms: Some(60_000),
                        });
                    }
                }
                WalkOp::Hits(r, v, hits) => {
                    let value = format!("v{v}");
                    for e in [&full_e, &delta_e] {
                        let d = e.decide_hits(now, None, &[(descs[r as usize], &value)], hits);
                        proptest::prop_assert!(d.is_ok(), "{d:?}");
                    }
                }
                WalkOp::Charge(r, v, units) => {
                    let value = format!("v{v}");
                    for e in [&full_e, &delta_e] {
                        let c = e.charge(now, &AdmitRequest {
                            request_id: "charge",
                            domain: None,
                            descriptors: &[(descs[r as usize], &value)],
                            cost: Cost { requests: units, ..Cost::ONE_REQUEST },
                            ttl_ms: None,
                        });
                        proptest::prop_assert!(c.is_ok(), "{c:?}");
                    }
                }
                WalkOp::Bare(r, v, n, flush) => {
                    let value = format!("v{v}");
                    for w in &mut workers {
                        let k = w.engine().key_handle(rules[r as usize], &[&value]).unwrap();
                        for _ in 0..n {
                            proptest::prop_assert!(w.try_acquire(now, &k, 1).is_ok());
                        }
                        if flush {
                            w.flush_demand();
                        }
                    }
                }
                WalkOp::Complete(q) => {
                    for e in [&full_e, &delta_e] {
                        let _ = e.complete(
                            now,
                            &format!("q{q}"),
                            bursar_agent::Usage::default(),
                            bursar_agent::CompletionStatus::Ok,
                        );
                    }
                }
                WalkOp::Grant(r, v, burst, short) => {
                    // A burst of 0-3 repeats often: renewals of the same slice.
                    seq += 1;
                    let mut g = grant(rules[r as usize], &format!("v{v}"), burst % 4, seq);
                    if r == 1 {
                        g.rate = 100;
                    }
                    g.lease_expires_at_ns = now + if short { 20 * MS } else { 10_000 * MS };
                    let key = format!("{}/v{v}", rules[r as usize]);
                    let a = full_t.apply(&full_e, now, vec![g.clone()], vec![key.clone()], &[7]);
                    let b = delta_t.apply(&delta_e, now, vec![g], vec![key], &[7]);
                    proptest::prop_assert_eq!(format!("{a:?}"), format!("{b:?}"));
                }
                WalkOp::Advance(ms) => {
                    now += ms * MS;
                    let a = full_e.maintain(now);
                    let b = delta_e.maintain(now);
                    proptest::prop_assert_eq!(format!("{a:?}"), format!("{b:?}"));
                }
                WalkOp::Report(full, only_new) => {
                    full_t.refresh(&full_e, now, &mut buf, key_of);
                    delta_t.refresh_changed(&delta_e, now, &mut buf, key_of);
                    let mut lines: [Vec<WalkLine>; 2] = [Vec::new(), Vec::new()];
                    for (t, out) in [&mut full_t, &mut delta_t].into_iter().zip(&mut lines) {
                        t.report(full, only_new && !full, |l| {
                            out.push((
                                l.key.clone(),
                                l.key_handle,
                                l.admitted,
                                l.rejected,
                                l.counting_since_ns,
                                l.in_flight,
                                l.held.map(|h| (h.epoch, h.seq, h.rate, h.burst)),
                            ))
                        });
                    }
                    proptest::prop_assert_eq!(&lines[0], &lines[1]);
                    for l in &lines[0] {
                        proptest::prop_assert!(l.4 <= now, "counting from the future: {l:?}");
                    }
                }
                WalkOp::NewStream => {
                    full_t.new_stream();
                    delta_t.new_stream();
                }
            }
        }
    }
}

#[test]
fn a_grant_that_names_no_key_finds_it_by_the_handle_an_earlier_grant_gave() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    touch(&e, 0, "r1", &[("org", "a")]);
    t.refresh(&e, 0, &mut buf, key_of);
    assert_eq!(t.key_of_handle(42), None);
    t.apply(
        &e,
        SEC,
        vec![grant("org-rps", "a", 10, 1)],
        vec!["org-rps/a".into()],
        &[42],
    );
    assert_eq!(t.key_of_handle(42).map(String::as_str), Some("org-rps/a"));
    assert_eq!(t.key_of_handle(0), None);
    // The allocator says it no longer knows the handle: gone.
    t.forget_handles(&[42]);
    assert_eq!(t.key_of_handle(42), None);
    // Given again, then a new stream: the last stream's handles mean nothing.
    t.apply(
        &e,
        SEC,
        vec![grant("org-rps", "a", 10, 2)],
        vec!["org-rps/a".into()],
        &[43],
    );
    assert_eq!(t.key_of_handle(43).map(String::as_str), Some("org-rps/a"));
    t.new_stream();
    assert_eq!(t.key_of_handle(43), None);
}

/// A report message dropped at the client's full queue was counted as sent: a new
/// key whose first line it held went unnamed until its counts moved. Its keys are
/// named again in the next report now, new-key polls included.
#[test]
fn the_keys_of_a_dropped_report_are_named_again_in_the_next() {
    let e = engine(RULES);
    let mut buf = Vec::new();
    let mut t: SyncTracks<String> = SyncTracks::new(0);
    let (a, b) = ("org-rps/a".to_string(), "org-rps/b".to_string());
    touch(&e, 0, "r1", &[("org", "a")]);
    t.refresh(&e, 0, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(a.clone(), 1, 0, 0)]);
    // Delivered. Then `b` is new, its report is made and dropped.
    touch(&e, SEC / 4, "r2", &[("org", "b")]);
    t.refresh(&e, SEC / 4, &mut buf, key_of);
    assert_eq!(counted(&mut t, false), [(b.clone(), 1, 0, 0)]);
    t.unsend_last_report();
    // The next new-key poll names `b` again (and not `a`, delivered before).
    t.refresh(&e, SEC / 2, &mut buf, key_of);
    let mut only_new = Vec::new();
    t.report(false, true, |l| only_new.push(l.key.clone()));
    assert_eq!(only_new, [b]);
    // Then nothing changed: nothing to say.
    t.refresh(&e, 3 * SEC / 4, &mut buf, key_of);
    assert!(counted(&mut t, false).is_empty());
}
