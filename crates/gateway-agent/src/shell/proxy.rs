//! An OpenAI-compatible reverse proxy: `/v1/chat/completions`, `/v1/completions`,
//! `/v1/embeddings` in front of an upstream that speaks the same schema.
//!
//! Per request: the tenant comes from the bearer key (only its SHA-256 is configured,
//! `[[api_key]]`); input tokens are counted offline with `tiktoken-rs` (for a model it
//! does not know, a conservative estimate of one token per two bytes); the engine
//! reserves input plus `min(max_tokens, cap)` (each rule's default cap when absent); the
//! request is forwarded, a stream passed through chunk by chunk as it arrives; the lease
//! is settled from the response's `usage`, from the final chunk of a stream (the proxy
//! asks for it with `stream_options.include_usage`), or by counting the streamed text
//! when the upstream reports none. A client that disconnects mid-stream is settled with
//! what was generated so far; an upstream error settles with zero usage, which releases
//! the reservation. Every settlement goes to the usage sink.
//!
//! Upstreams are plain HTTP (no TLS stack is compiled in): run the proxy beside the
//! model server or a local gateway. The client's `Authorization` header is forwarded,
//! unless `BURSAR_UPSTREAM_API_KEY` is set, which replaces it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::StreamExt;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::AgentState;
use super::headers;
use crate::clock::Clock;
use crate::config::ApiKey;
use crate::config::{Dimension, MAX_COST};
use crate::engine::{AdmitRequest, Cost, Decision, RejectReason};
use crate::{AdmitError, CompletionStatus, Usage};

/// Proxy settings.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Largest request body (413 above). Default 4 MiB.
    pub max_body_bytes: usize,
    /// Time allowed to receive the whole request body (408 after). Default 30 s.
    pub body_timeout: Duration,
    /// Time allowed to connect to the upstream and receive its response head (504
    /// after). Default 60 s.
    pub upstream_timeout: Duration,
    /// Largest non-streamed upstream response read. Default 32 MiB.
    pub max_response_bytes: usize,
    /// Longest silence of the upstream once it has answered: between two chunks of
    /// its body (a stream's tokens included). After it, the request is settled as
    /// broken off (a non-streamed answer: 504; a stream ends with an error). Without
    /// it, an upstream that stalled with its connection open kept the reservation for
    /// ever: the proxy extends the lease while it waits. Default 120 s.
    pub upstream_idle_timeout: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            max_body_bytes: 4 << 20,
            body_timeout: Duration::from_secs(30),
            upstream_timeout: Duration::from_secs(60),
            max_response_bytes: 32 << 20,
            upstream_idle_timeout: Duration::from_secs(120),
        }
    }
}

struct Proxy {
    agent: Arc<AgentState>,
    upstream: String,
    client: reqwest::Client,
    keys: HashMap<[u8; 32], Vec<(String, String)>>,
    cfg: ProxyConfig,
    ids: AtomicU64,
    /// A random prefix for this proxy's request ids: they become ledger event keys,
    /// so they must not repeat across agents or restarts (`px-{pid}-{n}` did: every
    /// agent in a container is pid 1).
    id_prefix: String,
    upstream_key: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Chat,
    Completions,
    Embeddings,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completions => "/v1/completions",
            Kind::Embeddings => "/v1/embeddings",
        }
    }
}

/// The proxy's routes.
pub fn router(
    agent: Arc<AgentState>,
    upstream: String,
    keys: Vec<ApiKey>,
    cfg: ProxyConfig,
) -> Router {
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()
        .expect("an HTTP client with no TLS always builds");
    let proxy = Arc::new(Proxy {
        agent,
        upstream: upstream.trim_end_matches('/').to_string(),
        client,
        keys: keys
            .into_iter()
            .map(|k| (k.sha256, k.descriptors))
            .collect(),
        cfg,
        ids: AtomicU64::new(0),
        id_prefix: {
            use std::hash::BuildHasher;
            let nonce = std::collections::hash_map::RandomState::new()
                .hash_one((std::process::id(), std::time::SystemTime::now()));
            format!("px-{nonce:016x}")
        },
        upstream_key: std::env::var("BURSAR_UPSTREAM_API_KEY").ok(),
    });
    Router::new()
        .route(
            "/v1/chat/completions",
            post(|s, r| handle(s, r, Kind::Chat)),
        )
        .route(
            "/v1/completions",
            post(|s, r| handle(s, r, Kind::Completions)),
        )
        .route(
            "/v1/embeddings",
            post(|s, r| handle(s, r, Kind::Embeddings)),
        )
        .with_state(proxy)
}

