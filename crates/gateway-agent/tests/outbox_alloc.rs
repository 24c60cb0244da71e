//! The durable outbox keeps the engine's completion path allocation-free: its sink
//! copies a record into a fixed-size slot of a queue reserved up front. Measured with
//! a counting global allocator around `Engine::complete`, beside the same engine with
//! the discarding sink. (Its own test binary: the allocator counts every thread, so
//! nothing else may run; the outbox's writer thread is not started here, which is
//! what the sink costs the caller; the writer's work happens on its own thread.)

use std::alloc::System;
use std::sync::Arc;

use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, DiscardSink, Engine, Usage, UsageSink,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const RULES: &str = r#"
[[rule]]
name = "org-tpm"
match = { org = "*", model = "*" }
dimension = "input_tokens"
rate = 1000000000
per = "minute"

[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 1000000000
per = "minute"

[[rule]]
name = "org-concurrency"
match = { org = "*" }
dimension = "concurrency"
max_in_flight = 100000
"#;

const N: usize = 2_000;

/// Admits `N` requests, then returns the allocations made by completing them all.
fn allocations_completing(engine: &Engine, ids: &[String]) -> (usize, usize) {
    for id in ids {
        let d = engine
            .admit(
                1,
                &AdmitRequest {
                    request_id: id,
                    domain: None,
                    descriptors: &[("org", "acme"), ("model", "m1")],
                    cost: Cost {
                        requests: 1,
                        input_tokens: 100,
                        max_output_tokens: Some(50),
                    },
                    ttl_ms: None,
                },
            )
            .unwrap();
        assert!(d.is_admitted());
    }
    let usage = Usage {
        input_tokens: 90,
        cached_input_tokens: 0,
        output_tokens: 20,
    };
    // A thread's first completion makes its completion buffer (once per thread): not
    // part of what is measured.
    assert!(
        engine
            .complete(2, "warm-up", usage, CompletionStatus::Ok)
            .is_err()
    );
    let region = Region::new(GLOBAL);
    for id in ids {
        engine.complete(2, id, usage, CompletionStatus::Ok).unwrap();
    }
    let s = region.change();
    (s.allocations, s.reallocations)
}

#[test]
fn the_outbox_sink_adds_no_allocation_to_a_completion() {
    let config = Config::from_toml(RULES).unwrap();
    let ids: Vec<String> = (0..N).map(|i| format!("req-{i}")).collect();

    let discard = Engine::new(config.clone(), Arc::new(DiscardSink));
    let base = allocations_completing(&discard, &ids);

    let dir = std::env::temp_dir().join(format!("bursar-outbox-alloc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut cfg = OutboxConfig::new(dir.clone(), 1);
    cfg.queue_max = 4 * N;
    cfg.events_max = 4 * N as u64;
    let outbox = Arc::new(Outbox::open(cfg).unwrap());
    let engine = Engine::new(config, Arc::clone(&outbox) as Arc<dyn UsageSink>);
    let with_outbox = allocations_completing(&engine, &ids);

    println!(
        "allocations completing {N} requests: discard sink {base:?}, outbox sink {with_outbox:?} \
         (allocations, reallocations); queued {}",
        outbox.queued()
    );
    assert_eq!(outbox.queued(), N, "every record was queued");
    assert_eq!(with_outbox, base, "the outbox sink allocated");
    assert_eq!(base, (0, 0), "a completion allocated");
    let _ = std::fs::remove_dir_all(&dir);
}
