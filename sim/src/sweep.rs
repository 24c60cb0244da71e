//! `bursar-sim sweep`: one scenario run over a range of report intervals, lease TTLs,
//! bursts and overdrafts, each point's measured overshoot printed beside the bound the
//! allocator stated for it (its formula, integrated over the run: see
//! docs/simulation.md, "What is measured").
//!
//! By default the axes are varied one at a time around the scenario's own settings
//! (each axis's values with the other three at the scenario's); `grid` runs every
//! combination instead. Every point runs every seed; a point fails if any seed measured
//! above its bound or found any other violation.

use bursar_agent::MAX_COST;
use serde::Serialize;

use crate::compare::span;
use crate::scenario::{Overrides, Scenario, ScenarioError};
use crate::sim::{Job, Report, Sim, SimError, replay_command, run_jobs};

/// What to vary. Empty lists keep the scenario's value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SweepSpec {
    /// Report intervals, ms (`allocator.report_interval_ms`).
    pub report_interval_ms: Vec<u64>,
    /// Lease TTLs, ms (`allocator.lease_ms`).
    pub lease_ms: Vec<u64>,
    /// Bursts, tokens (`limit.burst`).
    pub burst: Vec<u64>,
    /// Overdrafts, permille of `R` (`allocator.overdraft_permille`).
    pub overdraft_permille: Vec<u32>,
    /// Every combination rather than one axis at a time.
    pub grid: bool,
}

impl SweepSpec {
    /// The default ranges around a scenario: report interval 50-1,000 ms, lease
    /// 1-10 s, burst 0.5-4 x the scenario's (values below the largest request are
    /// left out: such a request could never be admitted; and values above the
    /// largest burst a rule may name, `MAX_COST`), overdraft 0-20 %.
    pub fn defaults_for(sc: &Scenario) -> SweepSpec {
        let b = sc.limit.burst;
        let w = &sc.workload;
        let largest = w
            .cost_max
            .saturating_add(if w.llm { w.output_max_tokens } else { 0 });
        let mut burst: Vec<u64> = [b / 2, b, b.saturating_mul(2), b.saturating_mul(4)]
            .into_iter()
            .filter(|&x| x >= largest && x <= MAX_COST)
            .collect();
        burst.dedup();
        SweepSpec {
            report_interval_ms: vec![50, 100, 250, 500, 1_000],
            lease_ms: vec![1_000, 2_000, 5_000, 10_000],
            burst,
            overdraft_permille: vec![0, 50, 100, 200],
            grid: false,
        }
    }

    /// The points, in order, without repeats; each is a set of overrides over `base`
    /// (which may already carry `run`-style overrides such as the fleet size), every
    /// swept setting named (the scenario's own value where an axis does not move it).
    pub fn points(&self, base: &Overrides, sc: &Scenario) -> Vec<Overrides> {
        let base = &Overrides {
            report_interval_ms: base
                .report_interval_ms
                .or(Some(sc.allocator.report_interval_ms)),
            lease_ms: base.lease_ms.or(Some(sc.allocator.lease_ms)),
            burst: base.burst.or(Some(sc.limit.burst)),
            overdraft_permille: base
                .overdraft_permille
                .or(Some(sc.allocator.overdraft_permille)),
            ..base.clone()
        };
        let axis_r = opts(&self.report_interval_ms, base.report_interval_ms);
        let axis_l = opts(&self.lease_ms, base.lease_ms);
        let axis_b = opts(&self.burst, base.burst);
        let axis_o = opts(&self.overdraft_permille, base.overdraft_permille);
        let point = |r, l, b, o| Overrides {
            report_interval_ms: r,
            lease_ms: l,
            burst: b,
            overdraft_permille: o,
            ..base.clone()
        };
        let mut out: Vec<Overrides> = Vec::new();
        let mut add = |p: Overrides| {
            if !out.contains(&p) {
                out.push(p);
            }
        };
        if self.grid {
            for &r in &axis_r {
                for &l in &axis_l {
                    for &b in &axis_b {
                        for &o in &axis_o {
                            add(point(r, l, b, o));
                        }
                    }
                }
            }
        } else {
            let keep = (
                base.report_interval_ms,
                base.lease_ms,
                base.burst,
                base.overdraft_permille,
            );
            for &r in &axis_r {
                add(point(r, keep.1, keep.2, keep.3));
            }
            for &l in &axis_l {
                add(point(keep.0, l, keep.2, keep.3));
            }
            for &b in &axis_b {
                add(point(keep.0, keep.1, b, keep.3));
            }
            for &o in &axis_o {
                add(point(keep.0, keep.1, keep.2, o));
            }
        }
        out
    }
}

/// An axis's values; an empty list keeps the base value.
fn opts<T: Copy>(xs: &[T], base: Option<T>) -> Vec<Option<T>> {
    if xs.is_empty() {
        vec![base]
    } else {
        xs.iter().map(|&x| Some(x)).collect()
    }
}

