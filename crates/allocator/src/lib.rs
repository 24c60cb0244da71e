//! The Bursar allocator's **allocation core**: a sans-IO state machine that moves budget
//! slices between agents by demand and never grants more than a limit plus the
//! configured overdraft (DESIGN.md, "The overshoot contract").
//!
//! This crate owns, today:
//!
//! - the agent registry with incarnations (a restart releases the old grants at once;
//!   two live agents claiming one id is refused);
//! - per limit key, smoothed demand per agent (admitted + rejected cost, from cumulative
//!   counters), weighted max-min water-filling, spare capacity to rejecting agents, a
//!   reserve kept free for newcomers, and hysteresis;
//! - **revoke before grant** (invariant 1): commitments count every grant an agent might
//!   still be using; growth only from what is free; overdraft `O` is the only excess;
//! - token transfer: tokens released by acknowledged shrinks go, as level, to agents
//!   that grow;
//! - leases echoing the agent's report timestamp (invariant 3), grants carrying the term
//!   and a sequence number (invariant 4), and a new term that learns what agents hold
//!   for one lease before granting anything beyond it;
//! - partition postures (`strict` / `conservative` / `open`) and the per-key overshoot
//!   bound they imply ([`Allocator::overshoot_bound`], docs/tuning.md);
//! - incremental recomputation: only keys whose demand changed, batched over
//!   `recompute_delay_ms`; a key with many agents is recomputed whole on a slower
//!   schedule and, in between, a report re-targets just the reporting agent's entry
//!   against the key's last water level (growth still only from what is free);
//! - `check_invariants()` (budget conservation per key, caches, indexes, bounds);
//! - rules reload ([`Allocator::reload`]): changed limits recomputed at once (a shrink
//!   revokes before anything grows, its excess counted in the bound meanwhile), removed
//!   and replaced rules released, old agents' lines for them ignored.
//!
//! It reads the agents' own rules file through `bursar_agent::Config`, and each
//! [`Grant`] maps one-to-one onto `bursar_agent::SliceUpdate` ([`Grant::to_slice_update`]).
//!
//! **Beside the core**, behind the default feature `shell`, this crate also holds the
//! `bursar-allocator` binary and its tokio shell (`shell`: one task owning the core, a
//! tonic stream per agent, the JSON admin endpoint, terms from `--term`/`--term-file`
//! or an etcd election, reload on SIGHUP); see that module's docs. Outside this crate: the wire types (`crates/proto`) and the agent's
//! sync client (`crates/gateway-agent`'s shell). The core compiles without tokio
//! (`--no-default-features`) and never reads a clock: every input carries `now`.
//!
//! ```
//! use bursar_agent::Config;
//! use bursar_allocator::{Allocator, AllocatorConfig, Hello, KeyName, KeyReport, Measure, Report};
//!
//! let rules = Config::from_toml(r#"
//!     [[rule]]
//!     name = "org-rpm"
//!     match = { org = "*" }
//!     dimension = "requests"
//!     rate = 600
//!     per = "minute"
//! "#).unwrap();
//! let cfg = AllocatorConfig { lease_ms: 1_000, reclaim_margin_ms: 100, ..Default::default() };
//! let mut alloc = Allocator::new(&rules, cfg, 1, 0).unwrap();
//! let sec = 1_000_000_000;
//! alloc.handle_timeout(2 * sec); // a new term learns for one lease first
//! alloc.handle_hello(2 * sec, &Hello {
//!     agent: "node-a".into(), incarnation: 1, agent_time_ns: 50, weight: 1,
//!     report_interval_ms: 250, held: vec![], grants_by_handle: false,
//!     rule_shapes: vec![],
//! }).unwrap();
//! alloc.handle_report(2 * sec, &Report {
//!     agent: "node-a".into(), incarnation: 1, agent_time_ns: 100,
//!     keys: vec![KeyReport {
//!         key: KeyName::new("org-rpm", &["acme"]),
//!         admitted: 0, rejected: 1, counting_since_ns: 100, in_flight: 0, held: None,
//!         key_handle: 0,
//!     }],
//!     measure: Measure::None,
//! }).unwrap();
//! alloc.handle_timeout(alloc.poll_timeout());
//! let grants: Vec<_> = alloc.drain_grants().collect();
//! assert_eq!(grants.len(), 1);
//! assert!(grants[0].rate > 0 && grants[0].rate <= 600);
//! alloc.check_invariants().unwrap();
//! ```
//!
//! # Layout
//!
//! - [`core`]: the state machine ([`Allocator`]): registry, demand, allocation,
//!   accounting, leases, terms, postures, bound, invariants; `core/reload.rs`: applying
//!   new rules ([`ReloadSummary`], [`RuleStatus`]).
//! - [`waterfill`]: weighted max-min shares and their rounding (pure arithmetic).
//! - [`msg`]: the core's messages (hello, report, ack, grant) and the mapping onto
//!   `bursar_agent::SliceUpdate`.
//! - [`config`]: the allocator's own settings, with bounds and `validate()`.
//! - `error`: [`AllocError`], one enum for the message boundary.
//! - [`testing`]: fixtures shared by tests and benchmarks.
//! - `shell` and `main.rs` (feature `shell`): the binary's tokio shell (not part of the
//!   core; see above).
//! - `benches/allocation.rs`: a full pass over 1,000 agents x 100,000 keys and a
//!   100-key report (figures in docs/BENCHMARKS.md ("Allocator core")).
//! - `tests/properties.rs`: random demand, report orders, losses, delays, ack loss,
//!   restarts, failovers and rules reloads against budget conservation (inside and
//!   outside view).
//! - `tests/shell.rs`: the real binary on loopback, reload included.
//! - `tests/conformance.rs`: the real agent engines and this core under a virtual
//!   clock, checked by a verifier token bucket; prints utilization and slice-move time.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod config;
pub mod core;
mod error;
pub mod msg;
#[cfg(feature = "shell")]
pub mod shell;
pub mod testing;
pub mod waterfill;

pub use config::{AllocatorConfig, ConfigError, MAX_AGENT_ID_BYTES};
pub use core::{
    AgentSlice, Allocator, KeyStatus, OvershootBound, ReloadSummary, RuleStatus, Slice,
};
pub use error::AllocError;
pub use msg::{
    Ack, Grant, GrantRef, HeldGrant, HeldSlice, Hello, KeyName, KeyReport, LeaseExtension, Measure,
    MeasureRequest, Report, Revocation, SliceAck, UnknownHandles,
};
