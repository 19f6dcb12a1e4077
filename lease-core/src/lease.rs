//! The [`Lease`] trait, its status, and the [`LostSignal`] that fires when ownership goes.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::{Error, LostReason, Result};
use crate::key::LockKey;
use crate::token::Token;

/// What a lease's holder knows about its ownership right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseStatus {
    /// Held, and local validity has not run out.
    Held,
    /// The connection to the coordinator is in doubt (for example disconnected inside a session):
    /// the lease may still be held, but nothing new should start under it.
    InDoubt,
    /// Known or presumed gone.
    Lost(LostReason),
}

#[derive(Debug, Clone, Copy)]
struct View {
    valid_until: Instant,
    status: LeaseStatus,
    /// The reason a passed validity is read as: `Expired`, or `KeeperStopped` once a keeper
    /// stopped renewing on purpose.
    runs_out_as: LostReason,
}

impl View {
    /// The status at this view, a passed validity read as `Lost(runs_out_as)`.
    fn status_now(&self) -> LeaseStatus {
        match self.status {
            LeaseStatus::Lost(_) => self.status,
            _ if Instant::now() >= self.valid_until => LeaseStatus::Lost(self.runs_out_as),
            s => s,
        }
    }
}

/// One lease's view, shared by its tracker and its [`LostSignal`]s: a small mutex-guarded value
/// and one `Notify` (a `watch` channel costs about 0.4 KiB, paid by every held lease).
struct Signal {
    view: std::sync::Mutex<View>,
    /// Woken on every change, and when the tracker is gone.
    changed: Notify,
    /// Set once the tracker (so the lease object) is gone.
    closed: AtomicBool,
}

impl Signal {
    fn view(&self) -> View {
        *self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The view and its status, the clock read under the lock. A status read from a copy
    /// could find validity passed that a renewal confirmed between the copy and the clock read
    /// had extended, and a reader that records what it finds would then record a lease renewed
    /// in time as `Lost(Expired)`. Read under the lock, a passed validity stays passed:
    /// [`LeaseState::renewed`] refuses to extend it.
    fn current(&self) -> (View, LeaseStatus) {
        let view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        (*view, view.status_now())
    }

    /// Applies `change`; wakes the waiters if it returns true. Returns what `change` returned.
    fn modify(&self, change: impl FnOnce(&mut View) -> bool) -> bool {
        let changed = change(&mut self.view.lock().unwrap_or_else(|p| p.into_inner()));
        if changed {
            self.changed.notify_waiters();
        }
        changed
    }
}

struct TrackerInner {
    backend: &'static str,
    key: LockKey,
    token: Token,
    ttl: Duration,
    margin: Duration,
    acquired_at: Instant,
    signal: Arc<Signal>,
    /// This lease in `fenced_leases_held`, until lost or dropped.
    held: crate::metrics::HeldLease,
    /// Set once its release began ([`LeaseTracker::release_with`]); never cleared.
    releasing: AtomicBool,
}

impl Drop for TrackerInner {
    fn drop(&mut self) {
        // The signals outlive the lease: wake them, they report it gone.
        self.signal.closed.store(true, Ordering::Release);
        self.signal.changed.notify_waiters();
    }
}

/// What a lease's holder can read of its client-side state ([`Lease::state`]): key, token,
/// validity, status and the lost signal. Nothing here changes the state: only the adapter that
/// granted the lease holds the [`LeaseTracker`] that records renewals and losses.
#[derive(Clone)]
pub struct LeaseState {
    inner: Arc<TrackerInner>,
}

/// The adapter's handle on one lease's client-side state: shared by the lease object, its
/// [`LostSignal`]s and whatever in the adapter learns that the lease is gone (a watch, a
/// keepalive, a revocation), and the only way to record a renewal, doubt or loss.
///
/// Adapters create one per acquisition (from [`crate::adapter`]) and expose its read-only
/// [`LeaseState`] through [`Lease::state`]; everything that depends only on this state (status,
/// validity, the lost signal, the `Lost` error) is written once here. Cloning is cheap and shares
/// the state.
#[derive(Clone)]
pub struct LeaseTracker {
    state: LeaseState,
}

impl std::ops::Deref for LeaseTracker {
    type Target = LeaseState;

    fn deref(&self) -> &LeaseState {
        &self.state
    }
}

impl fmt::Debug for LeaseTracker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.state.fmt(f)
    }
}

