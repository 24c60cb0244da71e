//! The cluster's wire format: an envelope around an rkyv message, and the compact
//! encoding of event batches inside it. Sans-IO: bytes in, values out; every size is
//! bounded and every malformed input is an error, never a panic.
//!
//! ```text
//! envelope := magic "BRSL" | version u8 (=1) | type u8 | reserved u16 (=0) | length u32 LE
//!             | payload (length bytes: an rkyv archive of `Msg`)
//! ```
//!
//! The receiver checks magic, version and length (at most `frame_max`) before it reads
//! the payload, copies the payload into an aligned buffer, and validates the archive
//! (rkyv's bytecheck) before using it; the type byte must match the archived message.
//!
//! Events travel in an [`EventBatch`]: a string table (origins, tenants, models and
//! descriptors repeat across a batch) and LEB128 varints, about 45-60 bytes per event
//! with a 36-byte request id, where the store's fixed-width canonical encoding takes
//! about 115. Every decoded event is validated again by the receiver.

use std::collections::HashMap;

use crate::digest::{Bucket, DIGEST_BYTES, Digest};
use crate::event::{Body, Event, EventKey, Limits, Status, TokenDeltas, Tokens};

/// The envelope's magic bytes.
pub const MAGIC: [u8; 4] = *b"BRSL";
/// The envelope (and message schema) version.
pub const VERSION: u8 = 2;
/// Envelope header length.
pub const HEADER_BYTES: usize = 12;
/// Default bound on a frame's payload: 32 MiB.
pub const FRAME_MAX_DEFAULT: usize = 32 << 20;

/// A wire problem. The frame (and the exchange it belonged to) is dropped; nothing
/// from it was applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not `BRSL`: not a Bursar ledger peer.
    #[error("bad magic {0:02x?} (not a Bursar ledger frame)")]
    Magic([u8; 4]),
    /// A version this node does not speak.
    #[error("unsupported frame version {0} (this node speaks {VERSION})")]
    Version(u8),
    /// The length exceeds the bound.
    #[error("frame of {len} bytes exceeds the bound of {max}")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The header or payload ended early.
    #[error("truncated frame: {0}")]
    Truncated(&'static str),
    /// Reserved bits set.
    #[error("reserved header bits set ({0:#06x})")]
    Reserved(u16),
    /// The archive failed validation.
    #[error("invalid message archive: {0}")]
    Archive(String),
    /// The type byte does not match the message.
    #[error("type byte {got} does not match the message (type {want})")]
    TypeMismatch {
        /// In the header.
        got: u8,
        /// Of the archived message.
        want: u8,
    },
    /// An event batch failed to decode.
    #[error("event batch: {0}")]
    Batch(String),
}

/// The message types (rkyv-derived; their generated archived and resolver types carry
/// no docs of their own, hence the allow).
#[allow(missing_docs)]
mod types {
    use crate::digest::Bucket;

    /// A bucket on the wire.
    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
    pub struct WireBucket {
        /// Hours since the epoch.
        pub hour: u64,
        /// Tenant.
        pub tenant: String,
    }

    impl From<&Bucket> for WireBucket {
        fn from(b: &Bucket) -> Self {
            WireBucket {
                hour: b.hour,
                tenant: b.tenant.clone(),
            }
        }
    }

    impl From<WireBucket> for Bucket {
        fn from(b: WireBucket) -> Self {
            Bucket {
                hour: b.hour,
                tenant: b.tenant,
            }
        }
    }

    /// A digest on the wire: [`crate::digest::Digest::to_bytes`].
    pub type WireDigest = Vec<u8>;

