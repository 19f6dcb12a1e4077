#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod acquire;
mod client;
mod coalesce;
mod config;
mod coordinator;
mod core;
mod error;
mod keys;
mod lease;
mod operator;
mod out_of_band;
mod session;

use lease_core::Registry;

pub use config::{
    ZkConfig, DEFAULT_BASE_PATH, DEFAULT_KEY_PREFIX, DEFAULT_PORT, DEFAULT_SESSION_TIMEOUT,
    MAX_TIMEOUT, MIN_SESSION_TIMEOUT,
};
pub use coordinator::ZkCoordinator;
pub use lease::ZkLease;
#[doc(hidden)]
pub use out_of_band::{close_session_out_of_band, OutOfBandClose};
/// The client library, re-exported for operators' tools and tests that talk to ZooKeeper directly.
pub use zookeeper_client;

/// The URL scheme this adapter serves.
pub const SCHEME: &str = "zk";

/// Registers [`ZkCoordinator`] for [`SCHEME`] (`zk://`).
///
/// After this, `registry.connect("zk://...")` parses the URL with
/// [`ZkConfig::from_backend_url`] and opens a session. ZooKeeper is a coordinator only: no fence
/// is registered for `zk://`.
pub fn register(registry: &mut Registry) {
    registry.register_coordinator_fn(&[SCHEME], |url| async {
        ZkCoordinator::connect(ZkConfig::from_backend_url(url)?).await
    });
}
