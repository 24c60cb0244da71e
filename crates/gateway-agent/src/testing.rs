//! Fixtures shared by unit tests, integration tests, benchmarks and the demo.

use std::sync::Arc;

use crate::engine::SliceUpdate;
use crate::{Config, Cost, DiscardSink, Engine, KeyHandle, Usage, UsageSink};

/// The demo's embedded rules: an LLM tenant layout with an org ceiling over per-key
/// limits, three token dimensions, concurrency and a shadow rule.
pub const DEMO_RULES: &str = r#"
[engine]
max_keys = 100_000
max_leases = 65_536

[[rule]]
name = "org-rpm"
match = { org = "*" }
dimension = "requests"
rate = 600
per = "minute"
burst = 100

[[rule]]
name = "org-input-tpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 2_000_000
per = "minute"
burst = 200_000

[[rule]]
name = "key-input-tpm"
parent = "org-input-tpm"
match = { org = "*", key = "*" }
dimension = "input_tokens"
rate = 500_000
per = "minute"
burst = 60_000

[[rule]]
name = "org-output-tpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 400_000
per = "minute"
burst = 50_000
max_output_tokens_default = 512
max_output_tokens_cap = 4_096

[[rule]]
name = "org-concurrency"
match = { org = "*" }
dimension = "concurrency"
max_in_flight = 64

[[rule]]
name = "org-total-tpm-shadow"
match = { org = "*" }
dimension = "total_tokens"
rate = 1_500_000
per = "minute"
mode = "shadow"
"#;

/// Allocated slices (nothing admitted before a grant): a rate rule on `org` (100 a
/// second, burst 10) and a concurrency rule on `team` (8 slots). The sync client's
/// tests (`tests/sync.rs`, `tests/sync_core.rs`).
pub const ALLOCATED_SYNC: &str = r#"
[engine]
slice_source = "allocated"

[[rule]]
name = "org-rps"
match = { org = "*" }
dimension = "requests"
rate = 100
per = "second"
burst = 10

[[rule]]
name = "team-conc"
match = { team = "*" }
dimension = "concurrency"
max_in_flight = 8
"#;

/// Three rate rules (requests, input tokens, output tokens) on one `org` key: the
/// shape of the 3-dimension admit benchmark. The rates are high enough (10^12 units a
/// second, burst the same) that a benchmark admitting millions of requests a second
/// never drains them: it measures admissions, not rejections.
pub const THREE_DIMENSIONS: &str = r#"
[engine]
unmatched = "reject"

[[rule]]
name = "rpm"
match = { org = "*" }
dimension = "requests"
rate = 1_000_000_000_000
per = "second"

[[rule]]
name = "itpm"
match = { org = "*" }
dimension = "input_tokens"
rate = 1_000_000_000_000
per = "second"

[[rule]]
name = "otpm"
match = { org = "*" }
dimension = "output_tokens"
rate = 1_000_000_000_000
per = "second"
"#;

/// The 3-dimension benchmark's request descriptors (its rules match `org`).
pub const THREE_DIMENSIONS_DESCRIPTORS: [(&str, &str); 3] =
    [("org", "acme"), ("key", "k-123"), ("model", "gpt-4o")];

/// The 3-dimension benchmark's cost: one request, 900 input tokens, 512 output
/// tokens reserved.
pub const THREE_DIMENSIONS_COST: Cost = Cost {
    requests: 1,
    input_tokens: 900,
    max_output_tokens: Some(512),
};

/// The 3-dimension benchmark's completion: 200 of the 512 output tokens used (the
/// rest refunded).
pub const THREE_DIMENSIONS_USAGE: Usage = Usage {
    input_tokens: 900,
    cached_input_tokens: 0,
    output_tokens: 200,
};

/// An engine over `toml`, discarding usage records. Panics on an invalid config (a
/// fixture bug).
pub fn engine(toml: &str) -> Arc<Engine> {
    engine_with_sink(toml, Arc::new(DiscardSink))
}

/// An engine over `toml` with the given sink.
pub fn engine_with_sink(toml: &str, sink: Arc<dyn UsageSink>) -> Arc<Engine> {
    Arc::new(Engine::new(
        Config::from_toml(toml).expect("fixture config is valid"),
        sink,
    ))
}

/// An exact token bucket `(rate per period, burst)` to check that admissions conform
/// (DESIGN.md, "The overshoot contract"): it starts full, refills continuously, and is
/// charged whatever the engine admitted. The level is kept in token x period-ns units,
/// so refill is integral and nothing is rounded. `worst_deficit` is how far the level
/// ever went below zero beyond the engine's stated rounding slack (two ns of refill,
/// `bucket.rs`): at most 0 means every window conformed.
#[derive(Debug, Clone)]
pub struct ExactBucket {
    level: i128,
    rate: i128,
    burst: i128,
    period_ns: i128,
    at: u64,
    slack: i128,
    worst: i128,
}

