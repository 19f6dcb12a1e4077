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

pub use config::{
    EtcdConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX, DEFAULT_PORT, DEFAULT_REQUEST_TIMEOUT,
    MAX_KEY_PREFIX_BYTES,
};
pub use coordinator::{EtcdCoordinator, MIN_TTL};
pub use fence::{EtcdFence, MAX_FENCE_VALUE_BYTES};
pub use lease::EtcdLease;

/// The etcd client library this adapter is built on, re-exported so that operator tooling and
/// tests name the same version ([`EtcdCoordinator::client`], [`EtcdCoordinator::from_client`]).
pub use etcd_client;

/// The URL schemes this crate serves: `etcd` (plain gRPC) and `etcds` (gRPC over TLS).
pub const SCHEMES: [&str; 2] = ["etcd", "etcds"];

/// Registers the [`SCHEMES`] in `registry`, for coordinators ([`EtcdCoordinator`]) and fences
/// ([`EtcdFence`]). Each `connect` makes a new client with its own sessions.
pub fn register(registry: &mut lease_core::Registry) {
    registry.register_coordinator_fn(&SCHEMES, |url| async {
        EtcdCoordinator::connect(EtcdConfig::from_backend_url(url)?).await
    });
    registry.register_fence_fn(&SCHEMES, |url| async {
        EtcdFence::connect(EtcdConfig::from_backend_url(url)?).await
    });
}
