//! The conformance suite every [`Store`] backend must pass.
//!
//! A backend's test calls [`run`] with two closures: one that makes a fresh, empty
//! store, and one that closes a store and opens it again from the same place (for a
//! durable backend; an in-memory one returns it unchanged). Each check compares the
//! backend against [`MemStore`], the reference model, and panics with the check's
//! name on a difference.
//!
//! ```
//! use bursar_ledger::{conformance, store::MemStore};
//! conformance::run(&mut || MemStore::new(), &mut |s| s);
//! ```

use std::ops::ControlFlow;

use crate::digest::Bucket;
use crate::event::{Event, HOUR_MS, TokenDeltas};
use crate::merge::Outcome;
use crate::store::{Cursor, MemStore, Store, usage_totals};
use crate::testing::{correction, usage, usage_stream};
use crate::totals::TotalsLimits;

const NOW: u64 = 490_000 * HOUR_MS;

/// Runs every check. `fresh` makes an empty store; `reopen` closes a store and opens
/// it again from the same place.
pub fn run<S: Store>(fresh: &mut dyn FnMut() -> S, reopen: &mut dyn FnMut(S) -> S) {
    new_duplicate_and_conflict_are_reported(fresh());
    conflicts_resolve_to_the_same_event_in_every_arrival_order(fresh);
    digests_scans_and_conflicts_match_the_reference_model(fresh());
    a_late_event_lands_in_its_own_hour_and_a_later_duplicate_counts_once(fresh());
    corrections_change_totals_and_not_the_event_count(fresh());
    an_empty_batch_changes_nothing(fresh());
    everything_acknowledged_survives_a_reopen(fresh(), reopen);
    the_store_id_is_kept_by_a_reopen_and_new_for_a_new_store(fresh, reopen);
}

fn the_store_id_is_kept_by_a_reopen_and_new_for_a_new_store<S: Store>(
    fresh: &mut dyn FnMut() -> S,
    reopen: &mut dyn FnMut(S) -> S,
) {
    let a = fresh();
    let id = a.store_id().to_string();
    assert!(!id.is_empty(), "conformance: a store has an id");
    a.apply(&[usage("r1", "acme", "m", NOW, 1, 0, 1)])
        .expect("apply");
    let a = reopen(a);
    assert_eq!(a.store_id(), id, "conformance: a reopen keeps the store id");
    let b = fresh();
    assert_ne!(
        b.store_id(),
        id,
        "conformance: a new (empty) store has an id of its own"
    );
}

fn new_duplicate_and_conflict_are_reported(s: impl Store) {
    let a = usage("r1", "acme", "m", NOW, 10, 0, 5);
    let b = usage("r2", "acme", "m", NOW, 1, 0, 1);
    let mut a2 = a.clone();
    a2.body = usage("r1", "acme", "m", NOW, 11, 0, 5).body;
    let r = s.apply(&[a.clone(), b.clone(), a.clone()]).expect("apply");
    assert_eq!(
        r.outcomes,
        vec![Outcome::New, Outcome::New, Outcome::Duplicate],
        "conformance: outcomes of one batch"
    );
    assert_eq!((r.new, r.duplicate, r.conflict), (2, 1, 0));
    let r = s.apply(&[b, a2]).expect("apply");
    assert_eq!(r.outcomes, vec![Outcome::Duplicate, Outcome::Conflict]);
    assert_eq!(
        s.root().expect("root").events,
        2,
        "conformance: a conflict counts once"
    );
    assert_eq!(s.conflicts(10).expect("conflicts").len(), 1);
}

