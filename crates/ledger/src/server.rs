//! The HTTP shell of a single ledger node (feature `server`): tokio + axum in front of
//! a [`RedbStore`].
//!
//! One thread owns the writes: HTTP handlers validate a batch, put it on a bounded
//! queue and wait; the writer drains every batch waiting (up to
//! [`ServerConfig::commit_events_max`] events), applies them in **one** durable
//! transaction (group commit), and only then answers each request. An event is
//! acknowledged only after the commit that holds it. Reads use redb's MVCC read
//! transactions on the blocking pool and never wait for the writer.
//!
//! Bounds: a request body is at most [`ServerConfig::body_max_bytes`] (413 beyond), a
//! batch at most [`ServerConfig::batch_events_max`] events (413), the ingest queue at
//! most [`ServerConfig::queue_max`] batches (503 with `Retry-After: 1` when full), an
//! export page at most [`ServerConfig::export_lines_max`] lines (the rest by cursor),
//! a query at most [`ServerConfig::range_hours_max`] hours.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::digest::Bucket;
use crate::event::{Event, HOUR_MS, Limits, hex};
use crate::merge::ApplyReport;
use crate::redb_store::RedbStore;
use crate::store::{Cursor, QueryError, Store, usage_totals};
use crate::totals::TotalsLimits;
use crate::wire::{BatchError, event_json, parse_batch};

/// Configuration of the HTTP shell. Plain data; [`ServerConfig::validate`] at start-up.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// This node's id (reported by `/healthz` and `/metrics`).
    pub node_id: String,
    /// Bounds on each event.
    pub limits: Limits,
    /// Bounds on a totals query.
    pub totals_limits: TotalsLimits,
    /// Largest request body, bytes. Default 16 MiB (about 50,000 events).
    pub body_max_bytes: usize,
    /// Most events in one `POST /v1/events`. Default 50,000.
    pub batch_events_max: usize,
    /// Most events the writer puts in one transaction (group commit). Default
    /// 100,000. Larger amortises the fsync further but holds answers longer.
    pub commit_events_max: usize,
    /// Most batches waiting for the writer. Default 256; beyond, 503.
    pub queue_max: usize,
    /// Most lines in one export page. Default 100,000.
    pub export_lines_max: usize,
    /// Widest query, hours. Default 24 * 400.
    pub range_hours_max: u64,
    /// Most buckets listed by `/v1/digest`. Default 100,000.
    pub digest_buckets_max: usize,
    /// Most `POST /v1/events` bodies read and parsed at once; one more is 503 (retry)
    /// before its body is read. Default 64. Without it every request's body (16 MiB)
    /// and parsed events were held before the queue's 503: 500 agents posting at once
    /// held gigabytes.
    pub ingest_max: usize,
    /// Time a client has to send a `POST /v1/events` body (408 after). Default 30 s.
    pub body_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            node_id: "ledger-1".into(),
            limits: Limits::default(),
            totals_limits: TotalsLimits::default(),
            body_max_bytes: 16 << 20,
            batch_events_max: 50_000,
            commit_events_max: 100_000,
            queue_max: 256,
            export_lines_max: 100_000,
            range_hours_max: 24 * 400,
            digest_buckets_max: 100_000,
            ingest_max: 64,
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// A configuration or start-up error. Nothing was started; the cause is the operator's.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Serving failed (the listener).
    #[error("HTTP server failed: {0}")]
    Serve(#[from] std::io::Error),
}

impl ServerConfig {
    /// Checks every bound is usable.
    pub fn validate(&self) -> Result<(), ServerError> {
        let positive = [
            ("body_max_bytes", self.body_max_bytes),
            ("batch_events_max", self.batch_events_max),
            ("commit_events_max", self.commit_events_max),
            ("queue_max", self.queue_max),
            ("export_lines_max", self.export_lines_max),
            ("digest_buckets_max", self.digest_buckets_max),
            ("ingest_max", self.ingest_max),
            ("body_timeout_ms", self.body_timeout.as_millis() as usize),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ServerError::Config(format!("{name} must be > 0")));
        }
        if self.node_id.is_empty() || self.node_id.len() > self.limits.name_max_bytes {
            return Err(ServerError::Config("node_id must be 1..=256 bytes".into()));
        }
        if self.range_hours_max == 0 {
            return Err(ServerError::Config("range_hours_max must be > 0".into()));
        }
        Ok(())
    }
}

