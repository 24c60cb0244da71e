//! The OpenAI-compatible proxy: the real agent process in front of a small test
//! upstream that speaks the OpenAI schema (streaming and not), with upstream errors,
//! an upstream that is down, client disconnects and bad input. Leases never leak.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Agent, request_with};
use serde_json::{Value, json};

const KEY: &str = "sk-test-acme";

fn rules() -> String {
    let hash = bursar_agent::shell::proxy::key_hash_hex(KEY);
    format!(
        r#"
[[rule]]
name = "org-otpm"
match = {{ org = "*" }}
dimension = "output_tokens"
rate = 60000
per = "minute"
burst = 1000
max_output_tokens_default = 300
max_output_tokens_cap = 800

[[rule]]
name = "org-rpm"
match = {{ org = "*" }}
dimension = "requests"
rate = 6000
per = "minute"
burst = 100

[[api_key]]
sha256 = "{hash}"
descriptors = {{ org = "acme" }}
"#
    )
}

type Seen = Arc<Mutex<Vec<Value>>>;

fn json_response(v: Value) -> Response {
    ([("content-type", "application/json")], v.to_string()).into_response()
}

/// A test upstream: behaviour by model name.
fn upstream(seen: Seen) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let seen2 = seen.clone();
            let app = Router::new()
                .route(
                    "/v1/chat/completions",
                    post(move |body: Bytes| chat(seen.clone(), body)),
                )
                .route(
                    "/v1/embeddings",
                    post(move |body: Bytes| {
                        let seen = seen2.clone();
                        async move {
                            let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                            seen.lock().unwrap().push(v);
                            json_response(json!({
                                "data": [{"embedding": [0.1, 0.2]}],
                                "usage": {"prompt_tokens": 4, "total_tokens": 4}
                            }))
                        }
                    }),
                );
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(l.local_addr().unwrap()).unwrap();
            axum::serve(l, app).await.unwrap();
        });
    });
    rx.recv().expect("upstream address")
}

