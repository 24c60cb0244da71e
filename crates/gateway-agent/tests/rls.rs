//! Envoy RLS v3 against the real `bursar-agent` process, called by a gRPC client
//! generated from an independent definition of Envoy's protocol (build.rs).

mod common;

#[allow(clippy::all, missing_docs)]
mod envoy_client {
    include!(concat!(env!("OUT_DIR"), "/envoy.service.ratelimit.v3.rs"));
}

use common::Agent;
use envoy_client::rate_limit_response::Code;
use envoy_client::rate_limit_service_client::RateLimitServiceClient;
use envoy_client::{Descriptor, RateLimitRequest, descriptor::Entry};

const RULES: &str = r#"
[[rule]]
name = "edge-rps"
domain = "edge"
match = { remote_address = "*" }
dimension = "requests"
rate = 2
per = "second"

[[rule]]
name = "ai-tokens"
domain = "ai"
match = { tenant = "*" }
dimension = "total_tokens"
rate = 600
per = "minute"
burst = 100
"#;

fn descriptor(pairs: &[(&str, &str)], hits: Option<u64>) -> Descriptor {
    Descriptor {
        entries: pairs
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        hits_addend: hits,
    }
}

async fn call(
    client: &mut RateLimitServiceClient<tonic::transport::Channel>,
    domain: &str,
    descriptors: Vec<Descriptor>,
) -> Result<envoy_client::RateLimitResponse, tonic::Status> {
    client
        .should_rate_limit(RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: 0,
        })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test]
async fn requests_are_limited_per_descriptor_with_statuses_and_headers() {
    let agent = Agent::start(RULES);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", agent.grpc))
        .await
        .expect("connect");
    let ip = descriptor(&[("remote_address", "10.0.0.1")], None);
    for remaining in [1, 0] {
        let r = call(&mut client, "edge", vec![ip.clone()]).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert!(
            r.response_headers_to_add.is_empty(),
            "by default only OVER_LIMIT responses carry headers"
        );
        let s = &r.statuses[0];
        assert_eq!(s.code, Code::Ok as i32);
        assert_eq!(s.limit_remaining, remaining);
        let limit = s.current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.name.as_str(), limit.requests_per_unit, limit.unit),
            ("edge-rps", 2, 1)
        );
    }
    let r = call(&mut client, "edge", vec![ip.clone()]).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let s = &r.statuses[0];
    assert_eq!(s.code, Code::OverLimit as i32);
    let reset = s.duration_until_reset.unwrap();
    assert!(reset.seconds == 0 && reset.nanos > 0, "{reset:?}");
    let headers: Vec<(&str, &str)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect();
    assert!(headers.contains(&("retry-after", "1")), "{headers:?}");
    assert!(
        headers.contains(&("x-ratelimit-remaining-requests", "0")),
        "{headers:?}"
    );
    // Two descriptors: the second, fresh, is OK while the first is over: overall over.
    let other = descriptor(&[("remote_address", "10.0.0.2")], None);
    let r = call(&mut client, "edge", vec![ip, other]).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[1].code, Code::Ok as i32);
    // A descriptor no rule matches is OK with no limit, as in Envoy's service.
    let r = call(
        &mut client,
        "edge",
        vec![descriptor(&[("path", "/x")], None)],
    )
    .await
    .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert!(r.statuses[0].current_limit.is_none());
}

#[tokio::test]
async fn with_rls_headers_always_ok_responses_carry_the_headers_too() {
    let agent = Agent::start_with(RULES, &["--rls-headers", "always"]);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", agent.grpc))
        .await
        .expect("connect");
    let r = call(
        &mut client,
        "edge",
        vec![descriptor(&[("remote_address", "a")], None)],
    )
    .await
    .unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let keys: Vec<&str> = r
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert!(keys.contains(&"x-ratelimit-remaining-requests"), "{keys:?}");
    assert!(keys.contains(&"ratelimit-policy"), "{keys:?}");
}

#[tokio::test]
async fn ai_gateway_style_token_checks_and_post_hoc_charges() {
    let agent = Agent::start(RULES);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", agent.grpc))
        .await
        .expect("connect");
    let check = || descriptor(&[("tenant", "t1")], Some(0));
    // Before the request: a zero-cost check passes while budget remains.
    let r = call(&mut client, "ai", vec![check()]).await.unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 100);
    // On stream end: 250 tokens were spent. The charge is recorded past zero.
    let r = call(
        &mut client,
        "ai",
        vec![descriptor(&[("tenant", "t1")], Some(250))],
    )
    .await
    .unwrap();
    assert_eq!(
        r.overall_code,
        Code::Ok as i32,
        "a post-hoc charge never rejects"
    );
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // The bucket is in debt: the next check says no.
    let r = call(&mut client, "ai", vec![check()]).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
}

#[tokio::test]
async fn malformed_requests_are_invalid_argument() {
    let agent = Agent::start(RULES);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", agent.grpc))
        .await
        .expect("connect");
    let e = call(&mut client, "edge", vec![]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let e = call(
        &mut client,
        "edge",
        vec![descriptor(&[("remote_address", "")], None)],
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("empty"), "{}", e.message());
    // An absurd hits_addend was an error, on which Envoy fails open by default: it is
    // OVER_LIMIT where a rule matches (as Envoy's own service answers), charging
    // nothing, and OK where none does.
    let absurd = descriptor(&[("remote_address", "10.0.0.9")], Some(u64::MAX));
    let r = call(&mut client, "edge", vec![absurd]).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let unmatched = descriptor(&[("path", "/x")], Some(u64::MAX));
    let r = call(&mut client, "edge", vec![unmatched]).await.unwrap();
    assert_eq!(r.overall_code, Code::Ok as i32);
    let ok = descriptor(&[("remote_address", "10.0.0.9")], None);
    let r = call(&mut client, "edge", vec![ok]).await.unwrap();
    assert_eq!(
        r.overall_code,
        Code::Ok as i32,
        "the absurd one charged nothing"
    );
}

/// A bad descriptor after good ones refused the call with the good ones already
/// charged (and Envoy, failing open, let the request through). Every descriptor is
/// checked first now: the call is refused and nothing is charged.
#[tokio::test]
async fn a_bad_descriptor_refuses_the_call_before_any_is_charged() {
    let agent = Agent::start(RULES);
    let mut client = RateLimitServiceClient::connect(format!("http://{}", agent.grpc))
        .await
        .expect("connect");
    let good = || descriptor(&[("remote_address", "10.0.0.5")], None);
    let bad = descriptor(&[("remote_address", "")], None);
    let e = call(&mut client, "edge", vec![good(), good(), bad])
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("descriptor 2"), "{}", e.message());
    // The limit's whole burst (2) is still there.
    for _ in 0..2 {
        let r = call(&mut client, "edge", vec![good()]).await.unwrap();
        assert_eq!(r.overall_code, Code::Ok as i32);
    }
    let r = call(&mut client, "edge", vec![good()]).await.unwrap();
    assert_eq!(r.overall_code, Code::OverLimit as i32);
}