fn openai_error(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    (
        status,
        [("content-type", "application/json")],
        json!({ "error": { "message": message, "type": kind, "code": code } }).to_string(),
    )
        .into_response()
}

/// SHA-256 of a bearer key, as `[[api_key]] sha256` wants it (hex).
pub fn key_hash_hex(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Longest run of non-whitespace bytes the tokenizer is given: its byte-pair merge is
/// quadratic in the length of one piece, and one letter repeated 4 MiB times is one
/// piece (about 10^13 steps: a client could stall a worker for hours). Longer runs are
/// counted by the conservative estimate of unknown models (half their bytes); the
/// upstream's usage settles the real count.
const TOKENIZER_RUN_MAX: usize = 256;

/// Input tokens of a text for `model`.
pub fn count_tokens(model: &str, text: &str) -> u64 {
    let mut long = 0u64;
    let mut kept: Option<String> = None;
    let mut start = None;
    let bytes = text.as_bytes();
    for i in 0..=bytes.len() {
        let space = i == bytes.len() || bytes[i].is_ascii_whitespace();
        match (start, space) {
            (None, false) => start = Some(i),
            (Some(s), true) => {
                if i - s > TOKENIZER_RUN_MAX {
                    // Runs end at ASCII whitespace: char boundaries.
                    let k = kept.get_or_insert_with(|| text[..s].to_string());
                    k.push(' ');
                    long += ((i - s) as u64).div_ceil(2);
                } else if let Some(k) = kept.as_mut() {
                    k.push_str(&text[s..i]);
                }
                start = None;
            }
            _ => {}
        }
        if space
            && i < bytes.len()
            && let Some(k) = kept.as_mut()
        {
            k.push(bytes[i] as char);
        }
    }
    long + count_tokens_exact(model, kept.as_deref().unwrap_or(text))
}

/// [`count_tokens`] for a text without overlong runs.
fn count_tokens_exact(model: &str, text: &str) -> u64 {
    use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
    let bpe = match get_tokenizer(model) {
        Some(Tokenizer::O200kBase) => tiktoken_rs::o200k_base_singleton(),
        Some(Tokenizer::Cl100kBase) => tiktoken_rs::cl100k_base_singleton(),
        Some(Tokenizer::P50kBase) => tiktoken_rs::p50k_base_singleton(),
        Some(Tokenizer::P50kEdit) => tiktoken_rs::p50k_edit_singleton(),
        Some(Tokenizer::R50kBase | Tokenizer::Gpt2) => tiktoken_rs::r50k_base_singleton(),
        // Unknown model: a conservative estimate (real vocabularies average ~4 bytes
        // per token on English text); usage reported by the upstream corrects it.
        _ => return (text.len() as u64).div_ceil(2),
    };
    bpe.encode_with_special_tokens(text).len() as u64
}

/// Collects the text of a prompt or content value into `out`, and counts the token ids
/// it holds in `ids`: OpenAI's completions and embeddings take a prompt as token ids
/// (`[1234, 5678]`, or a list of such lists), each one token.
fn text_of(v: &Value, out: &mut String, ids: &mut u64) {
    match v {
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        Value::Number(_) => *ids += 1,
        Value::Array(items) => items.iter().for_each(|i| text_of(i, out, ids)),
        Value::Object(o) => {
            // Content parts: {"type": "text", "text": "..."}; other parts (images,
            // audio) are not counted here: the upstream's usage settles them.
            if let Some(t) = o.get("text") {
                text_of(t, out, ids);
            }
        }
        _ => {}
    }
}

/// The text of a request body to count, and the tokens counted without it: token ids
/// given as numbers, and per OpenAI's accounting for chat, each message's ~4 tokens of
/// framing and the reply's 3 of priming (each message costs its content, role and name).
fn input_text(kind: Kind, body: &Value) -> (String, u64) {
    let mut text = String::new();
    let mut ids = 0u64;
    match kind {
        Kind::Chat => {
            let mut framing = 3u64;
            if let Some(msgs) = body.get("messages").and_then(Value::as_array) {
                for m in msgs {
                    framing += 4;
                    if let Some(role) = m.get("role") {
                        text_of(role, &mut text, &mut ids);
                    }
                    if let Some(c) = m.get("content") {
                        text_of(c, &mut text, &mut ids);
                    }
                    if let Some(n) = m.get("name") {
                        text_of(n, &mut text, &mut ids);
                    }
                }
            }
            return (text, ids + framing);
        }
        Kind::Completions => {
            if let Some(p) = body.get("prompt") {
                text_of(p, &mut text, &mut ids);
            }
        }
        Kind::Embeddings => {
            if let Some(p) = body.get("input") {
                text_of(p, &mut text, &mut ids);
            }
        }
    }
    (text, ids)
}

/// Input tokens of a request body ([`input_text`] counted).
#[cfg(test)]
fn input_tokens(kind: Kind, model: &str, body: &Value) -> u64 {
    let (text, extra) = input_text(kind, body);
    count_tokens(model, &text) + extra
}

/// Texts longer than this are counted on the blocking pool, not on the request's
/// worker thread (4 MiB of prose takes the tokenizer a good fraction of a second).
const COUNT_INLINE_MAX: usize = 64 << 10;

fn usage_of(v: &Value) -> Option<Usage> {
    let u = v.get("usage")?;
    if u.is_null() {
        return None;
    }
    // Clamped to what the engine accepts: a completion it refused (an absurd count
    // from the upstream) would leave the lease to expire, with no record until then.
    let n = |k: &str| u.get(k).and_then(Value::as_u64).map(|v| v.min(MAX_COST));
    let input = n("prompt_tokens")?;
    Some(Usage {
        input_tokens: input,
        cached_input_tokens: u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
            .min(input),
        output_tokens: n("completion_tokens").unwrap_or(0),
    })
}

/// What a choice (or a stream chunk's choice) generated, as text to count when the
/// upstream reports no usage: its content, and also what a model generates besides
/// content (tool and function call names and arguments, a refusal, reasoning text),
/// which are output tokens too.
fn generated_text(v: &Value, out: &mut String) {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return;
    };
    let mut push = |x: Option<&Value>| {
        if let Some(s) = x.and_then(Value::as_str) {
            out.push_str(s);
        }
    };
    for c in choices {
        push(c.get("text"));
        for m in ["delta", "message"].iter().filter_map(|k| c.get(*k)) {
            for field in ["content", "refusal", "reasoning_content", "reasoning"] {
                push(m.get(field));
            }
            let calls = m.get("tool_calls").and_then(Value::as_array);
            let functions = calls
                .into_iter()
                .flatten()
                .filter_map(|t| t.get("function"))
                .chain(m.get("function_call"));
            for f in functions {
                push(f.get("name"));
                push(f.get("arguments"));
            }
        }
    }
}

