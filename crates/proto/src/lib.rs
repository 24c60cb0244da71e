//! Wire types for Bursar. **Not built yet**: this crate holds no types today.
//!
//! It will own, and only own, the bytes that cross a process boundary:
//!
//! - the agent <-> allocator protocol: one bidirectional gRPC stream per agent
//!   (hello with agent id, incarnation and held grants; delta demand reports; grants
//!   carrying the allocator's term; acks; a redirect to the leader), as protobuf
//!   compiled at build time with `protox` and `tonic-prost-build` (no system `protoc`);
//! - Envoy's rate limit service, `envoy.service.ratelimit.v3`, wire compatible with
//!   Envoy's definition (same package, message names and field numbers);
//! - the ledger's gossip messages, as rkyv archives inside a versioned envelope
//!   (magic, version, type, length), validated before use.
//!
//! No I/O lives here. See `../shared/DESIGN.md` ("Protocols") and the open issues
//! "Allocator" and "Agent front doors".
//!
//! # Layout
//!
//! Empty until the issues above land.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
