//! The forwarder: delivers the outbox's events to the configured ledger nodes over
//! their HTTP API (`POST /v1/events`, which answers only after a durable commit).
//!
//! One task per configured ledger URL. Each learns its node's id and store id from
//! `GET /healthz` (so two URLs naming one node count once, a node keeps its place
//! across URL changes, and a node that lost its data and started empty under the same
//! id is not credited with what it held before: [`Outbox::holder`]), then loops: read
//! the next events above that holder's cursor from the outbox file, post them, and on
//! a `200` that counts every event and names the same node and store, acknowledge them
//! to the outbox ([`Outbox::ack`]). The outbox trims an event once
//! `min(2, configured ledgers)` distinct nodes acknowledged it. Failures back off
//! exponentially with jitter (100 ms to `backoff_max`); nothing is dropped. After a
//! restart the cursors come back from the file, so delivery resumes where it was;
//! a batch that was in flight may be sent again, which the ledger counts as a
//! duplicate (events are idempotent by request id).
//!
//! An event a ledger refuses on its own (`400` or `413` to a batch of just that event,
//! [`REFUSALS_BEFORE_QUARANTINE`] times in a row) is set aside for that ledger
//! ([`Outbox::quarantine`]: kept durably with the refusal, for an operator to replay)
//! and the events behind it are delivered; until the thirty-first session one such
//! event stopped that ledger's delivery for good, and the outbox filled to 503.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::watch;

use super::outbox::Outbox;

/// How often an idle forwarder asks its node's identity again while the outbox holds
/// events (see `step`).
const RELEARN_IDLE: Duration = Duration::from_secs(1);

/// Refusals in a row of one event sent alone (each after the failure backoff) after
/// which it is set aside for that ledger.
pub const REFUSALS_BEFORE_QUARANTINE: u32 = 3;

/// Forwarder settings. Plain data.
#[derive(Clone, Debug)]
pub struct ForwardConfig {
    /// Ledger base URLs (`http://host:port`), at least one.
    pub ledgers: Vec<String>,
    /// Most events in one `POST /v1/events`. Default 2,000 (a ledger takes 50,000).
    pub batch_max: usize,
    /// Longest pause between attempts after failures. Default 5 s.
    pub backoff_max: Duration,
    /// Timeout of one request. Default 30 s (a ledger answers after its fsync).
    pub request_timeout: Duration,
}

