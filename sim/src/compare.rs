//! `bursar-sim compare`: one scenario under every policy ([`crate::policy::POLICIES`]),
//! the same seeds for each, side by side: the comparison table of docs/BENCHMARKS.md
//! for one scenario.

use serde::Serialize;

use crate::policy::POLICIES;
use crate::scenario::Scenario;
use crate::sim::{Job, Report, SimError, run_jobs};

/// One policy's outcome over the seeds.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyOutcome {
    /// The policy's name.
    pub policy: String,
    /// Largest measured overshoot over seeds and keys, fraction of `B`.
    pub overshoot_max_fraction_of_burst: f64,
    /// Largest stated bound over seeds (0 for the baselines: they state none).
    pub bound_max_fraction_of_burst: f64,
    /// Smallest utilization vs the ideal bucket over seeds.
    pub utilization_min: f64,
    /// Largest utilization vs the ideal bucket over seeds.
    pub utilization_max: f64,
    /// Smallest utilization over the second half of the run (the steady state) over
    /// seeds.
    pub utilization_second_half_min: f64,
    /// Largest utilization over the second half of the run over seeds.
    pub utilization_second_half_max: f64,
    /// Largest realloc p95 over seeds (shift workloads only).
    pub realloc_p95_ms_max: Option<f64>,
    /// Mean control messages per agent per virtual second.
    pub control_messages_per_agent_per_s: f64,
    /// Mean control bytes per agent per virtual second.
    pub control_bytes_per_agent_per_s: f64,
    /// Violations summed over seeds (for a baseline: keys whose overshoot exceeded
    /// the bound it does not state, i.e. any overshoot).
    pub violations: u64,
    /// Seeds whose run found a violation, to replay with `bursar-sim run`.
    pub failed_seeds: Vec<u64>,
}

/// Every policy on one scenario.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Comparison {
    /// Scenario name.
    pub scenario: String,
    /// Seeds each policy ran.
    pub seeds: Vec<u64>,
    /// One per policy, in [`POLICIES`] order (`bursar` first).
    pub policies: Vec<PolicyOutcome>,
}

/// Smallest and largest of `values` (`(inf, 0)` when empty).
pub fn span(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, 0.0), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// Runs `sc` under every policy for every seed.
pub fn compare(sc: &Scenario, seeds: &[u64]) -> Result<Comparison, SimError> {
    let mut policies = Vec::with_capacity(POLICIES.len());
    // Every run at once, one per core; each policy's reports in seed order.
    let jobs: Vec<Job<'_>> = POLICIES
        .iter()
        .flat_map(|(name, _)| seeds.iter().map(move |&seed| (sc, seed, *name)))
        .collect();
    let mut all: Vec<Report> = Vec::with_capacity(jobs.len());
    run_jobs(&jobs, |_, r| all.push(r))?;
    let mut all = all.into_iter();
    for (name, _) in POLICIES {
        let reports: Vec<Report> = all.by_ref().take(seeds.len()).collect();
        let su = || reports.iter().map(|r| &r.summary);
        let n = reports.len().max(1) as f64;
        let whole = span(su().map(|s| s.utilization_vs_ideal));
        let late = span(su().map(|s| s.utilization_second_half));
        policies.push(PolicyOutcome {
            policy: name.to_string(),
            overshoot_max_fraction_of_burst: su()
                .map(|s| s.overshoot_max_fraction_of_burst)
                .fold(0.0, f64::max),
            bound_max_fraction_of_burst: su()
                .map(|s| s.bound_fraction_of_burst)
                .fold(0.0, f64::max),
            utilization_min: whole.0,
            utilization_max: whole.1,
            utilization_second_half_min: late.0,
            utilization_second_half_max: late.1,
            realloc_p95_ms_max: su().filter_map(|s| s.realloc_p95_ms).reduce(f64::max),
            control_messages_per_agent_per_s: su()
                .map(|s| s.control_messages_per_agent_per_s)
                .sum::<f64>()
                / n,
            control_bytes_per_agent_per_s: su()
                .map(|s| s.control_bytes_per_agent_per_s)
                .sum::<f64>()
                / n,
            violations: su().map(|s| s.violations).sum(),
            failed_seeds: reports
                .iter()
                .filter(|r| r.summary.violations > 0)
                .map(|r| r.seed)
                .collect(),
        });
    }
    Ok(Comparison {
        scenario: sc.name.clone(),
        seeds: seeds.to_vec(),
        policies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_runs_the_same_scenario_and_the_gubernator_like_one_overshoots() {
        let mut sc = Scenario::load("steady").unwrap();
        sc.gateways = 4;
        sc.keys = 1;
        sc.duration_s = 2.0;
        sc.workload.load = 2.0;
        let c = compare(&sc, &[5]).unwrap();
        let names: Vec<&str> = c.policies.iter().map(|p| p.policy.as_str()).collect();
        assert_eq!(names, ["bursar", "static", "doorman", "gubernator"]);
        let by = |n: &str| c.policies.iter().find(|p| p.policy == n).unwrap();
        assert_eq!(by("bursar").overshoot_max_fraction_of_burst, 0.0);
        assert_eq!(by("bursar").violations, 0);
        assert_eq!(by("static").control_messages_per_agent_per_s, 0.0);
        assert!(by("gubernator").overshoot_max_fraction_of_burst > 0.0);
        assert!(by("gubernator").violations > 0);
        assert!(by("bursar").failed_seeds.is_empty());
        assert_eq!(by("gubernator").failed_seeds, [5], "the seed to replay");
        assert!(by("gubernator").utilization_max > by("static").utilization_max);
    }
}