async fn chat(seen: Seen, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    seen.lock().unwrap().push(v.clone());
    let model = v["model"].as_str().unwrap_or("").to_string();
    if model == "fail" {
        return (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            json_response(json!({"error": {"message": "boom", "type": "server_error"}})),
        )
            .into_response();
    }
    if model == "fail-endless" {
        // An error whose body never ends.
        let s = futures_util::stream::unfold((), |()| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Some((
                Ok::<_, std::io::Error>(Bytes::from(vec![b'e'; 64 << 10])),
                (),
            ))
        });
        return Response::builder()
            .status(axum::http::StatusCode::BAD_GATEWAY)
            .body(Body::from_stream(s))
            .unwrap();
    }
    if model == "stall" || model == "stall-stream" {
        // Answers, sends a first piece, then nothing, with the connection kept open.
        let first = if model == "stall" {
            "{\"id\":".to_string()
        } else {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"index": 0, "delta": {"content": "tok "}}]})
            )
        };
        let s = futures_util::stream::unfold(Some(first), |first| async move {
            match first {
                Some(f) => Some((Ok::<_, std::io::Error>(Bytes::from(f)), None)),
                None => std::future::pending().await,
            }
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(s))
            .unwrap();
    }
    let stream = v["stream"] == json!(true);
    let include_usage = v["stream_options"]["include_usage"] == json!(true);
    if model == "huge" {
        // A whole answer larger than a small --proxy-max-response-bytes.
        return json_response(json!({
            "id": "c1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x".repeat(4000)}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 2000, "total_tokens": 2012},
        }));
    }
    if !stream {
        let mut out = json!({
            "id": "c1", "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello world"}}],
        });
        if model != "no-usage" {
            out["usage"] = json!({"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17});
        }
        return json_response(out).into_response();
    }
    // split-stream: three tokens and a usage chunk (50 output tokens), every event
    // cut across several 5-byte chunks.
    if model == "split-stream" {
        let mut body = String::new();
        for _ in 0..3 {
            let d = json!({"choices": [{"index": 0, "delta": {"content": "tok "}}]});
            body.push_str(&format!("data: {d}\n\n"));
        }
        let u = json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 50, "total_tokens": 62}});
        body.push_str(&format!("data: {u}\n\ndata: [DONE]\n\n"));
        let pieces: Vec<Result<Bytes, std::io::Error>> = body
            .into_bytes()
            .chunks(5)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(futures_util::StreamExt::then(
                futures_util::stream::iter(pieces),
                |p| async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    p
                },
            )))
            .unwrap();
    }
    // flood-stream: 32 MiB of SSE comment lines at once (more than the sockets and
    // the proxy buffer), then a token every 100 ms for 3 s, then [DONE].
    if model == "flood-stream" {
        let comment = Bytes::from(format!(": {}\n", "x".repeat((1 << 20) - 3)));
        let flood = futures_util::stream::iter((0..32).map(move |_| Ok(comment.clone())));
        let trickle = futures_util::stream::unfold(0u32, |i| async move {
            if i > 30 {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let d = if i == 30 {
                "data: [DONE]\n\n".to_string()
            } else {
                let d = json!({"choices": [{"index": 0, "delta": {"content": "tok "}}]});
                format!("data: {d}\n\n")
            };
            Some((Ok::<_, std::io::Error>(Bytes::from(d)), i + 1))
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(futures_util::StreamExt::chain(
                flood, trickle,
            )))
            .unwrap();
    }
    // json-anyway: a stream asked for, a whole JSON answer given, with its usage.
    if model == "json-anyway" {
        return json_response(json!({
            "id": "c-1", "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "tok tok tok"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 40, "total_tokens": 52}
        }))
        .into_response();
    }
    // early-usage-cut: a usage chunk that counts the prompt alone, three tokens, then
    // the upstream breaks off.
    if model == "early-usage-cut" {
        let u = json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 0, "total_tokens": 12}});
        let mut events: Vec<Result<Bytes, std::io::Error>> =
            vec![Ok(Bytes::from(format!("data: {u}\n\n")))];
        for _ in 0..3 {
            let d = json!({"choices": [{"index": 0, "delta": {"content": "tok "}}]});
            events.push(Ok(Bytes::from(format!("data: {d}\n\n"))));
        }
        events.push(Err(std::io::Error::other("the upstream broke off")));
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(futures_util::StreamExt::then(
                futures_util::stream::iter(events),
                |e| async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    e
                },
            )))
            .unwrap();
    }
    // slow-stream: 100 chunks 100 ms apart; long-stream: 20 (two seconds).
    let slow = model == "slow-stream" || model == "long-stream";
    let usage = include_usage && model != "no-usage";
    let chunks = match model.as_str() {
        "slow-stream" => 100,
        "long-stream" => 20,
        _ => 3,
    };
    let s = futures_util::stream::unfold(0u32, move |i| async move {
        if slow && i > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let data = if i < chunks {
            json!({"choices": [{"index": 0, "delta": {"content": "tok "}}]}).to_string()
        } else if i == chunks && usage {
            json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}})
                .to_string()
        } else if i <= chunks + 1 {
            "[DONE]".to_string()
        } else {
            return None;
        };
        let next = if i == chunks && !usage {
            chunks + 1
        } else {
            i + 1
        };
        Some((
            Ok::<_, std::io::Error>(Bytes::from(format!("data: {data}\n\n"))),
            if data == "[DONE]" { u32::MAX - 1 } else { next },
        ))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(s))
        .unwrap()
}

fn start(seen: &Seen, extra: &[&str]) -> (Agent, SocketAddr) {
    start_rules(seen, &rules(), extra)
}

/// [`start`] with other rules.
fn start_rules(seen: &Seen, rules: &str, extra: &[&str]) -> (Agent, SocketAddr) {
    let up = upstream(seen.clone());
    let upstream_url = format!("http://{up}");
    let mut args = vec![
        "--proxy-listen",
        "127.0.0.1:0",
        "--proxy-upstream",
        upstream_url.as_str(),
    ];
    args.extend_from_slice(extra);
    let agent = Agent::start_with(rules, &args);
    let proxy = agent.proxy.expect("proxy address");
    (agent, proxy)
}

