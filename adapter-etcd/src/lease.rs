//! [`EtcdLease`]: a held lock, its renewal and release, and the guardian task that notices
//! when it is gone.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use lease_core::adapter::{forced_release_of, Backoff, LeaseTracker, Op, StoredAudit};
use lease_core::{Lease, LeaseState, LeaseStatus, LostReason, Result};
use tokio::time::Instant;

use crate::core::Handle;
use crate::error::{retry_resendable, retry_unapplied, BACKEND};
use crate::keys::{self, Slot};
use crate::session::{Cleanup, Session, Unconfirmed};
use crate::watch::Seen;

/// What a lease shares with its guardian task.
pub(crate) struct LeaseShared {
    handle: Arc<Handle>,
    session: Arc<Session>,
    /// The holder's own etcd key.
    key: String,
    /// The slot of its name: freed once the key is known gone, or handed to the cleanup that
    /// deletes it.
    slot: std::sync::Mutex<Option<Slot>>,
    /// Its create revision: the fencing token.
    revision: i64,
    /// Set once the key is deleted or its deletion is queued (so it happens once).
    retired: AtomicBool,
}

impl LeaseShared {
    /// Deletes our key in the background (guarded by its create revision), once.
    fn retire(&self) {
        if !self.retired.swap(true, Ordering::SeqCst) {
            let cleanup =
                Cleanup::created(self.key.clone(), self.revision, self.session.watch_state());
            self.handle.cleaner.delete(match self.take_slot() {
                Some(slot) => cleanup.holding(slot),
                None => cleanup,
            });
        }
    }

    /// Records that the key is gone (deleted by us or by someone else): nothing to clean up.
    fn gone(&self) {
        self.retired.store(true, Ordering::SeqCst);
        // No key by this name exists any more: the next acquisition may reuse it at once.
        drop(self.take_slot());
    }

    /// The key range of the lock our key is in (our key up to its last `/`).
    fn lock_range(&self) -> &str {
        self.key.rfind('/').map_or(&self.key, |i| &self.key[..=i])
    }

    fn take_slot(&self) -> Option<Slot> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Why a key we no longer find is gone: the session ended, or someone deleted it.
    fn vanished_reason(&self) -> LostReason {
        match self.session.dead_reason() {
            Some(r) if r != LostReason::Released => r,
            _ => LostReason::Revoked,
        }
    }
}

/// A lease on an etcd lock.
///
/// Its key is `<prefix>/lock/<name>/<session>-<slot>` (a slot number the session reuses once no
/// key by that name exists), attached to the client's session lease;
/// its token is that key's create revision. See the crate docs for renewal, loss and release.
///
/// Dropping it without [`release`](Lease::release) marks it lost (`Released`) and deletes its key
/// in the background, compare-and-delete on the create revision, without blocking.
pub struct EtcdLease {
    tracker: LeaseTracker,
    shared: Arc<LeaseShared>,
}

impl fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdLease")
            .field("tracker", &self.tracker)
            .field("etcd_key", &self.shared.key)
            .field("session", &self.shared.session)
            .finish()
    }
}

impl EtcdLease {
    /// A granted lease; starts its guardian, which watches our key from `watch_from`.
    pub(crate) fn start(
        handle: Arc<Handle>,
        session: Arc<Session>,
        key: String,
        slot: Slot,
        revision: i64,
        tracker: LeaseTracker,
        watch_from: i64,
    ) -> EtcdLease {
        let shared = Arc::new(LeaseShared {
            handle,
            session,
            key,
            slot: std::sync::Mutex::new(Some(slot)),
            revision,
            retired: AtomicBool::new(false),
        });
        // Registered now, so that the session's end reaches the lease from the start; the
        // guardian starts a moment later, unless the lease is over and its key gone by then.
        let slot = shared
            .session
            .register(tracker.clone(), &shared.key, revision);
        let (guarded, lease) = (shared.clone(), tracker.clone());
        shared.handle.guardians.push(move || {
            if guarded.retired.load(Ordering::SeqCst)
                && matches!(lease.status(), LeaseStatus::Lost(_))
            {
                guarded.session.unregister(slot);
            } else {
                tokio::spawn(guard(guarded, lease, watch_from, slot));
            }
        });
        EtcdLease { tracker, shared }
    }

    /// The holder's own etcd key (for operators and tests).
    pub fn etcd_key(&self) -> &str {
        &self.shared.key
    }