/// Counters exported by `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    events_received: AtomicU64,
    events_new: AtomicU64,
    events_duplicate: AtomicU64,
    events_conflict: AtomicU64,
    commits: AtomicU64,
    commit_micros: AtomicU64,
    commit_failures: AtomicU64,
    rejected_invalid: AtomicU64,
    rejected_busy: AtomicU64,
    queued: AtomicU64,
    push_dropped: AtomicU64,
    /// Commits (apply + fsync, failed ones too) by duration: one counter per bucket of
    /// [`COMMIT_BUCKETS_S`], then one for longer ones.
    commit_buckets: [AtomicU64; COMMIT_BUCKETS_S.len() + 1],
}

/// Upper bounds of the commit duration histogram's buckets, in seconds.
const COMMIT_BUCKETS_S: [f64; 9] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

impl Metrics {
    fn commit_took(&self, d: Duration) {
        self.commit_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
        let s = d.as_secs_f64();
        let b = COMMIT_BUCKETS_S
            .iter()
            .position(|&le| s <= le)
            .unwrap_or(COMMIT_BUCKETS_S.len());
        self.commit_buckets[b].fetch_add(1, Ordering::Relaxed);
    }
}

struct Job {
    events: Vec<Event>,
    /// From this node's HTTP ingest (pushed to peers once committed), not from a peer.
    local: bool,
    reply: oneshot::Sender<Result<ApplyReport, String>>,
}

/// A handle on the node's single writer, for the cluster shell: batches from peers are
/// applied in the same group commits as local ingest.
#[derive(Clone)]
pub struct Writer {
    tx: mpsc::Sender<Job>,
    metrics: Arc<Metrics>,
}

impl Writer {
    /// Applies events received from a peer, durably; waits for room in the queue
    /// (peers are back-pressured, never refused) and for the commit.
    pub async fn apply_from_peer(&self, events: Vec<Event>) -> Result<ApplyReport, String> {
        let (reply, rx) = oneshot::channel();
        self.metrics.queued.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Job {
                events,
                local: false,
                reply,
            })
            .await
            .is_err()
        {
            self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            return Err("the writer has stopped".into());
        }
        rx.await
            .map_err(|_| "the writer stopped before committing".to_string())?
    }
}

#[derive(Clone)]
struct AppState {
    #[cfg(feature = "cluster")]
    cluster: Option<Arc<crate::cluster::Cluster>>,
    tx: mpsc::Sender<Job>,
    store: RedbStore,
    cfg: Arc<ServerConfig>,
    metrics: Arc<Metrics>,
    writer_alive: Arc<AtomicBool>,
    /// Permits for bodies being read and parsed ([`ServerConfig::ingest_max`]).
    ingest: Arc<tokio::sync::Semaphore>,
}

/// Unix time in ms from the system clock (the shell's clock; the core takes time as
/// an argument).
pub fn system_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Serves the API on `listener` until `shutdown` resolves, then drains the writer
/// (every accepted batch is committed and answered) and returns. A single node: no
/// cluster.
pub async fn serve(
    listener: tokio::net::TcpListener,
    store: RedbStore,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_inner(listener, store, cfg, None, shutdown).await
}

/// [`serve`], as a member of a cluster: starts the cluster shell (QUIC with mutual
/// TLS, membership, push and pull) beside the HTTP API, and adds `GET /v1/cluster`
/// (and `POST /v1/cluster/isolate` when fault injection is on). `on_ready` receives
/// the bound gossip address once the cluster is up.
#[cfg(feature = "cluster")]
pub async fn serve_cluster(
    listener: tokio::net::TcpListener,
    store: RedbStore,
    cfg: ServerConfig,
    cluster: crate::cluster::ClusterConfig,
    on_ready: impl FnOnce(std::net::SocketAddr) + Send,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    serve_inner(
        listener,
        store,
        cfg,
        Some((cluster, Box::new(on_ready))),
        shutdown,
    )
    .await
}

#[cfg(feature = "cluster")]
type ClusterStart<'a> = (
    crate::cluster::ClusterConfig,
    Box<dyn FnOnce(std::net::SocketAddr) + Send + 'a>,
);
#[cfg(not(feature = "cluster"))]
type ClusterStart<'a> = std::convert::Infallible;