impl fmt::Debug for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseTracker")
            .field("backend", &self.inner.backend)
            .field("key", &self.inner.key)
            .field("token", &self.inner.token)
            .field("status", &self.status())
            .finish()
    }
}

impl LeaseTracker {
    /// State for a lease just granted `ttl` by a request sent at `sent_at`: held, valid until
    /// `sent_at + ttl - margin` ([`crate::adapter::clock::valid_until`]).
    pub fn new(
        backend: &'static str,
        key: LockKey,
        token: Token,
        ttl: Duration,
        margin: Duration,
        sent_at: Instant,
    ) -> Self {
        let valid_until = crate::adapter::clock::valid_until(sent_at, ttl, margin);
        let signal = Arc::new(Signal {
            view: std::sync::Mutex::new(View {
                valid_until,
                status: LeaseStatus::Held,
                runs_out_as: LostReason::Expired,
            }),
            changed: Notify::new(),
            closed: AtomicBool::new(false),
        });
        LeaseTracker {
            state: LeaseState {
                inner: Arc::new(TrackerInner {
                    backend,
                    key,
                    token,
                    ttl,
                    margin,
                    acquired_at: sent_at,
                    signal,
                    held: crate::metrics::HeldLease::new(backend),
                    releasing: AtomicBool::new(false),
                }),
            },
        }
    }

    /// The read-only view of this state that the lease hands out ([`Lease::state`]).
    pub fn state(&self) -> &LeaseState {
        &self.state
    }

    /// Records a renewal confirmed for a request sent at `sent_at`: validity becomes
    /// `sent_at + ttl - margin` (never earlier than it was). Returns the deadline now in force, or
    /// `Err(Lost)` if the lease is already lost (a lost lease never comes back).
    pub fn renewed_from(&self, sent_at: Instant) -> Result<Instant> {
        self.state.renewed_from(sent_at)
    }

    /// Records a confirmed renewal: validity moves to `valid_until`, an in-doubt lease is held
    /// again. Has no effect on a lost lease (a lost lease never comes back) and returns false
    /// then; a lease whose validity has already passed counts as lost (its lost signal may have
    /// fired), and is recorded so.
    pub fn renewed(&self, valid_until: Instant) -> bool {
        self.state.renewed(valid_until)
    }

    /// Marks the lease in doubt (connection lost inside a still-live session). No effect once lost.
    pub fn in_doubt(&self) {
        self.state.in_doubt()
    }

    /// Marks the lease lost. Returns true the first time (later reasons are ignored: the first
    /// cause wins). The lease leaves `fenced_leases_held`; counts `fenced_leases_lost_total` and
    /// logs the loss, except for a plain release.
    pub fn mark_lost(&self, reason: LostReason) -> bool {
        self.state.mark_lost(reason)
    }

    /// Settles a release that was sent again after an earlier send's outcome was in doubt
    /// ([`crate::adapter::resend`]) and whose resend found the lock no longer this lease's (gone,
    /// or another holder's). The earlier send deleted it, unless something is known to have
    /// ended the lease first (`known_ended`: a force-release record naming this lease, the end of
    /// the session that held it, a loss already recorded) or the lease's validity had passed when
    /// the resend's answer came (`answered`: the server may have expired it). Then the lease is
    /// marked released and this returns true: the release succeeded. Otherwise it returns false
    /// and changes nothing; the caller reports the loss it knows of.
    ///
    /// While the lease was valid nobody else could take the lock unless it was deleted, and
    /// the only delete of this lease's own value that leaves no record is its own release.
    pub fn released_by_earlier_send(&self, known_ended: bool, answered: Instant) -> bool {
        let lost_otherwise = matches!(
            self.status(),
            LeaseStatus::Lost(reason) if reason != LostReason::Released
        );
        if known_ended || lost_otherwise || answered >= self.valid_until() {
            return false;
        }
        self.mark_lost(LostReason::Released);
        true
    }

