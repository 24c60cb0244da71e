//! Shared fixtures for unit tests, the conformance suite, integration tests and
//! benchmarks. Deterministic: every generator takes a seed.

pub mod http;

use crate::event::{Body, Event, EventKey, HOUR_MS, Status, TokenDeltas, Tokens};

/// A usage event with status `ok`, origin `agent-a` and sequence number 0.
pub fn usage(
    request_id: &str,
    tenant: &str,
    model: &str,
    time_ms: u64,
    input_tokens: u64,
    cached_input_tokens: u64,
    output_tokens: u64,
) -> Event {
    Event {
        request_id: request_id.to_string(),
        origin: "agent-a".to_string(),
        seq: 0,
        tenant: tenant.to_string(),
        descriptors: Vec::new(),
        model: model.to_string(),
        time_ms,
        body: Body::Usage {
            status: Status::Ok,
            tokens: Tokens {
                input_tokens,
                cached_input_tokens,
                output_tokens,
            },
        },
    }
}

/// A correction of `target` in `target`'s bucket: a void, or an adjust by `deltas`.
pub fn correction(request_id: &str, target: &Event, deltas: Option<TokenDeltas>) -> Event {
    let t: EventKey = target.key();
    Event {
        request_id: request_id.to_string(),
        origin: "agent-b".to_string(),
        seq: 0,
        tenant: target.tenant.clone(),
        descriptors: Vec::new(),
        model: target.model.clone(),
        time_ms: target.time_ms,
        body: match deltas {
            None => Body::Void { target: t },
            Some(deltas) => Body::Adjust { target: t, deltas },
        },
    }
}

/// SplitMix64: a tiny seeded generator, so fixtures need no RNG crate.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// `n` distinct usage events (request ids `{prefix}-{i}`) over 4 tenants, 3 models and
/// the 48 hours before `now_ms`, from origin `origin` with sequence numbers `0..n`.
pub fn usage_stream(seed: u64, prefix: &str, origin: &str, n: u64, now_ms: u64) -> Vec<Event> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|i| {
            let input = rng.below(4000);
            let mut e = usage(
                &format!("{prefix}-{i}"),
                ["acme", "globex", "initech", "umbrella"][rng.below(4) as usize],
                ["gpt-4o", "claude", "llama"][rng.below(3) as usize],
                now_ms - rng.below(48 * HOUR_MS),
                input,
                input / 4,
                rng.below(1000),
            );
            e.origin = origin.to_string();
            e.seq = i;
            e.descriptors = vec![("key".into(), format!("k{}", rng.below(10)))];
            e
        })
        .collect()
}
