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
use clap::{Args, Parser, Subcommand};

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
port) and stops on Ctrl-C or SIGTERM. The admin endpoint is JSON: GET /v1/keys \
(per key: limit, demand, committed, per-agent grants, the overshoot bound), GET /v1/status \
(with the rules in force, their version and the last reload error), GET /healthz, and \
POST /v1/admin/reload.\n\nSIGHUP (or POST /v1/admin/reload, or with --watch-config-ms a change \
to the file's contents) re-reads the --config file: a \
file that does not parse or validate is refused with an error naming the file, rule and \
field, and the rules in force stay unchanged; a valid one is applied at once (shrunk limits \
revoke before anything grows, removed rules' grants are released) and its version is sent \
to the agents.\n\n`bursar-allocator local` starts a whole cluster on loopback (this allocator \
and three agents) with synthetic traffic and a live summary.\n\nA new term first learns, for one lease plus the reclaim margin, what agents \
hold, and grants nothing beyond that meanwhile (invariant 4): expect the first grants \
--lease-ms + --reclaim-margin-ms after start.\n\nHigh availability: run replicas with \
--etcd URL; the elected leader's term is its etcd leader key's revision, standbys redirect \
agents to it, and a leader that cannot renew its etcd lease for two thirds of \
--election-ttl-s steps down (exit 1). \
Without etcd run one allocator and give each start a higher term than the last \
(--term-file does this for you)."
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Start a real local cluster on loopback (this allocator in-process, three ledger
    /// processes unless --no-ledger, and agent processes with usage outboxes), drive
    /// skewed synthetic traffic that shifts between agents, and print a live summary
    /// per key: limit, admitted rate, each agent's slice, measured overshoot and its
    /// bound. Exit code 1 if any key overshot beyond its bound plus the measurement
    /// margin, if the ledgers do not all hold the acknowledged completions, if the rules
    /// refused requests as never admissible (400/403) or nothing was admitted; Ctrl-C or
    /// SIGTERM stops the cluster and gives no verdict (exit 1).
    Local(local::LocalArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Rules file (TOML; the agents' file). Default: the embedded demo rules.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Also re-read `--config` when its contents change, looking this often (ms; 0:
    /// only on SIGHUP or POST /v1/admin/reload). For a file that changes under the
    /// allocator, such as a mounted Kubernetes ConfigMap.
    #[arg(long, default_value_t = 0, requires = "config", value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    watch_config_ms: u64,
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
    /// File holding the last term; each start reads it, adds one (or takes the wall
    /// clock in ms, if higher: a lost file does not start over at 1), and writes it back
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
    /// How fast, at most, an agent's clock may run, ppm: rates are granted out of
    /// (R + O) / (1 + ppm) so that fast clocks refill within R + O in real time.
    #[arg(long, default_value_t = 0)]
    clock_drift_ppm: u32,
    /// When one agent's demand for a key jumps and nothing is free, ask the key's other
    /// holders to measure their demand over this window, ms (a holder whose demand
    /// moved away is then seen within it). 0: off.
    #[arg(long, default_value_t = 100)]
    measure_window_ms: u64,
    /// Most agents registered.
    #[arg(long, default_value_t = 4_096)]
    max_agents: usize,
    /// Most limit keys tracked.
    #[arg(long, default_value_t = 1_000_000)]
    max_keys: usize,
    /// Bytes of agents' input (hellos, reports, acks, as converted) queued for the core
    /// at most. While it is spent, streams are not read: TCP holds their agents back.
    #[arg(long, default_value_t = 256 << 20, value_parser = clap::value_parser!(u64).range(65_536..=u32::MAX as u64))]
    input_bytes_max: u64,
    /// Streams waiting for their hello's answer at most; one more is refused at once
    /// (RESOURCE_EXHAUSTED, the agent retries with backoff).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    pending_hellos_max: u64,
    /// Open TCP connections to the stream port at most (a standby's redirect included);
    /// one more is closed at accept and counted (`connections_refused` in /v1/status),
    /// and its agent retries with backoff. Keep it under the process's file-descriptor
    /// limit (`ulimit -n`), with room for the admin endpoint and etcd.
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    connections_max: u64,
    /// Milliseconds a new connection to the stream port (a standby's redirect
    /// included) has to open its stream; one that opens none in time, whether it sent
    /// nothing or only the HTTP/2 preface or a TLS handshake, is closed and counted
    /// (`connections_silent` in /v1/status). An agent opens its stream at once.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    first_stream_timeout_ms: u64,
    /// etcd endpoint for leader election (e.g. http://127.0.0.1:2379). Replicas
    /// campaign; the leader's term is its leader key's revision; the others answer
    /// agents with a redirect to it; a leader that cannot renew its etcd lease for two
    /// thirds of --election-ttl-s steps down (exits 1, for its supervisor to restart it as a
    /// standby). Conflicts with --term and --term-file.
    #[arg(long, conflicts_with_all = ["term", "term_file"])]
    etcd: Option<String>,
    /// Election name in etcd (replicas of one allocator share it).
    #[arg(long, default_value = "bursar/allocator")]
    election_name: String,
    /// TTL of this replica's etcd lease, seconds: how long a dead leader blocks the
    /// election, and how long a cut-off leader keeps serving before it steps down.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i64).range(1..=300))]
    election_ttl_s: i64,
    /// Address agents use to reach this replica's gRPC port (what a standby redirects
    /// to). Default: the bound --grpc address.
    #[arg(long)]
    advertise: Option<String>,
    /// TLS on the agents' stream: this allocator's certificate (PEM). With --tls-key.
    /// Agents then connect with --allocator-ca (and their own certificate when
    /// --tls-client-ca is set).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: the CA that signs agents' certificates (PEM). An agent without a
    /// certificate from it is refused at the handshake.
    #[arg(long, requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
}

/// The stream's TLS configuration from the flags, if any.
fn stream_tls(args: &ServeArgs) -> Result<Option<tonic::transport::ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) else {
        return Ok(None);
    };
    let files = shell::TlsFiles {
        cert: cert.clone(),
        key: key.clone(),
        client_ca: args.tls_client_ca.clone(),
    };
    shell::server_tls(&files)
        .map(Some)
        .map_err(|e| anyhow::anyhow!("TLS on the agents' stream: {e}"))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Local(args)) => local::run(args),
        None => serve(cli.serve),
    }
}

