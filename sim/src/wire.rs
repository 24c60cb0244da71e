//! Encoded sizes of the control messages, for the report's bytes per agent per second.
//!
//! The simulator passes the cores' own message structs and never encodes protobuf, so
//! these functions compute what the messages of `bursar.allocator.v1`
//! (`crates/proto/proto/bursar/allocator/v1/allocator.proto`) would take on the wire:
//! the protobuf encoding of each field that is not at its default (proto3 omits those),
//! plus gRPC's 5-byte length prefix per message. Not counted: HTTP/2 frame headers,
//! HPACK, TLS records, TCP/IP headers, and the hello's `config_version` string (a short
//! hash). The Gubernator-like policy's hit batches are sized as a `Report` holding one
//! `KeyReport { key, admitted }` per key (what a peer needs), for comparison.
//!
//! The field numbers follow the .proto file; `a_report_is_sized_as_protobuf_would_encode_it`
//! checks the arithmetic against a hand-encoded message.

use bursar_allocator::{
    Ack, Grant, HeldGrant, Hello, KeyName, KeyReport, LeaseExtension, Measure, MeasureRequest,
    Report, UnknownHandles,
};

/// gRPC's per-message prefix: one compression byte and a 4-byte length.
pub const GRPC_PREFIX_BYTES: u64 = 5;

/// Bytes of `x` as a varint.
pub fn varint_len(x: u64) -> u64 {
    u64::from(64 - (x | 1).leading_zeros()).div_ceil(7)
}

/// A `uint64`/`uint32` field: tag plus varint, or nothing at the default (0).
fn uint(x: u64) -> u64 {
    if x == 0 { 0 } else { 1 + varint_len(x) }
}

/// A length-delimited field (string, bytes or a sub-message) of `len` bytes: tag,
/// length, body. A repeated element is encoded even when empty.
fn delimited(len: u64) -> u64 {
    1 + varint_len(len) + len
}

/// A string field: nothing when empty.
fn string(s: &str) -> u64 {
    if s.is_empty() {
        0
    } else {
        delimited(s.len() as u64)
    }
}

/// `Key { rule = 1; repeated values = 2 }`, body only.
fn key_body(k: &KeyName) -> u64 {
    string(&k.rule)
        + k.values
            .iter()
            .map(|v| delimited(v.len() as u64))
            .sum::<u64>()
}

/// `HeldGrant { epoch, seq, rate, burst }`, body only.
fn held_body(g: &HeldGrant) -> u64 {
    uint(g.epoch) + uint(g.seq) + uint(g.rate) + uint(g.burst)
}

fn key_report_body(k: &KeyReport) -> u64 {
    // By handle (field 7), the name left out; else by name.
    let key = if k.key_handle != 0 {
        uint(k.key_handle)
    } else {
        delimited(key_body(&k.key))
    };
    key + uint(k.admitted)
        + uint(k.rejected)
        + uint(k.counting_since_ns)
        + uint(k.in_flight)
        + k.held.as_ref().map_or(0, |g| delimited(held_body(g)))
}

/// An `AgentMessage { hello = 1 }` on the stream.
pub fn hello_bytes(h: &Hello) -> u64 {
    let held: u64 = h
        .held
        .iter()
        .map(|s| delimited(delimited(key_body(&s.key)) + delimited(held_body(&s.grant))))
        .sum();
    // RuleShape { rule = 1; fixed64 shape = 2 }.
    let shapes: u64 = h
        .rule_shapes
        .iter()
        .map(|(rule, shape)| delimited(string(rule) + if *shape == 0 { 0 } else { 9 }))
        .sum();
    let body = uint(2) // protocol_version = PROTOCOL_VERSION_2
        + string(&h.agent)
        + uint(h.incarnation)
        + uint(u64::from(h.weight))
        + uint(h.agent_time_ns)
        + held
        + uint(h.report_interval_ms)
        + uint(u64::from(h.grants_by_handle))
        + shapes;
    GRPC_PREFIX_BYTES + delimited(body)
}

