//! [`EtcdCoordinator`]: construction and the hooks the `Coordinator` impl is generated from.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use lease_core::adapter::{DelayedStarts, TokenAdmission};
use lease_core::{Capabilities, LockKey, OwnerId, Result};

use crate::client::client_for;
use crate::coalesce::Txns;
use crate::config::EtcdConfig;
use crate::confirm::Confirmer;
use crate::core::{Handle, Inner};
use crate::error::BACKEND;
use crate::keys;
use crate::lease::GUARD_DELAY;
use crate::session::Cleaner;
use crate::watch::Watcher;

/// etcd's smallest lease TTL with its default election timeout (1 s): a 1 s request is
/// granted 2 s. The adapter rejects smaller TTLs rather than hand out a longer lease than asked;
/// a cluster whose election timeout is longer has a larger minimum, and a TTL below that is
/// refused (`TtlBelowMinimum` naming the server's minimum) once etcd's grant shows it.
pub const MIN_TTL: Duration = Duration::from_secs(2);

/// A coordinator on an etcd cluster.
///
/// Cheap to clone (clones share the connection and the sessions). Connect with
/// [`EtcdCoordinator::connect`] or, by URL, through `fenced::connect("etcd://...")`.
/// See the crate docs for the semantics.
#[derive(Clone)]
pub struct EtcdCoordinator {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for EtcdCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdCoordinator")
            .field("config", &self.inner.handle.config)
            .field("owner", &self.inner.owner)
            .finish_non_exhaustive()
    }
}

/// The capabilities every etcd coordinator declares.
fn capabilities() -> Capabilities {
    Capabilities::new(BACKEND)
        .min_ttl(MIN_TTL)
        .per_lease_ttl(false)
        .durable_tokens(true)
        .shared_across_processes(true)
}

impl EtcdCoordinator {
    /// Connects to the cluster `config` names. With credentials, etcd's `Authenticate` RPC runs
    /// now (a wrong password is `Misconfigured`); over TLS (`etcds://`) one `Status` request
    /// checks the handshake now (a refused certificate is `Misconfigured` naming the TLS
    /// problem). Otherwise the connection opens lazily and an unreachable cluster shows as
    /// `Unavailable` on the first call.
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        let client = client_for(&config).await?;
        Self::from_client(client, config).await
    }

    /// A coordinator on a client the application already has (its own connection, balancer
    /// and credentials); `config` gives the adapter's own settings (key prefix, token floor,
    /// timeouts, owner) and names the cluster in the token watermark, so its endpoints should
    /// be the client's. Sends nothing: it starts the coordinator's background tasks on the
    /// current tokio runtime (async and fallible so that every adapter's `from_client` reads
    /// the same: `X::from_client(client, config).await?`).
    ///
    /// # Errors
    /// Never fails today; the `Result` is the signature every adapter's `from_client` has.
    pub async fn from_client(client: etcd_client::Client, config: EtcdConfig) -> Result<Self> {
        let owner = config
            .owner()
            .cloned()
            .unwrap_or_else(OwnerId::for_this_process);
        let cleaner = Cleaner::start(client.clone(), config.request_timeout());
        let watcher = Watcher::start(client.clone(), config.request_timeout());
        let confirmer = Confirmer::start(client.clone(), config.request_timeout());
        let tokens = TokenAdmission::new(
            BACKEND,
            format!(
                "etcd://{}#{}",
                config.endpoints().join(","),
                config.key_prefix()
            ),
            config.token_floor(),
        );
        Ok(EtcdCoordinator {
            inner: Arc::new(Inner {
                handle: Arc::new(Handle {
                    txns: Txns::new(client.clone(), config.request_timeout()),
                    client,
                    config,
                    cleaner,
                    watcher,
                    confirmer,
                    guardians: DelayedStarts::new(GUARD_DELAY, GUARD_DELAY / 2),
                }),
                caps: capabilities(),
                owner,
                sessions: std::sync::Mutex::new(HashMap::new()),
                attempts: AtomicU64::new(rand::random::<u32>() as u64),
                slots: Default::default(),
                tokens,
            }),
        })
    }

    /// Parses `url` ([`EtcdConfig::from_url`]) and connects.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(EtcdConfig::from_url(url)?).await
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.inner.handle.config
    }

    /// The etcd key range holding `key`'s holder and waiters (see [`crate::keys`]).
    pub fn lock_prefix(&self, key: &LockKey) -> String {
        keys::lock_prefix(self.config().key_prefix(), key)
    }

    /// The underlying etcd-client (cheap to clone), for operator tooling and tests.
    pub fn client(&self) -> Client {
        self.inner.handle.client.clone()
    }
}

impl Inner {
    pub(crate) fn timeout(&self) -> Duration {
        self.handle.config.request_timeout()
    }
}

lease_core::coordinator_from_primitives!(EtcdCoordinator);

impl EtcdCoordinator {
    /// `capabilities`.
    pub(crate) fn caps(&self) -> &Capabilities {
        &self.inner.caps
    }

    /// The clean-ups under way, which `settle` waits for.
    pub(crate) fn cleanups(&self) -> &lease_core::adapter::Cleanups {
        self.inner.handle.cleaner.cleanups()
    }

    /// None: etcd's queue already gives each waiter its turn (FIFO by create revision, each
    /// waiter first once the keys ahead of its own are deleted: no herd, no request per
    /// wake-up), and taking turns locally would enqueue a waiter only after the previous
    /// waiter's grant, one round trip more in every hand-off (measured with lease-bench, when
    /// waiters watched their predecessor: 64 tasks on 4 keys fell from 641 to 90 grants/s).
    pub(crate) fn local_waiters(&self) -> Option<&lease_core::adapter::LocalWaiters> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_declare_etcd() {
        let c = capabilities();
        assert_eq!(c.min_ttl, MIN_TTL);
        assert!(!c.per_lease_ttl && c.durable_tokens && c.shared_across_processes);
    }
}
