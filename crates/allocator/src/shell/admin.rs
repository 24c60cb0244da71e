//! The JSON admin endpoint.
//!
//! - `GET /v1/keys`: per key, the limit, summed demand, committed budget, each agent's
//!   grant (demand, granted, committed, partition fallback) and the overshoot bound.
//! - `GET /v1/status`: term, learning, agents, keys, shell counters, and `config`: the
//!   rules in force, their version, and reloads (count, last error, last change).
//! - `GET /healthz`: `ok`.
//! - `POST /v1/admin/reload`: re-reads the rules file (as SIGHUP does). 200 with the
//!   new version and what changed; 422 with the error (naming file, rule and field)
//!   when the file is refused, the rules in force unchanged; 409 when the allocator
//!   runs on embedded rules. The only request that changes anything; it takes no input
//!   (the file is the one given at start), so it can do no more than SIGHUP can. Bind
//!   the admin address to loopback or a private network.
//!
//! Every request asks the core task for a snapshot (or a reload) over the bounded input
//! channel (it never reads the core directly); at most `admin_max_keys` keys are listed.

use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use super::driver::{Input, Snapshot};
use crate::{KeyStatus, Slice};

/// Shared state of the admin endpoint.
pub struct Admin {
    inputs: mpsc::Sender<Input>,
    rules_path: Option<PathBuf>,
}

impl Admin {
    /// Admin over the core task's input channel; reloads re-read `rules_path`.
    pub fn new(inputs: mpsc::Sender<Input>, rules_path: Option<PathBuf>) -> Admin {
        Admin { inputs, rules_path }
    }

    async fn snapshot(&self) -> Option<Snapshot> {
        let (reply, answer) = oneshot::channel();
        self.inputs.send(Input::Snapshot { reply }).await.ok()?;
        answer.await.ok()
    }
}

/// The admin router.
pub fn router(admin: Arc<Admin>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/keys", get(keys))
        .route("/v1/status", get(status))
        .route("/v1/admin/reload", post(reload))
        .with_state(admin)
}

/// 200 while the core task runs; 503 once it stopped (a panic in it).
async fn healthz(State(admin): State<Arc<Admin>>) -> Response {
    if admin.inputs.is_closed() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the core task has stopped\n",
        )
            .into_response()
    } else {
        "ok".into_response()
    }
}

fn json_response(v: Value) -> Response {
    (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "the allocator is shutting down",
    )
        .into_response()
}

fn slice(s: Slice) -> Value {
    json!({ "rate": s.rate, "burst": s.burst })
}

/// One key as JSON.
pub fn key_json(k: &KeyStatus) -> Value {
    json!({
        "key": k.key.to_string(),
        "rule": k.key.rule,
        "values": k.key.values,
        "limit": slice(k.limit),
        "rate_capacity": k.rate_capacity,
        "demand": k.demand,
        "committed": slice(k.committed),
        "transfer_pool": k.transfer_pool,
        "concentrated": k.concentrated,
        "bound": {
            "rate": k.bound.rate,
            "burst": k.bound.burst,
            "overdraft_rate": k.bound.overdraft_rate,
            "partitioned_agents": k.bound.partitioned_agents,
            "period_ns": k.bound.period_ns,
        },
        "agents": k.agents.iter().map(|a| json!({
            "agent": &*a.agent,
            "demand": a.demand,
            "slow_demand": a.slow_demand,
            "granted": slice(a.granted),
            "committed": slice(a.committed),
            "fallback": a.fallback.map(slice),
        })).collect::<Vec<_>>(),
    })
}

fn status_json(s: &Snapshot) -> Value {
    let c = &s.counters;
    json!({
        "term": s.term,
        "learning": s.learning,
        "agents": s.agents,
        "connected": s.connected,
        "keys": s.key_count,
        "counters": {
            "hellos": c.hellos,
            "hellos_refused": c.hellos_refused,
            "reports": c.reports,
            "acks": c.acks,
            "refused": c.refused,
            "grants_sent": c.grants_sent,
            "grants_dropped": c.grants_dropped,
            "extensions_sent": c.extensions_sent,
            "extensions_dropped": c.extensions_dropped,
            "measures_sent": c.measures_sent,
            "measures_dropped": c.measures_dropped,
            "unknown_handles_sent": c.unknown_handles_sent,
            "unknown_handles_dropped": c.unknown_handles_dropped,
            "revocations_sent": c.revocations_sent,
            "revocations_dropped": c.revocations_dropped,
            "agents_evicted": s.agents_evicted,
            "streams_refused": s.gate.streams_refused,
            "connections_refused": s.gate.connections_refused,
            "connections_silent": s.gate.connections_silent,
            "input_bytes_waits": s.gate.input_bytes_waits,
        },
        "input": {
            "bytes_max": s.gate.input_bytes_max,
            "bytes_queued": s.gate.input_bytes_queued,
            "pending_hellos_max": s.gate.pending_hellos_max,
            "pending_hellos": s.gate.pending_hellos,
            "connections_max": s.gate.connections_max,
            "connections_open": s.gate.connections_open,
        },
        "last_error": s.last_error,
        "config": {
            "version": s.config_version,
            "path": s.reload.path,
            "reloads": s.reload.applied,
            "reloads_failed": s.reload.failed,
            "last_reload_error": s.reload.last_error,
            "last_reload": s.reload.last_applied,
            "versions_sent": s.reload.versions_sent,
            "ignored_lines": s.ignored_lines,
            "rules": s.rules.iter().map(|r| json!({
                "name": r.name,
                "limit": slice(r.limit),
                "rate_capacity": r.rate_capacity,
                "period_ns": r.period_ns,
                "concurrency": r.concurrency,
                "posture": format!("{:?}", r.posture).to_lowercase(),
            })).collect::<Vec<_>>(),
        },
    })
}

async fn keys(State(admin): State<Arc<Admin>>) -> Response {
    let Some(s) = admin.snapshot().await else {
        return unavailable();
    };
    let mut v = status_json(&s);
    v["truncated"] = json!(s.truncated);
    v["keys"] = json!(s.keys.iter().map(key_json).collect::<Vec<_>>());
    v["key_count"] = json!(s.key_count);
    json_response(v)
}

async fn status(State(admin): State<Arc<Admin>>) -> Response {
    match admin.snapshot().await {
        Some(s) => json_response(status_json(&s)),
        None => unavailable(),
    }
}

async fn reload(State(admin): State<Arc<Admin>>) -> Response {
    if admin.rules_path.is_none() {
        return (
            StatusCode::CONFLICT,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json!({
                "ok": false,
                "error": "no rules file: the allocator runs on its embedded rules (start it with --config FILE to reload)",
            })
            .to_string(),
        )
            .into_response();
    }
    match super::reload_via(&admin.inputs, admin.rules_path.as_deref()).await {
        None => unavailable(),
        Some(Ok(r)) => json_response(json!({
            "ok": true,
            "version": r.version,
            "previous_version": r.previous_version,
            "changed": !r.summary.is_empty(),
            "summary": r.summary.to_string(),
            "added": r.summary.added,
            "changed_rules": r.summary.changed,
            "replaced": r.summary.replaced,
            "removed": r.summary.removed,
        })),
        Some(Err(e)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json!({ "ok": false, "error": e }).to_string(),
        )
            .into_response(),
    }
}