async fn serve_inner(
    listener: tokio::net::TcpListener,
    store: RedbStore,
    cfg: ServerConfig,
    cluster: Option<ClusterStart<'_>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    cfg.validate()?;
    let (tx, rx) = mpsc::channel(cfg.queue_max);
    let metrics = Arc::new(Metrics::default());
    let writer_alive = Arc::new(AtomicBool::new(true));
    #[cfg(feature = "cluster")]
    let (push_tx, push_rx) = match &cluster {
        Some((c, _)) => {
            let (t, r) = mpsc::channel(c.push_queue_max);
            (Some(t), Some(r))
        }
        None => (None, None),
    };
    #[cfg(not(feature = "cluster"))]
    let push_tx: Option<mpsc::Sender<Vec<Event>>> = None;
    let writer = {
        let store = store.clone();
        let metrics = metrics.clone();
        let alive = writer_alive.clone();
        let max = cfg.commit_events_max;
        std::thread::Builder::new()
            .name("ledger-writer".into())
            .spawn(move || {
                // Cleared however the loop ends, a panic included: `/healthz` must not
                // answer 200 while every POST is refused (thirty-first session: the
                // flag was cleared after a normal return only).
                struct Alive(Arc<AtomicBool>);
                impl Drop for Alive {
                    fn drop(&mut self) {
                        self.0.store(false, Ordering::Release);
                    }
                }
                let _alive = Alive(alive);
                writer_loop(rx, &store, max, &metrics, push_tx.as_ref());
            })?
    };
    #[cfg(feature = "cluster")]
    let cluster = match cluster {
        Some((c, on_ready)) => {
            let w = Writer {
                tx: tx.clone(),
                metrics: metrics.clone(),
            };
            let started = crate::cluster::Cluster::start(
                c,
                store.clone(),
                w,
                push_rx.expect("a push channel with a cluster"),
            )
            .map_err(|e| ServerError::Config(e.to_string()))?;
            on_ready(started.local_addr());
            Some(Arc::new(started))
        }
        None => None,
    };
    #[cfg(not(feature = "cluster"))]
    let _ = cluster;
    let state = AppState {
        #[cfg(feature = "cluster")]
        cluster: cluster.clone(),
        tx,
        store,
        cfg: Arc::new(cfg.clone()),
        metrics,
        writer_alive,
        ingest: Arc::new(tokio::sync::Semaphore::new(cfg.ingest_max)),
    };
    let app = Router::new()
        .route("/v1/events", post(post_events))
        .route("/v1/usage", get(get_usage))
        .route("/v1/digest", get(get_digest))
        .route("/v1/export", get(get_export))
        .route("/v1/conflicts", get(get_conflicts))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text));
    #[cfg(feature = "cluster")]
    let app = app
        .route("/v1/cluster", get(get_cluster))
        .route("/v1/cluster/isolate", post(post_isolate));
    let app = app
        .layer(DefaultBodyLimit::max(cfg.body_max_bytes))
        .with_state(state);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await?;
    #[cfg(feature = "cluster")]
    if let Some(c) = cluster {
        c.shutdown().await;
    }
    // The router (and every sender) is dropped: the writer drains and stops.
    let _ = tokio::task::spawn_blocking(move || writer.join()).await;
    Ok(())
}