/// Settles a lease exactly once: explicitly at the end of a response, or on drop (the
/// client went away mid-stream) with what was generated so far. Keeps the lease alive
/// meanwhile ([`keeping_lease`]).
struct Settle {
    agent: Arc<AgentState>,
    id: String,
    model: String,
    input: u64,
    /// Output tokens reserved (the most any output rule took, else what the request
    /// asked for): charged when what the upstream generated cannot be known.
    reserved_output: u64,
    usage: Option<Usage>,
    text: String,
    done: bool,
    /// Held while this request is in flight: its keeper task
    /// ([`Settle::keep_while_alive`]) holds it weakly.
    alive: Arc<()>,
}

/// Generated text kept for counting when the upstream reports no usage.
const MAX_COUNTED_TEXT: usize = 8 << 20;

/// Most choices (`n`) or candidates (`best_of`) a request may ask for (OpenAI's own
/// bound on `n`).
const MAX_CHOICES: u64 = 128;

impl Settle {
    fn finish(&mut self, status: CompletionStatus) {
        if self.done {
            return;
        }
        self.done = true;
        let usage = match self.usage {
            // Cut short (the client gone, the upstream broken off) after a usage chunk:
            // that chunk may have counted less than was streamed (an early one counts
            // the prompt alone), so the text streamed is the floor of the output.
            Some(mut u) if status != CompletionStatus::Ok && !self.text.is_empty() => {
                u.output_tokens = u.output_tokens.max(count_tokens(&self.model, &self.text));
                u
            }
            Some(u) => u,
            None => Usage {
                input_tokens: self.input,
                cached_input_tokens: 0,
                output_tokens: count_tokens(&self.model, &self.text),
            },
        };
        let _ = self
            .agent
            .engine
            .complete(self.agent.clock.now_ns(), &self.id, usage, status);
    }