    /// Runs `release`, the adapter's body of [`Lease::release`], as this lease's one release.
    ///
    /// - From the start, [`gone_unless_releasing`](Self::gone_unless_releasing) records nothing:
    ///   the release decides why the lock went (its own delete, or an operator's force-release
    ///   it finds recorded), so a guardian that sees the deletion first cannot record the wrong
    ///   reason.
    /// - A second call, while one runs or after, returns `Err(Lost)` without running anything:
    ///   the first decides.
    /// - If the future is dropped before `release` ends (a caller's timeout around
    ///   [`Lease::release`]), the lease is marked `Lost(Released)` at once, as after a release
    ///   whose outcome is unknown, and `abandoned` runs: the adapter's background
    ///   compare-and-delete of the lock, if it has to start one (an adapter whose guardian
    ///   deletes the lock once the lease is lost passes nothing to do). The holder asked for the
    ///   release: the lease never reports `Held` again, whatever the dropped request did, and the
    ///   lock does not stay taken until its TTL.
    pub async fn release_with<F, A>(&self, release: F, abandoned: A) -> Result<()>
    where
        F: std::future::Future<Output = Result<()>>,
        A: FnOnce(),
    {
        if self.inner.releasing.swap(true, Ordering::SeqCst) {
            return Err(self.lost_error(LostReason::Released));
        }
        let unfinished = scopeguard::guard(abandoned, |abandoned| {
            self.mark_lost(LostReason::Released);
            abandoned();
        });
        let outcome = release.await;
        scopeguard::ScopeGuard::into_inner(unfinished);
        outcome
    }

    /// The adapter learned that the lock is gone (a watch, a read) and `reason` says why:
    /// records it unless a release began ([`release_with`](Self::release_with)), which decides
    /// the reason itself. Returns whether it was recorded now (false also when an earlier
    /// reason was).
    ///
    /// The release sets its mark before it sends anything, and this reads the mark before it
    /// records: a deletion seen without the mark was not the release's doing.
    pub fn gone_unless_releasing(&self, reason: LostReason) -> bool {
        !self.is_releasing() && self.mark_lost(reason)
    }

    /// What a renewal reports when it finds the lock gone or not its own: records `reason` unless
    /// a release began ([`gone_unless_releasing`](Self::gone_unless_releasing): a renewal racing
    /// with the holder's own release must not record the release's delete as a revocation), and
    /// returns the `Lost` error with the reason recorded, or `Released` while the release runs.
    pub fn lose_unless_releasing(&self, reason: LostReason) -> Error {
        self.gone_unless_releasing(reason);
        let fallback = if self.is_releasing() {
            LostReason::Released
        } else {
            reason
        };
        self.lost_error(fallback)
    }

    /// Whether this lease's release began ([`release_with`](Self::release_with)). It stays so:
    /// a release ends the lease whatever its outcome.
    pub fn is_releasing(&self) -> bool {
        self.state.release_begun()
    }

    /// Marks the lease lost for `reason` (unless it already was: the first cause wins) and
    /// returns the `Lost` error with the reason recorded.
    pub fn lose(&self, reason: LostReason) -> Error {
        self.state.mark_lost(reason);
        self.state.lost_error(reason)
    }
}

impl LeaseState {
    /// The key.
    pub fn key(&self) -> &LockKey {
        &self.inner.key
    }

    /// The token.
    pub fn token(&self) -> Token {
        self.inner.token
    }

