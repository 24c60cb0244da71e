//! The agent's shell: the front doors over the engine (HTTP JSON API, Envoy RLS v3 over
//! gRPC, a `tower::Layer`), the maintenance ticker, and the clock. Feature `shell`
//! (default); the engine compiles without it (`--no-default-features`).
//!
//! One engine serves every front door. The engine is shared (`Arc`), lock-free for
//! known keys, and every operation takes `now` from one coarse monotonic clock owned
//! here.

pub mod forward;
pub mod headers;
pub mod http;
pub mod layer;
pub mod outbox;
pub mod proxy;
pub mod rls;
pub mod sync;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::Engine;
use crate::clock::{Clock, MonotonicClock};

/// Decision counters shared by the front doors (for `/metrics`).
#[derive(Debug, Default)]
pub struct Counters {
    /// Admitted decisions.
    pub admitted: AtomicU64,
    /// Rejected decisions.
    pub rejected: AtomicU64,
    /// Requests that could not be decided (bad input, overload).
    pub errors: AtomicU64,
    /// Rules reloads refused ([`reload_rules`]; those applied are the engine's
    /// [`Engine::reloads`]).
    pub reloads_refused: AtomicU64,
}

/// What every front door shares.
pub struct AgentState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// The clock every engine call reads. The front doors read `Instant` directly
    /// (a vDSO call, ~25 ns, nothing beside a network round trip): a coarse clock's
    /// ticking thread cost 7 % of the agent's CPU under RLS load (10,000 wake-ups a
    /// second on a 2-core machine, measured with perf during bench/run.sh).
    pub clock: MonotonicClock,
    /// Decision counters.
    pub counters: Counters,
    /// The allocator sync client's status, once one runs (for `/metrics`).
    pub sync: std::sync::OnceLock<Arc<sync::SyncStatus>>,
    /// The durable usage outbox, when the engine's sink is one: completions wait for
    /// their record's commit before they are answered.
    pub outbox: std::sync::OnceLock<Arc<outbox::Outbox>>,
    /// The forwarder's per-ledger status, once it runs (for `/metrics`).
    pub ledgers: std::sync::OnceLock<Vec<Arc<forward::LedgerStatus>>>,
}

impl AgentState {
    /// State over `engine`.
    pub fn new(engine: Arc<Engine>) -> Arc<AgentState> {
        AgentState::with_clock(engine, MonotonicClock::new())
    }

    /// State over `engine` reading `clock` (whose origin the outbox maps to wall time).
    pub fn with_clock(engine: Arc<Engine>, clock: MonotonicClock) -> Arc<AgentState> {
        Arc::new(AgentState {
            engine,
            clock,
            counters: Counters::default(),
            sync: std::sync::OnceLock::new(),
            outbox: std::sync::OnceLock::new(),
            ledgers: std::sync::OnceLock::new(),
        })
    }
}

/// Watches a rules file for changed contents (`--watch-config-ms`): for files that
/// change under a process, such as a mounted Kubernetes ConfigMap, which nobody would
/// signal process by process. Used by `bursar-agent` and `bursar-allocator`.
pub struct ConfigWatch {
    path: Option<std::path::PathBuf>,
    every: Option<tokio::time::Interval>,
    seen: Option<Vec<u8>>,
}

impl ConfigWatch {
    /// What to pass [`ConfigWatch::new`] as `seen`: the file's contents, read before
    /// the process parses it (so that a change in between is not missed), when it will
    /// be watched; nothing otherwise.
    pub fn contents(path: Option<&std::path::Path>, every_ms: u64) -> Option<Vec<u8>> {
        path.filter(|_| every_ms > 0)
            .and_then(|p| std::fs::read(p).ok())
    }

    /// Watches `path` every `every_ms` (0, or no path: never reports a change), its
    /// contents as read before parsing being `seen` ([`ConfigWatch::contents`]).
    pub fn new(path: Option<&std::path::Path>, every_ms: u64, seen: Option<Vec<u8>>) -> Self {
        let every = (every_ms > 0 && path.is_some()).then(|| {
            let mut i = tokio::time::interval(Duration::from_millis(every_ms));
            i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            i
        });
        ConfigWatch {
            path: path.map(|p| p.to_path_buf()),
            every,
            seen,
        }
    }

    /// Resolves once the file's contents differ from the last seen (each change once,
    /// whether the reload it triggers is applied or refused). A file that cannot be
    /// read for a moment (a ConfigMap's links being swapped) is looked at again at the
    /// next tick. Cancel-safe: use it in `select!`.
    pub async fn changed(&mut self) {
        let (Some(every), Some(path)) = (self.every.as_mut(), self.path.as_deref()) else {
            return std::future::pending().await;
        };
        loop {
            every.tick().await;
            if let Ok(now) = std::fs::read(path)
                && self.seen.as_deref() != Some(now.as_slice())
            {
                self.seen = Some(now);
                return;
            }
        }
    }

    /// The file was re-read for another reason (SIGHUP): its contents now are the
    /// ones seen.
    pub fn reread(&mut self) {
        if let (Some(_), Some(path)) = (&self.every, &self.path) {
            self.seen = std::fs::read(path).ok();
        }
    }
}