/// One output-token rule refilling slowly (600 an hour, burst 1,000, 300 reserved by
/// default), so that what a request was charged still shows in the next one's
/// remaining, and the test key for org `acme`.
fn slow_otpm_rules() -> String {
    let hash = bursar_agent::shell::proxy::key_hash_hex(KEY);
    format!(
        "[[rule]]\nname = \"org-otpm\"\nmatch = {{ org = \"*\" }}\ndimension = \"output_tokens\"\n\
         rate = 600\nper = \"hour\"\nburst = 1000\nmax_output_tokens_default = 300\n\n\
         [[api_key]]\nsha256 = \"{hash}\"\ndescriptors = {{ org = \"acme\" }}\n"
    )
}

fn chat_call(proxy: SocketAddr, body: Value) -> common::Resp {
    request_with(
        proxy,
        "POST",
        "/v1/chat/completions",
        &[&format!("Authorization: Bearer {KEY}")],
        body.to_string().as_bytes(),
    )
}

fn remaining_tokens(r: &common::Resp) -> u64 {
    r.header("x-ratelimit-remaining-tokens")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no token header: {:?}", r.headers))
}

#[test]
fn a_plain_completion_is_forwarded_and_settled_from_its_usage() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("hello world"));
    // Reserved 500 of 1000 while in flight.
    assert_eq!(remaining_tokens(&r), 500);
    assert_eq!(agent.leases_drained(), 0);
    // Settled from usage (5 output tokens): the next reservation of 500 leaves ~495.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}),
    );
    let left = remaining_tokens(&r);
    assert!((495..=500).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn a_stream_passes_through_and_is_settled_from_its_final_usage_chunk() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body.matches("tok ").count(), 3, "{}", r.body);
    assert!(r.body.contains("[DONE]"));
    // The proxy asked the upstream for the usage chunk.
    let sent = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true);
    assert_eq!(agent.leases_drained(), 0);
    // 3 output tokens used: the next reservation (default 300) leaves ~697.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    );
    let left = remaining_tokens(&r);
    assert!((697..=700).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
}

/// An upstream that ignores `stream: true` and answers with one JSON body: its usage
/// (40 output tokens) is charged, not 0 (the SSE tap found no events in it).
#[test]
fn a_whole_json_answer_to_a_stream_request_is_settled_from_its_usage() {
    let seen = Seen::default();
    let rules = slow_otpm_rules();
    let (agent, proxy) = start_rules(&seen, &rules, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "json-anyway", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains("chat.completion"),
        "passed through: {}",
        r.body
    );
    assert_eq!(agent.leases_drained(), 0);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    );
    let left = remaining_tokens(&r);
    assert!((660..=661).contains(&left), "1000 - 40 - 300: {left}");
    assert_eq!(agent.leases_drained(), 0);
}

/// A stream cut short after an early usage chunk (the prompt alone, 0 output) was
/// settled at 0 output tokens though three were streamed: the text streamed is now the
/// floor of what a stream that did not end is charged.
#[test]
fn a_stream_cut_after_an_early_usage_chunk_is_charged_the_text_streamed() {
    let seen = Seen::default();
    let rules = slow_otpm_rules();
    let (agent, proxy) = start_rules(&seen, &rules, &[]);
    let _ = chat_call(
        proxy,
        json!({"model": "early-usage-cut", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(agent.leases_drained(), 0);
    // "tok tok tok " is 12 bytes, estimated at 2 bytes a token for an unknown model:
    // 6 tokens; the next reservation (default 300) leaves ~694 (0 charged: 700).
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    );
    let left = remaining_tokens(&r);
    assert!((694..=695).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
}

/// SSE events cut across chunks (5 bytes each, 1 ms apart, so that they reach the
/// proxy apart) are read whole: the usage chunk's 50 output tokens are what is charged.
#[test]
fn a_stream_whose_events_are_cut_across_chunks_is_settled_from_its_usage() {
    let seen = Seen::default();
    // A slow refill: the cut stream takes a few hundred ms.
    let rules = slow_otpm_rules();
    let (agent, proxy) = start_rules(&seen, &rules, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "split-stream", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    // (The body comes in HTTP chunks as small as the upstream's: this client does not
    // undo the chunked framing, so the events are not matched here.)
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(agent.leases_drained(), 0);
    // 50 output tokens used: the next reservation (default 300) leaves ~650 (text
    // counting would have charged ~6, a lost usage chunk 0).
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
    );
    let left = remaining_tokens(&r);
    assert!((650..=651).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn a_stream_without_usage_is_settled_by_counting_the_text() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "no-usage", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(agent.leases_drained(), 0);
    // "tok tok tok " is 12 bytes; an unknown model is estimated at 2 bytes per token.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 100, "messages": []}),
    );
    let left = remaining_tokens(&r);
    assert!((894..=900).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn upstream_errors_release_the_reservation() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "fail", "max_tokens": 800, "messages": []}),
    );
    assert_eq!(r.status, 500);
    assert!(r.body.contains("boom"));
    assert_eq!(agent.leases_drained(), 0);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 100, "messages": []}),
    );
    assert_eq!(
        remaining_tokens(&r),
        900,
        "the failed request's 800 came back"
    );
    // An upstream that is down: 502, reservation released.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let down = format!("http://{closed}");
    let agent2 = Agent::start_with(
        &rules(),
        &["--proxy-listen", "127.0.0.1:0", "--proxy-upstream", &down],
    );
    let r = chat_call(
        agent2.proxy.unwrap(),
        json!({"model": "gpt-4o", "messages": []}),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("upstream_unreachable"));
    assert_eq!(agent2.leases_drained(), 0);
    assert_eq!(agent.leases_drained(), 0);
}