    /// The TTL the backend granted.
    pub fn ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        self.inner.backend
    }

    /// When the lease was acquired (local monotonic clock, read before the request was sent).
    pub fn acquired_at(&self) -> Instant {
        self.inner.acquired_at
    }

    /// The local validity deadline.
    pub fn valid_until(&self) -> Instant {
        self.inner.signal.view().valid_until
    }

    /// The status now: a held or in-doubt lease whose validity has passed is reported as
    /// `Lost(Expired)` (or `Lost(KeeperStopped)` when a keeper stopped renewing it on purpose),
    /// and recorded as such.
    pub fn status(&self) -> LeaseStatus {
        let (view, now) = self.inner.signal.current();
        match now {
            LeaseStatus::Lost(reason) if !matches!(view.status, LeaseStatus::Lost(_)) => {
                self.mark_lost(reason);
                // Another reason may have been recorded in between: the first one wins.
                self.inner.signal.current().1
            }
            s => s,
        }
    }

    /// `Ok` while held (or in doubt, which is still possibly held), `Err(Lost)` once gone.
    pub fn ensure_not_lost(&self) -> Result<()> {
        match self.status() {
            LeaseStatus::Lost(reason) => Err(self.lost_error(reason)),
            _ => Ok(()),
        }
    }

    /// The `Lost` error for this lease: with the reason recorded when the lease is already lost
    /// (the first cause wins), `reason` otherwise.
    pub fn lost_error(&self, reason: LostReason) -> Error {
        let reason = match self.status() {
            LeaseStatus::Lost(recorded) => recorded,
            _ => reason,
        };
        Error::Lost {
            key: self.inner.key.to_string(),
            token: self.inner.token,
            reason,
        }
    }

    /// The drift margin subtracted from the TTL.
    pub fn drift_margin(&self) -> Duration {
        self.inner.margin
    }

    /// Records a renewal confirmed for a request sent at `sent_at`: validity becomes
    /// `sent_at + ttl - margin` (never earlier than it was). Returns the deadline now in force, or
    /// `Err(Lost)` if the lease is already lost (a lost lease never comes back).
    pub(crate) fn renewed_from(&self, sent_at: Instant) -> Result<Instant> {
        let until = crate::adapter::clock::valid_until(sent_at, self.inner.ttl, self.inner.margin);
        // Never earlier than it is, judged under the lock: two renewals confirmed at once could
        // otherwise each compare with the validity before either, and the earlier send's,
        // applied last, would take back what the later one confirmed.
        if self.apply_renewal(|current| until.max(current)) {
            Ok(self.valid_until())
        } else {
            self.ensure_not_lost()?;
            // Unreachable in practice: `renewed` fails only on a lost lease.
            Err(self.lost_error(LostReason::Superseded))
        }
    }

    /// Records a confirmed renewal: validity moves to `valid_until`, an in-doubt lease is held
    /// again. Has no effect on a lost lease (a lost lease never comes back) and returns false
    /// then; a lease whose validity has already passed counts as lost (its lost signal may have
    /// fired), and is recorded so.
    pub(crate) fn renewed(&self, valid_until: Instant) -> bool {
        self.apply_renewal(|_| valid_until)
    }

    /// [`Self::renewed`], with the new validity computed from the current one under the lock.
    fn apply_renewal(&self, valid_until: impl FnOnce(Instant) -> Instant) -> bool {
        let mut applied = false;
        let mut ran_out = None;
        self.inner.signal.modify(|v| match v.status_now() {
            LeaseStatus::Lost(reason) => {
                if !matches!(v.status, LeaseStatus::Lost(_)) {
                    ran_out = Some(reason);
                }
                false
            }
            _ => {
                v.valid_until = valid_until(v.valid_until);
                v.status = LeaseStatus::Held;
                applied = true;
                true
            }
        });
        if let Some(reason) = ran_out {
            self.mark_lost(reason);
        }
        applied
    }

    /// From now on a passed validity reads as `Lost(reason)` instead of `Lost(Expired)`: the
    /// keeper sets `KeeperStopped` when it stops renewing on purpose, so that every reader (the
    /// lost signal too, which records nothing) sees why the lease ran out.
    pub(crate) fn runs_out_as(&self, reason: LostReason) {
        self.inner.signal.modify(|v| {
            v.runs_out_as = reason;
            false
        });
    }

    /// Marks the lease in doubt (connection lost inside a still-live session). No effect once lost.
    pub(crate) fn in_doubt(&self) {
        self.inner.signal.modify(|v| {
            if v.status == LeaseStatus::Held {
                v.status = LeaseStatus::InDoubt;
                true
            } else {
                false
            }
        });
    }

    /// Whether the lease's release began ([`LeaseTracker::release_with`]): the release then
    /// decides the reason it is lost for.
    pub(crate) fn release_begun(&self) -> bool {
        self.inner.releasing.load(Ordering::SeqCst)
    }

    /// Marks the lease lost. Returns true the first time (later reasons are ignored: the first
    /// cause wins). The lease leaves `fenced_leases_held`; counts `fenced_leases_lost_total` and
    /// logs the loss, except for a plain release.
    pub(crate) fn mark_lost(&self, reason: LostReason) -> bool {
        let first = self.inner.signal.modify(|v| {
            if matches!(v.status, LeaseStatus::Lost(_)) {
                false
            } else {
                v.status = LeaseStatus::Lost(reason);
                true
            }
        });
        if first {
            self.inner.held.ended();
        }
        if first && reason != LostReason::Released {
            crate::metrics::lease_lost(self.inner.backend, reason);
            tracing::warn!(
                backend = self.inner.backend,
                key = %self.inner.key,
                token = %self.inner.token,
                %reason,
                "lease lost"
            );
        }
        first
    }

    /// A signal that fires when this lease is lost or its validity runs out.
    pub fn signal(&self) -> LostSignal {
        LostSignal {
            signal: self.inner.signal.clone(),
        }
    }
}

