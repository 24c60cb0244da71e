//! Fixtures shared by unit tests, property tests, the conformance test and benchmarks.

pub mod fleet;

use bursar_agent::Config;

use crate::config::AllocatorConfig;
use crate::core::Allocator;
use crate::msg::{Ack, Grant, HeldGrant, Hello, KeyName, KeyReport, Measure, Report, SliceAck};

/// Nanoseconds per millisecond.
pub const MS: u64 = 1_000_000;

/// Nanoseconds per second.
pub const SEC: u64 = 1_000_000_000;

/// Rules used by the tests: one rule per posture and a concurrency rule, all small
/// enough to reason about by hand (per second).
pub const RULES: &str = r#"
[engine]
slice_source = "allocated"

[[rule]]
name = "rps"
match = { org = "*" }
dimension = "requests"
rate = 1000
per = "second"
burst = 1000
posture = "conservative"

[[rule]]
name = "strict-rps"
match = { org = "*" }
dimension = "requests"
rate = 1000
per = "second"
burst = 500
posture = "strict"

[[rule]]
name = "open-rps"
match = { org = "*" }
dimension = "requests"
rate = 1000
per = "second"
burst = 500
posture = "open"

[[rule]]
name = "conc"
match = { org = "*" }
dimension = "concurrency"
max_in_flight = 10
"#;

/// The test rules, parsed.
pub fn rules() -> Config {
    Config::from_toml(RULES).expect("fixture rules are valid")
}

/// Settings with a 1 s lease and 100 ms margins, so tests run in few virtual seconds.
pub fn quick_config() -> AllocatorConfig {
    AllocatorConfig {
        lease_ms: 1_000,
        drift_margin_ms: 50,
        reclaim_margin_ms: 100,
        demand_half_life_ms: 200,
        ..AllocatorConfig::default()
    }
}

/// An allocator over [`RULES`] with [`quick_config`], term `term`, past its learning
/// period at `now` (it was started one lease earlier).
pub fn warm_allocator(term: u64, now: u64) -> Allocator {
    warm_allocator_with(&rules(), quick_config(), term, now)
}

/// An allocator over `rules` with `cfg`, term `term`, past its learning period at `now`
/// (it was started one lease and margin earlier).
pub fn warm_allocator_with(rules: &Config, cfg: AllocatorConfig, term: u64, now: u64) -> Allocator {
    let start = now.saturating_sub(MS * (cfg.lease_ms + cfg.reclaim_margin_ms));
    let mut a = Allocator::new(rules, cfg, term, start).expect("valid config");
    a.handle_timeout(now);
    a
}

/// A key of rule `rule` for org `org`.
pub fn key(rule: &str, org: &str) -> KeyName {
    KeyName::new(rule, &[org])
}

/// A hello from a new incarnation holding nothing, its report interval not said.
pub fn hello(agent: &str, incarnation: u64, agent_time_ns: u64) -> Hello {
    Hello {
        agent: agent.into(),
        incarnation,
        agent_time_ns,
        weight: 1,
        report_interval_ms: 0,
        held: vec![],
        grants_by_handle: false,
        rule_shapes: Vec::new(),
    }
}

/// One key's line in a report.
pub fn line(key: KeyName, admitted: u64, rejected: u64, held: Option<HeldGrant>) -> KeyReport {
    KeyReport {
        key,
        admitted,
        rejected,
        counting_since_ns: 0,
        in_flight: 0,
        held,
        key_handle: 0,
    }
}

/// A report.
pub fn report(agent: &str, incarnation: u64, agent_time_ns: u64, keys: Vec<KeyReport>) -> Report {
    Report {
        agent: agent.into(),
        incarnation,
        agent_time_ns,
        keys,
        measure: Measure::None,
    }
}

/// An ack of `g` with `released` tokens.
pub fn ack(g: &Grant, incarnation: u64, released: u64) -> Ack {
    Ack {
        agent: g.agent.to_string(),
        incarnation,
        slices: vec![SliceAck {
            key: (*g.key).clone(),
            epoch: g.epoch,
            seq: g.seq,
            released_tokens: released,
            in_flight: 0,
            key_handle: 0,
        }],
    }
}
