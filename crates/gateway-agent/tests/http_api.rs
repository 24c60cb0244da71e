//! The HTTP JSON API, against the real `bursar-agent` process on loopback.

mod common;

use common::{Agent, post, request};
use serde_json::json;

const RULES: &str = r#"
[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 3
per = "minute"

[[rule]]
name = "org-itpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 10000
per = "minute"
burst = 5000

[[rule]]
name = "org-otpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 10000
per = "minute"
max_output_tokens_default = 100
max_output_tokens_cap = 1000
"#;

fn admit(agent: &Agent, id: &str, org: &str, input: u64) -> common::Resp {
    post(
        agent.http,
        "/v1/admit",
        json!({
            "request_id": id,
            "descriptors": { "org": org },
            "cost": { "requests": 1, "input_tokens": input, "output_tokens": 200 }
        }),
    )
}

#[test]
fn admit_complete_and_the_rate_limit_headers() {
    let agent = Agent::start(RULES);
    let r = admit(&agent, "r1", "acme", 1000);
    assert_eq!(r.status, 200, "{}", r.body);
    let j = r.json();
    assert_eq!(j["admitted"], true);
    assert_eq!(j["replayed"], false);
    assert!(j["lease_expires_in_ms"].as_u64().unwrap() > 0);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("3"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("2"));
    assert_eq!(r.header("x-ratelimit-remaining-tokens"), Some("4000"));
    assert!(r.header("x-ratelimit-reset-requests").is_some());
    let policy = r.header("ratelimit-policy").unwrap();
    assert!(policy.contains("\"org-rpm\";q=3;w=60"), "{policy}");
    let state = r.header("ratelimit").unwrap();
    assert!(state.contains("\"org-rpm\";r=2;"), "{state}");

    let c = post(
        agent.http,
        "/v1/complete",
        json!({"request_id": "r1", "usage": {"input_tokens": 1000, "output_tokens": 20}}),
    );
    assert_eq!(c.status, 200, "{}", c.body);
    assert_eq!(c.json()["result"], "settled");
    let again = post(
        agent.http,
        "/v1/complete",
        json!({"request_id": "r1", "usage": {"input_tokens": 1000, "output_tokens": 20}}),
    );
    assert_eq!(again.json()["result"], "duplicate");
    assert_eq!(agent.leases_in_flight(), 0);
}

#[test]
fn a_tenant_over_its_limit_gets_429_with_retry_after_and_the_rule() {
    let agent = Agent::start(RULES);
    for i in 0..3 {
        let r = admit(&agent, &format!("r{i}"), "acme", 10);
        assert_eq!(r.status, 200, "{}", r.body);
        post(
            agent.http,
            "/v1/complete",
            json!({"request_id": format!("r{i}")}),
        );
    }
    let r = admit(&agent, "r3", "acme", 10);
    assert_eq!(r.status, 429, "{}", r.body);
    let j = r.json();
    assert_eq!(j["error"], "rate_limited");
    assert_eq!(j["rule"], "org-rpm");
    // 3 per minute: one request every 20 s.
    let retry_ms = j["retry_after_ms"].as_u64().unwrap();
    assert!((19_000..=20_000).contains(&retry_ms), "{retry_ms}");
    assert_eq!(r.header("retry-after"), Some("20"));
    assert_eq!(r.header("x-ratelimit-remaining-requests"), Some("0"));
    // Another tenant is unaffected.
    assert_eq!(admit(&agent, "o1", "other", 10).status, 200);
    post(agent.http, "/v1/complete", json!({"request_id": "o1"}));
    assert_eq!(agent.leases_in_flight(), 0);
}

#[test]
fn a_request_that_can_never_fit_is_400_not_429() {
    let agent = Agent::start(RULES);
    let r = admit(&agent, "big", "acme", 6000);
    assert_eq!(r.status, 400, "{}", r.body);
    let j = r.json();
    assert_eq!(j["error"], "never_fits");
    assert_eq!(j["rule"], "org-itpm");
    assert_eq!(j["burst"], 5000);
    assert_eq!(agent.leases_in_flight(), 0);
}

#[test]
fn a_retry_is_answered_from_its_lease_and_extend_moves_the_expiry() {
    let agent = Agent::start(RULES);
    assert_eq!(admit(&agent, "same", "acme", 10).status, 200);
    let again = admit(&agent, "same", "acme", 10);
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["replayed"], true);
    assert_eq!(again.header("x-ratelimit-remaining-requests"), Some("2"));
    let e = post(
        agent.http,
        "/v1/extend",
        json!({"request_id": "same", "ttl_ms": 600000}),
    );
    assert_eq!(e.status, 200, "{}", e.body);
    assert!(e.json()["lease_expires_in_ms"].as_u64().unwrap() > 500_000);
    let e = post(agent.http, "/v1/extend", json!({"request_id": "nope"}));
    assert_eq!(e.status, 404);
    post(agent.http, "/v1/complete", json!({"request_id": "same"}));
    assert_eq!(agent.leases_in_flight(), 0);
    // A late duplicate of the finished request's admission: refused, nothing charged.
    let late = admit(&agent, "same", "acme", 10);
    assert_eq!(late.status, 409, "{}", late.body);
    assert_eq!(late.json()["error"], "request_id_finished", "{}", late.body);
    assert_eq!(agent.leases_in_flight(), 0);
    let next = admit(&agent, "next", "acme", 10);
    assert_eq!(next.header("x-ratelimit-remaining-requests"), Some("1"));
}