/// Fires when a lease is known or presumed gone: lost, released, or its local validity passed
/// without a confirmed renewal.
///
/// Cheap to clone; each clone waits independently. Returned by [`Lease::lost`].
#[derive(Clone)]
pub struct LostSignal {
    signal: Arc<Signal>,
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostSignal")
            .field("status", &self.status())
            .finish()
    }
}

impl LostSignal {
    /// The status now (without recording anything). Once the lease object is gone, a lease
    /// not lost before reads as `Lost(Released)`, the reason [`Self::wait`] resolves with.
    pub fn status(&self) -> LeaseStatus {
        match self.signal.current().1 {
            LeaseStatus::Lost(r) => LeaseStatus::Lost(r),
            _ if self.signal.closed.load(Ordering::Acquire) => {
                LeaseStatus::Lost(LostReason::Released)
            }
            held => held,
        }
    }

    /// Resolves at the next change of the lease's state (a renewal, doubt, a loss, the lease
    /// object going). Enable it ([`tokio::sync::futures::Notified::enable`]) before reading the
    /// state, so that a change in between still wakes it.
    pub(crate) fn next_change(&self) -> tokio::sync::futures::Notified<'_> {
        self.signal.changed.notified()
    }

    /// Whether the lease is lost now.
    pub fn is_lost(&self) -> bool {
        matches!(self.status(), LeaseStatus::Lost(_))
    }

    /// The local validity deadline now.
    pub fn valid_until(&self) -> Instant {
        self.signal.view().valid_until
    }

    /// Resolves with the reason once the lease is lost or its validity passes. Cancel-safe.
    ///
    /// If the lease object is dropped without being lost first, resolves with
    /// [`LostReason::Released`]: nothing can hold the lease after its owner dropped it.
    pub async fn wait(&mut self) -> LostReason {
        self.wait_for(|s| match s {
            LeaseStatus::Lost(r) => Some(r),
            _ => None,
        })
        .await
    }

    /// Resolves as soon as the lease is in doubt or lost (the moment to stop starting new work).
    /// Returns the status seen.
    pub async fn uncertain(&mut self) -> LeaseStatus {
        self.wait_for(|s| (s != LeaseStatus::Held).then_some(s))
            .await
    }

    async fn wait_for<T>(&mut self, mut pick: impl FnMut(LeaseStatus) -> Option<T>) -> T
    where
        T: From<LostReason>,
    {
        loop {
            // Registered before the view is read, so a change in between still wakes it.
            let changed = self.signal.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let (view, now) = self.signal.current();
            if let Some(t) = pick(now) {
                return t;
            }
            if self.signal.closed.load(Ordering::Acquire) {
                // The tracker is gone: the lease object was dropped.
                return match view.status {
                    LeaseStatus::Lost(r) => T::from(r),
                    _ => T::from(LostReason::Released),
                };
            }
            tokio::select! {
                () = changed => {}
                _ = tokio::time::sleep_until(view.valid_until) => {}
            }
        }
    }
}

impl From<LostReason> for LeaseStatus {
    fn from(r: LostReason) -> Self {
        LeaseStatus::Lost(r)
    }
}

/// A held, time-bounded grant on one key.
///
/// # Contract
///
/// - [`token`](Lease::token) is strictly greater than the token of every earlier acquisition of
///   the key at this coordinator (including across restarts where the backend declares durable
///   tokens). Carry it on every protected write ([`crate::Fence`]).
/// - [`valid_until`](Lease::valid_until) is a local, monotonic estimate: the send time of the last
///   confirmed acquire or renew plus the granted TTL minus a drift margin. It is an upper bound on
///   how long this process may *believe* it holds the lock, never proof that it does. What the
///   backend promises everyone else: no other acquisition of the key is granted before it,
///   unless this lease was released or force-released (or, where an adapter documents so, across
///   a failover of an asynchronously replicated coordinator). The conformance suite checks that
///   promise over whole runs (its history checker's exclusive-tenure property).
/// - [`renew`](Lease::renew) extends validity or returns `Lost`; it never revives a lost lease and
///   never extends another owner's lock.
/// - [`release`](Lease::release) is compare-and-delete: it removes the lock only if this lease
///   still owns it, and returns `Lost` otherwise (a no-op for the new owner).
/// - [`lost`](Lease::lost) fires when ownership is known or presumed gone.
/// - Dropping a lease without releasing it stops any renewal; the lock is released best-effort
///   without blocking in `Drop` (never a blocking call), and in any case expires at its TTL.
///
/// Adapters implement [`state`](Lease::state), `renew` and `release`; the rest is provided.
#[async_trait]
pub trait Lease: Send + Sync + fmt::Debug {
    /// The client-side state of this lease, read-only: nothing reachable from a lease lets its
    /// holder change its status or validity (the adapter records those through its
    /// [`LeaseTracker`]).
    fn state(&self) -> &LeaseState;