    /// The etcd lease id of the session this lease's key is attached to.
    pub fn session_lease_id(&self) -> i64 {
        self.shared.session.id()
    }

    fn lost_now(&self, reason: LostReason) -> lease_core::Error {
        self.tracker.lose(reason)
    }

    /// Whether a force-release removed our key, as its audit record says
    /// ([`forced_release_of`]). A read that fails says no (the release is then taken for done,
    /// as before).
    async fn forced(&self) -> bool {
        let handle = &self.shared.handle;
        let key = self.tracker.key();
        let audit_key = keys::audit_key(handle.config.key_prefix(), key);
        match handle.read_audit(&audit_key, "release").await {
            // The whole trail, read anyway (at most `AuditRecord::MAX_LIMIT` records).
            Ok((_, trail)) => forced_release_of(
                &StoredAudit::newest_first(&trail, key, trail.len()),
                self.tracker.token(),
            ),
            Err(e) => {
                tracing::debug!(backend = BACKEND, key = %key, error = %e, "could not read the audit record after a release found its key gone");
                false
            }
        }
    }
}

/// How old, as a fraction `1 / KEEPALIVE_AGE` of the validity window, the keepalive a renewal's
/// validity counts from may be (see [`EtcdLease::renew`]).
const KEEPALIVE_AGE: u32 = 40;

#[async_trait]
impl Lease for EtcdLease {
    fn state(&self) -> &LeaseState {
        &self.tracker
    }

    /// Confirms ownership and extends local validity: our key must still exist, read after the
    /// call started (batched with other renewals, see the crate's `confirm` module), and validity counts
    /// from the earlier of the call's start and the session's last acknowledged keepalive, as
    /// at the grant. The session sends its keepalives every third of its TTL on its own; a
    /// renewal waits for one sent no more than 1/40 of the validity window before it (asking for
    /// one unless such a one is acknowledged or in flight). So validity never counts from more
    /// than that before the call, and a keeper renewing as late as 9/10 of the window (the most
    /// `renew_fraction` allows) still has 3/40 of it left for the renewal's round trip; the cost
    /// is at most one keepalive per session per that age while renewals run, whatever the
    /// number of leases.
    async fn renew(&self) -> Result<Instant> {
        self.tracker.ensure_not_lost()?;
        let sent = Instant::now();
        let timeout = self.shared.handle.config.request_timeout();
        let session = &self.shared.session;
        let window = self
            .tracker
            .ttl()
            .saturating_sub(self.tracker.drift_margin());
        let since = sent.checked_sub(window / KEEPALIVE_AGE).unwrap_or(sent);
        let (confirmed, read) = tokio::join!(
            async {
                // With the stream broken the lease is in doubt (the session's contract): only
                // an acknowledgement once it is open again holds it again.
                if session.acked_sent() < since || !session.stream_up() {
                    session.confirm(since, timeout).await
                } else {
                    Ok(())
                }
            },
            self.shared
                .handle
                .confirmer
                .owns(&self.shared.key, self.shared.revision),
        );
        if !read? {
            self.shared.gone();
            session.probe();
            // Our own release's delete, if one runs: it decides.
            return Err(self
                .tracker
                .lose_unless_releasing(self.shared.vanished_reason()));
        }
        match confirmed {
            Ok(()) => {
                if let Some(reason) = session.dead_reason() {
                    return Err(self.lost_now(session_lost(reason)));
                }
                self.tracker.renewed_from(sent.min(session.acked_sent()))
            }
            Err(Unconfirmed::Dead(reason)) => Err(self.lost_now(session_lost(reason))),
            Err(Unconfirmed::Timeout) => Err(lease_core::Error::unavailable(
                crate::error::BACKEND,
                format!("renew: the session keepalive was not acknowledged within {timeout:?}"),
            )),
        }
    }

    /// Deletes our key in one transaction guarded by its create revision (the token), so a
    /// stale release never deletes a newer holder's key.
    async fn release(&self) -> Result<()> {
        if let LeaseStatus::Lost(reason) = self.tracker.status() {
            self.shared.retire();
            return Err(self.tracker.lost_error(reason));
        }
        // A release dropped before it ends leaves the lease released and our key to delete in
        // the background (compare-and-delete on the create revision).
        self.tracker
            .release_with(self.release_key(), || self.shared.retire())
            .await
    }
}

