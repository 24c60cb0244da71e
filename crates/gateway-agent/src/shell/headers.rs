//! Rate-limit response headers from a decision's limit statuses.
//!
//! - OpenAI style: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, from the
//!   most constraining enforce limit of each kind (reset as a Go-style duration such
//!   as `1s`, `6m0s` or `20ms`).
//! - IETF draft-ietf-httpapi-ratelimit-headers-09: `RateLimit-Policy` lists every
//!   enforce limit as `"name";q=<rate per window>;w=<window s>`, and `RateLimit` its
//!   state as `"name";r=<remaining>;t=<seconds to full>`.
//! - `Retry-After` (whole seconds, at least 1) on 429 and 503.

use crate::engine::{Decision, LimitStatus};
use crate::{Dimension, Engine, Mode};

/// Headers for a decision, as (name, value) pairs.
pub fn for_decision(engine: &Engine, d: &Decision) -> Vec<(&'static str, String)> {
    let mut out = Vec::with_capacity(9);
    let enforce = || d.limits().iter().filter(|l| l.mode == Mode::Enforce);
    let tightest = |tokens: bool| {
        enforce()
            .filter(|l| match l.dimension {
                Dimension::Requests => !tokens,
                Dimension::InputTokens | Dimension::OutputTokens | Dimension::TotalTokens => tokens,
                Dimension::Concurrency => false,
            })
            .min_by_key(|l| l.remaining())
            .copied()
    };
    for (kind, tokens) in [("requests", false), ("tokens", true)] {
        if let Some(l) = tightest(tokens) {
            let limit = l.rate().map_or(l.limit(), |(rate, _)| rate);
            out.push((header_name("limit", kind), limit.to_string()));
            out.push((header_name("remaining", kind), l.remaining().to_string()));
            out.push((header_name("reset", kind), go_duration(l.reset_after_ns())));
        }
    }
    let mut policy = Vec::new();
    let mut state = Vec::new();
    let rules = engine.rules();
    for l in enforce() {
        let name = &rules.rules()[l.rule_index()].name;
        match l.rate() {
            Some((rate, period_ns)) => policy.push(format!(
                "\"{name}\";q={rate};w={}",
                period_ns / 1_000_000_000
            )),
            None => policy.push(format!("\"{name}\";q={}", l.limit())),
        }
        state.push(format!(
            "\"{name}\";r={};t={}",
            l.remaining(),
            l.reset_after_ns().div_ceil(1_000_000_000)
        ));
    }
    if !policy.is_empty() {
        out.push(("ratelimit-policy", policy.join(", ")));
        out.push(("ratelimit", state.join(", ")));
    }
    out
}

fn header_name(what: &str, kind: &str) -> &'static str {
    match (what, kind) {
        ("limit", "requests") => "x-ratelimit-limit-requests",
        ("remaining", "requests") => "x-ratelimit-remaining-requests",
        ("reset", "requests") => "x-ratelimit-reset-requests",
        ("limit", _) => "x-ratelimit-limit-tokens",
        ("remaining", _) => "x-ratelimit-remaining-tokens",
        _ => "x-ratelimit-reset-tokens",
    }
}

/// Seconds for `Retry-After`: rounded up, at least 1 (unknown waits say 1).
pub fn retry_after_secs(ns: Option<u64>) -> u64 {
    ns.map_or(1, |ns| ns.div_ceil(1_000_000_000).max(1))
}

/// A duration as Go prints it (OpenAI's reset headers): `20ms`, `1s`, `1.5s`, `6m0s`,
/// `1h2m3s`.
pub fn go_duration(ns: u64) -> String {
    if ns == 0 {
        return "0s".into();
    }
    // Whole milliseconds, rounded up: 999.5 ms is `1s`, not `1000ms`.
    let total_ms = ns.div_ceil(1_000_000);
    if total_ms < 1000 {
        return format!("{total_ms}ms");
    }
    let (h, rem) = (total_ms / 3_600_000, total_ms % 3_600_000);
    let (m, rem) = (rem / 60_000, rem % 60_000);
    let (s, ms) = (rem / 1000, rem % 1000);
    let secs = if ms == 0 {
        format!("{s}s")
    } else {
        let frac = format!("{ms:03}");
        format!("{s}.{}s", frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

/// Whether the limit that tripped is a key with no budget granted (allocator mode,
/// rate 0): the fleet's condition, not the tenant's, answered 503 rather than 429.
pub fn no_budget(d: &Decision) -> bool {
    tripped(d).is_some_and(|l| matches!(l.rate(), Some((0, _))))
}

/// The status of the limit that tripped, if any.
pub fn tripped(d: &Decision) -> Option<&LimitStatus> {
    match d {
        Decision::Rejected(r) => r.limits.iter().find(|l| l.rule_index() == r.rule),
        Decision::Admitted(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_as_go_does() {
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(20_000_000), "20ms");
        assert_eq!(go_duration(999_000_001), "1s", "rounded up to a second");
        assert_eq!(go_duration(999_000_000), "999ms");
        assert_eq!(go_duration(1_000_000_000), "1s");
        assert_eq!(go_duration(1_500_000_000), "1.5s");
        assert_eq!(go_duration(360_000_000_000), "6m0s");
        assert_eq!(go_duration(3_723_000_000_000), "1h2m3s");
    }

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(None), 1);
        assert_eq!(retry_after_secs(Some(1)), 1);
        assert_eq!(retry_after_secs(Some(1_000_000_001)), 2);
    }
}