    /// Extends the lease by its TTL, measured from the moment the request is sent.
    ///
    /// # Behaviour
    /// - `Ok(valid_until)`: the coordinator confirmed; the new local deadline is returned.
    /// - `Err(Lost)`: the lease is gone (expired, revoked, superseded, released); stop working.
    /// - `Err(Unavailable)` / `Err(OutcomeUnknown)`: not confirmed; validity is unchanged, the
    ///   caller may retry until [`valid_until`](Lease::valid_until).
    ///
    /// # Cancel safety
    ///
    /// A dropped future may have extended the lock on the server, or not. The local deadline
    /// moves only on a confirmed renewal, so it stays where it was (the safe side): renew again
    /// before [`valid_until`](Lease::valid_until).
    async fn renew(&self) -> Result<Instant>;

    /// Releases the lock if this lease still owns it (compare-and-delete), and marks the lease
    /// lost with [`LostReason::Released`].
    ///
    /// # Behaviour
    /// - `Ok(())`: the lock was ours and is deleted; waiters are woken.
    /// - `Err(Lost)`: the lease was already lost (expired, revoked, superseded, released). Nothing
    ///   of another holder's is deleted; a lock still this lease's on the server (lost by its
    ///   local validity only) may be deleted, compared on its owner.
    /// - `Err(Unavailable)` / `Err(OutcomeUnknown)`: the lock expires at its TTL in any case.
    ///
    /// # Cancel safety
    ///
    /// A future dropped once polled (a caller's timeout around `release`) ends the lease as a
    /// release whose outcome is unknown does: the lease is `Lost(Released)` at once and never
    /// `Held` again, whatever its request did, and the lock is deleted in the background if it
    /// is still this lease's (compare-and-delete, so never another holder's), at the latest
    /// expiring at its TTL. A later `release` returns `Err(Lost)`.
    async fn release(&self) -> Result<()>;

    /// The key.
    fn key(&self) -> &LockKey {
        self.state().key()
    }

    /// The fencing token of this acquisition.
    fn token(&self) -> Token {
        self.state().token()
    }

    /// The TTL the backend granted (may be larger than asked: backends round up).
    fn ttl(&self) -> Duration {
        self.state().ttl()
    }

    /// The local monotonic validity deadline: past it the lease is no longer held. It says
    /// nothing of a loss before it (revoked, superseded, released): read
    /// [`status`](Lease::status) or [`remaining`](Lease::remaining) for that.
    fn valid_until(&self) -> Instant {
        self.state().valid_until()
    }

