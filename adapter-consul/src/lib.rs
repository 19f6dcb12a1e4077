#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod acquire;
mod client;
mod config;
mod confirm;
mod coordinator;
mod core;
mod error;
mod keys;
mod lease;
mod monitor;
mod operator;
mod session;

use lease_core::Registry;

pub use config::{
    ConsulConfig, CONSUL_MAX_LOCK_DELAY, CONSUL_SESSION_TTL_MAX, CONSUL_SESSION_TTL_MIN,
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX, DEFAULT_LOCK_DELAY, DEFAULT_MAX_BLOCK,
    DEFAULT_REQUEST_TIMEOUT, ENV_VARS, MAX_KEY_PREFIX_BYTES,
};
pub use coordinator::ConsulCoordinator;
pub use keys::escape_key;
pub use lease::ConsulLease;
/// The HTTP crates this adapter's client is built on, so that
/// [`ConsulCoordinator::from_client`] is given a client of the same versions: hyper-util's
/// pooled client, and the request body type it sends (`http_body_util::Full<bytes::Bytes>`).
pub use {bytes, http_body_util, hyper_util};

/// The backend name in capabilities, errors and metrics.
pub const BACKEND: &str = "consul";

/// The URL schemes this adapter serves: `consul` (HTTP) and `consuls` (HTTPS).
pub const SCHEMES: [&str; 2] = ["consul", "consuls"];

/// Registers [`ConsulCoordinator`] for every scheme in [`SCHEMES`].
///
/// After this, `registry.connect("consul://127.0.0.1:8500")` parses the URL with
/// [`ConsulConfig::from_backend_url`] (the `CONSUL_*` environment filling what the URL leaves
/// out) and makes a coordinator (nothing is sent until the first
/// acquire). The adapter has no fence: protect the resource with another backend's fence.
pub fn register(registry: &mut Registry) {
    registry.register_coordinator_fn(&SCHEMES, |url| async {
        ConsulCoordinator::connect(ConsulConfig::from_backend_url(url)?).await
    });
}
