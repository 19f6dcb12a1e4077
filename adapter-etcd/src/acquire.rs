//! The acquire recipe on etcd: a session per TTL, the key the attempt writes (retired if the
//! attempt does not hand it to a lease), `try_acquire`'s one transaction and `acquire`'s queue
//! (FIFO by create revision, each waiter seeing the keys ahead of its own deleted on the lock's
//! shared range watch), and the grant.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
};
use lease_core::adapter::{
    clock, ended_during_acquire, Backoff, Cleanups, HolderRecord, LeaseTracker, Op, PendingCleanup,
    SharedOpening,
};
use lease_core::{
    Error, InvalidInput, Lease, LeaseOptions, LeaseStatus, LockKey, LostReason, Result, Token,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::coordinator::EtcdCoordinator;
use crate::core::Inner;
use crate::error::{retry_resendable, retry_unapplied, Failure, BACKEND};
use crate::keys::{self, Slot};
use crate::lease::EtcdLease;
use crate::session::{Cleaner, Cleanup, Session, Unconfirmed};
use crate::watch::{Lock, Range};

/// A waiter's or holder's key that must not outlive the attempt unless handed to a lease:
/// dropping it armed queues its deletion. Until the request that writes it was answered
/// (`revision` unknown), the deletion also writes the attempt's `marker`, which the request
/// requires to be absent, so a request applied late writes nothing.
///
/// A waiter whose session ended queues again with its key still armed: etcd removes with the
/// lease only the keys still on it, and a write from outside without the lease detaches a key,
/// which would otherwise stay in the queue, ahead of every later attempt, for good. The deletion
/// compares the key's create revision, so a key already gone (or a newer one by that name) is
/// left alone, at the cost of one request.
struct PendingKey {
    cleaner: Cleaner,
    key: String,
    /// The slot of `key`'s name, held until no key by that name can exist or still be written.
    slot: Slot,
    /// Written by the attempt's cleanup ([`keys::abandoned_key`]).
    marker: String,
    /// Written by `try_acquire`'s resends ([`keys::resent_key`]): not the cleanup's `marker`,
    /// whose presence tells the cleanup that it already ran.
    resent: String,
    revision: Option<i64>,
    session: Arc<Session>,
    armed: bool,
}

impl Drop for PendingKey {
    fn drop(&mut self) {
        if self.armed {
            let state = self.session.watch_state();
            self.cleaner.delete(
                match self.revision {
                    Some(rev) => Cleanup::created(self.key.clone(), rev, state),
                    None => Cleanup::abandoned(
                        self.key.clone(),
                        self.marker.clone(),
                        self.session.id(),
                        state,
                    ),
                }
                .holding(self.slot.clone()),
            );
        }
    }
}

/// Counts a waiting acquire whose caller gave up among the coordinator's cleanups, from the
/// caller's drop until the attempt's task ends: the task notices only then, and deletes our key
/// ([`PendingKey`]), and `settle` must not return in between.
struct GivenUp {
    cleanups: Cleanups,
    /// Shared with the task; holds the count once the caller gave up.
    counted: Arc<std::sync::Mutex<Option<PendingCleanup>>>,
    armed: bool,
}

impl GivenUp {
    fn new(cleanups: Cleanups) -> Self {
        GivenUp {
            cleanups,
            counted: Arc::default(),
            armed: true,
        }
    }

    /// The caller got its answer: nothing was given up.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for GivenUp {
    fn drop(&mut self) {
        if self.armed {
            // Kept until the task drops its clone; dropped at once (with this last clone) if
            // the task has ended already.
            *self.counted.lock().unwrap_or_else(|p| p.into_inner()) = Some(self.cleanups.begin());
        }
    }
}

/// A waiter's place in the queue: the lock's range, our key, and its create revision.
struct Queue<'a> {
    prefix: &'a str,
    own: &'a str,
    revision: i64,
}

/// What a read of the queue up to our key showed.
#[derive(Debug, Clone)]
enum Ahead {
    /// Our key is gone (the session ended, or someone deleted it).
    Gone,
    /// These keys are ahead of ours, nearest first; `all`: no other key is (the read was not cut
    /// off at [`QUEUE_READ`]).
    Keys { keys: Vec<Vec<u8>>, all: bool },
}

impl Ahead {
    /// From the newest keys up to ours ([`QUEUE_READ`] at most, newest first).
    fn of(own: &str, kvs: &[KeyValue]) -> Ahead {
        match kvs.first() {
            Some(kv) if kv.key() == own.as_bytes() => Ahead::Keys {
                keys: kvs[1..].iter().map(|kv| kv.key().to_vec()).collect(),
                all: (kvs.len() as i64) < QUEUE_READ,
            },
            _ => Ahead::Gone,
        }
    }

    /// Whether a key was ahead of ours: the lock was held (or about to be) by someone else.
    fn busy(&self) -> bool {
        matches!(self, Ahead::Keys { keys, all } if !keys.is_empty() || !*all)
    }
}

/// The last read of the queue: at which revision, when it was sent (our key existed then), and
/// what it showed.
struct Read {
    revision: i64,
    sent: Instant,
    ahead: Ahead,
    /// The keys ahead of ours with no lease (see [`Detached`]).
    detached: Vec<Detached>,
}

/// A key in a lock's queue with no lease: a write from outside without the lease detached it
/// from the session that created it, so etcd never removes it, and unless that session's owner
/// attaches it again (its guardian does, for as long as it runs) it stays ahead of every later
/// attempt for good. Its name says which session created it ([`keys::session_lease_of`]); once
/// that session is over, nobody holds or waits on it (a holder's validity and a waiter's place
/// end with their session), and [`Inner::clear_orphans`] deletes it. A waiter reads its queue
/// again once per session TTL however long it waits, so a key detached after its read (whose
/// deletion never comes) is found there too.
#[derive(Debug, Clone)]
struct Detached {
    key: Vec<u8>,
    create_revision: i64,
    /// The lease of the session that created the key.
    session_lease: i64,
}

impl Detached {
    /// The keys of `kvs` (a read of the lock at `prefix`) other than `own` that have no lease
    /// and are named as this adapter names them.
    fn among(prefix: &str, own: &str, kvs: &[KeyValue]) -> Vec<Detached> {
        kvs.iter()
            .filter(|kv| kv.lease() == 0 && kv.key() != own.as_bytes())
            .filter_map(|kv| {
                Some(Detached {
                    key: kv.key().to_vec(),
                    create_revision: kv.create_revision(),
                    session_lease: keys::session_lease_of(prefix, kv.key())?,
                })
            })
            .collect()
    }
}