impl ForwardConfig {
    /// Defaults for `ledgers`.
    pub fn new(ledgers: Vec<String>) -> ForwardConfig {
        ForwardConfig {
            ledgers,
            batch_max: 2_000,
            backoff_max: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// One ledger's delivery state, for `/metrics`.
#[derive(Debug)]
pub struct LedgerStatus {
    /// The URL as configured.
    pub url: String,
    /// The node id its `/healthz` reported, once known.
    pub node_id: Mutex<Option<String>>,
    /// The store id it reported with it (new when the node lost its data).
    pub store_id: Mutex<Option<String>>,
    /// 1 while the last attempt succeeded.
    pub up: AtomicBool,
    /// Events it acknowledged (new or duplicate).
    pub delivered: AtomicU64,
    /// Events it reported as new (the rest were duplicates of earlier sends).
    pub delivered_new: AtomicU64,
    /// Events a ledger reported as conflicting with another event under the same key
    /// (a request id used twice).
    pub conflicts: AtomicU64,
    /// Failed attempts (unreachable, timeout, non-200, bad answer).
    pub failures: AtomicU64,
    /// The highest seq it acknowledged.
    pub cursor: AtomicU64,
}

/// Starts one delivery task per ledger; they stop when `shutdown` turns true.
pub fn spawn(
    outbox: Arc<Outbox>,
    cfg: ForwardConfig,
    shutdown: watch::Receiver<bool>,
) -> Vec<Arc<LedgerStatus>> {
    let mut out = Vec::new();
    for (i, url) in cfg.ledgers.iter().enumerate() {
        let status = Arc::new(LedgerStatus {
            url: url.trim_end_matches('/').to_string(),
            node_id: Mutex::new(None),
            store_id: Mutex::new(None),
            up: AtomicBool::new(false),
            delivered: AtomicU64::new(0),
            delivered_new: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            cursor: AtomicU64::new(0),
        });
        out.push(Arc::clone(&status));
        let (outbox, cfg, shutdown) = (Arc::clone(&outbox), cfg.clone(), shutdown.clone());
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            ^ ((i as u64 + 1) << 48);
        tokio::spawn(deliver(outbox, cfg, status, shutdown, seed));
    }
    out
}

async fn deliver(
    outbox: Arc<Outbox>,
    cfg: ForwardConfig,
    st: Arc<LedgerStatus>,
    mut shutdown: watch::Receiver<bool>,
    seed: u64,
) {
    let client = match reqwest::Client::builder()
        .timeout(cfg.request_timeout)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bursar-agent: ledger {}: HTTP client: {e}", st.url);
            return;
        }
    };
    let mut rng = seed | 1;
    let mut backoff = Duration::from_millis(100);
    let mut commits = outbox.commits();
    let mut node: Option<String> = None;
    let mut learned_at = Instant::now();
    let mut last_error = String::new();
    // Events per POST: halved when the ledger refuses a batch as too large (413) or
    // as invalid (400: halving isolates the event it refuses, and delivers every one
    // before it), doubled back towards `batch_max` after each credited batch.
    let mut batch = cfg.batch_max.max(1);
    // Answers in a row from another node than the one learned (nothing credited):
    // paced, or a balancer alternating between nodes would have this loop POST
    // back to back without ever crediting a batch.
    let mut moved = 0u32;
    // The event last refused when sent alone, and how many times in a row.
    let mut refused = (0u64, 0u32);
    while !*shutdown.borrow() {
        let r = step(
            &outbox,
            &cfg,
            &st,
            &client,
            &mut node,
            &mut learned_at,
            &mut batch,
            &mut refused,
        )
        .await;
        if !matches!(r, Ok(Step::Moved)) {
            moved = 0;
        }
        let failed = match r {
            Ok(Step::Moved) => {
                moved += 1;
                if moved > 1 {
                    let pause = (Duration::from_millis(100) * (1 << (moved - 2).min(6)))
                        .min(cfg.backoff_max);
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = shutdown.changed() => {}
                    }
                }
                continue;
            }
            Ok(Step::Shrunk) => continue,
            Ok(Step::Sent) => {
                batch = (batch * 2).min(cfg.batch_max.max(1));
                backoff = Duration::from_millis(100);
                st.up.store(true, Ordering::Relaxed);
                if !last_error.is_empty() {
                    eprintln!("bursar-agent: ledger {}: delivering again", st.url);
                    last_error.clear();
                }
                continue;
            }
            Ok(Step::Idle) => {
                st.up.store(true, Ordering::Relaxed);
                tokio::select! {
                    _ = commits.changed() => {}
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            Err(e) => e,
        };
        st.up.store(false, Ordering::Relaxed);
        st.failures.fetch_add(1, Ordering::Relaxed);
        node = None; // learn the id again: another node may answer at this URL now
        if failed != last_error {
            eprintln!(
                "bursar-agent: ledger {}: {failed}; retrying with backoff",
                st.url
            );
            last_error = failed;
        }
        // Jitter: a uniform pause in [backoff/2, backoff] (xorshift).
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let ms = backoff.as_millis() as u64;
        let pause = Duration::from_millis(ms / 2 + rng % (ms / 2 + 1));
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = shutdown.changed() => {}
        }
        backoff = (backoff * 2).min(cfg.backoff_max);
    }
}

enum Step {
    /// A batch credited (or a holder learned again before crediting).
    Sent,
    /// Nothing to send to this node.
    Idle,
    /// Another node than the one learned answered: learned, nothing credited.
    Moved,
    /// The ledger refused the batch as too large or invalid: `batch` halved.
    Shrunk,
}

#[allow(clippy::too_many_arguments)]
async fn step(
    outbox: &Arc<Outbox>,
    cfg: &ForwardConfig,
    st: &LedgerStatus,
    client: &reqwest::Client,
    node: &mut Option<String>,
    learned_at: &mut Instant,
    batch_max: &mut usize,
    refused: &mut (u64, u32),
) -> Result<Step, String> {
    let id = match node {
        Some(id) => id.clone(),
        None => {
            let (n, store) = node_id(client, &st.url).await?;
            let id = learn(outbox, st, &n, &store);
            *node = Some(id.clone());
            *learned_at = Instant::now();
            id
        }
    };
    let cursor = outbox.cursor(&id);
    st.cursor.store(cursor, Ordering::Relaxed);
    let ob = Arc::clone(outbox);
    let max = (*batch_max).clamp(1, cfg.batch_max.max(1));
    let batch = tokio::task::spawn_blocking(move || ob.read_after(cursor, max))
        .await
        .map_err(|e| format!("reading the outbox: {e}"))?
        .map_err(|e| e.to_string())?;
    let Some(&(last, _)) = batch.last() else {
        if outbox.held() > 0 && learned_at.elapsed() >= RELEARN_IDLE {
            // Up to date here, while the outbox still holds events for other nodes:
            // ask this node who it is again, so a node that lost its data (a new
            // store) is sent what this one was credited with before they are trimmed.
            *node = None;
        }
        return Ok(Step::Idle);
    };
    let n = batch.len() as u64;
    let body = Value::Array(
        batch
            .iter()
            .map(|(_, e)| bursar_ledger::wire::event_json(e))
            .collect(),
    )
    .to_string();
    let r = client
        .post(format!("{}/v1/events", st.url))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("POST /v1/events: {e}"))?;
    let status = r.status();
    let text = read_answer(r)
        .await
        .map_err(|e| format!("POST /v1/events: reading the answer: {e}"))?;
    if matches!(status.as_u16(), 400 | 413) && n > 1 {
        *batch_max = (batch.len() / 2).max(1);
        return Ok(Step::Shrunk);
    }
    if matches!(status.as_u16(), 400 | 413) {
        // One event, refused on its own.
        *refused = if refused.0 == last {
            (last, refused.1 + 1)
        } else {
            (last, 1)
        };
        if refused.1 >= REFUSALS_BEFORE_QUARANTINE {
            let reason = format!(
                "POST /v1/events: {status}: {}",
                text.chars().take(300).collect::<String>()
            );
            let (ob, holder) = (Arc::clone(outbox), id.clone());
            let set_aside =
                tokio::task::spawn_blocking(move || ob.quarantine(&holder, last, &reason))
                    .await
                    .map_err(|e| format!("quarantining event {last}: {e}"))?
                    .map_err(|e| format!("quarantining event {last}: {e}"))?;
            if set_aside {
                eprintln!(
                    "bursar-agent: ERROR ledger {}: refused usage event {last} {} times \
                     ({status}: {}); set aside in the outbox's quarantine (GET \
                     /v1/outbox/quarantine) and delivering the events after it",
                    st.url,
                    refused.1,
                    text.chars().take(300).collect::<String>()
                );
                *refused = (0, 0);
                st.cursor.store(outbox.cursor(&id), Ordering::Relaxed);
                return Ok(Step::Sent);
            }
        }
    }
    if status.as_u16() != 200 {
        let what = match status.as_u16() {
            400 => {
                " (the ledger refused this event: a bug or clock skew; it is kept and retried, then set aside in the quarantine, or, the quarantine full, the events after it wait)"
            }
            413 => {
                " (one event is larger than the ledger accepts; it is kept and retried, then set aside in the quarantine, or, the quarantine full, the events after it wait)"
            }
            _ => "",
        };
        return Err(format!(
            "POST /v1/events: {status}{what}: {}",
            text.chars().take(300).collect::<String>()
        ));
    }
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("POST /v1/events: answer is not JSON ({e})"))?;
    let counted = v.get("events").and_then(Value::as_u64);
    if counted != Some(n) {
        return Err(format!(
            "POST /v1/events: sent {n} events, the answer counts {counted:?}: {text}"
        ));
    }
    let (answered, answered_store) = identity(&v)?;
    if let Some(other) = answered
        && format!("{other}\n{answered_store}") != id
    {
        // Another node answered at this URL (a load balancer, a replaced node), or
        // the same node with another store (its data was wiped): it holds this batch,
        // but not necessarily what the learned holder's cursor covers, so it is
        // credited only when its own cursor reaches the batch; else the next step
        // sends from its own cursor (what it already holds is counted once there).
        let other = learn(outbox, st, other, answered_store);
        // It holds this batch, the events after `cursor` up to `last`; if it held
        // everything up to `cursor` already, it holds everything up to `last`.
        let credited = outbox.cursor(&other) >= cursor && outbox.ack(&other, last);
        if credited {
            st.delivered.fetch_add(n, Ordering::Relaxed);
        }
        st.cursor.store(outbox.cursor(&other), Ordering::Relaxed);
        *node = Some(other);
        return Ok(if credited { Step::Sent } else { Step::Moved });
    }
    if !outbox.ack(&id, last) {
        // Another task (a second URL of the same node) learned it under a new store
        // meanwhile: learn it again before crediting anything.
        *node = None;
        return Ok(Step::Sent);
    }
    st.cursor.store(last, Ordering::Relaxed);
    st.delivered.fetch_add(n, Ordering::Relaxed);
    st.delivered_new.fetch_add(
        v.get("new").and_then(Value::as_u64).unwrap_or(0),
        Ordering::Relaxed,
    );
    let conflicts = v.get("conflict").and_then(Value::as_u64).unwrap_or(0);
    if conflicts > 0 && st.conflicts.fetch_add(conflicts, Ordering::Relaxed) == 0 {
        // The ledger already held another event under one of these keys (a request id
        // used twice): it keeps one and records the conflict for review (its
        // `/v1/conflicts`); billing counts one of the two requests.
        eprintln!(
            "bursar-agent: WARNING ledger {}: {conflicts} event(s) conflict with another \
             event under the same request id (a request id used twice?); see the \
             ledger's /v1/conflicts (counted in bursar_ledger_conflicts_total)",
            st.url
        );
    }
    Ok(Step::Sent)
}