    /// A batch of events in the compact encoding ([`super::encode_events`]).
    #[derive(
        rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq, Default,
    )]
    pub struct EventBatch {
        /// How many events `bytes` holds.
        pub count: u32,
        /// The encoding.
        pub bytes: Vec<u8>,
    }

    /// Every cluster message. One exchange is one bidirectional QUIC stream.
    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
    pub enum Msg {
        /// New events committed at the sender (push). Answered by [`Msg::PushAck`] after
        /// the receiver's durable commit.
        Push(EventBatch),
        /// Counts from the receiver's merge.
        PushAck {
            /// Events that were new here.
            new: u64,
            /// Events already held.
            duplicate: u64,
            /// Events that conflicted.
            conflict: u64,
        },
        /// Anti-entropy step 1 ([`crate::reconcile::offer`]).
        Offer {
            /// The initiator's root digest.
            root: WireDigest,
            /// Its bucket digests.
            buckets: Vec<(WireBucket, WireDigest)>,
            /// The covered range starts at bucket (hour, tenant), inclusive (an empty
            /// tenant: the hour's start)...
            from_hour: u64,
            /// ...
            from_tenant: String,
            /// ...and ends at bucket (hour, tenant), exclusive.
            to_hour: u64,
            /// ...
            to_tenant: String,
        },
        /// Step 2: the responder's events in differing buckets, what it wants, and
        /// sub-digests of buckets too large to send whole. `equal` when the roots match.
        Answer {
            /// The responder's events in the differing buckets.
            events: EventBatch,
            /// Buckets the responder wants whole.
            want: Vec<WireBucket>,
            /// Big buckets, with the responder's sub-digests.
            split: Vec<(WireBucket, Vec<WireDigest>)>,
            /// The answer was cut at a bound; another round follows.
            truncated: bool,
        },
        /// Step 3: the initiator's events for `want` and the differing sub-buckets, plus
        /// winners of conflicts; and the sub-buckets it wants from the responder.
        Serve {
            /// Events.
            events: EventBatch,
            /// Sub-buckets wanted, per big bucket.
            sub_wants: Vec<(WireBucket, Vec<u8>)>,
        },
        /// Step 4: the responder's events in the wanted sub-buckets plus winners.
        Back(EventBatch),
        /// Step 5: the initiator's winners of conflicts the step-4 events lost.
        Last(EventBatch),
        /// Opens an anti-entropy round: the initiator's root digest.
        Root(WireDigest),
        /// The roots differ: the initiator sends its [`Msg::Offer`] next.
        Differ,
        /// End of an exchange (equal roots, or after the responder's commit of step 5).
        Done,
        /// The other side refused or failed; the exchange ends, nothing more is applied.
        Error(String),
        /// The responder is in another anti-entropy round; try later (one round at a
        /// time per node, so a lagging node is not sent the same events by every peer
        /// at once).
        Busy,
    }

    impl Msg {
        /// The envelope's type byte.
        pub fn type_byte(&self) -> u8 {
            match self {
                Msg::Push(_) => 1,
                Msg::PushAck { .. } => 2,
                Msg::Offer { .. } => 3,
                Msg::Answer { .. } => 4,
                Msg::Serve { .. } => 5,
                Msg::Back(_) => 6,
                Msg::Last(_) => 7,
                Msg::Done => 8,
                Msg::Error(_) => 9,
                Msg::Root(_) => 10,
                Msg::Differ => 11,
                Msg::Busy => 12,
            }
        }
    }
}

pub use types::{EventBatch, Msg, WireBucket, WireDigest};

/// Encodes a message in its envelope.
pub fn encode(msg: &Msg) -> Vec<u8> {
    let payload = rkyv::to_bytes::<rkyv::rancor::Error>(msg)
        .expect("serializing an in-memory message cannot fail");
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(msg.type_byte());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// A checked header: the type byte and the payload length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Type byte.
    pub ty: u8,
    /// Payload length.
    pub len: usize,
}

/// Checks a header (exactly [`HEADER_BYTES`] bytes, or fewer: truncated).
pub fn decode_header(b: &[u8], frame_max: usize) -> Result<Header, FrameError> {
    if b.len() < HEADER_BYTES {
        return Err(FrameError::Truncated("header"));
    }
    let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(FrameError::Magic(magic));
    }
    if b[4] != VERSION {
        return Err(FrameError::Version(b[4]));
    }
    let reserved = u16::from_le_bytes([b[6], b[7]]);
    if reserved != 0 {
        return Err(FrameError::Reserved(reserved));
    }
    let len = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) as usize;
    if len > frame_max {
        return Err(FrameError::TooLarge {
            len,
            max: frame_max,
        });
    }
    Ok(Header { ty: b[5], len })
}

