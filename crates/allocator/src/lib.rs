//! The Bursar allocator. **Not built yet**: this crate holds no code today.
//!
//! It will own the control plane of `../shared/DESIGN.md`: a sans-IO allocation core
//! (agent registry with incarnations, smoothed demand per key and agent, weighted
//! max-min water-filling, revoke-before-grant, leases echoing the agent's timestamp,
//! epoch fencing, partition postures, `check_invariants()` for budget conservation)
//! and a thin shell (tonic stream per agent, etcd election, a JSON admin endpoint),
//! with the `bursar-allocator` binary.
//!
//! Until it exists, agents run standalone: each agent's slice is the whole limit
//! (`bursar_agent::SliceSource::Standalone`). The agent side already accepts slice
//! updates (`bursar_agent::Engine::apply_slices`), which is what this crate will drive.
//!
//! # Layout
//!
//! Empty until the issue "Allocator: demand-weighted slices with bounded overshoot"
//! lands.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
