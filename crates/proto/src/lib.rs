//! Wire types for Bursar.
//!
//! This crate owns the bytes that cross a process boundary, and nothing else (no I/O).
//! Built today:
//!
//! - **Envoy's rate limit service v3** (`envoy.service.ratelimit.v3`), wire compatible
//!   with Envoy's definition (same package, message names and field numbers), written
//!   from the published field list in `proto/`. Messages are prost types; the service
//!   has a tonic server and client.
//!
//! - **The agent <-> allocator stream** (`bursar.allocator.v1`): one bidirectional
//!   gRPC stream per agent carrying hello, delta reports and acks one way, and welcome,
//!   grants, leader redirects and config versions the other. Versioned
//!   ([`allocator::PROTOCOL_VERSION`], checked on hello) and bounded
//!   ([`allocator::MAX_MESSAGE_BYTES`], [`allocator::MAX_KEYS_PER_MESSAGE`]).
//!
//! Not built yet: the ledger's rkyv gossip envelope. See DESIGN.md, "Protocols".
//!
//! Protobuf is compiled at build time by `protox` (pure Rust) and `tonic-prost-build`:
//! no system `protoc` is needed.
//!
//! # Layout
//!
//! - `proto/envoy/...`, `proto/bursar/...`: the `.proto` sources.
//! - [`envoy`]: generated modules, nested by protobuf package.
//! - [`bursar`]: Bursar's own packages (generated); [`allocator`] re-exports
//!   `bursar.allocator.v1` with its version and size bounds.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

/// The prost version the messages are built with (for `encoded_len` and friends
/// without a second, possibly different, dependency).
pub use prost;

/// Envoy's API packages (generated).
pub mod envoy {
    /// `envoy.config`
    pub mod config {
        /// `envoy.config.core`
        pub mod core {
            /// `envoy.config.core.v3`
            #[allow(missing_docs, clippy::all)]
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    /// `envoy.type`
    pub mod r#type {
        /// `envoy.type.v3`
        #[allow(missing_docs, clippy::all)]
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    /// `envoy.extensions`
    pub mod extensions {
        /// `envoy.extensions.common`
        pub mod common {
            /// `envoy.extensions.common.ratelimit`
            pub mod ratelimit {
                /// `envoy.extensions.common.ratelimit.v3`
                #[allow(missing_docs, clippy::all)]
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    /// `envoy.service`
    pub mod service {
        /// `envoy.service.ratelimit`
        pub mod ratelimit {
            /// `envoy.service.ratelimit.v3`
            #[allow(missing_docs, clippy::all)]
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
    }
}

pub use envoy::service::ratelimit::v3 as rls;

/// Bursar's own API packages (generated).
pub mod bursar {
    /// `bursar.allocator`
    pub mod allocator {
        /// `bursar.allocator.v1`: the agent <-> allocator stream.
        #[allow(missing_docs, clippy::all)]
        pub mod v1 {
            tonic::include_proto!("bursar.allocator.v1");
        }
    }
}

/// The parts of etcd's v3 API the allocator's leader election uses (lease, election),
/// wire compatible with etcd (our own `.proto` in `proto/etcd/`).
pub mod etcd {
    /// `etcdserverpb` (lease service and messages).
    #[allow(missing_docs, clippy::all)]
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    /// `mvccpb`.
    #[allow(missing_docs, clippy::all)]
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    /// `v3electionpb` (election service).
    #[allow(missing_docs, clippy::all)]
    pub mod v3electionpb {
        tonic::include_proto!("v3electionpb");
    }
}

/// The agent <-> allocator protocol (`bursar.allocator.v1`) and its bounds.
pub mod allocator {
    pub use crate::bursar::allocator::v1::*;

    /// The protocol version this crate speaks; a hello with another one is refused.
    pub const PROTOCOL_VERSION: u32 = ProtocolVersion::ProtocolVersion2 as u32;

    /// Largest encoded message either side sends or accepts (set on the tonic server
    /// and client as the maximum encoding and decoding size). A report of
    /// [`MAX_KEYS_PER_MESSAGE`] keys with 256-byte values fits.
    pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;

    /// Most keys one report, hello or ack names, and most grants in one `Grants`
    /// message. Senders split larger sets; receivers refuse larger messages whole.
    pub const MAX_KEYS_PER_MESSAGE: usize = 10_000;

    /// The rules version both ends put in `Hello.config_version` and
    /// `Welcome.config_version`: FNV-1a (64 bit, hex) of a canonical rendering of the
    /// rules (both ends pass the `Debug` text of `bursar_agent::RuleSet`, so one build
    /// of agent and allocator agrees on equal rules).
    pub fn config_version(canonical_rules: &str) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in canonical_rules.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::allocator::*;
    use prost::Message;

    #[test]
    fn a_hello_round_trips_and_carries_the_protocol_version() {
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(Hello {
                protocol_version: PROTOCOL_VERSION,
                agent: "node-a".into(),
                incarnation: 7,
                weight: 1,
                agent_time_ns: 123,
                report_interval_ms: 250,
                grants_by_handle: true,
                rule_shapes: Vec::new(),
                held: vec![HeldSlice {
                    key: Some(Key {
                        rule: "org-rpm".into(),
                        values: vec!["acme".into()],
                    }),
                    grant: Some(HeldGrant {
                        epoch: 3,
                        seq: 9,
                        rate: 100,
                        burst: 10,
                    }),
                }],
                config_version: "abc".into(),
            })),
        };
        let bytes = hello.encode_to_vec();
        assert!(bytes.len() < MAX_MESSAGE_BYTES);
        let back = AgentMessage::decode(bytes.as_slice()).unwrap();
        assert_eq!(back, hello);
        assert_eq!(PROTOCOL_VERSION, 2);
    }

    #[test]
    fn a_full_report_of_the_largest_allowed_size_fits_in_one_message() {
        let keys = (0..MAX_KEYS_PER_MESSAGE)
            .map(|i| KeyReport {
                key: Some(Key {
                    rule: "key-input-tpm-with-a-long-name".into(),
                    values: vec![format!("{i:0>200}")],
                }),
                admitted: u64::MAX,
                rejected: u64::MAX,
                counting_since_ns: u64::MAX,
                in_flight: u64::MAX,
                held: Some(HeldGrant {
                    epoch: u64::MAX,
                    seq: u64::MAX,
                    rate: u64::MAX,
                    burst: u64::MAX,
                }),
                key_handle: 0,
            })
            .collect();
        let m = AgentMessage {
            msg: Some(agent_message::Msg::Report(Report {
                agent_time_ns: u64::MAX,
                keys,
                measure: Measure::End.into(),
            })),
        };
        let len = m.encoded_len();
        assert!(len <= MAX_MESSAGE_BYTES, "{len} bytes");
    }
}