/// A sweep could not start (operator error; nothing ran).
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// A point's scenario is impossible.
    #[error("sweep point{flags}: {source}")]
    Scenario {
        /// The point, as flags.
        flags: String,
        /// Why.
        source: ScenarioError,
    },
    /// A point's simulation could not be built.
    #[error("sweep point{flags}: {source}")]
    Sim {
        /// The point, as flags.
        flags: String,
        /// Why.
        source: SimError,
    },
}

/// One point's outcome over every seed.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PointOutcome {
    /// `allocator.report_interval_ms`.
    pub report_interval_ms: u64,
    /// `allocator.lease_ms`.
    pub lease_ms: u64,
    /// `limit.burst`.
    pub burst: u64,
    /// `allocator.overdraft_permille`.
    pub overdraft_permille: u32,
    /// Largest measured overshoot over seeds and keys, as a fraction of this point's
    /// `B`.
    pub overshoot_max_fraction_of_burst: f64,
    /// The stated bound of the same run (the seed with the worst overshoot; every seed's
    /// own bound is checked against its own overshoot), fraction of `B`.
    pub bound_fraction_of_burst: f64,
    /// Smallest utilization vs the ideal bucket over seeds.
    pub utilization_min: f64,
    /// Largest utilization vs the ideal bucket over seeds.
    pub utilization_max: f64,
    /// Smallest utilization over the second half of the run (the steady state: every
    /// slice starts empty while the ideal bucket starts full) over seeds.
    pub utilization_second_half_min: f64,
    /// Largest utilization over the second half of the run over seeds.
    pub utilization_second_half_max: f64,
    /// Mean control messages per agent per virtual second over seeds.
    pub control_messages_per_agent_per_s: f64,
    /// Mean control bytes per agent per virtual second over seeds.
    pub control_bytes_per_agent_per_s: f64,
    /// Violations summed over seeds (measured above bound, failed invariants).
    pub violations: u64,
    /// True when no seed measured above its bound or found any violation.
    pub within: bool,
    /// The command that replays the first failing seed (or the first seed).
    pub replay: String,
}

/// The whole sweep.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct SweepReport {
    /// Scenario name.
    pub scenario: String,
    /// Policy.
    pub policy: String,
    /// Seeds every point ran.
    pub seeds: Vec<u64>,
    /// Gateways.
    pub gateways: usize,
    /// Keys.
    pub keys: usize,
    /// Virtual seconds of traffic per run.
    pub duration_s: f64,
    /// One per point, in order.
    pub points: Vec<PointOutcome>,
    /// Points that failed.
    pub failed_points: usize,
}

