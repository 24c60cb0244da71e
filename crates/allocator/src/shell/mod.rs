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
//! - **The admin endpoint** ([`admin`]): JSON, `GET /v1/keys` (per key: limit,
//!   demand, committed, per-agent grants, the overshoot bound), `GET /v1/status` (with
//!   the rules in force, their version and the last reload's outcome), `GET /healthz`,
//!   and `POST /v1/admin/reload`.
//! - **Reload** ([`reload_rules`], [`Handle::reload`]): SIGHUP (in `main.rs`) or the
//!   admin POST re-reads the rules file. A file that does not read, parse or validate is
//!   refused with an error naming the file, the rule and the field (logged, and shown
//!   by the admin endpoint as `last_reload_error`); the rules in force stay unchanged.
//!   A valid one is applied to the core ([`crate::Allocator::reload`]) and its version
//!   is pushed to every connected agent (`ConfigVersion`).
//!
//! # Bounds and what happens at them
//!
//! - Inputs: `input_queue_max` (default 4,096) messages, and `input_bytes_max`
//!   (default 256 MiB) bytes of converted hellos, reports and acks not yet handled by
//!   the core (each holds its share until handled). Either full: stream readers wait
//!   (TCP back-pressure on the agent); admin requests wait on the first only.
//! - Streams waiting for their hello's answer: `pending_hellos_max` (default 256).
//!   Full: a new stream is refused at once (`RESOURCE_EXHAUSTED`). Streams past their
//!   hello belong to registered agents (at most the core's `max_agents`, one live
//!   stream each), and HTTP/2 allows `streams_per_connection_max` (default 16) per
//!   connection. A stream's reader holds at most one message of up to
//!   `MAX_MESSAGE_BYTES` while it converts it or waits for the budget.
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
pub mod conns;
pub mod driver;
pub mod election;
pub mod grpc;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
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
    /// Bytes of converted input (hellos, reports, acks) waiting for the core, at most
    /// (1 to `u32::MAX`). Default 256 MiB.
    pub input_bytes_max: usize,
    /// Streams waiting for their hello's answer, at most; one more is refused at once.
    /// Default 256.
    pub pending_hellos_max: usize,
    /// Open TCP connections to the stream port, at most; one more is closed at accept
    /// ([`conns::ConnectionCap`]). Default 16,384.
    pub connections_max: usize,
    /// Time a new connection has to open a stream before it is closed (and counted
    /// as silent, [`conns`]). Default 10 s.
    pub first_stream_timeout: Duration,
    /// Concurrent HTTP/2 streams per connection (an agent opens one). Default 16.
    pub streams_per_connection_max: u32,
    /// Time an agent has to send its hello after opening a stream. Default 5 s.
    pub hello_timeout: Duration,
    /// Keys listed per admin response at most. Default 1,000.
    pub admin_max_keys: usize,
    /// The file the rules came from: what a reload re-reads. `None` (embedded rules):
    /// reloads are refused.
    pub rules_path: Option<PathBuf>,
    /// TLS on the agents' stream ([`server_tls`]); `None`: plain HTTP/2.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// TLS files of the agents' stream: the allocator's certificate and key, and the CA
/// that signs agents' certificates (mutual TLS: an agent without one is refused).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
    /// CA of agents' client certificates (PEM); `None`: server authentication only.
    pub client_ca: Option<PathBuf>,
}

/// Reads the files into a server TLS configuration; errors name the file.
pub fn server_tls(files: &TlsFiles) -> Result<tonic::transport::ServerTlsConfig, String> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    let identity = Identity::from_pem(read(&files.cert)?, read(&files.key)?);
    let mut cfg = ServerTlsConfig::new().identity(identity);
    if let Some(ca) = &files.client_ca {
        cfg = cfg.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(cfg)
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
            input_bytes_max: 256 << 20,
            pending_hellos_max: 256,
            connections_max: conns::CONNECTIONS_MAX_DEFAULT,
            first_stream_timeout: conns::FIRST_STREAM_TIMEOUT_DEFAULT,
            streams_per_connection_max: 16,
            hello_timeout: Duration::from_secs(5),
            admin_max_keys: 1_000,
            rules_path: None,
            tls: None,
        }
    }
}

/// Starting the shell failed. Nothing is left running.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    /// A setting is out of range (operator).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The TLS certificate, key or CA was refused (operator).
    #[error("TLS on the agents' stream: {0}")]
    Tls(String),
    /// A bound on the shell's own queues is zero (operator).
    #[error("shell setting `{0}` must be at least 1")]
    Bound(&'static str),
    /// A bound on the shell's own queues is above what it supports (operator).
    #[error("shell setting `{name}` must be at most {max}")]
    TooLarge {
        /// The setting.
        name: &'static str,
        /// Its largest value.
        max: u64,
    },
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
    bursar_proto::allocator::config_version(&rules.rules.canonical())
}

