//! The acquire recipe on Consul: one transaction (`check-not-exists` of the attempt's marker,
//! `lock`, `get`) when the key is free, blocking queries on the key while it is not, the grant,
//! and the cancellation of an attempt whose answer was not seen.

use std::sync::{Arc, Weak};
use std::time::Duration;

use lease_core::adapter::{
    ended_during_acquire, fresh_id, Backoff, CleanupFailures, Cleanups, HolderRecord, LeaseTracker,
    Op,
};
use lease_core::{Error, Lease, LeaseOptions, LockKey, LostReason, Result};
use tokio::time::Instant;

use crate::client::{Http, KvEntry, TxnOp, TxnOutcome};
use crate::coordinator::ConsulCoordinator;
use crate::core::SlotGuard;
use crate::core::{BUSY_WAIT, MAX_WAITING_QUERIES};
use crate::lease::{start_guardian, ConsulLease, LeaseShared};
use crate::monitor::Watched;
use crate::session::{Session, SessionLease};
use crate::BACKEND;

/// Sleeps `d`, but not past `deadline`.
async fn nap(d: Duration, deadline: Option<Instant>) {
    let until = Instant::now() + d;
    tokio::time::sleep_until(deadline.map_or(until, |dl| until.min(dl))).await;
}

/// An acquire transaction in flight. If it is dropped armed (the caller's future was cancelled,
/// or the answer was lost), the attempt is cancelled in the background: a marker key makes a
/// late-arriving lock request fail its `check-not-exists`, then the lock is deleted if the
/// attempt did take it. The client's claim on the key is held until that is done.
struct Attempt {
    armed: Option<Armed>,
}

/// What cancelling an attempt needs.
struct Armed {
    http: Arc<Http>,
    cleanups: Cleanups,
    session: Arc<Session>,
    kv_key: String,
    marker: String,
    slot: SlotGuard,
}

impl Attempt {
    fn disarm(mut self) -> SlotGuard {
        self.armed.take().expect("armed until disarmed").slot
    }

    /// After a send in doubt whose resend was refused (the key held, a lock-delay): the
    /// resend's marker was not written, so an earlier send still on its way (an agent holding
    /// it through a leader election) could lock the key once it is free, for a lease nobody
    /// has. Writes the marker now, so that it fails, then deletes a lock of our session on the
    /// key if one such send got there first (the claim says no other lease of this client holds
    /// it), as the background cancellation does, each once within the request timeout. `Ok`
    /// with the claim when both are done; otherwise the attempt is left to that cancellation
    /// and the error returned.
    async fn settle(self) -> Result<SlotGuard> {
        let armed = self.armed.as_ref().expect("armed until disarmed");
        let (http, session) = (&armed.http, &armed.session.id);
        write_marker(http, session, &armed.marker).await?;
        undo_lock(http, session, &armed.kv_key).await?;
        Ok(self.disarm())
    }
}

/// Cancelling an attempt, step 1: writes its marker, so that its lock request, if it is still
/// on its way, fails its `check-not-exists`.
async fn write_marker(http: &Http, session: &str, marker: &str) -> Result<TxnOutcome> {
    http.txn(
        &[TxnOp::lock(marker, session, b"")],
        Op::write("cancel acquire", false),
    )
    .await
}

/// Cancelling an attempt, step 2: deletes the key if our session locks it. The client's claim
/// on the key is held, so no other lease of this client holds it: such a lock is the attempt's.
async fn undo_lock(http: &Http, session: &str, kv_key: &str) -> Result<()> {
    delete_own_lock(
        http,
        session,
        kv_key,
        None,
        Op::write("cancel acquire", false),
    )
    .await
}

/// Outside writes (a plain `PUT` keeps a lock and raises the key's `ModifyIndex`) that one
/// [`delete_own_lock`] rides out before it reports the key as not yet deleted.
const OUTSIDE_WRITES: u32 = 3;

