//! The state a Consul coordinator shares with its leases and background tasks (so that
//! `lease.rs` and the tasks import it from here, not from `coordinator.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

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
