//! Allocation benchmarks at the design's scale: 1,000 agents x 100,000 active keys,
//! 1,000,000 key-agent demand entries with Zipf-spread popularity (the hottest keys are
//! held by every agent, the tail by one).
//!
//! - `full_pass/1000_agents_100k_keys_1M_entries`: one allocation of every key from
//!   reported demand, issuing every grant (about a million).
//! - `full_pass/..._drained_to_wire`: the same pass, then every grant drained into a
//!   protobuf grant batched per agent, as the shell's `route` does.
//! - `full_pass/..._in_rounds_of_64k_drained`: the same allocation with `max_outbox`
//!   65,536: the core fills the outbox, the grants are drained (named), and
//!   `handle_timeout` goes on, until every key is done. Bounded memory for the outbox
//!   (2.6 MB reused instead of 40 MB of fresh pages), the naming drain included.
//! - `full_pass/..._regrant`: every key recomputed again once granted (few grants
//!   change).
//! - `report/100_keys`: one agent's report of 100 keys (demand changed on each), as the
//!   shell would feed it: `handle_report`, then `handle_timeout` recomputing the keys it
//!   marked (with `recompute_delay_ms = 0`), at the real rate of 4,000 reports per
//!   virtual second (each agent every 250 ms), agents carrying the grants they last
//!   received and naming keys by the handles grants carried (by name every 8th
//!   report, as the sync client); it includes lease renewals (one extension per agent every quarter
//!   hold, drained), whole-key passes of large keys on their schedule and the
//!   amortised expiry sweep. Only the allocator's calls are timed.
//! - `report/100_keys_routed_as_the_shell`: `report/100_keys` with the grants drained
//!   as the shell's `route` drains them (`for_each_grant`, each encoded into a protobuf
//!   grant, batched per agent stream) instead of into owned `Grant`s, from agents as
//!   today's sync client: every line by handle (full reports too), grants found by
//!   handle (a key named in its first grant on the stream only).
//! - `report/100_keys_handle_report_only`: the same without the recomputation.
//! - `report/100_keys_baseline_whole_key_recompute`: the named baseline, measured in the
//!   same run: every changed key recomputed whole (`large_key_entries = usize::MAX`),
//!   as the core did before single-entry updates.
//! - `report/100_keys_large_key_entries_8`: the same as `report/100_keys` with
//!   `large_key_entries = 8` instead of the default 32 (keys of 9 to 32 agents re-target
//!   the reporting entry and are recomputed whole on a schedule, instead of whole at
//!   every report): what that knob buys, not the default.
//! - `report/100_keys_default_recompute_delay`: `report/100_keys` with the default
//!   `recompute_delay_ms` (10) instead of 0: a key is recomputed when its delay is
//!   due, once for all the reports that changed it in between (about 40 reports land
//!   in 10 ms at this rate), so the figure is the report's amortised share.
//!
//! Run: `cargo bench -p bursar-allocator --bench allocation`. Figures:
//! docs/BENCHMARKS.md ("Allocator core").
// `criterion_group!` generates a public function without docs.
#![allow(missing_docs)]

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use bursar_allocator::AllocatorConfig;
use bursar_allocator::shell::driver::grant_to_pb;
use bursar_allocator::testing::fleet::{
    ENTRIES, Reporter, RoutedBatch, fleet, fleet_with, zipf_counts,
};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};

const MS: u64 = 1_000_000;

