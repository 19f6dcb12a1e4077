#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

mod acquire;
mod client;
mod config;
mod coordinator;
mod core;
mod error;
mod fence;
mod keys;
mod lease;
mod monitor;
mod operator;
mod renewals;
mod scripts;
mod wakeups;

use lease_core::Registry;

pub use config::{
    RedisConfig, ReplicaAcks, SentinelConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_KEY_PREFIX,
    DEFAULT_POLL_INTERVAL, DEFAULT_REQUEST_TIMEOUT, DEFAULT_SENTINEL_PORT, MAX_INTERVAL,
    MAX_KEY_PREFIX_BYTES, MAX_REPLICA_ACKS,
};
pub use coordinator::{RedisCoordinator, MIN_TTL};
pub use fence::{RedisFence, MAX_FENCE_VALUE_BYTES};
pub use lease::RedisLease;
/// The redis-rs crate this adapter is built on, so that [`RedisCoordinator::from_client`] is
/// given a client of the same version.
pub use redis;

/// The Lua source of the script this adapter runs for `operation`, exactly as it sends it with
/// `EVALSHA`: `"acquire"`, `"renew"`, `"renew_many"`, `"release"`, `"force_release"` or
/// `"fence"`; `None` for any other name.
///
/// For review (teams that approve the scripts run on their servers) and for benchmarks that send
/// the same requests from a raw client. The `KEYS` and `ARGV` each script takes are documented
/// next to it in this crate's `src/scripts.rs`; they are internal and may change in any release.
///
/// ```
/// let acquire = adapter_redis::script_source("acquire").unwrap();
/// assert!(acquire.contains("redis.call('SET', KEYS[1]"));
/// assert!(adapter_redis::script_source("unlock").is_none());
/// ```
pub fn script_source(operation: &str) -> Option<&'static str> {
    scripts::source(operation)
}

/// The URL schemes this adapter serves: `redis` (plain TCP), `rediss` (TLS) and
/// `redis+sentinel` (the primary found through Sentinel, followed across failovers).
pub const SCHEMES: [&str; 3] = ["redis", "rediss", "redis+sentinel"];

/// Registers [`RedisCoordinator`] and [`RedisFence`] for every scheme in [`SCHEMES`].
///
/// After this, `registry.connect("redis://...")` and `registry.connect_fence("redis://...")`
/// parse the URL with [`RedisConfig::from_backend_url`] and connect (durability check included).
pub fn register(registry: &mut Registry) {
    registry.register_coordinator_fn(&SCHEMES, |url| async {
        RedisCoordinator::connect(RedisConfig::from_backend_url(url)?).await
    });
    registry.register_fence_fn(&SCHEMES, |url| async {
        RedisFence::connect(RedisConfig::from_backend_url(url)?).await
    });
}

/// The Redis keys that store the lock `key` under `config`'s key prefix (the lock itself, its
/// token counter, its revocation marker and its audit stream), for operators and tests that
/// delete a lock's storage the way `redis-cli DEL` would. Deleting them is what an operator must
/// not rely on for safety: see the "Semantics on Redis" section on tokens.
pub fn storage_keys(config: &RedisConfig, key: &lease_core::LockKey) -> Vec<String> {
    let k = keys::LockKeys::new(config.key_prefix(), key);
    [k.lock(), k.counter(), k.revoked(), k.audit()]
        .map(str::to_owned)
        .to_vec()
}
