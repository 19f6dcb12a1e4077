//! [`ConsulLease`]: a lock on one KV key held by the client's session, with its fencing token.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use lease_core::adapter::{
    forced_release_of, spawn_guardian, CleanupFailures, Cleanups, LeaseTracker, Op, PendingCleanup,
    StoredAudit,
};
use lease_core::{Error, Lease, LeaseState, LeaseStatus, LockKey, LostReason, Result, Token};
use tokio::time::Instant;

use crate::client::{Http, KvEntry, TxnOp, TxnOutcome};
use crate::confirm::{Confirmer, Ownership};
use crate::core::SlotGuard;
use crate::monitor::{Monitor, Watched};
use crate::session::{Session, SessionLease, SessionManager};
use crate::BACKEND;

/// What a compare-and-delete of the lease's key found.
pub(crate) enum Released {
    /// The key was ours and is deleted.
    Deleted,
    /// The key was not ours any more (nothing deleted), for this reason.
    NotOurs(LostReason),
}

/// The state of one lease shared by the lease object, its session and its guardian task.
pub(crate) struct LeaseShared {
    pub(crate) id: u64,
    pub(crate) kv_key: String,
    /// The key of the lock's audit trail, where a force-release records the token it removed.
    audit_key: String,
    pub(crate) token: Token,
    pub(crate) tracker: LeaseTracker,
    pub(crate) session: Arc<Session>,
    pub(crate) sessions: Arc<SessionManager>,
    pub(crate) http: Arc<Http>,
    /// The coordinator's batched ownership checks (for renewals).
    confirmer: Arc<Confirmer>,
    /// The coordinator's lock monitor (loss detection), which watches this lease's key.
    pub(crate) monitor: Arc<Monitor>,
    /// The lease's own deadline (last confirmed acquire or renew, plus TTL, minus margin); its
    /// validity is this or the session's, whichever comes first.
    own_until: Mutex<Instant>,
    /// The server side is settled: released by us, or known not to be ours.
    resolved: AtomicBool,
    /// Held by whoever deletes the key (`release`, the guardian), so that neither frees the slot
    /// while the other's delete, keyed only on our session, may still be sent again.
    deleting: tokio::sync::Mutex<()>,
    /// This client's claim on the key (no second lease of the same session on it).
    slot: Mutex<Option<SlotGuard>>,
    /// The coordinator's clean-ups under way, which `settle` waits for.
    cleanups: Cleanups,
    /// The count of the clean-up after this lease was dropped, until the guardian has deleted
    /// its key (or, when the guardian was done already, until this state is dropped).
    dropped: Mutex<Option<PendingCleanup>>,
}

