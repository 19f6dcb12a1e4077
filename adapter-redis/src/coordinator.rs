//! [`RedisCoordinator`]: construction, the state it shares with the acquire recipe
//! (`acquire.rs`) and the operator actions (`operator.rs`), and the hooks the `Coordinator`
//! impl is generated from.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lease_core::adapter::{Cleanups, Op, TokenAdmission};
use lease_core::{Capabilities, LockKey, OwnerId, Result, Token};

use crate::client::Connection;
use crate::config::RedisConfig;
use crate::core::*;
use crate::error::{bad_reply, BACKEND};
use crate::keys::LockKeys;
use crate::renewals::Renewals;
use crate::wakeups::Wakeups;

/// The smallest TTL the adapter accepts. Redis expires keys with millisecond precision, but a
/// lease must outlive at least one round trip and the drift margin to be of any use.
pub const MIN_TTL: Duration = Duration::from_millis(10);

/// Fenced leases on Redis.
///
/// - **Acquire** is one script ([`EVALSHA`](crate#round-trips)): if the lock key is free, increment
///   the key's counter (above the configured floor) and set the lock to
///   `nonce|token|acquired-at|owner|operation` with `PX ttl`; else return the holder and its TTL.
/// - **Waiting** subscribes to the key's release channel on a dedicated pub/sub connection and
///   retries on each notification, at the holder's expiry, and at least every `poll_interval`.
///   Waiters are not served in arrival order: the first to run the script after a release wins.
/// - **Renew** and **release** are one script each, comparing the lease's nonce first.
/// - **Outside changes** to a held lock (an operator's `DEL`, another tool's `SET`) are noticed by
///   a holder monitor (client-side tracking, or polling where tracking is refused) and end the
///   lease at once; a broken connection marks every lease in doubt until its next renew.
/// - **Tokens** never go backwards in this process: a token at or below one this process already
///   granted for the key fails closed with `TokenRegression`. Across processes, durability (checked
///   at connect) and the token floor keep them increasing; see the crate docs.
///
/// Cloning is cheap and shares the connections.
#[derive(Clone)]
pub struct RedisCoordinator {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for RedisCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisCoordinator")
            .field("url", self.inner.config.url())
            .field("key_prefix", &self.inner.config.key_prefix())
            .field("durable_tokens", &self.inner.caps.durable_tokens)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for RedisCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "redis coordinator at {}", self.inner.config.url())
    }
}

impl RedisCoordinator {
    /// Connects: opens the command connection, checks durability (unless `volatile_tokens`), and
    /// opens the pub/sub connection for wake-ups.
    ///
    /// # Errors
    /// - `Misconfigured` naming each setting that would lose tokens (`appendonly`, `appendfsync`,
    ///   `maxmemory-policy`), or saying that they cannot be checked (`CONFIG` disabled), or bad
    ///   credentials.
    /// - `Unavailable` when the server cannot be reached within the connect timeout.
    /// - `InvalidInput` for a TLS file (`tls_ca_file`, `tls_cert_file`, `tls_key_file`) that
    ///   cannot be read or does not hold what its option names, or a URL the client rejects.
    pub async fn connect(config: RedisConfig) -> Result<Self> {
        let conn = Connection::open(&config).await?;
        Self::start(config, conn).await
    }

    /// A coordinator that opens its connections with a redis-rs client the application already
    /// has (its own address, TLS and credentials); `config` gives the adapter's own settings
    /// (key prefix, token floor, timeouts, owner) and names the server in the token watermark,
    /// so its host should be the client's. Connects and checks the server as
    /// [`RedisCoordinator::connect`] does.
    pub async fn from_client(client: redis::Client, config: RedisConfig) -> Result<Self> {
        let conn = Connection::open_with(&config, client).await?;
        Self::start(config, conn).await
    }