/// How a wait for our turn ended.
enum Wait {
    /// Every key ahead of ours at the last read is gone, none is left: ours is first.
    Ready,
    /// The lock's range watch showed every key ahead of ours at the last read deleted, the last
    /// at this revision, and ours not: ours is first, no re-read needed.
    First(i64),
    /// The watch showed our key deleted.
    Gone,
    /// Read the queue again: the watch's coverage starts after the last read, the keys we knew
    /// are gone but the read was cut off, or the session ended.
    Recheck,
    /// The lock's watch ended (compaction, the server cancelled it): join a new one and read.
    Ended,
    /// The caller dropped the acquire future.
    Cancelled,
    /// The wait bound passed.
    Deadline,
}

/// The session TTL for a requested lease TTL: whole seconds, rounded up.
fn ttl_secs(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    secs.max(1) as i64
}

fn holder_record(inner: &Inner, options: &LeaseOptions) -> Vec<u8> {
    HolderRecord::new(options, &inner.owner).to_json()
}

fn header_revision(h: Option<&etcd_client::ResponseHeader>) -> i64 {
    h.map_or(0, |h| h.revision())
}

/// `try_acquire`'s transaction: put our key (attached to the session) if the lock has no key
/// at all and the attempt was not abandoned (its marker is absent); otherwise read our own key,
/// which exists only if an earlier send of this attempt applied (the name's slot is ours while
/// the attempt runs), so the transaction can be sent again after a connection reset.
///
/// A resend (`in_doubt`) writes the attempt's resend marker ([`keys::resent_key`]), which every
/// send requires to be absent, whichever branch it takes: a delayed copy of any earlier send
/// (forwarded by a member, say) then writes nothing, even after our lease is released. Written
/// also when the resend finds our key (made by one earlier send) or the lock held: another
/// earlier send may still be on its way. It is not the cleanup's marker: a resend applied
/// without an answer must still leave the cleanup free to delete the key it created.
fn try_txn(prefix: &str, pending: &PendingKey, record: &[u8], in_doubt: bool) -> Txn {
    let attached = || Some(PutOptions::new().with_lease(pending.session.id()));
    let mut writes = vec![TxnOp::put(pending.key.clone(), record, attached())];
    let mut reads = vec![
        TxnOp::get(pending.key.clone(), None),
        // The holder (the oldest key): if it has no lease, maybe an orphan to delete.
        TxnOp::get(
            prefix,
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_sort(SortTarget::Create, SortOrder::Ascend)
                    .with_limit(1)
                    .with_keys_only(),
            ),
        ),
    ];
    if in_doubt {
        writes.push(TxnOp::put(pending.resent.clone(), "", attached()));
        reads.push(TxnOp::put(pending.resent.clone(), "", attached()));
    }
    Txn::new()
        .when([
            Compare::version(prefix, CompareOp::Equal, 0).with_prefix(),
            Compare::create_revision(pending.marker.clone(), CompareOp::Equal, 0),
            Compare::create_revision(pending.resent.clone(), CompareOp::Equal, 0),
        ])
        .and_then(writes)
        .or_else(reads)
}

/// How many of the queue's newest keys, up to ours, a waiter reads: its own and up to 31 ahead of
/// it (keys only). A waiter that read every key ahead of its own knows it is first once the lock's
/// range watch has shown each of them deleted, without a read; one further back reads again when
/// the keys it read are gone.
const QUEUE_READ: i64 = 32;

/// `acquire`'s transaction, one round trip: unless the attempt was abandoned (its marker
/// exists), create our key (attached to the session) and read the newest keys of the queue
/// ([`QUEUE_READ`]): ours and those just before it, if any.
fn enqueue_txn(prefix: &str, pending: &PendingKey, record: &[u8]) -> Txn {
    let queue = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Descend)
        .with_limit(QUEUE_READ)
        .with_keys_only();
    Txn::new()
        .when([
            Compare::create_revision(pending.key.clone(), CompareOp::Equal, 0),
            Compare::create_revision(pending.marker.clone(), CompareOp::Equal, 0),
        ])
        .and_then([
            TxnOp::put(
                pending.key.clone(),
                record,
                Some(PutOptions::new().with_lease(pending.session.id())),
            ),
            TxnOp::get(prefix, Some(queue)),
        ])
}

impl Inner {
    /// The live session for `secs`, granting one if there is none (or it ended, or its grant
    /// failed). Every caller asking while a grant is under way awaits that one: one request,
    /// and a failure reaches them all at once, each within one request timeout of asking.
    async fn session(&self, secs: i64) -> Result<Arc<Session>> {
        let slot = {
            let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            let slot = sessions.entry(secs);
            slot.or_insert_with(|| Arc::new(SharedOpening::new(BACKEND)))
                .clone()
        };
        slot.get(
            |s| !s.is_dead(),
            || {
                let (client, timeout) = (self.handle.client.clone(), self.timeout());
                async move {
                    let session = Session::grant(&client, secs, timeout)
                        .await
                        .map_err(|f| f.into_error(Op::read("grant session lease")))?;
                    let asked = Duration::from_secs(secs.unsigned_abs());
                    if session.ttl() > asked {
                        // etcd raised the TTL to its minimum, which depends on the cluster's
                        // election timeout: a lease longer than asked would keep others waiting
                        // after a crash longer than the caller agreed to. (Dropping the session
                        // revokes its lease.)
                        return Err(InvalidInput::TtlBelowMinimum {
                            ttl: asked,
                            min: session.ttl(),
                            backend: BACKEND,
                        }
                        .into());
                    }
                    Ok(session)
                }
            },
        )
        .await
    }

    /// The session for `secs` if one was granted and has not ended (for tests).
    #[cfg(test)]
    pub(crate) fn live_session(&self, secs: i64) -> Option<Arc<Session>> {
        let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.get(&secs)?.current(|s| !s.is_dead())
    }

    /// A new attempt on `lock` in `session`: its own key under `prefix`, and its marker.
    fn pending(&self, lock: &LockKey, prefix: &str, session: &Arc<Session>) -> PendingKey {
        let attempt = self.attempts.fetch_add(1, Ordering::Relaxed);
        let slot = self.slots.take(keys::own_key(prefix, session.id(), 0));
        let marker =
            keys::abandoned_key(self.handle.config.key_prefix(), lock, session.id(), attempt);
        PendingKey {
            cleaner: self.handle.cleaner.clone(),
            key: keys::own_key(prefix, session.id(), slot.number()),
            slot,
            resent: keys::resent_key(&marker),
            marker,
            revision: None,
            session: session.clone(),
            armed: true,
        }
    }

    /// The state of a lease granted `token` whose ownership was confirmed by a request sent at
    /// `confirmed_sent`: validity counts from the earlier of that send and the session's last
    /// acknowledged keepalive. Its `status()` says whether that validity is still running.
    fn tracker(
        &self,
        session: &Session,
        key: &LockKey,
        token: Token,
        options: &LeaseOptions,
        confirmed_sent: Instant,
    ) -> LeaseTracker {
        let ttl = session.ttl();
        let margin = options.drift_margin_for(ttl);
        let from = confirmed_sent.min(session.acked_sent());
        LeaseTracker::new(BACKEND, key.clone(), token, ttl, margin, from)
    }