/// An `AgentMessage { report = 2 }` on the stream (the agent's id is the stream's, not
/// a field of the report).
pub fn report_bytes(r: &Report) -> u64 {
    let keys: u64 = r.keys.iter().map(|k| delimited(key_report_body(k))).sum();
    let measure = match r.measure {
        Measure::None => 0,
        Measure::Start => 1,
        Measure::End => 2,
    };
    GRPC_PREFIX_BYTES + delimited(uint(r.agent_time_ns) + keys + uint(measure))
}

/// An `AgentMessage { ack = 3 }` on the stream.
pub fn ack_bytes(a: &Ack) -> u64 {
    let slices: u64 = a
        .slices
        .iter()
        .map(|s| {
            let key = if s.key_handle != 0 {
                uint(s.key_handle)
            } else {
                delimited(key_body(&s.key))
            };
            delimited(
                key + uint(s.epoch) + uint(s.seq) + uint(s.released_tokens) + uint(s.in_flight),
            )
        })
        .sum();
    GRPC_PREFIX_BYTES + delimited(slices)
}

/// An `AllocatorMessage { grants = 2 }` carrying these grants (the allocator's shell
/// batches the grants of one pass per agent stream).
pub fn grants_bytes(grants: &[Grant]) -> u64 {
    let body: u64 = grants
        .iter()
        .map(|g| {
            // A grant by handle alone carries no key (`Grant::named`).
            let key = if g.named {
                delimited(key_body(&g.key))
            } else {
                0
            };
            delimited(
                key + uint(g.rate)
                    + uint(g.burst)
                    + uint(g.epoch)
                    + uint(g.seq)
                    + uint(g.lease_expires_at_ns)
                    + uint(u64::from(g.fleet_size))
                    + uint(g.transfer_tokens)
                    + uint(g.key_handle),
            )
        })
        .sum();
    GRPC_PREFIX_BYTES + delimited(body)
}

/// An `AllocatorMessage { welcome = 1 }` (its `config_version` not counted, as the
/// hello's is not).
pub fn welcome_bytes(term: u64, max_keys_per_message: usize, lease_ms: u64) -> u64 {
    let body = uint(1) // protocol_version
        + uint(term)
        + uint(max_keys_per_message as u64)
        + uint(MAX_MESSAGE_BYTES)
        + uint(lease_ms);
    GRPC_PREFIX_BYTES + delimited(body)
}

/// `Welcome.max_message_bytes` as the allocator's shell sends it
/// (`bursar_proto::allocator::MAX_MESSAGE_BYTES`, 4 MiB).
const MAX_MESSAGE_BYTES: u64 = 4 << 20;

/// An `AllocatorMessage { lease_extension = 5 }`.
pub fn extension_bytes(x: &LeaseExtension) -> u64 {
    let body = uint(x.epoch) + uint(x.through_seq) + uint(x.lease_expires_at_ns);
    GRPC_PREFIX_BYTES + delimited(body)
}

/// An `AllocatorMessage { measure_request = 6 }` (handles packed, as proto3 encodes a
/// repeated scalar).
pub fn measure_request_bytes(m: &MeasureRequest) -> u64 {
    let packed: u64 = m.key_handles.iter().map(|&h| varint_len(h)).sum();
    let handles = if packed == 0 { 0 } else { delimited(packed) };
    GRPC_PREFIX_BYTES + delimited(handles + uint(u64::from(m.window_ms)))
}

/// An `AllocatorMessage { unknown_keys = 7 }` (handles packed).
pub fn unknown_keys_bytes(u: &UnknownHandles) -> u64 {
    let packed: u64 = u.key_handles.iter().map(|&h| varint_len(h)).sum();
    let handles = if packed == 0 { 0 } else { delimited(packed) };
    GRPC_PREFIX_BYTES + delimited(handles)
}