/// The term file's next term: one more than the last run's, never below the wall
/// clock in ms (the default without a file): a lost or emptied file (a pod's emptyDir,
/// a new volume) must not start the count again at 1, or every agent holding a grant
/// of an earlier run is refused ("unknown seq", "newer term") until it restarts.
fn next_term(path: &Path) -> Result<u64> {
    bursar_ledger::counter::next(path).context("the term file")
}

fn serve(args: ServeArgs) -> Result<()> {
    // What the rules were read from (`--watch-config-ms` reloads when it changes).
    let seen =
        bursar_agent::shell::ConfigWatch::contents(args.config.as_deref(), args.watch_config_ms);
    let rules = match &args.config {
        Some(p) => Config::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => {
            eprintln!("bursar-allocator: no --config given, using the embedded demo rules");
            Config::from_toml(DEMO_RULES).context("embedded demo rules")?
        }
    };
    if args.etcd.is_some() {
        return serve_elected(args, rules, seen);
    }
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
    cfg.allocator = allocator_config(&args);
    cfg.rules_path = args.config.clone();
    cfg.input_bytes_max = args.input_bytes_max as usize;
    cfg.pending_hellos_max = args.pending_hellos_max as usize;
    cfg.connections_max = args.connections_max as usize;
    cfg.first_stream_timeout = std::time::Duration::from_millis(args.first_stream_timeout_ms);
    cfg.tls = stream_tls(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let (bound, handle) = shell::start_with_handle(&rules, cfg, rx).await?;
        // Handlers before the listening line: a signal right after it is handled.
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        let mut sighup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("SIGHUP handler")?;
        let mut watch = bursar_agent::shell::ConfigWatch::new(
            args.config.as_deref(),
            args.watch_config_ms,
            seen,
        );
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
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = sigterm.recv() => break,
                _ = sighup.recv() => {
                    watch.reread();
                    reload(&handle, "SIGHUP").await;
                }
                _ = watch.changed() => reload(&handle, "the rules file changed").await,
                _ = handle.core_stopped() => {
                    eprintln!("bursar-allocator: the core task stopped; exiting");
                    std::process::exit(1);
                }
            }
        }
        eprintln!("bursar-allocator: shutting down");
        let _ = tx.send(true);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        Ok(())
    })
}

fn allocator_config(args: &ServeArgs) -> AllocatorConfig {
    AllocatorConfig {
        lease_ms: args.lease_ms,
        reclaim_margin_ms: args.reclaim_margin_ms,
        drift_margin_ms: args.drift_margin_ms,
        overdraft_permille: args.overdraft_permille,
        clock_drift_ppm: args.clock_drift_ppm,
        measure_window_ms: args.measure_window_ms,
        max_agents: args.max_agents,
        max_keys: args.max_keys,
        hash_seed: random_seed(),
        ..AllocatorConfig::default()
    }
}

/// Serves as one replica of an elected allocator: standby (redirecting agents) until
/// elected, then the allocator with the election's term, until stopped or the etcd
/// lease is lost (then exit 1: step down).
fn serve_elected(args: ServeArgs, mut rules: Config, seen: Option<Vec<u8>>) -> Result<()> {
    let endpoint = args.etcd.clone().context("--etcd")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(async move {
        use std::io::Write;
        let election = std::sync::Arc::new(
            shell::election::Election::connect(&endpoint, &args.election_name, args.election_ttl_s)
                .await?,
        );
        let listener = tokio::net::TcpListener::bind(args.grpc)
            .await
            .with_context(|| format!("binding {}", args.grpc))?;
        let grpc = listener.local_addr()?;
        let advertise = args.advertise.clone().unwrap_or_else(|| grpc.to_string());
        println!("bursar-allocator standby: grpc={grpc} campaigning in etcd as {advertise}");
        let _ = std::io::stdout().flush();
        let (sb_tx, sb_rx) = tokio::sync::watch::channel(false);
        let standby = tokio::spawn(shell::election::serve_standby(
            listener,
            std::sync::Arc::clone(&election),
            stream_tls(&args)?,
            args.connections_max as usize,
            std::time::Duration::from_millis(args.first_stream_timeout_ms),
            sb_rx,
        ));
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        let mut sighup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("SIGHUP handler")?;
        let mut watch = bursar_agent::shell::ConfigWatch::new(
            args.config.as_deref(),
            args.watch_config_ms,
            seen,
        );
        let win = election.win(&advertise);
        tokio::pin!(win);
        let leadership = loop {
            tokio::select! {
                won = &mut win => break won?,
                _ = tokio::signal::ctrl_c() => return Ok(()),
                _ = sigterm.recv() => return Ok(()),
                // A standby has no core: it re-reads the file now and serves the new
                // rules if elected (a refused file leaves the rules it has).
                _ = async {
                    tokio::select! {
                        _ = sighup.recv() => watch.reread(),
                        _ = watch.changed() => {}
                    }
                } => match &args.config {
                    None => eprintln!("bursar-allocator: SIGHUP: no --config file to reload"),
                    Some(p) => match shell::reload_rules(p) {
                        Ok(r) => {
                            eprintln!("bursar-allocator: standby: rules re-read ({} rules)", r.rules.len());
                            rules = r;
                        }
                        Err(e) => eprintln!("bursar-allocator: reload refused: {e}; the rules read before are unchanged"),
                    },
                },
            }
        };
        let _ = sb_tx.send(true);
        let _ = standby.await;
        let term = leadership.term;
        let lease = leadership.lease;
        let mut cfg = ShellConfig::new(grpc, Some(args.admin), term);
        cfg.allocator = allocator_config(&args);
        cfg.rules_path = args.config.clone();
        cfg.input_bytes_max = args.input_bytes_max as usize;
        cfg.pending_hellos_max = args.pending_hellos_max as usize;
    cfg.connections_max = args.connections_max as usize;
    cfg.first_stream_timeout = std::time::Duration::from_millis(args.first_stream_timeout_ms);
        cfg.tls = stream_tls(&args)?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        let (bound, handle) = shell::start_with_handle(&rules, cfg, rx).await?;
        println!(
            "bursar-allocator listening: grpc={} admin={} term={term}",
            bound.grpc,
            bound.admin.map_or("-".into(), |a| a.to_string())
        );
        eprintln!(
            "bursar-allocator: elected leader in etcd with term {term}; learning what agents hold for {} ms",
            args.lease_ms + args.reclaim_margin_ms
        );
        let _ = std::io::stdout().flush();
        // Stepping down is its own task: in the loop below, a reload waits behind the
        // core's queue and a recomputation of every changed key, longer than the
        // step-down margin under load, and a deposed leader must not grant meanwhile.
        let mut lost = leadership.lost;
        let ttl_s = args.election_ttl_s;
        tokio::spawn(async move {
            let _ = lost.wait_for(|l| *l).await;
            eprintln!(
                "bursar-allocator: leadership lost (the etcd lease not renewed within {ttl_s} s, \
                 or etcd names another leader): stepping down"
            );
            std::process::exit(1);
        });
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = sigterm.recv() => break,
                _ = sighup.recv() => {
                    watch.reread();
                    reload(&handle, "SIGHUP").await;
                }
                _ = watch.changed() => reload(&handle, "the rules file changed").await,
                _ = handle.core_stopped() => {
                    eprintln!("bursar-allocator: the core task stopped; exiting");
                    std::process::exit(1);
                }
            }
        }
        eprintln!("bursar-allocator: shutting down");
        let _ = tx.send(true);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        // Serving has stopped: the leader key goes now, so a standby is elected at
        // once instead of a TTL later (it learns for a lease before it grants).
        match election.resign(lease).await {
            Ok(()) => eprintln!("bursar-allocator: resigned the leadership in etcd"),
            Err(e) => eprintln!("bursar-allocator: resigning in etcd: {e}; the lease lapses instead"),
        }
        Ok(())
    })
}

