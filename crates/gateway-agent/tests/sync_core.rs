//! The sync client's bookkeeping (`sync_core`) on a real engine, without a network:
//! what each report names and how, and which grants are acknowledged when.

use bursar_agent::engine::KeyDemand;
use bursar_agent::sync_core::{Applied, SyncTracks};
use bursar_agent::testing::engine;
use bursar_agent::{AdmitRequest, Cost, Engine, SliceUpdate};

const SEC: u64 = 1_000_000_000;

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
    let mut out = Vec::new();
    t.report(full, false, |l| out.push((l.key.clone(), l.key_handle)));
    out
}

#[test]
fn reports_name_changed_keys_by_handle_and_every_key_by_name_when_full() {
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
    assert!(matches!(&out[..], [Applied::Ack(a)] if a.key == "org-rps/a" && a.seq == 1));
    // Its held grant changed: reported by handle; `b` did not change.
    t.refresh(&e, SEC / 2, &mut buf, key_of);
    assert_eq!(lines(&mut t, false), [("org-rps/a".into(), 42)]);
    // A full report names every key, by name.
    assert_eq!(
        lines(&mut t, true),
        [("org-rps/a".into(), 0), ("org-rps/b".into(), 0)]
    );
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
        assert!(matches!(&out[..], [Applied::Ack(_)]));
    }
    let measure = |t: &mut SyncTracks<String>| {
        let mut out = Vec::new();
        t.measure_report(&[7, 42], |l| {
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
