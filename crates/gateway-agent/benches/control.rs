//! The agent's control-plane calls on an engine holding 10,000 keys: what a sync
//! client pays per report (`Engine::key_demand` walks every key) and per grant batch
//! (`Engine::apply_slices` replaces the granted keys' slots and publishes the key
//! table before it returns). Neither is on the decision path, but a gateway with many
//! keys runs them every report interval and on every grant message, and the simulator
//! runs them for a thousand agents in one process.
//!
//! - `control/key_demand_10k_keys`: one walk into a reused buffer.
//! - `control/apply_slices_1_grant_10k_keys`: one grant that changes a key's slice (a
//!   new slot and a publish), cycling over the keys.
//! - `control/apply_slices_16_grants_10k_keys`: a batch of 16 such grants.
//! - `control/sync_refresh_10k_keys`: the sync client's read of every key into its
//!   tracks at a report, keyed as the shell keys them ([`TrackedKey`]);
//!   `..._string_names_baseline` keys them by fresh strings, as the shell did before.
//! - `control/sync_refresh_changed_10k_keys_100_busy`: the report tick's read since
//!   the twelfth session (`SyncTracks::refresh_changed`) and the report it feeds, when
//!   100 of the 10,000 keys admitted a request since the last one;
//!   `control/sync_refresh_every_key_10k_keys_100_busy` is the same tick reading every
//!   key (`SyncTracks::refresh`), in the same run.
//! - `control/maintain_10k_keys`: the maintenance tick (every 100 ms in the shell) when
//!   nothing is due: no lease or slice ended, no key idle long enough.
//!
//! Run: `cargo bench -p bursar-agent --bench control`. Figures: docs/BENCHMARKS.md
//! ("Agent control-plane calls").
// `criterion_group!` generates a public function without docs.
#![allow(missing_docs)]

use std::hint::black_box;

use bursar_agent::engine::{KeyDemand, SliceUpdate};
use bursar_agent::sync_core::{SyncTracks, TrackedKey};
use bursar_agent::testing::{FreshIds, keyed_engine, keyed_grant};
use bursar_agent::{AdmitRequest, CompletionStatus, Cost, Decision, Usage};
use criterion::{Criterion, criterion_group, criterion_main};

const KEYS: usize = 10_000;

