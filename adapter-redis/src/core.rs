//! The state a redis coordinator shares with its leases and background tasks (so that
//! `lease.rs` and the tasks import it from here, not from `coordinator.rs`).

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lease_core::adapter::{retry_until_settled, Backoff, Cleanups, LeaseTracker, TokenAdmission};
use lease_core::{Capabilities, LeaseStatus, LostReason, OwnerId, Result};
use tokio::time::Instant;

use crate::client::Connection;
use crate::config::RedisConfig;
use crate::error::{bad_reply, ops, BACKEND};
use crate::keys::LockKeys;
use crate::renewals::Renewals;
use crate::scripts::{self, reply};
use crate::wakeups::Wakeups;

/// How long a `revoked` marker lives when the removed lock had no TTL (never the case for locks
/// this adapter wrote).
pub(crate) const MARKER_WITHOUT_TTL_MS: u64 = 60_000;

/// The state shared by a coordinator, its leases and its background tasks.
pub(crate) struct Inner {
    pub(crate) config: RedisConfig,
    pub(crate) conn: Arc<Connection>,
    /// Batched renewals ([`crate::renewals`]).
    pub(crate) renewals: Renewals,
    pub(crate) wakeups: Wakeups,
    pub(crate) caps: Capabilities,
    /// The turns of this coordinator's waiting acquires.
    pub(crate) local_waiters: lease_core::adapter::LocalWaiters,
    pub(crate) default_owner: OwnerId,
    /// Admits grants: in range, above the floor and above every token this process was granted
    /// for the lock on this server and key prefix (fail closed otherwise).
    pub(crate) tokens: TokenAdmission,
    /// Live leases of this process by nonce, so that a local force release marks them revoked
    /// and the holder monitor can judge them.
    pub(crate) live: Mutex<LiveSet>,
    /// Watches the lock keys of live leases ([`crate::monitor`]).
    pub(crate) monitor: Monitor,
    /// The clean-ups under way ([`spawn_cleanup`]), which `settle` waits for.
    pub(crate) cleanups: Cleanups,
}

/// What the coordinator keeps about one live lease.
#[derive(Clone)]
pub(crate) struct LiveLease {
    pub(crate) nonce: u128,
    pub(crate) tracker: LeaseTracker,
    /// The lock's names (shared with the lease).
    pub(crate) keys: Arc<LockKeys>,
    /// `v1|<nonce>|`: the prefix of this lease's lock value (shared with the lease).
    pub(crate) head: Arc<str>,
}

/// A map key that is a lock's name, borrowed from the lease's [`LockKeys`] (no copy of the
/// name per held lease); looked up by `&str`.
#[derive(Clone)]
struct ByLock(Arc<LockKeys>);

impl PartialEq for ByLock {
    fn eq(&self, other: &Self) -> bool {
        self.0.lock() == other.0.lock()
    }
}

impl Eq for ByLock {}

impl std::hash::Hash for ByLock {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes, so that lookups by `&str` find it (`Borrow` contract).
        self.0.lock().hash(state);
    }
}

impl std::borrow::Borrow<str> for ByLock {
    fn borrow(&self) -> &str {
        self.0.lock()
    }
}

/// The live leases, by nonce and by lock key (the holder monitor looks them up by the keys an
/// invalidation names, thousands of times a second with thousands of leases).
#[derive(Default)]
pub(crate) struct LiveSet {
    pub(crate) by_nonce: HashMap<u128, LiveLease>,
    by_key: HashMap<ByLock, Vec<u128>>,
}

impl LiveSet {
    pub(crate) fn insert(&mut self, lease: LiveLease) {
        self.by_key
            .entry(ByLock(lease.keys.clone()))
            // Almost always one lease per lock: no room for four.
            .or_insert_with(|| Vec::with_capacity(1))
            .push(lease.nonce);
        self.by_nonce.insert(lease.nonce, lease);
    }

    fn remove(&mut self, nonce: u128) {
        let Some(lease) = self.by_nonce.remove(&nonce) else {
            return;
        };
        let name = lease.keys.lock();
        if let Some(nonces) = self.by_key.get_mut(name) {
            nonces.retain(|n| *n != nonce);
            if nonces.is_empty() {
                self.by_key.remove(name);
            }
        }
    }

