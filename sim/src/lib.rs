//! The Bursar simulator (`bursar-sim`): a deterministic discrete-event simulation that
//! drives the *real* agent engine ([`bursar_agent::Engine`], `slice_source =
//! "allocated"`) and the real allocation core ([`bursar_allocator::Allocator`]) under
//! virtual time, over simulated links with latency, loss and partitions, and checks
//! every key's fleet-wide admissions against a verifier token bucket `(R, B)` and the
//! allocator's stated overshoot bound ([`bursar_allocator::Allocator::overshoot_bound`]).
//!
//! A scenario (TOML, [`scenario::Scenario`]) and a seed replay bit for bit: the event
//! queue is ordered by `(time, seq)`, randomness comes from one seeded [`rng::Rng`], and
//! no map with a random iteration order is walked. See docs/simulation.md.
//!
//! ```
//! let mut sc = bursar_sim::scenario::Scenario::load("steady").unwrap();
//! sc.duration_s = 1.0;
//! sc.gateways = 2;
//! let report = bursar_sim::sim::run(&sc, 7).unwrap();
//! assert_eq!(report.summary.violations, 0);
//! ```
//!
//! # Layout
//!
//! - [`sim`]: the event loop, links, agents (each a real `Engine`, driven as the agent's
//!   sync client drives it), the allocator, faults, the checker and the [`sim::Report`].
//! - [`scenario`]: scenario files, built-ins (`sim/scenarios/*.toml`) and validation.
//! - [`compare`]: `bursar-sim compare`, one scenario under every policy.
//! - [`plot`]: `--plot DIR`, SVG charts of one run, written by hand.
//! - [`policy`]: baseline policies for `--policy` (static split, Doorman-like,
//!   Gubernator-GLOBAL-like).
//! - [`rng`]: the seeded generator.
//! - [`sweep`]: `bursar-sim sweep` (report interval, TTL, burst, overdraft).
//! - [`wire`]: encoded sizes of the control messages (bytes per agent per second).
//! - `main.rs`: the `bursar-sim` binary (`run`, `sweep`, `compare`, `list`).
//! - `tests/sweep.rs`: a short seed sweep over every built-in scenario.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod compare;
pub mod plot;
pub mod policy;
pub mod rng;
pub mod scenario;
pub mod sim;
pub mod sweep;
pub mod wire;