impl LeaseShared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: u64,
        kv_key: String,
        audit_key: String,
        tracker: LeaseTracker,
        own_until: Instant,
        session: Arc<Session>,
        sessions: Arc<SessionManager>,
        http: Arc<Http>,
        confirmer: Arc<Confirmer>,
        monitor: Arc<Monitor>,
        cleanups: Cleanups,
        slot: SlotGuard,
    ) -> Self {
        LeaseShared {
            id,
            kv_key,
            audit_key,
            token: tracker.token(),
            own_until: Mutex::new(own_until),
            tracker,
            session,
            sessions,
            http,
            confirmer,
            monitor,
            resolved: AtomicBool::new(false),
            deleting: tokio::sync::Mutex::new(()),
            slot: Mutex::new(Some(slot)),
            cleanups,
            dropped: Mutex::new(None),
        }
    }

    fn own_until(&self) -> Instant {
        *self.own_until.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The session's validity moved to `session_until`: a held lease's validity follows, up to
    /// its own deadline. No effect on a lost lease.
    ///
    /// A lease in doubt (the session's renewals failed meanwhile) is held again only once a read
    /// shows its key still locked by the session: a renewal proves the session lives, not that
    /// nobody deleted the key during the partition. Unless the renewals failed again since, it
    /// is then held with that validity; a key gone or locked by another session leaves it in
    /// doubt until the lock monitor, which sees the same, marks it lost.
    pub(crate) fn session_confirmed(self: &Arc<Self>, session_until: Instant) {
        let until = self
            .own_until()
            .min(session_until)
            .max(self.tracker.valid_until());
        match self.tracker.status() {
            LeaseStatus::Held => {
                self.tracker.renewed(until);
            }
            LeaseStatus::InDoubt => {
                let (lease, doubts) = (self.clone(), self.session.doubts());
                tokio::spawn(async move {
                    let owned = lease
                        .confirmer
                        .check(&lease.kv_key, &lease.session.id)
                        .await;
                    if matches!(owned, Ok(Ownership::Ours))
                        && lease.session.doubts() == doubts
                        && lease.tracker.status() == LeaseStatus::InDoubt
                    {
                        lease.tracker.renewed(until);
                    }
                });
            }
            LeaseStatus::Lost(_) => {}
        }
    }

    /// Marks the server side settled and the lease lost; returns the `Lost` error with the
    /// reason recorded first.
    pub(crate) fn lost(&self, reason: LostReason) -> Error {
        self.resolved.store(true, Ordering::SeqCst);
        self.tracker.lose(reason)
    }

    /// [`Self::lost`] for a renewal that found the key not ours: a release that runs decides the
    /// reason (see [`LeaseTracker::lose_unless_releasing`]).
    fn lost_unless_releasing(&self, reason: LostReason) -> Error {
        self.resolved.store(true, Ordering::SeqCst);
        self.tracker.lose_unless_releasing(reason)
    }

    /// Gives up this client's claim on the key (idempotent).
    pub(crate) fn free_slot(&self) {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Why the key is not ours, when Consul's answer does not say.
    fn reason_gone(&self, key_missing: bool) -> LostReason {
        if self.session.is_ended() {
            LostReason::SessionEnded
        } else if key_missing {
            LostReason::Revoked
        } else {
            LostReason::Superseded
        }
    }

    /// Whether `entry` (the key as Consul shows it now) is still this lease's lock.
    ///
    /// Ownership is the **session**, not the `ModifyIndex`: a plain write to the key by another
    /// tool (`PUT` without `?acquire`) keeps the key's session and raises its index, and the lock
    /// is still ours. The client's local slot guarantees that no other lease of this session
    /// holds the key while this one is not settled, so the session alone identifies this lease.
    fn owns(&self, entry: &KvEntry) -> bool {
        entry.holder() == Some(self.session.id.as_str())
    }

    /// What the lock monitor saw of the key, in an answer that follows the lease's acquire
    /// (`None`: the key is gone). Lost if the key is gone (`Revoked`, or `SessionEnded` when the
    /// session is known gone) or not locked by the lease's session (`Superseded`); nothing if it
    /// is, or if the lease is being released (the key's disappearance is then ours) or settled.
    pub(crate) fn seen(&self, entry: Option<&KvEntry>) {
        if self.tracker.is_releasing() || self.resolved.load(Ordering::SeqCst) {
            return;
        }
        match entry {
            Some(e) if self.owns(e) => {}
            other => {
                let reason = self.reason_gone(other.is_none());
                let _ = self.lost(reason);
            }
        }
    }

    /// Compare-and-delete in one transaction, keyed on this lease's version of the key: locked
    /// by its session (see [`Self::owns`]) at the `ModifyIndex` it was granted at (its token), or
    /// at the one an outside write moved it to (read back when the index check fails, and
    /// deleted only if the key still has this lease's `CreateIndex`). A copy of the delete that
    /// reaches the servers late (held through a leader election, or sent again after a failed
    /// connection) then deletes nothing, even once a newer lease of this same session locks a
    /// new key by that name: the session alone would not tell the two apart.
    ///
    /// One at a time: a second caller waits for the first, and finds it settled.
    pub(crate) async fn release_on_server(&self, operation: &'static str) -> Result<Released> {
        let _deleting = self.deleting.lock().await;
        if self.resolved.load(Ordering::SeqCst) {
            // Settled by the other caller (the guardian, for a lease that expired meanwhile).
            return Ok(Released::NotOurs(LostReason::Released));
        }
        // A lease is granted only on a key its own lock created: the key's `CreateIndex` is the
        // `ModifyIndex` of that lock, the token.
        let created = self.token.get();
        let mut index = created;
        let mut rereads = 0;
        let mut read_missing = false;
        loop {
            let ops = release_ops(&self.kv_key, &self.session.id, index);
            let (outcome, in_doubt) = self
                .http
                .txn_resending(&ops, &[], Op::write(operation, true))
                .await;
            let errors = match outcome? {
                TxnOutcome::Committed(_) => {
                    self.resolved.store(true, Ordering::SeqCst);
                    return Ok(Released::Deleted);
                }
                TxnOutcome::RolledBack(errors) => errors,
            };
            let moved = errors.iter().any(|e| e.contains("modify index"))
                && !errors.iter().any(|e| e.contains("doesn't exist"));
            if moved {
                // Written from outside since (a plain `PUT` keeps the lock and raises the
                // index): still this lease's key if its session and `CreateIndex` are.
                let (_, entry) = self
                    .http
                    .kv_get(&self.kv_key, true, None, operation)
                    .await?;
                read_missing = entry.is_none();
                if let Some(e) = entry.filter(|e| self.owns(e) && e.create_index == created) {
                    if rereads == RELEASE_REREADS {
                        // Still ours, written again before every delete: not settled. The
                        // caller (the guardian, for a lease ended otherwise) tries again later.
                        return Err(Error::unavailable(
                            BACKEND,
                            format!(
                                "{operation}: {} was written from outside before each of {} \
                                 deletes; it stays locked by this lease until a delete gets \
                                 through (retried in the background)",
                                self.kv_key,
                                RELEASE_REREADS + 1
                            ),
                        ));
                    }
                    rereads += 1;
                    index = e.modify_index;
                    continue;
                }
            }
            let answered = Instant::now();
            self.resolved.store(true, Ordering::SeqCst);
            // The earlier send deleted it, unless the session ended meanwhile (its locks go
            // with it), the lease was already lost, or an operator's force-release removed it
            // (its audit record names our token: revoked, whoever locked the key since).
            let forced = in_doubt && self.forced(operation).await;
            if in_doubt
                && !forced
                && self
                    .tracker
                    .released_by_earlier_send(self.session.is_ended(), answered)
            {
                return Ok(Released::Deleted);
            }
            if forced && !self.session.is_ended() {
                return Ok(Released::NotOurs(LostReason::Revoked));
            }
            let missing = read_missing || errors.iter().any(|e| e.contains("doesn't exist"));
            return Ok(Released::NotOurs(self.reason_gone(missing)));
        }
    }
}

impl LeaseShared {
    /// Whether a force-release removed our key, as its audit record says
    /// ([`forced_release_of`]; one `?consistent` read). A read that fails says no (the release
    /// is then taken for done, as before).
    async fn forced(&self, operation: &'static str) -> bool {
        match self
            .http
            .kv_get(&self.audit_key, true, None, operation)
            .await
        {
            Ok((_, entry)) => {
                // The whole trail, read anyway (at most `AuditRecord::MAX_LIMIT` records).
                // An unreadable trail holds no record of ours.
                let trail = entry
                    .and_then(|e| StoredAudit::parse_trail(&e.value_bytes()))
                    .unwrap_or_default();
                let all = StoredAudit::newest_first(&trail, self.tracker.key(), trail.len());
                forced_release_of(&all, self.token)
            }
            Err(e) => {
                tracing::debug!(backend = BACKEND, key = %self.kv_key, error = %e, "could not read the audit record after a release found its key gone");
                false
            }
        }
    }
}

/// How often a release reads the key again and retries when an outside write moved its
/// `ModifyIndex` in between, before it reports the key still locked (`Unavailable`).
const RELEASE_REREADS: u32 = 3;

/// The release's transaction: delete `kv_key` if `session` locks it at `ModifyIndex` `index`.
fn release_ops(kv_key: &str, session: &str, index: u64) -> [TxnOp; 3] {
    [
        TxnOp::check_session(kv_key, session),
        TxnOp::check_index(kv_key, index),
        TxnOp::delete(kv_key),
    ]
}

impl SessionLease for LeaseShared {
    fn kv_key(&self) -> &str {
        &self.kv_key
    }

    fn token(&self) -> Token {
        self.token
    }

    fn session_confirmed(self: Arc<Self>, until: Instant) {
        LeaseShared::session_confirmed(&self, until);
    }

    fn in_doubt(&self) {
        self.tracker.in_doubt();
    }

    fn session_ended(&self) {
        self.tracker.mark_lost(LostReason::SessionEnded);
    }

    fn revoked(&self) {
        let _ = self.lost(LostReason::Revoked);
    }

    #[cfg(test)]
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

impl Watched for LeaseShared {
    fn kv_key(&self) -> &str {
        &self.kv_key
    }

    fn acquired_at_index(&self) -> u64 {
        self.token.get()
    }

    fn is_lost(&self) -> bool {
        matches!(self.tracker.status(), LeaseStatus::Lost(_))
    }

    fn seen(&self, entry: Option<&KvEntry>) {
        LeaseShared::seen(self, entry);
    }

    fn in_doubt(&self) {
        self.tracker.in_doubt();
    }
}

/// Runs until the lease is lost (released, dropped, expired, revoked, session ended), then makes
/// sure its key is not left locked: a compare-and-delete, retried with backoff until it is
/// settled or the session is gone (whose keys Consul deletes with it).
pub(crate) fn start_guardian(shared: Arc<LeaseShared>) {
    let tracker = shared.tracker.clone();
    spawn_guardian(&tracker, move |reason| async move {
        guard(&shared, reason).await;
        // A drop's clean-up is done.
        drop(
            shared
                .dropped
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take(),
        );
    });
}

/// Ends the lease for `reason` and deletes its key if it is still ours. The reason is recorded
/// before anything is deleted (the first recorded reason wins): a renewal that lands between the
/// wait and this point cannot leave its holder believing it holds a deleted lock.
pub(crate) async fn guard(shared: &LeaseShared, reason: LostReason) {
    shared.tracker.mark_lost(reason);
    // `release_on_server` answers at once for a lease settled meanwhile (by its own release).
    let failures = CleanupFailures::new(BACKEND, &shared.kv_key);
    let released = || shared.release_on_server("release");
    shared
        .session
        .clean_up(&failures, "releasing an ended lease", released)
        .await;
    shared.free_slot();
    shared.session.unregister(shared.id);
    shared.monitor.unwatch(shared.id);
}

/// A lease from [`crate::ConsulCoordinator`]: the lock on one KV key, held by the client's
/// session, with the `ModifyIndex` of the acquiring write as its token.
///
/// Dropping it without `release` stops nothing but the lease itself (the session serves other
/// leases): the lease is marked released and a background task deletes the key (compare-and-
/// delete), without blocking in `Drop`.
pub struct ConsulLease {
    pub(crate) shared: Arc<LeaseShared>,
}

impl fmt::Debug for ConsulLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulLease")
            .field("tracker", &self.shared.tracker)
            .field("kv_key", &self.shared.kv_key)
            .finish_non_exhaustive()
    }
}