fn writer_loop(
    mut rx: mpsc::Receiver<Job>,
    store: &RedbStore,
    max: usize,
    m: &Metrics,
    push: Option<&mpsc::Sender<Vec<Event>>>,
) {
    while let Some(first) = rx.blocking_recv() {
        let mut jobs = vec![first];
        let mut n = jobs[0].events.len();
        while n < max {
            match rx.try_recv() {
                Ok(j) => {
                    n += j.events.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        m.queued.fetch_sub(jobs.len() as u64, Ordering::Relaxed);
        let lens: Vec<usize> = jobs.iter().map(|j| j.events.len()).collect();
        let mut all = Vec::with_capacity(n);
        for j in &mut jobs {
            all.append(&mut j.events);
        }
        let started = Instant::now();
        let result = store.apply(&all);
        m.commit_took(started.elapsed());
        match result {
            Ok(report) => {
                m.commits.fetch_add(1, Ordering::Relaxed);
                m.events_new.fetch_add(report.new, Ordering::Relaxed);
                m.events_duplicate
                    .fetch_add(report.duplicate, Ordering::Relaxed);
                m.events_conflict
                    .fetch_add(report.conflict, Ordering::Relaxed);
                if let Some(push) = push {
                    // Events new here from local ingest go to peers (after the commit).
                    // The batch is no longer needed: move them, do not copy them.
                    let local = jobs
                        .iter()
                        .zip(&lens)
                        .flat_map(|(j, &len)| std::iter::repeat_n(j.local, len));
                    let fresh: Vec<Event> = std::mem::take(&mut all)
                        .into_iter()
                        .zip(&report.outcomes)
                        .zip(local)
                        .filter(|((_, o), local)| *local && **o == crate::merge::Outcome::New)
                        .map(|((e, _), _)| e)
                        .collect();
                    if !fresh.is_empty() && push.try_send(fresh).is_err() {
                        m.push_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let mut outcomes = report.outcomes.into_iter();
                for (j, len) in jobs.into_iter().zip(lens) {
                    let mut r = ApplyReport::default();
                    for o in outcomes.by_ref().take(len) {
                        r.push(o);
                    }
                    let _ = j.reply.send(Ok(r));
                }
            }
            Err(e) => {
                m.commit_failures.fetch_add(1, Ordering::Relaxed);
                let msg = e.to_string();
                for j in jobs {
                    let _ = j.reply.send(Err(msg.clone()));
                }
            }
        }
    }
}

/// An HTTP error answer: a status and a message, as `{"error": "..."}`.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    msg: String,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(json!({ "error": self.msg }))).into_response()
    }
}

fn error(status: StatusCode, msg: impl Into<String>) -> ApiError {
    ApiError {
        status,
        msg: msg.into(),
    }
}

/// Why a request body could not be read.
enum BodyRead {
    TooLarge,
    Broken(String),
}

/// `body` whole, at most `max` bytes.
async fn read_body(mut body: axum::body::Body, max: usize) -> Result<Vec<u8>, BodyRead> {
    use axum::body::HttpBody;
    let mut out = Vec::new();
    loop {
        let frame = std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await;
        match frame {
            None => return Ok(out),
            Some(Err(e)) => return Err(BodyRead::Broken(e.to_string())),
            Some(Ok(f)) => {
                if let Ok(data) = f.into_data() {
                    if out.len() + data.len() > max {
                        return Err(BodyRead::TooLarge);
                    }
                    out.extend_from_slice(&data);
                }
            }
        }
    }
}

async fn post_events(State(s): State<AppState>, body: axum::body::Body) -> Response {
    let busy = |msg: &str| {
        s.metrics.rejected_busy.fetch_add(1, Ordering::Relaxed);
        let mut r = error(StatusCode::SERVICE_UNAVAILABLE, msg).into_response();
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        r
    };
    // Held until the batch is answered (read, parsed, queued, committed): the bodies
    // in memory at once, parsed or waiting for their commit, are bounded before any
    // is read. (Given back once queued, the queue's 256 batches of up to 16 MiB would
    // be the bound instead: reviewed and kept, thirty-first session.)
    let Ok(_in_flight) = Arc::clone(&s.ingest).try_acquire_owned() else {
        return busy("too many batches being received; nothing stored; retry");
    };
    let body = match tokio::time::timeout(s.cfg.body_timeout, read_body(body, s.cfg.body_max_bytes))
        .await
    {
        Ok(Ok(b)) => b,
        Ok(Err(BodyRead::TooLarge)) => {
            s.metrics.rejected_invalid.fetch_add(1, Ordering::Relaxed);
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the body is over {} bytes; nothing stored",
                    s.cfg.body_max_bytes
                ),
            )
            .into_response();
        }
        Ok(Err(BodyRead::Broken(e))) => {
            s.metrics.rejected_invalid.fetch_add(1, Ordering::Relaxed);
            return error(
                StatusCode::BAD_REQUEST,
                format!("reading the body: {e}; nothing stored"),
            )
            .into_response();
        }
        Err(_) => {
            s.metrics.rejected_invalid.fetch_add(1, Ordering::Relaxed);
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the body did not arrive within {} ms; nothing stored",
                    s.cfg.body_timeout.as_millis()
                ),
            )
            .into_response();
        }
    };
    let reject = |status, msg: String| {
        s.metrics.rejected_invalid.fetch_add(1, Ordering::Relaxed);
        error(status, msg).into_response()
    };
    let events = match parse_batch(
        &body,
        system_now_ms(),
        &s.cfg.limits,
        s.cfg.batch_events_max,
    ) {
        Ok(events) => events,
        Err(e @ BatchError::TooMany(..)) => {
            return reject(StatusCode::PAYLOAD_TOO_LARGE, e.to_string());
        }
        Err(e @ BatchError::Event { .. }) => {
            return reject(
                StatusCode::BAD_REQUEST,
                format!("{e} (nothing in this request was stored)"),
            );
        }
        Err(e) => return reject(StatusCode::BAD_REQUEST, e.to_string()),
    };
    s.metrics
        .events_received
        .fetch_add(events.len() as u64, Ordering::Relaxed);
    let n = events.len();
    let (reply, rx) = oneshot::channel();
    // Count the batch as queued before the writer can see (and uncount) it.
    s.metrics.queued.fetch_add(1, Ordering::Relaxed);
    match s.tx.try_send(Job {
        events,
        local: true,
        reply,
    }) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            s.metrics.rejected_busy.fetch_add(1, Ordering::Relaxed);
            let mut r = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "ingest queue full; nothing stored; retry",
            )
            .into_response();
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return r;
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            s.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the writer has stopped; nothing stored",
            )
            .into_response();
        }
    }
    match rx.await {
        Ok(Ok(r)) => {
            debug_assert_eq!(r.outcomes.len(), n);
            axum::Json(json!({
                "events": n,
                "new": r.new,
                "duplicate": r.duplicate,
                "conflict": r.conflict,
                // Which node holds them now: a forwarder behind a load balancer credits
                // the node that answered, not the one it learned at /healthz.
                "node_id": s.cfg.node_id,
                // And which store: a node whose data was wiped answers with a new one,
                // and holds nothing a forwarder credited to the old.
                "store_id": s.store.store_id(),
            }))
            .into_response()
        }
        Ok(Err(msg)) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{msg}; nothing in this request was stored; retry"),
        )
        .into_response(),
        Err(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the writer stopped before committing; nothing acknowledged; retry",
        )
        .into_response(),
    }
}