fn full_pass(c: &mut Criterion) {
    let f = fleet(10, AllocatorConfig::default().large_key_entries);
    println!(
        "fleet: {} agents, {} keys, {} key-agent entries; hottest key on {} agents",
        f.alloc.agent_count(),
        f.alloc.key_count(),
        f.alloc.entry_count(),
        zipf_counts()[0]
    );
    let mut g = c.benchmark_group("full_pass");
    g.sample_size(10);
    // From reported demand to a grant for every entry (about a million grants).
    g.bench_function("1000_agents_100k_keys_1M_entries", |b| {
        b.iter_batched(
            || f.alloc.clone(),
            |mut a| {
                a.reallocate_all(f.now + 20 * MS);
                let n = a.pending_grants();
                assert!(n >= ENTRIES / 2, "{n} grants");
                a
            },
            BatchSize::LargeInput,
        )
    });
    // The same pass, then the outbox drained into wire grants batched per agent, as
    // the shell's `route` does (names resolved, key strings copied into protobuf):
    // what the pass hands on to the shell, measured with it.
    g.bench_function("1000_agents_100k_keys_1M_entries_drained_to_wire", |b| {
        b.iter_batched(
            || f.alloc.clone(),
            |mut a| {
                a.reallocate_all(f.now + 20 * MS);
                let mut batches: HashMap<u32, Vec<_>> = HashMap::new();
                a.for_each_grant(|g| {
                    batches
                        .entry(g.agent_index)
                        .or_default()
                        .push(grant_to_pb(&g))
                });
                let n: usize = batches.values().map(Vec::len).sum();
                assert!(n >= ENTRIES / 2, "{n} grants");
                (a, batches)
            },
            BatchSize::LargeInput,
        )
    });
    // The same allocation with the outbox bounded to ROUND grants: the core allocates
    // until the outbox is full, the grants are drained (named, as the shell's `route`
    // does before it encodes them), and `handle_timeout` goes on where it stopped. The
    // outbox's memory is reused from round to round instead of a million records
    // landing on fresh pages.
    const ROUND: usize = 65_536;
    let rounds = fleet_with(AllocatorConfig {
        max_outbox: ROUND,
        ..AllocatorConfig::default()
    });
    g.bench_function(
        "1000_agents_100k_keys_1M_entries_in_rounds_of_64k_drained",
        |b| {
            b.iter_batched(
                || rounds.alloc.clone(),
                |mut a| {
                    let mut t = rounds.now + 20 * MS;
                    a.reallocate_all(t);
                    let mut n = 0usize;
                    loop {
                        a.for_each_grant(|g| {
                            n += 1;
                            black_box(g.agent.len() + g.key.rule.len());
                        });
                        if a.poll_timeout() > t {
                            break;
                        }
                        t += 1;
                        a.handle_timeout(t);
                    }
                    assert!(n >= ENTRIES / 2, "{n} grants");
                    a
                },
                BatchSize::LargeInput,
            )
        },
    );
    // Every key recomputed again once all are granted (the pass after a config reload
    // or the end of a term's learning): the arithmetic without a million new grants.
    let mut granted = f.alloc.clone();
    granted.reallocate_all(f.now + 20 * MS);
    granted.drain_grants().for_each(drop);
    g.bench_function("1000_agents_100k_keys_1M_entries_regrant", |b| {
        b.iter_batched(
            || granted.clone(),
            |mut a| {
                a.reallocate_all(f.now + 40 * MS);
                a
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn report(c: &mut Criterion) {
    let mut g = c.benchmark_group("report");
    let mut out = Vec::new();
    let default_large = AllocatorConfig::default().large_key_entries;
    // The baseline: every key recomputed whole whenever its demand changes.
    let default_delay = AllocatorConfig::default().recompute_delay_ms;
    for (label, large, delay, recompute) in [
        ("100_keys", default_large, 0, true),
        ("100_keys_handle_report_only", default_large, 0, false),
        ("100_keys_baseline_whole_key_recompute", usize::MAX, 0, true),
        ("100_keys_large_key_entries_8", 8, 0, true),
        (
            "100_keys_default_recompute_delay",
            default_large,
            default_delay,
            true,
        ),
    ] {
        let mut r = Reporter::new(large, delay);
        if label == "100_keys" {
            // The same reports with the grants drained as the shell's `route` does,
            // from agents that name keys by handle in every report and find grants'
            // keys by handle (today's sync client).
            let mut routed = Reporter::new(large, delay).with_handles_in_full_reports();
            let mut batch = RoutedBatch::new();
            g.bench_function("100_keys_routed_as_the_shell", |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let i = routed.prepare();
                        let t = Instant::now();
                        routed.report_routed(i, &mut batch);
                        spent += t.elapsed();
                        black_box(batch.len());
                        routed.deliver_routed(&mut batch);
                    }
                    spent
                })
            });
        }
        g.bench_function(label, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let i = r.prepare();
                    let t = Instant::now();
                    r.report(i, recompute, &mut out);
                    spent += t.elapsed();
                    black_box(out.len());
                    r.deliver(&out);
                    out.clear();
                }
                spent
            })
        });
    }
    g.finish();
}

criterion_group!(
    name = benches;
    config = Criterion::default();
    targets = full_pass, report
);
criterion_main!(benches);
