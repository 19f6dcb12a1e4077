//! [`ConsulCoordinator`]: construction and the hooks the `Coordinator` impl is generated from.

use std::fmt;
use std::sync::Arc;

use lease_core::adapter::TokenAdmission;
use lease_core::{Capabilities, LeaseOptions, OwnerId, Result};

use crate::client::Http;
use crate::config::ConsulConfig;
use crate::confirm::Confirmer;
use crate::core::{Inner, Slots, MAX_WAITING_QUERIES};
use crate::monitor::Monitor;
use crate::session::SessionManager;
use crate::BACKEND;

// ---------------------------------------------------------------------------- the coordinator

/// A Consul coordinator: one session per client, locks on KV keys, tokens from the Raft index.
///
/// See the crate documentation ("Semantics on Consul") for the exact behaviour. Cloning is cheap
/// and shares the client and its session.
#[derive(Clone)]
pub struct ConsulCoordinator {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for ConsulCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulCoordinator")
            .field("config", &self.inner.config)
            .field("session", &self.inner.sessions.peek().map(|s| s.id.clone()))
            .finish()
    }
}

impl ConsulCoordinator {
    /// A coordinator for `config`. Sends nothing: the session is created by the first acquire
    /// (async only so that every adapter's constructor reads the same).
    ///
    /// # Errors
    /// `Misconfigured` if TLS cannot be set up (no CA certificates; an unreadable or empty CA
    /// file or directory, client certificate or key; an invalid `tls_server_name`);
    /// `InvalidInput` for a token that cannot be sent as a header.
    pub async fn connect(config: ConsulConfig) -> Result<Self> {
        let http = Http::new(&config)?;
        Ok(Self::start(config, http))
    }

    /// A coordinator that sends its requests with an HTTP client the application already has:
    /// hyper-util's pooled client (the stack this adapter is built on, re-exported as
    /// [`crate::hyper_util`]) with the application's own connector (its TLS setup, proxy,
    /// resolver). `config` gives the agent's address and scheme (`consuls://` for HTTPS; the
    /// connector must speak it), the ACL token, the datacenter and the adapter's own settings
    /// (key prefix, session TTL, token floor, timeouts, owner); its TLS files are not read.
    ///
    /// Every request goes through the client's one pool. [`ConsulCoordinator::connect`] keeps
    /// one pool each for session requests, blocking queries and the rest (decision 0015); with
    /// HTTP/1.1 the pool opens a connection for a request that finds none idle, so a session
    /// renewal does not wait behind a blocking query either way. Sends nothing.
    ///
    /// # Errors
    /// `InvalidInput` for a token that cannot be sent as a header.
    pub async fn from_client<C>(
        client: hyper_util::client::legacy::Client<C, http_body_util::Full<bytes::Bytes>>,
        config: ConsulConfig,
    ) -> Result<Self>
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let http = Http::with_client(client, &config)?;
        Ok(Self::start(config, http))
    }

    fn start(config: ConsulConfig, http: Http) -> Self {
        let http = Arc::new(http);
        let default_owner = config
            .owner()
            .cloned()
            .unwrap_or_else(OwnerId::for_this_process);
        let caps = Capabilities::new(BACKEND)
            .min_ttl(config.session_ttl())
            .max_ttl(LeaseOptions::MAX_TTL)
            .per_lease_ttl(false)
            .durable_tokens(true)
            .shared_across_processes(true)
            .lock_delay(config.lock_delay());
        let sessions = Arc::new(SessionManager::new(
            http.clone(),
            config.session_ttl(),
            config.lock_delay(),
            format!("fenced {default_owner}"),
        ));
        ConsulCoordinator {
            inner: Arc::new(Inner {
                tokens: TokenAdmission::new(BACKEND, config.token_scope(), config.token_floor()),
                monitor: Arc::new(Monitor::new(
                    http.clone(),
                    config.locks_prefix(),
                    config.max_block(),
                )),
                config,
                caps,
                local_waiters: Default::default(),
                confirmer: Arc::new(Confirmer::new(http.clone())),
                waits: Arc::new(tokio::sync::Semaphore::new(MAX_WAITING_QUERIES)),
                http,
                sessions,
                slots: Arc::new(Slots::default()),
                default_owner,
                cleanups: Default::default(),
            }),
        }
    }

    /// Parses `url` ([`ConsulConfig::from_url`]) and makes a coordinator. Sends nothing.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(ConsulConfig::from_url(url)?).await
    }

    /// The configuration (token redacted in its `Debug` and `Display`).
    pub fn config(&self) -> &ConsulConfig {
        &self.inner.config
    }

    /// The ID of the client's current Consul session, if one is live (for diagnostics).
    pub fn session_id(&self) -> Option<String> {
        self.inner.sessions.peek().map(|s| s.id.clone())
    }
}

lease_core::coordinator_from_primitives!(ConsulCoordinator);

impl ConsulCoordinator {
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
