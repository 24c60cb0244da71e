//! `bursar-sim`: run a scenario against the real agent and allocator cores and check
//! overshoot against the allocator's stated bound. See docs/simulation.md.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use bursar_sim::scenario::{BUILT_INS, Scenario};
use bursar_sim::sim::{Sim, replay_command};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "bursar-sim",
    about = "Bursar fleet simulator (virtual time, real cores)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
        /// Override the number of gateways.
        #[arg(long)]
        gateways: Option<usize>,
        /// Override the number of keys.
        #[arg(long)]
        keys: Option<usize>,
        /// Override the virtual duration of traffic, seconds.
        #[arg(long)]
        duration_s: Option<f64>,
        /// Allocation policy: `bursar` (the real allocator), `static` (R/N each),
        /// `doorman` (proportional shares without revoke-before-grant) or `gubernator`
        /// (every gateway holds the full limit and syncs hits every report interval).
        #[arg(long, default_value = "bursar")]
        policy: String,
        /// Write the JSON report here.
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
        Cmd::Run {
            scenario,
            seed,
            gateways,
            keys,
            duration_s,
            policy,
            json,
        } => {
            let mut sc = Scenario::load(&scenario)?;
            let replay = replay_command(&scenario, seed, gateways, keys, duration_s, &policy);
            if let Some(g) = gateways {
                sc.gateways = g;
            }
            if let Some(k) = keys {
                sc.keys = k;
            }
            if let Some(d) = duration_s {
                sc.duration_s = d;
            }
            sc.validate()?;
            let sim = Sim::new(&sc, seed, &policy)?;
            let started = Instant::now();
            let report = sim.run();
            let wall_s = started.elapsed().as_secs_f64();
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
                "  utilization vs ideal {:.3}   jain {}   realloc p95 {}   cold first admit p95 {}",
                s.utilization_vs_ideal,
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
