//! The agent's HTTP JSON API (docs/api.md, docs/openapi.yaml).
//!
//! Every body is read as bytes (bounded by [`MAX_BODY_BYTES`]) and parsed strictly:
//! unknown fields, wrong types, negative or fractional numbers and invalid UTF-8 are a
//! 400 with a message that says what was wrong; nothing changes.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AgentState;
use super::headers;
use crate::clock::Clock;
use crate::engine::{AdmitRequest, Completion, Cost, Decision, RejectReason};
use crate::{AdmitError, CompleteError, CompletionStatus, ExtendError, Usage};

/// Largest request body accepted (413 above).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// The API's routes.
pub fn router(state: Arc<AgentState>) -> Router {
    Router::new()
        .route("/v1/admit", post(admit))
        .route("/v1/complete", post(complete))
        .route("/v1/extend", post(extend))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .route(
            "/v1/outbox/quarantine",
            get(quarantine_list).delete(quarantine_clear),
        )
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdmitBody {
    request_id: String,
    #[serde(default)]
    domain: Option<String>,
    #[serde(deserialize_with = "unique_descriptors")]
    descriptors: BTreeMap<String, String>,
    #[serde(default)]
    cost: CostBody,
    #[serde(default)]
    ttl_ms: Option<u64>,
}

/// The descriptors object, refusing a name given twice (`{"org":"a","org":"b"}` was
/// read as `org=b`, silently: which limit a request counts against must not depend on
/// a JSON parser's choice).
fn unique_descriptors<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    struct Unique;
    impl<'de> serde::de::Visitor<'de> for Unique {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object of descriptor names to string values")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut m: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((k, v)) = m.next_entry::<String, String>()? {
                if out.contains_key(&k) {
                    return Err(serde::de::Error::custom(format_args!(
                        "descriptor {k:?} given twice"
                    )));
                }
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Unique)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CostBody {
    #[serde(default = "one")]
    requests: u64,
    #[serde(default)]
    input_tokens: u64,
    /// `max_tokens`: output reserved (capped per rule); absent: each rule's default.
    #[serde(default)]
    output_tokens: Option<u64>,
}

impl Default for CostBody {
    fn default() -> Self {
        CostBody {
            requests: 1,
            input_tokens: 0,
            output_tokens: None,
        }
    }
}

fn one() -> u64 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CompleteBody {
    request_id: String,
    #[serde(default)]
    usage: UsageBody,
    #[serde(default = "ok_status")]
    status: String,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct UsageBody {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    cached_input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
}

fn ok_status() -> String {
    "ok".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExtendBody {
    request_id: String,
    #[serde(default)]
    ttl_ms: Option<u64>,
}

// A Response is the natural error of a handler step; it is built once per bad request.
#[allow(clippy::result_large_err)]
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Response> {
    serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            &format!("malformed body: {e}"),
        )
    })
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        [("content-type", "application/json")],
        json!({ "error": code, "message": message }).to_string(),
    )
        .into_response()
}

fn admit_error(e: &AdmitError) -> Response {
    let (status, code) = match e {
        AdmitError::Invalid(_)
        | AdmitError::CostTooLarge { .. }
        | AdmitError::InvalidTtl { .. } => (StatusCode::BAD_REQUEST, "invalid_request"),
        AdmitError::NoMatchingRule => (StatusCode::FORBIDDEN, "no_matching_rule"),
        AdmitError::TooManyLimits { .. } => (StatusCode::INTERNAL_SERVER_ERROR, "config"),
        AdmitError::KeyTableFull { .. } | AdmitError::LeaseTableFull { .. } => {
            (StatusCode::SERVICE_UNAVAILABLE, "overloaded")
        }
        AdmitError::RequestIdCollision => (StatusCode::CONFLICT, "request_id_collision"),
        AdmitError::RequestIdFinished { .. } => (StatusCode::CONFLICT, "request_id_finished"),
    };
    let mut r = error(status, code, &e.to_string());
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    r
}