/// Review (twenty-seventh session): an upstream that answered and then stalled with
/// its connection open kept the reservation and its slot for ever (the proxy extends
/// the lease while it waits), and an error body was read whole, with no bound in size
/// or time.
#[test]
fn stalled_upstreams_and_endless_error_bodies_give_the_reservation_back() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &["--proxy-idle-timeout-ms", "400"]);
    // Not streamed: 504 once the upstream has been silent for the idle timeout.
    let r = chat_call(
        proxy,
        json!({"model": "stall", "max_tokens": 300, "messages": []}),
    );
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(r.body.contains("upstream_idle"), "{}", r.body);
    assert_eq!(agent.leases_drained(), 0, "the stalled request's lease");
    // Streamed: the first chunk reaches the client, then the stream ends.
    let r = chat_call(
        proxy,
        json!({"model": "stall-stream", "stream": true, "max_tokens": 300, "messages": []}),
    );
    assert_eq!(r.status, 200);
    assert!(r.body.contains("tok "), "{}", r.body);
    assert_eq!(agent.leases_drained(), 0, "the stalled stream's lease");
    // An error with an endless body: passed on cut, the reservation released.
    let r = chat_call(
        proxy,
        json!({"model": "fail-endless", "max_tokens": 300, "messages": []}),
    );
    assert_eq!(r.status, 502);
    assert!(
        r.body.len() <= 64 << 10,
        "{} bytes of error body",
        r.body.len()
    );
    assert_eq!(agent.leases_drained(), 0);
    // The lower-case bearer scheme is the same scheme.
    let r = request_with(
        proxy,
        "POST",
        "/v1/chat/completions",
        &[&format!("Authorization: bearer {KEY}")],
        json!({"model": "gpt-4o", "max_tokens": 10, "messages": []})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // A prompt of one letter repeated 1 MiB times is counted by estimate (the
    // tokenizer's merge is quadratic in one piece), and answered.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 10,
               "messages": [{"role": "user", "content": "a".repeat(1 << 20)}]}),
    );
    assert!(
        r.status == 200 || r.status == 429 || r.status == 400,
        "{}",
        r.body
    );
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn a_client_that_disconnects_mid_stream_is_settled() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let body = json!({"model": "slow-stream", "stream": true, "max_tokens": 500, "messages": []})
        .to_string();
    let mut s = TcpStream::connect(proxy).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    assert_eq!(agent.leases_in_flight(), 1);
    drop(s);
    assert_eq!(
        agent.leases_drained(),
        0,
        "the lease must be settled when the client goes"
    );
}

