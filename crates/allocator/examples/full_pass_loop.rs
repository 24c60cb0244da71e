//! The criterion harness's `full_pass/1000_agents_100k_keys_1M_entries` as a plain
//! program, for `perf record` and valgrind: the fleet is built once, then each round
//! clones it (not timed) and runs one `reallocate_all` (timed; the wall time of each
//! round is printed).
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
    for _ in 0..rounds {
        let mut a = f.alloc.clone();
        let t = Instant::now();
        a.reallocate_all(f.now + 20 * MS);
        times.push(t.elapsed());
        assert!(a.pending_grants() > 0);
        drop(a);
    }
    times.sort();
    println!(
        "{rounds} passes: min {:?}, median {:?}, max {:?}",
        times[0],
        times[rounds / 2],
        times[rounds - 1]
    );
}
