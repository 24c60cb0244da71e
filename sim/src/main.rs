//! `bursar-sim`: run a scenario against the real agent and allocator cores and check
//! overshoot against the allocator's stated bound. See docs/simulation.md.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use bursar_sim::compare::compare;
use bursar_sim::plot::write_charts;
use bursar_sim::scenario::{BUILT_INS, Overrides, Scenario};
use bursar_sim::sim::{Sim, replay_command};
use bursar_sim::sweep::{SweepSpec, sweep};
use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "bursar-sim",
    about = "Bursar fleet simulator (virtual time, real cores)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Overrides of the scenario's fleet and run length.
#[derive(Args)]
struct FleetArgs {
    /// Override the number of gateways.
    #[arg(long)]
    gateways: Option<usize>,
    /// Override the number of keys.
    #[arg(long)]
    keys: Option<usize>,
    /// Override the virtual duration of traffic, seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Override `network.latency_ms`: the base one-way latency of every
    /// agent-allocator link a `[[link]]` does not set, ms (e.g. 20-100 for an
    /// allocator in another region).
    #[arg(long, allow_negative_numbers = true)]
    latency_ms: Option<f64>,
    /// Override `network.jitter_ms`: the mean of the exponential delay added to each
    /// message, ms.
    #[arg(long, allow_negative_numbers = true)]
    jitter_ms: Option<f64>,
}