/// SIGHUP, or a change `--watch-config-ms` saw (`why`): re-read the rules file. The
/// core task logs the outcome (a refused file names the file, rule and field; the
/// rules in force stay unchanged).
async fn reload(handle: &shell::Handle, why: &str) {
    eprintln!("bursar-allocator: {why}: reloading the rules");
    if handle.reload().await.is_none() {
        eprintln!("bursar-allocator: reload: the core task has stopped");
    }
}

/// A random 64-bit seed from the standard library's per-process hasher keys.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    h.finish()
}

/// `bursar-allocator local`: a real cluster on loopback with synthetic traffic.
mod local {
    use std::collections::HashMap;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::path::PathBuf;
    use std::process::{Child, Command, Stdio};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use anyhow::{Context, Result, bail};
    use bursar_agent::config::Pattern;
    use bursar_agent::testing::ExactBucket;
    use bursar_agent::{Config, Dimension, Mode, RuleLimit};
    use bursar_allocator::AllocatorConfig;
    use bursar_allocator::shell::{self, ShellConfig};
    use clap::Args;

    /// The embedded rules: two per-tenant limits that bind at different loads.
    pub const LOCAL_RULES: &str = r#"
[[rule]]
name = "org-input-tps"
match = { org = "*" }
dimension = "input_tokens"
rate = 20_000
per = "second"
burst = 4_000
posture = "conservative"

[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 150
per = "second"
burst = 30
posture = "conservative"
"#;

    #[derive(Args)]
    pub struct LocalArgs {
        /// Rules file (TOML). Its rules must match the `org` descriptor (the traffic
        /// sends `org` = acme | globex and `key` = k0..k3). Default: embedded rules
        /// (org-input-tps 20,000 input tokens/s, org-rps 150 requests/s).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The bursar-agent binary. Default: next to this binary.
        #[arg(long)]
        agent_bin: Option<PathBuf>,
        /// The bursar-ledger binary. Default: next to this binary.
        #[arg(long)]
        ledger_bin: Option<PathBuf>,
        /// Run without the ledger cluster (no usage outbox on the agents).
        #[arg(long)]
        no_ledger: bool,
        /// Agent processes.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
        agents: u64,
        /// How long to run, in seconds.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
        duration_s: u64,
        /// Offered load, requests per second over all agents (80 % tenant acme, 20 %
        /// globex; cost 20 to 200 input tokens).
        #[arg(long, default_value_t = 240, value_parser = clap::value_parser!(u64).range(1..=5_000))]
        rps: u64,
        /// Seconds before acme's demand moves to the next agent (70 % of it on one
        /// agent, the rest spread).
        #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..=3_600))]
        shift_s: u64,
        /// Lease of every grant, ms (short, so the new term's learning period is too).
        #[arg(long, default_value_t = 2_000)]
        lease_ms: u64,
        /// Reclaim margin, ms.
        #[arg(long, default_value_t = 500)]
        reclaim_margin_ms: u64,
        /// Seed of the synthetic load.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    }

    /// (org, key) -> the keys a request reaches and their dimensions.
    type OfferedRoutes = HashMap<(String, String), Vec<(usize, Dimension)>>;

    const SEC: u64 = 1_000_000_000;
    const TENANTS: [&str; 2] = ["acme", "globex"];

    /// Child processes, killed on drop.
    struct Children(Vec<Child>);

    /// A path in the temporary directory no earlier run used: `prefix-PID-NANOS`
    /// then `suffix`.
    fn unique_temp(prefix: &str, suffix: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        std::env::temp_dir().join(format!("{prefix}-{}-{nanos}{suffix}", std::process::id()))
    }

    /// A directory removed on drop.
    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// One ledger node of the local cluster.
    struct LedgerNode {
        name: String,
        http: Http,
    }

    /// Starts three clustered ledger nodes (development certificates made by
    /// `bursar-ledger certs` in `dir`); returns them with their HTTP addresses.
    fn start_ledgers(
        bin: &std::path::Path,
        dir: &std::path::Path,
        children: &mut Children,
        interrupted: &AtomicBool,
    ) -> Result<Vec<LedgerNode>> {
        let names = ["ledger-0", "ledger-1", "ledger-2"];
        let certs = dir.join("certs");
        let mut cmd = Command::new(bin);
        cmd.arg("certs").arg("--out").arg(&certs);
        for n in names {
            cmd.args(["--node", n]);
        }
        let out = cmd
            .output()
            .with_context(|| format!("running {} certs", bin.display()))?;
        if !out.status.success() {
            bail!(
                "bursar-ledger certs failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let mut nodes = Vec::new();
        let mut seed: Option<String> = None;
        for n in names {
            let mut c = Command::new(bin);
            c.arg("--data-dir")
                .arg(dir.join(n))
                .args([
                    "--node-id",
                    n,
                    "--http",
                    "127.0.0.1:0",
                    "--gossip",
                    "127.0.0.1:0",
                ])
                .arg("--tls-dir")
                .arg(&certs);
            if let Some(s) = &seed {
                c.args(["--peer", s]);
            }
            let log = dir.join(format!("{n}.log"));
            child_io(&mut c, &log)?;
            let mut child = c
                .spawn()
                .with_context(|| format!("starting {}", bin.display()))?;
            let stdout = child.stdout.take().context("ledger stdout")?;
            children.0.push(child);
            let lines = ready_lines(stdout, 2, interrupted, &log)
                .with_context(|| format!("starting ledger {n}"))?;
            let (l1, l2) = (&lines[0], &lines[1]);
            let http: SocketAddr = l1
                .trim()
                .strip_prefix("listening on http://")
                .and_then(|a| a.parse().ok())
                .with_context(|| format!("ledger {n} said {l1:?}; {}", log_tail(&log)))?;
            let gossip = l2
                .trim()
                .strip_prefix("gossip on ")
                .with_context(|| format!("ledger {n} said {l2:?}; {}", log_tail(&log)))?
                .to_string();
            seed.get_or_insert(gossip);
            println!("  ledger {n}: http://{http}");
            nodes.push(LedgerNode {
                name: n.to_string(),
                http: Http {
                    addr: http,
                    conn: None,
                },
            });
        }
        Ok(nodes)
    }

    /// Each ledger's root digest (`events`, `hash`), or None if it did not answer.
    fn ledger_roots(nodes: &mut [LedgerNode]) -> Vec<Option<(u64, String)>> {
        nodes
            .iter_mut()
            .map(|n| {
                let (status, body) = n.http.request("GET", "/v1/digest", "")?;
                if status != 200 {
                    return None;
                }
                let v: serde_json::Value = serde_json::from_str(&body).ok()?;
                Some((
                    v["root"]["events"].as_u64()?,
                    v["root"]["hash"].as_str()?.to_string(),
                ))
            })
            .collect()
    }

    impl Drop for Children {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// A child's settings: its own process group (a terminal's Ctrl-C reaches only
    /// this process, which stops the cluster and says so; until the thirty-first
    /// session the children died with it and the ledger check then waited 30 s on
    /// dead nodes), stdout piped for its readiness line, stderr to `log`.
    fn child_io(cmd: &mut Command, log: &std::path::Path) -> Result<()> {
        use std::os::unix::process::CommandExt as _;
        let f =
            std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
        cmd.process_group(0)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(f));
        Ok(())
    }

    /// The first `n` lines a child prints (its readiness lines), waited for at most
    /// 30 s and only while the run is not interrupted: a child that stalls before its
    /// line fails the start with its log, instead of hanging it.
    fn ready_lines(
        out: std::process::ChildStdout,
        n: usize,
        interrupted: &AtomicBool,
        log: &std::path::Path,
    ) -> Result<Vec<String>> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(out);
            let mut lines = Vec::new();
            for _ in 0..n {
                let mut l = String::new();
                if r.read_line(&mut l).unwrap_or(0) == 0 {
                    break;
                }
                lines.push(l);
            }
            let _ = tx.send(lines);
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(lines) if lines.len() == n => return Ok(lines),
                Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("the process stopped before it was ready; {}", log_tail(log))
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if interrupted.load(Ordering::Relaxed) {
                        bail!("interrupted while the cluster was starting; it is stopped");
                    }
                    if Instant::now() > deadline {
                        bail!("not ready within 30 s; {}", log_tail(log));
                    }
                }
            }
        }
    }

