//! Limit keys: a rule plus the descriptor values its `*` entries matched.

use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;

/// A limit key: the unit of allocation. Created on the slow path (new keys only).
#[derive(Debug, PartialEq, Eq)]
pub struct LimitKey {
    /// Hash identity inside one engine (seeded per engine; see [`KeyHashing`]).
    pub(crate) id: u64,
    /// A second, independent hash of (rule, values).
    pub(crate) check: u64,
    /// Index of the rule in the rule set.
    pub(crate) rule: u32,
    /// Values matched by the rule's `*` entries, in the rule's match-key order.
    pub(crate) values: Arc<[Box<str>]>,
    /// `rule{k=v,...}` for logs, metrics and usage records.
    pub(crate) display: Box<str>,
}

impl LimitKey {
    /// Index of the rule this key belongs to.
    pub fn rule_index(&self) -> usize {
        self.rule as usize
    }

    /// Values matched by the rule's `*` entries, in the rule's match-key order.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        self.values.iter().map(|v| &**v)
    }

    /// The key as `rule{key=value,...}` (every match entry, exact ones included).
    pub fn as_str(&self) -> &str {
        &self.display
    }

    #[cfg(test)]
    pub(crate) fn for_tests(name: &str) -> LimitKey {
        LimitKey {
            id: 0,
            check: 0,
            rule: 0,
            values: Arc::new([]),
            display: name.into(),
        }
    }
}

impl fmt::Display for LimitKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display)
    }
}

const RULE_MIX_ID: u64 = 0x9e37_79b9_7f4a_7c15;
const RULE_MIX_CHECK: u64 = 0xd6e8_feb8_6659_fd93;

/// The value hashes of the last key looked up during one request: consecutive rules
/// that matched the same descriptor values (an org's request, input and output token
/// limits all match `org`) reuse them. Compared by the values' addresses and lengths,
/// which are the request's own descriptor strings.
///
/// It remembers at most [`MEMO_VALUES`] values (a rule matching more hashes its values
/// every time): built per request, a memo sized for `MAX_DESCRIPTORS` was a 264-byte
/// `memset` on every admission.
#[derive(Default)]
pub(crate) struct KeyMemo {
    values: [(usize, usize); MEMO_VALUES],
    n: usize,
    hashes: Option<(u64, u64)>,
}

/// Most values a [`KeyMemo`] remembers.
const MEMO_VALUES: usize = 4;

impl KeyMemo {
    /// The value hashes of `values`, computed at most once while they repeat.
    #[inline]
    pub(crate) fn hashes(&mut self, hashing: &KeyHashing, values: &[&str]) -> (u64, u64) {
        if let Some(h) = self.hashes
            && self.n == values.len()
            && self.values[..self.n]
                .iter()
                .zip(values)
                .all(|(&(p, l), v)| p == v.as_ptr() as usize && l == v.len())
        {
            return h;
        }
        let h = hashing.values_hashes(values);
        if values.len() > MEMO_VALUES {
            self.hashes = None;
            return h;
        }
        for (slot, v) in self.values.iter_mut().zip(values) {
            *slot = (v.as_ptr() as usize, v.len());
        }
        self.n = values.len();
        self.hashes = Some(h);
        h
    }
}

/// Seeded hashing for key ids and request ids. The seed is random per engine, so ids
/// are not predictable from outside and collisions cannot be aimed at.
#[derive(Clone)]
pub(crate) struct KeyHashing {
    keys: foldhash::fast::RandomState,
    checks: foldhash::fast::RandomState,
    ids_lo: foldhash::quality::RandomState,
    ids_hi: foldhash::quality::RandomState,
}

impl KeyHashing {
    pub(crate) fn new() -> KeyHashing {
        KeyHashing {
            keys: foldhash::fast::RandomState::default(),
            checks: foldhash::fast::RandomState::default(),
            ids_lo: foldhash::quality::RandomState::default(),
            ids_hi: foldhash::quality::RandomState::default(),
        }
    }

    /// Id of the limit key (rule, values).
    #[inline]
    pub(crate) fn key_id<'a>(&self, rule: u32, values: impl Iterator<Item = &'a str>) -> u64 {
        Self::with_rule(Self::hash_values(&self.keys, values), rule, RULE_MIX_ID)
    }

    /// The key's check hash (independently seeded).
    #[inline]
    pub(crate) fn key_check<'a>(&self, rule: u32, values: impl Iterator<Item = &'a str>) -> u64 {
        Self::with_rule(
            Self::hash_values(&self.checks, values),
            rule,
            RULE_MIX_CHECK,
        )
    }

    /// Both seeded hashes of a key's values, before the rule is mixed in: requests
    /// whose rules match the same descriptor values hash them once (the decision path
    /// keeps them in a [`KeyMemo`]).
    #[inline]
    pub(crate) fn values_hashes(&self, values: &[&str]) -> (u64, u64) {
        (
            Self::hash_values(&self.keys, values.iter().copied()),
            Self::hash_values(&self.checks, values.iter().copied()),
        )
    }

    /// (id, check) of the key (rule, values) from [`KeyHashing::values_hashes`].
    #[inline]
    pub(crate) fn ids_from(hashes: (u64, u64), rule: u32) -> (u64, u64) {
        (
            Self::with_rule(hashes.0, rule, RULE_MIX_ID),
            Self::with_rule(hashes.1, rule, RULE_MIX_CHECK),
        )
    }

    /// Values are written with their lengths so that ("ab","c") and ("a","bc") differ.
    #[inline]
    fn hash_values<'a>(
        state: &foldhash::fast::RandomState,
        values: impl Iterator<Item = &'a str>,
    ) -> u64 {
        let mut h = state.build_hasher();
        for v in values {
            h.write_usize(v.len());
            h.write(v.as_bytes());
        }
        h.finish()
    }

    /// Mixes the rule into a seeded hash of the values: for one rule a bijection of the
    /// hash (distinct values collide only if their seeded hashes do); across rules the
    /// offset differs. The finalizer is MurmurHash3's `fmix64`.
    #[inline]
    fn with_rule(h: u64, rule: u32, k: u64) -> u64 {
        let mut x = h ^ (rule as u64 + 1).wrapping_mul(k);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^ (x >> 33)
    }

    /// 128-bit id of a request id: two independently seeded hashes. Leases are keyed by
    /// it; the id string itself is stored in the lease and compared on lookup.
    #[inline]
    pub(crate) fn request_hash(&self, request_id: &str) -> u128 {
        let lo = self.ids_lo.hash_one(request_id);
        let hi = self.ids_hi.hash_one(request_id);
        ((hi as u128) << 64) | lo as u128
    }
}

/// A hasher for keys that are already uniform hashes: passes the value through.
#[derive(Default, Clone, Copy)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only used with u64/u128 keys; fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
    #[inline]
    fn write_u128(&mut self, n: u128) {
        self.0 = (n as u64) ^ ((n >> 64) as u64);
    }
}

/// `BuildHasher` for [`PassThrough`].
pub(crate) type PassThroughState = BuildHasherDefault<PassThrough>;
