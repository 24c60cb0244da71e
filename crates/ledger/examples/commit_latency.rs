//! Commit latency of `RedbStore::apply` as a store grows: `commits` commits of
//! `events` new events each into a fresh store, time-ordered (`node-counter`) or random
//! (UUIDv4-like) request ids; prints events/s over all commits and the p50, p90 and
//! maximum time of one commit (the maximum is the commit that merged the largest runs of
//! the dedupe index). Criterion's medians hide those merges; this shows them.
//!
//! `cargo run --release -p bursar-ledger --example commit_latency -- random 1000 600`
//! (arguments: `ordered|random`, events per commit, commits). Figures in
//! docs/BENCHMARKS.md ("Ledger").
#![allow(missing_docs)]

use std::time::Instant;

use bursar_ledger::event::HOUR_MS;
use bursar_ledger::testing::{SplitMix64, usage_stream};
use bursar_ledger::{RedbStore, Store};

fn main() {
    let mut args = std::env::args().skip(1);
    let random = match args.next().as_deref() {
        Some("random") => true,
        Some("ordered") | None => false,
        Some(other) => {
            eprintln!(
                "usage: commit_latency [ordered|random] [events per commit] [commits]; got {other:?}"
            );
            std::process::exit(2);
        }
    };
    let number = |s: Option<String>, default: u64| -> u64 {
        s.map_or(default, |s| {
            s.parse().unwrap_or_else(|_| {
                eprintln!("not a positive number: {s:?}");
                std::process::exit(2)
            })
        })
    };
    let events = number(args.next(), 1_000).max(1);
    let commits = number(args.next(), 600).max(1);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = RedbStore::open_dir(dir.path()).expect("open");
    let now = 490_000 * HOUR_MS;
    let mut times = Vec::with_capacity(commits as usize);
    let started = Instant::now();
    for i in 0..commits {
        let mut batch = usage_stream(i, &format!("node-{i:09}"), "bench", events, now);
        if random {
            let mut rng = SplitMix64(i);
            for e in &mut batch {
                e.request_id = format!("{:016x}{:016x}", rng.next_u64(), rng.next_u64());
            }
        }
        let t = Instant::now();
        store.apply(&batch).expect("apply");
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let total_ms: f64 = times.iter().sum();
    times.sort_by(f64::total_cmp);
    println!(
        "{} ids, {commits} commits of {events}: {:.0} events/s; one commit p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms (wall {:.1} s)",
        if random { "random" } else { "ordered" },
        (events * commits) as f64 / (total_ms / 1e3),
        times[times.len() / 2],
        times[times.len() * 9 / 10],
        times[times.len() - 1],
        started.elapsed().as_secs_f64()
    );
}
