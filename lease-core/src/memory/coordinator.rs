//! The in-memory [`Coordinator`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::audit::AuditRecord;
use crate::coordinator::{Coordinator, HolderInfo};
use crate::error::{Error, LostReason, Result};
use crate::key::LockKey;
use crate::lease::{Lease, LeaseState, LeaseTracker};
use crate::options::{Capabilities, ForceRelease, LeaseOptions, OwnerId};
use crate::token::Token;

const BACKEND: &str = "memory";

/// A forced release as the in-memory coordinator recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ForcedReleaseRecord {
    /// The key.
    pub key: LockKey,
    /// Who forced it.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// The holder removed, if any.
    pub removed: Option<HolderInfo>,
    /// When (wall clock, for display).
    pub at: SystemTime,
}

struct Holder {
    nonce: u128,
    token: Token,
    expires_at: Instant,
    owner: OwnerId,
    operation: Option<String>,
    acquired_wall: SystemTime,
    tracker: LeaseTracker,
}

struct Waiter {
    id: u64,
    notify: Arc<Notify>,
    /// The end of its wait: past it, the entry holds up nobody (see [`KeyState::prune`]).
    deadline: Instant,
}

#[derive(Default)]
struct KeyState {
    holder: Option<Holder>,
    /// The last token issued for this key. Never reset, even when the key is free.
    last_token: u64,
    waiters: VecDeque<Waiter>,
}

impl KeyState {
    /// Drops an expired holder (marking its lease lost) and waiters whose wait is over, and
    /// wakes the head waiter.
    fn expire(&mut self, now: Instant) {
        self.expire_keeping(now, None);
    }

    /// [`Self::expire`], keeping the waiter `keep` (the one being polled: a waiter that runs
    /// late, past its deadline, still takes a turn that is its own).
    fn expire_keeping(&mut self, now: Instant, keep: Option<u64>) {
        let pruned = self.prune(now, keep);
        if self.holder.as_ref().is_some_and(|h| h.expires_at <= now) {
            let h = self.holder.take().expect("checked");
            h.tracker.mark_lost(LostReason::Expired);
            self.notify_head_keeping(keep);
        } else if pruned {
            self.notify_head_keeping(keep);
        }
    }

    /// Removes the waiters at the head of the queue whose wait is over: an `acquire` future
    /// that is kept but no longer polled (a `select!` that moved on without dropping it) would
    /// otherwise stay at the head past its wait and hold up every later caller, `try_acquire`
    /// included, until it is dropped. Its own next poll reports `Timeout` (or, should the key
    /// be free with nobody queued, grants it as a `try_acquire` would). Whether any was removed.
    fn prune(&mut self, now: Instant, keep: Option<u64>) -> bool {
        let mut pruned = false;
        while self
            .waiters
            .front()
            .is_some_and(|w| w.deadline <= now && Some(w.id) != keep)
        {
            self.waiters.pop_front();
            pruned = true;
        }
        pruned
    }

    fn wake_head(&mut self) {
        if self.holder.is_none() {
            self.notify_head();
        }
    }

    /// Wakes the head waiter whatever the holder state, so that a waiter that has just become
    /// head re-arms its sleep to the current holder's expiry (a waiter behind the head sleeps
    /// until its own deadline). Waiters whose wait is over are removed first.
    fn notify_head(&mut self) {
        self.notify_head_keeping(None);
    }

    /// [`Self::notify_head`], keeping the waiter `keep` at the head even past its deadline (see
    /// [`Self::expire_keeping`]).
    fn notify_head_keeping(&mut self, keep: Option<u64>) {
        self.prune(Instant::now(), keep);
        if let Some(w) = self.waiters.front() {
            w.notify.notify_one();
        }
    }

    fn holder_info(&self, key: &LockKey, now: Instant) -> Option<HolderInfo> {
        self.holder.as_ref().map(|h| {
            HolderInfo::new(key.clone(), h.owner.clone(), h.token)
                .with_operation(h.operation.clone())
                .with_acquired_at(Some(h.acquired_wall))
                .with_expires_in(Some(h.expires_at.saturating_duration_since(now)))
        })
    }
}

#[derive(Default)]
struct State {
    keys: HashMap<LockKey, KeyState>,
    next_waiter: u64,
    forced: Vec<ForcedReleaseRecord>,
}