/// Runs every point of `spec` over `base` (a scenario as loaded, by `name`, with
/// `base_overrides` applied to every point) for every seed. `progress` sees each point
/// as it finishes.
pub fn sweep(
    name: &str,
    scenario: &Scenario,
    base_overrides: &Overrides,
    spec: &SweepSpec,
    seeds: &[u64],
    policy: &str,
    mut progress: impl FnMut(&PointOutcome),
) -> Result<SweepReport, SweepError> {
    let points = spec.points(base_overrides, scenario);
    // Build every point first, so that a bad value fails before anything runs.
    let mut built = Vec::with_capacity(points.len());
    for p in &points {
        let mut sc = scenario.clone();
        p.apply(&mut sc).map_err(|source| SweepError::Scenario {
            flags: p.flags(),
            source,
        })?;
        Sim::new(&sc, seeds[0], policy).map_err(|source| SweepError::Sim {
            flags: p.flags(),
            source,
        })?;
        built.push(sc);
    }
    let mut out = Vec::with_capacity(points.len());
    // Every run at once, one per core; a point is summed up (and shown) as soon as its
    // seeds and every earlier point's are done.
    let jobs: Vec<Job<'_>> = built
        .iter()
        .flat_map(|sc| seeds.iter().map(move |&seed| (sc, seed, policy)))
        .collect();
    let mut reports: Vec<Report> = Vec::with_capacity(seeds.len());
    let mut point = 0;
    run_jobs(&jobs, |_, r| {
        reports.push(r);
        if reports.len() < seeds.len() {
            return;
        }
        let reports = std::mem::take(&mut reports);
        let (p, sc) = (&points[point], &built[point]);
        point += 1;
        let failing = |r: &Report| {
            r.summary.violations > 0
                || r.summary.overshoot_max_fraction_of_burst
                    > r.summary.bound_fraction_of_burst + 1e-9
        };
        let worst = reports
            .iter()
            .max_by(|a, b| {
                a.summary
                    .overshoot_max_fraction_of_burst
                    .total_cmp(&b.summary.overshoot_max_fraction_of_burst)
            })
            .expect("at least one seed");
        let replay_seed = reports
            .iter()
            .find(|r| failing(r))
            .map_or(seeds[0], |r| r.seed);
        let n = reports.len() as f64;
        let whole = span(reports.iter().map(|r| r.summary.utilization_vs_ideal));
        let late = span(reports.iter().map(|r| r.summary.utilization_second_half));
        let o = PointOutcome {
            report_interval_ms: sc.allocator.report_interval_ms,
            lease_ms: sc.allocator.lease_ms,
            burst: sc.limit.burst,
            overdraft_permille: sc.allocator.overdraft_permille,
            overshoot_max_fraction_of_burst: worst.summary.overshoot_max_fraction_of_burst,
            bound_fraction_of_burst: worst.summary.bound_fraction_of_burst,
            utilization_min: whole.0,
            utilization_max: whole.1,
            utilization_second_half_min: late.0,
            utilization_second_half_max: late.1,
            control_messages_per_agent_per_s: reports
                .iter()
                .map(|r| r.summary.control_messages_per_agent_per_s)
                .sum::<f64>()
                / n,
            control_bytes_per_agent_per_s: reports
                .iter()
                .map(|r| r.summary.control_bytes_per_agent_per_s)
                .sum::<f64>()
                / n,
            violations: reports.iter().map(|r| r.summary.violations).sum(),
            within: !reports.iter().any(failing),
            replay: replay_command(name, replay_seed, p, policy),
        };
        progress(&o);
        out.push(o);
    })
    .map_err(|source| SweepError::Sim {
        // The first point not summed up is the one whose run could not start.
        flags: points[point.min(points.len() - 1)].flags(),
        source,
    })?;
    let sc0 = &built[0];
    Ok(SweepReport {
        scenario: scenario.name.clone(),
        policy: policy.to_string(),
        seeds: seeds.to_vec(),
        gateways: sc0.gateways,
        keys: sc0.keys,
        duration_s: sc0.duration_s,
        failed_points: out.iter().filter(|p| !p.within).count(),
        points: out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_axis_at_a_time_runs_each_value_once_with_the_others_at_the_scenarios() {
        let spec = SweepSpec {
            report_interval_ms: vec![100, 250],
            lease_ms: vec![2_000],
            burst: vec![],
            overdraft_permille: vec![0, 100],
            grid: false,
        };
        let base = Overrides {
            gateways: Some(4),
            ..Overrides::default()
        };
        let sc = Scenario::load("steady").unwrap(); // 250 ms, 2 s lease, B 4000, O 0
        let pts = spec.points(&base, &sc);
        // 100, 250 (the scenario's point), then lease 2000 and O 0 are that point
        // again; O 100 is new.
        assert_eq!(pts.len(), 3);
        assert!(pts.iter().all(|p| p.gateways == Some(4)));
        assert_eq!(pts[0].report_interval_ms, Some(100));
        assert_eq!(
            pts[0].lease_ms,
            Some(2_000),
            "other axes stay at the scenario's"
        );
        assert_eq!(pts[0].burst, Some(4_000));
        assert_eq!(pts[1].report_interval_ms, Some(250));
        assert_eq!(pts[2].overdraft_permille, Some(100));
        assert_eq!(pts[2].report_interval_ms, Some(250));
        let grid = SweepSpec { grid: true, ..spec }.points(&base, &sc);
        assert_eq!(grid.len(), 2 * 2);
        assert!(grid.iter().all(|p| p.lease_ms == Some(2_000)));
    }

    #[test]
    fn default_bursts_leave_out_values_a_request_could_never_fit() {
        let mut sc = Scenario::load("steady").unwrap();
        sc.limit.burst = 300; // cost_max 200: 150 is out
        let spec = SweepSpec::defaults_for(&sc);
        assert_eq!(spec.burst, vec![300, 600, 1_200]);
        assert_eq!(spec.overdraft_permille[0], 0);
    }

    /// Review, thirty-first session: `4 * b` (and the largest request's sum) were
    /// taken in u64, and bursts no rule may name were offered: a scenario at the
    /// largest burst swept points that could only be refused.
    #[test]
    fn default_bursts_stay_within_what_a_rule_may_name() {
        let mut sc = Scenario::load("steady").unwrap();
        sc.limit.burst = MAX_COST;
        sc.validate().unwrap();
        let spec = SweepSpec::defaults_for(&sc);
        assert_eq!(spec.burst, vec![MAX_COST / 2, MAX_COST]);
        // Unvalidated, nothing wraps around: a burst past u64::MAX / 4 and a request
        // that fills u64 leave no point at all rather than a wrapped one.
        sc.limit.burst = u64::MAX / 2;
        sc.workload.llm = true;
        sc.workload.cost_max = u64::MAX;
        assert!(SweepSpec::defaults_for(&sc).burst.is_empty());
    }
}