/// A way into the running core task (for `main.rs`'s SIGHUP handler and in-process
/// callers such as `bursar-allocator local`): snapshots and reloads over the same
/// bounded channel the admin endpoint uses.
#[derive(Clone, Debug)]
pub struct Handle {
    inputs: mpsc::Sender<driver::Input>,
    rules_path: Option<PathBuf>,
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

    /// Re-reads the rules file and applies it (see [`reload_rules`]); the error names
    /// the file, rule and field, and the rules in force stay unchanged. `None` once the
    /// core task stopped.
    pub async fn reload(&self) -> Option<Result<driver::Reloaded, String>> {
        reload_via(&self.inputs, self.rules_path.as_deref()).await
    }

    /// Resolves once the core task has stopped: after a shutdown, or a panic in it.
    /// The binary exits then, unless it is shutting down: a process whose core died
    /// kept serving (every hello refused, `/healthz` fine, and in etcd mode its
    /// leadership renewed, so no standby took over).
    pub async fn core_stopped(&self) {
        self.inputs.closed().await
    }
}

/// Reads, parses and validates the rules file at `path` for a reload. Errors name the
/// file and, as far as the file lets us know, the rule and the field (a TOML syntax
/// error names its line and the `[[rule]]` it sits in).
///
/// Refused beyond the agent's own validation: a file with no rule at all (an emptied
/// or truncated file would otherwise release every limit).
pub fn reload_rules(path: &Path) -> Result<Config, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("rules file {shown}: cannot read it: {e}"))?;
    let rules = Config::from_toml(&text).map_err(|e| {
        let mut msg = format!("rules file {shown}: {e}");
        if let bursar_agent::ConfigError::Syntax(s) = &e
            && let Some(rule) = syntax_error_rule(&text, s)
        {
            msg = format!("rules file {shown}: in {rule}: {e}");
        }
        one_line(&msg)
    })?;
    if rules.rules.is_empty() {
        return Err(format!(
            "rules file {shown}: no [[rule]] at all; refusing to release every limit (an \
             emptied or truncated file?)"
        ));
    }
    Ok(rules)
}

/// One line for logs and JSON: TOML's error spans several (position, an excerpt of
/// the file with a caret, the message); the excerpt is kept, quoted.
fn one_line(msg: &str) -> String {
    let mut parts: Vec<String> = Vec::new();
    for l in msg.lines() {
        let t = l.trim();
        if t.is_empty() || t.starts_with('|') {
            continue;
        }
        match t.split_once(" | ") {
            Some((n, src)) if n.bytes().all(|b| b.is_ascii_digit()) => {
                parts.push(format!("(`{}`)", src.trim()))
            }
            _ => parts.push(t.to_string()),
        }
    }
    parts.join(" ")
}

/// For a TOML syntax error at "line N", the `[[rule]]` table that line sits in, named
/// by its `name` if it has one (`[[rule]] #3 "org-rps"`).
fn syntax_error_rule(text: &str, error: &str) -> Option<String> {
    let at = error.find("line ")? + "line ".len();
    let line: usize = error[at..]
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    let lines: Vec<&str> = text.lines().collect();
    let mut index = 0;
    let mut start = None;
    for (i, l) in lines.iter().enumerate().take(line.min(lines.len())) {
        let t = l.trim();
        if t.starts_with("[[rule]]") {
            index += 1;
            start = Some(i);
        } else if t.starts_with('[') {
            start = None;
        }
    }
    let start = start?;
    let name = lines[start + 1..]
        .iter()
        .take_while(|l| !l.trim().starts_with('['))
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
        });
    Some(match name {
        Some(n) => format!("[[rule]] #{index} {n:?}"),
        None => format!("[[rule]] #{index}"),
    })
}