struct Shared {
    state: Mutex<State>,
    caps: Capabilities,
    default_owner: OwnerId,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated in a way that breaks
        // the invariants (every update is a single assignment), so recover from poisoning.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An in-process coordinator: the embedded default and the reference implementation.
///
/// # Semantics
///
/// - Tokens start at 1 and increase by one per acquisition of a key; they are never reset while
///   the coordinator lives, and are lost with it (not durable, not shared across processes).
/// - Waiters are served strictly first-in, first-out and are woken by notification, never by
///   polling: the queue head sleeps until the holder's expiry or a release, whichever comes first.
/// - `try_acquire` fails with `Held` while anyone holds the key *or* waits for it (no barging).
/// - Expiry uses the monotonic clock (tokio's, so tests may pause and advance time).
/// - Dropping a lease releases it at once (the in-memory release cannot block).
/// - Dropping an `acquire` future removes its waiter entry and passes the turn on; so does the
///   end of its wait, even while the future is kept but no longer polled.
/// - Each key ever locked keeps a small entry (its last token, which must never be issued
///   again) for the coordinator's life: locking an unbounded number of distinct keys (one per
///   request id) grows the map without bound.
///
/// Cloning is cheap and shares the coordinator.
#[derive(Clone)]
pub struct MemoryCoordinator {
    shared: Arc<Shared>,
}

impl fmt::Debug for MemoryCoordinator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.shared.lock();
        f.debug_struct("MemoryCoordinator")
            .field("keys", &st.keys.len())
            .finish()
    }
}

impl Default for MemoryCoordinator {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryCoordinator {
    /// A new, empty coordinator (minimum TTL 1 ms, FIFO, per-lease TTL).
    pub fn new() -> Self {
        Self::with_owner(OwnerId::for_this_process())
    }

    /// A coordinator whose leases carry `owner` unless the options name another.
    pub fn with_owner(owner: OwnerId) -> Self {
        MemoryCoordinator {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                caps: Capabilities::new(BACKEND),
                default_owner: owner,
            }),
        }
    }

    /// Every forced release so far, oldest first (the audit trail an operator tool would show).
    pub fn forced_releases(&self) -> Vec<ForcedReleaseRecord> {
        self.shared.lock().forced.clone()
    }

    /// How many acquire calls are waiting on `key` (for tests and diagnostics).
    pub fn waiters(&self, key: &LockKey) -> usize {
        self.shared
            .lock()
            .keys
            .get(key)
            .map_or(0, |k| k.waiters.len())
    }

    /// The last token issued for `key`, if any.
    pub fn last_token(&self, key: &LockKey) -> Option<Token> {
        self.shared
            .lock()
            .keys
            .get(key)
            .filter(|k| k.last_token > 0)
            .map(|k| Token::new(k.last_token).expect("in range"))
    }

    fn grant(
        &self,
        st: &mut State,
        key: &LockKey,
        options: &LeaseOptions,
        sent_at: Instant,
        now: Instant,
    ) -> Result<MemoryLease> {
        let ks = st.keys.entry(key.clone()).or_default();
        let token = Token::new(ks.last_token + 1).map_err(|_| Error::TokenRegression {
            backend: BACKEND,
            key: key.to_string(),
            observed: Token::MAX,
            floor: Token::MAX,
        })?;
        ks.last_token = token.get();
        let ttl = options.ttl_value();
        let margin = options.drift_margin_for(ttl);
        let tracker = LeaseTracker::new(BACKEND, key.clone(), token, ttl, margin, sent_at);
        let nonce: u128 = rand::random();
        ks.holder = Some(Holder {
            nonce,
            token,
            expires_at: now + ttl,
            owner: options
                .owner_value()
                .cloned()
                .unwrap_or_else(|| self.shared.default_owner.clone()),
            operation: options.operation_value().map(str::to_owned),
            acquired_wall: SystemTime::now(),
            tracker: tracker.clone(),
        });
        Ok(MemoryLease {
            shared: self.shared.clone(),
            nonce,
            tracker,
        })
    }
}

/// Removes a waiter entry when an acquire call ends in any way, including being dropped.
struct WaiterGuard {
    /// `None` once the waiter has been served (its entry is already gone).
    shared: Option<Arc<Shared>>,
    key: LockKey,
    id: u64,
    notify: Arc<Notify>,
}

impl Drop for WaiterGuard {
    fn drop(&mut self) {
        let Some(shared) = self.shared.take() else {
            return;
        };
        let mut st = shared.lock();
        if let Some(ks) = st.keys.get_mut(&self.key) {
            let was_head = ks.waiters.front().is_some_and(|w| w.id == self.id);
            ks.waiters.retain(|w| w.id != self.id);
            if was_head {
                // We may have consumed the wake-up meant for the head: pass it on. The new head
                // is woken even while the key is held, so that it sleeps until the holder's
                // expiry rather than until its own deadline.
                ks.expire(Instant::now());
                ks.notify_head();
            }
        }
    }
}

