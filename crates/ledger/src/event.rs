//! The usage event: an immutable, integer-only record of one request's usage, or a
//! correction (`void`, `adjust`) pointing at an earlier event.
//!
//! An event has one canonical binary encoding ([`Event::encode`]). It is what the store
//! keeps, what the element hash of the digests covers, and what the conflict rule
//! compares, so every node that holds the same events holds the same bytes.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// Milliseconds in one hour: the width of a digest bucket.
pub const HOUR_MS: u64 = 3_600_000;

/// Identity of an event: the first 16 bytes of SHA-256 over a domain tag and the
/// request id. Two events with the same request id have the same key; the ledger keeps
/// one of them (see [`crate::merge`]).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventKey(pub [u8; 16]);

impl EventKey {
    /// The key of the event whose request id is `request_id`.
    pub fn from_request_id(request_id: &str) -> EventKey {
        let mut h = Sha256::new();
        h.update(b"bursar-ledger/v1/event-key\0");
        h.update(request_id.as_bytes());
        let out = h.finalize();
        let mut key = [0u8; 16];
        key.copy_from_slice(&out[..16]);
        EventKey(key)
    }

    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 32 hex characters.
    pub fn from_hex(s: &str) -> Option<EventKey> {
        let b = s.as_bytes();
        if b.len() != 32 {
            return None;
        }
        let mut key = [0u8; 16];
        for (i, pair) in b.chunks_exact(2).enumerate() {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            key[i] = (hi * 16 + lo) as u8;
        }
        Some(EventKey(key))
    }
}

impl fmt::Debug for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventKey({})", self.to_hex())
    }
}

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// How the request ended (for a usage event).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Status {
    /// Finished normally.
    Ok,
    /// The upstream failed; usage is what was consumed.
    UpstreamError,
    /// The client went away; usage is what was generated.
    ClientGone,
    /// The agent's lease expired without a completion; counts are what was reserved or 0.
    Expired,
}

impl Status {
    /// Every status, in encoding order.
    pub const ALL: [Status; 4] = [
        Status::Ok,
        Status::UpstreamError,
        Status::ClientGone,
        Status::Expired,
    ];

    /// The name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::UpstreamError => "upstream_error",
            Status::ClientGone => "client_gone",
            Status::Expired => "expired",
        }
    }

    /// Parses the JSON name.
    pub fn parse(s: &str) -> Option<Status> {
        Status::ALL.into_iter().find(|st| st.as_str() == s)
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_code(c: u8) -> Option<Status> {
        Status::ALL.get(c as usize).copied()
    }
}

/// Token counts. Integers only; each at most [`crate::Limits::tokens_max`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tokens {
    /// Prompt tokens processed.
    pub input_tokens: u64,
    /// Of which served from a prompt cache (at most `input_tokens`).
    pub cached_input_tokens: u64,
    /// Completion tokens generated.
    pub output_tokens: u64,
}

/// Signed token deltas of an `adjust` correction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenDeltas {
    /// Change to `input_tokens`.
    pub input_tokens: i64,
    /// Change to `cached_input_tokens`.
    pub cached_input_tokens: i64,
    /// Change to `output_tokens`.
    pub output_tokens: i64,
}

/// What an event says.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Body {
    /// Usage of one request.
    Usage {
        /// How it ended.
        status: Status,
        /// What it consumed.
        tokens: Tokens,
    },
    /// Cancels the usage event `target` entirely (however many voids name it).
    Void {
        /// The event cancelled.
        target: EventKey,
    },
    /// Adds signed deltas to the usage event `target` (each total is clamped at 0).
    Adjust {
        /// The event corrected.
        target: EventKey,
        /// The change.
        deltas: TokenDeltas,
    },
}

impl Body {
    /// `"usage"`, `"void"` or `"adjust"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Body::Usage { .. } => "usage",
            Body::Void { .. } => "void",
            Body::Adjust { .. } => "adjust",
        }
    }

    /// The target of a correction.
    pub fn target(&self) -> Option<EventKey> {
        match self {
            Body::Usage { .. } => None,
            Body::Void { target } | Body::Adjust { target, .. } => Some(*target),
        }
    }
}