#[test]
fn bad_input_is_a_clear_400_and_changes_nothing() {
    let agent = Agent::start(RULES);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("malformed JSON", b"{\"request_id\": ".to_vec(), 400, "malformed body"),
        ("missing field", br#"{"descriptors": {"org": "a"}}"#.to_vec(), 400, "missing field `request_id`"),
        (
            "unknown field",
            br#"{"request_id": "x", "descriptors": {"org": "a"}, "priority": 1}"#.to_vec(),
            400,
            "unknown field `priority`",
        ),
        (
            "negative number",
            br#"{"request_id": "x", "descriptors": {"org": "a"}, "cost": {"input_tokens": -5}}"#.to_vec(),
            400,
            "invalid value: integer `-5`",
        ),
        (
            "fractional number",
            br#"{"request_id": "x", "descriptors": {"org": "a"}, "cost": {"input_tokens": 1.5}}"#.to_vec(),
            400,
            "invalid type: floating point",
        ),
        (
            "absurd number",
            br#"{"request_id": "x", "descriptors": {"org": "a"}, "cost": {"input_tokens": 99999999999999}}"#.to_vec(),
            400,
            "cost is absurd",
        ),
        (
            "number past u64",
            br#"{"request_id": "x", "descriptors": {"org": "a"}, "cost": {"input_tokens": 184467440737095516150}}"#.to_vec(),
            400,
            "malformed body",
        ),
        (
            // Review (twenty-seventh session): read as org=b, silently.
            "a descriptor given twice",
            br#"{"request_id": "x", "descriptors": {"org": "a", "org": "b"}}"#.to_vec(),
            400,
            r#"descriptor \"org\" given twice"#,
        ),
        (
            "empty descriptors",
            br#"{"request_id": "x", "descriptors": {}}"#.to_vec(),
            400,
            "descriptors are empty",
        ),
        (
            "non-UTF-8",
            b"{\"request_id\": \"\xff\xfe\", \"descriptors\": {\"org\": \"a\"}}".to_vec(),
            400,
            "malformed body",
        ),
        (
            "unknown tenant",
            br#"{"request_id": "x", "descriptors": {"team": "a"}}"#.to_vec(),
            403,
            "no rule matches",
        ),
    ];
    for (what, body, status, needle) in cases {
        let r = request(agent.http, "POST", "/v1/admit", &body);
        assert_eq!(r.status, status, "{what}: {}", r.body);
        assert!(
            r.body.contains(needle),
            "{what}: {:?} lacks {needle:?}",
            r.body
        );
    }
    // Over the body limit: 413, nothing read into the engine.
    let huge = vec![b' '; 70 * 1024];
    assert_eq!(request(agent.http, "POST", "/v1/admit", &huge).status, 413);
    // Completion input.
    let r = post(agent.http, "/v1/complete", json!({"request_id": "never"}));
    assert_eq!(r.status, 404);
    let r = post(
        agent.http,
        "/v1/complete",
        json!({"request_id": "x", "status": "exploded"}),
    );
    assert_eq!(r.status, 400);
    assert!(r.body.contains("exploded"));
    // Nothing was admitted or held by any of it.
    assert_eq!(agent.leases_in_flight(), 0);
    let m = request(agent.http, "GET", "/metrics", b"");
    assert!(
        m.body
            .contains("bursar_decisions_total{result=\"admitted\"} 0"),
        "{}",
        m.body
    );
}