#[test]
fn embeddings_reserve_no_output() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = request_with(
        proxy,
        "POST",
        "/v1/embeddings",
        &[&format!("Authorization: Bearer {KEY}")],
        json!({"model": "text-embedding-3-small", "input": ["a", "b"]})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(remaining_tokens(&r), 1000);
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn bad_input_unknown_keys_and_stalled_clients_get_clear_errors() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &["--proxy-body-timeout-ms", "300"]);
    let body = json!({"model": "gpt-4o", "messages": []}).to_string();
    let r = request_with(proxy, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    let r = request_with(
        proxy,
        "POST",
        "/v1/chat/completions",
        &["Authorization: Bearer sk-wrong"],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    assert!(r.body.contains("invalid_api_key"));
    let auth = format!("Authorization: Bearer {KEY}");
    let cases: Vec<(&[u8], u16, &str)> = vec![
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (br#"{"messages": []}"#, 400, "missing_model"),
        (
            br#"{"model": "gpt-4o", "max_tokens": -3, "messages": []}"#,
            400,
            "whole number",
        ),
        (b"{\"model\": \"\xff\"}", 400, "malformed JSON"),
    ];
    for (body, status, needle) in cases {
        let r = request_with(proxy, "POST", "/v1/chat/completions", &[&auth], body);
        assert_eq!(r.status, status, "{}", r.body);
        assert!(r.body.contains(needle), "{:?} lacks {needle:?}", r.body);
    }
    let huge = vec![b' '; 5 << 20];
    let r = request_with(proxy, "POST", "/v1/chat/completions", &[&auth], &huge);
    assert_eq!(r.status, 413);
    // A client that sends its headers and then stalls: 408 once the body timeout passes.
    let mut s = TcpStream::connect(proxy).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\n{auth}\r\nContent-Length: 100\r\n\r\n{{\"model\""
    )
    .unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(
        String::from_utf8_lossy(&buf).contains("408"),
        "{}",
        String::from_utf8_lossy(&buf)
    );
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn proxied_completions_are_committed_to_the_usage_outbox_before_the_response_ends() {
    use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
    let seen = Seen::default();
    let dir = std::env::temp_dir().join(format!("bursar-proxy-outbox-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // A shadow rule on the model, so the model is among the lease's limit keys and
    // reaches the event (the engine keeps no other descriptors after admission).
    let rules = format!(
        "{}\n[[rule]]\nname = \"model-shadow\"\nmatch = {{ org = \"*\", model = \"*\" }}\n\
         dimension = \"requests\"\nrate = 1000000\nper = \"second\"\nmode = \"shadow\"\n",
        rules()
    );
    let (agent, proxy) = start_rules(
        &seen,
        &rules,
        &[
            "--outbox-dir",
            dir.to_str().unwrap(),
            // Nothing listens there: events stay in the outbox for this test to read.
            "--ledger",
            "http://127.0.0.1:9",
            "--agent-id",
            "proxy-agent",
        ],
    );
    let committed = || agent.metric("bursar_outbox_events_total{kind=\"committed\"} ");
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 500, "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // The response was only sent once its usage record was in the file.
    assert_eq!(committed(), 1);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "stream": true, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("[DONE]"));
    // The stream ended only once its usage record was in the file.
    assert_eq!(committed(), 2);
    drop(agent); // releases the file
    let ob = Outbox::open(OutboxConfig::new(dir.clone(), 1)).expect("reopen the outbox");
    let events = ob.read_after(0, 10).expect("read");
    assert_eq!(events.len(), 2);
    for (i, (seq, e)) in events.iter().enumerate() {
        assert_eq!(*seq, i as u64 + 1);
        assert_eq!(e.tenant, "acme");
        assert_eq!(e.model, "gpt-4o");
        assert_eq!(e.origin, "proxy-agent");
        assert!(e.request_id.starts_with("px-"), "{}", e.request_id);
    }
    assert_eq!(
        format!("{:?}", events[0].1.body),
        "Usage { status: Ok, tokens: Tokens { input_tokens: 12, cached_input_tokens: 0, output_tokens: 5 } }"
    );
    assert_eq!(
        format!("{:?}", events[1].1.body),
        "Usage { status: Ok, tokens: Tokens { input_tokens: 12, cached_input_tokens: 0, output_tokens: 3 } }"
    );
    ob.close();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_null_stream_options_still_asks_the_upstream_for_usage() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "stream": true, "stream_options": null, "max_tokens": 400,
               "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let sent = seen
        .lock()
        .unwrap()
        .last()
        .cloned()
        .expect("the upstream saw it");
    assert_eq!(
        sent["stream_options"]["include_usage"],
        json!(true),
        "{sent}"
    );
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn several_choices_reserve_max_tokens_for_each_up_to_the_cap() {
    let seen = Seen::default();
    let (agent, proxy) = start(&seen, &[]);
    // Two choices of at most 300: 600 reserved (the cap is 800).
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "n": 2, "max_tokens": 300, "messages": []}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(remaining_tokens(&r), 400);
    assert_eq!(agent.leases_drained(), 0);
    // Settled at the 5 used (the bucket refills 1,000 a second meanwhile). Three
    // candidates without max_tokens reserve the cap.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "best_of": 3, "messages": []}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let left = remaining_tokens(&r);
    assert!((195..=200).contains(&left), "{left}");
    assert_eq!(agent.leases_drained(), 0);
    // A null max_completion_tokens leaves max_tokens in force.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_completion_tokens": null, "max_tokens": 50, "messages": []}),
    );
    let left = remaining_tokens(&r);
    assert!((940..=950).contains(&left), "{left}");
    for bad in [json!(0), json!(129), json!(-1), json!("2")] {
        let r = chat_call(proxy, json!({"model": "gpt-4o", "n": bad, "messages": []}));
        assert_eq!(r.status, 400, "n = {bad}: {}", r.body);
        assert!(r.body.contains("invalid_n"), "{}", r.body);
    }
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn a_stream_longer_than_the_lease_ttl_keeps_its_lease() {
    let seen = Seen::default();
    let rules = format!("[engine]\nlease_ttl_ms = 600\n{}", rules());
    let (agent, proxy) = start_rules(&seen, &rules, &[]);
    let reader = std::thread::spawn(move || {
        chat_call(
            proxy,
            json!({"model": "long-stream", "stream": true, "max_tokens": 500, "messages": []}),
        )
    });
    // Two seconds of stream against a 600 ms TTL: the lease is extended as it flows.
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(agent.leases_in_flight(), 1, "the lease expired mid-stream");
    }
    let r = reader.join().expect("reader");
    assert_eq!(r.status, 200);
    assert!(r.body.contains("[DONE]"));
    assert_eq!(agent.leases_drained(), 0);
}

/// A client that stops reading a stream: its body is not polled, and the lease was
/// extended only from the body's polls, so it expired after the TTL while the upstream
/// connection stayed open (its concurrency slot and reservation given back). A task
/// now keeps it while the request is in flight; the client gone, it is settled.
#[test]
fn a_client_that_stops_reading_a_stream_keeps_its_lease_until_it_goes() {
    use std::io::{Read, Write};
    let seen = Seen::default();
    let rules = format!("[engine]\nlease_ttl_ms = 600\n{}", rules());
    let (agent, proxy) = start_rules(&seen, &rules, &[]);
    let body = json!({"model": "flood-stream", "stream": true, "max_tokens": 500, "messages": []})
        .to_string();
    let mut c = std::net::TcpStream::connect(proxy).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 4096];
    let n = c.read(&mut head).unwrap();
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    // Reads nothing more for 2 s, over three TTLs.
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(
            agent.leases_in_flight(),
            1,
            "the lease expired while in flight"
        );
    }
    // Gone: settled (as the client gone), nothing left in flight.
    drop(c);
    let t0 = std::time::Instant::now();
    while agent.leases_in_flight() != 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "not settled");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(agent.leases_drained(), 0);
}

#[test]
fn requests_that_cost_their_rules_nothing_are_still_recorded() {
    use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
    let seen = Seen::default();
    let dir = std::env::temp_dir().join(format!("bursar-proxy-zero-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Output tokens only: an embedding reserves none of them. A slow refill, so that
    // what a request was charged still shows in the next one's remaining.
    let rules = slow_otpm_rules();
    let (agent, proxy) = start_rules(
        &seen,
        &rules,
        &[
            "--proxy-max-response-bytes",
            "1024",
            "--outbox-dir",
            dir.to_str().unwrap(),
            "--ledger",
            "http://127.0.0.1:9",
            "--agent-id",
            "proxy-agent",
        ],
    );
    let r = request_with(
        proxy,
        "POST",
        "/v1/embeddings",
        &[&format!("Authorization: Bearer {KEY}")],
        json!({"model": "text-embedding-3-small", "input": [[1, 2, 3]]})
            .to_string()
            .as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(agent.leases_drained(), 0);
    // An answer over --proxy-max-response-bytes: 502, charged what it reserved.
    let r = chat_call(
        proxy,
        json!({"model": "huge", "max_tokens": 100, "messages": []}),
    );
    assert_eq!(r.status, 502, "{}", r.body);
    assert_eq!(agent.leases_drained(), 0);
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 100, "messages": []}),
    );
    assert_eq!(
        remaining_tokens(&r),
        1000 - 100 - 100,
        "the huge answer's 100 stay spent"
    );
    assert_eq!(agent.leases_drained(), 0);
    drop(agent);
    let ob = Outbox::open(OutboxConfig::new(dir.clone(), 1)).expect("reopen the outbox");
    let events = ob.read_after(0, 10).expect("read");
    let bodies: Vec<String> = events
        .iter()
        .map(|(_, e)| format!("{:?}", e.body))
        .collect();
    assert_eq!(bodies.len(), 3, "{bodies:?}");
    assert_eq!(
        bodies[0],
        "Usage { status: Ok, tokens: Tokens { input_tokens: 4, cached_input_tokens: 0, output_tokens: 0 } }"
    );
    assert!(bodies[1].contains("UpstreamError"), "{}", bodies[1]);
    assert!(bodies[1].contains("output_tokens: 100"), "{}", bodies[1]);
    ob.close();
    let _ = std::fs::remove_dir_all(&dir);
}

/// An answer the proxy cannot read (over --proxy-max-response-bytes) is charged the
/// output its rules reserved. With a total-token rule and no output-token rule that
/// fell back to the client's uncapped `max_tokens`, and for several choices without
/// one to 2^40 tokens: the tenant was locked out by the debt and billed for them.
#[test]
fn an_unreadable_answer_under_a_total_token_rule_is_charged_the_capped_reservation() {
    use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
    let seen = Seen::default();
    let dir = std::env::temp_dir().join(format!("bursar-proxy-total-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let hash = bursar_agent::shell::proxy::key_hash_hex(KEY);
    let rules = format!(
        "[[rule]]\nname = \"org-tpm\"\nmatch = {{ org = \"*\" }}\ndimension = \"total_tokens\"\n\
         rate = 1\nper = \"hour\"\nburst = 2400\nmax_output_tokens_cap = 800\n\n\
         [[api_key]]\nsha256 = \"{hash}\"\ndescriptors = {{ org = \"acme\" }}\n"
    );
    let (agent, proxy) = start_rules(
        &seen,
        &rules,
        &[
            "--proxy-max-response-bytes",
            "1024",
            "--outbox-dir",
            dir.to_str().unwrap(),
            "--ledger",
            "http://127.0.0.1:9",
            "--agent-id",
            "proxy-agent",
        ],
    );
    for body in [
        json!({"model": "huge", "n": 2, "messages": []}),
        json!({"model": "huge", "max_tokens": 1_000_000, "messages": []}),
    ] {
        let r = chat_call(proxy, body);
        assert_eq!(r.status, 502, "{}", r.body);
    }
    // The tenant is not locked out.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 10, "messages": []}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // What is left (~780 of 2,400) does not hold another 800: a 429 whose OpenAI error
    // type says a token limit tripped.
    let r = chat_call(
        proxy,
        json!({"model": "gpt-4o", "max_tokens": 1000, "messages": []}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "tokens", "{}", r.body);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(agent.leases_drained(), 0);
    drop(agent);
    let ob = Outbox::open(OutboxConfig::new(dir.clone(), 1)).expect("reopen the outbox");
    let events = ob.read_after(0, 10).expect("read");
    let bodies: Vec<String> = events
        .iter()
        .map(|(_, e)| format!("{:?}", e.body))
        .collect();
    assert_eq!(bodies.len(), 3, "{bodies:?}");
    for b in &bodies[..2] {
        assert!(b.contains("UpstreamError"), "{b}");
        assert!(b.contains("output_tokens: 800 "), "the rule's cap: {b}");
    }
    ob.close();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A timeout of 0 was accepted, and `--proxy-idle-timeout-ms 0` cut every stream
/// that was not ready at once: each is refused at start with the flag named.
#[test]
fn proxy_timeouts_of_zero_are_refused_with_the_flag_named() {
    for flag in [
        "--proxy-body-timeout-ms",
        "--proxy-upstream-timeout-ms",
        "--proxy-idle-timeout-ms",
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bursar-agent"))
            .args(["--http", "127.0.0.1:0", flag, "0"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} 0 must be refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}
