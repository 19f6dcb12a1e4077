//! The state an etcd coordinator shares with its leases and background tasks (so that
//! `lease.rs` and the tasks import it from here, not from `coordinator.rs`).

use etcd_client::Client;

use crate::config::EtcdConfig;
use crate::confirm::Confirmer;
use crate::session::Cleaner;
use crate::watch::Watcher;

/// What a coordinator shares with its leases.
pub(crate) struct Handle {
    pub(crate) client: Client,
    pub(crate) config: EtcdConfig,
    pub(crate) cleaner: Cleaner,
    /// The coordinator's one watch stream (guardians and waiters).
    pub(crate) watcher: Watcher,
    /// Batched reads of held keys (renewals).
    pub(crate) confirmer: Confirmer,
}

/// The numbers in use in holders' and waiters' own key names, per session and lock.
///
/// A key is named `<lock prefix><session>-<slot>` with the lowest slot free for that session
/// and lock, so one client acquiring a lock again and again writes the same key name each time.
/// etcd keeps an index entry for every key name ever written until the next compaction, and
/// every read of a lock's range (the `try_acquire` check, the queue read) walks them all: with a
/// new name per attempt, each acquisition of a lock cost more than the one before (measured with
/// lease-bench, server CPU per acquire+release rose from 362 to 429 µs between a 1 s and a 6 s
/// run, while a client reusing its key name stayed at 256 µs).
///
/// A slot stays taken for as long as a key by its name may exist or may still be written by a
/// request in flight: by the attempt, then by the lease, then by a background cleanup, each
/// holding a [`Slot`] clone.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    used: std::sync::Mutex<std::collections::HashMap<String, std::collections::BTreeSet<u64>>>,
}

/// A slot in use (see [`Slots`]); the last clone dropped frees it.
#[derive(Debug, Clone)]
pub(crate) struct Slot(std::sync::Arc<Taken>);

#[derive(Debug)]
struct Taken {
    slots: std::sync::Arc<Slots>,
    base: String,
    number: u64,
}

impl Slots {
    /// Takes the lowest free slot of `base` (a lock prefix and a session).
    pub(crate) fn take(self: &std::sync::Arc<Self>, base: String) -> Slot {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let set = used.entry(base.clone()).or_default();
        let number = (0..).find(|n| !set.contains(n)).unwrap_or(0);
        set.insert(number);
        Slot(std::sync::Arc::new(Taken {
            slots: self.clone(),
            base,
            number,
        }))
    }

    /// Slots in use over every lock and session (for tests).
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        let used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        used.values().map(|s| s.len()).sum()
    }
}

impl Slot {
    /// Its number in the key name.
    pub(crate) fn number(&self) -> u64 {
        self.0.number
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut used = self.slots.used.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(set) = used.get_mut(&self.base) {
            set.remove(&self.number);
            if set.is_empty() {
                used.remove(&self.base);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_lowest_free_slot_is_reused_once_every_clone_is_dropped() {
        let slots = Arc::new(Slots::default());
        let a = slots.take("p/s".into());
        let b = slots.take("p/s".into());
        assert_eq!((a.number(), b.number()), (0, 1));
        assert_eq!(slots.take("q/s".into()).number(), 0, "per lock and session");
        let a2 = a.clone();
        drop(a);
        assert_eq!(
            slots.take("p/s".into()).number(),
            2,
            "a clone still holds 0"
        );
        drop(a2);
        assert_eq!(slots.take("p/s".into()).number(), 0);
        drop(b);
        assert_eq!(slots.in_use(), 0, "nothing left behind");
    }
}