    /// When the validity of a grant confirmed by a request sent at `confirmed_sent` ends, as
    /// [`Inner::tracker`] counts it. Checked before the tracker is made: a tracker whose
    /// validity has passed records a loss (a metric, a warning) for a lease nobody held.
    fn valid_until(
        &self,
        session: &Session,
        options: &LeaseOptions,
        confirmed_sent: Instant,
    ) -> Instant {
        let ttl = session.ttl();
        let from = confirmed_sent.min(session.acked_sent());
        clock::valid_until(from, ttl, options.drift_margin_for(ttl))
    }

    /// Builds the lease for a granted key, with the tracker of [`Inner::tracker`] (its
    /// validity checked to be running by the caller, [`Inner::valid_until`]).
    fn grant(
        self: &Arc<Self>,
        session: Arc<Session>,
        pending: &PendingKey,
        revision: i64,
        tracker: LeaseTracker,
        watch_from: i64,
    ) -> Result<EtcdLease> {
        let lease = EtcdLease::start(
            self.handle.clone(),
            session,
            pending.key.clone(),
            pending.slot.clone(),
            revision,
            tracker,
            watch_from,
        );
        if let LeaseStatus::Lost(_) = lease.state().status() {
            // The session ended between the grant and the lease's registration: its key goes
            // with it, and the caller gets no lease, as from an unreachable server.
            return Err(ended_during_acquire(BACKEND));
        }
        Ok(lease)
    }

    /// `try_acquire`: one transaction that creates our key only if the lock has no key at all
    /// (no holder and no waiter), so nothing is written when it is busy.
    async fn try_once(
        self: &Arc<Self>,
        key: &LockKey,
        options: &LeaseOptions,
    ) -> Result<EtcdLease> {
        let prefix = keys::lock_prefix(self.handle.config.key_prefix(), key);
        let secs = ttl_secs(options.ttl_value());
        let record = holder_record(self, options);
        // Sends with a new session after the last one's lease was found gone, and once more
        // after an orphaned holder was deleted (each has its own budget).
        let (mut lease_gone, mut orphaned_before) = (0, false);
        while lease_gone < 3 {
            let session = self.session(secs).await?;
            let mut pending = self.pending(key, &prefix, &session);
            // Validity counts from the first send, which may be the one that applied.
            let sent = Instant::now();
            let txns = &self.handle.txns;
            let (resp, in_doubt) = retry_resendable(self.timeout(), |in_doubt| {
                let txn = try_txn(&prefix, &pending, &record, in_doubt);
                txns.send(&prefix, txn)
            })
            .await;
            let resp = match resp {
                Ok(r) => r,
                Err(f) if f.is_lease_not_found() => {
                    lease_gone += 1;
                    pending.armed = false;
                    session.mark_dead(LostReason::SessionEnded);
                    continue;
                }
                // The request may still apply: `pending` retires the attempt in the background
                // (its marker makes a late transaction write nothing).
                Err(f) => {
                    let op = Op::write("try_acquire", true);
                    let e = f.into_error(op);
                    return Err(if in_doubt { op.after_doubt(e) } else { e });
                }
            };
            let revision = if resp.succeeded {
                // Our key's create revision is the transaction's revision.
                resp.revision
            } else {
                // Our own key exists only if an earlier send in doubt created it.
                match resp.range(0).first() {
                    Some(ours) if in_doubt && ours.lease() == session.id() => {
                        ours.create_revision()
                    }
                    _ => {
                        // After a send in doubt, `pending` stays armed: a delayed copy of it
                        // (forwarded by a member, say) could still create our key, which the
                        // background retirement then deletes.
                        pending.armed = in_doubt;
                        let mut orphans = Detached::among(&prefix, &pending.key, resp.range(1));
                        if !orphans.is_empty() && !orphaned_before {
                            // A holder nobody holds any more: try again once it is deleted.
                            orphaned_before = true;
                            if self.clear_orphans(&mut orphans).await.is_none() {
                                continue;
                            }
                        }
                        return Err(Error::Held {
                            key: key.to_string(),
                        });
                    }
                }
            };
            pending.revision = Some(revision);
            let token = self.tokens.admit(key, revision)?;
            if self.valid_until(&session, options, sent) <= Instant::now() {
                // The answer came after the validity it grants had ended (a round trip longer
                // than the TTL minus the drift margin): never hand out such a lease. `pending`
                // stays armed, so the key is deleted in the background.
                return Err(Error::unavailable(
                    BACKEND,
                    format!(
                        "try_acquire: the grant arrived {:?} after it was sent, after its local \
                         validity had ended (TTL {:?} minus drift margin {:?})",
                        sent.elapsed(),
                        session.ttl(),
                        options.drift_margin_for(session.ttl())
                    ),
                ));
            }
            let tracker = self.tracker(&session, key, token, options, sent);
            pending.armed = false;
            return self.grant(session, &pending, revision, tracker, revision + 1);
        }
        Err(Error::unavailable(
            BACKEND,
            "try_acquire: the session lease kept disappearing",
        ))
    }