    /// The end of a child's stderr log, for an error that says why it failed.
    fn log_tail(log: &std::path::Path) -> String {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!("{} says:\n  {}", log.display(), tail.join("\n  "))
    }

    /// A keep-alive HTTP/1.1 client over one connection.
    struct Http {
        addr: SocketAddr,
        conn: Option<BufReader<TcpStream>>,
    }

    impl Http {
        fn try_request(
            &mut self,
            method: &str,
            path: &str,
            body: &str,
        ) -> std::io::Result<(u16, String)> {
            if self.conn.is_none() {
                let s = TcpStream::connect(self.addr)?;
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                self.conn = Some(BufReader::new(s));
            }
            let r = self.conn.as_mut().expect("connected");
            write!(
                r.get_mut(),
                "{method} {path} HTTP/1.1\r\nHost: local\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            )?;
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let status = line
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .ok_or(std::io::ErrorKind::InvalidData)?;
            let mut len = 0usize;
            loop {
                let mut h = String::new();
                r.read_line(&mut h)?;
                let h = h.trim_end();
                if h.is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':')
                    && k.eq_ignore_ascii_case("content-length")
                {
                    len = v
                        .trim()
                        .parse()
                        .map_err(|_| std::io::ErrorKind::InvalidData)?;
                }
            }
            let mut b = vec![0; len];
            r.read_exact(&mut b)?;
            Ok((status, String::from_utf8_lossy(&b).into_owned()))
        }

        fn request(&mut self, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
            match self.try_request(method, path, body) {
                Ok(x) => Some(x),
                Err(_) => {
                    self.conn = None;
                    self.try_request(method, path, body).ok()
                }
            }
        }

        fn post(&mut self, path: &str, body: &str) -> Option<(u16, String)> {
            self.request("POST", path, body)
        }
    }

