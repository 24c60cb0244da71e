//! The Bursar gateway agent: admits or rejects each request against in-memory budget
//! slices, with no network hop.
//!
//! This crate owns the agent's **budget engine** (a sans-IO core: every operation takes
//! `now`) and its shell (feature `shell`, default): the HTTP JSON API, Envoy RLS v3, the
//! OpenAI-compatible proxy, a `tower::Layer`, and the allocator sync client; and the
//! `bursar-agent` binary (front doors, `demo`, `check-config`, `hash-key`).
//!
//! ```
//! use std::sync::Arc;
//! use bursar_agent::{AdmitRequest, Config, Cost, DiscardSink, Engine, Usage, CompletionStatus};
//!
//! let config = Config::from_toml(r#"
//!     [[rule]]
//!     name = "org-rpm"
//!     match = { org = "*" }
//!     dimension = "requests"
//!     rate = 60
//!     per = "minute"
//! "#).unwrap();
//! let engine = Engine::new(config, Arc::new(DiscardSink));
//! let now = 0;
//! let decision = engine.admit(now, &AdmitRequest {
//!     request_id: "req-1",
//!     domain: None,
//!     descriptors: &[("org", "acme")],
//!     cost: Cost::ONE_REQUEST,
//!     ttl_ms: None,
//! }).unwrap();
//! assert!(decision.is_admitted());
//! engine.complete(now, "req-1", Usage::default(), CompletionStatus::Ok).unwrap();
//! ```
//!
//! A thread that admits and completes many requests keeps a [`Worker`]
//! (`engine.worker()`, an `Arc<Engine>`'s): `Worker::admit_into` and
//! `Worker::complete` read the key table through the worker's cached snapshot and
//! reuse its buffers, the cheapest path. `Worker::try_acquire` is the bare keyed check
//! (no lease, what `governor` does) on a [`KeyHandle`] resolved once; the admitted
//! cost of repeated checks on one key reaches the key's counts within
//! [`DEMAND_BUFFER_NS`] (see its docs).
//!
//! # Layout
//!
//! - [`config`]: rules and engine settings from TOML, validated with errors that name
//!   the rule and field.
//! - `bucket`: the atomic GCRA bucket and concurrency slots (sealing, conversion
//!   under invariant 2).
//! - [`engine`]: the engine: key table (arc-swap snapshot + slow path), admit,
//!   complete, extend, charge, slices, maintenance, invariants.
//! - `lease`: the sharded lease table and tombstones.
//! - [`usage`]: usage records and the sink trait the ledger consumes.
//! - [`clock`]: monotonic clocks for the shell (the engine takes `now`).
//! - [`testing`]: fixtures shared by tests, benches and the demo.
//! - `shell` (feature `shell`, default): the front doors over the engine (HTTP JSON
//!   API, Envoy RLS v3, OpenAI proxy, `tower::Layer`), the allocator sync client, the
//!   maintenance ticker, and the durable usage outbox (`shell::outbox`: records to
//!   ledger events in a local redb file, committed before a completion is answered)
//!   with its forwarder to ledger nodes (`shell::forward`).
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod bucket;
pub mod clock;
pub mod config;
pub mod engine;
mod error;
mod key;
mod lease;
#[cfg(feature = "shell")]
pub mod shell;
pub mod sync_core;
pub mod sync_session;
pub mod testing;
pub mod usage;

pub use bucket::RateLimit;
pub use config::{
    ApiKey, Config, ConfigError, Dimension, EngineConfig, MAX_COST, Mode, Period, Posture, Rule,
    RuleLimit, RuleSet, SliceSource, Unmatched,
};
pub use engine::{
    AdmitRequest, Admitted, Completion, Cost, DEMAND_BUFFER_NS, Decision, Engine, KeyHandle,
    KeyTotals, LimitStatus, Limits, MaintainReport, RejectReason, Rejected, ReloadSummary,
    RuleStats, SliceApplied, SliceExtension, SliceUpdate, Worker,
};
pub use error::{AdmitError, CompleteError, ExtendError, HandleError, ReloadError, SliceError};
pub use key::LimitKey;
pub use usage::{
    CompletionStatus, DiscardSink, MemorySink, Outcome, OwnedRecord, RecordLimit, Usage,
    UsageRecord, UsageSink,
};