/// Deletes `kv_key` if `session` locks it, for a caller that holds this client's claim on the
/// key (so no lease of this client holds it: such a lock is one to remove). The delete is keyed
/// on the lock's `ModifyIndex` (`index`, or read first when `None`), so a copy of it applied
/// late (held through a leader election) cannot delete the key of the lock this client takes
/// next, which has the same session.
///
/// A delete refused because the key was written from outside since (its `ModifyIndex` moved)
/// reads the key again and deletes it at its new index while our session still locks it: a
/// refusal is not a removal. `Ok` once the key is deleted or not locked by `session`;
/// `Unavailable` when it was written again before each of `OUTSIDE_WRITES + 1` deletes (still
/// locked: the caller tries again later).
async fn delete_own_lock(
    http: &Http,
    session: &str,
    kv_key: &str,
    mut index: Option<u64>,
    op: Op,
) -> Result<()> {
    for _ in 0..=OUTSIDE_WRITES {
        let at = match index.take() {
            Some(at) => at,
            None => {
                let (_, entry) = http.kv_get(kv_key, true, None, op.name).await?;
                match entry.filter(|e| e.holder() == Some(session)) {
                    Some(e) => e.modify_index,
                    None => return Ok(()),
                }
            }
        };
        let ops = [
            TxnOp::check_session(kv_key, session),
            TxnOp::check_index(kv_key, at),
            TxnOp::delete(kv_key),
        ];
        if let TxnOutcome::Committed(_) = http.txn(&ops, op).await? {
            tracing::debug!(key = %kv_key, operation = op.name, "removed a lock not handed out");
            return Ok(());
        }
        // Refused: no longer ours, gone, or written from outside since. Read it again.
    }
    Err(Error::unavailable(
        BACKEND,
        format!(
            "{}: {kv_key} was written from outside before each of {} deletes; it stays locked \
             by this client's session until a delete gets through",
            op.name,
            OUTSIDE_WRITES + 1
        ),
    ))
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let Some(Armed {
            http,
            cleanups,
            session,
            kv_key,
            marker,
            slot,
        }) = self.armed.take()
        else {
            return;
        };
        let key = kv_key.clone();
        if !cleanups.spawn(cancel_attempt(http, session, kv_key, marker, slot)) {
            tracing::warn!(
                %key,
                "an acquire was abandoned outside a runtime; its lock, if taken, lasts until the client's session ends"
            );
        }
    }
}

async fn cancel_attempt(
    http: Arc<Http>,
    session: Arc<Session>,
    kv_key: String,
    marker: String,
    slot: SlotGuard,
) {
    let failures = CleanupFailures::new(BACKEND, &kv_key);
    // 1. The marker: the attempt's lock request, if it is still on its way, now fails. (If the
    //    session is gone, the request fails anyway and its keys went with it.)
    let marked = || write_marker(&http, &session.id, &marker);
    session
        .clean_up(&failures, "writing a cancelled attempt's marker", marked)
        .await;
    // 2. Undo the lock if the attempt took it: this client holds no other lease on the key (the
    //    claim is still ours), so a lock of our session on it is the attempt's.
    let undone = || undo_lock(&http, &session.id, &kv_key);
    session
        .clean_up(&failures, "removing a cancelled attempt's lock", undone)
        .await;
    drop(slot);
}

/// Why an acquire transaction was refused.
enum Refusal {
    Held,
    LockDelay,
    SessionGone,
    /// Refused only by the attempt's own marker: an earlier send in doubt (the one that wrote
    /// the marker) applied, and the attempt was undone since. Nothing of it is left: try again.
    Undone,
}

impl ConsulCoordinator {
    /// The state of this client's live lease on `key` (for the crate's tests).
    #[cfg(test)]
    pub(crate) fn lease_shared(&self, key: &LockKey) -> Option<Arc<LeaseShared>> {
        let kv_key = self.inner.config.kv_key(key);
        let lease = self.inner.sessions.peek()?.leases_on(&kv_key).pop()?;
        lease.as_any().downcast().ok()
    }

    fn holder_value(&self, options: &LeaseOptions) -> Vec<u8> {
        HolderRecord::new(options, &self.inner.default_owner).to_json()
    }