fn conflicts_resolve_to_the_same_event_in_every_arrival_order<S: Store>(
    fresh: &mut dyn FnMut() -> S,
) {
    let x = usage("same", "acme", "m", NOW, 10, 0, 5);
    let mut y = x.clone();
    y.origin = "agent-z".into();
    let mut z = x.clone();
    z.time_ms = NOW - 5 * HOUR_MS; // another bucket: a replace must move the index
    let orders: [[&Event; 3]; 4] = [[&x, &y, &z], [&z, &y, &x], [&y, &x, &z], [&y, &z, &x]];
    let mut seen = Vec::new();
    for order in orders {
        for one_batch in [true, false] {
            let s = fresh();
            if one_batch {
                let batch: Vec<Event> = order.iter().map(|e| (*e).clone()).collect();
                s.apply(&batch).expect("apply");
            } else {
                for e in order {
                    s.apply(std::slice::from_ref(e)).expect("apply");
                }
            }
            let kept = s.event(&x.request_id).expect("event").expect("present");
            let digests = s.digests(0, u64::MAX, None).expect("digests");
            let mut losers: Vec<Event> = s
                .conflicts(10)
                .expect("conflicts")
                .into_iter()
                .map(|c| c.loser)
                .collect();
            losers.sort_by_key(Event::encode);
            let mut scanned = Vec::new();
            s.scan(0, u64::MAX, None, &mut |_, e| {
                scanned.push(e.clone());
                ControlFlow::Continue(())
            })
            .expect("scan");
            assert_eq!(
                scanned,
                vec![kept.clone()],
                "conformance: one event per key"
            );
            seen.push((kept, digests, losers));
        }
    }
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "conformance: conflict resolution depends on arrival order"
    );
    assert_eq!(seen[0].2.len(), 2, "conformance: both losers recorded");
}