type Params = Query<HashMap<String, String>>;

fn param_u64(p: &HashMap<String, String>, name: &str) -> Result<Option<u64>, ApiError> {
    match p.get(name) {
        None => Ok(None),
        Some(v) => v.parse::<u64>().map(Some).map_err(|_| {
            error(
                StatusCode::BAD_REQUEST,
                format!("query parameter {name}={v:?} is not a unix time in ms"),
            )
        }),
    }
}

/// `from`/`to` (unix ms, whole hours, from < to) as an hour range.
fn hour_range(
    p: &HashMap<String, String>,
    max_hours: u64,
    required: bool,
) -> Result<(u64, u64), ApiError> {
    let from = param_u64(p, "from")?;
    let to = param_u64(p, "to")?;
    let (from, to) = match (from, to) {
        (Some(f), Some(t)) => (f, t),
        (None, None) if !required => return Ok((0, u64::MAX)),
        _ => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "query parameters from and to (unix ms) are required",
            ));
        }
    };
    if from % HOUR_MS != 0 || to % HOUR_MS != 0 {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!(
                "from and to must be whole hours (multiples of {HOUR_MS} ms); digests are per hour"
            ),
        ));
    }
    if from >= to {
        return Err(error(StatusCode::BAD_REQUEST, "from must be before to"));
    }
    let (fh, th) = (from / HOUR_MS, to / HOUR_MS);
    if th - fh > max_hours {
        return Err(error(
            StatusCode::BAD_REQUEST,
            format!("the range spans {} hours; at most {max_hours}", th - fh),
        ));
    }
    Ok((fh, th))
}

fn store_error(e: impl std::fmt::Display) -> ApiError {
    error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(store_error(format!("query task failed: {e}"))))
}