    fn release(&mut self) {
        self.usage = Some(Usage::default());
        self.finish(CompletionStatus::UpstreamError);
    }

    /// The upstream answered 200 but the proxy could not read what it generated (a
    /// body over the response bound, or one that broke off): the upstream did the work,
    /// so the estimate of the prompt and the output reserved are charged.
    fn charge_reserved(&mut self) {
        self.usage = Some(Usage {
            input_tokens: self.input,
            cached_input_tokens: 0,
            output_tokens: self.reserved_output,
        });
        self.finish(CompletionStatus::UpstreamError);
    }

    /// Extends the lease every third of the TTL (`every`) from a task of its own, for
    /// as long as this guard lives and the lease is live: a generation longer than the
    /// TTL (a long stream, a slow reasoning model) would otherwise have its lease
    /// expire mid-flight and give back its concurrency slot while the upstream still
    /// works. From a task, not from the request's own awaits: a stream's body is
    /// polled only when its client reads, and one that stopped reading let the lease
    /// expire while the upstream connection stayed open (a tenant past its
    /// `max_in_flight` by opening streams and not reading them).
    fn keep_while_alive(&self, every: Duration) {
        let alive = Arc::downgrade(&self.alive);
        let agent = Arc::clone(&self.agent);
        let id = self.id.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if alive.upgrade().is_none() {
                    return;
                }
                if agent
                    .engine
                    .extend(agent.clock.now_ns(), &id, None)
                    .is_err()
                {
                    // Settled or expired: nothing to keep.
                    return;
                }
            }
        });
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        self.finish(CompletionStatus::ClientGone);
    }
}

/// Incremental SSE parsing of a passing stream: lines of `data: {json}`.
struct SseTap {
    buf: Vec<u8>,
}

impl SseTap {
    /// Reads the complete lines `chunk` ends, keeping a partial last one. Only the new
    /// bytes are searched for line ends, and the lines read are removed once: a long
    /// line arriving in small chunks was searched from its start at every chunk and
    /// each line shifted the rest (quadratic: ~4 GB of scanning for one 8 MiB line in
    /// 8 KiB chunks).
    fn feed(&mut self, chunk: &[u8], settle: &mut Settle) {
        // What is held has no line end: it was all read up to its last one.
        let mut from = self.buf.len();
        self.buf.extend_from_slice(chunk);
        let mut start = 0;
        while let Some(off) = self.buf[from..].iter().position(|&b| b == b'\n') {
            let nl = from + off;
            sse_line(&self.buf[start..nl], settle);
            start = nl + 1;
            from = start;
        }
        self.buf.drain(..start);
        // A line longer than the counting bound is not an SSE event we can use.
        if self.buf.len() > MAX_COUNTED_TEXT {
            self.buf.clear();
        }
    }
}

/// One SSE line (without its line end): a `data:` event's usage and text.
fn sse_line(line: &[u8], settle: &mut Settle) {
    let line = String::from_utf8_lossy(line);
    let Some(data) = line.trim_end().strip_prefix("data:") else {
        return;
    };
    let data = data.trim();
    if data == "[DONE]" || data.is_empty() {
        return;
    }
    if let Ok(v) = serde_json::from_str::<Value>(data) {
        if let Some(u) = usage_of(&v) {
            settle.usage = Some(u);
        }
        if settle.text.len() < MAX_COUNTED_TEXT {
            generated_text(&v, &mut settle.text);
        }
    }
}

