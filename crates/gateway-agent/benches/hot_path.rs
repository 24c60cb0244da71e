//! The hot path, side by side with the `governor` crate (keyed, DashMap store) in one
//! harness, so the figures are ratios from one run on one machine.
//!
//! Run: `cargo bench -p bursar-agent --bench hot_path`
//!
//! Both limiters are set so that every check is admitted (the common case), and both
//! look a key up by an integer-like handle: governor hashes a `u64` key into its
//! DashMap; ours finds a pre-resolved `KeyHandle`'s id in the arc-swap table through a
//! per-thread `Worker` cache. Ours reads a coarse clock (one atomic load); governor
//! reads its default clock (quanta). FIELD-NOTES records both clock costs. Ours also
//! counts each check's cost as the key's demand (one atomic add governor has no need
//! for: the allocator sizes the agent's slice from it).
#![allow(missing_docs)] // criterion_group! generates undocumented items

use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bursar_agent::clock::{Clock, CoarseClock};
use bursar_agent::testing::{
    FreshIds, THREE_DIMENSIONS, THREE_DIMENSIONS_COST, THREE_DIMENSIONS_DESCRIPTORS,
    THREE_DIMENSIONS_USAGE, engine, keyed_engine,
};
use bursar_agent::{AdmitRequest, Completion, CompletionStatus, Decision, Engine, KeyHandle};
use criterion::{Criterion, criterion_group, criterion_main};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

const KEYS: usize = 10_000;

fn governor() -> DefaultKeyedRateLimiter<u64> {
    RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX))
}

fn ours() -> (Arc<Engine>, Vec<KeyHandle>) {
    keyed_engine(KEYS)
}

fn single_thread(c: &mut Criterion) {
    let (clock, _driver) = CoarseClock::start(Duration::from_micros(100));
    let (e, handles) = ours();
    let gov = governor();
    for k in 0..KEYS as u64 {
        let _ = gov.check_key(&k);
    }

    let mut g = c.benchmark_group("keyed_check");
    g.bench_function("governor/1_key", |b| {
        b.iter(|| black_box(gov.check_key(black_box(&7u64)).is_ok()))
    });
    let mut w = e.worker();
    g.bench_function("bursar/1_key", |b| {
        b.iter(|| {
            black_box(
                w.try_acquire(clock.now_ns(), black_box(&handles[7]), 1)
                    .expect("ok"),
            )
        })
    });
    let mut i = 0u64;
    g.bench_function("governor/10k_keys", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS as u64;
            black_box(gov.check_key(black_box(&i)).is_ok())
        })
    });
    let mut j = 0usize;
    g.bench_function("bursar/10k_keys", |b| {
        b.iter(|| {
            j = (j + 7919) % KEYS;
            black_box(
                w.try_acquire(clock.now_ns(), black_box(&handles[j]), 1)
                    .expect("ok"),
            )
        })
    });
    g.finish();
}

/// Two threads, `iters` checks each, run at once; the time per iteration is wall time
/// over `iters`, i.e. the cost of one check per thread while the other runs too.
fn two_threads(c: &mut Criterion) {
    let (clock, _driver) = CoarseClock::start(Duration::from_micros(100));
    let (e, handles) = ours();
    let handles = Arc::new(handles);
    let gov = Arc::new(governor());

    let mut g = c.benchmark_group("two_threads");
    for (name, same) in [("distinct_keys", false), ("same_key", true)] {
        g.bench_function(format!("governor/{name}"), |b| {
            b.iter_custom(|iters| {
                let barrier = Arc::new(Barrier::new(2));
                let start = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..2u64 {
                        let (gov, barrier) = (Arc::clone(&gov), Arc::clone(&barrier));
                        s.spawn(move || {
                            barrier.wait();
                            let mut k = t * 5_000;
                            for _ in 0..iters {
                                if !same {
                                    k = t * 5_000 + (k + 7) % 5_000;
                                }
                                black_box(gov.check_key(&k).is_ok());
                            }
                        });
                    }
                });
                start.elapsed()
            })
        });
        g.bench_function(format!("bursar/{name}"), |b| {
            b.iter_custom(|iters| {
                let barrier = Arc::new(Barrier::new(2));
                let start = Instant::now();
                std::thread::scope(|s| {
                    for t in 0..2usize {
                        let (handles, barrier, clock) =
                            (Arc::clone(&handles), Arc::clone(&barrier), clock.clone());
                        let mut w = e.worker();
                        s.spawn(move || {
                            barrier.wait();
                            let mut k = t * 5_000;
                            for _ in 0..iters {
                                if !same {
                                    k = t * 5_000 + (k + 7) % 5_000;
                                }
                                black_box(
                                    w.try_acquire(clock.now_ns(), &handles[k], 1).expect("ok"),
                                );
                            }
                        });
                    }
                });
                start.elapsed()
            })
        });
    }
    g.finish();
}

/// Admit from descriptors over three rules (requests, input tokens, output tokens),
/// with a lease, then complete it with a refund: the whole per-request cost. Each
/// request has a new id, as real traffic does: a finished id is not admitted again
/// while remembered, and each completion leaves a tombstone (the table of finished
/// ids at its bound, the oldest forgotten by the maintenance tick).
fn admit_complete(c: &mut Criterion) {
    let (clock, _driver) = CoarseClock::start(Duration::from_micros(100));
    let e = engine(THREE_DIMENSIONS);
    let mut ids = FreshIds::default();
    let mut w = e.worker();
    let mut next_maintain = 0u64;
    let mut g = c.benchmark_group("admit_complete");
    // By value (`Worker::admit`), and through `Worker::admit_into` with one reused
    // `Decision` (no copy of its ~600 bytes on the way out).
    let mut d = Decision::EMPTY;
    for (name, into) in [
        ("bursar/3_dimensions", false),
        ("bursar/3_dimensions_admit_into", true),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                let id = ids.next_id();
                let now = clock.now_ns();
                let req = AdmitRequest {
                    request_id: id,
                    domain: None,
                    descriptors: &THREE_DIMENSIONS_DESCRIPTORS,
                    cost: THREE_DIMENSIONS_COST,
                    ttl_ms: None,
                };
                if into {
                    w.admit_into(now, &req, &mut d).expect("ok");
                } else {
                    d = w.admit(now, &req).expect("ok");
                }
                // Checked in release too: a drained bucket would turn this into a
                // benchmark of rejections (it did, before the rates were raised).
                assert!(d.is_admitted(), "the benchmark must measure admissions");
                black_box(&d);
                // `admit_into` pairs with the worker's `complete` (its cached table
                // snapshot); the by-value admission with the engine's, as before.
                let c = if into {
                    w.complete(now, id, THREE_DIMENSIONS_USAGE, CompletionStatus::Ok)
                } else {
                    e.complete(now, id, THREE_DIMENSIONS_USAGE, CompletionStatus::Ok)
                }
                .expect("live");
                assert_eq!(c, Completion::Settled, "a live lease settles once");
                // The shell's maintenance tick, every 100 ms as in the shell; its cost
                // is amortised into the figure, as it is in production.
                if now >= next_maintain {
                    e.maintain(now);
                    next_maintain = now + 100_000_000;
                }
                black_box(c)
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(40);
    targets = single_thread, two_threads, admit_complete
}
criterion_main!(benches);