    /// `acquire` (`Some(wait)`) and `try_acquire` (`None`), with `options` validated: one `/v1/txn` round trip when the key is
    /// free (`check-not-exists` of the attempt marker, `lock`, `get`). Trying once, `Held` if
    /// another session holds the key (or its lock-delay runs); waiting, blocking queries on the
    /// key until it changes, backing off while a lock-delay holds, within `wait`.
    pub(crate) async fn acquire_for(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Box<dyn Lease>> {
        let inner = &self.inner;
        let start = Instant::now();
        let deadline = wait.map(|w| start + w);
        let timeout = || Error::Timeout {
            key: key.to_string(),
            waited: start.elapsed(),
        };
        let held = || Error::Held {
            key: key.to_string(),
        };
        let kv_key = inner.config.kv_key(key);
        let mut slot = match inner.slots.claim(&kv_key, deadline).await {
            Some(s) => Some(s),
            None if deadline.is_none() => return Err(held()),
            None => return Err(timeout()),
        };
        let value = self.holder_value(options);
        let mut index = 0u64;
        let mut retry = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        let mut raced = Backoff::new(Duration::from_millis(2), Duration::from_millis(200));
        let mut sessions_lost = 0;
        let mut rewritten = 0;
        let mut undone = 0;
        loop {
            let session = match inner.sessions.session().await {
                Ok(s) => s,
                Err(e) if e.is_retryable() && deadline.is_some_and(|d| Instant::now() < d) => {
                    nap(retry.next_delay(), deadline).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let attempt_id = format!("{:032x}", rand::random::<u128>());
            let marker = inner.config.attempt_key(&session.id, &attempt_id);
            let marker_name = marker.clone();
            let ops = [
                TxnOp::check_not_exists(&marker),
                TxnOp::lock(&kv_key, &session.id, &value),
                TxnOp::get(&kv_key),
            ];
            // A resend after a send in doubt also writes the attempt's marker: a delayed copy
            // of the first send then fails its check and cannot lock the key after the lease
            // is released.
            let on_resend = [TxnOp::lock(&marker, &session.id, b"")];
            let attempt = Attempt {
                armed: Some(Armed {
                    http: inner.http.clone(),
                    cleanups: inner.cleanups.clone(),
                    session: session.clone(),
                    kv_key: kv_key.clone(),
                    marker,
                    slot: slot.take().expect("the claim is held between attempts"),
                }),
            };
            let sent_at = Instant::now();
            // Safe to send again after its connection failed: a lock by our own session on a
            // key it already locks, with the same value, succeeds and changes nothing (Consul
            // skips a write equal to the entry: its `ModifyIndex` stays that of the first send's
            // lock, which created the key), so the grant's token is that `CreateIndex`. A
            // failure after a send in doubt cancels the attempt in the background; a refusal
            // after one settles it first (`Attempt::settle`).
            let (outcome, in_doubt) = inner
                .http
                .txn_resending(&ops, &on_resend, Op::write("acquire", true))
                .await;
            let refusal = match outcome {
                Ok(TxnOutcome::Committed(results)) => {
                    let Some(entry) = results
                        .into_iter()
                        .rev()
                        .find(|e| e.key == kv_key)
                        .filter(|e| e.holder() == Some(session.id.as_str()) && e.lock_index > 0)
                    else {
                        // Committed, so the lock is ours, but the answer does not show it: the
                        // armed attempt's cancellation deletes it (the claim is held until then).
                        drop(attempt);
                        return Err(crate::error::unreadable(
                            Op::write("acquire", true),
                            "the transaction did not return the lock",
                        ));
                    };
                    let claim = attempt.disarm();
                    if entry.create_index != entry.modify_index {
                        // The key existed (unlocked) before this lock: the token would not be
                        // its `CreateIndex`, which `inspect` reports. Delete it and lock again,
                        // so every lease's token is the `CreateIndex` of its own key.
                        rewritten += 1;
                        // The delete runs in its own task, which holds the claim until it is
                        // done: a caller that drops this future meanwhile leaves no lock behind.
                        let deleting =
                            self.delete_leftover(&kv_key, entry.modify_index, &session, claim);
                        let bound = deadline
                            .unwrap_or_else(Instant::now)
                            .max(Instant::now() + inner.http.request_timeout());
                        match tokio::time::timeout_at(bound, deleting).await {
                            Ok(Ok(claim)) if rewritten <= 3 => {
                                slot = Some(claim);
                                continue;
                            }
                            Ok(Ok(_)) => {
                                return Err(Error::unavailable(BACKEND, format!(
                                    "the Consul key of {key:?} keeps being rewritten by another writer"
                                )))
                            }
                            Ok(Err(_)) | Err(_) => {
                                return Err(Error::unavailable(BACKEND, format!(
                                    "could not remove a leftover value of {key:?} in time; it is removed in the background"
                                )))
                            }
                        }
                    }
                    return self
                        .granted(key, &kv_key, options, session, entry, sent_at, claim)
                        .await;
                }
                Ok(TxnOutcome::RolledBack(errors)) => {
                    slot = Some(if in_doubt {
                        attempt.settle().await?
                    } else {
                        attempt.disarm()
                    });
                    let all = errors.join("; ");
                    if in_doubt && errors.iter().all(|e| e.contains(marker_name.as_str())) {
                        Refusal::Undone
                    } else if all.contains("invalid session") {
                        Refusal::SessionGone
                    } else if all.contains("lock delay") {
                        Refusal::LockDelay
                    } else if all.contains("already held") {
                        Refusal::Held
                    } else {
                        return Err(crate::error::unreadable(Op::read("acquire"), all));
                    }
                }
                Err(e @ Error::OutcomeUnknown { .. }) => {
                    // Dropping the armed attempt cancels it in the background.
                    drop(attempt);
                    return Err(e);
                }
                Err(e) if in_doubt => {
                    // An error after a send in doubt that is not `OutcomeUnknown` (a refusal
                    // such as a 403): the earlier send may still apply; dropping the armed
                    // attempt cancels it in the background.
                    drop(attempt);
                    return Err(e);
                }
                Err(e) => {
                    // Every other error certainly applied nothing (`error.rs`): no lock to
                    // undo.
                    slot = Some(attempt.disarm());
                    if e.is_retryable() && deadline.is_some_and(|d| Instant::now() < d) {
                        nap(retry.next_delay(), deadline).await;
                        continue;
                    }
                    return Err(e);
                }
            };
            match refusal {
                Refusal::SessionGone => {
                    inner.sessions.ended(&session);
                    sessions_lost += 1;
                    if sessions_lost > 3 {
                        return Err(Error::unavailable(
                            BACKEND,
                            "Consul keeps invalidating new sessions",
                        ));
                    }
                    continue;
                }
                Refusal::Undone => {
                    undone += 1;
                    if undone > 3 {
                        return Err(Error::unavailable(
                            BACKEND,
                            format!(
                                "acquire of {key:?}: the connection kept failing after sending"
                            ),
                        ));
                    }
                    continue;
                }
                _ if deadline.is_none() => return Err(held()),
                _ if deadline.is_some_and(|d| Instant::now() >= d) => return Err(timeout()),
                Refusal::LockDelay => {
                    // Consul does not say how long the delay lasts: back off, bounded.
                    nap(retry.next_delay(), deadline).await;
                }
                Refusal::Held => {
                    let free = self
                        .wait_for_change(&kv_key, &mut index, deadline.expect("checked"))
                        .await?;
                    if free {
                        // Seen free, then refused: another contender won the race.
                        nap(raced.next_delay(), deadline).await;
                    }
                }
            }
        }
    }

    /// Blocks (Consul blocking queries on the key, from the last index seen) until the key looks
    /// free, or the deadline passes. Returns whether it was seen free. Transient errors are
    /// retried with backoff within the deadline.
    async fn wait_for_change(
        &self,
        kv_key: &str,
        index: &mut u64,
        deadline: Instant,
    ) -> Result<bool> {
        let inner = &self.inner;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let mut wait = (deadline - now).min(inner.config.max_block());
            // A blocking query takes one of the coordinator's waiting slots (a plain read, the
            // first, needs none).
            let _slot = if *index > 0 {
                match tokio::time::timeout_at(deadline, inner.waits.clone().acquire_owned()).await {
                    Err(_) => return Ok(false),
                    Ok(permit) => {
                        if inner.waits.available_permits() < MAX_WAITING_QUERIES / 4 {
                            wait = wait.min(BUSY_WAIT);
                        }
                        permit.ok()
                    }
                }
            } else {
                None
            };
            let block = (*index > 0).then_some((*index, wait));
            match tokio::time::timeout_at(deadline, inner.http.kv_get(kv_key, false, block, "wait"))
                .await
            {
                Err(_) => return Ok(false),
                Ok(Ok((new_index, entry))) => {
                    // An index that went backwards (a restore) restarts the watch. At least 1,
                    // as the monitor's: an answer without `X-Consul-Index` (a proxy that drops
                    // it) would otherwise make every later query return at once.
                    *index = if new_index < *index {
                        0
                    } else {
                        new_index.max(1)
                    };
                    if entry.as_ref().and_then(KvEntry::holder).is_none() {
                        return Ok(true);
                    }
                }
                Ok(Err(e)) if e.is_retryable() => {
                    *index = 0;
                    nap(backoff.next_delay(), Some(deadline)).await;
                }
                Ok(Err(e)) => return Err(e),
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn granted(
        &self,
        key: &LockKey,
        kv_key: &str,
        options: &LeaseOptions,
        session: Arc<Session>,
        entry: KvEntry,
        sent_at: Instant,
        slot: SlotGuard,
    ) -> Result<Box<dyn Lease>> {
        let inner = &self.inner;
        let raw = entry.modify_index;
        // Fail closed on an index that is not above the floor or above every token this process
        // was granted for the key on this agent (a snapshot restore), and leave no lock behind.
        let token = match inner.tokens.admit(key, raw) {
            Ok(t) => t,
            Err(e) => {
                self.release_detached(kv_key, raw, &session, slot);
                return Err(e);
            }
        };
        let ttl = options.ttl_value();
        let margin = options.drift_margin_for(ttl);
        let tracker = LeaseTracker::new(BACKEND, key.clone(), token, ttl, margin, sent_at);
        let session_until = session.valid_until();
        if session_until <= Instant::now() {
            self.release_detached(kv_key, raw, &session, slot);
            return Err(Error::unavailable(
                BACKEND,
                "the client's Consul session has not been renewed recently",
            ));
        }
        // The lease's own deadline, before the session caps it.
        let own_until = tracker.valid_until();
        if session_until < own_until {
            tracker.renewed(session_until);
        }
        let shared = Arc::new(LeaseShared::new(
            fresh_id(),
            kv_key.to_owned(),
            inner.config.audit_key(key),
            tracker,
            own_until,
            session.clone(),
            inner.sessions.clone(),
            inner.http.clone(),
            inner.confirmer.clone(),
            inner.monitor.clone(),
            inner.cleanups.clone(),
            slot,
        ));
        if !session.register(shared.id, Arc::downgrade(&shared) as Weak<dyn SessionLease>) {
            shared.tracker.mark_lost(LostReason::SessionEnded);
            return Err(ended_during_acquire(BACKEND));
        }
        start_guardian(shared.clone());
        inner
            .monitor
            .watch(shared.id, Arc::downgrade(&shared) as Weak<dyn Watched>);
        Ok(Box::new(ConsulLease { shared }))
    }

    /// Deletes a lock this client just took but will not hand out ([`delete_own_lock`]), in the
    /// background, keeping the claim until done.
    fn release_detached(&self, kv_key: &str, index: u64, session: &Arc<Session>, slot: SlotGuard) {
        let http = self.inner.http.clone();
        let (kv_key, session) = (kv_key.to_owned(), session.clone());
        self.inner.cleanups.spawn(async move {
            let failures = CleanupFailures::new(BACKEND, &kv_key);
            let op = Op::write("release", false);
            let released = || delete_own_lock(&http, &session.id, &kv_key, Some(index), op);
            session
                .clean_up(&failures, "releasing a lock not handed out", released)
                .await;
            drop(slot);
        });
    }

    /// Deletes a key this client has just locked but will not hand out as it is (it held a
    /// leftover value) ([`delete_own_lock`]), retrying until done or the session is gone; the
    /// task keeps the claim and returns it.
    fn delete_leftover(
        &self,
        kv_key: &str,
        index: u64,
        session: &Arc<Session>,
        claim: SlotGuard,
    ) -> tokio::task::JoinHandle<SlotGuard> {
        let http = self.inner.http.clone();
        let (kv_key, session) = (kv_key.to_owned(), session.clone());
        // Counted: an acquire dropped while it waits for this leaves it running.
        let pending = self.inner.cleanups.begin();
        tokio::spawn(async move {
            let _pending = pending;
            let failures = CleanupFailures::new(BACKEND, &kv_key);
            let op = Op::write("acquire", false);
            let deleted = || delete_own_lock(&http, &session.id, &kv_key, Some(index), op);
            session
                .clean_up(&failures, "deleting a leftover value", deleted)
                .await;
            claim
        })
    }
}
