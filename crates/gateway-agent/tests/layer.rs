//! The `tower::Layer`: the engine in-process in front of an axum service.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use bursar_agent::shell::layer::{Admission, AdmissionLayer, UsageReport};
use bursar_agent::testing::engine;
use bursar_agent::{Cost, Usage};
use http::{Request, StatusCode};
use tower::ServiceExt;

const RULES: &str = r#"
[[rule]]
name = "user-rpm"
match = { user = "*" }
dimension = "requests"
rate = 2
per = "minute"

[[rule]]
name = "user-otpm"
match = { user = "*" }
dimension = "output_tokens"
rate = 1000
per = "minute"
max_output_tokens_default = 500
"#;

async fn handler() -> impl IntoResponse {
    let mut r = "generated".into_response();
    r.extensions_mut().insert(UsageReport(Usage {
        input_tokens: 0,
        cached_input_tokens: 0,
        output_tokens: 40,
    }));
    r
}

#[tokio::test]
async fn the_layer_admits_settles_and_rejects_in_process() {
    let e = engine(RULES);
    let layer = AdmissionLayer::new(Arc::clone(&e), |parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?.to_string();
        Some(Admission {
            descriptors: vec![("user".into(), user)],
            cost: Cost {
                requests: 1,
                input_tokens: 0,
                max_output_tokens: None,
            },
        })
    });
    let app = Router::new()
        .route("/gen", post(handler))
        .layer(layer.clone());
    let req = || {
        Request::post("/gen")
            .header("x-user", "u1")
            .body(Body::empty())
            .unwrap()
    };
    for _ in 0..2 {
        let r = app.clone().oneshot(req()).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK);
        assert!(r.headers().contains_key("x-ratelimit-remaining-requests"));
    }
    // Each request reserved 500 output tokens and reported 40: the refunds leave
    // 1000 - 80 = 920 (and a little refill), not 0.
    let level = e.level(layer.now_ns(), "user-otpm", &["u1"]).unwrap();
    assert!((920..=1000).contains(&level), "{level}");
    assert_eq!(
        e.leases_in_flight(),
        0,
        "every admitted request was completed"
    );
    let r = app.clone().oneshot(req()).await.unwrap();
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(r.headers().contains_key("retry-after"));
    // Requests the classifier does not know pass unlimited.
    let plain = Request::post("/gen").body(Body::empty()).unwrap();
    assert_eq!(app.oneshot(plain).await.unwrap().status(), StatusCode::OK);
}

/// As the HTTP API and the proxy answer: a key the allocator has granted nothing yet
/// is the fleet's condition (503), not the tenant's limit (429).
#[tokio::test]
async fn a_key_with_no_budget_granted_is_answered_503_not_429() {
    let e = engine(&format!("[engine]\nslice_source = \"allocated\"\n{RULES}"));
    let layer = AdmissionLayer::new(Arc::clone(&e), |parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?.to_string();
        Some(Admission {
            descriptors: vec![("user".into(), user)],
            cost: Cost::ONE_REQUEST,
        })
    });
    let app = Router::new().route("/gen", post(handler)).layer(layer);
    let req = Request::post("/gen")
        .header("x-user", "u1")
        .body(Body::empty())
        .unwrap();
    let r = app.oneshot(req).await.unwrap();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(e.leases_in_flight(), 0);
}

#[tokio::test]
async fn with_an_outbox_the_layer_answers_after_the_usage_record_is_durable() {
    use bursar_agent::clock::MonotonicClock;
    use bursar_agent::shell::outbox::{Outbox, OutboxConfig};
    use bursar_agent::{Config, Engine, UsageSink};
    let dir = std::env::temp_dir().join(format!("bursar-layer-outbox-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let outbox = Arc::new(Outbox::open(OutboxConfig::new(dir.clone(), 1)).unwrap());
    let config = Config::from_toml(RULES).unwrap();
    let clock = MonotonicClock::new();
    let wall_origin_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let e = Arc::new(Engine::new(
        config.clone(),
        Arc::clone(&outbox) as Arc<dyn UsageSink>,
    ));
    outbox.start(config.rules.clone(), wall_origin_ms);
    let layer = AdmissionLayer::new(Arc::clone(&e), |parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?.to_string();
        Some(Admission {
            descriptors: vec![("user".into(), user)],
            cost: Cost {
                requests: 1,
                input_tokens: 0,
                max_output_tokens: None,
            },
        })
    })
    .with_clock(clock)
    .with_outbox(Arc::clone(&outbox));
    let app = Router::new().route("/gen", post(handler)).layer(layer);
    let r = app
        .oneshot(
            Request::post("/gen")
                .header("x-user", "u1")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // Answered only once the record was committed.
    assert_eq!(
        outbox
            .stats()
            .committed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    let events = outbox.read_after(0, 10).unwrap();
    assert_eq!(events.len(), 1);
    let e = &events[0].1;
    assert!(e.request_id.starts_with("layer-"), "{}", e.request_id);
    assert_eq!(e.tenant, "unknown", "no `org` descriptor in these rules");
    assert_eq!(e.descriptors, vec![("user".to_string(), "u1".to_string())]);
    assert!(e.time_ms.abs_diff(wall_origin_ms) < 60_000);
    outbox.close();
    let _ = std::fs::remove_dir_all(&dir);
}