impl ExactBucket {
    /// A full bucket at `start_ns`.
    pub fn new(rate: u64, burst: u64, period_ns: u64, start_ns: u64) -> ExactBucket {
        let (rate, burst, period_ns) = (rate as i128, burst as i128, period_ns as i128);
        ExactBucket {
            level: burst * period_ns,
            rate,
            burst,
            period_ns,
            at: start_ns,
            slack: 2 * rate,
            worst: i128::MIN,
        }
    }

    /// Refills up to `t` (times must not go back).
    pub fn advance(&mut self, t: u64) {
        let dt = t.saturating_sub(self.at) as i128;
        self.level = (self.level + dt * self.rate).min(self.burst * self.period_ns);
        self.at = self.at.max(t);
    }

    /// Charges `cost` units.
    pub fn charge(&mut self, cost: u64) {
        self.level -= cost as i128 * self.period_ns;
        self.worst = self.worst.max(-self.level - self.slack);
    }

    /// Charges `cost` units already spent (usage beyond a reservation, known only at
    /// completion): the level may go below zero without counting as a deficit, and a
    /// later admission that finds it unpaid does.
    pub fn charge_spent(&mut self, cost: u64) {
        self.level -= cost as i128 * self.period_ns;
    }

    /// A new slice: shrinking clamps the level, growing does not raise it (invariant 2).
    pub fn reslice(&mut self, rate: u64, burst: u64) {
        self.rate = rate as i128;
        self.burst = burst as i128;
        self.level = self.level.min(self.burst * self.period_ns);
        self.slack = self.slack.max(2 * self.rate);
    }

    /// A limit for a key the engine does not hold (never met, or evicted at rest):
    /// when next met it starts full at its limit, as any new key does.
    pub fn restart_full(&mut self, rate: u64, burst: u64) {
        self.rate = rate as i128;
        self.burst = burst as i128;
        self.level = self.burst * self.period_ns;
        self.slack = self.slack.max(2 * self.rate);
    }

    /// The worst deficit beyond the slack, in token x period-ns units (`i128::MIN`
    /// before any charge).
    pub fn worst_deficit(&self) -> i128 {
        self.worst
    }

    /// [`ExactBucket::worst_deficit`] in tokens.
    pub fn worst_deficit_tokens(&self) -> f64 {
        self.worst as f64 / self.period_ns as f64
    }
}

/// One `requests` rule with a key per distinct `k` value, rate and burst high enough
/// that every check is admitted: the shape of the keyed-check benchmarks (10,000 keys).
pub const KEYED: &str = r#"
[engine]
max_keys = 20_000
[[rule]]
name = "rps"
match = { k = "*" }
dimension = "requests"
rate = 4_000_000_000
per = "second"
burst = 4_000_000_000
"#;

/// An engine with [`KEYED`] and `keys` warm keys (`key-0`, `key-1`, ...): each created
/// through the slow path once and published, so checks on their handles take the
/// decision path. What the keyed-check benchmarks measure.
pub fn keyed_engine(keys: usize) -> (Arc<Engine>, Vec<KeyHandle>) {
    let e = engine(KEYED);
    let handles: Vec<KeyHandle> = (0..keys)
        .map(|i| e.key_handle("rps", &[&format!("key-{i}")]).expect("rule"))
        .collect();
    let mut w = e.worker();
    for h in &handles {
        assert!(w.try_acquire(0, h, 1).expect("ok"));
    }
    e.maintain(0);
    (e, handles)
}

/// A grant for [`KEYED`]'s key `key-{key}` with seq `seq`, its rate differing with the
/// seq's parity so that each one applied replaces the key's slot (and republishes the
/// table); its lease runs for ever.
pub fn keyed_grant(key: usize, seq: u64) -> SliceUpdate {
    SliceUpdate {
        rule: "rps".into(),
        values: vec![format!("key-{key}")],
        rate: 1_000_000 + seq % 2,
        burst: 1_000_000,
        epoch: 1,
        seq,
        lease_expires_at_ns: u64::MAX / 2,
        fleet_size: 1,
        transfer_tokens: 0,
    }
}

/// Request ids that are new every time, without allocating: `req-` and a counter in
/// hexadecimal. A finished id is not admitted again while the engine remembers it
/// (`AdmitError::RequestIdFinished`), so loops that admit and complete take a new
/// one per request, as real traffic does (each completion then leaves a tombstone).
#[derive(Debug, Default)]
pub struct FreshIds {
    n: u64,
    buf: [u8; 20],
}

impl FreshIds {
    /// The next id.
    pub fn next_id(&mut self) -> &str {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        self.buf[..4].copy_from_slice(b"req-");
        for (i, b) in self.buf[4..].iter_mut().enumerate() {
            *b = HEX[((self.n >> (60 - 4 * i)) & 0xf) as usize];
        }
        self.n += 1;
        std::str::from_utf8(&self.buf).expect("ASCII")
    }
}

#[cfg(test)]
mod fresh_ids_tests {
    use super::FreshIds;

    #[test]
    fn each_id_is_new() {
        let mut ids = FreshIds::default();
        assert_eq!(ids.next_id(), "req-0000000000000000");
        assert_eq!(ids.next_id(), "req-0000000000000001");
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            assert!(seen.insert(ids.next_id().to_string()));
        }
    }
}
