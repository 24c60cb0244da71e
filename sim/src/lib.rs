//! The Bursar simulator. **Not built yet**: this crate holds no code today.
//!
//! It will own `bursar-sim`: a deterministic discrete-event simulation that drives the
//! *real* agent engine (`bursar_agent::Engine`, whose every operation already takes
//! `now` as an argument) and the real allocator core with virtual time, over thousands
//! of gateways with network faults, and checks the measured overshoot of every key
//! against the allocator's stated bound with a verifier token bucket.
//!
//! # Layout
//!
//! Empty until the issue "Simulator: measure overshoot against its bound" lands.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
