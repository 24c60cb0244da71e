//! `bursar-ledger`: one ledger node. Durable, exact usage records over HTTP JSON;
//! with `--gossip`, a member of a cluster (QUIC with mutual TLS, SWIM membership,
//! push and digest-driven pull). `bursar-ledger certs` makes a development CA and node
//! certificates.

use std::path::PathBuf;

use anyhow::Context as _;
use std::time::Duration;

use bursar_ledger::RedbStore;
use bursar_ledger::cluster::{ClusterConfig, TlsFiles, tls};
use bursar_ledger::server::{ServerConfig, serve, serve_cluster};
use clap::{Parser, Subcommand};

/// mimalloc, not glibc's malloc: 15-27 % less CPU per ingested event, for ~30 % more
/// peak memory (docs/BENCHMARKS.md, "A faster allocator for the node").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// One Bursar ledger node: durable, exact usage records for billing.
///
/// HTTP JSON API: POST /v1/events, GET /v1/usage, GET /v1/digest, GET /v1/export,
/// GET /v1/conflicts, GET /v1/cluster, GET /healthz, GET /metrics (docs/ledger.md).
///
/// Without --gossip the node runs standalone. With --gossip it joins a cluster: QUIC
/// with mutual TLS (every node's certificate signed by the cluster CA; make a
/// development set with `bursar-ledger certs`), SWIM membership, push of new events
/// and anti-entropy pull. Every node holds every event.
///
/// Example, three nodes on one machine:
///   bursar-ledger certs --out certs --node a --node b --node c
///   bursar-ledger --data-dir d/a --node-id a --http 127.0.0.1:7480 \
///       --gossip 127.0.0.1:7490 --tls-dir certs --peer 127.0.0.1:7491
///   (and b, c likewise, each with the others as --peer)
#[derive(Parser, Debug)]
#[command(name = "bursar-ledger", version, subcommand_negates_reqs = true)]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Directory of the data file (ledger.redb); created if missing.
    #[arg(long, required = true)]
    data_dir: Option<PathBuf>,
    /// This node's id (appears in /healthz and /metrics; names its certificate files
    /// in --tls-dir).
    #[arg(long, required = true)]
    node_id: Option<String>,
    /// HTTP listen address; port 0 picks a free port (the chosen address is printed
    /// on stdout as `listening on http://ADDR`).
    #[arg(long, default_value = "127.0.0.1:7480")]
    http: String,
    /// Cluster listen address (UDP, QUIC). Without it the node runs standalone.
    /// Port 0 picks a free port (printed as `gossip on ADDR`).
    #[arg(long)]
    gossip: Option<std::net::SocketAddr>,
    /// The address peers reach this node's --gossip at (its identity in membership).
    /// Required when --gossip listens on every interface (0.0.0.0 or [::]); in
    /// Kubernetes, the pod IP (`$(POD_IP):7490`).
    #[arg(long, requires = "gossip")]
    gossip_advertise: Option<std::net::SocketAddr>,
    /// A seed peer's --gossip address, HOST:PORT or IP:PORT (repeatable; names are
    /// resolved again every 2 s). Membership finds the rest.
    #[arg(long, requires = "gossip")]
    peer: Vec<String>,
    /// Directory with ca.pem, <node-id>.pem and <node-id>.key (as `bursar-ledger certs`
    /// writes them). Required with --gossip unless --ca, --cert and --key are given.
    #[arg(long, requires = "gossip")]
    tls_dir: Option<PathBuf>,
    /// Cluster CA certificate (PEM); overrides --tls-dir's.
    #[arg(long, requires = "gossip")]
    ca: Option<PathBuf>,
    /// This node's certificate (PEM, signed by the cluster CA); overrides --tls-dir's.
    #[arg(long, requires = "gossip")]
    cert: Option<PathBuf>,
    /// This node's private key (PEM); overrides --tls-dir's.
    #[arg(long, requires = "gossip")]
    key: Option<PathBuf>,
    /// Peers each new local batch is pushed to.
    #[arg(long, default_value_t = 2)]
    push_fanout: usize,
    /// Milliseconds between anti-entropy rounds.
    #[arg(long, default_value_t = 1000)]
    sync_interval_ms: u64,
    /// Accept POST /v1/cluster/isolate?on=true|false, which cuts this node off from
    /// its peers (for partition tests). Never in production.
    #[arg(long)]
    fault_injection: bool,
    /// Most events per durable write transaction (group commit).
    #[arg(long, default_value_t = ServerConfig::default().commit_events_max)]
    commit_events_max: usize,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = ServerConfig::default().body_max_bytes)]
    body_max_bytes: usize,
    /// Most POST /v1/events bodies read at once; one more is answered 503 (with
    /// Retry-After) before its body is read, so bodies in memory stay bounded.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    ingest_max: u64,
    /// Milliseconds a client has to send a POST /v1/events body (408 after).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    body_timeout_ms: u64,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Make a development cluster CA (ca.pem, ca.key; reused when present) and a
    /// certificate and key per node (<node>.pem, <node>.key) in --out. For production,
    /// issue node certificates from your own CA with the DNS name
    /// "bursar-ledger.cluster".
    Certs {
        /// Output directory (created if missing).
        #[arg(long)]
        out: PathBuf,
        /// A node id (repeatable).
        #[arg(long = "node", required = true)]
        nodes: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(Cmd::Certs { out, nodes }) = &args.cmd {
        let made = tls::make_certs(out, nodes)?;
        if !made.ca_created {
            println!("using the existing CA in {}", out.display());
        }
        for p in made.written {
            println!("wrote {}", p.display());
        }
        return Ok(());
    }
    let node_id = args.node_id.clone().expect("required by clap");
    let data_dir = args.data_dir.clone().expect("required by clap");
    let cluster = match args.gossip {
        None => None,
        Some(listen) => {
            let base = args.tls_dir.as_ref().map(|d| TlsFiles::in_dir(d, &node_id));
            let pick = |flag: &Option<PathBuf>, from_dir: Option<PathBuf>, name: &str| {
                flag.clone().or(from_dir).with_context(|| {
                    format!("--gossip needs TLS files: give --tls-dir or --{name}")
                })
            };
            let tls = TlsFiles {
                ca: pick(&args.ca, base.as_ref().map(|b| b.ca.clone()), "ca")?,
                cert: pick(&args.cert, base.as_ref().map(|b| b.cert.clone()), "cert")?,
                key: pick(&args.key, base.as_ref().map(|b| b.key.clone()), "key")?,
            };
            let mut c = ClusterConfig::new(&node_id, listen, tls);
            c.seeds = args.peer.clone();
            c.advertise = args.gossip_advertise;
            c.push_fanout = args.push_fanout;
            c.sync_interval = Duration::from_millis(args.sync_interval_ms);
            c.fault_injection = args.fault_injection;
            c.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
            Some(c)
        }
    };
    let cfg = ServerConfig {
        node_id: node_id.clone(),
        commit_events_max: args.commit_events_max,
        body_max_bytes: args.body_max_bytes,
        ingest_max: args.ingest_max as usize,
        body_timeout: std::time::Duration::from_millis(args.body_timeout_ms),
        ..ServerConfig::default()
    };
    cfg.validate()?;
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating data dir {}", data_dir.display()))?;
    let mut cluster = cluster;
    if let Some(c) = cluster.as_mut() {
        // One more than the last run's (or the wall clock, if higher): a restart wins
        // the address conflict against its old identity even if the clock stepped back.
        c.generation = Some(
            bursar_ledger::counter::next(&data_dir.join("membership-generation"))
                .context("the membership generation file")?,
        );
    }
    let store = RedbStore::open_dir(&data_dir)
        .context("refusing to start: the ledger data file could not be opened")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&args.http)
            .await
            .with_context(|| format!("binding --http {}", args.http))?;
        let addr = listener.local_addr()?;
        println!("listening on http://{addr}");
        eprintln!(
            "bursar-ledger: node {} serving {} from {}",
            node_id,
            addr,
            data_dir.display()
        );
        match cluster {
            None => serve(listener, store, cfg, shutdown_signal()).await?,
            Some(c) => {
                let on_ready = |gossip| {
                    println!("gossip on {gossip}");
                    eprintln!("bursar-ledger: cluster member on {gossip} (QUIC, mutual TLS)");
                };
                serve_cluster(listener, store, cfg, c, on_ready, shutdown_signal()).await?
            }
        }
        eprintln!("bursar-ledger: stopped cleanly");
        Ok(())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
