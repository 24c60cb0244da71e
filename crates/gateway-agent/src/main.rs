//! `bursar-agent`: the Bursar gateway agent.
//!
//! Without a subcommand it serves the front doors (HTTP JSON API, Envoy RLS v3) over
//! one engine, standalone (each key's slice is the rule's whole limit). `demo` drives
//! the engine with synthetic traffic; `check-config` validates a rules file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bursar_agent::clock::{Clock, CoarseClock};
use bursar_agent::shell::forward::ForwardConfig;
use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
use bursar_agent::testing::DEMO_RULES;
use bursar_agent::{
    AdmitRequest, CompletionStatus, Config, Cost, Decision, Engine, MemorySink, RuleLimit, Usage,
};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "bursar-agent",
    version,
    args_conflicts_with_subcommands = true,
    about = "Bursar gateway agent: admits or rejects each request against in-memory budget slices",
    long_about = "Bursar gateway agent: admits or rejects each request against in-memory \
budget slices, with no network hop.\n\nWithout a subcommand it serves the HTTP JSON API \
(/v1/admit, /v1/complete, /v1/extend, /healthz, /metrics; see docs/api.md) and Envoy's rate \
limit service v3 over gRPC, standalone: each limit key's slice is the rule's whole limit. It \
prints one line `bursar-agent listening: http=ADDR grpc=ADDR` (and `proxy=ADDR` with the \
proxy) once bound, and stops on \
Ctrl-C or SIGTERM. With --proxy-listen and --proxy-upstream it also runs an \
OpenAI-compatible proxy (/v1/chat/completions, /v1/completions, /v1/embeddings).\n\nWith \
--allocator ADDR it joins a fleet: slices come from `bursar-allocator` (docs/allocator.md).\n\n\
SIGHUP (or, with --watch-config-ms, a change to the file) re-reads --config: new numbers of \
the rules in force apply at once, without a fresh burst; a file that adds, removes or \
re-matches rules is refused with the rule and field named, and changes nothing (`check-config \
NEW --reload-from CURRENT` tries it first; docs/configuration.md, \"Reloading the rules\")."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Parser)]
struct ServeArgs {
    /// Rules file (TOML, docs/configuration.md). Default: the embedded demo rules.
    /// SIGHUP re-reads it and applies its rules' new numbers (rate, burst, slots,
    /// mode, ...); other changes are refused and need a restart.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Also re-read `--config` when its contents change, looking this often (ms; 0:
    /// only on SIGHUP). For files that change under the agent, such as a mounted
    /// Kubernetes ConfigMap.
    #[arg(long, default_value_t = 0, requires = "config", value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    watch_config_ms: u64,
    /// HTTP JSON API address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: std::net::SocketAddr,
    /// Envoy RLS v3 gRPC address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8081")]
    grpc: std::net::SocketAddr,
    /// Which Envoy RLS responses carry the rate-limit headers (`response_headers_to_add`):
    /// always, over-limit (the default: the client needs Retry-After) or never.
    #[arg(long, value_enum, default_value = "over-limit")]
    rls_headers: RlsHeadersArg,
    /// Allocator address (host:port). Sets `slice_source = "allocated"`: each key's
    /// slice comes from the allocator's grants (a key with no grant rejects until its
    /// first grant), and starts the sync client (reports every --report-interval-ms,
    /// reconnects with jittered backoff, follows each rule's posture once a lease ends).
    #[arg(long)]
    allocator: Option<String>,
    /// This agent's id (unique in the fleet): its name at the allocator (default
    /// `HOSTNAME-HTTPPORT`) and the `origin` of its ledger events (default: the id
    /// stored in the outbox, or `agent-PID-UNIXMS` for a new outbox).
    #[arg(long)]
    agent_id: Option<String>,
    /// Demand report period for the allocator, ms.
    #[arg(long, default_value_t = 250, requires = "allocator", value_parser = clap::value_parser!(u64).range(10..=60_000))]
    report_interval_ms: u64,
    /// Longest delay between reconnect attempts to the allocator, ms (jittered
    /// exponential backoff from 100 ms).
    #[arg(long, default_value_t = 5_000, requires = "allocator", value_parser = clap::value_parser!(u64).range(100..=600_000))]
    allocator_backoff_max_ms: u64,
    /// TLS to the allocator: the CA that signs its certificate (PEM). Without it the
    /// stream is plain HTTP/2.
    #[arg(long, requires = "allocator")]
    allocator_ca: Option<PathBuf>,
    /// The DNS name the allocator's certificate must carry. Default: the host part of
    /// --allocator.
    #[arg(long, requires = "allocator_ca")]
    allocator_tls_name: Option<String>,
    /// This agent's certificate (PEM), for an allocator that requires client
    /// certificates (--tls-client-ca there). With --allocator-key.
    #[arg(long, requires_all = ["allocator_ca", "allocator_key"])]
    allocator_cert: Option<PathBuf>,
    /// The private key of --allocator-cert (PEM).
    #[arg(long, requires = "allocator_cert")]
    allocator_key: Option<PathBuf>,
    /// OpenAI-compatible proxy listen address (with --proxy-upstream). Tenants come
    /// from `[[api_key]]` entries of the config (see `bursar-agent hash-key`).
    #[arg(long, requires = "proxy_upstream")]
    proxy_listen: Option<std::net::SocketAddr>,
    /// Upstream base URL for the proxy, plain HTTP, e.g. http://127.0.0.1:8000.
    #[arg(long, requires = "proxy_listen")]
    proxy_upstream: Option<String>,
    /// Time the proxy allows a client to send its request body (408 after; 1 ms to 1
    /// day).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    proxy_body_timeout_ms: u64,
    /// Time the proxy allows the upstream to answer with its response head (504 after,
    /// and the reservation comes back; 1 ms to 1 day). An upstream sends a
    /// non-streamed answer's head only once the whole answer is generated: raise this
    /// for models that take longer (reasoning models), or have clients stream.
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    proxy_upstream_timeout_ms: u64,
    /// Longest silence the proxy allows the upstream once it has answered, between two
    /// chunks of its body (a stream's tokens included); then the request is settled as
    /// broken off: 504, charged the output reserved, or for a stream an error at its
    /// end, charged what was generated (1 ms to 1 day). Raise it for models that pause
    /// for minutes within a stream (reasoning before the first token).
    #[arg(long, default_value_t = 120_000, value_parser = clap::value_parser!(u64).range(1..=86_400_000))]
    proxy_idle_timeout_ms: u64,
    /// Largest non-streamed upstream response the proxy reads (streams pass through
    /// unbounded). A larger one is answered 502 and charged its prompt estimate and
    /// the output reserved: the upstream did the work.
    #[arg(long, default_value_t = 32 << 20, value_parser = clap::value_parser!(u64).range(1024..=1 << 32))]
    proxy_max_response_bytes: u64,
    /// Directory of the durable usage outbox (`outbox.redb`, created if missing; one
    /// agent per directory). Every usage record is committed there before its
    /// completion is answered, and kept until min(2, number of --ledger) ledger nodes
    /// acknowledged it. Requires --ledger.
    #[arg(long, requires = "ledger")]
    outbox_dir: Option<PathBuf>,
    /// A ledger node's base URL (`http://HOST:PORT`, plain HTTP), repeatable. The
    /// outbox's events are delivered to every one. Requires --outbox-dir.
    #[arg(long, requires = "outbox_dir")]
    ledger: Vec<String>,
    /// Usage records waiting for the outbox's writer (memory reserved up front,
    /// 256 bytes each). New work gets 503 past three quarters of it; leases already in
    /// flight always have room for their records beyond it.
    #[arg(long, default_value_t = 16_384, value_parser = clap::value_parser!(u64).range(16..=4_194_304))]
    outbox_queue_max: u64,
    /// Undelivered events the outbox holds before completions get 503 (`outbox_full`).
    /// Size it for the longest ledger outage to ride out at the completion rate.
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(u64).range(16..))]
    outbox_events_max: u64,
    /// Usage events a ledger refused on their own (400/413 three times, sent alone)
    /// that the outbox sets aside and keeps for an operator (`GET
    /// /v1/outbox/quarantine`), so the events behind them are delivered. Past it a
    /// refused event stops that ledger's delivery until the quarantine is cleared
    /// (`DELETE /v1/outbox/quarantine?through_seq=N`). 0: never set aside.
    #[arg(long, default_value_t = 10_000)]
    outbox_quarantine_max: u64,
    /// Allow `DELETE /v1/outbox/quarantine?through_seq=N` on the HTTP port (off by
    /// default: anyone who reaches the port could erase the quarantined billing records).
    #[arg(long)]
    outbox_quarantine_clear: bool,
    /// Longest wait for a usage record's commit before the completion answers 503
    /// (`outbox_unavailable`; the record stays queued, a retry is safe), ms.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    outbox_durable_timeout_ms: u64,
    /// Descriptor whose value is the ledger's `tenant` (billing account).
    #[arg(long, default_value = "org")]
    ledger_tenant_descriptor: String,
    /// Descriptor whose value is the ledger's `model`.
    #[arg(long, default_value = "model")]
    ledger_model_descriptor: String,
    /// Most events in one POST to a ledger.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=50_000))]
    ledger_batch_max: u64,
    /// Longest delay between delivery attempts to a failing ledger, ms (jittered
    /// exponential backoff from 100 ms).
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    ledger_backoff_max_ms: u64,
}