fn digests_scans_and_conflicts_match_the_reference_model(s: impl Store) {
    let reference = MemStore::new();
    let mut events = usage_stream(7, "req", "agent-a", 3_000, NOW);
    // Duplicates and a conflict or two, spread over batches.
    events.extend(usage_stream(7, "req", "agent-a", 500, NOW));
    events.extend(usage_stream(8, "req", "agent-b", 20, NOW));
    for batch in events.chunks(700) {
        let got = s.apply(batch).expect("apply");
        let want = reference.apply(batch).expect("reference apply");
        assert_eq!(
            got, want,
            "conformance: batch outcomes differ from the model"
        );
    }
    reference.check_invariants();
    assert_eq!(s.root().expect("root"), reference.root().expect("root"));
    let all = |st: &dyn Store| st.digests(0, u64::MAX, None).expect("digests");
    assert_eq!(all(&s), all(&reference), "conformance: bucket digests");
    let mut sum = crate::digest::Digest::default();
    for (_, d) in all(&s) {
        sum.add(&d);
    }
    assert_eq!(
        sum,
        s.root().expect("root"),
        "conformance: root is the sum of buckets"
    );
    // A read view answers the same root as the store (one view serves both the root
    // and its buckets in `GET /v1/digest`).
    let mut view_root = None;
    s.read_view(&mut |v| view_root = Some(v.root().expect("root in a view")))
        .expect("read view");
    assert_eq!(view_root, Some(sum), "conformance: a read view's root");
    // Bounded: the same list up to `max`, none past it (found without building it).
    let n = all(&s).len();
    assert_eq!(
        s.digests_at_most(0, u64::MAX, None, n).expect("digests"),
        Some(all(&s)),
        "conformance: digests_at_most at the count"
    );
    assert_eq!(
        s.digests_at_most(0, u64::MAX, None, n - 1)
            .expect("digests"),
        None,
        "conformance: digests_at_most below the count"
    );
    // The newest ones before an hour, whole hours (reconciliation's offer): as the
    // model's, which cuts the whole list.
    let list = all(&s);
    let mid = list[list.len() / 2].0.hour;
    let inside = list[list.len() / 3].0.clone();
    let ends = [
        crate::digest::Bucket {
            hour: u64::MAX,
            tenant: String::new(),
        },
        crate::digest::Bucket {
            hour: mid + 1,
            tenant: String::new(),
        },
        crate::digest::Bucket {
            hour: mid,
            tenant: String::new(),
        },
        inside,
        list[0].0.clone(),
        crate::digest::Bucket::default(),
    ];
    let entry = crate::reconcile::offer_entry_bytes(&list[0].0);
    for to in &ends {
        for max in [0, 1, 2, 3, n / 2, n - 1, n, n + 5] {
            for bytes_max in [0, entry, 3 * entry, 10 * entry, usize::MAX] {
                let got = s.newest_digests(to, max, bytes_max).expect("newest");
                assert_eq!(
                    got,
                    reference
                        .newest_digests(to, max, bytes_max)
                        .expect("newest"),
                    "conformance: newest_digests before {to:?}, at most {max}, {bytes_max} bytes"
                );
                assert!(got.0.iter().all(|(b, _)| b < to && *b >= got.1));
            }
        }
    }
    let some = all(&s)[3].0.clone();
    assert_eq!(
        s.digests(some.hour, some.hour + 1, Some(&some.tenant))
            .expect("digests"),
        reference
            .digests(some.hour, some.hour + 1, Some(&some.tenant))
            .expect("digests"),
        "conformance: digests of one tenant and hour"
    );
    let collect = |st: &dyn Store, from: u64, to: u64, after: Option<&Cursor>| {
        let mut v = Vec::new();
        st.scan(from, to, after, &mut |c, e| {
            v.push((c.clone(), e.clone()));
            ControlFlow::Continue(())
        })
        .expect("scan");
        v
    };
    let (from, to) = (NOW / HOUR_MS - 30, NOW / HOUR_MS - 10);
    // Same arrival order as the model, so the same scan order.
    let got = collect(&s, from, to, None);
    let events_of = |v: &[(Cursor, Event)]| v.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>();
    assert_eq!(
        events_of(&got),
        events_of(&collect(&reference, from, to, None)),
        "conformance: scan"
    );
    assert!(got.len() > 20);
    assert!(
        got.iter()
            .all(|(c, e)| c.0 == Bucket::of(e) && (from..to).contains(&e.hour())),
        "conformance: scan cursors name the event's bucket"
    );
    assert!(
        got.windows(2).all(|w| w[0].0 < w[1].0),
        "conformance: scan runs in cursor order"
    );
    assert_eq!(
        events_of(&collect(&s, from, to, Some(&got[10].0))),
        events_of(&got[11..]),
        "conformance: scan after a cursor"
    );
    let mut first = Vec::new();
    s.scan(from, to, None, &mut |_, e| {
        first.push(e.clone());
        if first.len() == 5 {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })
    .expect("scan");
    assert_eq!(
        first,
        events_of(&got[..5]),
        "conformance: scan stops on Break"
    );
    let mut in_bucket = Vec::new();
    s.visit_bucket(&some, &mut |e| in_bucket.push(e.clone()))
        .expect("visit");
    let mut want = Vec::new();
    reference
        .visit_bucket(&some, &mut |e| want.push(e.clone()))
        .expect("visit");
    assert_eq!(in_bucket, want, "conformance: visit_bucket");
    assert!(in_bucket.iter().all(|e| Bucket::of(e) == some));
    let conflicts = |st: &dyn Store| {
        st.conflicts(1000)
            .expect("conflicts")
            .into_iter()
            .map(|c| (c.key, c.loser))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        conflicts(&s),
        conflicts(&reference),
        "conformance: conflicts"
    );
    assert_eq!(conflicts(&s).len(), 20);
}

fn a_late_event_lands_in_its_own_hour_and_a_later_duplicate_counts_once(s: impl Store) {
    let late = usage("late", "acme", "m", NOW - 35 * 24 * HOUR_MS + 17, 100, 0, 7);
    let today = usage("today", "acme", "m", NOW, 1, 0, 1);
    s.apply(&[today, late.clone()]).expect("apply");
    // "A week later" the same event is delivered again, alone and in a batch.
    let r = s
        .apply(&[late.clone(), usage("x", "acme", "m", NOW, 1, 0, 1)])
        .expect("apply");
    assert_eq!(r.outcomes[0], Outcome::Duplicate);
    let late_hour = late.time_ms / HOUR_MS;
    let d = s
        .digests(late_hour, late_hour + 1, Some("acme"))
        .expect("digests");
    assert_eq!(d.len(), 1, "conformance: the late event has its own bucket");
    assert_eq!(d[0].1.events, 1);
    assert_eq!(d[0].1.input_tokens, 100);
    let t = usage_totals(
        &s,
        "acme",
        late_hour,
        late_hour + 1,
        false,
        TotalsLimits::default(),
    )
    .expect("totals");
    assert_eq!(t.total.requests, 1, "conformance: a duplicate counts once");
    assert_eq!(t.total.input_tokens, 100);
}

fn corrections_change_totals_and_not_the_event_count(s: impl Store) {
    let a = usage("a", "acme", "gpt", NOW, 100, 10, 50);
    let b = usage("b", "acme", "claude", NOW, 200, 0, 20);
    let void = correction("void-a", &a, None);
    let adjust = correction(
        "adj-b",
        &b,
        Some(TokenDeltas {
            input_tokens: -50,
            cached_input_tokens: 0,
            output_tokens: 5,
        }),
    );
    s.apply(&[void, a, b, adjust]).expect("apply");
    let h = NOW / HOUR_MS;
    let t = usage_totals(&s, "acme", h, h + 1, true, TotalsLimits::default()).expect("totals");
    assert_eq!(t.digest.events, 4);
    assert_eq!(t.digest.corrections, 2);
    assert_eq!(t.voided, 1);
    assert_eq!(t.adjusted, 1);
    assert_eq!(t.total.requests, 1);
    assert_eq!(t.total.input_tokens, 150);
    assert_eq!(t.total.output_tokens, 25);
    assert_eq!(
        t.groups.len(),
        1,
        "conformance: the voided model has no group"
    );
    assert!(t.groups.contains_key("claude"));
}

fn an_empty_batch_changes_nothing(s: impl Store) {
    let r = s.apply(&[]).expect("apply");
    assert!(r.outcomes.is_empty());
    assert!(s.root().expect("root").is_empty());
    assert!(s.digests(0, u64::MAX, None).expect("digests").is_empty());
}

fn everything_acknowledged_survives_a_reopen<S: Store>(s: S, reopen: &mut dyn FnMut(S) -> S) {
    let events = usage_stream(11, "dur", "agent-a", 2_000, NOW);
    let mut x = events[0].clone();
    x.origin = "zzz".into();
    s.apply(&events[..1000]).expect("apply");
    s.apply(&events[1000..]).expect("apply");
    s.apply(&[x]).expect("apply");
    let root = s.root().expect("root");
    let digests = s.digests(0, u64::MAX, None).expect("digests");
    let conflicts = s.conflicts(10).expect("conflicts");
    let s = reopen(s);
    assert_eq!(
        s.root().expect("root"),
        root,
        "conformance: root after reopen"
    );
    assert_eq!(s.digests(0, u64::MAX, None).expect("digests"), digests);
    assert_eq!(s.conflicts(10).expect("conflicts"), conflicts);
    // events[0] lost or won its conflict with x; every other one is as written.
    assert!(s.event(&events[0].request_id).expect("event").is_some());
    for e in &events[1..] {
        assert_eq!(s.event(&e.request_id).expect("event").as_ref(), Some(e));
    }
    assert_eq!(s.event("never-sent").expect("event"), None);
    let r = s.apply(&events).expect("apply");
    assert_eq!(r.new, 0, "conformance: nothing is new after a reopen");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_model_passes_its_own_suite() {
        run(&mut MemStore::new, &mut |s| s);
    }
}