impl EtcdLease {
    /// The body of `release`.
    async fn release_key(&self) -> Result<()> {
        let key = self.shared.key.clone();
        let txn = Txn::new()
            .when([Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                self.shared.revision,
            )])
            .and_then([TxnOp::delete(key, None)]);
        let txns = &self.shared.handle.txns;
        let lock = self.shared.lock_range();
        // The delete is keyed on the create revision: sent again after a reset connection, it
        // can only delete our own key.
        let (outcome, in_doubt) =
            retry_resendable(self.shared.handle.config.request_timeout(), |_| {
                txns.send(lock, txn.clone())
            })
            .await;
        match outcome {
            Ok(resp) if resp.succeeded => {
                self.shared.gone();
                self.tracker.mark_lost(LostReason::Released);
                Ok(())
            }
            // An earlier send in doubt deleted it, unless the session ended meanwhile (its keys
            // go with it; our validity, which the session bounds, has not passed) or an
            // operator's force-release removed it (its audit record names our token).
            Ok(_) => {
                let answered = Instant::now();
                self.shared.gone();
                if in_doubt
                    && !self.forced().await
                    && self.tracker.released_by_earlier_send(
                        self.shared.session.dead_reason().is_some(),
                        answered,
                    )
                {
                    return Ok(());
                }
                Err(self.lost_now(self.shared.vanished_reason()))
            }
            Err(f) => {
                // Not seen: delete it in the background; the lease is given up either way.
                self.shared.retire();
                self.tracker.mark_lost(LostReason::Released);
                let op = Op::write("release", true);
                let e = f.into_error(op);
                Err(if in_doubt { op.after_doubt(e) } else { e })
            }
        }
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        if !matches!(self.tracker.status(), LeaseStatus::Lost(_)) {
            self.tracker.mark_lost(LostReason::Released);
        }
        self.shared.retire();
    }
}

/// Why a lease is lost when its session ended for `reason` (`Released` is the client closing
/// the session, which its leases see as the session ending).
fn session_lost(reason: LostReason) -> LostReason {
    if reason == LostReason::Released {
        LostReason::SessionEnded
    } else {
        reason
    }
}

/// How long after the grant a lease's guardian starts (and opens its watch on our key): a lease
/// released by then costs no task, no watch and no wake-up of another thread at its release. The
/// watch starts just after our key's creation, so a deletion or outside write since is still
/// delivered (on etcd's sync tick, at most ~100 ms later).
pub(crate) const GUARD_DELAY: Duration = Duration::from_millis(50);

/// How the guardian's watch ended.
enum Watched {
    /// The lease's signal fired with this reason (expiry, release, drop, session end).
    Lost(LostReason),
    /// Our key was deleted by someone else, or by the server with the session.
    Deleted,
}

/// The guardian of one lease: watches our own key and deletes it once the lease is lost.
///
/// - Our key deleted (force release, an operator, the session lease revoked or expired):
///   `lost()` fires with `Revoked`, or the session's reason.
/// - The lease lost otherwise (local validity passed without a renewal, released, dropped,
///   session over): the key is deleted (compare-and-delete on its create revision) unless it is
///   gone already, so an unrenewed lease never blocks others past its validity even though the
///   session keeps living.
///
/// The watch is one of the coordinator's multiplexed watches ([`crate::watch`]); one cancelled
/// by the server (compaction, no leader) is re-established after re-reading the key.
async fn guard(shared: Arc<LeaseShared>, tracker: LeaseTracker, mut from: i64, slot: u64) {
    let mut signal = tracker.signal();
    let timeout = shared.handle.config.request_timeout();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let key = shared.key.as_bytes().to_vec();
    let outcome = 'outer: loop {
        let session_lease = shared.session.id();
        let mut deletion = shared
            .handle
            .watcher
            .deleted(key.clone(), session_lease, from);
        let seen = tokio::select! {
            r = signal.wait() => break 'outer Watched::Lost(r),
            seen = deletion.wait() => seen,
        };
        match seen {
            // (`Turn` answers only a waiter's range watch.)
            Seen::Deleted => break 'outer Watched::Deleted,
            // Compacted past `from`, or cancelled by the server: re-read, then watch again from
            // just after the read. Detached from the session: the same, and the re-read
            // attaches it again.
            // Boxed: a client request future is several KB, and every held lease's guardian
            // would carry that much for its whole life otherwise.
            Seen::Recheck | Seen::Detached => match Box::pin(recheck(&shared, &key, timeout)).await
            {
                Some(Some(next)) => {
                    from = next;
                    backoff.reset();
                }
                Some(None) => break 'outer Watched::Deleted,
                None => {
                    tokio::select! {
                        r = signal.wait() => break 'outer Watched::Lost(r),
                        _ = backoff.sleep() => {}
                    }
                }
            },
        }
    };
    match outcome {
        Watched::Lost(reason) => {
            // Record the reason the signal fired before deleting the key (the first recorded
            // reason wins): on `Expired` the signal only observed that validity passed, and a
            // renewal completing in between must not leave a lease that reports held while its
            // key is deleted.
            tracker.mark_lost(reason);
            shared.retire();
        }
        Watched::Deleted => {
            shared.gone();
            // Once a release began it judges the deletion: its own delete, seen before its
            // answer, or an operator's, which it tells apart by the audit record.
            if !tracker.is_releasing() {
                // If the session lease was revoked, this makes the session find out now.
                shared.session.probe();
                tracker.gone_unless_releasing(shared.vanished_reason());
            }
        }
    }
    shared.session.unregister(slot);
}

