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
//! Not built yet: the agent <-> allocator stream (hello, delta reports, grants, acks,
//! leader redirect) and the ledger's rkyv gossip envelope. See DESIGN.md, "Protocols".
//!
//! Protobuf is compiled at build time by `protox` (pure Rust) and `tonic-prost-build`:
//! no system `protoc` is needed.
//!
//! # Layout
//!
//! - `proto/envoy/...`: the `.proto` sources.
//! - [`envoy`]: generated modules, nested by protobuf package.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

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