async fn handle(State(p): State<Arc<Proxy>>, req: Request, kind: Kind) -> Response {
    let (parts, body) = req.into_parts();
    // Who is calling.
    let Some(descs) = bearer(&parts.headers).and_then(|k| {
        let h: [u8; 32] = Sha256::digest(k.as_bytes()).into();
        p.keys.get(&h)
    }) else {
        return openai_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            "missing or unknown API key",
        );
    };
    // The body, bounded in size and time.
    let bytes =
        match tokio::time::timeout(p.cfg.body_timeout, read_body(body, p.cfg.max_body_bytes)).await
        {
            Err(_) => {
                return openai_error(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    "timeout",
                    "the request body did not arrive in time",
                );
            }
            Ok(Err(BodyError::TooLarge)) => {
                return openai_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "body_too_large",
                    &format!("request body over {} bytes", p.cfg.max_body_bytes),
                );
            }
            Ok(Err(BodyError::Broken(e))) => {
                // A client that broke off mid-upload, or bad chunked framing: not a size.
                return openai_error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    "body_broken",
                    &format!("the request body broke off: {e}"),
                );
            }
            Ok(Ok(b)) => b,
        };
    let mut body: Value = match serde_json::from_slice(&bytes) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_body",
                "the body must be a JSON object",
            );
        }
        Err(e) => {
            return openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_body",
                &format!("malformed JSON: {e}"),
            );
        }
    };
    let Some(model) = body
        .get("model")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return openai_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "missing_model",
            "`model` (a string) is required",
        );
    };
    let max_out = match kind {
        Kind::Embeddings => Some(0),
        _ => match body
            .get("max_completion_tokens")
            .filter(|v| !v.is_null())
            .or_else(|| body.get("max_tokens"))
        {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64() {
                Some(n) => Some(n),
                None => {
                    return openai_error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        "invalid_max_tokens",
                        &format!("max_tokens must be a whole number, got {v}"),
                    );
                }
            },
        },
    };
    // `max_tokens` bounds each choice: `n` choices (or `best_of` candidates, generated
    // and all paid for) reserve that many times it, still capped by each rule's
    // `max_output_tokens_cap`; without `max_tokens`, several choices reserve the cap.
    let mut choices = 1u64;
    if kind != Kind::Embeddings {
        for field in ["n", "best_of"] {
            match body.get(field) {
                None | Some(Value::Null) => {}
                Some(v) => match v.as_u64().filter(|n| (1..=MAX_CHOICES).contains(n)) {
                    Some(n) => choices = choices.max(n),
                    None => {
                        return openai_error(
                            StatusCode::BAD_REQUEST,
                            "invalid_request_error",
                            "invalid_n",
                            &format!(
                                "{field} must be a whole number from 1 to {MAX_CHOICES}, got {v}"
                            ),
                        );
                    }
                },
            }
        }
    }
    // What the client asked for, for a charge no rule's reservation bounds (below).
    let asked_out = max_out.map_or(0, |m| m.saturating_mul(choices).min(MAX_COST));
    let max_out = match (max_out, choices) {
        (m, 1) => m,
        (Some(m), c) => Some(m.saturating_mul(c).min(MAX_COST)),
        (None, _) => Some(MAX_COST),
    };
    let stream = kind != Kind::Embeddings && body.get("stream") == Some(&Value::Bool(true));
    let (text, extra) = input_text(kind, &body);
    let input = extra.saturating_add(if text.len() <= COUNT_INLINE_MAX {
        count_tokens(&model, &text)
    } else {
        let m = model.clone();
        let len = text.len() as u64;
        tokio::task::spawn_blocking(move || count_tokens(&m, &text))
            .await
            .unwrap_or(len)
    });

    // Admit.
    let id = format!("{}-{}", p.id_prefix, p.ids.fetch_add(1, Ordering::Relaxed));
    // With the durable outbox: a full outbox refuses here, before any upstream tokens
    // are spent, since the completion could not be recorded.
    if let Some(ob) = p.agent.outbox.get()
        && let Err(e) = ob.check_room()
    {
        let mut r = openai_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "usage_outbox_full",
            &e.to_string(),
        );
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
        return r;
    }
    let mut desc: Vec<(&str, &str)> = descs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if !descs.iter().any(|(k, _)| k == "model") && !model.is_empty() && model.len() <= 256 {
        desc.push(("model", model.as_str()));
    }
    let now = p.agent.clock.now_ns();
    let decision = p.agent.engine.admit(
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
    let d = match decision {
        Ok(d) => d,
        Err(e) => {
            p.agent.counters.errors.fetch_add(1, Ordering::Relaxed);
            // As the HTTP API answers them (`http.rs`): a full table is the agent's
            // overload (503, retry), too many limits on one request is the rules'
            // fault (500), the rest is the request's (400, or 403 with no rule).
            let (status, kind) = match e {
                AdmitError::KeyTableFull { .. } | AdmitError::LeaseTableFull { .. } => {
                    (StatusCode::SERVICE_UNAVAILABLE, "server_error")
                }
                AdmitError::TooManyLimits { .. } => {
                    (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
                }
                AdmitError::NoMatchingRule => (StatusCode::FORBIDDEN, "invalid_request_error"),
                _ => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            };
            let mut r = openai_error(status, kind, "not_admitted", &e.to_string());
            if status == StatusCode::SERVICE_UNAVAILABLE {
                r.headers_mut()
                    .insert("retry-after", HeaderValue::from_static("1"));
            }
            return r;
        }
    };
    let hs = headers::for_decision(&p.agent.engine, &d);
    if let Decision::Rejected(r) = &d {
        p.agent.counters.rejected.fetch_add(1, Ordering::Relaxed);
        let rules = p.agent.engine.rules();
        let tripped = &rules.rules()[r.rule];
        let rule = tripped.name.clone();
        // OpenAI's 429s say which kind of limit: "tokens" for a token limit.
        let limit_type = match tripped.dimension {
            Dimension::InputTokens | Dimension::OutputTokens | Dimension::TotalTokens => "tokens",
            Dimension::Requests | Dimension::Concurrency => "requests",
        };
        let no_budget = headers::no_budget(&d);
        let resp = match r.reason {
            RejectReason::NeverFits { cost, burst } => openai_error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "context_too_large_for_limit",
                &format!(
                    "this request costs {cost}, above the whole burst {burst} of limit {rule}"
                ),
            ),
            RejectReason::RetryLater { retry_after_ns } => {
                let retry = headers::go_duration(retry_after_ns.unwrap_or(1_000_000_000));
                let mut r = if no_budget {
                    openai_error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "server_error",
                        "no_budget",
                        &format!("no budget granted for limit {rule} yet; retry in {retry}"),
                    )
                } else {
                    openai_error(
                        StatusCode::TOO_MANY_REQUESTS,
                        limit_type,
                        "rate_limit_exceeded",
                        &format!("rate limit {rule} reached; retry in {retry}"),
                    )
                };
                r.headers_mut().insert(
                    "retry-after",
                    HeaderValue::from(headers::retry_after_secs(retry_after_ns)),
                );
                r
            }
        };
        return with_headers(resp, &hs);
    }
    p.agent.counters.admitted.fetch_add(1, Ordering::Relaxed);
    // The output the rules reserved: an output-token limit's cost, or a total-token
    // limit's past the input. Only when no rule counts output, what the client asked
    // for (0 without `max_tokens`). Before, a total-token rule alone fell back to the
    // uncapped `max_tokens`, and without one to `MAX_COST` for several choices: an
    // answer the proxy could not read charged 2^40 output tokens (the tenant locked
    // out by debt, and billed for them).
    let reserved_output = d
        .limits()
        .iter()
        .filter_map(|l| match l.dimension {
            Dimension::OutputTokens => Some(l.cost),
            Dimension::TotalTokens => Some(l.cost.saturating_sub(input)),
            _ => None,
        })
        .max()
        .unwrap_or(asked_out);
    let ttl_ms = p.agent.engine.config().lease_ttl_ms;
    let mut settle = Settle {
        agent: Arc::clone(&p.agent),
        id,
        model: model.clone(),
        input,
        reserved_output,
        usage: None,
        text: String::new(),
        done: false,
        alive: Arc::new(()),
    };
    settle.keep_while_alive(Duration::from_millis((ttl_ms / 3).max(1)));

    // Forward.
    if stream {
        // Ask for the usage chunk; a `stream_options` that is null or not an object is
        // replaced (an entry left at null asked for nothing).
        let opts = body
            .as_object_mut()
            .expect("checked above")
            .entry("stream_options")
            .or_insert_with(|| json!({}));
        if !opts.is_object() {
            *opts = json!({});
        }
        if let Some(o) = opts.as_object_mut() {
            o.insert("include_usage".into(), Value::Bool(true));
        }
    }
    let mut up = p
        .client
        .post(format!("{}{}", p.upstream, kind.path()))
        .header("content-type", "application/json")
        .body(body.to_string());
    let auth = p
        .upstream_key
        .as_ref()
        .map(|k| format!("Bearer {k}"))
        .or_else(|| {
            parts
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        });
    if let Some(a) = auth {
        up = up.header("authorization", a);
    }
    let sent = tokio::time::timeout(p.cfg.upstream_timeout, up.send());
    let upstream = match sent.await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            settle.release();
            return with_headers(
                openai_error(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_unreachable",
                    &format!("upstream failed: {e}"),
                ),
                &hs,
            );
        }
        Err(_) => {
            settle.release();
            return with_headers(
                openai_error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_error",
                    "upstream_timeout",
                    "the upstream did not answer in time",
                ),
                &hs,
            );
        }
    };
    let status =
        StatusCode::from_u16(upstream.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let content_type = upstream
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json")
        .to_string();
    if !status.is_success() {
        // Released first: nothing was generated, whatever the body takes to arrive.
        settle.release();
        let text = error_body(upstream, ERROR_BODY_MAX, p.cfg.upstream_idle_timeout).await;
        let r = (status, [("content-type", content_type)], text).into_response();
        return with_headers(r, &hs);
    }
    // An upstream that ignores `stream: true` and answers with a whole JSON body is
    // read as one (its usage counts): through the SSE tap it found no events and was
    // settled at 0 output.
    let answered_whole = stream && content_type.starts_with("application/json");
    if !stream || answered_whole {
        let mut buf = Vec::new();
        let mut s = upstream.bytes_stream();
        let idle = p.cfg.upstream_idle_timeout;
        loop {
            let next = tokio::time::timeout(idle, s.next()).await;
            let chunk = match next {
                Ok(Some(chunk)) => chunk,
                Ok(None) => break,
                Err(_) => {
                    // Stalled with its connection open: the work may be done, but
                    // what it generated is unknown.
                    settle.charge_reserved();
                    return with_headers(
                        openai_error(
                            StatusCode::GATEWAY_TIMEOUT,
                            "upstream_error",
                            "upstream_idle",
                            &format!("the upstream sent nothing for {} ms", idle.as_millis()),
                        ),
                        &hs,
                    );
                }
            };
            match chunk {
                Ok(c) if buf.len() + c.len() <= p.cfg.max_response_bytes => {
                    buf.extend_from_slice(&c)
                }
                Ok(_) | Err(_) => {
                    // Too large or broken mid-body: the upstream did the work, but what
                    // it generated is unknown.
                    settle.charge_reserved();
                    return with_headers(
                        openai_error(
                            StatusCode::BAD_GATEWAY,
                            "upstream_error",
                            "upstream_response",
                            "the upstream response broke off or was too large",
                        ),
                        &hs,
                    );
                }
            }
        }
        if let Ok(v) = serde_json::from_slice::<Value>(&buf) {
            settle.usage = usage_of(&v);
            generated_text(&v, &mut settle.text);
        }
        settle.finish(CompletionStatus::Ok);
        durable(&p.agent).await;
        let r = (status, [("content-type", content_type)], Bytes::from(buf)).into_response();
        return with_headers(r, &hs);
    }
    // Stream: pass each chunk through as it arrives; the tap reads usage and text on
    // the way; the settle guard completes at the end, or on drop if the client goes.
    let tap = SseTap { buf: Vec::new() };
    let idle = p.cfg.upstream_idle_timeout;
    let body_stream = futures_util::stream::unfold(
        (upstream.bytes_stream(), settle, tap, false),
        move |(mut s, mut settle, mut tap, ended)| async move {
            if ended {
                return None;
            }
            match tokio::time::timeout(idle, s.next()).await {
                Ok(Some(Ok(chunk))) => {
                    tap.feed(&chunk, &mut settle);
                    Some((Ok::<Bytes, std::io::Error>(chunk), (s, settle, tap, false)))
                }
                Ok(Some(Err(e))) => {
                    // The upstream broke off: settle with what was generated.
                    settle.finish(CompletionStatus::UpstreamError);
                    Some((Err(std::io::Error::other(e)), (s, settle, tap, true)))
                }
                Err(_) => {
                    // Stalled with its connection open: settle with what was
                    // generated, and end the client's stream with an error.
                    settle.finish(CompletionStatus::UpstreamError);
                    let e = std::io::Error::other(format!(
                        "the upstream sent nothing for {} ms",
                        idle.as_millis()
                    ));
                    Some((Err(e), (s, settle, tap, true)))
                }
                Ok(None) => {
                    settle.finish(CompletionStatus::Ok);
                    // The response ends only once the usage record is durable.
                    durable(&settle.agent).await;
                    None
                }
            }
        },
    );
    let r = Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("cache-control", "no-cache")
        .body(Body::from_stream(body_stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response());
    with_headers(r, &hs)
}

enum BodyError {
    TooLarge,
    Broken(String),
}

/// A request body of at most `max` bytes.
async fn read_body(body: Body, max: usize) -> Result<Bytes, BodyError> {
    let mut s = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = s.next().await {
        let c = chunk.map_err(|e| BodyError::Broken(e.to_string()))?;
        if buf.len() + c.len() > max {
            return Err(BodyError::TooLarge);
        }
        buf.extend_from_slice(&c);
    }
    Ok(Bytes::from(buf))
}

/// Reads an upstream error's body, at most `max` bytes (the rest is dropped) and for
/// at most `within`: what it says is passed on, but an endless or huge one must hold
/// neither memory nor the reservation.
async fn error_body(upstream: reqwest::Response, max: usize, within: Duration) -> Bytes {
    let mut buf = Vec::new();
    let mut s = upstream.bytes_stream();
    let read = async {
        while let Some(Ok(c)) = s.next().await {
            let room = max - buf.len();
            buf.extend_from_slice(&c[..c.len().min(room)]);
            if buf.len() >= max {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(within, read).await;
    Bytes::from(buf)
}

/// Most bytes of an upstream error's body passed on.
const ERROR_BODY_MAX: usize = 64 << 10;

/// With the durable outbox, waits until every usage record so far is committed. A
/// commit slower than the outbox's timeout is counted (`not_durable`) and the answer
/// goes out anyway: the tokens are spent, and the record stays queued.
async fn durable(agent: &AgentState) {
    if let Some(ob) = agent.outbox.get() {
        let _ = ob.durable(ob.ticket()).await;
    }
}

fn bearer(h: &HeaderMap) -> Option<&str> {
    let v = h.get("authorization")?.to_str().ok()?;
    // The scheme is case-insensitive (RFC 9110): `bearer` is `Bearer`.
    let (scheme, key) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| key.trim())
        .filter(|k| !k.is_empty())
}

fn with_headers(mut r: Response, hs: &[(&'static str, String)]) -> Response {
    for (k, v) in hs {
        if let Ok(v) = HeaderValue::from_str(v) {
            r.headers_mut().insert(HeaderName::from_static(k), v);
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlong_runs_are_estimated_and_the_rest_is_counted_exactly() {
        let m = "gpt-4o";
        let long = "a".repeat(10_000);
        let text = format!("hello there {long} general kenobi");
        let rest = count_tokens_exact(m, "hello there   general kenobi");
        assert_eq!(count_tokens(m, &text), 5_000 + rest);
        // Text without overlong runs is counted exactly, as before.
        let prose = "the quick brown fox jumps over the lazy dog\n".repeat(100);
        assert_eq!(count_tokens(m, &prose), count_tokens_exact(m, &prose));
        // A run of exactly the bound is not estimated.
        let edge = "b".repeat(TOKENIZER_RUN_MAX);
        assert_eq!(count_tokens(m, &edge), count_tokens_exact(m, &edge));
    }

    #[test]
    fn prompts_of_token_ids_count_one_token_an_id() {
        let m = "some-unknown-model";
        let b = json!({"prompt": [1234, 5678, 9]});
        assert_eq!(input_tokens(Kind::Completions, m, &b), 3);
        let b = json!({"input": [[1, 2, 3], [4]]});
        assert_eq!(input_tokens(Kind::Embeddings, m, &b), 4);
        // Text and ids together: "abcd\n" is 5 bytes, 3 tokens at 2 bytes a token.
        let b = json!({"input": ["abcd", [7, 8]]});
        assert_eq!(input_tokens(Kind::Embeddings, m, &b), 3 + 2);
    }

    #[test]
    fn generated_text_counts_tool_calls_refusals_and_reasoning() {
        let mut out = String::new();
        generated_text(
            &json!({"choices": [{"delta": {"tool_calls": [
                {"index": 0, "function": {"name": "get_weather", "arguments": "{\"city\":"}},
                {"index": 0, "function": {"arguments": "\"Paris\"}"}}
            ]}}]}),
            &mut out,
        );
        assert_eq!(out, "get_weather{\"city\":\"Paris\"}");
        let mut out = String::new();
        generated_text(
            &json!({"choices": [
                {"message": {"content": null, "refusal": "no", "reasoning_content": "think"}},
                {"message": {"function_call": {"name": "f", "arguments": "{}"}}},
                {"text": "plain"}
            ]}),
            &mut out,
        );
        assert_eq!(out, "nothinkf{}plain");
    }
}
