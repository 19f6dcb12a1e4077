//! The state a Consul coordinator shares with its acquire recipe, operator actions, leases and
//! background tasks (so that they import it from here, not from `coordinator.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lease_core::adapter::{Cleanups, LocalWaiters, TokenAdmission};
use lease_core::{Capabilities, OwnerId};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use crate::client::Http;
use crate::config::ConsulConfig;
use crate::confirm::Confirmer;
use crate::monitor::Monitor;
use crate::session::SessionManager;

/// At most this many blocking queries of waiting acquires are in flight per coordinator (each
/// holds one connection of the long-poll pool). A waiter beyond them waits for a slot (within its
/// own deadline); its next query resumes from the last index it saw, so it misses no change,
/// only sees it later.
pub(crate) const MAX_WAITING_QUERIES: usize = 64;

/// While fewer than a quarter of the waiting slots are free, a waiter's blocking query waits at
/// most this long, so the slots go round.
pub(crate) const BUSY_WAIT: Duration = Duration::from_secs(2);

/// What a coordinator shares with its acquire recipe and operator actions.
pub(crate) struct Inner {
    pub(crate) config: ConsulConfig,
    pub(crate) caps: Capabilities,
    /// The turns of this coordinator's waiting acquires.
    pub(crate) local_waiters: LocalWaiters,
    pub(crate) http: Arc<Http>,
    pub(crate) confirmer: Arc<Confirmer>,
    /// The one blocking query that watches every held key (loss detection).
    pub(crate) monitor: Arc<Monitor>,
    /// Slots for waiting acquires' blocking queries (see [`MAX_WAITING_QUERIES`]).
    pub(crate) waits: Arc<tokio::sync::Semaphore>,
    pub(crate) sessions: Arc<SessionManager>,
    pub(crate) slots: Arc<Slots>,
    pub(crate) default_owner: OwnerId,
    /// Admits grants; the watermark's scope is agent, datacenter and key prefix (each
    /// datacenter has its own Raft index; two prefixes are two lock namespaces).
    pub(crate) tokens: TokenAdmission,
    /// The clean-ups under way, which `settle` waits for.
    pub(crate) cleanups: Cleanups,
}

/// Per-key claims inside one client. Consul lets a session re-acquire a key it already holds, so
/// two leases of one client (one session) on one key must be kept apart locally: a second
/// acquire waits here (FIFO) until the first lease is released, lost and settled.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    map: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A held claim; dropping it frees the key for the client's next acquire.
pub(crate) struct SlotGuard {
    slots: Arc<Slots>,
    key: String,
    mutex: Arc<tokio::sync::Mutex<()>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let mut map = self.slots.map.lock().unwrap_or_else(|p| p.into_inner());
        drop(self.guard.take());
        // Only the map and this guard still know the mutex: nobody waits, forget it.
        if Arc::strong_count(&self.mutex) == 2 {
            map.remove(&self.key);
        }
    }
}

impl Slots {
    /// Claims `key`: at once (`deadline` `None`), or waiting until `deadline`. `None` if busy.
    pub(crate) async fn claim(
        self: &Arc<Self>,
        key: &str,
        deadline: Option<Instant>,
    ) -> Option<SlotGuard> {
        let mutex = self
            .map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_owned())
            .or_default()
            .clone();
        let guard = match deadline {
            None => mutex.clone().try_lock_owned().ok()?,
            Some(d) => tokio::time::timeout_at(d, mutex.clone().lock_owned())
                .await
                .ok()?,
        };
        Some(SlotGuard {
            slots: self.clone(),
            key: key.to_owned(),
            mutex,
            guard: Some(guard),
        })
    }
}