#[async_trait]
impl Coordinator for MemoryCoordinator {
    fn capabilities(&self) -> &Capabilities {
        &self.shared.caps
    }

    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        options.validate(&self.shared.caps)?;
        let start = Instant::now();
        let deadline = start + options.wait_value();
        let mut ticket: Option<WaiterGuard> = None;
        loop {
            let now = Instant::now();
            let (notify, sleep_until) = {
                let mut st = self.shared.lock();
                let ks = st.keys.entry(key.clone()).or_default();
                let my_id = ticket.as_ref().map(|t| t.id);
                ks.expire_keeping(now, my_id);
                let my_turn = ks.holder.is_none()
                    && match ks.waiters.front() {
                        None => true,
                        Some(w) => Some(w.id) == my_id,
                    };
                if my_turn {
                    if let Some(id) = my_id {
                        ks.waiters.retain(|w| w.id != id);
                    }
                    let lease = self.grant(&mut st, key, options, now, now)?;
                    if let Some(t) = ticket.as_mut() {
                        // Already removed from the queue: disarm the guard.
                        t.shared = None;
                        // The next waiter is head now: wake it so it sleeps until our expiry.
                        if let Some(ks) = st.keys.get_mut(key) {
                            ks.notify_head();
                        }
                    }
                    return Ok(Box::new(lease));
                }
                if now >= deadline {
                    drop(st);
                    drop(ticket);
                    return Err(Error::Timeout {
                        key: key.to_string(),
                        waited: now - start,
                    });
                }
                if ticket.is_none() {
                    st.next_waiter += 1;
                    let id = st.next_waiter;
                    let notify = Arc::new(Notify::new());
                    st.keys
                        .get_mut(key)
                        .expect("entry exists")
                        .waiters
                        .push_back(Waiter {
                            id,
                            notify: notify.clone(),
                            deadline,
                        });
                    ticket = Some(WaiterGuard {
                        shared: Some(self.shared.clone()),
                        key: key.clone(),
                        id,
                        notify,
                    });
                }
                let t = ticket.as_ref().expect("set above");
                let ks = st.keys.get(key).expect("entry exists");
                let is_head = ks.waiters.front().is_some_and(|w| w.id == t.id);
                // The head sleeps until the holder's expiry. A waiter behind it sleeps until the
                // earliest deadline of those ahead of it at the latest: whichever of them is head
                // when that wait ends, and is no longer polled, leaves the queue then (see
                // `prune`), and this one may be next. Only the head is woken when the head
                // changes, so the current head's deadline alone would be stale by then.
                let wake = if is_head {
                    ks.holder.as_ref().map(|h| h.expires_at)
                } else {
                    ks.waiters
                        .iter()
                        .take_while(|w| w.id != t.id)
                        .map(|w| w.deadline)
                        .min()
                };
                (t.notify.clone(), wake.map_or(deadline, |e| e.min(deadline)))
            };
            tokio::select! {
                _ = notify.notified() => {}
                _ = tokio::time::sleep_until(sleep_until) => {}
            }
        }
    }

    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        options.validate(&self.shared.caps)?;
        let now = Instant::now();
        let mut st = self.shared.lock();
        let ks = st.keys.entry(key.clone()).or_default();
        ks.expire(now);
        if ks.holder.is_some() || !ks.waiters.is_empty() {
            return Err(Error::Held {
                key: key.to_string(),
            });
        }
        let lease = self.grant(&mut st, key, options, now, now)?;
        Ok(Box::new(lease))
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let now = Instant::now();
        let mut st = self.shared.lock();
        Ok(st.keys.get_mut(key).and_then(|ks| {
            ks.expire(now);
            ks.holder_info(key, now)
        }))
    }

    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let now = Instant::now();
        let mut st = self.shared.lock();
        if let Some(expected) = request.expected_token() {
            // Compared under the same lock as the removal below: nothing can arrive in between.
            let found = st.keys.get_mut(key).and_then(|ks| {
                ks.expire(now);
                ks.holder.as_ref().map(|h| h.token)
            });
            if found != Some(expected) {
                return Err(request.refused(BACKEND, key, expected, found));
            }
        }
        let removed = st.keys.get_mut(key).and_then(|ks| {
            ks.expire(now);
            let info = ks.holder_info(key, now);
            if let Some(h) = ks.holder.take() {
                h.tracker.mark_lost(LostReason::Revoked);
                ks.wake_head();
            }
            info
        });
        st.forced.push(ForcedReleaseRecord {
            key: key.clone(),
            actor: request.actor().to_owned(),
            reason: request.reason().to_owned(),
            removed: removed.clone(),
            at: SystemTime::now(),
        });
        Ok(removed)
    }

    async fn audit_trail(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
        let limit = AuditRecord::check_limit(limit)?;
        let st = self.shared.lock();
        Ok(st
            .forced
            .iter()
            .rev()
            .filter(|r| &r.key == key)
            .take(limit)
            .map(|r| {
                AuditRecord::new(r.key.clone(), r.actor.clone(), r.reason.clone())
                    .with_at(Some(r.at))
                    .with_removed(
                        r.removed.as_ref().map(|h| h.token),
                        r.removed.as_ref().map(|h| h.owner.as_str().to_owned()),
                    )
            })
            .collect())
    }
}

