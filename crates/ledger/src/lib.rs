//! The Bursar ledger: billing truth. It owns the usage event model, validation,
//! merge by set union with a deterministic conflict rule, per (tenant, hour) digests,
//! exact totals with corrections applied, the storage trait with its conformance
//! suite, and the durable redb backend. ("The limiter gates, the meter bills": the
//! agent's counters are never read for billing; this crate is what is.)
//!
//! # What works, what does not (yet)
//!
//! Built and tested: the sans-IO core ([`event`], [`wire`], [`merge`], [`digest`],
//! [`totals`]), the [`Store`] trait with the in-memory reference model
//! ([`MemStore`]) and the redb backend ([`RedbStore`], group commit, fsync before
//! acknowledgement, refuses a damaged data file), and the single-node HTTP shell
//! ([`server`], feature `server`, default) behind the `bursar-ledger` binary.
//!
//! The cluster (feature `cluster`, part of `server`): [`cluster`] runs QUIC (quinn)
//! with mutual TLS from a cluster CA, foca membership, push of new batches and the
//! digest-driven anti-entropy of [`reconcile`], with rkyv messages in a checked
//! envelope ([`cluster::frame`]). Every node holds every event.
//!
//! **Not built:** version vectors (by choice: digests find every difference; see
//! docs/ledger.md, "Cluster"), deeper sub-bucket splitting, a second backend.
//!
//! The API, the guarantees and the evidence for each are in `docs/ledger.md`;
//! ingest figures in `docs/BENCHMARKS.md` ("Ledger"). The core builds without the shell:
//! `cargo check -p bursar-ledger --no-default-features`.
//!
//! # Layout
//!
//! - [`event`]: [`Event`], [`EventKey`] (from the request id), validation
//!   ([`Limits`]), the canonical binary encoding and the element hash.
//! - [`wire`]: the JSON shape of an event, parsed by hand so each bad field gets its
//!   own error.
//! - [`merge`]: the conflict rule (the smaller canonical encoding wins) and the
//!   per-batch report.
//! - [`digest`]: per (tenant, hour) digests and the root, order-independent and
//!   updated incrementally.
//! - [`totals`]: exact per-bucket totals with `void` and `adjust` applied.
//! - [`store`]: the [`Store`] trait, the merge algorithm every backend shares
//!   ([`store::apply_batch`]), [`MemStore`], and queries ([`store::usage_totals`]).
//! - [`reconcile`]: digest-driven reconciliation between two stores, sans-IO (the
//!   core the cluster's anti-entropy runs over its streams).
//! - [`redb_store`]: the durable backend; [`id_runs`]: its dedupe index (sorted runs).
//! - [`counter`]: a number that only grows across restarts (membership generation,
//!   the allocator's term file).
//! - `cluster` (feature `cluster`): QUIC transport, TLS, membership, push and pull.
//! - `server` (feature `server`): the HTTP JSON shell: one writer thread owns the
//!   writes and group-commits concurrent requests; reads use MVCC snapshots.
//! - `main.rs`: the `bursar-ledger` binary (clap, anyhow).
//! - [`conformance`]: the suite every backend's tests call.
//! - [`testing`]: seeded fixtures shared by tests and benchmarks.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

#[cfg(feature = "cluster")]
pub mod cluster;
pub mod conformance;
pub mod counter;
pub mod digest;
pub mod event;
pub mod id_runs;
pub mod merge;
pub mod reconcile;
pub mod redb_store;
#[cfg(feature = "server")]
pub mod server;
pub mod store;
pub mod testing;
pub mod totals;
pub mod wire;

pub use event::{Body, Event, EventKey, Limits, Status, TokenDeltas, Tokens, ValidationError};
pub use redb_store::RedbStore;
pub use store::{MemStore, Store, StoreError};