fn limits_json(state: &AgentState, d: &Decision) -> Vec<Value> {
    d.limits()
        .iter()
        .map(|l| {
            let rules = state.engine.rules();
            let rule = &rules.rules()[l.rule_index()];
            json!({
                "rule": rule.name,
                "dimension": l.dimension.as_str(),
                "mode": if l.mode == crate::Mode::Shadow { "shadow" } else { "enforce" },
                "cost": l.cost,
                "limit": l.limit(),
                "remaining": l.remaining(),
                "reset_ms": l.reset_after_ns().div_ceil(1_000_000),
                "shadow_rejected": l.shadow_rejected,
            })
        })
        .collect()
}

fn with_headers(mut r: Response, hs: Vec<(&'static str, String)>) -> Response {
    let map: &mut HeaderMap = r.headers_mut();
    for (k, v) in hs {
        if let Ok(v) = HeaderValue::from_str(&v) {
            map.insert(HeaderName::from_static(k), v);
        }
    }
    r
}

async fn admit(State(state): State<Arc<AgentState>>, body: Bytes) -> Response {
    let b: AdmitBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let descriptors: Vec<(&str, &str)> = b
        .descriptors
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let now = state.clock.now_ns();
    let req = AdmitRequest {
        request_id: &b.request_id,
        domain: b.domain.as_deref(),
        descriptors: &descriptors,
        cost: Cost {
            requests: b.cost.requests,
            input_tokens: b.cost.input_tokens,
            max_output_tokens: b.cost.output_tokens,
        },
        ttl_ms: b.ttl_ms,
    };
    // With the durable outbox: a full one refuses new work here too (a check holds
    // nothing and records nothing), so that past its soft bound only leases already in
    // flight can still bring records, which its headroom always takes.
    if !req.cost.is_check()
        && let Some(ob) = state.outbox.get()
        && let Err(e) = ob.check_room()
    {
        return outbox_error(&e);
    }
    let d = match state.engine.admit(now, &req) {
        Ok(d) => d,
        Err(e) => {
            state.counters.errors.fetch_add(1, Ordering::Relaxed);
            return admit_error(&e);
        }
    };
    let hs = headers::for_decision(&state.engine, &d);
    let limits = limits_json(&state, &d);
    let r = match &d {
        Decision::Admitted(a) => {
            state.counters.admitted.fetch_add(1, Ordering::Relaxed);
            (
                StatusCode::OK,
                [("content-type", "application/json")],
                json!({
                    "admitted": true,
                    "request_id": b.request_id,
                    "replayed": a.replayed,
                    "lease_expires_in_ms": a.lease_expires_at_ns
                        .map(|at| at.saturating_sub(now).div_ceil(1_000_000)),
                    "limits": limits,
                })
                .to_string(),
            )
                .into_response()
        }
        Decision::Rejected(r) => {
            state.counters.rejected.fetch_add(1, Ordering::Relaxed);
            let rule = state.engine.rules().rules()[r.rule].name.clone();
            match r.reason {
                RejectReason::NeverFits { cost, burst } => (
                    StatusCode::BAD_REQUEST,
                    [("content-type", "application/json")],
                    json!({
                        "admitted": false,
                        "error": "never_fits",
                        "message": format!(
                            "cost {cost} is above the whole burst {burst} of rule {rule}: it can never be admitted"
                        ),
                        "rule": rule,
                        "cost": cost,
                        "burst": burst,
                        "limits": limits,
                    })
                    .to_string(),
                )
                    .into_response(),
                RejectReason::RetryLater { retry_after_ns } => {
                    let no_budget = headers::no_budget(&d);
                    let status = if no_budget {
                        StatusCode::SERVICE_UNAVAILABLE
                    } else {
                        StatusCode::TOO_MANY_REQUESTS
                    };
                    let secs = headers::retry_after_secs(retry_after_ns);
                    let mut resp = (
                        status,
                        [("content-type", "application/json")],
                        json!({
                            "admitted": false,
                            "error": if no_budget { "no_budget" } else { "rate_limited" },
                            "rule": rule,
                            "retry_after_ms": retry_after_ns.map_or(secs * 1000, |ns| ns.div_ceil(1_000_000)),
                            "limits": limits,
                        })
                        .to_string(),
                    )
                        .into_response();
                    resp.headers_mut()
                        .insert("retry-after", HeaderValue::from(secs));
                    resp
                }
            }
        }
    };
    with_headers(r, hs)
}

async fn complete(State(state): State<Arc<AgentState>>, body: Bytes) -> Response {
    let b: CompleteBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let status = match b.status.as_str() {
        "ok" => CompletionStatus::Ok,
        "upstream_error" => CompletionStatus::UpstreamError,
        "client_gone" => CompletionStatus::ClientGone,
        other => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &format!("status {other:?} is not one of ok, upstream_error, client_gone"),
            );
        }
    };
    let usage = Usage {
        input_tokens: b.usage.input_tokens,
        cached_input_tokens: b.usage.cached_input_tokens,
        output_tokens: b.usage.output_tokens,
    };
    // With the durable outbox: refuse before anything changes when it is full, and
    // answer only once the usage record is committed to the local file.
    let outbox = state.outbox.get();
    if let Some(ob) = outbox
        && let Err(e) = ob.check_room()
    {
        return outbox_error(&e);
    }
    let dropped = outbox.map_or(0, |ob| ob.dropped());
    match state
        .engine
        .complete(state.clock.now_ns(), &b.request_id, usage, status)
    {
        Ok(c) => {
            if let Some(ob) = outbox {
                // The ticket covers every record pushed so far, this one included (and,
                // for a duplicate, the first completion's record if still queued).
                let ticket = ob.ticket();
                if ob.dropped() != dropped {
                    // The lease is settled (a retry answers `duplicate`): saying that
                    // nothing changed, as a full outbox before the completion does,
                    // would hide the lost record.
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "usage_record_lost",
                        "the lease was settled, but a usage record (this one's, or a \
                         concurrent completion's) was dropped at the outbox's hard bound: \
                         more leases were in flight than it holds room for (see \
                         bursar_outbox_events_total{kind=\"dropped\"})",
                    );
                }
                if let Err(e) = ob.durable(ticket).await {
                    return outbox_error(&e);
                }
            }
            let result = match c {
                Completion::Settled => "settled",
                Completion::Late => "late",
                Completion::Duplicate => "duplicate",
            };
            (
                StatusCode::OK,
                [("content-type", "application/json")],
                json!({ "request_id": b.request_id, "result": result }).to_string(),
            )
                .into_response()
        }
        Err(e @ CompleteError::UnknownRequest) => {
            error(StatusCode::NOT_FOUND, "unknown_request", &e.to_string())
        }
        Err(e) => error(StatusCode::BAD_REQUEST, "invalid_request", &e.to_string()),
    }
}

