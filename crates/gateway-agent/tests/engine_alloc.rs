//! The decision path allocates nothing for known keys: admission and completion,
//! counted with a counting global allocator once the lease table has grown to its
//! working set (its id map grows by doubling up to its bound, then never again). (Its
//! own test binary: the allocator counts every thread, so nothing else may run.)

use std::alloc::System;
use std::sync::Arc;

use bursar_agent::{AdmitRequest, CompletionStatus, Config, Cost, DiscardSink, Engine, Usage};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const RULES: &str = r#"
[engine]
max_tombstones = 4096

[[rule]]
name = "org-itpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 1000000000
per = "minute"

[[rule]]
name = "org-otpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 1000000000
per = "minute"

[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 1000000000
per = "minute"
"#;

const N: usize = 2_000;
const PASSES: usize = 5;

/// Allocations made by the last of `PASSES` passes that each admit `N` requests with
/// `max_output` reserved, then complete them with `output` used, through `admit` and
/// `complete`. The first ones make the keys (published: a key still waiting to be is
/// found on the slow path), the thread's completion buffer, and the lease table's
/// working set (live leases and tombstones up to their bound).
fn allocations(
    engine: &Engine,
    max_output: u64,
    output: u64,
    mut admit: impl FnMut(&AdmitRequest<'_>) -> bool,
    mut complete: impl FnMut(&str, Usage),
) -> (usize, usize) {
    let usage = Usage {
        input_tokens: 90,
        cached_input_tokens: 0,
        output_tokens: output,
    };
    let passes: Vec<Vec<String>> = (0..PASSES)
        .map(|p| (0..N).map(|i| format!("p{p}-{i}")).collect())
        .collect();
    let mut measured = (0, 0);
    for ids in &passes {
        let requests: Vec<AdmitRequest<'_>> = ids
            .iter()
            .map(|id| AdmitRequest {
                request_id: id,
                domain: None,
                descriptors: &[("org", "acme")],
                cost: Cost {
                    requests: 1,
                    input_tokens: 100,
                    max_output_tokens: Some(max_output),
                },
                ttl_ms: None,
            })
            .collect();
        let region = Region::new(GLOBAL);
        for r in &requests {
            assert!(admit(r), "{}", r.request_id);
        }
        for id in ids {
            complete(id, usage);
        }
        let s = region.change();
        measured = (s.allocations, s.reallocations);
        // The maintenance tick, as the agent runs it: forgets tombstones past their
        // bound (off the decision path).
        engine.maintain(1);
    }
    measured
}

#[test]
fn admission_and_completion_allocate_nothing_even_where_a_limit_reserves_nothing() {
    let config = Config::from_toml(RULES).unwrap();
    // Reserving output, and reserving none (an embeddings request under an output
    // rule: the lease once kept that key's name, a boxed array per admission), with
    // output used beyond the reservation (charged at completion).
    for (max_output, output) in [(50, 20), (0, 0), (0, 7)] {
        let engine = Engine::new(config.clone(), Arc::new(DiscardSink));
        let measured = allocations(
            &engine,
            max_output,
            output,
            |r| engine.admit(1, r).unwrap().is_admitted(),
            |id, u| {
                engine.complete(2, id, u, CompletionStatus::Ok).unwrap();
            },
        );
        assert_eq!(
            measured,
            (0, 0),
            "engine, output {max_output} reserved, {output} used"
        );
        assert_eq!(engine.leases_in_flight(), 0);
        engine.check_invariants(2).unwrap();

        let engine = Arc::new(Engine::new(config.clone(), Arc::new(DiscardSink)));
        let worker = std::cell::RefCell::new(engine.worker());
        let measured = allocations(
            &engine,
            max_output,
            output,
            |r| worker.borrow_mut().admit(1, r).unwrap().is_admitted(),
            |id, u| {
                worker
                    .borrow_mut()
                    .complete(2, id, u, CompletionStatus::Ok)
                    .unwrap();
            },
        );
        assert_eq!(
            measured,
            (0, 0),
            "worker, output {max_output} reserved, {output} used"
        );
        engine.check_invariants(2).unwrap();
    }
}
