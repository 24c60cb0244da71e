//! The criterion harness's `full_pass/1000_agents_100k_keys_1M_entries` as a plain
//! program, for `perf record` and valgrind: the fleet is built once, then each round
//! clones it (not timed) and runs one `reallocate_all` (timed; the wall time of each
//! round is printed), with the page faults the pass took (Linux: `minflt` of
//! /proc/self/stat; the fresh outbox is most of them).
//!
//! `cargo run --release -p bursar-allocator --example full_pass_loop -- 10`

use std::time::Instant;

use bursar_allocator::AllocatorConfig;
use bursar_allocator::testing::fleet::fleet;

const MS: u64 = 1_000_000;

fn main() {
    let rounds: usize = match std::env::args().nth(1).map(|v| v.parse()) {
        Some(Ok(n)) => n,
        _ => {
            eprintln!("usage: full_pass_loop <rounds>");
            std::process::exit(2);
        }
    };
    let f = fleet(10, AllocatorConfig::default().large_key_entries);
    let mut times = Vec::with_capacity(rounds);
    let mut faults = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let mut a = f.alloc.clone();
        let before = minor_faults();
        let t = Instant::now();
        a.reallocate_all(f.now + 20 * MS);
        times.push(t.elapsed());
        faults.push(
            minor_faults()
                .zip(before)
                .map(|(after, before)| after - before),
        );
        assert!(a.pending_grants() > 0);
        drop(a);
    }
    times.sort();
    faults.sort();
    let faults = match faults[rounds / 2] {
        Some(n) => format!(", median page faults per pass {n}"),
        None => String::new(),
    };
    println!(
        "{rounds} passes: min {:?}, median {:?}, max {:?}{faults}",
        times[0],
        times[rounds / 2],
        times[rounds - 1]
    );
}

/// The process's minor page faults so far (field 10 of /proc/self/stat), where there
/// is one.
fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(7)?.parse().ok()
}