#[derive(Subcommand)]
enum Command {
    /// Run the engine standalone against synthetic LLM traffic and print a live summary.
    Demo(DemoArgs),
    /// Validate a rules file and print what it defines. Exit code 1 on an invalid file
    /// (or, with `--reload-from`, one a running agent's reload would refuse).
    CheckConfig {
        /// The TOML rules file.
        file: PathBuf,
        /// The file in force: say whether an agent running it would take `file` on a
        /// reload (SIGHUP), and which rules would change.
        #[arg(long)]
        reload_from: Option<PathBuf>,
        /// With `--reload-from`: the agent runs with `--allocator` (its
        /// `slice_source` is `allocated` whatever the files say).
        #[arg(long, requires = "reload_from")]
        allocated: bool,
    },
    /// Print the SHA-256 of an API key read from stdin, for an `[[api_key]]` entry.
    HashKey,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum RlsHeadersArg {
    Always,
    OverLimit,
    Never,
}

#[derive(Parser)]
struct DemoArgs {
    /// Rules file (TOML). Default: the embedded demo rules (an org ceiling over per-key
    /// limits on input tokens, requests, output tokens, concurrency and a shadow rule).
    #[arg(long)]
    config: Option<PathBuf>,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    duration_s: u64,
    /// Offered load, requests per second across all tenants.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    rps: u64,
    /// Tenants (`org` values), Zipf-distributed (a few heavy, many light).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    tenants: u64,
    /// Load-generating threads.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    threads: u64,
    /// Seed of the synthetic load.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Demo(args)) => demo(args),
        Some(Command::CheckConfig {
            file,
            reload_from,
            allocated,
        }) => {
            check_config(&file)?;
            match reload_from {
                Some(old) => check_reload(&old, &file, allocated),
                None => Ok(()),
            }
        }
        Some(Command::HashKey) => {
            let mut key = String::new();
            std::io::stdin()
                .read_line(&mut key)
                .context("reading the key from stdin")?;
            let key = key.trim();
            if key.is_empty() {
                bail!("no key on stdin");
            }
            println!("{}", bursar_agent::shell::proxy::key_hash_hex(key));
            Ok(())
        }
        None => serve(cli.serve),
    }
}