    /// Charges `cost` admitted at `now` (log order: never going back) to a key's
    /// verifier, the engine's own exact bucket (`bursar_agent::testing::ExactBucket`:
    /// levels in units x the rule's period in ns, so a rule of any period refills
    /// exactly; a rate per second by integer division once refilled nothing at 1,000
    /// an hour, and every such run read as overshoot).
    fn debit(v: &mut ExactBucket, now: u64, cost: u64) {
        v.advance(now);
        v.charge(cost);
    }

    /// A verifier's deepest deficit so far, units (0: none).
    fn overshoot(v: &ExactBucket) -> f64 {
        v.worst_deficit_tokens().max(0.0)
    }

    /// One rate-limited key the traffic can reach.
    struct KeyInfo {
        name: String,
        rule: String,
        values: Vec<String>,
        rate: u64,
        burst: u64,
        period_ns: u64,
        verifier: ExactBucket,
        admitted_window: u64,
        offered_window: u64,
    }

    /// Admissions logged by the load threads: (test clock at logging, key, cost).
    #[derive(Default)]
    struct Log {
        events: Vec<(u64, usize, u64)>,
        /// Offered cost per key since the last summary.
        offered: Vec<u64>,
    }

    struct Shared {
        start: Instant,
        stop: AtomicBool,
        log: Mutex<Log>,
        /// Largest time from sending an admit to logging its admission, ns.
        l_max: AtomicU64,
        decisions: AtomicU64,
        admitted: AtomicU64,
        errors: AtomicU64,
        /// Admissions refused as requests the rules can never admit (400: never fits,
        /// invalid; 403: no rule): a `--config` that does not fit the traffic. Any
        /// fails the run (it was a pass with nothing, or little, admitted).
        refused: AtomicU64,
        /// Completions the agents acknowledged (200), and their input tokens.
        completed: AtomicU64,
        completed_tokens: AtomicU64,
        /// Completions without a 200 (no answer, or 503 after the record was queued):
        /// each may or may not be in the ledgers.
        completed_unknown: AtomicU64,
    }

    fn values_for(rule: &bursar_agent::Rule, desc: &[(&str, &str)]) -> Option<Vec<String>> {
        let mut out = Vec::new();
        for (k, p) in &rule.matches {
            let v = desc.iter().find(|(dk, _)| dk == k)?.1;
            match p {
                Pattern::Each => out.push(v.to_string()),
                Pattern::Exact(e) if **e == *v => {}
                Pattern::Exact(_) => return None,
            }
        }
        Some(out)
    }

    pub fn run(args: LocalArgs) -> Result<()> {
        let (rules, rules_path, _tmp) = match &args.config {
            Some(p) => (
                Config::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
                p.clone(),
                None,
            ),
            None => {
                let p = unique_temp("bursar-local", ".toml");
                std::fs::write(&p, LOCAL_RULES).context("writing the rules for the agents")?;
                (
                    Config::from_toml(LOCAL_RULES).context("embedded rules")?,
                    p.clone(),
                    Some(TempFile(p)),
                )
            }
        };
        let agent_bin = match &args.agent_bin {
            Some(p) => p.clone(),
            None => std::env::current_exe()
                .context("locating this binary")?
                .with_file_name("bursar-agent"),
        };
        if !agent_bin.exists() {
            bail!(
                "{} not found: build it (`cargo build -p bursar-agent`) or pass --agent-bin",
                agent_bin.display()
            );
        }
        // Keys the traffic reaches: every rate rule matched by org (and key) values.
        let mut keys: Vec<KeyInfo> = Vec::new();
        let mut routes: HashMap<(String, String, String), Vec<usize>> = HashMap::new();
        let mut offered_routes: OfferedRoutes = HashMap::new();
        for org in TENANTS {
            for k in ["k0", "k1", "k2", "k3"] {
                let desc = [("org", org), ("key", k)];
                for r in rules.rules.rules() {
                    let RuleLimit::Rate { rate, per, burst } = r.limit else {
                        continue;
                    };
                    if r.mode == Mode::Shadow {
                        continue;
                    }
                    let Some(values) = values_for(r, &desc) else {
                        continue;
                    };
                    let name = format!("{}{{{}}}", r.name, values.join(","));
                    let idx = match keys.iter().position(|x| x.name == name) {
                        Some(i) => i,
                        None => {
                            keys.push(KeyInfo {
                                name,
                                rule: r.name.clone(),
                                values,
                                rate,
                                burst,
                                period_ns: per.as_ns(),
                                verifier: ExactBucket::new(rate, burst, per.as_ns(), 0),
                                admitted_window: 0,
                                offered_window: 0,
                            });
                            keys.len() - 1
                        }
                    };
                    routes
                        .entry((org.to_string(), k.to_string(), r.name.clone()))
                        .or_default()
                        .push(idx);
                    offered_routes
                        .entry((org.to_string(), k.to_string()))
                        .or_default()
                        .push((idx, r.dimension));
                }
            }
        }
        if keys.is_empty() {
            bail!("no enforced rate rule matches the traffic's `org` / `key` descriptors");
        }

        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("tokio runtime")?;
        // SIGINT and SIGTERM stop the run: the traffic ends, the children are stopped,
        // the temporary files removed, and no verdict is given.
        let interrupted = Arc::new(AtomicBool::new(false));
        {
            let flag = Arc::clone(&interrupted);
            use tokio::signal::unix::{SignalKind, signal};
            let (mut term, mut hup) = {
                let _in_rt = rt.enter();
                (
                    signal(SignalKind::terminate()).context("SIGTERM handler")?,
                    // A closed terminal: the children are in their own process groups
                    // and would not hear it.
                    signal(SignalKind::hangup()).context("SIGHUP handler")?,
                )
            };
            rt.spawn(async move {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                    _ = hup.recv() => {}
                }
                flag.store(true, Ordering::Relaxed);
            });
        }
        let (sd_tx, sd_rx) = tokio::sync::watch::channel(false);
        let term = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .context("clock before 1970")?
            .as_millis() as u64;
        let mut cfg = ShellConfig::new(
            "127.0.0.1:0".parse().expect("address"),
            Some("127.0.0.1:0".parse().expect("address")),
            term,
        );
        cfg.allocator = AllocatorConfig {
            lease_ms: args.lease_ms,
            reclaim_margin_ms: args.reclaim_margin_ms,
            ..AllocatorConfig::default()
        };
        let (bound, handle) = rt
            .block_on(shell::start_with_handle(&rules, cfg, sd_rx))
            .context("starting the allocator")?;
        println!(
            "bursar-allocator local: allocator grpc={} admin=http://{}/v1/keys (term {term})",
            bound.grpc,
            bound.admin.map_or("-".into(), |a| a.to_string())
        );