/// Validates and deserializes a payload (copied into an aligned buffer first).
pub fn decode_payload(h: Header, payload: &[u8]) -> Result<Msg, FrameError> {
    if payload.len() < h.len {
        return Err(FrameError::Truncated("payload"));
    }
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(h.len);
    aligned.extend_from_slice(&payload[..h.len]);
    let msg = rkyv::from_bytes::<Msg, rkyv::rancor::Error>(&aligned)
        .map_err(|e| FrameError::Archive(e.to_string()))?;
    if msg.type_byte() != h.ty {
        return Err(FrameError::TypeMismatch {
            got: h.ty,
            want: msg.type_byte(),
        });
    }
    Ok(msg)
}

/// Decodes one whole frame (header and payload, nothing after it).
pub fn decode(b: &[u8], frame_max: usize) -> Result<Msg, FrameError> {
    let h = decode_header(b, frame_max)?;
    let payload = &b[HEADER_BYTES..];
    if payload.len() < h.len {
        return Err(FrameError::Truncated("payload"));
    }
    if payload.len() > h.len {
        return Err(FrameError::Archive(format!(
            "{} bytes after the payload",
            payload.len() - h.len
        )));
    }
    decode_payload(h, payload)
}

/// An anti-entropy offer as its message (both sides of the exchange, and tests).
pub fn offer_msg(o: &crate::reconcile::Offer) -> Msg {
    Msg::Offer {
        root: o.root.to_bytes().to_vec(),
        buckets: wire_digests(&o.buckets),
        from_hour: o.from.hour,
        from_tenant: o.from.tenant.clone(),
        to_hour: o.to.hour,
        to_tenant: o.to.tenant.clone(),
    }
}

/// Converts digests for the wire.
pub fn wire_digests(list: &[(Bucket, Digest)]) -> Vec<(WireBucket, WireDigest)> {
    list.iter()
        .map(|(b, d)| (WireBucket::from(b), d.to_bytes().to_vec()))
        .collect()
}

/// Reads a digest from the wire.
pub fn digest(b: &[u8]) -> Result<Digest, FrameError> {
    if b.len() != DIGEST_BYTES {
        return Err(FrameError::Batch(format!(
            "digest of {} bytes (want {DIGEST_BYTES})",
            b.len()
        )));
    }
    Digest::from_bytes(b).ok_or_else(|| FrameError::Batch("malformed digest".into()))
}

/// Reads digests from the wire, keeping (hour, tenant) order checked: a peer's list out
/// of order would make the merge walk of `differing_buckets` wrong.
pub fn digests(list: Vec<(WireBucket, WireDigest)>) -> Result<Vec<(Bucket, Digest)>, FrameError> {
    let mut out: Vec<(Bucket, Digest)> = Vec::with_capacity(list.len());
    for (b, d) in list {
        let b = Bucket::from(b);
        if let Some((prev, _)) = out.last()
            && *prev >= b
        {
            return Err(FrameError::Batch("bucket digests out of order".into()));
        }
        out.push((b, digest(&d)?));
    }
    Ok(out)
}

// ---- The compact event encoding ----

fn put_var(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn intern<'a>(table: &mut HashMap<&'a str, u64>, strings: &mut Vec<&'a str>, s: &'a str) -> u64 {
    let next = table.len() as u64;
    *table.entry(s).or_insert_with(|| {
        strings.push(s);
        next
    })
}