/// Re-reads the rules file at `path` and applies its new numbers to the engine
/// ([`Engine::reload`]: what a reload may change, and what it does to keys and
/// reservations). `allocated`: the agent runs with an allocator (the file's
/// `slice_source` is set as at start). `api_keys`: the proxy's keys in force, which
/// are read only at start: a file whose `[[api_key]]` entries differ is refused. On a
/// refusal nothing changed; the error names the file and what is wrong, and counts
/// in `/metrics` (`bursar_rules_reloads_total{result="refused"}`).
pub fn reload_rules(
    state: &AgentState,
    path: &std::path::Path,
    allocated: bool,
    api_keys: &[crate::ApiKey],
) -> Result<crate::ReloadSummary, String> {
    let refused = |why: String| {
        state
            .counters
            .reloads_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Err(format!(
            "rules file {}: {why}; the rules in force (version {}) are unchanged",
            path.display(),
            sync::config_version(&state.engine)
        ))
    };
    let mut config = match crate::Config::from_file(path) {
        Ok(c) => c,
        Err(e) => return refused(e.to_string()),
    };
    if let Err(why) = prepare_reload(&mut config, allocated, api_keys) {
        return refused(why);
    }
    match state.engine.reload(state.clock.now_ns(), config) {
        Ok(s) => Ok(s),
        Err(e) => refused(e.to_string()),
    }
}

/// What the agent checks and sets on a new rules file before the engine's reload: the
/// `slice_source` the agent runs with (`allocated`: it has `--allocator`), and the
/// proxy's keys, read only at start. Shared by [`reload_rules`] and the dry run
/// (`bursar-agent check-config --reload-from`).
pub fn prepare_reload(
    config: &mut crate::Config,
    allocated: bool,
    api_keys: &[crate::ApiKey],
) -> Result<(), String> {
    if allocated {
        config.engine.slice_source = crate::SliceSource::Allocated;
    }
    if config.api_keys != api_keys {
        return Err(
            "its [[api_key]] entries differ from those in force; the proxy reads them only at start (restart the agent)".into(),
        );
    }
    Ok(())
}

/// Where the front doors listen. `None` disables one.
#[derive(Debug, Clone, Default)]
pub struct Listen {
    /// HTTP JSON API.
    pub http: Option<SocketAddr>,
    /// Envoy RLS (gRPC).
    pub grpc: Option<SocketAddr>,
    /// Which RLS responses carry rate-limit headers.
    pub rls_headers: rls::RlsHeaders,
    /// OpenAI-compatible proxy: listen address, upstream base URL, accepted keys.
    pub proxy: Option<(SocketAddr, String, Vec<crate::ApiKey>, proxy::ProxyConfig)>,
}

/// Bound addresses of a running agent.
#[derive(Debug, Clone, Default)]
pub struct Bound {
    /// HTTP API.
    pub http: Option<SocketAddr>,
    /// gRPC (RLS).
    pub grpc: Option<SocketAddr>,
    /// Proxy.
    pub proxy: Option<SocketAddr>,
}

/// Binds every configured front door, starts them and the maintenance ticker, and
/// returns the bound addresses. Everything stops when `shutdown` turns true.
pub async fn start(
    state: Arc<AgentState>,
    listen: Listen,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<Bound> {
    let mut bound = Bound::default();
    if let Some(addr) = listen.http {
        let l = TcpListener::bind(addr).await?;
        bound.http = Some(l.local_addr()?);
        let l = l.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let app = http::router(Arc::clone(&state));
        let mut sd = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(l, app)
                .with_graceful_shutdown(async move {
                    let _ = sd.wait_for(|s| *s).await;
                })
                .await;
        });
    }
    if let Some(addr) = listen.grpc {
        let l = TcpListener::bind(addr).await?;
        bound.grpc = Some(l.local_addr()?);
        let svc = bursar_proto::rls::rate_limit_service_server::RateLimitServiceServer::new(
            rls::Rls::new(Arc::clone(&state), listen.rls_headers),
        );
        let mut sd = shutdown.clone();
        // Without TCP_NODELAY small gRPC responses wait on Nagle's algorithm and the
        // peer's delayed ACK: ~40 ms per call (measured by bench/run.sh).
        let incoming = tokio_stream::StreamExt::map(
            tokio_stream::wrappers::TcpListenerStream::new(l),
            |conn| {
                conn.inspect(|s| {
                    let _ = s.set_nodelay(true);
                })
            },
        );
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = sd.wait_for(|s| *s).await;
                })
                .await;
        });
    }
    if let Some((addr, upstream, keys, cfg)) = listen.proxy {
        let l = TcpListener::bind(addr).await?;
        bound.proxy = Some(l.local_addr()?);
        let l = l.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let app = proxy::router(Arc::clone(&state), upstream, keys, cfg);
        let mut sd = shutdown.clone();
        tokio::spawn(async move {
            let _ = axum::serve(l, app)
                .with_graceful_shutdown(async move {
                    let _ = sd.wait_for(|s| *s).await;
                })
                .await;
        });
    }
    // Maintenance: expire leases, apply postures, evict idle keys, publish new keys.
    let mut sd = shutdown;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    state.engine.maintain(state.clock.now_ns());
                }
                _ = sd.wait_for(|s| *s) => break,
            }
        }
    });
    Ok(bound)
}