/// 503 for an outbox that is full (`outbox_full`: nothing changed) or slow to commit
/// (`outbox_unavailable`: settled, record queued; a retry answers `duplicate` once it
/// is durable).
fn outbox_error(e: &super::outbox::OutboxError) -> Response {
    let code = match e {
        super::outbox::OutboxError::Full { .. } => "outbox_full",
        _ => "outbox_unavailable",
    };
    let mut r = error(StatusCode::SERVICE_UNAVAILABLE, code, &e.to_string());
    r.headers_mut()
        .insert("retry-after", HeaderValue::from_static("1"));
    r
}

async fn extend(State(state): State<Arc<AgentState>>, body: Bytes) -> Response {
    let b: ExtendBody = match parse(&body) {
        Ok(b) => b,
        Err(r) => return r,
    };
    let now = state.clock.now_ns();
    match state.engine.extend(now, &b.request_id, b.ttl_ms) {
        Ok(at) => (
            StatusCode::OK,
            [("content-type", "application/json")],
            json!({
                "request_id": b.request_id,
                "lease_expires_in_ms": at.saturating_sub(now).div_ceil(1_000_000),
            })
            .to_string(),
        )
            .into_response(),
        Err(e @ ExtendError::NotLive) => error(StatusCode::NOT_FOUND, "not_live", &e.to_string()),
        Err(e) => error(StatusCode::BAD_REQUEST, "invalid_request", &e.to_string()),
    }
}