/// One immutable ledger event. Build it through [`crate::wire::parse_event`] or
/// [`Event::validate`]; the store assumes a validated event.
///
/// `time_ms` is the time of the usage (unix ms) and decides the (tenant, hour) bucket.
/// A correction carries its target's tenant and usage time, so it lands in its
/// target's bucket and every bucket's totals depend only on that bucket's events.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Event {
    /// The request id; the [`EventKey`] derives from it.
    pub request_id: String,
    /// The node (agent) that produced the event.
    pub origin: String,
    /// Per-origin sequence number (for version vectors; not part of the identity).
    pub seq: u64,
    /// The tenant (billing account) descriptor value.
    pub tenant: String,
    /// Other descriptors, in the order given (e.g. `key=k1`).
    pub descriptors: Vec<(String, String)>,
    /// The model name (may be empty on a correction).
    pub model: String,
    /// Time of the usage, unix ms.
    pub time_ms: u64,
    /// What the event says.
    pub body: Body,
}

/// Bounds on an event, checked by [`Event::validate`]. Plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Longest request id, bytes. Default 256.
    pub request_id_max_bytes: usize,
    /// Longest origin, tenant, model, descriptor key or value, bytes. Default 256.
    pub name_max_bytes: usize,
    /// Most descriptors besides the tenant. Default 16.
    pub descriptors_max: usize,
    /// Largest token count (and largest absolute delta) in one event. Default 2^40
    /// (about 1.1e12): far above any real request, far below where sums of many
    /// events could overflow the u128 totals.
    pub tokens_max: u64,
    /// How far in the future (by the ingesting node's clock) `time_ms` may be.
    /// Default 10 minutes; raise it if agents' clocks drift more.
    pub future_skew_ms: u64,
    /// How far in the past `time_ms` may be. Default 400 days, so a late event from
    /// last month still lands in its own hour.
    pub max_age_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            request_id_max_bytes: 256,
            name_max_bytes: 256,
            descriptors_max: 16,
            tokens_max: 1 << 40,
            future_skew_ms: 10 * 60 * 1000,
            max_age_ms: 400 * 24 * HOUR_MS,
        }
    }
}

/// Why an event was refused. Nothing was stored; the cause is the sender's input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// A required field is absent.
    #[error("missing field \"{0}\"")]
    Missing(&'static str),
    /// A field has the wrong JSON type.
    #[error("field \"{field}\": expected {expected}")]
    WrongType {
        /// The field.
        field: String,
        /// What it should be.
        expected: &'static str,
    },
    /// An unknown field (refused so that typos do not silently drop data).
    #[error("unknown field \"{0}\"")]
    UnknownField(String),
    /// A count is negative.
    #[error("field \"{field}\": {value} is negative; token counts are integers >= 0")]
    Negative {
        /// The field.
        field: &'static str,
        /// The value as sent.
        value: String,
    },
    /// A number is not an integer, or too large for 64 bits, or above `tokens_max`.
    #[error("field \"{field}\": {value} is not an integer in 0..={max}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value as sent.
        value: String,
        /// The largest accepted value.
        max: u64,
    },
    /// A string is empty or too long.
    #[error("field \"{field}\": length {len} bytes is not in 1..={max}")]
    BadLength {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// Too many descriptors.
    #[error("{0} descriptors; at most {1}")]
    TooManyDescriptors(usize, usize),
    /// `cached_input_tokens` exceeds `input_tokens`.
    #[error("cached_input_tokens {cached} exceeds input_tokens {input}")]
    CachedAboveInput {
        /// Cached.
        cached: u64,
        /// Input.
        input: u64,
    },
    /// `time_ms` is too far in the future or the past.
    #[error("time_ms {time_ms} is outside [{earliest}, {latest}] (now {now_ms})")]
    TimeOutOfRange {
        /// As sent.
        time_ms: u64,
        /// Earliest accepted.
        earliest: u64,
        /// Latest accepted.
        latest: u64,
        /// The ingesting node's clock.
        now_ms: u64,
    },
    /// A field is not allowed for this kind of event.
    #[error("field \"{field}\" is not allowed on a {kind} event")]
    NotAllowed {
        /// The field.
        field: &'static str,
        /// The event kind.
        kind: &'static str,
    },
    /// Bad value for an enumerated field.
    #[error("field \"{field}\": unknown value \"{value}\"; expected one of {expected}")]
    BadValue {
        /// The field.
        field: &'static str,
        /// As sent.
        value: String,
        /// The accepted values.
        expected: &'static str,
    },
    /// A correction names itself.
    #[error("a correction cannot target itself")]
    SelfTarget,
    /// `event_key` was sent and does not match the request id.
    #[error("event_key {sent} does not match the key of request_id ({derived})")]
    KeyMismatch {
        /// As sent.
        sent: String,
        /// Derived from the request id.
        derived: String,
    },
}

