//! Digests per (tenant, hour) bucket, rolled up to a root.
//!
//! A digest is a sum over the bucket's events, in wrapping (mod 2^64 / 2^128)
//! arithmetic: the event count, the correction count, the token sums of its usage
//! events, and the sum of the events' element hashes ([`crate::event::element_hash`]).
//! Addition is commutative and has an inverse, so a digest depends only on the set of
//! events, never on the order they arrived in, and an insert or a conflict replacement
//! updates it in O(1). The root is the sum of every bucket's digest.
//!
//! Two nodes with equal digests for a bucket hold the same events there (up to a
//! 2^-128 hash collision); unequal digests say which buckets to reconcile.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::event::{Body, Event, hex};

/// A (tenant, hour) bucket: `hour` is `time_ms / HOUR_MS`.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bucket {
    /// Hours since the unix epoch.
    pub hour: u64,
    /// The tenant.
    pub tenant: String,
}

impl Bucket {
    /// The bucket an event lands in.
    pub fn of(e: &Event) -> Bucket {
        Bucket {
            hour: e.hour(),
            tenant: e.tenant.clone(),
        }
    }
}

/// The digest of a set of events. See the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Digest {
    /// Events (usage and corrections).
    pub events: u64,
    /// Of which corrections (`void`, `adjust`).
    pub corrections: u64,
    /// Sum of `input_tokens` over usage events (corrections not applied).
    pub input_tokens: u128,
    /// Sum of `cached_input_tokens` over usage events.
    pub cached_input_tokens: u128,
    /// Sum of `output_tokens` over usage events.
    pub output_tokens: u128,
    /// Sum of element hashes, mod 2^128.
    pub hash: u128,
}

/// Size of [`Digest::to_bytes`].
pub const DIGEST_BYTES: usize = 8 * 2 + 16 * 4;

impl Digest {
    /// The digest of one event whose element hash is `element_hash`.
    pub fn of_event(e: &Event, element_hash: u128) -> Digest {
        let mut d = Digest {
            events: 1,
            hash: element_hash,
            ..Digest::default()
        };
        match &e.body {
            Body::Usage { tokens, .. } => {
                d.input_tokens = u128::from(tokens.input_tokens);
                d.cached_input_tokens = u128::from(tokens.cached_input_tokens);
                d.output_tokens = u128::from(tokens.output_tokens);
            }
            Body::Void { .. } | Body::Adjust { .. } => d.corrections = 1,
        }
        d
    }

    /// `self + other`.
    pub fn add(&mut self, o: &Digest) {
        self.events = self.events.wrapping_add(o.events);
        self.corrections = self.corrections.wrapping_add(o.corrections);
        self.input_tokens = self.input_tokens.wrapping_add(o.input_tokens);
        self.cached_input_tokens = self.cached_input_tokens.wrapping_add(o.cached_input_tokens);
        self.output_tokens = self.output_tokens.wrapping_add(o.output_tokens);
        self.hash = self.hash.wrapping_add(o.hash);
    }

    /// `self - other`.
    pub fn sub(&mut self, o: &Digest) {
        self.events = self.events.wrapping_sub(o.events);
        self.corrections = self.corrections.wrapping_sub(o.corrections);
        self.input_tokens = self.input_tokens.wrapping_sub(o.input_tokens);
        self.cached_input_tokens = self.cached_input_tokens.wrapping_sub(o.cached_input_tokens);
        self.output_tokens = self.output_tokens.wrapping_sub(o.output_tokens);
        self.hash = self.hash.wrapping_sub(o.hash);
    }

    /// True for the digest of the empty set.
    pub fn is_empty(&self) -> bool {
        *self == Digest::default()
    }

    /// Fixed-size little-endian encoding (for the store).
    pub fn to_bytes(&self) -> [u8; DIGEST_BYTES] {
        let mut out = [0u8; DIGEST_BYTES];
        out[0..8].copy_from_slice(&self.events.to_le_bytes());
        out[8..16].copy_from_slice(&self.corrections.to_le_bytes());
        out[16..32].copy_from_slice(&self.input_tokens.to_le_bytes());
        out[32..48].copy_from_slice(&self.cached_input_tokens.to_le_bytes());
        out[48..64].copy_from_slice(&self.output_tokens.to_le_bytes());
        out[64..80].copy_from_slice(&self.hash.to_le_bytes());
        out
    }

    /// Inverse of [`Digest::to_bytes`]; `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Digest> {
        if b.len() != DIGEST_BYTES {
            return None;
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u128_at = |i: usize| u128::from_le_bytes(b[i..i + 16].try_into().expect("16 bytes"));
        Some(Digest {
            events: u64_at(0),
            corrections: u64_at(8),
            input_tokens: u128_at(16),
            cached_input_tokens: u128_at(32),
            output_tokens: u128_at(48),
            hash: u128_at(64),
        })
    }