    fn on_keys(&self, keys: &[String]) -> Vec<LiveLease> {
        keys.iter()
            .filter_map(|k| self.by_key.get(k.as_str()))
            .flatten()
            .filter_map(|n| self.by_nonce.get(n).cloned())
            .collect()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    /// How many replica acknowledgements a grant about to be sent waits for (`replica_acks`;
    /// `auto` is one once the primary reported a streaming replica, counted again now and then
    /// while it has not: [`Connection::acks_for`]).
    pub(crate) async fn replica_acks(&self) -> Result<usize> {
        self.conn.acks_for(self.config.replica_acks()).await
    }

    /// [`Self::replica_acks`] as known now, counting nothing.
    pub(crate) fn replica_acks_known(&self) -> usize {
        self.conn.acks_known(self.config.replica_acks())
    }

    /// Compare-and-delete by nonce (`head`), then wake waiters: the script's code (`1` when
    /// deleted, else see `scripts::NOT_OURS`), and whether it is the code of a resend after the
    /// first send's connection dropped (that send may have deleted it).
    pub(crate) async fn release_by_head(&self, keys: &LockKeys, head: &str) -> (Result<i64>, bool) {
        let (v, resent) = self
            .conn
            .eval_noting_resend(
                ops::RELEASE,
                &scripts::RELEASE,
                &[keys.lock(), keys.revoked()],
                &[head.as_bytes(), keys.channel().as_bytes()],
            )
            .await;
        let code =
            v.and_then(|v| reply::int(&v).ok_or_else(|| bad_reply(ops::RELEASE, "not an integer")));
        (code, resent)
    }

    /// Stops tracking a lease (dropped, or about to be released: from then on the monitor does
    /// not judge it, so its own delete is never taken for an outside one).
    pub(crate) fn forget(&self, nonce: u128) {
        lock(&self.live).remove(nonce);
    }

    /// A snapshot of the live leases.
    pub(crate) fn live_leases(&self) -> Vec<LiveLease> {
        lock(&self.live).by_nonce.values().cloned().collect()
    }

    /// A snapshot of the live leases on any of the lock keys `keys`.
    pub(crate) fn live_on(&self, keys: &[String]) -> Vec<LiveLease> {
        lock(&self.live).on_keys(keys)
    }

    /// Whether any lease is live.
    pub(crate) fn has_live_leases(&self) -> bool {
        !lock(&self.live).by_nonce.is_empty()
    }

    /// Judges `lease` by its lock's current `value` and the key's `revoked` record (both read
    /// after the lease was registered): still ours, nothing; force-released (the revoked record
    /// is ours) or gone, `Lost(Revoked)`; another value, `Lost(Superseded)`. Only while the
    /// lease is still live (a lease being released is not judged on its own delete).
    pub(crate) fn judge(&self, lease: &LiveLease, value: Option<&[u8]>, revoked: Option<&[u8]>) {
        let live = lock(&self.live);
        if !live.by_nonce.contains_key(&lease.nonce) {
            return;
        }
        let ours = |v: &[u8]| v.starts_with(lease.head.as_bytes());
        let reason = match value {
            Some(v) if ours(v) => return,
            // Force-released, and maybe taken by the next holder since.
            _ if revoked.is_some_and(ours) => LostReason::Revoked,
            Some(_) => LostReason::Superseded,
            None => LostReason::Revoked,
        };
        // A lease whose local validity has passed is reported as expired, not as taken.
        if matches!(lease.tracker.status(), LeaseStatus::Lost(_)) {
            return;
        }
        tracing::warn!(
            backend = BACKEND,
            key = %lease.tracker.key(),
            %reason,
            "the lock of a held lease was changed from outside"
        );
        lease.tracker.mark_lost(reason);
    }
}

/// How long a background cleanup keeps trying.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cleanup {
    /// Release once (a dropped lease): retry only while the server cannot be reached.
    Once,
    /// A request of ours may still be pending at the server (its reply was never seen): keep
    /// trying to compare-and-delete until our lock is deleted or the TTL has passed, because the
    /// request may run after a first "not ours".
    UntilExpiry,
}

