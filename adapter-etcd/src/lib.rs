#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod acquire;
mod client;
mod coalesce;
mod config;
mod confirm;
mod coordinator;
mod core;
mod error;
mod fence;
pub mod keys;
mod lease;
mod operator;
mod session;
mod watch;

use std::sync::Arc;

pub use config::{
    EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT,
    MAX_KEY_PREFIX_BYTES,
};
pub use coordinator::{EtcdCoordinator, MIN_TTL};
pub use fence::EtcdFence;
pub use lease::EtcdLease;

/// The etcd client library this adapter is built on, re-exported so that operator tooling and
/// tests name the same version ([`EtcdCoordinator::client`], [`EtcdCoordinator::from_client`]).
pub use etcd_client;

/// The URL schemes this crate serves: `etcd` (plain gRPC) and `etcds` (gRPC over TLS).
pub const SCHEMES: [&str; 2] = ["etcd", "etcds"];

/// Registers the [`SCHEMES`] in `registry`, for coordinators ([`EtcdCoordinator`]) and fences
/// ([`EtcdFence`]). Each `connect` makes a new client with its own sessions.
pub fn register(registry: &mut lease_core::Registry) {
    for scheme in SCHEMES {
        registry.register_coordinator(
            scheme,
            Arc::new(|url| {
                Box::pin(async move {
                    let c = EtcdCoordinator::connect(EtcdConfig::from_backend_url(url)?).await?;
                    Ok(Arc::new(c) as Arc<dyn lease_core::Coordinator>)
                })
            }),
        );
        registry.register_fence(
            scheme,
            Arc::new(|url| {
                Box::pin(async move {
                    let f = EtcdFence::connect(EtcdConfig::from_backend_url(url)?).await?;
                    Ok(Arc::new(f) as Arc<dyn lease_core::Fence>)
                })
            }),
        );
    }
}