    /// The hash as 32 hex characters.
    pub fn hash_hex(&self) -> String {
        hex(&self.hash.to_be_bytes())
    }

    /// JSON for the HTTP API (the hash as hex).
    pub fn to_json(&self) -> Value {
        json!({
            "events": self.events,
            "corrections": self.corrections,
            "input_tokens": exact_json(self.input_tokens),
            "cached_input_tokens": exact_json(self.cached_input_tokens),
            "output_tokens": exact_json(self.output_tokens),
            "hash": self.hash_hex(),
        })
    }
}

/// A sum as JSON, exactly: a number up to `u64::MAX`, a decimal string above (serde_json
/// holds no larger integer: `json!` of such a `u128` panicked, and every node that
/// held the sums lost its `/v1/digest` and `/v1/usage`).
pub fn exact_json(n: u128) -> Value {
    match u64::try_from(n) {
        Ok(n) => Value::from(n),
        Err(_) => Value::String(n.to_string()),
    }
}

/// Digests of every bucket plus their root, kept in memory. The in-memory store keeps
/// one; the redb store keeps the same numbers in tables and uses this as a per-batch
/// delta.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DigestSet {
    buckets: BTreeMap<Bucket, Digest>,
    root: Digest,
}

impl DigestSet {
    /// Adds `d` to `bucket`.
    pub fn add(&mut self, bucket: &Bucket, d: &Digest) {
        self.root.add(d);
        // Look up before cloning the bucket: most adds hit an existing one.
        let entry = match self.buckets.get_mut(bucket) {
            Some(e) => e,
            None => self.buckets.entry(bucket.clone()).or_default(),
        };
        entry.add(d);
        if entry.is_empty() {
            self.buckets.remove(bucket);
        }
    }

    /// Subtracts `d` from `bucket`.
    pub fn sub(&mut self, bucket: &Bucket, d: &Digest) {
        let mut neg = Digest::default();
        neg.sub(d);
        self.add(bucket, &neg);
    }

    /// The root: the sum of every bucket.
    pub fn root(&self) -> Digest {
        self.root
    }

    /// Every non-empty bucket, in (hour, tenant) order.
    pub fn buckets(&self) -> &BTreeMap<Bucket, Digest> {
        &self.buckets
    }

    /// Panics if the root is not the sum of the buckets or an empty bucket is kept
    /// (bugs, not operating errors).
    pub fn check_invariants(&self) {
        let mut sum = Digest::default();
        for d in self.buckets.values() {
            assert!(!d.is_empty(), "an empty bucket digest is kept");
            sum.add(d);
        }
        assert_eq!(sum, self.root, "root is not the sum of the bucket digests");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{HOUR_MS, element_hash};
    use crate::testing::usage;

    #[test]
    fn adding_then_subtracting_an_event_leaves_the_empty_digest() {
        let e = usage("r", "acme", "m", 5 * HOUR_MS, 10, 3, 4);
        let d = Digest::of_event(&e, element_hash(&e.encode()));
        let mut set = DigestSet::default();
        set.add(&Bucket::of(&e), &d);
        assert_eq!(set.root(), d);
        set.sub(&Bucket::of(&e), &d);
        assert!(set.root().is_empty());
        assert!(set.buckets().is_empty());
        set.check_invariants();
    }

    #[test]
    fn a_digest_survives_its_byte_encoding() {
        let d = Digest {
            events: 3,
            corrections: 1,
            input_tokens: u128::MAX - 1,
            cached_input_tokens: 7,
            output_tokens: 9,
            hash: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
        };
        assert_eq!(Digest::from_bytes(&d.to_bytes()), Some(d));
        assert_eq!(Digest::from_bytes(&[0u8; 3]), None);
    }

    /// Sums past `u64::MAX` (2^24 events of 2^40 tokens) panicked in `to_json`; they
    /// are written exactly, as decimal strings, and smaller ones stay numbers.
    #[test]
    fn sums_past_u64_are_written_exactly_as_strings() {
        let d = Digest {
            input_tokens: u128::from(u64::MAX) + 1,
            output_tokens: u128::from(u64::MAX),
            ..Default::default()
        };
        let v = d.to_json();
        assert_eq!(v["input_tokens"], "18446744073709551616");
        assert_eq!(v["output_tokens"], u64::MAX);
        let t = crate::totals::Totals {
            cached_input_tokens: u128::MAX,
            ..Default::default()
        };
        let v = t.to_json();
        assert_eq!(
            v["cached_input_tokens"],
            "340282366920938463463374607431768211455"
        );
        assert_eq!(v["input_tokens"], 0);
    }
}