/// Encodes events: `strings` (count, then length-prefixed UTF-8), then `count` events
/// of varints referring to the table; times are deltas (zigzag) from the previous
/// event's.
pub fn encode_events(events: &[Event]) -> EventBatch {
    let mut table: HashMap<&str, u64> = HashMap::new();
    let mut strings: Vec<&str> = Vec::new();
    // Every name is interned (request ids are not: they are unique).
    let mut body = Vec::with_capacity(events.len() * 56);
    let mut prev_time = 0u64;
    for e in events {
        put_var(&mut body, e.request_id.len() as u64);
        body.extend_from_slice(e.request_id.as_bytes());
        for s in [e.origin.as_str(), e.tenant.as_str(), e.model.as_str()] {
            put_var(&mut body, intern(&mut table, &mut strings, s));
        }
        put_var(&mut body, e.seq);
        put_var(&mut body, e.descriptors.len() as u64);
        for (k, v) in &e.descriptors {
            for s in [k.as_str(), v.as_str()] {
                put_var(&mut body, intern(&mut table, &mut strings, s));
            }
        }
        put_var(&mut body, zigzag(e.time_ms.wrapping_sub(prev_time) as i64));
        prev_time = e.time_ms;
        match &e.body {
            Body::Usage { status, tokens } => {
                body.push(0);
                body.push(status.code());
                put_var(&mut body, tokens.input_tokens);
                put_var(&mut body, tokens.cached_input_tokens);
                put_var(&mut body, tokens.output_tokens);
            }
            Body::Void { target } => {
                body.push(1);
                body.extend_from_slice(&target.0);
            }
            Body::Adjust { target, deltas } => {
                body.push(2);
                body.extend_from_slice(&target.0);
                put_var(&mut body, zigzag(deltas.input_tokens));
                put_var(&mut body, zigzag(deltas.cached_input_tokens));
                put_var(&mut body, zigzag(deltas.output_tokens));
            }
        }
    }
    let mut out = Vec::with_capacity(body.len() + strings.len() * 12 + 8);
    put_var(&mut out, strings.len() as u64);
    for s in &strings {
        put_var(&mut out, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    }
    out.extend_from_slice(&body);
    EventBatch {
        count: events.len() as u32,
        bytes: out,
    }
}

struct Rd<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Rd<'a> {
    fn err(what: &str) -> FrameError {
        FrameError::Batch(format!("malformed {what}"))
    }
    fn u8(&mut self, what: &str) -> Result<u8, FrameError> {
        let v = *self.b.get(self.at).ok_or_else(|| Rd::err(what))?;
        self.at += 1;
        Ok(v)
    }
    fn var(&mut self, what: &str) -> Result<u64, FrameError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.u8(what)?;
            let bits = u64::from(byte & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(Rd::err(what));
            }
            v |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Rd::err(what))
    }
    fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8], FrameError> {
        let end = self.at.checked_add(n).ok_or_else(|| Rd::err(what))?;
        let s = self.b.get(self.at..end).ok_or_else(|| Rd::err(what))?;
        self.at = end;
        Ok(s)
    }
    fn str(&mut self, max: usize, what: &str) -> Result<&'a str, FrameError> {
        let n = self.var(what)?;
        if n > max as u64 {
            return Err(FrameError::Batch(format!("{what} longer than {max} bytes")));
        }
        std::str::from_utf8(self.bytes(n as usize, what)?).map_err(|_| Rd::err(what))
    }
}