    /// `acquire` with a wait: queue our key, then wait for the deletion of every key ahead.
    async fn acquire_queued(
        self: &Arc<Self>,
        key: &LockKey,
        options: &LeaseOptions,
        start: Instant,
        deadline: Instant,
        caller: &mut oneshot::Sender<Result<EtcdLease>>,
    ) -> Result<EtcdLease> {
        let prefix = keys::lock_prefix(self.handle.config.key_prefix(), key);
        let secs = ttl_secs(options.ttl_value());
        let record = holder_record(self, options);
        let timeout = self.timeout();
        // `Timeout` only when a read showed the key busy (decision 0036): a wait that ended
        // while its place in the queue kept going (our session or key gone, a request failing)
        // never showed it.
        let mut seen_busy = false;
        let timed_out = |seen_busy: bool| {
            if seen_busy {
                Error::Timeout {
                    key: key.to_string(),
                    waited: start.elapsed(),
                }
            } else {
                Error::unavailable(
                    BACKEND,
                    format!(
                        "acquire: the wait ended after {:?} before a place in {key}'s queue was \
                         kept (our session or key went, or a request failed); the key was not \
                         seen busy",
                        start.elapsed()
                    ),
                )
            }
        };
        let mut lease_gone = 0;
        // Backoff between attempts that failed on a transient error (see `retry_within`).
        let mut retry = Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
        let mut queued_before = false;
        'enqueue: loop {
            // Queueing again (our key or session went) is not done past the wait bound: a grant
            // there would come after the caller's deadline.
            if caller.is_closed() || (queued_before && Instant::now() >= deadline) {
                return Err(timed_out(seen_busy));
            }
            queued_before = true;
            let session = match self.session(secs).await {
                Ok(s) => s,
                Err(e) => {
                    retry_within(e, &mut retry, deadline, caller).await?;
                    continue 'enqueue;
                }
            };
            let mut pending = self.pending(key, &prefix, &session);
            let own = pending.key.clone();
            let txn = enqueue_txn(&prefix, &pending, &record);
            let sent = Instant::now();
            let txns = &self.handle.txns;
            let resp = match retry_unapplied(timeout, || txns.send(&prefix, txn.clone())).await {
                Ok(r) => r,
                Err(f) if f.is_lease_not_found() && lease_gone < 3 => {
                    lease_gone += 1;
                    pending.armed = false;
                    session.mark_dead(LostReason::SessionEnded);
                    continue;
                }
                // As in `try_once`: `pending` retires the attempt (a late application writes
                // nothing); a transient failure is tried again with a new attempt within the
                // wait bound.
                Err(f) => {
                    retry_within(
                        f.into_error(Op::write("acquire", false)),
                        &mut retry,
                        deadline,
                        caller,
                    )
                    .await?;
                    continue 'enqueue;
                }
            };
            if !resp.succeeded {
                // Our attempt's key already exists: impossible while its slot is held for as
                // long as a key by its name may exist. Should it happen, that slot stays taken
                // for the life of the session (a key by its name exists), so every later attempt
                // gets another name.
                pending.armed = false;
                std::mem::forget(pending.slot.clone());
                continue;
            }
            tracing::debug!(%key, %own, "etcd waiter's key written: in the queue");
            let kvs = resp.range(1);
            let mut last = Read {
                revision: resp.revision,
                sent,
                ahead: Ahead::of(&own, kvs),
                detached: Detached::among(&prefix, &own, kvs),
            };
            seen_busy |= last.ahead.busy();
            let (Some(mine), false) = (kvs.first(), matches!(last.ahead, Ahead::Gone)) else {
                return Err(Error::unavailable(
                    BACKEND,
                    "acquire: the queue read did not show our own key",
                ));
            };
            let revision = mine.create_revision();
            pending.revision = Some(revision);
            // Fail fast on a revision that cannot be handed out; admitted when granted.
            let token = self.tokens.check(key, revision)?;
            let queue = Queue {
                prefix: &prefix,
                own: &own,
                revision,
            };
            // Our turn was proven by the range watch, not by a read of ours (see below).
            let mut by_turn = false;
            let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
            // Joined once a key is ahead of ours (an uncontended acquire sends no watch).
            let mut watch: Option<Lock> = None;
            // When to look again at keys ahead with no lease whose session still lives (`None`:
            // at once, after each read that shows some).
            let mut orphans_at: Option<Instant> = None;
            loop {
                if !last.detached.is_empty() && orphans_at.is_none_or(|t| Instant::now() >= t) {
                    // Their deletion reaches the wait below as any other. Within the wait
                    // bound: past it, the wait below reports the deadline.
                    let orphans = self.clear_orphans(&mut last.detached);
                    orphans_at = tokio::select! {
                        _ = caller.closed() => return Err(timed_out(seen_busy)),
                        next = tokio::time::timeout_at(deadline, orphans) => next.unwrap_or(None),
                    };
                }
                // However long the wait, the queue is read again once per session TTL: a key
                // ahead that a write from outside detached after our read never goes, and its
                // session's end is not an event the watch delivers (see `Detached`). The read
                // shows it with no lease.
                // (At least half a TTL from now: a read slower than the TTL does not make
                // the next one follow at once.)
                let reread_at = (last.sent + session.ttl()).max(Instant::now() + session.ttl() / 2);
                let recheck_at = match orphans_at.filter(|_| !last.detached.is_empty()) {
                    Some(at) => at.min(reread_at),
                    None => reread_at,
                };
                let wait = match &last.ahead {
                    Ahead::Keys { keys, all: true } if keys.is_empty() => Wait::Ready,
                    _ => {
                        let lock = watch.get_or_insert_with(|| {
                            self.handle.watcher.lock(prefix.as_bytes().to_vec())
                        });
                        self.wait_turn(
                            &session, &queue, lock, &mut last, deadline, recheck_at, caller,
                        )
                        .await
                    }
                };
                match wait {
                    Wait::Ready => break,
                    Wait::First(revision) => {
                        // Every deletion in the range up to `revision` was seen: ours is not
                        // among them, so our key exists and nothing is ahead of it.
                        last.revision = revision;
                        by_turn = true;
                        break;
                    }
                    Wait::Gone => last.ahead = Ahead::Gone,
                    Wait::Recheck | Wait::Ended => {
                        if session.is_dead() {
                            // Our key goes with the session, but maybe only at the server's
                            // expiry of its lease (a revoke that could not be sent): queue again
                            // on a new session now, rather than re-read a queue that still shows
                            // our key, with nothing more to wait for, until then. `pending` stays
                            // armed (see `PendingKey`).
                            tracing::debug!(key = %key, "etcd waiter's session ended; queueing again");
                            if Instant::now() >= deadline {
                                return Err(timed_out(seen_busy));
                            }
                            continue 'enqueue;
                        }
                        if let Wait::Ended = wait {
                            // Join a new watch before the read, so its start is likely before it.
                            watch = Some(self.handle.watcher.lock(prefix.as_bytes().to_vec()));
                        }
                        // Re-read the part of the queue up to our key: ours must still be there
                        // (a waiter whose session ended must not report acquired), and the keys
                        // below ours are the ones to see go.
                        let read = tokio::select! {
                            _ = caller.closed() => return Err(timed_out(seen_busy)),
                            _ = tokio::time::sleep_until(deadline) => {
                                self.delete_now(&mut pending).await;
                                return Err(timed_out(seen_busy));
                            }
                            read = self.read_queue(&queue) => read,
                        };
                        match read {
                            Ok(read) => {
                                last = read;
                                seen_busy |= last.ahead.busy();
                                orphans_at = None;
                            }
                            Err(f) => {
                                tracing::debug!(key = %key, error = %f, "etcd waiter could not re-read its queue; retrying");
                                tokio::select! {
                                    _ = caller.closed() => return Err(timed_out(seen_busy)),
                                    _ = tokio::time::sleep_until(deadline) => {
                                        self.delete_now(&mut pending).await;
                                        return Err(timed_out(seen_busy));
                                    }
                                    _ = backoff.sleep() => {}
                                }
                                continue;
                            }
                        }
                        backoff.reset();
                    }
                    Wait::Cancelled => return Err(timed_out(seen_busy)),
                    Wait::Deadline => {
                        self.delete_now(&mut pending).await;
                        return Err(timed_out(seen_busy));
                    }
                }
                if let Ahead::Gone = last.ahead {
                    tracing::debug!(key = %key, "etcd waiter's key vanished (session ended or deleted); queueing again");
                    pending.armed = false;
                    if Instant::now() >= deadline {
                        return Err(timed_out(seen_busy));
                    }
                    continue 'enqueue;
                }
            }
            drop(watch);
            let mut confirmed_sent = last.sent;
            if session.is_dead() {
                // Our key went with the session (or is about to): queue again, `pending` armed
                // (see `PendingKey`).
                continue 'enqueue;
            }
            self.tokens.admit(key, revision)?;
            // Never return a lease whose validity already ended (a slow last read, a session
            // whose last acknowledged keepalive is old): confirm again, a keepalive and a read of
            // our key in one round trip, until the validity it gives is still running when the
            // answer arrives, or the wait bound passes.
            //
            // A turn proven by the range watch counts the validity from the last read (the
            // enqueue, typically): after a long wait that leaves little of it, so unless at least
            // half the TTL is left, it is confirmed first, like an expired one.
            loop {
                let until = self.valid_until(&session, options, confirmed_sent);
                let now = Instant::now();
                let left = until.saturating_duration_since(now);
                let fresh = !by_turn || left * 2 >= session.ttl() || now >= deadline;
                if until > now && fresh {
                    let tracker = self.tracker(&session, key, token, options, confirmed_sent);
                    pending.armed = false;
                    // The guardian watches our key from its creation, not from this read: a
                    // write while it waited (one without the lease detaches it from the session)
                    // is seen and undone as after the grant; the range watch ignores puts.
                    return self.grant(session, &pending, revision, tracker, revision + 1);
                }
                if Instant::now() >= deadline {
                    self.delete_now(&mut pending).await;
                    return Err(timed_out(seen_busy));
                }
                let sent3 = Instant::now();
                let kv = self.handle.client.clone();
                let (confirmed, read) = tokio::select! {
                    _ = caller.closed() => return Err(timed_out(seen_busy)),
                    _ = tokio::time::sleep_until(deadline) => {
                        self.delete_now(&mut pending).await;
                        return Err(timed_out(seen_busy));
                    }
                    r = async {
                        tokio::join!(
                            session.confirm(sent3, timeout),
                            retry_unapplied(timeout, || {
                                let (mut kv, own) = (kv.clone(), own.clone());
                                async move { kv.get(own, None).await }
                            }),
                        )
                    } => r,
                };
                let ours = match &read {
                    Ok(g) => Some(
                        g.kvs()
                            .first()
                            .is_some_and(|kv| kv.create_revision() == revision),
                    ),
                    Err(_) => None,
                };
                match (confirmed, ours) {
                    (_, Some(false)) => {
                        tracing::debug!(key = %key, "etcd grant could not be confirmed: our key is gone; queueing again");
                        pending.armed = false;
                        continue 'enqueue;
                    }
                    (Err(Unconfirmed::Dead(_)), _) => {
                        // `pending` stays armed (see `PendingKey`).
                        tracing::debug!(key = %key, "etcd grant could not be confirmed: our session is gone; queueing again");
                        continue 'enqueue;
                    }
                    (Ok(()), Some(true)) => {
                        confirmed_sent = sent3;
                        by_turn = false;
                    }
                    _ => {
                        tokio::select! {
                            _ = caller.closed() => return Err(timed_out(seen_busy)),
                            _ = tokio::time::sleep_until(deadline) => {}
                            _ = backoff.sleep() => {}
                        }
                    }
                }
            }
        }
    }

    /// Waits, on the lock's range watch `lock` (every deletion in the range, shared by this
    /// coordinator's waiters of the lock), until every key ahead of ours at `last`'s read is
    /// deleted. [`Lock::from`] is the revision after which the watch delivers every deletion,
    /// once it has told it: when that is after `last`'s read, the deletions in between are not
    /// delivered, and the wait asks for one more read ([`Wait::Recheck`]). Deletions at or
    /// before `last`'s read are already in it. The session ending also ends the wait (our key
    /// went with it): the re-read then queues again. `recheck_at` passing also asks for a read
    /// (keys with no lease ahead to look at again, or the periodic read, see [`Detached`]).
    #[allow(clippy::too_many_arguments)]
    async fn wait_turn(
        &self,
        session: &Session,
        queue: &Queue<'_>,
        lock: &mut Lock,
        last: &mut Read,
        deadline: Instant,
        recheck_at: Instant,
        caller: &mut oneshot::Sender<Result<EtcdLease>>,
    ) -> Wait {
        if lock.from().is_some_and(|f| f > last.revision) {
            return Wait::Recheck;
        }
        let mut state = session.watch_state();
        let dead = state.wait_for(|s| s.dead.is_some());
        tokio::pin!(dead);
        loop {
            match &last.ahead {
                Ahead::Gone => return Wait::Gone,
                Ahead::Keys { keys, all } if keys.is_empty() => {
                    return if *all { Wait::Ready } else { Wait::Recheck };
                }
                Ahead::Keys { .. } => {}
            }
            let event = tokio::select! {
                _ = caller.closed() => return Wait::Cancelled,
                _ = tokio::time::sleep_until(deadline) => return Wait::Deadline,
                _ = &mut dead => return Wait::Recheck,
                _ = tokio::time::sleep_until(recheck_at) => return Wait::Recheck,
                event = lock.next() => event,
            };
            match event {
                Range::From(start) => {
                    if start > last.revision {
                        return Wait::Recheck;
                    }
                }
                Range::Deleted(deleted) => {
                    let Ahead::Keys { keys, all } = &mut last.ahead else {
                        return Wait::Gone;
                    };
                    let mut emptied_at = None;
                    for (key, revision) in deleted.iter().filter(|(_, r)| *r > last.revision) {
                        // Ours deleted (also in the same revision as the last key ahead, as by a
                        // prefix delete): never granted on a key that is gone.
                        if key.as_slice() == queue.own.as_bytes() {
                            return Wait::Gone;
                        }
                        let before = keys.len();
                        keys.retain(|k| k != key);
                        if keys.is_empty() && before > 0 {
                            emptied_at = Some(*revision);
                        }
                    }
                    if let (Some(revision), true) = (emptied_at, *all) {
                        return Wait::First(revision);
                    }
                }
                Range::Ended => return Wait::Ended,
            }
        }
    }

    /// Reads the queue up to our key: whether ours is still there, and what is ahead of it.
    async fn read_queue(&self, queue: &Queue<'_>) -> Result<Read, Failure> {
        let upto = GetOptions::new()
            .with_prefix()
            .with_max_create_revision(queue.revision)
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(QUEUE_READ)
            .with_keys_only();
        let sent = Instant::now();
        let client = &self.handle.client;
        let mut got = retry_unapplied(self.timeout(), || {
            let (mut kv, prefix, upto) = (client.clone(), queue.prefix.to_owned(), upto.clone());
            async move { kv.get(prefix, Some(upto)).await }
        })
        .await?;
        let kvs = got.take_kvs();
        Ok(Read {
            revision: header_revision(got.header()),
            sent,
            ahead: Ahead::of(queue.own, &kvs),
            detached: Detached::among(queue.prefix, queue.own, &kvs),
        })
    }

    /// Deletes the keys of `detached` whose session is over (see [`Detached`]): each only while
    /// it is still the same key and still has no lease (create revision and lease compared in
    /// the delete's transaction), so a key its owner attached again, or a newer key by its name,
    /// stays. Keeps in `detached` those whose session still lives and those it could not settle,
    /// and returns when to look at them again: once the session's TTL left has passed, plus a
    /// second (its owner attaches the key again meanwhile, or dies), or a second from now after a
    /// failed request; `None` once none is left.
    async fn clear_orphans(&self, detached: &mut Vec<Detached>) -> Option<Instant> {
        let timeout = self.timeout();
        let client = &self.handle.client;
        let mut next: Option<Instant> = None;
        let mut kept = Vec::new();
        // What each session's lease answered (keys of one session share one request).
        let mut ttls = std::collections::HashMap::new();
        for orphan in std::mem::take(detached) {
            let lease = orphan.session_lease;
            let ttl = match ttls.get(&lease) {
                Some(ttl) => *ttl,
                None => {
                    let ttl = retry_unapplied(timeout, || {
                        let mut c = client.clone();
                        async move { c.lease_time_to_live(lease, None).await }
                    })
                    .await
                    // etcd answers a remaining TTL of about 2^63 ns for a lease whose expiry a
                    // new leader has not set yet: no more than the TTL it was granted.
                    .map(|r| r.ttl().min(r.granted_ttl()))
                    .ok();
                    ttls.insert(lease, ttl);
                    ttl
                }
            };
            let again = match ttl {
                // The session lives: its owner may still hold or wait on the key.
                Some(ttl) if ttl >= 0 => Duration::from_secs(ttl as u64 + 1),
                Some(_) => {
                    let txn = Txn::new()
                        .when([
                            Compare::create_revision(
                                orphan.key.clone(),
                                CompareOp::Equal,
                                orphan.create_revision,
                            ),
                            Compare::lease(orphan.key.clone(), CompareOp::Equal, 0),
                        ])
                        .and_then([TxnOp::delete(orphan.key.clone(), None)]);
                    match retry_unapplied(timeout, || {
                        let (mut c, txn) = (client.clone(), txn.clone());
                        async move { c.txn(txn).await }
                    })
                    .await
                    {
                        Ok(resp) => {
                            if resp.succeeded() {
                                tracing::warn!(
                                    backend = BACKEND,
                                    key = %String::from_utf8_lossy(&orphan.key),
                                    "deleted a lock key that a write from outside had detached \
                                     from its session, which has ended: nobody held it, and it \
                                     would have kept the lock taken for good"
                                );
                            }
                            // Deleted, or changed since the read: either way not an orphan.
                            continue;
                        }
                        Err(_) => Duration::from_secs(1),
                    }
                }
                None => Duration::from_secs(1),
            };
            let at = Instant::now() + again;
            next = Some(next.map_or(at, |n| n.min(at)));
            kept.push(orphan);
        }
        *detached = kept;
        next
    }

    /// Deletes a waiter's key now (compare-and-delete on its create revision); if that fails,
    /// `pending` stays armed and the deletion is retried in the background.
    async fn delete_now(&self, pending: &mut PendingKey) {
        let Some(rev) = pending.revision else { return };
        let txn = Txn::new()
            .when([Compare::create_revision(
                pending.key.clone(),
                CompareOp::Equal,
                rev,
            )])
            .and_then([TxnOp::delete(pending.key.clone(), None)]);
        let client = &self.handle.client;
        let deleted = retry_unapplied(self.timeout(), || {
            let (mut kv, txn) = (client.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await;
        if deleted.is_ok() {
            pending.armed = false;
        }
    }
}

/// A waiting `acquire`'s answer to a failed session grant or enqueue: `Unavailable` and
/// `OutcomeUnknown` (no leader during an election, a member that died or was cut off, a request
/// timeout) are transient on a cluster, so the attempt is made again after `backoff` (doubling,
/// with jitter, up to 500 ms) as long as that leaves time before `deadline`; any other error, or a transient
/// one too close to the deadline, is returned as it is. The retry uses a new attempt key, so an
/// attempt whose answer was lost is still retired by the background worker.
async fn retry_within(
    error: Error,
    backoff: &mut Backoff,
    deadline: Instant,
    caller: &mut oneshot::Sender<Result<EtcdLease>>,
) -> Result<()> {
    let transient = matches!(
        error,
        Error::Unavailable { .. } | Error::OutcomeUnknown { .. }
    );
    if !transient || Instant::now() + backoff.ceiling() >= deadline {
        return Err(error);
    }
    tracing::debug!(error = %error, backoff = ?backoff.ceiling(), "etcd acquire failed transiently; trying again within its wait");
    tokio::select! {
        _ = caller.closed() => return Err(error),
        _ = backoff.sleep() => {}
    }
    Ok(())
}

impl EtcdCoordinator {
    /// `acquire` (`Some(wait)`: queued behind the holder up to `wait`) and `try_acquire`
    /// (`None`: one transaction), with `options` validated. A queued attempt runs in its own
    /// task; a single transaction (`try_acquire`, or `acquire` with no wait) runs in the caller's.
    pub(crate) async fn acquire_for(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Box<dyn Lease>> {
        let start = Instant::now();
        let Some(wait) = wait else {
            return self.acquire_once(key, options).await;
        };
        if wait.is_zero() {
            return self.acquire_once(key, options).await.map_err(|e| match e {
                Error::Held { key } => Error::Timeout {
                    key,
                    waited: start.elapsed(),
                },
                e => e,
            });
        }
        self.acquire_waiting(key, options, start, start + wait)
            .await
    }

    async fn acquire_waiting(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        start: Instant,
        deadline: Instant,
    ) -> Result<Box<dyn Lease>> {
        let inner = self.inner.clone();
        let (key, options) = (key.clone(), options.clone());
        // The attempt runs in its own task, so that dropping this future never cancels a
        // request in flight: the task sees the caller gone and deletes our key itself (and a
        // lease it could not hand over is dropped, which releases it).
        let (mut tx, rx) = oneshot::channel();
        let abandoned = GivenUp::new(inner.handle.cleaner.cleanups().clone());
        let task_ends = abandoned.counted.clone();
        tokio::spawn(async move {
            let r = inner
                .acquire_queued(&key, &options, start, deadline, &mut tx)
                .await;
            let _ = tx.send(r);
            // The caller gone, our key is deleted by now (or queued for the cleaner, which
            // counts it from then on): the count taken at the caller's drop can end.
            drop(task_ends);
        });
        let answer = rx.await;
        abandoned.disarm();
        match answer {
            Ok(r) => r.map(|l| Box::new(l) as Box<dyn Lease>),
            Err(_) => Err(Error::unavailable(
                BACKEND,
                "acquire: the attempt's task ended without an answer",
            )),
        }
    }

    /// One transaction, from the caller's task: a caller that stops waiting drops the attempt's
    /// [`PendingKey`], which retires the attempt in the background (its key deleted, or its
    /// marker written so that a late copy of the transaction writes nothing), as a failed send
    /// does. No task of its own, so no hand-over to another thread and back.
    async fn acquire_once(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        Ok(Box::new(self.inner.try_once(key, options).await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etcd_client::Client;
    use lease_core::Coordinator;

    #[test]
    fn ttl_rounds_up_to_whole_seconds() {
        assert_eq!(ttl_secs(Duration::from_secs(2)), 2);
        assert_eq!(ttl_secs(Duration::from_millis(2001)), 3);
        assert_eq!(ttl_secs(Duration::from_millis(10)), 1);
    }

    /// A waiter's lock watch starts at the server's current revision, so a predecessor deleted
    /// after the waiter's read and before the watch exists is not delivered: the watch's start,
    /// after the read, makes the waiter read again. Once the watch covers the read, the
    /// deletions of the keys ahead alone make the waiter first, and nothing else ends the wait.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_predecessor_deleted_before_the_watch_exists_is_seen_by_a_read() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};

        let test = "a_predecessor_deleted_before_the_watch_exists_is_seen_by_a_read";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let coord = EtcdCoordinator::connect_url(&server.url()).await.unwrap();
        let raw = coord.client();
        let inner = &coord.inner;
        let key: LockKey = "gap".parse().unwrap();
        let prefix = coord.lock_prefix(&key);
        let session = inner.session(20).await.unwrap();
        let put = |name: &str| {
            let (mut raw, name) = (raw.clone(), format!("{prefix}{name}"));
            async move { header_revision(raw.put(name, "", None).await.unwrap().header()) }
        };
        let delete = |name: &str| {
            let (mut raw, name) = (raw.clone(), format!("{prefix}{name}"));
            async move { raw.delete(name, None).await.unwrap() }
        };
        for only in [true, false] {
            if !only {
                put("first").await;
            }
            put("pred").await;
            let own_rev = put("own").await;
            let own = format!("{prefix}own");
            let queue = Queue {
                prefix: &prefix,
                own: &own,
                revision: own_rev,
            };
            let (mut caller, _rx) = oneshot::channel();
            let mut last = inner.read_queue(&queue).await.unwrap();
            let stale = last.revision;
            let ahead = |last: &Read| match &last.ahead {
                Ahead::Keys { keys, all: true } => keys.len(),
                other => panic!("{other:?}"),
            };
            assert_eq!(ahead(&last), if only { 1 } else { 2 });
            macro_rules! wait_turn {
                ($lock:ident, $last:ident, $deadline:ident) => {
                    inner
                        .wait_turn(
                            &session,
                            &queue,
                            &mut $lock,
                            &mut $last,
                            $deadline,
                            // No periodic read within these waits.
                            $deadline + Duration::from_secs(3600),
                            &mut caller,
                        )
                        .await
                };
            }

            // Nothing written since the read: the wait goes on to its bound.
            let mut lock = inner.handle.watcher.lock(prefix.as_bytes().to_vec());
            let deadline = Instant::now() + Duration::from_millis(300);
            let wait = wait_turn!(lock, last, deadline);
            assert!(matches!(wait, Wait::Deadline), "only {only}");
            assert!(lock.from().is_some_and(|f| f <= stale));
            drop(lock);

            // The predecessor deleted after the read, before the watch exists.
            delete("pred").await;
            let mut lock = inner.handle.watcher.lock(prefix.as_bytes().to_vec());
            let deadline = Instant::now() + Duration::from_secs(10);
            let wait = wait_turn!(lock, last, deadline);
            assert!(matches!(wait, Wait::Recheck), "only {only}");
            assert!(lock.from().is_some_and(|f| f > stale));
            let mut last = inner.read_queue(&queue).await.unwrap();
            assert_eq!(ahead(&last), if only { 0 } else { 1 });
            if !only {
                // The watch covers the read: the last key ahead going makes ours first.
                delete("first").await;
            }
            let wait = wait_turn!(lock, last, deadline);
            match wait {
                Wait::Ready if only => {}
                Wait::First(revision) if !only => assert!(revision > last.revision),
                _ => panic!("only {only}: not first"),
            }
            let all = etcd_client::DeleteOptions::new().with_prefix();
            raw.clone().delete(prefix.clone(), Some(all)).await.unwrap();
        }
    }
    /// A copy of an abandoned attempt's cleanup applied late (its first send got no answer and a
    /// retry succeeded, freeing the name's slot) writes nothing: it cannot delete the key of a
    /// newer lease that reuses the name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_late_copy_of_an_abandoned_cleanup_leaves_a_newer_key_of_the_same_name() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};

        let test = "a_late_copy_of_an_abandoned_cleanup_leaves_a_newer_key_of_the_same_name";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let coord = EtcdCoordinator::connect_url(&server.url()).await.unwrap();
        let mut raw = coord.client();
        let key: LockKey = "reused-late".parse().unwrap();
        let lease = coord
            .try_acquire(&key, &LeaseOptions::new(Duration::from_secs(20)))
            .await
            .unwrap();
        let held = raw
            .get(
                coord.lock_prefix(&key),
                Some(GetOptions::new().with_prefix()),
            )
            .await
            .unwrap()
            .take_kvs();
        assert_eq!(held.len(), 1);
        let (name, session) = (held[0].key_str().unwrap().to_owned(), held[0].lease());
        // An earlier attempt under the same name was abandoned and its cleanup applied once:
        // its marker exists.
        let marker = format!("{}/abandoned/reused-late/old", coord.config().key_prefix());
        raw.put(
            marker.clone(),
            "",
            Some(PutOptions::new().with_lease(session)),
        )
        .await
        .unwrap();
        // Another copy of that cleanup arrives now.
        let state = coord.inner.live_session(20).unwrap().watch_state();
        let late = Cleanup::abandoned(name.clone(), marker, session, state);
        raw.txn(late.txn()).await.unwrap();
        let after = raw.get(name, None).await.unwrap().take_kvs();
        assert_eq!(after.len(), 1, "the newer lease's key stays");
        assert_eq!(after[0].create_revision(), held[0].create_revision());
        assert_eq!(lease.status(), LeaseStatus::Held);
        lease.release().await.unwrap();
    }

    /// An acquire whose answers are lost is `OutcomeUnknown`, every attempt it made within its
    /// wait is retired (its key deleted, its marker written), and each attempt's transaction
    /// applied late, as etcd does with a proposal the client gave up on, writes nothing: no
    /// orphan key in the queue.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unanswered_acquire_is_retired_and_a_late_apply_writes_nothing() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};
        use conformance_tests::proxy::FaultProxy;

        let test = "an_unanswered_acquire_is_retired_and_a_late_apply_writes_nothing";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let proxy = FaultProxy::start(server.addr()).await.unwrap();
        let url = format!("etcd://{}?request_timeout_ms=300", proxy.addr());
        let coord = EtcdCoordinator::connect_url(&url).await.unwrap();
        let mut raw = EtcdCoordinator::connect_url(&server.url())
            .await
            .unwrap()
            .client();
        let key: LockKey = "late".parse().unwrap();
        let prefix = coord.lock_prefix(&key);
        let markers = format!("{}/abandoned/late/", coord.config().key_prefix());
        let options = LeaseOptions::new(Duration::from_secs(20)).wait(Duration::from_secs(5));
        // Open the session before cutting the link, so only the acquire's txn is lost.
        let warm = coord.acquire(&key, &options).await.unwrap();
        warm.release().await.unwrap();

        proxy.blackhole();
        let err = coord.acquire(&key, &options).await.map(|_| ()).unwrap_err();
        assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err:?}");
        proxy.heal();

        // The cleaner retires the attempts (the waiting acquire made several within its wait,
        // each lost): markers written, no key left in the queue.
        async fn kvs(raw: &Client, prefix: &str) -> Vec<KeyValue> {
            let mut raw = raw.clone();
            let options = GetOptions::new().with_prefix();
            raw.get(prefix, Some(options)).await.unwrap().take_kvs()
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let retired = loop {
            let m = kvs(&raw, &markers).await;
            if !m.is_empty() && kvs(&raw, &prefix).await.is_empty() {
                break m;
            }
            assert!(
                Instant::now() < deadline,
                "the attempts were not retired: {} markers",
                m.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let session = coord.inner.live_session(20).unwrap();
        for marker in &retired {
            assert_eq!(
                marker.lease(),
                session.id(),
                "the marker goes with the session"
            );
            // etcd applies the lost request now: it writes nothing.
            let name = marker.key_str().unwrap().rsplit('/').next().unwrap();
            let late = PendingKey {
                cleaner: coord.inner.handle.cleaner.clone(),
                // The marker names the attempt; the key is named like it for the test (its
                // name does not matter: the marker alone makes the transaction write nothing).
                key: format!("{prefix}{name}"),
                slot: coord.inner.slots.take(format!("{prefix}{name}")),
                marker: marker.key_str().unwrap().to_owned(),
                resent: keys::resent_key(marker.key_str().unwrap()),
                revision: None,
                session: session.clone(),
                armed: false,
            };
            for txn in [
                enqueue_txn(&prefix, &late, b"{}"),
                try_txn(&prefix, &late, b"{}", false),
            ] {
                assert!(!raw.txn(txn).await.unwrap().succeeded());
            }
        }
        assert!(kvs(&raw, &prefix).await.is_empty());
        let next = coord.try_acquire(&key, &options).await.unwrap();
        next.release().await.unwrap();
    }

    /// `try_acquire`'s resend applied but its answer was lost too, so the call gave up: the
    /// attempt's cleanup still deletes the key the resend created (the resend's own marker is
    /// not the cleanup's), and a late copy of the first send writes nothing after it. Before,
    /// the resend wrote the cleanup's marker, the cleanup found it and deleted nothing, and the
    /// key stayed locked on the live session for as long as the process ran.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resend_applied_without_an_answer_is_still_retired() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};

        let test = "a_resend_applied_without_an_answer_is_still_retired";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let coord = EtcdCoordinator::connect_url(&server.url()).await.unwrap();
        let mut raw = coord.client();
        let key: LockKey = "resent-unanswered".parse().unwrap();
        let prefix = coord.lock_prefix(&key);
        let options = LeaseOptions::new(Duration::from_secs(20));
        // Open the session.
        let warm = coord.try_acquire(&key, &options).await.unwrap();
        warm.release().await.unwrap();
        let session = coord.inner.live_session(20).unwrap();

        let pending = coord.inner.pending(&key, &prefix, &session);
        let (name, marker, resent) = (
            pending.key.clone(),
            pending.marker.clone(),
            pending.resent.clone(),
        );
        // The resend applies; its answer, like the first send's, never comes.
        let applied = raw.txn(try_txn(&prefix, &pending, b"{}", true)).await;
        assert!(applied.unwrap().succeeded());
        // The call gives up: the attempt is retired in the background.
        drop(pending);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !raw.get(name.clone(), None).await.unwrap().kvs().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the key the resend created was left locked"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A late copy of the first send writes nothing.
        let late = PendingKey {
            cleaner: coord.inner.handle.cleaner.clone(),
            key: name.clone(),
            slot: coord.inner.slots.take(name.clone()),
            marker,
            resent,
            revision: None,
            session: session.clone(),
            armed: false,
        };
        let copy = raw.txn(try_txn(&prefix, &late, b"{}", false)).await;
        assert!(!copy.unwrap().succeeded());
        assert!(raw.get(name, None).await.unwrap().kvs().is_empty());
        let next = coord.try_acquire(&key, &options).await.unwrap();
        next.release().await.unwrap();
    }

    /// The first send applies unanswered, a resend is held up on its way, and a second resend
    /// finds our key: the lease is granted, used and released. The held-up resend, applied
    /// last, must write nothing. Before, only a resend that created our key wrote the resend
    /// marker, so the held-up one found the lock empty and locked the key again for a lease
    /// nobody held, attached to a live session: every other client was refused for as long as
    /// this process ran.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_resend_applied_after_the_lease_it_granted_was_released_writes_nothing() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};

        let test = "a_resend_applied_after_the_lease_it_granted_was_released_writes_nothing";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let coord = EtcdCoordinator::connect_url(&server.url()).await.unwrap();
        let mut raw = coord.client();
        let key: LockKey = "resent-held-up".parse().unwrap();
        let prefix = coord.lock_prefix(&key);
        let options = LeaseOptions::new(Duration::from_secs(20));
        // Open the session.
        let warm = coord.try_acquire(&key, &options).await.unwrap();
        warm.release().await.unwrap();
        let session = coord.inner.live_session(20).unwrap();

        let mut pending = coord.inner.pending(&key, &prefix, &session);
        let name = pending.key.clone();
        // Send 1 applies; its answer never comes.
        let first = raw.txn(try_txn(&prefix, &pending, b"{}", false)).await;
        assert!(first.unwrap().succeeded());
        // Send 2, in doubt, is held up on its way.
        let held_up = try_txn(&prefix, &pending, b"{}", true);
        // Send 3, in doubt, finds our key: what `try_once` grants on.
        let third = raw
            .txn(try_txn(&prefix, &pending, b"{}", true))
            .await
            .unwrap();
        assert!(!third.succeeded());
        let found = match &third.op_responses()[0] {
            etcd_client::TxnOpResponse::Get(r) => r.kvs().first().map(|kv| kv.lease()),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(found, Some(session.id()));
        // The lease is released (a compare-and-delete of our key).
        raw.delete(name.clone(), None).await.unwrap();
        // Send 2 arrives.
        let late = raw.txn(held_up).await.unwrap();
        assert!(!late.succeeded(), "the held-up resend locked the key again");
        assert!(raw.get(name, None).await.unwrap().kvs().is_empty());
        pending.armed = false;
        drop(pending);
        let next = coord.try_acquire(&key, &options).await.unwrap();
        next.release().await.unwrap();
    }
}