/// Re-reads our key: `Some(Some(rev))` if it is still ours (watch again from `rev`),
/// `Some(None)` if it is gone, `None` if the read (or the attach below) failed.
///
/// A key of ours found detached from its session (an outside `put` without the lease) is
/// attached to it again, its value kept, unless it changed since the read: left detached, it
/// would outlive a holder that dies, and keep the lock taken until the session is over and a
/// later attempt deletes it (see `acquire::Detached`).
async fn recheck(shared: &LeaseShared, key: &[u8], timeout: Duration) -> Option<Option<i64>> {
    let client = &shared.handle.client;
    let resp = retry_unapplied(timeout, || {
        let mut kv = client.clone();
        async move { kv.get(key, None).await }
    })
    .await
    .ok()?;
    let Some(kv) = resp
        .kvs()
        .first()
        .filter(|kv| kv.create_revision() == shared.revision)
    else {
        return Some(None);
    };
    let session = shared.session.id();
    if kv.lease() == session {
        return Some(Some(
            resp.header().map_or(shared.revision, |h| h.revision()) + 1,
        ));
    }
    let attach = Txn::new()
        .when([Compare::mod_revision(
            key,
            CompareOp::Equal,
            kv.mod_revision(),
        )])
        .and_then([TxnOp::put(
            key,
            "",
            Some(PutOptions::new().with_lease(session).with_ignore_value()),
        )]);
    let done = retry_unapplied(timeout, || {
        let (mut kv, attach) = (client.clone(), attach.clone());
        async move { kv.txn(attach).await }
    })
    .await
    .ok()?;
    if !done.succeeded() {
        // Written again since the read: read again.
        return None;
    }
    tracing::warn!(
        backend = crate::error::BACKEND,
        key = %shared.key,
        "a write from outside detached our lock key from its session; attached it again"
    );
    Some(Some(
        done.header().map_or(shared.revision, |h| h.revision()) + 1,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::{LockKey, Token};

    /// The guardian's race: its signal fires because validity passed, then a renewal sent before
    /// the expiry is confirmed (on another thread), then the guardian deletes the key. The late
    /// renewal must not make the lease read `Held` again: it is refused, the expiry is recorded,
    /// and the guardian's own record of it changes nothing.
    #[tokio::test(start_paused = true)]
    async fn the_guardian_records_the_expiry_it_acted_on_despite_a_late_renewal() {
        let sent = Instant::now();
        let key: LockKey = "k".parse().unwrap();
        let ttl = Duration::from_secs(2);
        let tracker = LeaseTracker::new(
            "etcd",
            key,
            Token::new(5).unwrap(),
            ttl,
            Duration::from_millis(100),
            sent,
        );
        let mut signal = tracker.signal();
        let reason = signal.wait().await;
        assert_eq!(reason, LostReason::Expired);
        // The renewal, sent before validity passed, is confirmed now: too late.
        assert!(tracker.renewed_from(sent + Duration::from_secs(1)).is_err());
        assert_eq!(tracker.status(), LeaseStatus::Lost(LostReason::Expired));
        // What the guardian does before deleting the key.
        tracker.mark_lost(reason);
        assert_eq!(tracker.status(), LeaseStatus::Lost(LostReason::Expired));
        assert!(tracker.renewed_from(Instant::now()).is_err());
    }
}