/// `GET /v1/outbox/quarantine`: the usage events a ledger refused on their own and
/// the outbox set aside, one JSON object per line (oldest first; at most
/// `OutboxConfig::quarantine_max`). 404 without an outbox.
async fn quarantine_list(State(state): State<Arc<AgentState>>) -> Response {
    let ob = match outbox_of(&state) {
        Ok(ob) => ob,
        Err(r) => return r,
    };
    match on_outbox(ob, |ob| ob.quarantined(usize::MAX)).await {
        Ok(lines) => {
            let mut body = String::new();
            for l in lines {
                body.push_str(&l);
                body.push('\n');
            }
            (
                StatusCode::OK,
                [("content-type", "application/x-ndjson")],
                body,
            )
                .into_response()
        }
        Err(r) => r,
    }
}

/// The agent's outbox, or the 404 that says it keeps none (the answer, as `parse`'s).
#[allow(clippy::result_large_err)]
fn outbox_of(state: &AgentState) -> Result<Arc<super::outbox::Outbox>, Response> {
    state.outbox.get().cloned().ok_or_else(|| {
        error(
            StatusCode::NOT_FOUND,
            "no_outbox",
            "this agent keeps no usage outbox (--outbox-dir)",
        )
    })
}

/// Runs `f` (file I/O) on the blocking pool; a failure is a 500 naming the outbox.
async fn on_outbox<T: Send + 'static>(
    ob: Arc<super::outbox::Outbox>,
    f: impl FnOnce(&super::outbox::Outbox) -> Result<T, super::outbox::OutboxError> + Send + 'static,
) -> Result<T, Response> {
    let fail = |e: String| error(StatusCode::INTERNAL_SERVER_ERROR, "outbox", &e);
    match tokio::task::spawn_blocking(move || f(&ob)).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(fail(e.to_string())),
        Err(e) => Err(fail(e.to_string())),
    }
}

