//! Durable ingest throughput of one node: events per second through
//! `RedbStore::apply` (one write transaction and one fsync per batch: group commit).
//!
//! Each store is first filled with 500,000 events, so the indexes are not trivially
//! small. Two request-id shapes: time-ordered (`node-counter`, UUIDv7-like: the dedupe
//! index grows at one end) and random (UUIDv4-like: inserts land all over the index).
//! Baselines in the same run: a batch of 1 (a commit per event, what group commit
//! avoids) and the in-memory reference store (the merge and digest work with no disk).
//!
//! `cargo bench -p bursar-ledger --bench ingest`; figures in docs/BENCHMARKS.md ("Ledger").
#![allow(missing_docs)] // criterion_main! generates an undocumented `main`.

use std::sync::atomic::{AtomicU64, Ordering};

use bursar_ledger::event::HOUR_MS;
use bursar_ledger::testing::{SplitMix64, usage_stream};
use bursar_ledger::{Event, MemStore, RedbStore, Store};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const NOW: u64 = 490_000 * HOUR_MS;
const PREFILL: u64 = 500_000;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A batch of `n` events with request ids never used before in this process.
fn fresh_batch(n: u64, random_ids: bool) -> Vec<Event> {
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut batch = usage_stream(i, &format!("node-{i:09}"), "bench", n, NOW);
    if random_ids {
        let mut rng = SplitMix64(i);
        for e in &mut batch {
            e.request_id = format!("{:016x}{:016x}", rng.next_u64(), rng.next_u64());
        }
    }
    batch
}

fn filled(dir: &std::path::Path, random_ids: bool) -> RedbStore {
    let store = RedbStore::open_dir(dir).expect("open");
    for _ in 0..PREFILL / 10_000 {
        store
            .apply(&fresh_batch(10_000, random_ids))
            .expect("prefill");
    }
    store
}

fn ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("durable_ingest");
    g.sample_size(10);
    for random_ids in [false, true] {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = filled(dir.path(), random_ids);
        let ids = if random_ids { "random" } else { "ordered" };
        for n in [1u64, 1_000, 10_000, 50_000] {
            g.throughput(Throughput::Elements(n));
            g.bench_function(format!("redb_{ids}_ids_batch_{n}"), |b| {
                b.iter_batched(
                    || fresh_batch(n, random_ids),
                    |batch| store.apply(&batch).expect("apply"),
                    BatchSize::PerIteration,
                )
            });
        }
    }
    let mem = MemStore::new();
    let n = 10_000;
    g.throughput(Throughput::Elements(n));
    g.bench_function(format!("memory_batch_{n}"), |b| {
        b.iter_batched(
            || fresh_batch(n, false),
            |batch| mem.apply(&batch).expect("apply"),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, ingest);
criterion_main!(benches);