fn control(c: &mut Criterion) {
    let mut g = c.benchmark_group("control");
    let (engine, _handles) = keyed_engine(KEYS);
    let mut buf = Vec::with_capacity(KEYS);
    engine.key_demand(&mut buf);
    assert_eq!(buf.len(), KEYS, "every warm key is walked");
    g.bench_function("key_demand_10k_keys", |b| {
        b.iter(|| {
            buf.clear();
            engine.key_demand(&mut buf);
            black_box(buf.len())
        })
    });
    // The sync client's read of every key at a report (`SyncTracks::refresh`): tracks
    // keyed as the shell keys them (`TrackedKey`: the engine's identity of the key, its
    // names shared); and, the named baseline in the same run, as it keyed them until
    // 2026-12-01: a `String` and a `Vec<String>` per key, at every read.
    let mut tracked: SyncTracks<TrackedKey> = SyncTracks::new(0);
    let mut now = 0u64;
    // Once outside the timed loop too: the checks below hold whichever benchmarks a
    // filter (`cargo bench ... -- NAME`) leaves out.
    tracked.refresh(&engine, now, &mut buf, |d| Some(TrackedKey::of(d)));
    g.bench_function("sync_refresh_10k_keys", |b| {
        b.iter(|| {
            now += 250_000_000;
            tracked.refresh(&engine, now, &mut buf, |d| Some(TrackedKey::of(d)));
        })
    });
    let key_7 = TrackedKey::named(&engine, "rps", &["key-7".to_string()]);
    assert!(
        tracked.contains(&key_7),
        "a key named on the wire finds its track"
    );
    let mut strings: SyncTracks<(String, Vec<String>)> = SyncTracks::new(0);
    let string_names = |d: &KeyDemand| {
        Some((
            d.rule.to_string(),
            d.values().iter().map(|v| v.to_string()).collect::<Vec<_>>(),
        ))
    };
    strings.refresh(&engine, now, &mut buf, string_names);
    g.bench_function("sync_refresh_10k_keys_string_names_baseline", |b| {
        b.iter(|| {
            now += 250_000_000;
            strings.refresh(&engine, now, &mut buf, string_names);
        })
    });
    assert!(strings.contains(&("rps".to_string(), vec!["key-7".to_string()])));
    drop(strings);
    // The report tick: 100 keys busy since the last one (a different 100 each time: a
    // request admitted and completed on each, which the counters a report reads
    // count), read by changes or by a walk of every key, then the delta report's lines.
    let (engine2, _) = keyed_engine(KEYS);
    let names: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    // One engine for both loops: their ids must not repeat.
    let mut ids = FreshIds::default();
    for changed_only in [true, false] {
        let mut t: SyncTracks<TrackedKey> = SyncTracks::new(0);
        t.refresh(&engine2, now, &mut buf, |d| Some(TrackedKey::of(d)));
        t.report(true, false, |_| {});
        let mut next = 0usize;
        let name = if changed_only {
            "sync_refresh_changed_10k_keys_100_busy"
        } else {
            "sync_refresh_every_key_10k_keys_100_busy"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                now += 250_000_000;
                for _ in 0..100 {
                    let desc = [("k", names[next % KEYS].as_str())];
                    let id = ids.next_id();
                    let d = engine2
                        .admit(
                            now,
                            &AdmitRequest {
                                request_id: id,
                                domain: None,
                                descriptors: &desc,
                                cost: Cost::ONE_REQUEST,
                                ttl_ms: None,
                            },
                        )
                        .expect("valid");
                    assert!(matches!(d, Decision::Admitted(_)), "{d:?}");
                    engine2
                        .complete(now, id, Usage::default(), CompletionStatus::Ok)
                        .expect("settles");
                    next += 97;
                }
                if changed_only {
                    t.refresh_changed(&engine2, now, &mut buf, |d| Some(TrackedKey::of(d)));
                } else {
                    t.refresh(&engine2, now, &mut buf, |d| Some(TrackedKey::of(d)));
                }
                let mut lines = 0;
                t.report(false, false, |_| lines += 1);
                assert_eq!(lines, 100, "each busy key is reported once ({lines})");
                black_box(lines)
            })
        });
    }
    drop(buf);
    let mut seq = 0u64;
    for batch in [1usize, 16] {
        let mut next = 0usize;
        let mut updates: Vec<SliceUpdate> = Vec::with_capacity(batch);
        g.bench_function(
            format!(
                "apply_slices_{batch}_grant{}_10k_keys",
                if batch == 1 { "" } else { "s" }
            ),
            |b| {
                b.iter(|| {
                    updates.clear();
                    for _ in 0..batch {
                        seq += 1;
                        // A different slice every time: the slot is replaced.
                        updates.push(keyed_grant(next % KEYS, seq));
                        next += 7;
                    }
                    let applied = engine.apply_slices(1, &updates);
                    assert!(applied.iter().all(|r| r.is_ok()), "{applied:?}");
                    black_box(applied.len())
                })
            },
        );
    }
    // A tick with nothing due: the leases of the slices granted above are far off, and
    // the clock cycles through the first 30 s (keys go idle after 60).
    let mut tick = 0u64;
    g.bench_function("maintain_10k_keys", |b| {
        b.iter(|| {
            tick = (tick + 1) % 300;
            let r = engine.maintain(2 + tick * 100_000_000);
            assert_eq!((r.slices_expired, r.keys_evicted), (0, 0), "nothing is due");
            black_box(r)
        })
    });
    g.finish();
}

criterion_group!(
    name = benches;
    config = Criterion::default();
    targets = control
);
criterion_main!(benches);