fn serve(args: ServeArgs) -> Result<()> {
    // What the rules were read from (`--watch-config-ms` reloads when it changes).
    let seen =
        bursar_agent::shell::ConfigWatch::contents(args.config.as_deref(), args.watch_config_ms);
    let mut config = match &args.config {
        Some(p) => Config::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => {
            eprintln!("bursar-agent: no --config given, using the embedded demo rules");
            Config::from_toml(DEMO_RULES).context("embedded demo rules")?
        }
    };
    let proxy = match (args.proxy_listen, args.proxy_upstream) {
        (Some(listen), Some(upstream)) => {
            if !upstream.starts_with("http://") {
                bail!("--proxy-upstream {upstream:?}: only plain http:// upstreams are supported");
            }
            if config.api_keys.is_empty() {
                bail!(
                    "the proxy needs at least one [[api_key]] in the config (see `bursar-agent hash-key`)"
                );
            }
            Some((
                listen,
                upstream,
                config.api_keys.clone(),
                bursar_agent::shell::proxy::ProxyConfig {
                    body_timeout: std::time::Duration::from_millis(args.proxy_body_timeout_ms),
                    upstream_timeout: std::time::Duration::from_millis(
                        args.proxy_upstream_timeout_ms,
                    ),
                    max_response_bytes: args.proxy_max_response_bytes as usize,
                    upstream_idle_timeout: std::time::Duration::from_millis(
                        args.proxy_idle_timeout_ms,
                    ),
                    ..Default::default()
                },
            ))
        }
        _ => None,
    };
    if args.allocator.is_some() {
        config.engine.slice_source = bursar_agent::SliceSource::Allocated;
    }
    let outbox = match &args.outbox_dir {
        Some(dir) => {
            let mut seen = std::collections::HashSet::new();
            for url in &args.ledger {
                if !url.starts_with("http://") {
                    bail!("--ledger {url:?}: only plain http:// ledger URLs are supported");
                }
                // One URL given twice would count as two of the holders an event needs
                // while only one node can answer it: nothing would ever be trimmed.
                if !seen.insert(url.trim_end_matches('/').to_ascii_lowercase()) {
                    bail!(
                        "--ledger {url:?} is given twice: each --ledger must reach another ledger node"
                    );
                }
            }
            if args.ledger.len() == 1 {
                eprintln!(
                    "bursar-agent: one --ledger: events leave the outbox once that one node holds them \
                     (give two ledger nodes' URLs to keep each event until two hold it)"
                );
            }
            let mut cfg = OutboxConfig::new(dir.clone(), args.ledger.len().min(2));
            cfg.agent_id = args.agent_id.clone();
            cfg.queue_max = args.outbox_queue_max as usize;
            // Every lease in flight may still bring a record once new work is refused.
            cfg.in_flight_max = config.engine.max_leases;
            cfg.events_max = args.outbox_events_max;
            cfg.quarantine_max = args.outbox_quarantine_max;
            cfg.quarantine_clear_over_http = args.outbox_quarantine_clear;
            cfg.durable_timeout = Duration::from_millis(args.outbox_durable_timeout_ms);
            cfg.tenant_descriptor = args.ledger_tenant_descriptor.clone();
            cfg.model_descriptor = args.ledger_model_descriptor.clone();
            let ob = Outbox::open(cfg).map_err(|e| anyhow::anyhow!("{e}"))?;
            eprintln!(
                "bursar-agent: usage outbox {} (origin {:?}, {} events held, delivering to {} ledger(s), {} needed per event)",
                ob.path().display(),
                ob.origin(),
                ob.held(),
                args.ledger.len(),
                ob.ledgers_needed()
            );
            Some(Arc::new(ob))
        }
        None => None,
    };
    // The engine's clock, and the unix time at its origin (the outbox's event times).
    let clock = bursar_agent::clock::MonotonicClock::new();
    let wall_origin_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the system clock is before 1970")?
        .as_millis() as u64;
    let rules = config.rules.clone();
    let api_keys = config.api_keys.clone();
    let sink: Arc<dyn bursar_agent::UsageSink> = match &outbox {
        Some(ob) => {
            let sink: Arc<Outbox> = Arc::clone(ob);
            sink
        }
        // Without --outbox-dir usage records are not kept (no billing).
        None => Arc::new(bursar_agent::DiscardSink),
    };
    let engine = Arc::new(Engine::new(config, sink));
    if let Some(ob) = &outbox {
        ob.start(rules, wall_origin_ms);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let served = rt.block_on(async {
        let state = bursar_agent::shell::AgentState::with_clock(engine, clock);
        if let Some(ob) = &outbox {
            let _ = state.outbox.set(Arc::clone(ob));
        }
        let (tx, rx) = tokio::sync::watch::channel(false);
        let bound = bursar_agent::shell::start(
            Arc::clone(&state),
            bursar_agent::shell::Listen {
                http: Some(args.http),
                grpc: Some(args.grpc),
                rls_headers: match args.rls_headers {
                    RlsHeadersArg::Always => bursar_agent::shell::rls::RlsHeaders::Always,
                    RlsHeadersArg::OverLimit => bursar_agent::shell::rls::RlsHeaders::OverLimit,
                    RlsHeadersArg::Never => bursar_agent::shell::rls::RlsHeaders::Never,
                },
                proxy,
            },
            rx.clone(),
        )
        .await
        .context("binding the front doors")?;
        println!(
            "bursar-agent listening: http={} grpc={} proxy={}",
            bound.http.map_or("-".into(), |a| a.to_string()),
            bound.grpc.map_or("-".into(), |a| a.to_string()),
            bound.proxy.map_or("-".into(), |a| a.to_string())
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if let Some(allocator) = &args.allocator {
            let http_port = bound.http.map_or(0, |a| a.port());
            let agent_id = args.agent_id.clone().unwrap_or_else(|| {
                let host = std::env::var("HOSTNAME")
                    .ok()
                    .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
                    .unwrap_or_else(|| "agent".into());
                format!("{host}-{http_port}")
            });
            let mut cfg = bursar_agent::shell::sync::SyncConfig::new(allocator.clone(), agent_id);
            cfg.report_interval = Duration::from_millis(args.report_interval_ms);
            cfg.backoff_max = Duration::from_millis(args.allocator_backoff_max_ms);
            if let Some(ca) = &args.allocator_ca {
                let bare = allocator
                    .trim_start_matches("https://")
                    .trim_start_matches("http://");
                let host = bare.rsplit_once(':').map_or(bare, |(h, _)| h);
                let files = bursar_agent::shell::sync::ClientTlsFiles {
                    ca: ca.clone(),
                    server_name: args
                        .allocator_tls_name
                        .clone()
                        .unwrap_or_else(|| host.trim_matches(['[', ']']).to_string()),
                    identity: args.allocator_cert.clone().zip(args.allocator_key.clone()),
                };
                cfg.tls = Some(
                    bursar_agent::shell::sync::client_tls(&files)
                        .map_err(|e| anyhow::anyhow!("TLS to the allocator: {e}"))?,
                );
            }
            let (status, _task) =
                bursar_agent::shell::sync::spawn(Arc::clone(&state), cfg, rx.clone());
            let _ = state.sync.set(status);
        }
        if let Some(ob) = &outbox {
            let mut cfg = ForwardConfig::new(args.ledger.clone());
            cfg.batch_max = args.ledger_batch_max as usize;
            cfg.backoff_max = Duration::from_millis(args.ledger_backoff_max_ms);
            let ledgers = bursar_agent::shell::forward::spawn(Arc::clone(ob), cfg, rx.clone());
            let _ = state.ledgers.set(ledgers);
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("SIGTERM handler")?;
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("SIGHUP handler")?;
        let mut watch = bursar_agent::shell::ConfigWatch::new(
            args.config.as_deref(),
            args.watch_config_ms,
            seen,
        );
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
                _ = hup.recv() => {
                    watch.reread();
                    reload(&state, args.config.as_deref(), args.allocator.is_some(), &api_keys);
                }
                _ = watch.changed() => {
                    reload(&state, args.config.as_deref(), args.allocator.is_some(), &api_keys);
                }
            }
        }
        eprintln!("bursar-agent: shutting down");
        let _ = tx.send(true);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        // No completion can reach the leases still in flight once the process ends:
        // each is recorded as expired (its reservation charged) before the outbox's
        // last commit, or a restart lost their usage without a trace.
        let n = state.engine.expire_all_leases(state.clock.now_ns());
        if n > 0 {
            eprintln!(
                "bursar-agent: {n} leases in flight at shutdown recorded as expired \
                 (their declared input counted, no output)"
            );
        }
        anyhow::Ok(())
    });
    // Commit whatever the last completions queued before the process ends.
    if let Some(ob) = &outbox {
        ob.close();
    }
    served
}

/// SIGHUP (or a change `--watch-config-ms` saw): re-reads `--config` and applies the
/// rules' new numbers, or says why not.
fn reload(
    state: &bursar_agent::shell::AgentState,
    path: Option<&std::path::Path>,
    allocated: bool,
    api_keys: &[bursar_agent::ApiKey],
) {
    let Some(path) = path else {
        eprintln!(
            "bursar-agent: SIGHUP ignored: no --config given (the embedded demo rules cannot be re-read)"
        );
        return;
    };
    match bursar_agent::shell::reload_rules(state, path, allocated, api_keys) {
        Ok(s) if s.changed.is_empty() => eprintln!(
            "bursar-agent: rules file {} re-read: no change",
            path.display()
        ),
        Ok(s) => eprintln!(
            "bursar-agent: rules reloaded from {}: changed {} ({} keys moved to the new limits); version {}",
            path.display(),
            s.changed.join(", "),
            s.keys_updated,
            bursar_agent::shell::sync::config_version(&state.engine)
        ),
        Err(e) => eprintln!("bursar-agent: reload refused: {e}"),
    }
}

/// Whether an agent running `old` (with `--allocator` if `allocated`) would take `new`
/// on a reload: the same checks as its SIGHUP, on an engine built from `old`.
fn check_reload(old: &std::path::Path, new: &std::path::Path, allocated: bool) -> Result<()> {
    let mut in_force = Config::from_file(old).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut next = Config::from_file(new).map_err(|e| anyhow::anyhow!("{e}"))?;
    if allocated {
        in_force.engine.slice_source = bursar_agent::SliceSource::Allocated;
    }
    if let Err(why) = bursar_agent::shell::prepare_reload(&mut next, allocated, &in_force.api_keys)
    {
        bail!("reload from {} would be refused: {why}", old.display());
    }
    let engine = Engine::new(in_force, Arc::new(bursar_agent::DiscardSink));
    match engine.reload(0, next) {
        Ok(s) if s.changed.is_empty() => {
            println!("reload from {}: no change", old.display());
            Ok(())
        }
        Ok(s) => {
            println!(
                "reload from {}: would apply; changed {}",
                old.display(),
                s.changed.join(", ")
            );
            Ok(())
        }
        Err(e) => bail!("reload from {} would be refused: {e}", old.display()),
    }
}

fn check_config(file: &std::path::Path) -> Result<()> {
    let cfg = Config::from_file(file).map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{}: {} rules, valid", file.display(), cfg.rules.len());
    for r in cfg.rules.rules() {
        let limit = match r.limit {
            RuleLimit::Rate { rate, per, burst } => {
                format!("{rate}/{} burst {burst}", per.as_str())
            }
            RuleLimit::Concurrency { max_in_flight } => format!("{max_in_flight} in flight"),
        };
        let matches: Vec<String> = r
            .matches
            .iter()
            .map(|(k, p)| match p {
                bursar_agent::config::Pattern::Each => format!("{k}=*"),
                bursar_agent::config::Pattern::Exact(v) => format!("{k}={v}"),
            })
            .collect();
        println!(
            "  {:<24} {:<14} {:<28} match {{{}}}{}",
            r.name,
            r.dimension.as_str(),
            limit,
            matches.join(","),
            if r.mode == bursar_agent::Mode::Shadow {
                "  (shadow)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// splitmix64: a small seeded generator for the synthetic load (no dependency).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Default)]
struct Counters {
    decisions: AtomicU64,
    admitted: AtomicU64,
    rejected: AtomicU64,
    errors: AtomicU64,
}

fn demo(args: DemoArgs) -> Result<()> {
    let config = match &args.config {
        Some(p) => Config::from_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
        None => Config::from_toml(DEMO_RULES).context("embedded demo rules")?,
    };
    let wildcard_keys: Vec<&str> = config
        .rules
        .rules()
        .iter()
        .flat_map(|r| r.matches.iter().map(|(k, _)| k.as_str()))
        .collect();
    if !wildcard_keys.contains(&"org") {
        bail!(
            "the demo's synthetic load sends descriptors org and key: the rules match none of them"
        );
    }
    let sink = Arc::new(MemorySink::new(0)); // count-only: records are dropped at the bound
    let engine = Arc::new(Engine::new(config, sink.clone()));
    let (clock, _driver) = CoarseClock::start(Duration::from_micros(100));
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());

    // Zipf(1.1) over tenants: cumulative weights for inverse sampling.
    let weights: Vec<f64> = (1..=args.tenants)
        .map(|i| 1.0 / (i as f64).powf(1.1))
        .collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    let cdf: Arc<Vec<f64>> = Arc::new(
        weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect(),
    );
    let orgs: Arc<Vec<String>> =
        Arc::new((0..args.tenants).map(|i| format!("org-{i:03}")).collect());
    let keys = ["k0", "k1", "k2", "k3"];

    println!(
        "bursar-agent demo: standalone engine, {} rules, {} tenants (Zipf 1.1), {} req/s offered \
         on {} threads for {} s",
        engine.rules().len(),
        args.tenants,
        args.rps,
        args.threads,
        args.duration_s
    );
    println!("Each key's slice is the rule's whole limit (no allocator yet).\n");

    let per_thread_rps = (args.rps / args.threads).max(1);
    let mut workers = Vec::new();
    for t in 0..args.threads {
        let (engine, clock, stop, counters, cdf, orgs) = (
            Arc::clone(&engine),
            clock.clone(),
            Arc::clone(&stop),
            Arc::clone(&counters),
            Arc::clone(&cdf),
            Arc::clone(&orgs),
        );
        let seed = args.seed.wrapping_mul(1_000_003).wrapping_add(t);
        workers.push(std::thread::spawn(move || {
            let mut rng = Rng(seed);
            let mut w = engine.worker();
            // Requests in flight: (request id, reserved output, finishes at ns).
            let mut in_flight: std::collections::VecDeque<(String, u64, u64)> =
                std::collections::VecDeque::with_capacity(256);
            let interval_ns = 1_000_000_000 / per_thread_rps;
            let mut next_at = clock.now_ns();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let now = clock.now_ns();
                // Finish what is due (actual output below the reservation).
                while let Some((_, _, at)) = in_flight.front() {
                    if *at > now && in_flight.len() < 200 {
                        break;
                    }
                    let (id, reserved, _) = in_flight.pop_front().expect("front exists");
                    let out = (reserved as f64 * rng.unit()) as u64;
                    let usage = Usage {
                        input_tokens: 0,
                        cached_input_tokens: 0,
                        output_tokens: out,
                    };
                    let _ = w.complete(now, &id, usage, CompletionStatus::Ok);
                }
                if now < next_at {
                    std::thread::sleep(Duration::from_nanos((next_at - now).min(2_000_000)));
                    continue;
                }
                next_at += interval_ns;
                n += 1;
                let u = rng.unit();
                let org = cdf.partition_point(|&c| c < u).min(orgs.len() - 1);
                let key = keys[(rng.next() % keys.len() as u64) as usize];
                // LLM-like: input tokens heavy-tailed, max_tokens often set.
                let input = 50 + (rng.unit().powi(3) * 6_000.0) as u64;
                let max_out = if rng.next().is_multiple_of(4) {
                    None
                } else {
                    Some(256 + rng.next() % 1_024)
                };
                let id = format!("t{t}-{n}");
                let desc = [("org", orgs[org].as_str()), ("key", key)];
                let r = w.admit(
                    now,
                    &AdmitRequest {
                        request_id: &id,
                        domain: None,
                        descriptors: &desc,
                        cost: Cost {
                            requests: 1,
                            input_tokens: input,
                            max_output_tokens: max_out,
                        },
                        ttl_ms: None,
                    },
                );
                counters.decisions.fetch_add(1, Ordering::Relaxed);
                match r {
                    Ok(Decision::Admitted(_)) => {
                        counters.admitted.fetch_add(1, Ordering::Relaxed);
                        let reserved = max_out.unwrap_or(512);
                        let dur = 20_000_000 + rng.next() % 400_000_000;
                        in_flight.push_back((id, reserved, now + dur));
                    }
                    Ok(Decision::Rejected(_)) => {
                        counters.rejected.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            for (id, _, _) in in_flight {
                let _ = w.complete(
                    clock.now_ns(),
                    &id,
                    Usage::default(),
                    CompletionStatus::ClientGone,
                );
            }
        }));
    }

    let start = Instant::now();
    let mut last = engine.stats();
    let mut last_counts = (0u64, 0u64, 0u64);
    let mut next_print = Duration::from_secs(1);
    while start.elapsed() < Duration::from_secs(args.duration_s) {
        std::thread::sleep(Duration::from_millis(100));
        engine.maintain(clock.now_ns());
        if start.elapsed() >= next_print {
            next_print += Duration::from_secs(1);
            let stats = engine.stats();
            let d = counters.decisions.load(Ordering::Relaxed);
            let a = counters.admitted.load(Ordering::Relaxed);
            let r = counters.rejected.load(Ordering::Relaxed);
            println!(
                "t={:>3}s  decisions {:>6}/s  admitted {:>6}/s  rejected {:>6}/s  leases {:>5}  keys {:>5}",
                start.elapsed().as_secs(),
                d - last_counts.0,
                a - last_counts.1,
                r - last_counts.2,
                engine.leases_in_flight(),
                engine.key_count()
            );
            println!(
                "        {:<24} {:<14} {:>14} {:>14} {:>6}",
                "limit", "dimension", "admitted/s", "rejected/s", "keys"
            );
            let rules = engine.rules();
            for (s, l) in stats.iter().zip(last.iter()) {
                let rule = rules.by_name(&s.rule).expect("own rule").1;
                println!(
                    "        {:<24} {:<14} {:>14} {:>14} {:>6}{}",
                    s.rule,
                    rule.dimension.as_str(),
                    s.admitted.saturating_sub(l.admitted),
                    s.rejected.saturating_sub(l.rejected),
                    s.keys,
                    if s.shadow {
                        "  (shadow: rejected = would reject)"
                    } else {
                        ""
                    }
                );
            }
            last = stats;
            last_counts = (d, a, r);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join()
            .map_err(|_| anyhow::anyhow!("a load thread panicked"))?;
    }
    let now = clock.now_ns();
    engine.maintain(now);
    let d = counters.decisions.load(Ordering::Relaxed);
    let a = counters.admitted.load(Ordering::Relaxed);
    println!(
        "\ndone: {d} decisions, {a} admitted ({:.1} %), {} rejected, {} errors; leases left {}",
        100.0 * a as f64 / d.max(1) as f64,
        counters.rejected.load(Ordering::Relaxed),
        counters.errors.load(Ordering::Relaxed),
        engine.leases_in_flight()
    );
    match engine.check_invariants(now) {
        Ok(()) => println!("engine invariants: ok (every slot and held reservation accounted for)"),
        Err(e) => bail!("engine invariant violated: {e}"),
    }
    let (_, records) = sink.take();
    println!(
        "usage records produced: {records} (the demo keeps none; `bursar-agent --outbox-dir DIR --ledger URL` delivers them to ledgers)"
    );
    Ok(())
}