/// Removes, in the background and best-effort, a lock of ours (compare-and-delete by nonce).
/// Never outlives the lock's TTL (after which Redis has removed it anyway). Needs a tokio runtime;
/// without one the lock simply expires.
pub(crate) fn spawn_cleanup(
    inner: Arc<Inner>,
    keys: Arc<LockKeys>,
    head: Arc<str>,
    ttl: Duration,
    mode: Cleanup,
) {
    let give_up = Instant::now() + ttl + Duration::from_secs(1);
    let cap = (ttl / 20).clamp(Duration::from_secs(1), Duration::from_secs(30));
    let cleanups = inner.cleanups.clone();
    cleanups.spawn(async move {
        let backoff = Backoff::new(Duration::from_millis(50), cap);
        let last_error = Mutex::new(None);
        let settled = retry_until_settled(backoff, Some(give_up), || async {
            match (inner.release_by_head(&keys, &head).await.0, mode) {
                (Ok(1), _) | (Ok(_), Cleanup::Once) => ControlFlow::Break(()),
                (outcome, _) => {
                    *lock(&last_error) = outcome.err().map(|e| e.to_string());
                    ControlFlow::Continue(())
                }
            }
        })
        .await;
        if settled.is_none() {
            if let Some(error) = lock(&last_error).take() {
                tracing::debug!(backend = BACKEND, key = %keys.lock(), %error, "cleanup gave up; the lock expires at its TTL");
            }
        }
    });
}

/// Whether a status means the lease is already gone without anything to delete.
pub(crate) fn nothing_to_delete(status: LeaseStatus) -> Option<LostReason> {
    match status {
        LeaseStatus::Lost(
            r @ (LostReason::Released | LostReason::Revoked | LostReason::Superseded),
        ) => Some(r),
        _ => None,
    }
}

/// A TTL as Redis `PX` milliseconds, rounded *up*, so that the server never expires the lock
/// before the client's own validity estimate (computed from the exact TTL) ends.
pub(crate) fn px_millis(ttl: Duration) -> u128 {
    ttl.as_nanos().div_ceil(1_000_000)
}

/// The coordinator's handle on its monitor task ([`crate::monitor`]): the lock keys of new
/// leases, each with its grant time, for the task to read once they are old enough. Dropping it
/// ends the task.
///
/// A grant only appends to the queue; the task is woken when the queue stops being empty, not
/// once per grant (under load thousands of grants a second would otherwise each wake it), and
/// otherwise sleeps until the oldest entry is due.
pub(crate) struct Monitor {
    queue: Arc<WatchQueue>,
}

/// The queue shared by a [`Monitor`] and its task.
#[derive(Default)]
pub(crate) struct WatchQueue {
    granted: Mutex<std::collections::VecDeque<(Instant, Arc<LockKeys>)>>,
    /// Woken when the queue stops being empty, and when the monitor is dropped.
    wake: tokio::sync::Notify,
    closed: std::sync::atomic::AtomicBool,
}

impl WatchQueue {
    /// Whether the coordinator is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Resolves when a key is queued into an empty queue, or the coordinator is gone (a wake-up
    /// that came while nobody waited is kept for the next call).
    pub(crate) async fn changed(&self) {
        self.wake.notified().await
    }

    /// When the oldest queued key was granted.
    pub(crate) fn oldest(&self) -> Option<Instant> {
        lock(&self.granted).front().map(|(at, _)| *at)
    }

    /// Takes the lock keys granted at or before `until`, oldest first.
    pub(crate) fn take_granted_by(&self, until: Instant) -> Vec<String> {
        let mut granted = lock(&self.granted);
        let mut keys = Vec::new();
        while granted.front().is_some_and(|(at, _)| *at <= until) {
            keys.extend(granted.pop_front().map(|(_, k)| k.lock().to_owned()));
        }
        keys
    }

    /// Forgets every queued key (the task reads every held key anyway).
    pub(crate) fn clear(&self) {
        lock(&self.granted).clear();
    }
}

impl Monitor {
    /// A handle and the queue for [`crate::monitor::spawn`].
    pub(crate) fn new() -> (Self, Arc<WatchQueue>) {
        let queue = Arc::new(WatchQueue::default());
        (
            Monitor {
                queue: queue.clone(),
            },
            queue,
        )
    }

    /// Starts watching the lock of `keys` (a lease on it was just granted and registered as
    /// live).
    pub(crate) fn watch(&self, keys: &Arc<LockKeys>) {
        let mut granted = lock(&self.queue.granted);
        let was_empty = granted.is_empty();
        granted.push_back((Instant::now(), keys.clone()));
        drop(granted);
        if was_empty {
            self.queue.wake.notify_one();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.queue
            .closed
            .store(true, std::sync::atomic::Ordering::Release);
        self.queue.wake.notify_one();
    }
}