impl ConsulLease {
    /// The Consul KV key holding the lock.
    pub fn kv_key(&self) -> &str {
        &self.shared.kv_key
    }

    /// The lock key.
    pub fn lock_key(&self) -> &LockKey {
        self.shared.tracker.key()
    }
}

#[async_trait]
impl Lease for ConsulLease {
    fn state(&self) -> &LeaseState {
        &self.shared.tracker
    }

    /// Confirms that the key is still locked by the client's session with a `?consistent` read
    /// made after the call started, batched with the checks of concurrent renewals (one
    /// read-only `/v1/txn` of up to 64 `check-session`s per round, see `confirm.rs`). The session
    /// itself is renewed by the client's background renewer; a renewal sends a session renewal
    /// only when less than half the session TTL of its validity is left, and then shares it with
    /// every concurrent renewal (one `PUT` for all). Lost if the session is gone (404), or the
    /// key is gone or not locked by the session. A plain write to the key by another tool keeps
    /// its session: still ours. Validity never exceeds the session's last confirmed renewal.
    async fn renew(&self) -> Result<Instant> {
        let s = &self.shared;
        s.tracker.ensure_not_lost()?;
        let sent = Instant::now();
        let session_renewal = async {
            if s.session.fresh_at(sent) {
                Ok(true)
            } else {
                s.sessions.renew_after(&s.session, sent).await
            }
        };
        let (renewed, owned) =
            tokio::join!(session_renewal, s.confirmer.check(&s.kv_key, &s.session.id),);
        if let Ok(false) = renewed {
            return Err(s.lost(LostReason::SessionEnded));
        }
        // A loss the ownership check confirmed counts whatever became of the session renewal
        // sent with it (an agent without a leader fails the renewal, and the key is still gone).
        match owned {
            Ok(Ownership::NotOurs) => return Err(s.lost_unless_releasing(s.reason_gone(false))),
            Ok(Ownership::Missing) => return Err(s.lost_unless_releasing(s.reason_gone(true))),
            Ok(Ownership::Ours) => renewed.map(|_| ())?,
            Err(e) => {
                renewed?;
                return Err(e);
            }
        }
        let own = lease_core::adapter::clock::valid_until(
            sent,
            s.tracker.ttl(),
            s.tracker.drift_margin(),
        );
        {
            let mut o = s.own_until.lock().unwrap_or_else(|p| p.into_inner());
            *o = (*o).max(own);
        }
        let until = s
            .own_until()
            .min(s.session.valid_until())
            .max(s.tracker.valid_until());
        if !s.tracker.renewed(until) {
            s.tracker.ensure_not_lost()?;
        }
        Ok(s.tracker.valid_until())
    }

