//! The Bursar ledger. **Not built yet**: this crate holds no code today.
//!
//! It will own billing truth: immutable usage events (keyed by `event_key` from the
//! request id), a durable store behind a narrow trait (redb first; a sled backend may
//! follow behind a cargo feature and must pass the same conformance suite), merge by
//! set union with deterministic conflict resolution, per (tenant, hour) digests, and
//! a cluster shell (foca for membership, quinn with mutual TLS for sync), with the
//! `bursar-ledger` binary. The agent will embed it as a local durable outbox.
//!
//! Today the agent hands usage records to `bursar_agent::UsageSink`; this crate will
//! provide the sink that makes them durable.
//!
//! # Layout
//!
//! Empty until the issue "Ledger: exact, durable, gossip-merged usage records" lands.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