impl Event {
    /// The event's key.
    pub fn key(&self) -> EventKey {
        EventKey::from_request_id(&self.request_id)
    }

    /// The hour bucket, `time_ms / HOUR_MS`.
    pub fn hour(&self) -> u64 {
        self.time_ms / HOUR_MS
    }

    /// Checks every bound. `now_ms` is the ingesting node's clock (an input: the core
    /// reads no clock).
    pub fn validate(&self, now_ms: u64, limits: &Limits) -> Result<(), ValidationError> {
        let len = |field: &'static str, s: &str, max: usize| {
            if s.is_empty() || s.len() > max {
                Err(ValidationError::BadLength {
                    field,
                    len: s.len(),
                    max,
                })
            } else {
                Ok(())
            }
        };
        len("request_id", &self.request_id, limits.request_id_max_bytes)?;
        len("origin", &self.origin, limits.name_max_bytes)?;
        len("tenant", &self.tenant, limits.name_max_bytes)?;
        if self.descriptors.len() > limits.descriptors_max {
            return Err(ValidationError::TooManyDescriptors(
                self.descriptors.len(),
                limits.descriptors_max,
            ));
        }
        for (k, v) in &self.descriptors {
            len("descriptors (key)", k, limits.name_max_bytes)?;
            len("descriptors (value)", v, limits.name_max_bytes)?;
        }
        match &self.body {
            Body::Usage { tokens, .. } => {
                len("model", &self.model, limits.name_max_bytes)?;
                for (field, v) in [
                    ("input_tokens", tokens.input_tokens),
                    ("cached_input_tokens", tokens.cached_input_tokens),
                    ("output_tokens", tokens.output_tokens),
                ] {
                    if v > limits.tokens_max {
                        return Err(ValidationError::OutOfRange {
                            field,
                            value: v.to_string(),
                            max: limits.tokens_max,
                        });
                    }
                }
                if tokens.cached_input_tokens > tokens.input_tokens {
                    return Err(ValidationError::CachedAboveInput {
                        cached: tokens.cached_input_tokens,
                        input: tokens.input_tokens,
                    });
                }
            }
            Body::Void { target } | Body::Adjust { target, .. } => {
                if self.model.len() > limits.name_max_bytes {
                    return Err(ValidationError::BadLength {
                        field: "model",
                        len: self.model.len(),
                        max: limits.name_max_bytes,
                    });
                }
                if *target == self.key() {
                    return Err(ValidationError::SelfTarget);
                }
                if let Body::Adjust { deltas, .. } = &self.body {
                    for (field, v) in [
                        ("input_tokens", deltas.input_tokens),
                        ("cached_input_tokens", deltas.cached_input_tokens),
                        ("output_tokens", deltas.output_tokens),
                    ] {
                        if v.unsigned_abs() > limits.tokens_max {
                            return Err(ValidationError::OutOfRange {
                                field,
                                value: v.to_string(),
                                max: limits.tokens_max,
                            });
                        }
                    }
                }
            }
        }
        let earliest = now_ms.saturating_sub(limits.max_age_ms);
        let latest = now_ms.saturating_add(limits.future_skew_ms);
        if self.time_ms < earliest || self.time_ms > latest {
            return Err(ValidationError::TimeOutOfRange {
                time_ms: self.time_ms,
                earliest,
                latest,
                now_ms,
            });
        }
        Ok(())
    }

    /// The canonical encoding: what the store keeps, what digests hash and what the
    /// conflict rule compares. Version byte first.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(96 + self.request_id.len() + self.tenant.len());
        self.encode_into(&mut out);
        out
    }

    /// [`Event::encode`] into a caller's buffer (appends).
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        fn s(out: &mut Vec<u8>, v: &str) {
            // Lengths are bounded by validation far below u16::MAX; clamp anyway so a
            // bug cannot produce an ambiguous encoding.
            let b = &v.as_bytes()[..v.len().min(u16::MAX as usize)];
            out.extend_from_slice(&(b.len() as u16).to_le_bytes());
            out.extend_from_slice(b);
        }
        out.push(ENCODING_VERSION);
        s(out, &self.request_id);
        s(out, &self.origin);
        out.extend_from_slice(&self.seq.to_le_bytes());
        s(out, &self.tenant);
        out.push(self.descriptors.len().min(u8::MAX as usize) as u8);
        for (k, v) in self.descriptors.iter().take(u8::MAX as usize) {
            s(out, k);
            s(out, v);
        }
        s(out, &self.model);
        out.extend_from_slice(&self.time_ms.to_le_bytes());
        match &self.body {
            Body::Usage { status, tokens } => {
                out.push(0);
                out.push(status.code());
                out.extend_from_slice(&tokens.input_tokens.to_le_bytes());
                out.extend_from_slice(&tokens.cached_input_tokens.to_le_bytes());
                out.extend_from_slice(&tokens.output_tokens.to_le_bytes());
            }
            Body::Void { target } => {
                out.push(1);
                out.extend_from_slice(&target.0);
            }
            Body::Adjust { target, deltas } => {
                out.push(2);
                out.extend_from_slice(&target.0);
                out.extend_from_slice(&deltas.input_tokens.to_le_bytes());
                out.extend_from_slice(&deltas.cached_input_tokens.to_le_bytes());
                out.extend_from_slice(&deltas.output_tokens.to_le_bytes());
            }
        }
    }

    /// Decodes [`Event::encode`]'s output. Any malformed input (truncated, trailing
    /// bytes, bad UTF-8, unknown version or tag) is an error, never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
        let mut r = Reader { b: bytes, at: 0 };
        let version = r.u8()?;
        if version != ENCODING_VERSION {
            return Err(DecodeError::Version(version));
        }
        let request_id = r.str()?;
        let origin = r.str()?;
        let seq = r.u64()?;
        let tenant = r.str()?;
        let n = r.u8()? as usize;
        let mut descriptors = Vec::with_capacity(n);
        for _ in 0..n {
            let k = r.str()?;
            let v = r.str()?;
            descriptors.push((k, v));
        }
        let model = r.str()?;
        let time_ms = r.u64()?;
        let body = match r.u8()? {
            0 => {
                let code = r.u8()?;
                let status = Status::from_code(code).ok_or(DecodeError::Tag(code))?;
                Body::Usage {
                    status,
                    tokens: Tokens {
                        input_tokens: r.u64()?,
                        cached_input_tokens: r.u64()?,
                        output_tokens: r.u64()?,
                    },
                }
            }
            1 => Body::Void {
                target: EventKey(r.key()?),
            },
            2 => Body::Adjust {
                target: EventKey(r.key()?),
                deltas: TokenDeltas {
                    input_tokens: r.u64()? as i64,
                    cached_input_tokens: r.u64()? as i64,
                    output_tokens: r.u64()? as i64,
                },
            },
            t => return Err(DecodeError::Tag(t)),
        };
        if r.at != bytes.len() {
            return Err(DecodeError::Trailing(bytes.len() - r.at));
        }
        Ok(Event {
            request_id,
            origin,
            seq,
            tenant,
            descriptors,
            model,
            time_ms,
            body,
        })
    }
}