/// A lease from [`MemoryCoordinator`].
pub struct MemoryLease {
    shared: Arc<Shared>,
    nonce: u128,
    tracker: LeaseTracker,
}

impl fmt::Debug for MemoryLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The nonce is the lease's private proof of ownership: never shown.
        f.debug_struct("MemoryLease")
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

impl MemoryLease {
    /// Applies `f` to our holder entry if we still hold the key; otherwise marks the lease lost
    /// with the reason found and returns `Err(Lost)`.
    fn with_own_holder<T>(&self, f: impl FnOnce(&mut KeyState, Instant) -> T) -> Result<T> {
        self.tracker.ensure_not_lost()?;
        let now = Instant::now();
        let mut st = self.shared.lock();
        let ks = st
            .keys
            .get_mut(self.tracker.key())
            .expect("a key with a lease has an entry");
        let ours_but_expired = ks
            .holder
            .as_ref()
            .is_some_and(|h| h.nonce == self.nonce && h.expires_at <= now);
        ks.expire(now);
        if ks.holder.as_ref().is_some_and(|h| h.nonce == self.nonce) {
            return Ok(f(ks, now));
        }
        let reason = if ours_but_expired {
            LostReason::Expired
        } else {
            LostReason::Superseded
        };
        drop(st);
        self.tracker.mark_lost(reason);
        // The first recorded reason wins (a revocation is recorded by force_release).
        match self.tracker.status() {
            crate::LeaseStatus::Lost(r) => Err(self.tracker.lost_error(r)),
            _ => Err(self.tracker.lost_error(reason)),
        }
    }
}

#[async_trait]
impl Lease for MemoryLease {
    fn state(&self) -> &LeaseState {
        &self.tracker
    }

    async fn renew(&self) -> Result<Instant> {
        let ttl = self.tracker.ttl();
        let sent_at = Instant::now();
        self.with_own_holder(|ks, now| {
            ks.holder.as_mut().expect("ours").expires_at = now + ttl;
        })?;
        self.tracker.renewed_from(sent_at).inspect_err(|_| {
            // Validity ended just before the extension: the lease is lost, so the extended
            // entry must not keep the key for another TTL.
            self.remove_own();
        })
    }

    async fn release(&self) -> Result<()> {
        if let Err(e) = self.tracker.ensure_not_lost() {
            // Lost locally (its validity ended, or its keeper stopped) while the entry may still
            // be ours: remove it, as the other backends' compare-and-delete does, instead of
            // leaving the key taken until the entry expires.
            self.remove_own();
            return Err(e);
        }
        self.with_own_holder(|ks, _| {
            ks.holder = None;
            // Recorded under the lock that removed the entry: a renewal racing with this release
            // must not find the entry gone first and record it as superseded.
            self.tracker.mark_lost(LostReason::Released);
            ks.wake_head();
        })?;
        Ok(())
    }
}

impl MemoryLease {
    /// Removes the key's holder entry if it is still this lease's (whatever the lease's local
    /// status), and hands the key to the next waiter.
    fn remove_own(&self) {
        let mut st = self.shared.lock();
        if let Some(ks) = st.keys.get_mut(self.tracker.key()) {
            if ks.holder.as_ref().is_some_and(|h| h.nonce == self.nonce) {
                ks.holder = None;
                ks.wake_head();
            }
        }
    }
}

impl Drop for MemoryLease {
    fn drop(&mut self) {
        // Also after a local loss (validity ended, keeper stopped): the entry may still be ours.
        self.remove_own();
        self.tracker.mark_lost(LostReason::Released);
    }
}
