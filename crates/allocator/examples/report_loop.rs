//! One agent's report of 100 keys, as the criterion harness `benches/allocation.rs`
//! (`report/...`) measures it, as a plain program for instruction and cache-miss counts
//! under `valgrind --tool=cachegrind`: `bench/allocator_instructions.sh` counts only
//! inside [`Reporter::report`] (cachegrind's `--toggle-collect`), so the fleet's
//! construction is not in the figure. Counts do not move with the machine's load the
//! way wall-clock figures do on a shared box; they do not show how well cache misses
//! overlap (time does).
//!
//! `cargo run --release -p bursar-allocator --example report_loop -- report 2000`
//! (`report`: handle_report then the recomputation, as `report/100_keys`;
//! `handle-report`: as `report/100_keys_handle_report_only`; `routed`: as
//! `report/100_keys_routed_as_the_shell`, counted inside `Reporter::report_routed`).

use bursar_allocator::AllocatorConfig;
use bursar_allocator::testing::fleet::{Reporter, RoutedBatch};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let n: usize = match args.next().map(|v| v.parse()) {
        Some(Ok(n)) => n,
        _ => usage(),
    };
    let recompute = match mode.as_str() {
        "report" | "routed" => true,
        "handle-report" => false,
        _ => usage(),
    };
    // The benchmark's `report/100_keys` settings: recomputation at once.
    let mut r = Reporter::new(AllocatorConfig::default().large_key_entries, 0);
    let mut out = Vec::new();
    let mut grants = 0usize;
    if mode == "routed" {
        let mut r = r.with_handles_in_full_reports();
        let mut batch = RoutedBatch::new();
        for _ in 0..n {
            let i = r.prepare();
            r.report_routed(i, &mut batch);
            grants += batch.values().map(|(_, g)| g.len()).sum::<usize>();
            r.deliver_routed(&mut batch);
        }
        println!("{n} reports, {grants} grants");
        return;
    }
    for _ in 0..n {
        let i = r.prepare();
        r.report(i, recompute, &mut out);
        grants += out.len();
        r.deliver(&out);
        out.clear();
    }
    println!("{n} reports, {grants} grants");
}

fn usage() -> ! {
    eprintln!("usage: report_loop <report|handle-report|routed> <reports>");
    std::process::exit(2);
}
