//! Property tests of merge, digests and reconciliation: the ledger's totals and digests
//! are a function of the *set* of events, never of arrival order, duplication or
//! batching, and reconciling two ledgers gives both the state of their union.

use std::ops::ControlFlow;

use bursar_ledger::digest::{Bucket, Digest};
use bursar_ledger::event::{Body, Event, HOUR_MS, Status, TokenDeltas, Tokens};
use bursar_ledger::reconcile::{ReconcileLimits, reconcile_in_memory};
use bursar_ledger::store::{MemStore, Store, usage_totals};
use bursar_ledger::totals::{TotalsLimits, UsageTotals};
use bursar_ledger::{EventKey, RedbStore};
use proptest::prelude::*;

const NOW: u64 = 490_000 * HOUR_MS;

/// Events over few request ids, tenants, models and hours, so that duplicates,
/// conflicts (same id, other payload) and corrections all occur.
fn event() -> impl Strategy<Value = Event> {
    (
        0u8..24,
        0u8..3,
        0u8..2,
        0u64..4,
        0u8..4,
        0u8..10,
        (0u64..5_000, 0u64..5_000, 0u64..2_000),
        (0u8..24, -300i64..300),
    )
        .prop_map(
            |(id, tenant, model, hour, origin, kind, (input, cached, output), (target, delta))| {
                let body = match kind {
                    0 => Body::Void {
                        target: EventKey::from_request_id(&format!("r{target}")),
                    },
                    1 => Body::Adjust {
                        target: EventKey::from_request_id(&format!("r{target}")),
                        deltas: TokenDeltas {
                            input_tokens: delta,
                            cached_input_tokens: delta / 3,
                            output_tokens: -delta,
                        },
                    },
                    _ => Body::Usage {
                        status: Status::ALL[usize::from(kind) % 4],
                        tokens: Tokens {
                            input_tokens: input,
                            cached_input_tokens: cached.min(input),
                            output_tokens: output,
                        },
                    },
                };
                Event {
                    request_id: if matches!(body, Body::Usage { .. }) {
                        format!("r{id}")
                    } else {
                        format!("c{id}")
                    },
                    origin: format!("agent-{origin}"),
                    seq: u64::from(id),
                    tenant: ["acme", "globex", "initech"][usize::from(tenant)].to_string(),
                    descriptors: vec![],
                    model: ["gpt-4o", "claude"][usize::from(model)].to_string(),
                    time_ms: NOW - hour * HOUR_MS,
                    body,
                }
            },
        )
}

/// Everything observable about a store's state (scan order aside).
#[derive(Debug, PartialEq)]
struct Observed {
    root: Digest,
    digests: Vec<(Bucket, Digest)>,
    events: Vec<Event>,
    conflicts: Vec<(EventKey, Vec<u8>)>,
    totals: Vec<UsageTotals>,
}

fn observe(s: &dyn Store) -> Observed {
    let mut events = Vec::new();
    s.scan(0, u64::MAX, None, &mut |_, e| {
        events.push(e.clone());
        ControlFlow::Continue(())
    })
    .unwrap();
    // Within a bucket, scans run in this node's arrival order: compare as sets.
    events.sort_by_key(Event::encode);
    let mut conflicts: Vec<_> = s
        .conflicts(usize::MAX)
        .unwrap()
        .into_iter()
        .map(|c| (c.key, c.loser.encode()))
        .collect();
    conflicts.sort();
    let totals = ["acme", "globex", "initech"]
        .iter()
        .map(|t| usage_totals(s, t, 0, u64::MAX, true, TotalsLimits::default()).unwrap())
        .collect();
    Observed {
        root: s.root().unwrap(),
        digests: s.digests(0, u64::MAX, None).unwrap(),
        events,
        conflicts,
        totals,
    }
}

fn apply_in_batches(s: &dyn Store, events: &[Event], cuts: &[usize]) {
    let mut start = 0;
    for &c in cuts {
        let end = (start + c).min(events.len());
        s.apply(&events[start..end]).unwrap();
        start = end;
    }
    s.apply(&events[start..]).unwrap();
}

