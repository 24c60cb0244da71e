//! The allocator's shell (feature `shell`, default): the tokio tasks around the
//! sans-IO [`crate::Allocator`].
//!
//! - **One task owns the core** ([`driver`]): it drains a bounded channel of inputs
//!   (hellos, reports, acks, disconnects, admin snapshots), sleeps until the core's
//!   `poll_timeout()`, and routes the grants it drains to per-agent bounded channels.
//!   Nothing else touches the core: no `Arc<Mutex<Allocator>>`.
//! - **The agents' streams** ([`grpc`]): one tonic bidirectional stream per agent
//!   (`bursar.allocator.v1.Allocator/Sync`), hello first (protocol version checked),
//!   then reports and acks in, welcome and grants out.
//! - **The admin endpoint** ([`admin`]): read-only JSON, `GET /v1/keys` (per key:
//!   limit, demand, committed, per-agent grants, the overshoot bound), `GET /v1/status`
//!   and `GET /healthz`.
//!
//! # Bounds and what happens at them
//!
//! - Inputs: `input_queue_max` (default 4,096). Full: stream readers wait (TCP
//!   back-pressure on the agent); admin requests wait.
//! - Per-agent outbound: `agent_queue_max` messages (default 64). Full: the grant batch
//!   is dropped and counted (`grants_dropped`). That is safe: a sent grant counts as
//!   committed until acknowledged or expired (invariant 1), and the core re-sends
//!   renewals when they are due.
//! - Message size: [`bursar_proto::allocator::MAX_MESSAGE_BYTES`] on the tonic server;
//!   keys per message: the core's `max_keys_per_message`.
//! - Admin: at most `admin_max_keys` keys per response (`truncated` says so).
//!
//! # Not built
//!
//! HA election through etcd ([`election`], `--etcd`): replicas campaign, the winner's
//! term is its leader key's revision, the others redirect agents to it, and a leader
//! that cannot renew its lease for a TTL steps down. Without etcd, one allocator runs
//! with a fixed term (`--term`, or a counter persisted in `--term-file` and raised at
//! every start). It never sends a
//! redirect, though agents follow one.

pub mod admin;
pub mod driver;
pub mod election;
pub mod grpc;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bursar_agent::Config;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

use crate::{Allocator, AllocatorConfig, ConfigError};

/// The shell's settings (the core's are in [`ShellConfig::allocator`]).
#[derive(Clone, Debug)]
pub struct ShellConfig {
    /// Address of the agents' gRPC stream (port 0 picks a free port).
    pub grpc: SocketAddr,
    /// Address of the JSON admin endpoint; `None` disables it.
    pub admin: Option<SocketAddr>,
    /// The allocator's term (grants' epoch). Must be higher than any term an agent may
    /// still hold grants from: a restarted allocator needs a higher one.
    pub term: u64,
    /// The core's settings.
    pub allocator: AllocatorConfig,
    /// Inputs waiting for the core task. Default 4,096.
    pub input_queue_max: usize,
    /// Messages waiting per agent stream. Default 64.
    pub agent_queue_max: usize,
    /// Time an agent has to send its hello after opening a stream. Default 5 s.
    pub hello_timeout: Duration,
    /// Keys listed per admin response at most. Default 1,000.
    pub admin_max_keys: usize,
}

impl ShellConfig {
    /// Defaults on the given addresses and term.
    pub fn new(grpc: SocketAddr, admin: Option<SocketAddr>, term: u64) -> ShellConfig {
        ShellConfig {
            grpc,
            admin,
            term,
            allocator: AllocatorConfig::default(),
            input_queue_max: 4_096,
            agent_queue_max: 64,
            hello_timeout: Duration::from_secs(5),
            admin_max_keys: 1_000,
        }
    }
}

/// Starting the shell failed. Nothing is left running.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    /// A setting is out of range (operator).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A bound on the shell's own queues is zero (operator).
    #[error("shell setting `{0}` must be at least 1")]
    Bound(&'static str),
    /// An address could not be bound (operator: in use, or not local).
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
}

/// Addresses the shell is listening on.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    /// The agents' gRPC stream.
    pub grpc: SocketAddr,
    /// The admin endpoint.
    pub admin: Option<SocketAddr>,
}

/// The shell's monotonic clock: nanoseconds since the shell started (never 0).
#[derive(Clone, Copy, Debug)]
pub struct ShellClock {
    start: Instant,
}

impl ShellClock {
    /// A clock starting now.
    pub fn new() -> ShellClock {
        ShellClock {
            start: Instant::now(),
        }
    }