    async fn start(config: RedisConfig, conn: Connection) -> Result<Self> {
        let tokens = TokenAdmission::new(
            BACKEND,
            format!(
                "redis://{}{}#{}",
                config.url().hosts().join(","),
                config.url().expose().path(),
                config.key_prefix()
            ),
            config.token_floor(),
        );
        let conn = Arc::new(conn);
        let wakeups = Wakeups::start(&conn, config.request_timeout()).await?;
        let (monitor, watch) = Monitor::new();
        let caps = Capabilities::new(BACKEND)
            .min_ttl(MIN_TTL)
            .per_lease_ttl(true)
            .durable_tokens(!config.volatile_tokens())
            .shared_across_processes(true);
        let default_owner = config
            .owner()
            .cloned()
            .unwrap_or_else(OwnerId::for_this_process);
        let renewals = Renewals::start(
            conn.clone(),
            config.replica_acks(),
            config.request_timeout() / 2,
        );
        let inner = Arc::new(Inner {
            config,
            conn,
            renewals,
            wakeups,
            caps,
            local_waiters: Default::default(),
            default_owner,
            tokens,
            live: Mutex::new(LiveSet::default()),
            monitor,
            cleanups: Cleanups::new(),
        });
        let weak = Arc::downgrade(&inner);
        inner.conn.set_on_break(Box::new(move || {
            if let Some(inner) = weak.upgrade() {
                crate::monitor::all_in_doubt(&inner);
            }
        }));
        let started = crate::monitor::spawn(Arc::downgrade(&inner), watch);
        // Bounded: without the monitor in place a lease is still judged at the monitor's first
        // read, only later.
        let _ = tokio::time::timeout(inner.config.connect_timeout(), started).await;
        Ok(RedisCoordinator { inner })
    }

    /// Parses `url` ([`RedisConfig::from_url`]) and connects.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(RedisConfig::from_url(url)?).await
    }

    /// The configuration (its `Debug` and `Display` redact the password).
    pub fn config(&self) -> &RedisConfig {
        &self.inner.config
    }

    /// The highest token this process has granted for `key` on this server and key prefix, if
    /// any: tokens at or below it are refused with `TokenRegression`
    /// ([`lease_core::adapter::Watermarks`]).
    pub fn high_water_mark(&self, key: &LockKey) -> Option<Token> {
        self.inner.tokens.highest(key)
    }

    /// The lock's value and PTTL (`GET` and `PTTL` in one `MULTI`/`EXEC`: one round trip, atomic,
    /// and read-only, so it passes `CLIENT PAUSE WRITE` and works on a replica), or `None` when
    /// free.
    pub(crate) async fn read_lock(&self, keys: &LockKeys, op: Op) -> Result<Option<(String, i64)>> {
        let (value, pttl): (Option<Vec<u8>>, i64) = self
            .inner
            .conn
            .run(op, |mut c| async move {
                redis::pipe()
                    .atomic()
                    .cmd("GET")
                    .arg(keys.lock())
                    .cmd("PTTL")
                    .arg(keys.lock())
                    .query_async(&mut c)
                    .await
            })
            .await?;
        match value {
            None => Ok(None),
            Some(v) => {
                let v = String::from_utf8(v).map_err(|_| bad_reply(op, "value not UTF-8"))?;
                Ok(Some((v, pttl)))
            }
        }
    }
}

lease_core::coordinator_from_primitives!(RedisCoordinator);

impl RedisCoordinator {
    /// `capabilities`.
    pub(crate) fn caps(&self) -> &Capabilities {
        &self.inner.caps
    }

    /// The clean-ups under way, which `settle` waits for.
    pub(crate) fn cleanups(&self) -> &lease_core::adapter::Cleanups {
        &self.inner.cleanups
    }

    /// The turns of this coordinator's waiting acquires.
    pub(crate) fn local_waiters(&self) -> Option<&lease_core::adapter::LocalWaiters> {
        Some(&self.inner.local_waiters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn px_rounds_up_to_whole_milliseconds() {
        assert_eq!(px_millis(Duration::from_millis(400)), 400);
        assert_eq!(px_millis(Duration::from_micros(400_001)), 401);
        assert_eq!(px_millis(Duration::from_nanos(1)), 1);
    }
}
