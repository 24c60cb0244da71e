//! `bursar-allocator`: moves budget slices between Bursar agents by demand, never
//! granting more than each limit (plus the configured overdraft).
//!
//! Without a subcommand it serves the agents' gRPC stream and the JSON admin endpoint.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use bursar_agent::Config;
use bursar_agent::testing::DEMO_RULES;
use bursar_allocator::AllocatorConfig;
use bursar_allocator::shell::{self, ShellConfig};
use clap::{Args, Parser};

#[derive(Parser)]
#[command(
    name = "bursar-allocator",
    version,
    about = "Bursar allocator: moves budget slices between agents by demand, never over-granting",
    long_about = "Bursar allocator: moves budget slices between agents by demand, never \
over-granting.\n\nAgents connect with `bursar-agent --allocator ADDR` (one gRPC stream each, \
protocol bursar.allocator.v1) and report their demand every 250 ms; the allocator answers \
with grants (rate, burst, lease) whose sum per limit key never exceeds the rule's limit \
(plus --overdraft-permille). Rules come from the same TOML file the agents read.\n\nIt prints \
one line `bursar-allocator listening: grpc=ADDR admin=ADDR` once bound (port 0 picks a free \
port) and stops on Ctrl-C or SIGTERM. The admin endpoint is read-only JSON: GET /v1/keys \
(per key: limit, demand, committed, per-agent grants, the overshoot bound), GET /v1/status, \
GET /healthz.\n\nA new term first learns, for one lease plus the reclaim margin, what agents \
hold, and grants nothing beyond that meanwhile (invariant 4): expect the first grants \
--lease-ms + --reclaim-margin-ms after start.\n\nNot built: HA election. Run one allocator; \
give each start a higher term than the last (--term-file does this for you)."
)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Args)]
struct ServeArgs {
    /// Rules file (TOML; the agents' file). Default: the embedded demo rules.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Agents' gRPC stream address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7070")]
    grpc: std::net::SocketAddr,
    /// JSON admin endpoint address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7071")]
    admin: std::net::SocketAddr,
    /// The term (epoch of every grant). Must exceed every earlier run's. Conflicts with
    /// --term-file. Default without either: wall-clock milliseconds since 1970.
    #[arg(long, conflicts_with = "term_file", value_parser = clap::value_parser!(u64).range(1..))]
    term: Option<u64>,
    /// File holding the last term; each start reads it, adds one, and writes it back
    /// (fsynced) before serving.
    #[arg(long)]
    term_file: Option<PathBuf>,
    /// Lease of every grant, ms. Agents cut off from the allocator keep their grants this
    /// long, then follow the rule's posture.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// Margin after a lease before the allocator reclaims an unreachable agent's grant, ms.
    #[arg(long, default_value_t = 1_000)]
    reclaim_margin_ms: u64,
    /// Subtracted from each lease's end in the agent's clock (clock-rate drift), ms.
    #[arg(long, default_value_t = 200)]
    drift_margin_ms: u64,
    /// Overdraft O in permille of each rule's rate: the only excess ever granted.
    #[arg(long, default_value_t = 0)]
    overdraft_permille: u32,
    /// Most agents registered.
    #[arg(long, default_value_t = 4_096)]
    max_agents: usize,
    /// Most limit keys tracked.
    #[arg(long, default_value_t = 1_000_000)]
    max_keys: usize,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    serve(cli.serve)
}

fn next_term(path: &Path) -> Result<u64> {
    let last = match std::fs::read_to_string(path) {
        Ok(s) => s
            .trim()
            .parse::<u64>()
            .with_context(|| format!("{}: not a term number", path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let term = last.checked_add(1).context("term overflow")?;
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write;
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        writeln!(f, "{term}")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming onto {}", path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(d) = std::fs::File::open(dir)
    {
        let _ = d.sync_all();
    }
    Ok(term)
}

fn serve(args: ServeArgs) -> Result<()> {
    let rules = match &args.config {
        Some(p) => Config::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => {
            eprintln!("bursar-allocator: no --config given, using the embedded demo rules");
            Config::from_toml(DEMO_RULES).context("embedded demo rules")?
        }
    };
    let term = match (args.term, &args.term_file) {
        (Some(t), _) => t,
        (None, Some(p)) => next_term(p)?,
        (None, None) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .context("the wall clock is before 1970")?
            .as_millis() as u64,
    };
    if term == 0 {
        bail!("the term must be at least 1");
    }
    let mut cfg = ShellConfig::new(args.grpc, Some(args.admin), term);
    cfg.allocator = AllocatorConfig {
        lease_ms: args.lease_ms,
        reclaim_margin_ms: args.reclaim_margin_ms,
        drift_margin_ms: args.drift_margin_ms,
        overdraft_permille: args.overdraft_permille,
        max_agents: args.max_agents,
        max_keys: args.max_keys,
        hash_seed: random_seed(),
        ..AllocatorConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let bound = shell::start(&rules, cfg, rx).await?;
        println!(
            "bursar-allocator listening: grpc={} admin={}",
            bound.grpc,
            bound.admin.map_or("-".into(), |a| a.to_string())
        );
        eprintln!(
            "bursar-allocator: term {term}, {} rules; learning what agents hold for {} ms",
            rules.rules.len(),
            args.lease_ms + args.reclaim_margin_ms
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = sigterm.recv() => {}
        }
        eprintln!("bursar-allocator: shutting down");
        let _ = tx.send(true);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        Ok(())
    })
}

/// A random 64-bit seed from the standard library's per-process hasher keys.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.finish()
}
