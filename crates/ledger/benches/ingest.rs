//! Durable ingest throughput of one node: events per second through
//! `RedbStore::apply` (one write transaction and one fsync per batch: group commit),
//! for several batch sizes. Baselines in the same run: a batch of 1 (a commit per
//! event, what group commit avoids) and the in-memory reference store (no disk).
//!
//! `cargo bench -p bursar-ledger --bench ingest`; figures in docs/benchmarks-ledger.md.
#![allow(missing_docs)] // criterion_main! generates an undocumented `main`.

use std::sync::atomic::{AtomicU64, Ordering};

use bursar_ledger::event::HOUR_MS;
use bursar_ledger::testing::usage_stream;
use bursar_ledger::{Event, MemStore, RedbStore, Store};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const NOW: u64 = 490_000 * HOUR_MS;

static NEXT: AtomicU64 = AtomicU64::new(0);

/// A batch of `n` events with request ids never used before in this process.
fn fresh_batch(n: u64) -> Vec<Event> {
    let i = NEXT.fetch_add(1, Ordering::Relaxed);
    usage_stream(i, &format!("b{i}"), "bench", n, NOW)
}

fn ingest(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbStore::open_dir(dir.path()).expect("open");
    let mem = MemStore::new();
    let mut g = c.benchmark_group("durable_ingest");
    g.sample_size(10);
    for n in [1u64, 100, 1_000, 10_000] {
        g.throughput(Throughput::Elements(n));
        g.bench_function(format!("redb_batch_{n}"), |b| {
            b.iter_batched(
                || fresh_batch(n),
                |batch| store.apply(&batch).expect("apply"),
                BatchSize::PerIteration,
            )
        });
    }
    let n = 10_000;
    g.throughput(Throughput::Elements(n));
    g.bench_function(format!("memory_batch_{n}"), |b| {
        b.iter_batched(
            || fresh_batch(n),
            |batch| mem.apply(&batch).expect("apply"),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, ingest);
criterion_main!(benches);