/// A Gubernator-like hit batch: one `KeyReport { key, admitted = hits }` per key.
pub fn hits_bytes<'a>(hits: impl Iterator<Item = (&'a KeyName, u64)>) -> u64 {
    let keys: u64 = hits
        .map(|(k, h)| delimited(delimited(key_body(k)) + uint(h)))
        .sum();
    GRPC_PREFIX_BYTES + delimited(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_take_one_byte_per_seven_bits() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(127), 1);
        assert_eq!(varint_len(128), 2);
        assert_eq!(varint_len(16_383), 2);
        assert_eq!(varint_len(16_384), 3);
        assert_eq!(varint_len(u64::MAX), 10);
    }

    #[test]
    fn a_report_is_sized_as_protobuf_would_encode_it() {
        let r = Report {
            agent: "gw-0".into(),
            incarnation: 1,
            agent_time_ns: 300,
            keys: vec![KeyReport {
                key: KeyName::new("tenant", &["t0"]),
                admitted: 5,
                rejected: 0,
                counting_since_ns: 0,
                in_flight: 0,
                held: Some(HeldGrant {
                    epoch: 1,
                    seq: 2,
                    rate: 0,
                    burst: 0,
                }),
                key_handle: 0,
            }],
            measure: Measure::None,
        };
        // Hand-encoded: Key = 0a 06 "tenant" 12 02 "t0" (12 bytes);
        // HeldGrant = 08 01 10 02 (4 bytes);
        // KeyReport = 0a 0c <key> 10 05 32 04 <held> (2+12 + 2 + 2+4 = 22 bytes);
        // Report = 08 ac 02 (agent_time_ns 300: 3 bytes) 12 16 <keyreport> (24 bytes)
        //        = 27 bytes; AgentMessage = 12 1b <report> = 29 bytes; plus gRPC's 5.
        assert_eq!(report_bytes(&r), 29 + GRPC_PREFIX_BYTES);
    }

    #[test]
    fn a_hello_is_sized_as_protobuf_would_encode_it() {
        let h = Hello {
            agent: "gw-0".into(),
            incarnation: 1,
            agent_time_ns: 300,
            weight: 1,
            report_interval_ms: 250,
            held: Vec::new(),
            grants_by_handle: true,
            rule_shapes: vec![("rpm".into(), 7)],
        };
        // Hello = 08 02 (version) 12 04 "gw-0" 18 01 20 01 28 ac 02 40 fa 01 (report
        // interval) 48 01 (grants by handle) 52 0e [0a 03 "rpm" 11 <8 bytes>] = 36
        // bytes; AgentMessage = 0a 24 <hello> = 38; plus gRPC's 5. (Until the
        // twenty-ninth session the last three fields went uncounted.)
        assert_eq!(hello_bytes(&h), 38 + GRPC_PREFIX_BYTES);
    }

    #[test]
    fn a_lease_extension_is_sized_as_protobuf_would_encode_it() {
        let x = LeaseExtension {
            agent: "gw-0".into(),
            incarnation: 1,
            epoch: 1,
            through_seq: 300,
            lease_expires_at_ns: 0,
        };
        // LeaseExtension = 08 01 10 ac 02 (5 bytes); AllocatorMessage = 2a 05 <ext>
        // = 7 bytes; plus gRPC's 5. Agent and incarnation name the stream only.
        assert_eq!(extension_bytes(&x), 7 + GRPC_PREFIX_BYTES);
    }

    #[test]
    fn an_unknown_keys_notice_is_sized_as_protobuf_would_encode_it() {
        let u = UnknownHandles {
            agent: "gw-0".into(),
            incarnation: 1,
            key_handles: vec![1, 300],
        };
        // key_handles packed = 0a 03 01 ac 02 (5 bytes); AllocatorMessage = 3a 05
        // <notice> = 7 bytes; plus gRPC's 5.
        assert_eq!(unknown_keys_bytes(&u), 7 + GRPC_PREFIX_BYTES);
    }

    #[test]
    fn a_measure_request_is_sized_as_protobuf_would_encode_it() {
        let m = MeasureRequest {
            agent: "gw-0".into(),
            incarnation: 1,
            key_handles: vec![1, 300],
            window_ms: 100,
        };
        // key_handles packed = 0a 03 01 ac 02 (5 bytes); window_ms = 10 64 (2 bytes);
        // AllocatorMessage = 32 07 <request> = 9 bytes; plus gRPC's 5.
        assert_eq!(measure_request_bytes(&m), 9 + GRPC_PREFIX_BYTES);
        // A report's measure field: 18 02 (2 bytes) when not MEASURE_NONE.
        let r = |measure| Report {
            agent: "gw-0".into(),
            incarnation: 1,
            agent_time_ns: 300,
            keys: Vec::new(),
            measure,
        };
        assert_eq!(
            report_bytes(&r(Measure::End)),
            report_bytes(&r(Measure::None)) + 2
        );
    }
}