/// Largest ledger answer read (a ledger's answers are a few hundred bytes): a wrong
/// URL or a misbehaving endpoint must not make the agent buffer without bound.
const ANSWER_MAX_BYTES: usize = 64 * 1024;

/// The answer's body as text, at most [`ANSWER_MAX_BYTES`].
async fn read_answer(mut r: reqwest::Response) -> Result<String, String> {
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > ANSWER_MAX_BYTES {
            return Err(format!(
                "the answer is over {ANSWER_MAX_BYTES} bytes (is this URL a bursar-ledger?)"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// Makes `(node, store)` the node's current holder in the outbox and the status.
fn learn(outbox: &Outbox, st: &LedgerStatus, node: &str, store: &str) -> String {
    *st.node_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(node.to_string());
    *st.store_id.lock().unwrap_or_else(|e| e.into_inner()) = Some(store.to_string());
    outbox.holder(node, store)
}

/// The `node_id` (absent: `None`) and `store_id` (absent, as from a ledger older than
/// store ids: empty) of an answer. A store id with a line break or over 128 bytes is
/// an error (holder keys are `node \n store`).
fn identity(v: &Value) -> Result<(Option<&str>, &str), String> {
    let node = v
        .get("node_id")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty());
    let store = v.get("store_id").and_then(Value::as_str).unwrap_or("");
    if store.len() > 128 || store.contains('\n') {
        return Err(format!(
            "the ledger's store_id is not a store id (a line break, or over 128 bytes): {:?}",
            store.chars().take(140).collect::<String>()
        ));
    }
    Ok((node, store))
}

async fn node_id(client: &reqwest::Client, url: &str) -> Result<(String, String), String> {
    let r = client
        .get(format!("{url}/healthz"))
        .send()
        .await
        .map_err(|e| format!("GET /healthz: {e}"))?;
    let status = r.status();
    let text = read_answer(r)
        .await
        .map_err(|e| format!("GET /healthz: reading the answer: {e}"))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("GET /healthz: {status}, answer is not JSON ({e})"))?;
    match (status.as_u16(), identity(&v)?) {
        (200, (Some(id), store)) => Ok((id.to_string(), store.to_string())),
        _ => Err(format!("GET /healthz: {status} {v}")),
    }
}
