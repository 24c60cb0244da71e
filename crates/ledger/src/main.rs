//! `bursar-ledger`: one ledger node. Durable, exact usage records over HTTP JSON.
//!
//! Clustering is **not built yet**: `--gossip` and `--peer` are accepted (so
//! deployment files can name them) and ignored with a warning; each node is a
//! standalone ledger.

use std::path::PathBuf;

use anyhow::Context as _;
use bursar_ledger::RedbStore;
use bursar_ledger::server::{ServerConfig, serve};
use clap::Parser;

/// One Bursar ledger node: durable, exact usage records for billing.
///
/// HTTP JSON API: POST /v1/events, GET /v1/usage, GET /v1/digest, GET /v1/export,
/// GET /v1/conflicts, GET /healthz, GET /metrics (see docs/ledger.md).
///
/// CLUSTERING IS NOT BUILT YET: --gossip and --peer are accepted and ignored; every
/// node is a standalone single-node ledger and nothing is replicated.
#[derive(Parser, Debug)]
#[command(name = "bursar-ledger", version)]
struct Args {
    /// Directory of the data file (ledger.redb); created if missing.
    #[arg(long)]
    data_dir: PathBuf,
    /// This node's id (appears in /healthz and /metrics).
    #[arg(long)]
    node_id: String,
    /// HTTP listen address; port 0 picks a free port (the chosen address is printed
    /// on stdout as `listening on http://ADDR`).
    #[arg(long, default_value = "127.0.0.1:7480")]
    http: String,
    /// NOT BUILT YET: gossip (cluster) listen address. Accepted and ignored.
    #[arg(long)]
    gossip: Option<String>,
    /// NOT BUILT YET: a peer's gossip address (repeatable). Accepted and ignored.
    #[arg(long)]
    peer: Vec<String>,
    /// Most events per durable write transaction (group commit).
    #[arg(long, default_value_t = ServerConfig::default().commit_events_max)]
    commit_events_max: usize,
    /// Largest request body, bytes.
    #[arg(long, default_value_t = ServerConfig::default().body_max_bytes)]
    body_max_bytes: usize,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.gossip.is_some() || !args.peer.is_empty() {
        eprintln!(
            "bursar-ledger: warning: clustering is not built yet; --gossip and --peer are \
             ignored and this node runs standalone"
        );
    }
    let cfg = ServerConfig {
        node_id: args.node_id.clone(),
        commit_events_max: args.commit_events_max,
        body_max_bytes: args.body_max_bytes,
        ..ServerConfig::default()
    };
    cfg.validate()?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating data dir {}", args.data_dir.display()))?;
    let store = RedbStore::open_dir(&args.data_dir)
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
            args.node_id,
            addr,
            args.data_dir.display()
        );
        serve(listener, store, cfg, shutdown_signal()).await?;
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