    /// One transaction: `check-session`, `delete`.
    ///
    /// A release that was sent ends the lease whatever its outcome: on an error (the answer
    /// lost, a timeout, Consul unavailable) the lease is `Lost(Released)` at once and never
    /// `Held` again, and the background task retries the delete until it is settled.
    async fn release(&self) -> Result<()> {
        let s = &self.shared;
        s.tracker.ensure_not_lost()?;
        // A release dropped before it ends (a caller's timeout around it) ends the lease as a
        // failed one does: the guardian, woken by the loss, deletes the key if it is still ours.
        s.tracker.release_with(self.release_key(), || {}).await
    }
}

impl ConsulLease {
    /// The body of `release`.
    async fn release_key(&self) -> Result<()> {
        let s = &self.shared;
        match s.release_on_server("release").await {
            Ok(Released::Deleted) => {
                s.tracker.mark_lost(LostReason::Released);
                s.free_slot();
                Ok(())
            }
            Ok(Released::NotOurs(reason)) => Err(s.lost(reason)),
            Err(e) => {
                // It may or may not have applied. Either way the lease is over for its holder;
                // the guardian (woken by this) deletes the key if it is still ours.
                s.tracker.mark_lost(LostReason::Released);
                Err(e)
            }
        }
    }
}

impl Drop for ConsulLease {
    fn drop(&mut self) {
        // The guardian sees this and deletes the key if it is still ours, counted until then:
        // also after a loss or a failed release, whose delete the guardian may still be
        // retrying. A guardian that has finished already took nothing; the count then ends with
        // `shared`, which only this lease still holds.
        *self
            .shared
            .dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(self.shared.cleanups.begin());
        if !matches!(self.shared.tracker.status(), LeaseStatus::Lost(_)) {
            self.shared.tracker.mark_lost(LostReason::Released);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConsulCoordinator;
    use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions};
    use lease_core::{Coordinator, LeaseOptions};
    use std::time::Duration;

    /// The guardian's wait has decided `Expired`; a renewal sent before the expiry lands (Consul
    /// confirms the session and the key) before the guardian goes on. The guardian must still record
    /// the loss before it deletes the key: from then on the lease reads `Lost`, never `Held`.
    #[tokio::test]
    async fn a_renewal_landing_after_the_guardian_woke_does_not_outlive_the_deleted_key() {
        let s = ConsulStandIn::start(
            StandInOptions::default().session_ttl_min(Duration::from_millis(500)),
        )
        .expect("stand-in");
        let c =
            ConsulCoordinator::connect_url(&format!("consul://{}?session_ttl_ms=1000", s.addr()))
                .await
                .unwrap();
        let k = LockKey::new("guarded").unwrap();
        let lease = c
            .acquire(&k, &LeaseOptions::new(Duration::from_secs(30)))
            .await
            .unwrap();
        let shared = c.lease_shared(&k).expect("the lease is registered");
        // The renewal completes...
        lease.renew().await.expect("renewed");
        assert_eq!(lease.status(), LeaseStatus::Held);
        // ...after the guardian's wait had returned `Expired`.
        guard(&shared, LostReason::Expired).await;
        assert!(c.inspect(&k).await.unwrap().is_none(), "the key is deleted");
        assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Expired));
        assert!(matches!(
            lease.renew().await,
            Err(Error::Lost {
                reason: LostReason::Expired,
                ..
            })
        ));
    }

    /// A copy of a release that reaches the servers late (held through a leader election while
    /// a resend committed) must not delete the key of the next lease this same client takes on
    /// the key: both are locked by the client's one session, so the release is keyed on its
    /// lease's `ModifyIndex` too.
    #[tokio::test]
    async fn a_late_copy_of_a_release_leaves_the_next_lease_of_the_same_session() {
        let s = ConsulStandIn::start(StandInOptions::default()).expect("stand-in");
        let c = ConsulCoordinator::connect_url(&format!("consul://{}", s.addr()))
            .await
            .unwrap();
        let k = LockKey::new("released-late").unwrap();
        let options = LeaseOptions::new(Duration::from_secs(30));
        let first = c.acquire(&k, &options).await.unwrap();
        let shared = c.lease_shared(&k).expect("the lease is registered");
        let late = release_ops(&shared.kv_key, &shared.session.id, shared.token.get());
        first.release().await.unwrap();
        let next = c.acquire(&k, &options).await.unwrap();
        let now = c.lease_shared(&k).expect("the next lease is registered");
        assert_eq!(now.session.id, shared.session.id, "one session per client");
        // The first release's copy arrives now.
        let outcome = shared
            .http
            .txn(&late, Op::write("release", true))
            .await
            .unwrap();
        assert!(matches!(outcome, TxnOutcome::RolledBack(_)), "{outcome:?}");
        let info = c
            .inspect(&k)
            .await
            .unwrap()
            .expect("the next lease's key stays");
        assert_eq!(info.token, next.token());
        assert_eq!(next.status(), LeaseStatus::Held);
        next.release().await.unwrap();
    }
}
