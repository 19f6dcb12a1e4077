//! [`Cleanups`]: the clean-ups a coordinator has begun in the background, counted so that
//! [`Coordinator::settle`](crate::Coordinator::settle) can wait for them.
//!
//! An adapter cleans up in the background whatever a caller left behind: the waiter entry or
//! the lock of an acquire whose future was dropped (or that ended in an error while a request
//! may still have applied), the lock of a lease dropped without a release. Those tasks run on
//! the application's runtime, and a runtime that shuts down drops them unfinished: what they
//! would have deleted then stays until its TTL or session ends, in the way of every waiter
//! behind it. A process about to exit calls `settle` first.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The clean-ups one coordinator has begun and not finished. Cheap to clone (the clones count
/// together).
///
/// Count a clean-up from the moment it is due, synchronously (in the `Drop` of what was left
/// behind, before any task is spawned or woken): a [`settle`](Cleanups::settle) called right
/// after the drop must find it. [`begin`](Cleanups::begin) returns the guard that counts it;
/// move it into whatever does the work, and it stops counting when that is dropped.
#[derive(Clone, Default)]
pub struct Cleanups {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    pending: AtomicUsize,
    done: Notify,
}

impl fmt::Debug for Cleanups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cleanups")
            .field("pending", &self.pending())
            .finish()
    }
}

impl Cleanups {
    /// No clean-up begun.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one clean-up until the returned guard is dropped.
    pub fn begin(&self) -> PendingCleanup {
        self.inner.pending.fetch_add(1, Ordering::AcqRel);
        PendingCleanup {
            inner: self.inner.clone(),
        }
    }

    /// Spawns `cleanup` on the current tokio runtime, counted until it ends (or the runtime
    /// drops it). Returns false, and counts nothing, outside a runtime.
    pub fn spawn<F>(&self, cleanup: F) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let pending = self.begin();
        runtime.spawn(async move {
            let _pending = pending;
            cleanup.await;
        });
        true
    }

    /// How many clean-ups are under way now.
    pub fn pending(&self) -> usize {
        self.inner.pending.load(Ordering::Acquire)
    }

    /// Resolves once no clean-up is under way, those begun while it waits included. Cancel-safe.
    pub async fn settle(&self) {
        loop {
            // Registered before the count is read, so a clean-up ending in between wakes it.
            let done = self.inner.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            if self.pending() == 0 {
                return;
            }
            done.await;
        }
    }
}

/// One clean-up under way ([`Cleanups::begin`]); it ends when this is dropped.
#[must_use = "the clean-up counts only while this guard lives"]
pub struct PendingCleanup {
    inner: Arc<Inner>,
}

impl fmt::Debug for PendingCleanup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PendingCleanup")
    }
}

impl Drop for PendingCleanup {
    fn drop(&mut self) {
        if self.inner.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.done.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn settle_waits_for_every_clean_up_begun_and_returns_at_once_without() {
        let cleanups = Cleanups::new();
        cleanups.settle().await;
        let first = cleanups.begin();
        assert!(cleanups.spawn(tokio::time::sleep(Duration::from_secs(3))));
        assert_eq!(cleanups.pending(), 2);
        let settled = tokio::spawn({
            let c = cleanups.clone();
            async move {
                c.settle().await;
                tokio::time::Instant::now()
            }
        });
        let start = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Begun while settle waits: waited for too.
        let late = cleanups.begin();
        drop(first);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            !settled.is_finished(),
            "settled with one clean-up under way"
        );
        drop(late);
        let at = settled.await.unwrap();
        assert_eq!(at - start, Duration::from_secs(6));
        assert_eq!(cleanups.pending(), 0);
    }

    #[test]
    fn outside_a_runtime_nothing_is_spawned_or_counted() {
        let cleanups = Cleanups::new();
        assert!(!cleanups.spawn(async {}));
        assert_eq!(cleanups.pending(), 0);
    }
}
