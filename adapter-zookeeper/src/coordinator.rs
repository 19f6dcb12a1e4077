//! [`ZkCoordinator`]: construction, the session, and the hooks the `Coordinator` impl is
//! generated from.

use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use lease_core::adapter::{Cleanups, SharedOpening, TokenAdmission};
use lease_core::{Capabilities, LockKey, OwnerId, Result};

use crate::config::ZkConfig;
use crate::core::Inner;
use crate::error::BACKEND;
use crate::session::Session;

/// A [`Coordinator`](lease_core::Coordinator) on ZooKeeper: one session per coordinator, one ephemeral sequential node per
/// contender, the holder's czxid as the token. See the crate docs for the semantics.
///
/// Cloning is cheap and shares the session.
#[derive(Clone)]
pub struct ZkCoordinator {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for ZkCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkCoordinator")
            .field("config", &self.inner.config)
            .field("session_timeout", &self.inner.caps.min_ttl)
            .finish()
    }
}

impl ZkCoordinator {
    /// Opens a session with the ensemble named by `config` and makes sure `<base>/locks` exists.
    ///
    /// The negotiated session timeout becomes [`Capabilities::min_ttl`]. Errors: `Unavailable`
    /// when no session could be established within the connect timeout, `Misconfigured` when the
    /// credentials may not create or use the base path.
    pub async fn connect(config: ZkConfig) -> Result<Self> {
        let cleanups = Cleanups::new();
        let session = Session::connect(&config, "/", cleanups.clone()).await?;
        Ok(Self::start(config, "/".to_owned(), session, cleanups))
    }

    /// A coordinator on a ZooKeeper session the application already has (its own client, with
    /// its own credentials and chroot); `config` gives the adapter's own settings (base path,
    /// token floor, timeouts, owner), names the ensemble in the token watermark (its hosts
    /// should be the client's), and is what a new session is opened from once this one ends
    /// (an expiry or a close ends every lease on it, as for a session of the coordinator's own).
    /// The base path is within the client's chroot, and so is every later session's: its locks
    /// are those of a coordinator from a URL whose base path is the chroot and then the base
    /// path.
    ///
    /// The session is confirmed with one `sync` first (when it was last confirmed is not known),
    /// then `<base>/locks` is made sure of, as [`ZkCoordinator::connect`] does. Give `config` the
    /// digest credentials the client authenticated with: they decide the ACL of the nodes the
    /// coordinator creates. Errors: `Unavailable` or `OutcomeUnknown` when the sync gets no
    /// answer, `Misconfigured` as for `connect`.
    pub async fn from_client(client: zookeeper_client::Client, config: ZkConfig) -> Result<Self> {
        let cleanups = Cleanups::new();
        let chroot = client.path().to_owned();
        let session = Session::adopt(&config, client, cleanups.clone()).await?;
        Ok(Self::start(config, chroot, session, cleanups))
    }

    /// The coordinator on its first session, within `chroot` (`/` for none), whose clean-ups
    /// count among `cleanups`.
    fn start(config: ZkConfig, chroot: String, session: Arc<Session>, cleanups: Cleanups) -> Self {
        let caps = Capabilities::new(BACKEND)
            .min_ttl(session.timeout())
            .per_lease_ttl(false)
            .durable_tokens(true)
            .shared_across_processes(true);
        // The nodes' full path: a coordinator from a URL whose base path is the chroot and then
        // this base path shares the scope.
        let within = chroot.trim_end_matches('/');
        let tokens = TokenAdmission::new(
            BACKEND,
            format!("{}{within}{}", config.connect_string(), config.base_path()),
            config.token_floor(),
        );
        let owner = config
            .owner()
            .cloned()
            .unwrap_or_else(OwnerId::for_this_process);
        ZkCoordinator {
            inner: Arc::new(Inner {
                config,
                chroot,
                caps,
                local_waiters: Default::default(),
                session: SharedOpening::with_open(BACKEND, session),
                client_id: rand::random(),
                attempts: AtomicU64::new(0),
                owner,
                tokens,
                cleanups,
            }),
        }
    }

    /// Parses `url` ([`ZkConfig::from_url`]) and connects.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(ZkConfig::from_url(url)?).await
    }

    /// The configuration (shown redacted).
    pub fn config(&self) -> &ZkConfig {
        &self.inner.config
    }

    /// The session timeout the server negotiated at connect: every lease's minimum TTL.
    pub fn session_timeout(&self) -> Duration {
        self.inner.caps.min_ttl
    }

    /// The znode of `key`'s lock (the parent of its contender nodes), for operators' tools.
    pub fn lock_path(&self, key: &LockKey) -> String {
        self.inner.config.lock_path(key)
    }

    /// The id and password of this coordinator's current ZooKeeper session, or `None` when none
    /// is open (it ended and no call has opened a new one yet). For operators' tools and tests
    /// that act on the session itself: a client connected with
    /// `zookeeper_client::Connector::with_session` and the same digest credentials takes the
    /// session over and can close it, as an operator closing a holder's session would.
    ///
    /// The password stays inside the returned `SessionInfo`, whose `Debug` leaves it out; never
    /// log it. Opens no session and sends nothing.
    #[doc(hidden)]
    pub async fn current_session(&self) -> Option<zookeeper_client::SessionInfo> {
        let session = self.inner.session.current(|s| !s.is_terminated())?;
        Some(session.client().session().clone())
    }

    /// The live session, or a new one if the last one ended: callers asking while one is being
    /// opened await that opening ([`SharedOpening`]).
    pub(crate) async fn session(&self) -> Result<Arc<Session>> {
        let inner = &self.inner;
        inner
            .session
            .get(
                |s| !s.is_terminated(),
                || {
                    let (config, declared) = (inner.config.clone(), inner.caps.min_ttl);
                    let (chroot, cleanups) = (inner.chroot.clone(), inner.cleanups.clone());
                    async move {
                        let s = Session::connect(&config, &chroot, cleanups).await?;
                        if s.timeout() != declared {
                            tracing::warn!(
                                negotiated = ?s.timeout(),
                                ?declared,
                                "the new zookeeper session negotiated another timeout than the \
                                 first one; leases use the new one for validity"
                            );
                        }
                        Ok(s)
                    }
                },
            )
            .await
    }
}

lease_core::coordinator_from_primitives!(ZkCoordinator);

impl ZkCoordinator {
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