async fn reload_via(
    inputs: &mpsc::Sender<driver::Input>,
    path: Option<&Path>,
) -> Option<Result<driver::Reloaded, String>> {
    // One reload at a time, from reading the file to its answer: two at once (the
    // admin POST and SIGHUP, or the file watcher) could apply the older read last and
    // leave it in force, the watcher having recorded the newer file as seen.
    static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE_AT_A_TIME.lock().await;
    let rules = match path {
        None => Err(
            "no rules file: the allocator runs on its embedded rules (start it with \
             --config FILE to reload)"
                .to_string(),
        ),
        Some(p) => {
            let p = p.to_path_buf();
            tokio::task::spawn_blocking(move || reload_rules(&p))
                .await
                .unwrap_or_else(|e| Err(format!("reading the rules file: {e}")))
        }
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    inputs
        .send(driver::Input::Reload { rules, reply })
        .await
        .ok()?;
    answer.await.ok()
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
        ("input_bytes_max", cfg.input_bytes_max),
        ("pending_hellos_max", cfg.pending_hellos_max),
        ("connections_max", cfg.connections_max),
        (
            "streams_per_connection_max",
            cfg.streams_per_connection_max as usize,
        ),
    ] {
        if v == 0 {
            return Err(ShellError::Bound(name));
        }
    }
    if cfg.input_bytes_max > u32::MAX as usize {
        return Err(ShellError::TooLarge {
            name: "input_bytes_max",
            max: u32::MAX as u64,
        });
    }
    let gate = Arc::new(grpc::Gate::new(
        cfg.input_bytes_max,
        cfg.pending_hellos_max,
        cfg.connections_max,
        cfg.first_stream_timeout,
    ));
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
    let handle = Handle {
        inputs: tx.clone(),
        rules_path: cfg.rules_path.clone(),
    };
    let driver = driver::Driver::new(
        core,
        clock,
        config_version(rules),
        cfg.admin_max_keys,
        cfg.rules_path.as_ref().map(|p| p.display().to_string()),
        Arc::clone(&gate),
    );
    tokio::spawn(driver.run(rx, shutdown.clone()));
    let incoming = Arc::clone(gate.connections()).incoming(grpc_l);
    let svc = grpc::Service::new(tx.clone(), cfg.hello_timeout, cfg.agent_queue_max, gate);
    let mut sd = shutdown.clone();
    let streams_per_connection = cfg.streams_per_connection_max;
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = cfg.tls.clone() {
        server = server
            .tls_config(tls)
            .map_err(|e| ShellError::Tls(e.to_string()))?;
    }
    tokio::spawn(async move {
        let _ = server
            .max_concurrent_streams(Some(streams_per_connection))
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
            let app = admin::router(Arc::new(admin::Admin::new(tx, cfg.rules_path.clone())));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("bursar-reload-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The status line of `GET path` on `addr`.
    async fn get_status(addr: SocketAddr, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        c.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        out.lines().next().unwrap_or("").to_string()
    }

    /// A core task that died (a panic: its input receiver goes with it) left the
    /// process serving with `/healthz` fine, and the binary never noticed. The handle
    /// now resolves `core_stopped` (the binary exits on it) and `/healthz` is 503.
    #[tokio::test]
    async fn a_core_that_stopped_is_seen_by_the_handle_and_healthz() {
        let (tx, rx) = mpsc::channel::<driver::Input>(4);
        let handle = Handle {
            inputs: tx.clone(),
            rules_path: None,
        };
        let app = admin::router(Arc::new(admin::Admin::new(tx, None)));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        assert!(get_status(addr, "/healthz").await.contains("200"));
        let core = tokio::spawn(async move {
            let _inputs = rx;
            panic!("a bug in the core");
        });
        assert!(core.await.unwrap_err().is_panic());
        tokio::time::timeout(Duration::from_secs(5), handle.core_stopped())
            .await
            .expect("the handle sees the core stop");
        let st = get_status(addr, "/healthz").await;
        assert!(st.contains("503"), "{st}");
    }

    #[test]
    fn a_refused_rules_file_is_named_with_its_rule_and_field() {
        let missing = std::env::temp_dir().join("bursar-reload-no-such-file.toml");
        let e = reload_rules(&missing).unwrap_err();
        assert!(e.starts_with(&format!("rules file {}: cannot read it", missing.display())));

        let empty = file("empty.toml", "# truncated\n");
        let e = reload_rules(&empty).unwrap_err();
        assert!(e.contains("no [[rule]] at all"), "{e}");

        let text = "[[rule]]\nname = \"a\"\nmatch = { org = \"*\" }\ndimension = \"requests\"\n\
                    rate = 10\nper = \"second\"\n\n[[rule]]\nname = \"b\"\nmatch = { org = \"*\" }\n\
                    dimension = \"requests\"\nrate = 10 10\nper = \"second\"\n";
        let bad = file("syntax.toml", text);
        let e = reload_rules(&bad).unwrap_err();
        assert!(
            e.contains("in [[rule]] #2 \"b\"") && e.contains("line 12"),
            "{e}"
        );
        assert!(!e.contains('\n'), "one line: {e}");

        let unknown = file("field.toml", &text.replace("rate = 10 10", "rat = 10"));
        let e = reload_rules(&unknown).unwrap_err();
        assert!(e.contains("rule b") && e.contains("`rat`"), "{e}");
        for p in [empty, bad, unknown] {
            let _ = std::fs::remove_file(p);
        }
    }
}
