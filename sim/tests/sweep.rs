//! A short seed sweep over every built-in scenario (the CI evidence for the overshoot
//! contract): zero overshoot with overdraft 0 where nothing cuts agents off from the
//! allocator (or with the `strict` posture under a partition), and measured overshoot
//! within the allocator's stated bound everywhere.

use bursar_sim::scenario::{BUILT_INS, Overrides, Scenario};
use bursar_sim::sim::{replay_command, run};

const SEEDS: [u64; 2] = [0x5EED_0001, 0x5EED_0002];

#[test]
fn every_built_in_scenario_stays_within_its_overshoot_bound_over_a_seed_sweep() {
    for (name, _) in BUILT_INS {
        let mut sc = Scenario::load(name).unwrap();
        // Short runs: the sweep must stay well under a minute in a debug build.
        sc.duration_s = sc.duration_s.min(8.0);
        for seed in SEEDS {
            let r = run(&sc, seed).unwrap();
            let s = &r.summary;
            let overrides = Overrides {
                duration_s: Some(sc.duration_s),
                ..Overrides::default()
            };
            let replay = replay_command(name, seed, &overrides, "bursar");
            println!(
                "{name:<16} seed {seed:#x}: overshoot {:.4} B, bound {:.4} B, utilization {:.3}, {} events",
                s.overshoot_max_fraction_of_burst,
                s.bound_fraction_of_burst,
                s.utilization_vs_ideal,
                r.counters.events
            );
            assert!(r.counters.requests > 0, "{name}: no traffic ({replay})");
            assert_eq!(
                s.violations, 0,
                "{name}: {:?} ({replay})",
                r.violation_messages
            );
            assert!(
                s.overshoot_max_fraction_of_burst <= s.bound_fraction_of_burst + 1e-9,
                "{name}: measured above bound ({replay})"
            );
            // No partition, or the `strict` posture under one: no overshoot at all.
            let contained = !sc.has_partition() || sc.limit.posture == "strict";
            if contained && sc.allocator.overdraft_permille == 0 {
                assert_eq!(
                    s.overshoot_max_fraction_of_burst, 0.0,
                    "{name}: overshoot without a partition ({replay})"
                );
            }
            assert!(s.utilization_vs_ideal > 0.0 && s.utilization_vs_ideal <= 1.5);
        }
    }
}

#[test]
fn the_checker_sees_an_overdraft_and_holds_it_within_the_stated_bound() {
    // Negative control: with O = 20 % of R and no partition, the fleet admits above
    // (R, B); the verifier must see it, and the bound (O * T) must cover it.
    let mut sc = Scenario::load("steady").unwrap();
    sc.gateways = 4;
    sc.keys = 1;
    sc.duration_s = 6.0;
    sc.workload.load = 2.0;
    sc.allocator.overdraft_permille = 200;
    let r = run(&sc, 0x5EED_0003).unwrap();
    let s = &r.summary;
    assert!(
        s.overshoot_max_fraction_of_burst > 0.0,
        "the verifier must detect the overdraft"
    );
    assert!(s.bound_fraction_of_burst >= s.overshoot_max_fraction_of_burst);
    assert_eq!(s.violations, 0, "{:?}", r.violation_messages);
}