async fn get_usage(State(s): State<AppState>, Query(p): Params) -> Response {
    let run = async {
        let tenant = p
            .get("tenant")
            .filter(|t| !t.is_empty())
            .cloned()
            .ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    "query parameter tenant is required",
                )
            })?;
        let (fh, th) = hour_range(&p, s.cfg.range_hours_max, true)?;
        let group_by_model = match p.get("group_by").map(String::as_str) {
            None | Some("") => false,
            Some("model") => true,
            Some(other) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("group_by={other:?} is not supported; use group_by=model"),
                ));
            }
        };
        let store = s.store.clone();
        let limits = s.cfg.totals_limits;
        let t = tenant.clone();
        let totals = blocking(move || {
            usage_totals(&store, &t, fh, th, group_by_model, limits).map_err(|e| match e {
                QueryError::Totals(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
                QueryError::Store(e) => store_error(e),
            })
        })
        .await?;
        let mut v = totals.to_json();
        v["tenant"] = tenant.into();
        v["from"] = (fh * HOUR_MS).into();
        v["to"] = (th * HOUR_MS).into();
        v["group_by"] = if group_by_model {
            "model".into()
        } else {
            Value::Null
        };
        Ok::<_, ApiError>(axum::Json(v).into_response())
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

async fn get_digest(State(s): State<AppState>, Query(p): Params) -> Response {
    let run = async {
        let (fh, th) = hour_range(&p, u64::MAX, false)?;
        let tenant = p.get("tenant").cloned();
        let store = s.store.clone();
        let max = s.cfg.digest_buckets_max;
        let (root, buckets) = blocking(move || {
            // One read view for both: the root is the sum of the buckets it answers
            // with (two reads let a commit land between them; thirty-first session).
            // Stopped past `max`: with no range and no tenant, every bucket of the
            // store (millions: over a gigabyte) was built just to answer 400.
            let mut out = None;
            store
                .read_view(&mut |v| {
                    out =
                        Some(v.root().and_then(|r| {
                            Ok((r, v.digests_at_most(fh, th, tenant.as_deref(), max)?))
                        }));
                })
                .map_err(store_error)?;
            out.expect("read_view calls its closure")
                .map_err(store_error)
        })
        .await?;
        let Some(buckets) = buckets else {
            return Err(error(
                StatusCode::BAD_REQUEST,
                format!(
                    "more than {max} buckets; at most {max} per answer: narrow from/to or name a tenant"
                ),
            ));
        };
        let list: Vec<Value> = buckets
            .iter()
            .map(|(b, d)| {
                let mut v = d.to_json();
                v["hour_start"] = (b.hour * HOUR_MS).into();
                v["tenant"] = b.tenant.clone().into();
                v
            })
            .collect();
        Ok::<_, ApiError>(
            axum::Json(json!({ "root": root.to_json(), "buckets": list })).into_response(),
        )
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// Most bytes of one export page before it ends with a cursor (the line that crosses
/// it is kept whole: a page is at most this plus one line).
const EXPORT_PAGE_BYTES_MAX: usize = 16 << 20;

/// Export cursor: `hour.tenant-hex.position` (opaque to clients; valid on the node
/// that issued it).
fn cursor_string(c: &Cursor) -> String {
    format!("{}.{}.{}", c.0.hour, hex(c.0.tenant.as_bytes()), c.1)
}

fn parse_cursor(s: &str) -> Option<Cursor> {
    let mut parts = s.split('.');
    let hour = parts.next()?.parse().ok()?;
    let th = parts.next()?;
    let seq = parts.next()?.parse().ok()?;
    if parts.next().is_some() || th.len() % 2 != 0 {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..th.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(th.get(i..i + 2)?, 16).ok())
        .collect();
    let tenant = String::from_utf8(bytes?).ok()?;
    Some((Bucket { hour, tenant }, seq))
}

async fn get_export(State(s): State<AppState>, Query(p): Params) -> Response {
    let run = async {
        let (fh, th) = hour_range(&p, s.cfg.range_hours_max, true)?;
        let after = match p.get("after") {
            None => None,
            Some(c) => Some(parse_cursor(c).ok_or_else(|| {
                error(
                    StatusCode::BAD_REQUEST,
                    "after= is not a cursor this ledger issued",
                )
            })?),
        };
        let max = s.cfg.export_lines_max;
        let limit = match param_u64(&p, "limit")? {
            None => max,
            Some(l) if l >= 1 && l as usize <= max => l as usize,
            Some(l) => {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    format!("limit={l} is not in 1..={max}"),
                ));
            }
        };
        let store = s.store.clone();
        let (body, next) = blocking(move || {
            let mut body = String::new();
            let mut n = 0usize;
            let mut last = None;
            let mut more = false;
            store
                .scan(fh, th, after.as_ref(), &mut |c, e| {
                    // Lines, and bytes: 100,000 lines of events near the size limits
                    // (long ids, sixteen long descriptors, escaped control characters)
                    // were gigabytes in one string.
                    if n == limit || body.len() >= EXPORT_PAGE_BYTES_MAX {
                        more = true;
                        return ControlFlow::Break(());
                    }
                    let _ = writeln!(body, "{}", event_json(e));
                    n += 1;
                    last = Some(c.clone());
                    ControlFlow::Continue(())
                })
                .map_err(store_error)?;
            let next = if more {
                last.as_ref().map(cursor_string)
            } else {
                None
            };
            Ok((body, next))
        })
        .await?;
        let mut r = ([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response();
        if let Some(next) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
            r.headers_mut().insert("x-bursar-next-after", next);
        }
        Ok::<_, ApiError>(r)
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

async fn get_conflicts(State(s): State<AppState>, Query(p): Params) -> Response {
    let limit = match param_u64(&p, "limit") {
        Ok(l) => l.unwrap_or(1000).min(10_000) as usize,
        Err(r) => return r.into_response(),
    };
    let store = s.store.clone();
    let res = blocking(move || store.conflicts(limit).map_err(store_error)).await;
    match res {
        Ok(list) => axum::Json(json!({
            "conflicts": list.iter().map(|c| json!({
                "event_key": c.key.to_hex(),
                "not_counted": event_json(&c.loser),
            })).collect::<Vec<_>>()
        }))
        .into_response(),
        Err(r) => r.into_response(),
    }
}

#[cfg(feature = "cluster")]
async fn get_cluster(State(s): State<AppState>) -> Response {
    match &s.cluster {
        Some(c) => {
            let mut v = c.status_json();
            v["push"]["dropped"] = json!(s.metrics.push_dropped.load(Ordering::Relaxed));
            axum::Json(v).into_response()
        }
        None => error(
            StatusCode::NOT_FOUND,
            "this node runs standalone (no --gossip)",
        )
        .into_response(),
    }
}

/// Fault injection: `POST /v1/cluster/isolate?on=true|false`. Only with
/// `--fault-injection`; otherwise 404.
#[cfg(feature = "cluster")]
async fn post_isolate(State(s): State<AppState>, Query(p): Params) -> Response {
    let Some(c) = s.cluster.as_ref().filter(|c| c.fault_injection()) else {
        return error(
            StatusCode::NOT_FOUND,
            "fault injection is off (start the node with --fault-injection)",
        )
        .into_response();
    };
    let on = match p.get("on").map(String::as_str) {
        Some("true") => true,
        Some("false") => false,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "query parameter on=true|false is required",
            )
            .into_response();
        }
    };
    c.set_isolated(on);
    axum::Json(json!({ "isolated": on })).into_response()
}

async fn healthz(State(s): State<AppState>) -> Response {
    if s.writer_alive.load(Ordering::Acquire) {
        axum::Json(json!({
            "status": "ok",
            "node_id": s.cfg.node_id,
            "store_id": s.store.store_id(),
        }))
        .into_response()
    } else {
        error(StatusCode::SERVICE_UNAVAILABLE, "the writer has stopped").into_response()
    }
}

/// One metric of `kind` (`counter` or `gauge`) in Prometheus text, labelled `node`.
fn metric(out: &mut String, node: &str, kind: &str, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP bursar_ledger_{name} {help}");
    let _ = writeln!(out, "# TYPE bursar_ledger_{name} {kind}");
    let _ = writeln!(out, "bursar_ledger_{name}{{node=\"{node}\"}} {v}");
}

async fn metrics_text(State(s): State<AppState>) -> Response {
    let store = s.store.clone();
    let stored = blocking(move || store.root().map_err(store_error))
        .await
        .map(|r| r.events)
        .ok();
    let store = s.store.clone();
    // Waits for a commit in progress (it holds the index).
    let index = blocking(move || Ok(store.index_stats()))
        .await
        .ok()
        .flatten();
    let m = &s.metrics;
    let id = &s.cfg.node_id;
    let mut out = String::new();
    let mut counter =
        |name: &str, help: &str, v: u64| metric(&mut out, id, "counter", name, help, v);
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    counter(
        "events_received_total",
        "Valid events received.",
        l(&m.events_received),
    );
    counter(
        "events_new_total",
        "Events stored for the first time.",
        l(&m.events_new),
    );
    counter(
        "events_duplicate_total",
        "Identical events already held.",
        l(&m.events_duplicate),
    );
    counter(
        "events_conflict_total",
        "Same key, different payload (recorded).",
        l(&m.events_conflict),
    );
    counter(
        "commits_total",
        "Durable write transactions (group commits).",
        l(&m.commits),
    );
    counter(
        "commit_microseconds_total",
        "Time spent in apply + commit.",
        l(&m.commit_micros),
    );
    counter(
        "commit_failures_total",
        "Failed commits (nothing acknowledged).",
        l(&m.commit_failures),
    );
    counter(
        "requests_invalid_total",
        "Ingest requests refused as invalid (4xx).",
        l(&m.rejected_invalid),
    );
    counter(
        "requests_busy_total",
        "Ingest requests refused with 503 (queue full).",
        l(&m.rejected_busy),
    );
    counter(
        "push_dropped_total",
        "Local batches not pushed to peers because the push queue was full (pull repairs).",
        l(&m.push_dropped),
    );
    #[cfg(feature = "cluster")]
    if let Some(c) = &s.cluster {
        let cs = c.stats();
        for (name, help, v) in [
            (
                "cluster_push_ok_total",
                "Push exchanges completed.",
                &cs.push_ok,
            ),
            (
                "cluster_push_failed_total",
                "Push exchanges failed (pull repairs).",
                &cs.push_failed,
            ),
            (
                "cluster_push_events_total",
                "Events pushed, once per peer.",
                &cs.push_events,
            ),
            (
                "cluster_push_bytes_total",
                "Bytes of push frames sent.",
                &cs.push_bytes,
            ),
            (
                "cluster_sync_in_sync_total",
                "Anti-entropy rounds with equal roots.",
                &cs.sync_in_sync,
            ),
            (
                "cluster_sync_reconciled_total",
                "Anti-entropy rounds that reconciled.",
                &cs.sync_reconciled,
            ),
            (
                "cluster_sync_failed_total",
                "Anti-entropy rounds that failed.",
                &cs.sync_failed,
            ),
            (
                "cluster_sync_events_sent_total",
                "Events sent by anti-entropy.",
                &cs.sync_events_sent,
            ),
            (
                "cluster_sync_events_received_total",
                "Events received by anti-entropy.",
                &cs.sync_events_received,
            ),
            (
                "cluster_bytes_sent_total",
                "Frame bytes sent to peers.",
                &cs.bytes_sent,
            ),
            (
                "cluster_bytes_received_total",
                "Frame bytes received from peers.",
                &cs.bytes_received,
            ),
            (
                "cluster_frames_rejected_total",
                "Malformed frames refused.",
                &cs.frames_rejected,
            ),
            (
                "cluster_handshakes_failed_total",
                "Incoming handshakes that failed (e.g. unknown CA).",
                &cs.handshakes_failed,
            ),
        ] {
            counter(name, help, l(v));
        }
        let members = c.members().len() as u64;
        metric(
            &mut out,
            id,
            "gauge",
            "cluster_members",
            "Live peers seen by membership.",
            members,
        );
    }
    let queued = l(&m.queued);
    metric(
        &mut out,
        id,
        "gauge",
        "queue_batches",
        "Batches waiting for the writer.",
        queued,
    );
    if let Some(n) = stored {
        metric(
            &mut out,
            id,
            "gauge",
            "stored_events",
            "Events in the store.",
            n,
        );
    }
    let name = "bursar_ledger_commit_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} Commits (apply + fsync, failed ones too) by duration."
    );
    let _ = writeln!(out, "# TYPE {name} histogram");
    let mut count = 0;
    for (i, b) in m.commit_buckets.iter().enumerate() {
        count += l(b);
        let le = COMMIT_BUCKETS_S
            .get(i)
            .map_or_else(|| "+Inf".to_string(), |le| le.to_string());
        let _ = writeln!(out, "{name}_bucket{{node=\"{id}\",le=\"{le}\"}} {count}");
    }
    let sum = l(&m.commit_micros) as f64 / 1e6;
    let _ = writeln!(out, "{name}_sum{{node=\"{id}\"}} {sum}");
    let _ = writeln!(out, "{name}_count{{node=\"{id}\"}} {count}");
    if let Some(ix) = index {
        for (name, help, v) in [
            (
                "index_runs",
                "Runs of the dedupe index (each a filter probe per new id).",
                ix.runs,
            ),
            (
                "index_filter_bytes",
                "Bytes of the dedupe index's Bloom filters, held in memory.",
                ix.filter_bytes,
            ),
            (
                "index_merge_ids_left",
                "Ids the index merge spread over commits has still to rewrite (0: none).",
                ix.merge_ids_left,
            ),
            (
                "index_merged_runs_to_delete",
                "Merged index runs whose blocks are still to be deleted.",
                ix.merged_runs_to_delete,
            ),
        ] {
            metric(&mut out, id, "gauge", name, help, v);
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_cursor_survives_a_round_trip() {
        let b = Bucket {
            hour: 490_000,
            tenant: "acme.corp/ü".into(),
        };
        let c = (b, 12345);
        assert_eq!(parse_cursor(&cursor_string(&c)), Some(c));
        assert_eq!(parse_cursor("1.zz.00"), None);
        assert_eq!(parse_cursor("1.61.x"), None);
    }

    #[test]
    fn the_default_configuration_is_valid_and_zero_bounds_are_not() {
        assert!(ServerConfig::default().validate().is_ok());
        let bad = ServerConfig {
            queue_max: 0,
            ..ServerConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("queue_max")
        );
    }
}