    /// Validity left now: zero once it has passed, and zero for a lost lease (revoked,
    /// superseded, released) whatever its local deadline says.
    fn remaining(&self) -> Duration {
        if let LeaseStatus::Lost(_) = self.status() {
            return Duration::ZERO;
        }
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// The status now.
    fn status(&self) -> LeaseStatus {
        self.state().status()
    }

    /// A signal that fires when the lease is lost.
    fn lost(&self) -> LostSignal {
        self.state().signal()
    }

    /// `Ok` only while the lease is [`LeaseStatus::Held`]. An in-doubt lease gives a retryable
    /// `Err(Unavailable)` (it may still be held: do not start new work, but do not assume it is
    /// gone); a lost one gives `Err(Lost)`.
    fn ensure_held(&self) -> Result<()> {
        match self.status() {
            LeaseStatus::Held => Ok(()),
            LeaseStatus::InDoubt => Err(Error::unavailable(
                self.state().backend(),
                format!(
                    "lease on {:?} is in doubt (its connection was lost, or its last renewal was \
                     not confirmed)",
                    self.key()
                ),
            )),
            LeaseStatus::Lost(r) => Err(self.state().lost_error(r)),
        }
    }
}

/// `Box` and `Arc` of a lease are leases: every required method forwards (the provided ones
/// read [`Lease::state`], so they follow).
macro_rules! forward_lease {
    ($ty:ty) => {
        #[async_trait]
        impl<L: Lease + ?Sized> Lease for $ty {
            fn state(&self) -> &LeaseState {
                (**self).state()
            }
            async fn renew(&self) -> Result<Instant> {
                (**self).renew().await
            }
            async fn release(&self) -> Result<()> {
                (**self).release().await
            }
        }
    };
}

forward_lease!(Box<L>);
forward_lease!(Arc<L>);

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(valid_for: Duration) -> LeaseTracker {
        LeaseTracker::new(
            "test",
            LockKey::new("k").unwrap(),
            Token::new(1).unwrap(),
            valid_for,
            Duration::ZERO,
            Instant::now(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn signal_fires_on_expiry_and_renewal_postpones_it() {
        let t = tracker(Duration::from_secs(10));
        let mut sig = t.signal();
        let start = Instant::now();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(t.renewed(Instant::now() + Duration::from_secs(10)));
        assert_eq!(sig.wait().await, LostReason::Expired);
        assert_eq!(Instant::now() - start, Duration::from_secs(15));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Expired));
        // A lost lease never comes back.
        assert!(!t.renewed(Instant::now() + Duration::from_secs(10)));
        assert!(t.ensure_not_lost().is_err());
    }

    /// A renewal confirmed after validity passed does not bring the lease back: its lost signal
    /// may already have fired (nothing recorded the expiry until now).
    #[tokio::test(start_paused = true)]
    async fn a_renewal_after_validity_passed_does_not_revive() {
        let t = tracker(Duration::from_secs(10));
        let sig = t.signal();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(sig.is_lost());
        assert!(!t.renewed(Instant::now() + Duration::from_secs(10)));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Expired));
        assert!(t.renewed_from(Instant::now()).is_err());
    }

    /// Once told, a passed validity reads as the keeper's stop, for the signal and the status.
    #[tokio::test(start_paused = true)]
    async fn a_run_out_reads_as_the_reason_set() {
        let t = tracker(Duration::from_secs(10));
        let mut sig = t.signal();
        t.runs_out_as(LostReason::KeeperStopped);
        assert_eq!(t.status(), LeaseStatus::Held);
        assert_eq!(sig.wait().await, LostReason::KeeperStopped);
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::KeeperStopped));
    }

    /// Once a release began, a deletion seen elsewhere records nothing; the release decides,
    /// and a second release runs nothing.
    #[tokio::test]
    async fn a_release_decides_why_the_lock_went() {
        let t = tracker(Duration::from_secs(10));
        let outcome = t
            .release_with(
                async {
                    assert!(!t.gone_unless_releasing(LostReason::Revoked));
                    // A renewal racing with the release reports it, and records nothing.
                    assert!(matches!(
                        t.lose_unless_releasing(LostReason::Revoked),
                        Error::Lost {
                            reason: LostReason::Released,
                            ..
                        }
                    ));
                    assert_eq!(t.status(), LeaseStatus::Held);
                    Err(t.lose(LostReason::Revoked))
                },
                || panic!("a release that ended is not abandoned"),
            )
            .await;
        assert!(matches!(
            outcome,
            Err(Error::Lost {
                reason: LostReason::Revoked,
                ..
            })
        ));
        let again = t
            .release_with(async { panic!("a second release runs nothing") }, || {})
            .await;
        assert!(matches!(
            again,
            Err(Error::Lost {
                reason: LostReason::Revoked,
                ..
            })
        ));
        // Without a release, the deletion is recorded.
        let other = tracker(Duration::from_secs(10));
        assert!(other.gone_unless_releasing(LostReason::Revoked));
        assert_eq!(other.status(), LeaseStatus::Lost(LostReason::Revoked));
    }

    /// A release whose future is dropped before it ends leaves the lease released at once and
    /// hands the lock to the adapter's background delete.
    #[tokio::test]
    async fn a_release_dropped_before_it_ends_leaves_the_lease_released() {
        let t = tracker(Duration::from_secs(10));
        let abandoned = AtomicBool::new(false);
        let started = Notify::new();
        let release = t.release_with(
            async {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok(())
            },
            || abandoned.store(true, Ordering::SeqCst),
        );
        tokio::select! {
            _ = release => unreachable!("the release never ends"),
            _ = started.notified() => {}
        }
        assert!(abandoned.load(Ordering::SeqCst));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Released));
        assert!(!t.gone_unless_releasing(LostReason::Revoked));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Released));
    }

    #[tokio::test(start_paused = true)]
    async fn first_reason_wins_and_signal_sees_it() {
        let t = tracker(Duration::from_secs(10));
        let mut sig = t.signal();
        let t2 = t.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            t2.mark_lost(LostReason::Revoked);
        });
        assert_eq!(sig.wait().await, LostReason::Revoked);
        assert!(!t.mark_lost(LostReason::Released));
        match t.ensure_not_lost() {
            Err(Error::Lost { reason, .. }) => assert_eq!(reason, LostReason::Revoked),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_resent_release_is_released_only_while_valid_and_nothing_else_ended_it() {
        // Valid, nothing known: the earlier send deleted it.
        let t = tracker(Duration::from_secs(10));
        assert!(t.released_by_earlier_send(false, Instant::now()));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Released));
        // Something known ended it (a revocation record, the session's end).
        let t = tracker(Duration::from_secs(10));
        assert!(!t.released_by_earlier_send(true, Instant::now()));
        assert_eq!(t.status(), LeaseStatus::Held);
        // A loss already recorded wins.
        let t = tracker(Duration::from_secs(10));
        t.mark_lost(LostReason::Revoked);
        assert!(!t.released_by_earlier_send(false, Instant::now()));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Revoked));
        // Past its validity the server may have expired it.
        let t = tracker(Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(!t.released_by_earlier_send(false, Instant::now()));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Expired));
    }

    #[tokio::test(start_paused = true)]
    async fn in_doubt_is_uncertain_and_renewal_restores() {
        let t = tracker(Duration::from_secs(10));
        let mut sig = t.signal();
        t.in_doubt();
        assert_eq!(sig.uncertain().await, LeaseStatus::InDoubt);
        assert!(!sig.is_lost());
        t.renewed(Instant::now() + Duration::from_secs(10));
        assert_eq!(t.status(), LeaseStatus::Held);
    }

    #[test]
    fn lose_keeps_the_first_reason_and_lost_error_reports_it() {
        let t = tracker(Duration::from_secs(10));
        assert!(matches!(
            t.lost_error(LostReason::Expired),
            Error::Lost {
                reason: LostReason::Expired,
                ..
            }
        ));
        assert!(matches!(
            t.lose(LostReason::Revoked),
            Error::Lost {
                reason: LostReason::Revoked,
                ..
            }
        ));
        assert!(matches!(
            t.lose(LostReason::Released),
            Error::Lost {
                reason: LostReason::Revoked,
                ..
            }
        ));
        assert!(matches!(
            t.lost_error(LostReason::Expired),
            Error::Lost {
                reason: LostReason::Revoked,
                ..
            }
        ));
        assert_eq!(t.status(), LeaseStatus::Lost(LostReason::Revoked));
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_tracker_resolves_signal() {
        let t = tracker(Duration::from_secs(100));
        let mut sig = t.signal();
        assert_eq!(sig.status(), LeaseStatus::Held);
        drop(t);
        // The status says what the wait resolves with. Before, it read `Held` until validity
        // passed, for a lease its owner had dropped.
        assert_eq!(sig.status(), LeaseStatus::Lost(LostReason::Released));
        assert!(sig.is_lost());
        assert_eq!(sig.wait().await, LostReason::Released);
    }

    /// Signals already waiting are woken by a loss and by the tracker going, each clone on its
    /// own, long before the validity they were also waiting for.
    #[tokio::test(start_paused = true)]
    async fn waiting_signals_are_woken_by_a_loss_and_by_the_tracker_going() {
        let start = Instant::now();
        let lost = tracker(Duration::from_secs(100));
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let mut sig = lost.signal();
                tokio::spawn(async move { sig.wait().await })
            })
            .collect();
        let mut uncertain = lost.signal();
        let in_doubt = tokio::spawn(async move { uncertain.uncertain().await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        lost.in_doubt();
        assert_eq!(in_doubt.await.unwrap(), LeaseStatus::InDoubt);
        lost.mark_lost(LostReason::Revoked);
        for w in waiters {
            assert_eq!(w.await.unwrap(), LostReason::Revoked);
        }
        let gone = tracker(Duration::from_secs(100));
        let mut sig = gone.signal();
        let waiter = tokio::spawn(async move { sig.wait().await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(gone);
        assert_eq!(waiter.await.unwrap(), LostReason::Released);
        assert!(Instant::now() - start < Duration::from_secs(3));
    }
}