/// Decodes [`encode_events`]'s output and validates every event with `limits` (time
/// window excepted: an event a peer accepted stays acceptable however old it gets, or
/// replication would stop at the window's edge). At most `events_max` events, and at
/// most `bytes_max` bytes decoded: the events by `reconcile::event_wire_bytes` (what
/// every sender keeps a message to), and the string table by its strings plus a slot
/// each. Strings are shared on the wire and copied into each event decoded: without
/// the byte bound, a 4.5 MB batch of events naming the same 256-byte strings decoded
/// to a gigabyte.
pub fn decode_events(
    batch: &EventBatch,
    limits: &Limits,
    events_max: usize,
    bytes_max: usize,
) -> Result<Vec<Event>, FrameError> {
    let count = batch.count as usize;
    if count > events_max {
        return Err(FrameError::Batch(format!(
            "{count} events exceed the bound of {events_max}"
        )));
    }
    let mut r = Rd {
        b: &batch.bytes,
        at: 0,
    };
    let n_strings = r.var("string count")?;
    // Every string takes at least one byte: a count beyond the input is malformed.
    if n_strings > batch.bytes.len() as u64 {
        return Err(Rd::err("string count"));
    }
    // Grown as strings are read, not reserved from the count: a batch of empty strings
    // would reserve 16 bytes of table per byte of input.
    let mut strings = Vec::with_capacity((n_strings as usize).min(4_096));
    let mut table_bytes = 0usize;
    for _ in 0..n_strings {
        let st = r.str(limits.name_max_bytes, "string table")?;
        table_bytes += st.len() + std::mem::size_of::<&str>();
        if table_bytes > bytes_max {
            return Err(FrameError::Batch(format!(
                "the string table decodes to over {bytes_max} bytes"
            )));
        }
        strings.push(st);
    }
    let s = |i: u64| -> Result<String, FrameError> {
        strings
            .get(i as usize)
            .map(|s| s.to_string())
            .ok_or_else(|| FrameError::Batch(format!("string index {i} out of range")))
    };
    let mut unbounded = limits.clone();
    unbounded.max_age_ms = u64::MAX;
    unbounded.future_skew_ms = u64::MAX;
    let mut out = Vec::with_capacity(count.min(batch.bytes.len()));
    let mut time = 0u64;
    let mut decoded = 0usize;
    for i in 0..count {
        let request_id = r
            .str(limits.request_id_max_bytes, "request id")?
            .to_string();
        let origin = s(r.var("origin")?)?;
        let tenant = s(r.var("tenant")?)?;
        let model = s(r.var("model")?)?;
        let seq = r.var("seq")?;
        let nd = r.var("descriptor count")?;
        if nd > limits.descriptors_max as u64 {
            return Err(FrameError::Batch(format!(
                "event {i}: {nd} descriptors exceed {}",
                limits.descriptors_max
            )));
        }
        let mut descriptors = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            descriptors.push((s(r.var("descriptor")?)?, s(r.var("descriptor")?)?));
        }
        time = time.wrapping_add(unzigzag(r.var("time")?) as u64);
        let key = |r: &mut Rd<'_>| -> Result<EventKey, FrameError> {
            Ok(EventKey(
                r.bytes(16, "target")?.try_into().expect("16 bytes"),
            ))
        };
        let body = match r.u8("kind")? {
            0 => {
                let code = r.u8("status")?;
                let status = Status::from_code(code)
                    .ok_or_else(|| FrameError::Batch(format!("unknown status {code}")))?;
                Body::Usage {
                    status,
                    tokens: Tokens {
                        input_tokens: r.var("tokens")?,
                        cached_input_tokens: r.var("tokens")?,
                        output_tokens: r.var("tokens")?,
                    },
                }
            }
            1 => Body::Void {
                target: key(&mut r)?,
            },
            2 => Body::Adjust {
                target: key(&mut r)?,
                deltas: TokenDeltas {
                    input_tokens: unzigzag(r.var("delta")?),
                    cached_input_tokens: unzigzag(r.var("delta")?),
                    output_tokens: unzigzag(r.var("delta")?),
                },
            },
            k => return Err(FrameError::Batch(format!("unknown event kind {k}"))),
        };
        let e = Event {
            request_id,
            origin,
            seq,
            tenant,
            descriptors,
            model,
            time_ms: time,
            body,
        };
        e.validate(0, &unbounded)
            .map_err(|v| FrameError::Batch(format!("event {i}: {v}")))?;
        decoded += crate::reconcile::event_wire_bytes(&e);
        if decoded > bytes_max {
            return Err(FrameError::Batch(format!(
                "events 0..={i} decode to over {bytes_max} bytes"
            )));
        }
        out.push(e);
    }
    if r.at != batch.bytes.len() {
        return Err(FrameError::Batch(format!(
            "{} bytes after the last event",
            batch.bytes.len() - r.at
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::HOUR_MS;
    use crate::testing::{correction, usage_stream};

    const NOW: u64 = 490_000 * HOUR_MS;
    /// What a receiver with the default limits takes (`exchange::message_bytes_max`).
    const TEST_BYTES: usize = 16 << 20;

    /// Review, thirty-first session: the receiver bounded a batch by its event count
    /// only, and strings shared on the wire are copied into every event decoded: 10,000
    /// events naming the same 35 strings of 256 bytes are ~0.5 MB on the wire and ~97
    /// MB decoded (100,000 of them, within the count bound, a gigabyte). A table of
    /// empty strings was 16 bytes of memory per byte of input.
    #[test]
    fn a_batch_that_decodes_past_the_byte_bound_is_refused() {
        let long = |c: char| c.to_string().repeat(256);
        let mut base = usage_stream(1, "r", &long('o'), 1, NOW).remove(0);
        base.tenant = long('t');
        base.model = long('m');
        base.descriptors = (0..16u8)
            .map(|i| (format!("{:0>256}", i), long('v')))
            .collect();
        let events: Vec<Event> = (0..10_000)
            .map(|i| Event {
                request_id: format!("r{i}"),
                seq: i + 1,
                ..base.clone()
            })
            .collect();
        let b = encode_events(&events);
        assert!(
            b.bytes.len() < 1 << 20,
            "{} bytes on the wire",
            b.bytes.len()
        );
        let err = decode_events(&b, &Limits::default(), 100_000, TEST_BYTES).unwrap_err();
        assert!(err.to_string().contains("decode to over"), "{err}");
        // A hundred of them decode.
        let few = encode_events(&events[..100]);
        assert_eq!(
            decode_events(&few, &Limits::default(), 100_000, TEST_BYTES)
                .unwrap()
                .len(),
            100
        );
        // Four million empty strings and no event.
        let mut bytes = Vec::new();
        put_var(&mut bytes, 4_000_000);
        bytes.extend(std::iter::repeat_n(0u8, 4_000_000));
        let b = EventBatch { count: 0, bytes };
        let err = decode_events(&b, &Limits::default(), 100_000, TEST_BYTES).unwrap_err();
        assert!(err.to_string().contains("string table"), "{err}");
    }

    fn sample() -> Vec<Event> {
        let mut v = usage_stream(7, "req", "agent-a", 200, NOW);
        v[3].descriptors = vec![("key".into(), "k1".into()), ("region".into(), "eu".into())];
        let void = correction("fix-1", &v[0], None);
        let adjust = correction(
            "fix-2",
            &v[1],
            Some(TokenDeltas {
                input_tokens: -5,
                cached_input_tokens: 0,
                output_tokens: 7,
            }),
        );
        v.push(void);
        v.push(adjust);
        v
    }

    #[test]
    fn events_round_trip_through_the_compact_encoding() {
        let events = sample();
        let b = encode_events(&events);
        assert_eq!(b.count as usize, events.len());
        let back = decode_events(&b, &Limits::default(), 10_000, TEST_BYTES).unwrap();
        assert_eq!(back, events);
        // Out-of-order times (a late event after a new one) survive the deltas.
        let mut mixed = events.clone();
        mixed.swap(0, 150);
        mixed[5].time_ms = 1;
        let back = decode_events(
            &encode_events(&mixed),
            &Limits::default(),
            10_000,
            TEST_BYTES,
        )
        .unwrap();
        assert_eq!(back, mixed);
    }

    #[test]
    fn a_typical_event_takes_well_under_100_bytes_on_the_wire() {
        // UUID-sized request ids, a few tenants and models: the common shape.
        let mut events = usage_stream(9, "r", "agent-7", 10_000, NOW);
        for (i, e) in events.iter_mut().enumerate() {
            e.request_id = format!("0190c3a2-7b1e-7c4d-9e8f-{i:012x}");
        }
        let frame = encode(&Msg::Push(encode_events(&events)));
        let per_event = frame.len() as f64 / events.len() as f64;
        let canonical: usize = events.iter().map(|e| e.encode().len()).sum();
        let canonical = canonical as f64 / events.len() as f64;
        println!("wire bytes per event: {per_event:.1} (canonical store encoding {canonical:.1})");
        assert!(per_event < 100.0, "{per_event} bytes per event");
        assert!(per_event < canonical, "{per_event} vs {canonical}");
    }

    #[test]
    fn every_message_round_trips_through_the_envelope() {
        let d = Digest::default().to_bytes().to_vec();
        let wb = WireBucket {
            hour: 5,
            tenant: "t".into(),
        };
        let msgs = vec![
            Msg::Push(encode_events(&sample())),
            Msg::PushAck {
                new: 1,
                duplicate: 2,
                conflict: 3,
            },
            Msg::Root(d.clone()),
            Msg::Differ,
            Msg::Offer {
                root: d.clone(),
                buckets: vec![(wb.clone(), d.clone())],
                from_hour: 0,
                from_tenant: "acme".into(),
                to_hour: u64::MAX,
                to_tenant: String::new(),
            },
            Msg::Answer {
                events: EventBatch::default(),
                want: vec![wb.clone()],
                split: vec![(wb.clone(), vec![d.clone(); 3])],
                truncated: true,
            },
            Msg::Serve {
                events: EventBatch::default(),
                sub_wants: vec![(wb, vec![1, 2, 255])],
            },
            Msg::Back(EventBatch::default()),
            Msg::Last(EventBatch::default()),
            Msg::Done,
            Msg::Busy,
            Msg::Error("nope".into()),
        ];
        let mut types = std::collections::HashSet::new();
        for m in msgs {
            assert!(types.insert(m.type_byte()), "type bytes are distinct");
            let b = encode(&m);
            assert_eq!(decode(&b, FRAME_MAX_DEFAULT).unwrap(), m);
        }
    }

    #[test]
    fn bad_envelopes_are_refused_with_their_reason() {
        let good = encode(&Msg::Push(encode_events(&sample())));
        // Truncated anywhere: a clear error, never a panic.
        for cut in 0..good.len() {
            let e = decode(&good[..cut], FRAME_MAX_DEFAULT).unwrap_err();
            assert!(matches!(e, FrameError::Truncated(_)), "cut at {cut}: {e:?}");
        }
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(
            decode(&b, FRAME_MAX_DEFAULT),
            Err(FrameError::Magic(_))
        ));
        let mut b = good.clone();
        b[4] = 9;
        assert_eq!(decode(&b, FRAME_MAX_DEFAULT), Err(FrameError::Version(9)));
        let mut b = good.clone();
        b[6] = 1;
        assert!(matches!(
            decode(&b, FRAME_MAX_DEFAULT),
            Err(FrameError::Reserved(_))
        ));
        let mut b = good.clone();
        b[5] = Msg::Done.type_byte();
        assert!(matches!(
            decode(&b, FRAME_MAX_DEFAULT),
            Err(FrameError::TypeMismatch { .. })
        ));
        // A length beyond the bound is refused from the header alone.
        let e = decode_header(&good[..HEADER_BYTES], 100).unwrap_err();
        assert!(matches!(e, FrameError::TooLarge { .. }), "{e:?}");
        let mut b = good.clone();
        b.push(0);
        assert!(decode(&b, FRAME_MAX_DEFAULT).is_err(), "trailing bytes");
    }

    #[test]
    fn bad_event_batches_are_refused() {
        let good = encode_events(&sample());
        let lim = Limits::default();
        // Too many for the bound.
        assert!(decode_events(&good, &lim, 10, TEST_BYTES).is_err());
        // Every truncation of the bytes.
        for cut in 0..good.bytes.len() {
            let b = EventBatch {
                count: good.count,
                bytes: good.bytes[..cut].to_vec(),
            };
            assert!(
                decode_events(&b, &lim, 10_000, TEST_BYTES).is_err(),
                "cut at {cut}"
            );
        }
        // A count that does not match the bytes.
        let b = EventBatch {
            count: good.count + 1,
            bytes: good.bytes.clone(),
        };
        assert!(decode_events(&b, &lim, 10_000, TEST_BYTES).is_err());
        let b = EventBatch {
            count: good.count - 1,
            bytes: good.bytes.clone(),
        };
        assert!(decode_events(&b, &lim, 10_000, TEST_BYTES).is_err());
        // Values that fail validation: output tokens beyond the bound.
        let mut e = sample();
        if let Body::Usage { tokens, .. } = &mut e[0].body {
            tokens.output_tokens = lim.tokens_max + 1;
        }
        let err = decode_events(&encode_events(&e), &lim, 10_000, TEST_BYTES).unwrap_err();
        assert!(err.to_string().contains("event 0"), "{err}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(300))]
        /// Random corruption of a frame never panics, and anything that still decodes
        /// is a well-formed message whose events validate.
        #[test]
        fn corrupt_frames_never_panic(flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..8)) {
            let good = encode(&Msg::Push(encode_events(&sample()[..20])));
            let mut b = good.clone();
            for (at, v) in flips {
                let i = at % b.len();
                b[i] ^= v.max(1);
            }
            if let Ok(Msg::Push(batch)) = decode(&b, FRAME_MAX_DEFAULT) {
                let _ = decode_events(&batch, &Limits::default(), 10_000, TEST_BYTES);
            }
        }
    }
}
