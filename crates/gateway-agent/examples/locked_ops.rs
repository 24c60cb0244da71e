//! What one locked instruction costs on this machine, beside a plain add: the hot
//! path's floor is set by how many of these a decision takes (docs/BENCHMARKS.md,
//! "Agent hot path"). Each loop is back to back on one cache line, one thread.
//!
//! `cargo run --release -p bursar-agent --example locked_ops`

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use portable_atomic::AtomicU128;

const N: u64 = 20_000_000;

fn per_op(name: &str, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    println!(
        "{name:<28} {:6.2} ns",
        t.elapsed().as_nanos() as f64 / N as f64
    );
}

fn main() {
    for round in 1..=3 {
        println!("round {round}");
        per_op("plain add", || {
            let mut x = 0u64;
            for i in 0..N {
                x = x.wrapping_add(black_box(i));
            }
            black_box(x);
        });
        let c = AtomicU64::new(0);
        per_op("fetch_add (lock xadd)", || {
            for i in 0..N {
                c.fetch_add(black_box(i), Ordering::Relaxed);
            }
        });
        let a = Arc::new(0u64);
        per_op("Arc clone + drop", || {
            for _ in 0..N {
                drop(black_box(Arc::clone(&a)));
            }
        });
        per_op("u64 load + CAS", || {
            for i in 0..N {
                let cur = c.load(Ordering::Acquire);
                let _ = c.compare_exchange_weak(
                    cur,
                    cur.wrapping_add(black_box(i)),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        });
        let swap = arc_swap::ArcSwap::from_pointee(0u64);
        per_op("ArcSwap load + guard drop", || {
            for _ in 0..N {
                drop(black_box(swap.load()));
            }
        });
        let w = AtomicU128::new(0);
        per_op("u128 load + CAS (16-byte)", || {
            for i in 0..N {
                let cur = w.load(Ordering::Acquire);
                let _ = w.compare_exchange_weak(
                    cur,
                    cur.wrapping_add(black_box(i as u128)),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
        });
    }
}