        // Declared before the children: they are stopped (dropped) before it is
        // removed. New each run (a directory left by a killed run whose process id
        // came back was reused, old ledger data and all).
        let work = TempDir(unique_temp("bursar-local", ""));
        std::fs::create_dir(&work.0).with_context(|| format!("creating {}", work.0.display()))?;
        let mut children = Children(Vec::new());
        let mut ledgers = if args.no_ledger {
            Vec::new()
        } else {
            let ledger_bin = match &args.ledger_bin {
                Some(p) => p.clone(),
                None => std::env::current_exe()
                    .context("locating this binary")?
                    .with_file_name("bursar-ledger"),
            };
            if !ledger_bin.exists() {
                bail!(
                    "{} not found: build it (`cargo build -p bursar-ledger`), pass \
                     --ledger-bin, or run with --no-ledger",
                    ledger_bin.display()
                );
            }
            start_ledgers(&ledger_bin, &work.0, &mut children, &interrupted)?
        };
        let ledger_urls: Vec<String> = ledgers
            .iter()
            .map(|l| format!("http://{}", l.http.addr))
            .collect();
        let mut agents: Vec<(String, SocketAddr)> = Vec::new();
        for i in 0..args.agents {
            let name = format!("local-{i}");
            let mut cmd = Command::new(&agent_bin);
            cmd.arg("--config")
                .arg(&rules_path)
                .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
                .args(["--allocator", &bound.grpc.to_string(), "--agent-id", &name])
                .args(["--allocator-backoff-max-ms", "1000"]);
            if !ledger_urls.is_empty() {
                // Each agent's outbox delivers to two of the three ledgers (kept until
                // both hold an event); the cluster replicates to the third.
                cmd.arg("--outbox-dir")
                    .arg(work.0.join(format!("outbox-{name}")));
                for j in 0..2 {
                    cmd.args([
                        "--ledger",
                        &ledger_urls[(i as usize + j) % ledger_urls.len()],
                    ]);
                }
            }
            let log = work.0.join(format!("{name}.log"));
            child_io(&mut cmd, &log)?;
            let mut child = cmd
                .spawn()
                .with_context(|| format!("starting {}", agent_bin.display()))?;
            let stdout = child.stdout.take().context("agent stdout")?;
            children.0.push(child);
            let line = ready_lines(stdout, 1, &interrupted, &log)
                .with_context(|| format!("starting agent {name}"))?
                .remove(0);
            let http = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("http="))
                .and_then(|a| a.parse().ok())
                .with_context(|| format!("agent {name} said {line:?}; {}", log_tail(&log)))?;
            println!("  agent {name}: http://{http}");
            agents.push((name, http));
        }
        println!(
            "A new term learns what agents hold for {} ms before its first grants; the \
             traffic starts after that.\n",
            args.lease_ms + args.reclaim_margin_ms
        );

        // Traffic starts once the term has learned and every agent is connected.
        let ready = Instant::now();
        loop {
            let snap = rt
                .block_on(handle.snapshot())
                .context("allocator stopped")?;
            if !snap.learning && snap.connected == agents.len() {
                break;
            }
            if interrupted.load(Ordering::Relaxed) {
                bail!("interrupted before the traffic started; the cluster is stopped");
            }
            if ready.elapsed() > Duration::from_secs(30) {
                bail!(
                    "the agents did not connect within 30 s (their logs: {}/local-*.log)",
                    work.0.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let shared = Arc::new(Shared {
            start: Instant::now(),
            stop: AtomicBool::new(false),
            log: Mutex::new(Log::default()),
            l_max: AtomicU64::new(0),
            decisions: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            completed_unknown: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            completed_tokens: AtomicU64::new(0),
        });
        let routes = Arc::new((routes, offered_routes));
        shared.log.lock().expect("log").offered = vec![0; keys.len()];
        let n_agents = agents.len();
        let mut threads = Vec::new();
        for (i, (_, http)) in agents.iter().enumerate() {
            let (shared, routes, http) = (Arc::clone(&shared), Arc::clone(&routes), *http);
            let (rps, shift_ns, seed) = (args.rps as f64, args.shift_s * SEC, args.seed);
            threads.push(std::thread::spawn(move || {
                load(
                    i, n_agents, http, rps, shift_ns, seed, &shared, &routes.0, &routes.1,
                )
            }));
        }

        let ctrl_c = Arc::clone(&interrupted);
        let mut worst: (f64, f64, String) = (0.0, 0.0, String::new());
        let mut last_t = 0u64;
        for second in 1..=args.duration_s {
            let due = shared.start + Duration::from_secs(second);
            while Instant::now() < due && !ctrl_c.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if ctrl_c.load(Ordering::Relaxed) {
                break;
            }
            let (events, offered) = {
                let mut log = shared.log.lock().expect("log");
                let n = log.offered.len();
                (
                    std::mem::take(&mut log.events),
                    std::mem::replace(&mut log.offered, vec![0; n]),
                )
            };
            for (k, o) in offered.into_iter().enumerate() {
                keys[k].offered_window = o;
            }
            for (t, k, cost) in events {
                debit(&mut keys[k].verifier, t, cost);
                keys[k].admitted_window += cost;
            }
            let now = shared.start.elapsed().as_nanos() as u64;
            let window_s = (now - last_t) as f64 / SEC as f64;
            last_t = now;
            let snap = rt
                .block_on(handle.snapshot())
                .context("allocator stopped")?;
            let l_max = shared.l_max.load(Ordering::Relaxed);
            let hot = ((now / (args.shift_s * SEC)) as usize) % n_agents;
            println!(
                "t={second:>3}s  term {}{}  decisions {}  admitted {}  acme's demand on {}  \
                 (measurement margin: largest admit round trip {:.1} ms)",
                snap.term,
                if snap.learning { " (learning)" } else { "" },
                shared.decisions.load(Ordering::Relaxed),
                shared.admitted.load(Ordering::Relaxed),
                agents[hot].0,
                l_max as f64 / 1e6
            );
            if !ledgers.is_empty() {
                let roots = ledger_roots(&mut ledgers);
                let held: Vec<String> = ledgers
                    .iter()
                    .zip(&roots)
                    .map(|(l, r)| {
                        format!(
                            "{}={}",
                            l.name,
                            r.as_ref().map_or("?".into(), |r| r.0.to_string())
                        )
                    })
                    .collect();
                println!(
                    "  ledger: usage events held {}  (completions acknowledged {})",
                    held.join(" "),
                    shared.completed.load(Ordering::Relaxed)
                );
            }
            println!(
                "  {:<22} {:>18} {:>10} {:>10}  {:<36} {:>9} {:>12}",
                "key",
                "limit",
                "offered/s",
                "admitted/s",
                "slice per agent (rate)",
                "overshoot",
                "bound+margin"
            );
            for k in keys.iter_mut() {
                let status = snap
                    .keys
                    .iter()
                    .find(|s| s.key.rule == k.rule && s.key.values == k.values);
                let slices: Vec<String> = agents
                    .iter()
                    .map(|(name, _)| {
                        let r = status
                            .and_then(|s| s.agents.iter().find(|a| &*a.agent == name))
                            .map_or(0, |a| a.granted.rate);
                        format!("{}={r}", name.trim_start_matches("local-"))
                    })
                    .collect();
                let per = k.period_ns as f64 / SEC as f64;
                let overshoot = overshoot(&k.verifier);
                // Measurement margin: R per ns times the largest round trip, plus 1 ms.
                let margin = k.rate as f64 / per * (l_max as f64 + 1e6) / 1e9;
                let bound = status.map_or(0.0, |s| s.bound.excess_over(SEC) as f64);
                if overshoot - (bound + margin) > worst.0 - worst.1 {
                    worst = (overshoot, bound + margin, k.name.clone());
                }
                println!(
                    "  {:<22} {:>9}/{:<3} b{:<5} {:>10.0} {:>10.0}  {:<36} {:>9.1} {:>12}",
                    k.name,
                    k.rate,
                    if per == 1.0 {
                        "s".to_string()
                    } else {
                        format!("{per}s")
                    },
                    k.burst,
                    k.offered_window as f64 / window_s,
                    k.admitted_window as f64 / window_s,
                    slices.join(" "),
                    overshoot,
                    format!("{bound:.0}+{margin:.0}")
                );
                k.admitted_window = 0;
            }
        }
        shared.stop.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        if interrupted.load(Ordering::Relaxed) {
            let _ = sd_tx.send(true);
            drop(children);
            bail!(
                "interrupted after {} decisions; the cluster is stopped (no verdict)",
                shared.decisions.load(Ordering::Relaxed)
            );
        }
        // Billing check: every acknowledged completion is in every ledger exactly once
        // (the outboxes drain, the cluster converges).
        let ledger_check = if ledgers.is_empty() {
            None
        } else {
            let want = shared.completed.load(Ordering::Relaxed);
            // Completions not answered 200 may be held too (their record was queued
            // before the answer was lost or refused).
            let maybe = shared.completed_unknown.load(Ordering::Relaxed);
            let t0 = Instant::now();
            loop {
                let roots = ledger_roots(&mut ledgers);
                let agreed = roots
                    .iter()
                    .all(|r| r.as_ref().is_some_and(|r| Some(r) == roots[0].as_ref()));
                let held = roots[0].as_ref().map_or(0, |r| r.0);
                if agreed && (want..=want + maybe).contains(&held) {
                    break Some(Ok((held, t0.elapsed())));
                }
                // More than could have been sent never comes right: no need to wait.
                let over = roots
                    .iter()
                    .any(|r| r.as_ref().is_some_and(|r| r.0 > want + maybe));
                if over || t0.elapsed() > Duration::from_secs(30) {
                    break Some(Err(roots));
                }
                if interrupted.load(Ordering::Relaxed) {
                    let _ = sd_tx.send(true);
                    drop(children);
                    bail!("interrupted while waiting for the ledgers; the cluster is stopped");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        };
        let _ = sd_tx.send(true);
        drop(children);
        println!(
            "\ndone: {} decisions, {} admitted, {} errors. Overshoot is measured by a \
             verifier token bucket (R, B) per key over every admission, logged on one clock; \
             bound = the allocator's overshoot bound over 1 s + the measurement margin.",
            shared.decisions.load(Ordering::Relaxed),
            shared.admitted.load(Ordering::Relaxed),
            shared.errors.load(Ordering::Relaxed),
        );
        // Every verdict is reported, then the run fails if any did.
        let mut failed = Vec::new();
        match ledger_check {
            None => {}
            Some(Ok((n, took))) => println!(
                "ledger: all 3 nodes hold the same {n} events for the {} acknowledged \
                 completions ({} input tokens; {} more completions went unanswered), with \
                 equal digests ({:.1} s after the traffic stopped).",
                shared.completed.load(Ordering::Relaxed),
                shared.completed_tokens.load(Ordering::Relaxed),
                shared.completed_unknown.load(Ordering::Relaxed),
                took.as_secs_f64()
            ),
            Some(Err(roots)) => failed.push(format!(
                "ledger: the nodes hold {roots:?} events (count, digest), expected the {} \
                 acknowledged completions (up to {} more unanswered) on each",
                shared.completed.load(Ordering::Relaxed),
                shared.completed_unknown.load(Ordering::Relaxed)
            )),
        }
        if worst.0 > worst.1 {
            failed.push(format!(
                "{}: overshoot {:.1} beyond its bound plus margin {:.1}",
                worst.2, worst.0, worst.1
            ));
        } else {
            println!("no key overshot beyond its bound.");
        }
        let refused = shared.refused.load(Ordering::Relaxed);
        if refused > 0 {
            failed.push(format!(
                "{refused} admissions refused as requests the rules can never admit (400 or \
                 403: does --config match the traffic's org and key descriptors, with bursts \
                 above its costs of up to 200?)"
            ));
        }
        if shared.admitted.load(Ordering::Relaxed) == 0 {
            failed.push("nothing was admitted".to_string());
        }
        if !failed.is_empty() {
            bail!("{}", failed.join("; "));
        }
        Ok(())
    }

    /// Deletes a file on drop.
    struct TempFile(PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn load(
        agent: usize,
        agents: usize,
        http: SocketAddr,
        rps: f64,
        shift_ns: u64,
        seed: u64,
        shared: &Shared,
        routes: &HashMap<(String, String, String), Vec<usize>>,
        offered_routes: &OfferedRoutes,
    ) {
        let mut c = Http {
            addr: http,
            conn: None,
        };
        let mut rng = seed
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(agent as u64)
            | 1;
        let mut next = rng_unit(&mut rng) * 0.01;
        let mut n = 0u64;
        while !shared.stop.load(Ordering::Relaxed) {
            let now = shared.start.elapsed().as_nanos() as u64;
            let hot = ((now / shift_ns) as usize) % agents;
            // acme: 80 % of the load, 70 % of it on the hot agent (all of it with one
            // agent); globex: 20 %, spread evenly.
            let acme_share = if agents == 1 {
                1.0
            } else if agent == hot {
                0.7
            } else {
                0.3 / (agents - 1) as f64
            };
            let acme = 0.8 * rps * acme_share;
            let globex = 0.2 * rps / agents as f64;
            let total = acme + globex;
            let t = now as f64 / SEC as f64;
            if t < next {
                std::thread::sleep(Duration::from_secs_f64((next - t).min(0.005)));
                continue;
            }
            next += 1.0 / total;
            n += 1;
            let org = if rng_unit(&mut rng) * total < acme {
                TENANTS[0]
            } else {
                TENANTS[1]
            };
            let key = ["k0", "k1", "k2", "k3"][(rng_next(&mut rng) % 4) as usize];
            let cost = 20 + rng_next(&mut rng) % 181;
            let id = format!("l{agent}-{n}");
            let sent = shared.start.elapsed().as_nanos() as u64;
            let body = format!(
                r#"{{"request_id":"{id}","descriptors":{{"org":"{org}","key":"{key}"}},"cost":{{"input_tokens":{cost},"output_tokens":0}}}}"#
            );
            shared.decisions.fetch_add(1, Ordering::Relaxed);
            if let Some(ks) = offered_routes.get(&(org.to_string(), key.to_string())) {
                let mut log = shared.log.lock().expect("log");
                for &(k, dim) in ks {
                    let units = match dim {
                        Dimension::Requests | Dimension::Concurrency => 1,
                        Dimension::InputTokens | Dimension::TotalTokens => cost,
                        Dimension::OutputTokens => 0,
                    };
                    if let Some(o) = log.offered.get_mut(k) {
                        *o += units;
                    }
                }
            }
            let Some((status, resp)) = c.post("/v1/admit", &body) else {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if status != 200 {
                if status == 400 || status == 403 {
                    shared.refused.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&resp) else {
                shared.errors.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if v["admitted"] != true {
                continue;
            }
            shared.admitted.fetch_add(1, Ordering::Relaxed);
            {
                let mut log = shared.log.lock().expect("log");
                let at = shared.start.elapsed().as_nanos() as u64;
                shared.l_max.fetch_max(at - sent, Ordering::Relaxed);
                for l in v["limits"].as_array().into_iter().flatten() {
                    let (Some(rule), Some(cost)) = (l["rule"].as_str(), l["cost"].as_u64()) else {
                        continue;
                    };
                    if let Some(ks) =
                        routes.get(&(org.to_string(), key.to_string(), rule.to_string()))
                    {
                        for &k in ks {
                            log.events.push((at, k, cost));
                        }
                    }
                }
            }
            let done = format!(r#"{{"request_id":"{id}","usage":{{"input_tokens":{cost}}}}}"#);
            match c.post("/v1/complete", &done) {
                Some((200, _)) => {
                    shared.completed.fetch_add(1, Ordering::Relaxed);
                    shared.completed_tokens.fetch_add(cost, Ordering::Relaxed);
                }
                _ => {
                    shared.errors.fetch_add(1, Ordering::Relaxed);
                    shared.completed_unknown.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn rng_next(s: &mut u64) -> u64 {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    }

    fn rng_unit(s: &mut u64) -> f64 {
        (rng_next(s) >> 11) as f64 / (1u64 << 53) as f64
    }

    #[cfg(test)]
    mod tests {
        use super::{debit, overshoot};
        use bursar_agent::testing::ExactBucket;

        /// Review, thirty-first session: the verifier's refill was the rate per second
        /// by integer division, so 1,000 an hour refilled nothing (and 100 a minute
        /// 1 a second instead of 1.67): `--config` with such rules read overshoot
        /// where there was none.
        #[test]
        fn the_verifier_refills_at_a_rule_s_own_period() {
            let hour = 3_600_000_000_000u64;
            let mut v = ExactBucket::new(1_000, 10, hour, 0);
            debit(&mut v, 0, 10);
            // 3.6 s refill exactly one unit of 1,000 an hour.
            debit(&mut v, 3_600_000_000, 1);
            assert_eq!(overshoot(&v), 0.0);
            debit(&mut v, 3_600_000_000, 1);
            // One unit, less the engine's rounding slack (2 ns of refill).
            assert!((overshoot(&v) - 1.0).abs() < 1e-6, "{}", overshoot(&v));
            let minute = 60_000_000_000u64;
            let mut v = ExactBucket::new(100, 100, minute, 0);
            debit(&mut v, 0, 100);
            // 100 a minute: 50 in 30 s, not 30.
            debit(&mut v, 30_000_000_000, 50);
            assert_eq!(overshoot(&v), 0.0);
        }
    }
}