#[test]
fn health_and_metrics_answer() {
    let agent = Agent::start(RULES);
    let h = request(agent.http, "GET", "/healthz", b"");
    assert_eq!((h.status, h.body.as_str()), (200, "ok\n"));
    admit(&agent, "m1", "acme", 10);
    let m = request(agent.http, "GET", "/metrics", b"");
    assert!(
        m.body
            .contains("bursar_admitted_units_total{rule=\"org-itpm\"} 10"),
        "{}",
        m.body
    );
    assert!(m.body.contains("bursar_leases_in_flight 1"));
    post(agent.http, "/v1/complete", json!({"request_id": "m1"}));
    assert_eq!(agent.leases_in_flight(), 0);
}

/// SIGHUP re-reads the rules: a file that cannot be read, or that changes more than a
/// rule's numbers, is refused (counted) and the rules in force stay; new numbers apply
/// to the next decision, a lowered limit at once and without a fresh burst.
#[test]
fn sighup_reloads_the_numbers_of_the_rules_and_refuses_the_rest() {
    let agent = Agent::start(RULES);
    let applied = "bursar_rules_reloads_total{result=\"applied\"} ";
    let refused = "bursar_rules_reloads_total{result=\"refused\"} ";
    for i in 0..3 {
        assert_eq!(admit(&agent, &format!("a{i}"), "acme", 10).status, 200);
    }
    assert_eq!(admit(&agent, "a3", "acme", 10).status, 429, "3 a minute");

    // Not TOML: refused, nothing changed.
    agent.rewrite_config("[[rule]\nname = ");
    agent.hup();
    assert_eq!(agent.wait_metric(refused, 1), 1);
    // A rule renamed: refused too.
    agent.rewrite_config(&RULES.replace("org-otpm", "org-output"));
    agent.hup();
    assert_eq!(agent.wait_metric(refused, 2), 2);
    assert_eq!(agent.metric(applied), 0);
    assert_eq!(
        admit(&agent, "a4", "acme", 10).status,
        429,
        "still 3 a minute"
    );

    // The request limit to 600 a minute: the bucket is not refilled by the reload
    // (the next request waits for the new rate's next unit, 100 ms), and the
    // headers show the new limit.
    let version = |agent: &Agent| {
        let m = request(agent.http, "GET", "/metrics", b"").body;
        m.lines()
            .find_map(|l| l.strip_prefix("bursar_rules_info{version=\""))
            .and_then(|l| l.split('"').next())
            .map(String::from)
            .expect("bursar_rules_info")
    };
    let before = version(&agent);
    agent.rewrite_config(&RULES.replace("rate = 3\n", "rate = 600\n"));
    agent.hup();
    assert_eq!(agent.wait_metric(applied, 1), 1);
    assert_ne!(version(&agent), before, "the version follows the reload");
    std::thread::sleep(std::time::Duration::from_millis(250));
    let r = admit(&agent, "a5", "acme", 10);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("600"));
    let remaining: u64 = r
        .header("x-ratelimit-remaining-requests")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        remaining < 10,
        "refilled at 10 a second, not to 600: {remaining}"
    );
    assert_eq!(agent.metric(refused), 2);
    // Reservations taken under the old numbers settle under the new ones.
    for id in ["a0", "a1", "a2", "a5"] {
        let c = post(
            agent.http,
            "/v1/complete",
            json!({"request_id": id, "usage": {"input_tokens": 10, "output_tokens": 5}}),
        );
        assert_eq!(c.json()["result"], "settled", "{id}: {}", c.body);
    }
    assert_eq!(agent.leases_drained(), 0);
}

/// `--watch-config-ms`: a changed file is reloaded without a signal (a mounted
/// ConfigMap), once per change; a file that is refused is not retried until it
/// changes again.
#[test]
fn a_watched_config_file_reloads_when_it_changes() {
    let agent = Agent::start_with(RULES, &["--watch-config-ms", "50"]);
    let applied = "bursar_rules_reloads_total{result=\"applied\"} ";
    let refused = "bursar_rules_reloads_total{result=\"refused\"} ";
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(
        agent.metric(applied),
        0,
        "an unchanged file is not reloaded"
    );
    agent.rewrite_config(&RULES.replace("rate = 3\n", "rate = 600\n"));
    assert_eq!(agent.wait_metric(applied, 1), 1);
    let r = admit(&agent, "w1", "acme", 10);
    assert_eq!(r.header("x-ratelimit-limit-requests"), Some("600"));
    agent.rewrite_config(&RULES.replace("org-rpm", "org-requests"));
    assert_eq!(agent.wait_metric(refused, 1), 1);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(agent.metric(refused), 1, "a refused file is read once");
    assert_eq!(agent.metric(applied), 1);
}