/// A permutation of `events` with some of them repeated, driven by `picks`.
fn shuffled_with_duplicates(events: &[Event], picks: &[(usize, bool)]) -> Vec<Event> {
    let mut out = events.to_vec();
    for (i, &(p, dup)) in picks.iter().enumerate() {
        if out.is_empty() {
            break;
        }
        let a = i % out.len();
        let b = p % out.len();
        out.swap(a, b);
        if dup {
            out.push(out[b].clone());
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn any_permutation_duplication_and_batching_gives_identical_state(
        events in prop::collection::vec(event(), 0..60),
        picks in prop::collection::vec((0usize..1000, any::<bool>()), 0..80),
        cuts_a in prop::collection::vec(0usize..10, 0..8),
        cuts_b in prop::collection::vec(0usize..10, 0..8),
    ) {
        let a = MemStore::new();
        apply_in_batches(&a, &events, &cuts_a);
        let b = MemStore::new();
        let other = shuffled_with_duplicates(&events, &picks);
        apply_in_batches(&b, &other, &cuts_b);
        a.check_invariants();
        b.check_invariants();
        prop_assert_eq!(observe(&a), observe(&b));
    }

    #[test]
    fn the_digest_counts_each_key_once_and_totals_never_exceed_raw_usage(
        events in prop::collection::vec(event(), 0..60),
    ) {
        let s = MemStore::new();
        s.apply(&events).unwrap();
        s.apply(&events).unwrap();
        let mut keys: Vec<EventKey> = events.iter().map(Event::key).collect();
        keys.sort();
        keys.dedup();
        prop_assert_eq!(s.root().unwrap().events, keys.len() as u64);
        for t in observe(&s).totals {
            // Voids only remove, adjusts clamp at 0: requests never exceed usage events.
            prop_assert!(u128::from(t.total.requests) <= u128::from(t.digest.events - t.digest.corrections));
            prop_assert!(t.total.cached_input_tokens <= t.total.input_tokens);
        }
    }
}

proptest! {
    // Each case fsyncs a few redb commits on a real file: few cases.
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn redb_and_the_reference_model_agree_on_any_arrival_order(
        events in prop::collection::vec(event(), 0..60),
        picks in prop::collection::vec((0usize..1000, any::<bool>()), 0..80),
        cuts in prop::collection::vec(0usize..20, 0..4),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let r = RedbStore::open_dir(dir.path()).unwrap();
        apply_in_batches(&r, &shuffled_with_duplicates(&events, &picks), &cuts);
        let m = MemStore::new();
        m.apply(&events).unwrap();
        prop_assert_eq!(observe(&r), observe(&m));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn reconciling_any_two_ledgers_gives_both_the_state_of_the_union(
        a_events in prop::collection::vec(event(), 0..60),
        b_events in prop::collection::vec(event(), 0..60),
        buckets_max in 1usize..20,
        events_max in 4usize..80,
        split_above in 0usize..100,
        bytes_max in prop_oneof![Just(usize::MAX), 1usize..20_000],
        offer_bytes_max in prop_oneof![Just(16usize << 20), 0usize..2_000],
    ) {
        let a = MemStore::new();
        a.apply(&a_events).unwrap();
        let b = MemStore::new();
        b.apply(&b_events).unwrap();
        // Small events_max and split_above: buckets over either are reconciled by
        // sub-bucket (one level; every sub-bucket here holds far fewer than 4 events).
        // And a small bytes_max: buckets whose events would not fit the bytes of one
        // message travel in whole sub-buckets. At least four events' worth, as
        // events_max is at least 4: a single sub-bucket over the bound is the known
        // limit of one level of splitting (its first events would be sent every round).
        let largest = a_events
            .iter()
            .chain(&b_events)
            .map(bursar_ledger::reconcile::event_wire_bytes)
            .max()
            .unwrap_or(0);
        let bytes_max = bytes_max.max(4 * largest);
        // And a small offer_bytes_max: offers end inside an hour (one bucket at least).
        let limits = ReconcileLimits {
            buckets_max,
            events_max,
            split_above,
            bytes_max,
            offer_bytes_max,
            window_seed: 0,
        };
        let (rounds, _) = reconcile_in_memory(&a, &b, &limits, 100).unwrap();
        prop_assert!(rounds < 100, "did not converge");
        let union = MemStore::new();
        union.apply(&a_events).unwrap();
        union.apply(&b_events).unwrap();
        let (mut oa, mut ob, mut ou) = (observe(&a), observe(&b), observe(&union));
        // Conflict records stay where the conflict was seen; compare the rest.
        oa.conflicts.clear();
        ob.conflicts.clear();
        ou.conflicts.clear();
        prop_assert_eq!(&oa, &ou);
        prop_assert_eq!(&ob, &ou);
        a.check_invariants();
        b.check_invariants();
    }
}