/// Version byte of [`Event::encode`].
pub const ENCODING_VERSION: u8 = 1;

/// A stored event could not be decoded: the data is corrupt (or from another version).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Ran out of bytes.
    #[error("truncated event record")]
    Truncated,
    /// Bytes left over.
    #[error("{0} trailing bytes after event record")]
    Trailing(usize),
    /// Unknown encoding version.
    #[error("unknown event encoding version {0}")]
    Version(u8),
    /// Unknown tag.
    #[error("unknown tag {0} in event record")]
    Tag(u8),
    /// A string is not UTF-8.
    #[error("string in event record is not UTF-8")]
    Utf8,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let end = self.at.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self.b.get(self.at..end).ok_or(DecodeError::Truncated)?;
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn key(&mut self) -> Result<[u8; 16], DecodeError> {
        let mut a = [0u8; 16];
        a.copy_from_slice(self.take(16)?);
        Ok(a)
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        let n = u16::from_le_bytes(a) as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::Utf8)
    }
}

/// The element hash of an encoded event: 128 bits of SHA-256 over a domain tag and the
/// canonical encoding. Digests add these (mod 2^128), so the digest of a set does not
/// depend on the order its events arrived in.
pub fn element_hash(encoded: &[u8]) -> u128 {
    let mut h = Sha256::new();
    h.update(b"bursar-ledger/v1/element\0");
    h.update(encoded);
    let out = h.finalize();
    let mut a = [0u8; 16];
    a.copy_from_slice(&out[..16]);
    u128::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::usage;

    #[test]
    fn an_event_survives_encoding_and_decoding() {
        let mut e = usage("req-1", "acme", "gpt-4o", 1_000 * HOUR_MS, 10, 2, 5);
        e.descriptors = vec![("key".into(), "k1".into()), ("region".into(), "eu".into())];
        assert_eq!(Event::decode(&e.encode()).unwrap(), e);
        let adj = Event {
            body: Body::Adjust {
                target: EventKey::from_request_id("req-0"),
                deltas: TokenDeltas {
                    input_tokens: -3,
                    cached_input_tokens: 0,
                    output_tokens: i64::from(i32::MAX),
                },
            },
            ..e.clone()
        };
        assert_eq!(Event::decode(&adj.encode()).unwrap(), adj);
    }

    #[test]
    fn every_truncation_of_an_encoding_is_an_error_not_a_panic() {
        let e = usage("req-1", "acme", "gpt-4o", 1_000 * HOUR_MS, 10, 2, 5);
        let bytes = e.encode();
        for n in 0..bytes.len() {
            assert!(Event::decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Event::decode(&longer), Err(DecodeError::Trailing(1)));
    }

    #[test]
    fn the_key_depends_on_the_request_id_only() {
        let a = usage("req-1", "acme", "gpt-4o", HOUR_MS, 1, 0, 1);
        let b = usage("req-1", "other", "m", 7 * HOUR_MS, 9, 9, 9);
        assert_eq!(a.key(), b.key());
        assert_ne!(
            a.key(),
            usage("req-2", "acme", "gpt-4o", HOUR_MS, 1, 0, 1).key()
        );
        assert_eq!(EventKey::from_hex(&a.key().to_hex()), Some(a.key()));
    }

    #[test]
    fn validation_refuses_cached_above_input_and_oversized_counts() {
        let now = 10_000 * HOUR_MS;
        let l = Limits::default();
        let ok = usage("r", "t", "m", now, 10, 10, 0);
        assert_eq!(ok.validate(now, &l), Ok(()));
        let cached = usage("r", "t", "m", now, 10, 11, 0);
        assert!(matches!(
            cached.validate(now, &l),
            Err(ValidationError::CachedAboveInput { .. })
        ));
        let big = usage("r", "t", "m", now, l.tokens_max + 1, 0, 0);
        assert!(matches!(
            big.validate(now, &l),
            Err(ValidationError::OutOfRange {
                field: "input_tokens",
                ..
            })
        ));
    }

    #[test]
    fn validation_accepts_a_35_day_old_event_and_refuses_one_from_the_far_future() {
        let now = 500_000 * HOUR_MS;
        let l = Limits::default();
        let late = usage("r", "t", "m", now - 35 * 24 * HOUR_MS, 1, 0, 1);
        assert_eq!(late.validate(now, &l), Ok(()));
        let future = usage("r", "t", "m", now + HOUR_MS, 1, 0, 1);
        assert!(matches!(
            future.validate(now, &l),
            Err(ValidationError::TimeOutOfRange { .. })
        ));
    }

    #[test]
    fn a_correction_cannot_target_itself() {
        let now = 10 * HOUR_MS;
        let mut e = usage("r", "t", "m", now, 1, 0, 1);
        e.body = Body::Void { target: e.key() };
        assert_eq!(
            e.validate(now, &Limits::default()),
            Err(ValidationError::SelfTarget)
        );
    }
}