impl FleetArgs {
    /// These overrides, the rest unset.
    fn overrides(&self) -> Overrides {
        Overrides {
            gateways: self.gateways,
            keys: self.keys,
            duration_s: self.duration_s,
            latency_ms: self.latency_ms,
            jitter_ms: self.jitter_ms,
            ..Overrides::default()
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one scenario (a TOML file or a built-in name).
    Run {
        /// Scenario file, or the name of a built-in (`bursar-sim list`).
        scenario: String,
        /// Seed (the same seed and scenario replay bit for bit).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[command(flatten)]
        fleet: FleetArgs,
        /// Override `allocator.report_interval_ms` (and the Gubernator-like sync).
        #[arg(long)]
        report_interval_ms: Option<u64>,
        /// Override `allocator.lease_ms` (the grants' TTL).
        #[arg(long)]
        lease_ms: Option<u64>,
        /// Override `limit.burst`.
        #[arg(long)]
        burst: Option<u64>,
        /// Override `allocator.overdraft_permille`.
        #[arg(long)]
        overdraft_permille: Option<u32>,
        /// Override `allocator.hysteresis_permille` (0..1,000; fewer grant messages
        /// against slower small moves, see docs/tuning.md).
        #[arg(long)]
        hysteresis_permille: Option<u32>,
        /// Override `allocator.measure_window_ms` (0..10,000; 0: holders are never
        /// asked to measure afresh, see docs/tuning.md).
        #[arg(long)]
        measure_window_ms: Option<u64>,
        /// Allocation policy: `bursar` (the real allocator), `static` (R/N each),
        /// `doorman` (proportional shares without revoke-before-grant) or `gubernator`
        /// (every gateway holds the full limit and syncs hits every report interval).
        #[arg(long, default_value = "bursar")]
        policy: String,
        /// Write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Write SVG charts into this directory (admitted.svg, slices.svg,
        /// overshoot.svg).
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Threads: 1 runs everything on one; 2 shares each round of the simulation
        /// (the allocator, shards of the gateways) out between two. The report is the
        /// same either way. Default: 2 for fleets of at least 100,000 gateway-key pairs
        /// on a machine with two cores or more, else 1.
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=2))]
        threads: Option<u64>,
    },
    /// Run one scenario over ranges of report interval, lease TTL, burst and overdraft,
    /// and print each point's measured overshoot beside its stated bound. Exits 1 if
    /// any point measured above its bound.
    Sweep {
        /// Scenario file, or the name of a built-in.
        scenario: String,
        /// Seeds: every point runs each of 1..=N (the same seeds for every point).
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        #[command(flatten)]
        fleet: FleetArgs,
        /// Report intervals, ms, comma-separated (default 50,100,250,500,1000).
        #[arg(long, value_delimiter = ',')]
        report_interval_ms: Vec<u64>,
        /// Lease TTLs, ms (default 1000,2000,5000,10000).
        #[arg(long, value_delimiter = ',')]
        lease_ms: Vec<u64>,
        /// Bursts, tokens (default 0.5, 1, 2 and 4 x the scenario's, those that fit the
        /// largest request).
        #[arg(long, value_delimiter = ',')]
        burst: Vec<u64>,
        /// Overdrafts, permille of R (default 0,50,100,200).
        #[arg(long, value_delimiter = ',')]
        overdraft_permille: Vec<u32>,
        /// Run every combination instead of one axis at a time.
        #[arg(long)]
        grid: bool,
        /// Allocation policy (as for `run`).
        #[arg(long, default_value = "bursar")]
        policy: String,
        /// Write the sweep as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Run one scenario under every policy (bursar, static, doorman, gubernator) with
    /// the same seeds, side by side. Exits 1 only if the real allocator (`bursar`)
    /// measured above its bound: the baselines state no bound, so their overshoot is
    /// reported, not failed.
    Compare {
        /// Scenario file, or the name of a built-in.
        scenario: String,
        /// Seeds: every policy runs each of 1..=N.
        #[arg(long, default_value_t = 3)]
        seeds: u64,
        #[command(flatten)]
        fleet: FleetArgs,
        /// Write the comparison as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Name the built-in scenarios.
    List,
}

fn main() -> ExitCode {
    match real_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("bursar-sim: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<ExitCode> {
    match Cli::parse().cmd {
        Cmd::List => {
            for (name, text) in BUILT_INS {
                let sc = Scenario::from_toml(name, text)?;
                println!("{name:<18} {}", sc.description);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Compare {
            scenario,
            seeds,
            fleet,
            json,
        } => {
            let mut sc = Scenario::load(&scenario)?;
            fleet.overrides().apply(&mut sc)?;
            for w in sc.faults_after_end() {
                eprintln!("bursar-sim: note: {w}");
            }
            let seed_list: Vec<u64> = (1..=seeds.max(1)).collect();
            println!(
                "compare {}: {} gateways x {} keys x {} virtual s, seeds 1..={}",
                sc.name,
                sc.gateways,
                sc.keys,
                sc.duration_s,
                seed_list.len()
            );
            println!(
                "{:<11} {:>12} {:>8} {:>13} {:>13} {:>11} {:>12} {:>13} {:>10}",
                "policy",
                "overshoot/B",
                "bound/B",
                "utilization",
                "second half",
                "realloc ms",
                "msgs/agent/s",
                "bytes/agent/s",
                "violations"
            );
            let c = compare(&sc, &seed_list)?;
            for p in &c.policies {
                println!(
                    "{:<11} {:>12.4} {:>8.2} {:>13} {:>13} {:>11} {:>12.1} {:>13.0} {:>10}",
                    p.policy,
                    p.overshoot_max_fraction_of_burst,
                    p.bound_max_fraction_of_burst,
                    format!("{:.3}-{:.3}", p.utilization_min, p.utilization_max),
                    format!(
                        "{:.3}-{:.3}",
                        p.utilization_second_half_min, p.utilization_second_half_max
                    ),
                    opt(p.realloc_p95_ms_max, 0, ""),
                    p.control_messages_per_agent_per_s,
                    p.control_bytes_per_agent_per_s,
                    p.violations
                );
            }
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&c)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            let ours = c.policies.iter().find(|p| p.policy == "bursar");
            if let Some(p) = ours.filter(|p| p.violations > 0) {
                println!("FAILED: the real allocator measured above its bound; replay with:");
                for &seed in &p.failed_seeds {
                    println!(
                        "  {}",
                        replay_command(&scenario, seed, &fleet.overrides(), "bursar")
                    );
                }
                return Ok(ExitCode::FAILURE);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Sweep {
            scenario,
            seeds,
            fleet,
            report_interval_ms,
            lease_ms,
            burst,
            overdraft_permille,
            grid,
            policy,
            json,
        } => {
            let sc = Scenario::load(&scenario)?;
            let base = fleet.overrides();
            let mut sized = sc.clone();
            base.apply(&mut sized)?;
            let defaults = SweepSpec::defaults_for(&sized);
            let pick = |given: Vec<u64>, default: Vec<u64>| {
                if given.is_empty() { default } else { given }
            };
            let spec = SweepSpec {
                report_interval_ms: pick(report_interval_ms, defaults.report_interval_ms),
                lease_ms: pick(lease_ms, defaults.lease_ms),
                burst: pick(burst, defaults.burst),
                overdraft_permille: if overdraft_permille.is_empty() {
                    defaults.overdraft_permille
                } else {
                    overdraft_permille
                },
                grid,
            };
            let seed_list: Vec<u64> = (1..=seeds.max(1)).collect();
            println!(
                "sweep {} policy {policy}: {} gateways x {} keys x {} virtual s, seeds 1..={}",
                sc.name,
                sized.gateways,
                sized.keys,
                sized.duration_s,
                seed_list.len()
            );
            println!(
                "{:>9} {:>8} {:>8} {:>5} {:>12} {:>10} {:>13} {:>13} {:>12} {:>13}  result",
                "report_ms",
                "lease_ms",
                "burst",
                "O_pm",
                "overshoot/B",
                "bound/B",
                "utilization",
                "second half",
                "msgs/agent/s",
                "bytes/agent/s"
            );
            let started = Instant::now();
            let report = sweep(&scenario, &sc, &base, &spec, &seed_list, &policy, |p| {
                println!(
                    "{:>9} {:>8} {:>8} {:>5} {:>12.4} {:>10.4} {:>13} {:>13} {:>12.1} {:>13.0}  {}",
                    p.report_interval_ms,
                    p.lease_ms,
                    p.burst,
                    p.overdraft_permille,
                    p.overshoot_max_fraction_of_burst,
                    p.bound_fraction_of_burst,
                    format!("{:.3}-{:.3}", p.utilization_min, p.utilization_max),
                    format!(
                        "{:.3}-{:.3}",
                        p.utilization_second_half_min, p.utilization_second_half_max
                    ),
                    p.control_messages_per_agent_per_s,
                    p.control_bytes_per_agent_per_s,
                    if p.within { "within" } else { "ABOVE BOUND" }
                );
            })?;
            let wall_s = started.elapsed().as_secs_f64();
            println!(
                "{} points x {} seeds in {wall_s:.1} s wall",
                report.points.len(),
                seed_list.len()
            );
            if let Some(path) = json {
                std::fs::write(&path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if report.failed_points > 0 {
                for p in report.points.iter().filter(|p| !p.within) {
                    println!("FAILED: replay with: {}", p.replay);
                }
                return Ok(ExitCode::FAILURE);
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Run {
            scenario,
            seed,
            fleet,
            report_interval_ms,
            lease_ms,
            burst,
            overdraft_permille,
            hysteresis_permille,
            measure_window_ms,
            policy,
            json,
            plot,
            threads,
        } => {
            let mut sc = Scenario::load(&scenario)?;
            let overrides = Overrides {
                report_interval_ms,
                lease_ms,
                burst,
                overdraft_permille,
                hysteresis_permille,
                measure_window_ms,
                ..fleet.overrides()
            };
            let replay = replay_command(&scenario, seed, &overrides, &policy);
            overrides.apply(&mut sc)?;
            for w in sc.faults_after_end() {
                eprintln!("bursar-sim: note: {w}");
            }
            let mut sim = Sim::new(&sc, seed, &policy)?;
            if let Some(t) = threads {
                sim.set_threads(t as usize);
            }
            if plot.is_some() {
                sim.record_series();
            }
            let progress = std::io::stderr().is_terminal();
            if progress {
                sim.on_progress(1 << 16, progress_line());
            }
            let started = Instant::now();
            let (report, series, spent) = sim.run_to_end();
            let wall_s = started.elapsed().as_secs_f64();
            if progress {
                // Clears the progress line.
                eprint!("\r\x1b[2K");
            }
            // The process exits once the report is out: freeing the fleet's engines
            // one by one would only delay that (seconds at 1,000 gateways).
            std::mem::forget(spent);
            let s = &report.summary;
            let events_per_s = report.counters.events as f64 / wall_s.max(1e-9);
            println!(
                "scenario {} seed {} policy {}: {} gateways x {} keys x {} virtual s",
                report.scenario,
                seed,
                report.policy,
                report.gateways,
                report.keys,
                report.duration_s
            );
            println!(
                "  overshoot max {:.4} of B   bound {:.4} of B   ({})",
                s.overshoot_max_fraction_of_burst,
                s.bound_fraction_of_burst,
                if s.violations == 0 {
                    "within"
                } else {
                    "VIOLATED"
                }
            );
            println!(
                "  utilization vs ideal {:.3} (second half {:.3})   jain {}   realloc p95 {}   cold first admit p95 {}",
                s.utilization_vs_ideal,
                s.utilization_second_half,
                opt(s.jain_fairness, 3, ""),
                opt(s.realloc_p95_ms, 0, " ms"),
                opt(s.cold_first_admit_p95_ms, 0, " ms"),
            );
            println!(
                "  control {:.1} messages, {:.0} bytes per agent per s; {} events in {:.2} s wall ({:.0} events/s)",
                s.control_messages_per_agent_per_s,
                s.control_bytes_per_agent_per_s,
                report.counters.events,
                wall_s,
                events_per_s
            );
            for k in report.worst_keys.iter().take(3) {
                println!(
                    "  key {}: overshoot {:.1} tokens, bound {:.1}, admitted {} of ideal {}",
                    k.key, k.overshoot_tokens, k.bound_tokens, k.admitted, k.ideal_admitted
                );
            }
            for v in &report.violation_messages {
                println!("  violation: {v}");
            }
            if let Some(path) = json {
                let mut value = serde_json::to_value(&report)?;
                value["speed"] = serde_json::json!({
                    "wall_s": wall_s,
                    "events_per_s": events_per_s,
                });
                std::fs::write(&path, serde_json::to_string_pretty(&value)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(dir) = plot {
                let paths = write_charts(&dir, &report, &series)
                    .with_context(|| format!("writing charts into {}", dir.display()))?;
                for p in paths {
                    println!("  chart: {}", p.display());
                }
            }
            if s.violations > 0 {
                println!(
                    "FAILED: {} violation(s); replay with: {replay}",
                    s.violations
                );
                return Ok(ExitCode::FAILURE);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn opt(x: Option<f64>, digits: usize, unit: &str) -> String {
    match x {
        Some(v) => format!("{v:.digits$}{unit}"),
        None => "n/a".into(),
    }
}

/// The progress line `run` keeps on a terminal's stderr: virtual time against the
/// run's, events and their rate, and the wall time left at that rate (rewritten at
/// most twice a second; the fleet-scale minute runs for minutes).
fn progress_line() -> impl FnMut(bursar_sim::sim::Progress) {
    let started = Instant::now();
    let mut shown = started;
    move |p| {
        let now = Instant::now();
        if now.duration_since(shown).as_millis() < 500 {
            return;
        }
        shown = now;
        let wall = now.duration_since(started).as_secs_f64();
        let left = if p.virtual_s > 0.0 {
            format!(
                ", ~{:.0} s left",
                wall * (p.duration_s - p.virtual_s).max(0.0) / p.virtual_s
            )
        } else {
            String::new()
        };
        eprint!(
            "\r\x1b[2K  {:.1} / {:.0} virtual s, {:.1} M events ({:.0} k/s){left}",
            p.virtual_s,
            p.duration_s,
            p.events as f64 / 1e6,
            p.events as f64 / wall.max(1e-9) / 1e3,
        );
    }
}