    /// Nanoseconds since start, plus one.
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64 + 1
    }

    /// The instant of a core deadline (clamped to an hour ahead).
    pub fn instant_of(&self, ns: u64) -> tokio::time::Instant {
        let now = self.now_ns();
        let ahead = ns.saturating_sub(now).min(3_600_000_000_000);
        tokio::time::Instant::now() + Duration::from_nanos(ahead)
    }
}

impl Default for ShellClock {
    fn default() -> Self {
        ShellClock::new()
    }
}

/// The rules version agents and allocator compare (see
/// [`bursar_proto::allocator::config_version`]).
pub fn config_version(rules: &Config) -> String {
    bursar_proto::allocator::config_version(&format!("{:?}", rules.rules))
}

/// A way into the running core task (for in-process callers such as
/// `bursar-allocator local`): snapshots over the same bounded channel the admin
/// endpoint uses.
#[derive(Clone, Debug)]
pub struct Handle {
    inputs: mpsc::Sender<driver::Input>,
}

impl Handle {
    /// The core's state now (`None` once the core task stopped).
    pub async fn snapshot(&self) -> Option<driver::Snapshot> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.inputs
            .send(driver::Input::Snapshot { reply })
            .await
            .ok()?;
        answer.await.ok()
    }
}

/// Binds both listeners, starts the core task, the gRPC server and the admin endpoint,
/// and returns the bound addresses. Everything stops when `shutdown` turns true.
pub async fn start(
    rules: &Config,
    cfg: ShellConfig,
    shutdown: watch::Receiver<bool>,
) -> Result<Bound, ShellError> {
    start_with_handle(rules, cfg, shutdown)
        .await
        .map(|(b, _)| b)
}

/// [`start`], also returning a [`Handle`] on the core task.
pub async fn start_with_handle(
    rules: &Config,
    cfg: ShellConfig,
    shutdown: watch::Receiver<bool>,
) -> Result<(Bound, Handle), ShellError> {
    for (name, v) in [
        ("input_queue_max", cfg.input_queue_max),
        ("agent_queue_max", cfg.agent_queue_max),
        ("admin_max_keys", cfg.admin_max_keys),
    ] {
        if v == 0 {
            return Err(ShellError::Bound(name));
        }
    }
    let clock = ShellClock::new();
    let core = Allocator::new(rules, cfg.allocator.clone(), cfg.term, clock.now_ns())?;
    let grpc_l = TcpListener::bind(cfg.grpc)
        .await
        .map_err(|source| ShellError::Bind {
            addr: cfg.grpc,
            source,
        })?;
    let grpc_addr = grpc_l.local_addr().map_err(|source| ShellError::Bind {
        addr: cfg.grpc,
        source,
    })?;
    let admin_l = match cfg.admin {
        Some(addr) => {
            let l = TcpListener::bind(addr)
                .await
                .map_err(|source| ShellError::Bind { addr, source })?;
            let a = l
                .local_addr()
                .map_err(|source| ShellError::Bind { addr, source })?;
            Some((l, a))
        }
        None => None,
    };
    let (tx, rx) = mpsc::channel(cfg.input_queue_max);
    let handle = Handle { inputs: tx.clone() };
    let driver = driver::Driver::new(core, clock, config_version(rules), cfg.admin_max_keys);
    tokio::spawn(driver.run(rx, shutdown.clone()));
    let svc = grpc::Service::new(tx.clone(), cfg.hello_timeout, cfg.agent_queue_max);
    let mut sd = shutdown.clone();
    // TCP_NODELAY: a small grant must not wait on Nagle's algorithm and the agent's
    // delayed ACK (~40 ms).
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(grpc_l),
        |conn| {
            conn.inspect(|s| {
                let _ = s.set_nodelay(true);
            })
        },
    );
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(2)))
            .http2_keepalive_timeout(Some(Duration::from_secs(5)))
            .add_service(svc.into_server())
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = sd.wait_for(|s| *s).await;
            })
            .await;
    });
    let admin = match admin_l {
        Some((l, a)) => {
            let app = admin::router(Arc::new(admin::Admin::new(tx)));
            let mut sd = shutdown;
            tokio::spawn(async move {
                let _ = axum::serve(l, app)
                    .with_graceful_shutdown(async move {
                        let _ = sd.wait_for(|s| *s).await;
                    })
                    .await;
            });
            Some(a)
        }
        None => None,
    };
    Ok((
        Bound {
            grpc: grpc_addr,
            admin,
        },
        handle,
    ))
}
