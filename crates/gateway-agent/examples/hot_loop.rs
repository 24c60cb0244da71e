//! The hot path's two loops (the criterion harness `benches/hot_path.rs` measures the
//! same work), as a plain program for instruction and cache-miss counts under
//! `valgrind --tool=cachegrind`: `bench/instructions.sh` runs it at two sizes and
//! reports the difference per operation. Counts do not move with the machine's load
//! the way wall-clock figures do on a shared box.
//!
//! `cargo run --release -p bursar-agent --example hot_loop -- admit-complete 100000`
//! `cargo run --release -p bursar-agent --example hot_loop -- admit-into-complete 100000`
//! `cargo run --release -p bursar-agent --example hot_loop -- keyed-10k 1000000`
//! `cargo run --release -p bursar-agent --example hot_loop -- governor-10k 1000000` (the
//! baseline of `keyed-10k`)
//!
//! The keyed loops take the number of keys as a third argument (10,000 by default): how
//! the two compare as the keys' footprint grows past the caches.

use bursar_agent::testing::{
    FreshIds, THREE_DIMENSIONS, THREE_DIMENSIONS_COST, THREE_DIMENSIONS_DESCRIPTORS,
    THREE_DIMENSIONS_USAGE, engine, keyed_engine,
};
use bursar_agent::{AdmitRequest, Completion, CompletionStatus, Decision};

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_default();
    let n: u64 = match args.next().map(|v| v.parse()) {
        Some(Ok(n)) => n,
        _ => usage(),
    };
    let keys: u64 = match args.next().map(|v| v.parse()) {
        None => 10_000,
        // The walk's stride (7,919, a prime) must not divide it.
        Some(Ok(k)) if k > 0 && k % 7_919 != 0 => k,
        Some(_) => usage(),
    };
    let done = match mode.as_str() {
        "admit-complete" => admit_complete(n, false),
        "admit-into-complete" => admit_complete(n, true),
        "keyed-10k" => keyed(n, keys as usize),
        "governor-10k" => governor_keyed(n, keys),
        _ => usage(),
    };
    println!("{done} operations");
}

fn usage() -> ! {
    eprintln!(
        "usage: hot_loop <admit-complete|admit-into-complete|keyed-10k|governor-10k> <operations> [keys, for the keyed loops: 10000]"
    );
    std::process::exit(2);
}

/// Admit from three descriptors over three rules (requests, input, output tokens),
/// then complete with a refund; a new request id each time (a finished id is not
/// admitted again while remembered), virtual time 1 us apart,
/// the maintenance tick every 100 ms of it. Every admission is checked.
/// Admit (by value, or `into` one reused `Decision`) and complete, three dimensions
/// (`into`: both through the worker).
fn admit_complete(n: u64, into: bool) -> u64 {
    let e = engine(THREE_DIMENSIONS);
    let mut ids = FreshIds::default();
    let mut w = e.worker();
    let mut next_maintain = 0;
    let mut d = Decision::EMPTY;
    for i in 0..n {
        let id = ids.next_id();
        let now = i * 1_000;
        let req = AdmitRequest {
            request_id: id,
            domain: None,
            descriptors: &THREE_DIMENSIONS_DESCRIPTORS,
            cost: THREE_DIMENSIONS_COST,
            ttl_ms: None,
        };
        if into {
            w.admit_into(now, &req, &mut d).expect("valid request");
        } else {
            d = w.admit(now, &req).expect("valid request");
        }
        assert!(d.is_admitted(), "the loop must measure admissions");
        std::hint::black_box(&d);
        // The cheapest pair goes through the worker both ways (its cached table
        // snapshot); the by-value one through the engine's `complete`, as before.
        let c = if into {
            w.complete(now, id, THREE_DIMENSIONS_USAGE, CompletionStatus::Ok)
        } else {
            e.complete(now, id, THREE_DIMENSIONS_USAGE, CompletionStatus::Ok)
        };
        assert_eq!(c, Ok(Completion::Settled));
        if now >= next_maintain {
            e.maintain(now);
            next_maintain = now + 100_000_000;
        }
    }
    n
}

/// The bare keyed check (`Worker::try_acquire`) over `keys` pre-resolved keys (10,000
/// as in the criterion harness), in the harness's order.
fn keyed(n: u64, keys: usize) -> u64 {
    let (e, handles) = keyed_engine(keys);
    let mut w = e.worker();
    let mut j = 0usize;
    let mut admitted = 0;
    for i in 0..n {
        j = (j + 7919) % handles.len();
        admitted += u64::from(w.try_acquire(1 + i, &handles[j], 1).expect("ok"));
    }
    assert_eq!(admitted, n, "every check is admitted");
    n
}

/// The baseline of `keyed-10k`: the `governor` crate's keyed limiter (DashMap store,
/// `u64` keys, its default clock) over the same keys in the same order, as the
/// criterion harness sets it up.
fn governor_keyed(n: u64, keys: u64) -> u64 {
    use governor::{Quota, RateLimiter};
    let gov = RateLimiter::keyed(Quota::per_second(std::num::NonZeroU32::MAX));
    for k in 0..keys {
        let _ = gov.check_key(&k);
    }
    let mut j = 0u64;
    let mut admitted = 0;
    for _ in 0..n {
        j = (j + 7919) % keys;
        admitted += u64::from(gov.check_key(std::hint::black_box(&j)).is_ok());
    }
    assert_eq!(admitted, n, "every check is admitted");
    n
}