/// `DELETE /v1/outbox/quarantine?through_seq=N`: forgets the quarantined events with
/// seq up to `N` (replayed or written off by an operator); answers how many.
async fn quarantine_clear(State(state): State<Arc<AgentState>>, uri: axum::http::Uri) -> Response {
    let ob = match outbox_of(&state) {
        Ok(ob) => ob,
        Err(r) => return r,
    };
    if !ob.quarantine_clear_over_http() {
        return error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "clearing the quarantine over HTTP is off: start the agent with \
             --outbox-quarantine-clear (anyone who reaches this port could erase billing \
             records)",
        );
    }
    let through = uri.query().unwrap_or("").split('&').find_map(|kv| {
        kv.strip_prefix("through_seq=")
            .map(|v| v.parse::<u64>().map_err(|_| v.to_string()))
    });
    let through = match through {
        Some(Ok(n)) => n,
        Some(Err(v)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                &format!("through_seq must be a whole number, not {v:?}"),
            );
        }
        None => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request",
                "through_seq is required: the highest seq to forget (see GET)",
            );
        }
    };
    match on_outbox(ob, move |ob| ob.clear_quarantine(through)).await {
        Ok(n) => (
            StatusCode::OK,
            [("content-type", "application/json")],
            json!({ "removed": n }).to_string(),
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn metrics(State(state): State<Arc<AgentState>>) -> Response {
    let mut out = String::with_capacity(2048);
    out.push_str("# HELP bursar_decisions_total Admission decisions by result.\n");
    out.push_str("# TYPE bursar_decisions_total counter\n");
    let c = &state.counters;
    for (result, v) in [
        ("admitted", &c.admitted),
        ("rejected", &c.rejected),
        ("error", &c.errors),
    ] {
        out.push_str(&format!(
            "bursar_decisions_total{{result=\"{result}\"}} {}\n",
            v.load(Ordering::Relaxed)
        ));
    }
    let stats = state.engine.stats();
    out.push_str(
        "# HELP bursar_admitted_units_total Units admitted per rule (tokens, requests or slots).\n",
    );
    out.push_str("# TYPE bursar_admitted_units_total counter\n");
    for s in &stats {
        out.push_str(&format!(
            "bursar_admitted_units_total{{rule=\"{}\"}} {}\n",
            s.rule, s.admitted
        ));
    }
    out.push_str("# HELP bursar_rejected_units_total Units rejected per rule (shadow rules: would have rejected).\n");
    out.push_str("# TYPE bursar_rejected_units_total counter\n");
    for s in &stats {
        out.push_str(&format!(
            "bursar_rejected_units_total{{rule=\"{}\"}} {}\n",
            s.rule, s.rejected
        ));
    }
    out.push_str("# HELP bursar_blocked_units_total Units of requests matching the rule that another rule rejected (demand all the same).\n");
    out.push_str("# TYPE bursar_blocked_units_total counter\n");
    for s in &stats {
        out.push_str(&format!(
            "bursar_blocked_units_total{{rule=\"{}\"}} {}\n",
            s.rule, s.blocked
        ));
    }
    out.push_str("# HELP bursar_keys Limit keys held per rule.\n# TYPE bursar_keys gauge\n");
    for s in &stats {
        out.push_str(&format!("bursar_keys{{rule=\"{}\"}} {}\n", s.rule, s.keys));
    }
    out.push_str("# HELP bursar_rules_info The rules in force: their version, as agents and the allocator compare it.\n# TYPE bursar_rules_info gauge\n");
    out.push_str(&format!(
        "bursar_rules_info{{version=\"{}\"}} 1\n",
        super::sync::config_version(&state.engine)
    ));
    out.push_str("# HELP bursar_rules_reloads_total Rules reloads (SIGHUP) applied and refused.\n# TYPE bursar_rules_reloads_total counter\n");
    out.push_str(&format!(
        "bursar_rules_reloads_total{{result=\"applied\"}} {}\nbursar_rules_reloads_total{{result=\"refused\"}} {}\n",
        state.engine.reloads(),
        c.reloads_refused.load(Ordering::Relaxed)
    ));
    out.push_str(
        "# HELP bursar_leases_in_flight Reservations held.\n# TYPE bursar_leases_in_flight gauge\n",
    );
    out.push_str(&format!(
        "bursar_leases_in_flight {}\n",
        state.engine.leases_in_flight()
    ));
    if let Some(sync) = state.sync.get() {
        out.push_str("# HELP bursar_sync_connected 1 while a stream to the allocator is up.\n# TYPE bursar_sync_connected gauge\n");
        out.push_str(&format!(
            "bursar_sync_connected {}\n",
            sync.connected.load(Ordering::Relaxed) as u8
        ));
        out.push_str("# HELP bursar_sync_term The allocator's term from the last welcome.\n# TYPE bursar_sync_term gauge\n");
        out.push_str(&format!(
            "bursar_sync_term {}\n",
            sync.term.load(Ordering::Relaxed)
        ));
        out.push_str("# HELP bursar_sync_events_total Allocator sync events by kind.\n# TYPE bursar_sync_events_total counter\n");
        for (kind, v) in [
            ("connect", &sync.connects),
            ("grant_applied", &sync.grants_applied),
            ("grant_refused", &sync.grants_refused),
            ("extension_applied", &sync.extensions_applied),
            ("extension_refused", &sync.extensions_refused),
            ("report_sent", &sync.reports_sent),
            ("ack_sent", &sync.acks_sent),
            ("slice_revoked", &sync.slices_revoked),
            ("stale_term", &sync.stale_terms),
            ("unknown_handle", &sync.unknown_handles),
            ("dropped", &sync.dropped),
        ] {
            out.push_str(&format!(
                "bursar_sync_events_total{{kind=\"{kind}\"}} {}\n",
                v.load(Ordering::Relaxed)
            ));
        }
    }
    if let Some(ob) = state.outbox.get() {
        outbox_metrics(&mut out, ob, state.ledgers.get().map_or(&[][..], |v| v));
    }
    (
        StatusCode::OK,
        [("content-type", "text/plain; version=0.0.4")],
        out,
    )
        .into_response()
}

fn outbox_metrics(
    out: &mut String,
    ob: &super::outbox::Outbox,
    ledgers: &[Arc<super::forward::LedgerStatus>],
) {
    let s = ob.stats();
    out.push_str("# HELP bursar_outbox_pending_events Usage events held locally until enough ledgers hold them (in the file plus queued).\n# TYPE bursar_outbox_pending_events gauge\n");
    out.push_str(&format!("bursar_outbox_pending_events {}\n", ob.held()));
    out.push_str("# HELP bursar_outbox_queued_records Records waiting for the outbox writer.\n# TYPE bursar_outbox_queued_records gauge\n");
    out.push_str(&format!("bursar_outbox_queued_records {}\n", ob.queued()));
    out.push_str("# HELP bursar_outbox_last_seq Highest event sequence number written.\n# TYPE bursar_outbox_last_seq gauge\n");
    out.push_str(&format!("bursar_outbox_last_seq {}\n", ob.last_seq()));
    out.push_str("# HELP bursar_outbox_quarantined_events Usage events a ledger refused on their own, set aside for an operator (GET /v1/outbox/quarantine).\n# TYPE bursar_outbox_quarantined_events gauge\n");
    out.push_str(&format!(
        "bursar_outbox_quarantined_events {}\n",
        ob.quarantine_held()
    ));
    out.push_str("# HELP bursar_outbox_events_total Outbox events by what happened to them.\n# TYPE bursar_outbox_events_total counter\n");
    for (kind, v) in [
        ("committed", &s.committed),
        ("trimmed", &s.trimmed),
        ("dropped", &s.dropped),
        ("invalid", &s.invalid),
        ("time_clamped", &s.time_clamped),
        ("time_shifted", &s.time_shifted),
        ("quarantined", &s.quarantined),
    ] {
        out.push_str(&format!(
            "bursar_outbox_events_total{{kind=\"{kind}\"}} {}\n",
            v.load(Ordering::Relaxed)
        ));
    }
    out.push_str("# HELP bursar_outbox_commits_total Outbox write transactions by result.\n# TYPE bursar_outbox_commits_total counter\n");
    out.push_str(&format!(
        "bursar_outbox_commits_total{{result=\"ok\"}} {}\nbursar_outbox_commits_total{{result=\"failed\"}} {}\n",
        s.commits.load(Ordering::Relaxed),
        s.commit_failures.load(Ordering::Relaxed)
    ));
    out.push_str("# HELP bursar_outbox_refused_total Completions answered 503 by the outbox.\n# TYPE bursar_outbox_refused_total counter\n");
    out.push_str(&format!(
        "bursar_outbox_refused_total{{reason=\"full\"}} {}\nbursar_outbox_refused_total{{reason=\"not_durable\"}} {}\n",
        s.refused_full.load(Ordering::Relaxed),
        s.not_durable.load(Ordering::Relaxed)
    ));
    type Read = fn(&super::forward::LedgerStatus) -> u64;
    let rows: [(&str, &str, &str, Read); 5] = [
        (
            "bursar_ledger_up",
            "gauge",
            "1 while the last delivery attempt to this ledger succeeded.",
            |l| l.up.load(Ordering::Relaxed) as u64,
        ),
        (
            "bursar_ledger_delivered_events_total",
            "counter",
            "Events a ledger acknowledged (durably committed), new or duplicate.",
            |l| l.delivered.load(Ordering::Relaxed),
        ),
        (
            "bursar_ledger_conflicts_total",
            "counter",
            "Delivered events the ledger found in conflict with another event under the same request id.",
            |l| l.conflicts.load(Ordering::Relaxed),
        ),
        (
            "bursar_ledger_failures_total",
            "counter",
            "Failed delivery attempts.",
            |l| l.failures.load(Ordering::Relaxed),
        ),
        (
            "bursar_ledger_cursor",
            "gauge",
            "Highest outbox seq this ledger acknowledged.",
            |l| l.cursor.load(Ordering::Relaxed),
        ),
    ];
    for (name, kind, help, read) in rows {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for l in ledgers {
            out.push_str(&format!("{name}{{ledger=\"{}\"}} {}\n", l.url, read(l)));
        }
    }
}
