//! Sessions: one etcd lease per client and TTL, kept alive by one keepalive stream, and the
//! background deletion of keys nobody is waiting on any more.
//!
//! A [`Session`] is an etcd lease granted once and kept alive by a task that sends a keepalive
//! every third of the TTL on one `LeaseKeepAlive` stream. Every holder and waiter key the
//! client writes with that TTL is attached to the session's lease, so a crashed, frozen or
//! partitioned process loses all its keys when the server expires the lease.
//!
//! The task owns the session's **deadline**: the send time of the last keepalive the server
//! acknowledged plus the TTL it reported. The server cannot have expired the lease before that
//! instant (it received the keepalive after it was sent). When the deadline passes without a
//! newer acknowledgement, or a keepalive answers TTL 0 (the lease was revoked or expired), the
//! session is over: every lease registered on it is marked lost, and the next acquisition
//! grants a new session. While the stream is broken but the deadline has not passed, the leases
//! are marked in doubt. The next acknowledgement proves that the session lease lives, not that
//! each lease's key is still there (an operator may have deleted it meanwhile): a read of the
//! keys, batched as the renewals' ([`crate::confirm`]), restores those found with their create
//! revision, unless the stream broke again since; the others stay in doubt until their
//! guardian, whose watch delivers the deletion, marks them lost.
//!
//! The session does *not* extend a lease's own validity: that moves only when the holder renews
//! (see the crate docs), and a lease whose validity passes is deleted by its guardian even though
//! the session lives on.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, PutOptions, Txn, TxnOp};
use lease_core::adapter::{fresh_id, Backoff, Cleanups, Dependents, LeaseTracker, PendingCleanup};
use lease_core::{LeaseStatus, LostReason};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::{retry_unapplied, Failure};

/// What the keepalive task knows about its session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionState {
    /// Send time of the newest keepalive (or the grant) the server acknowledged.
    pub(crate) acked_sent: Instant,
    /// `acked_sent` plus the TTL the server reported: the lease lives at least until then.
    pub(crate) deadline: Instant,
    /// Set once the session is over, with the reason its leases are lost (`Released` when the
    /// client closed the session itself).
    pub(crate) dead: Option<LostReason>,
    /// How many times the keepalive stream broke: a check of the keys in doubt that was sent
    /// before the latest break restores nothing.
    pub(crate) breaks: u64,
    /// The keepalive stream is open: false from a break until the next acknowledgement. A
    /// lease registered meanwhile is in doubt from the start, and a renewal waits for a
    /// keepalive acknowledged after it began.
    pub(crate) stream_up: bool,
}

/// A lease on a session: its tracker, and its key with the create revision it was granted on
/// (what is read back after a broken stream before the lease is held again).
#[derive(Debug)]
pub(crate) struct OnSession {
    tracker: LeaseTracker,
    key: String,
    revision: i64,
}

/// One etcd lease of a client, shared by every lease and waiter of one TTL.
pub(crate) struct Session {
    id: i64,
    ttl: Duration,
    state: Arc<watch::Sender<SessionState>>,
    kick: mpsc::UnboundedSender<Instant>,
    leases: Arc<Dependents<OnSession>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &format_args!("{:016x}", self.id as u64))
            .field("ttl", &self.ttl)
            .field("dead", &self.state.borrow().dead)
            .finish()
    }
}

/// Why [`Session::confirm`] could not confirm.
#[derive(Debug)]
pub(crate) enum Unconfirmed {
    /// The session is over.
    Dead(LostReason),
    /// No acknowledgement within the bound.
    Timeout,
}

impl Session {
    /// Grants a lease of `ttl_secs` and starts its keepalive task.
    pub(crate) async fn grant(
        client: &Client,
        ttl_secs: i64,
        request_timeout: Duration,
    ) -> Result<Arc<Session>, Failure> {
        let sent = Instant::now();
        let resp = retry_unapplied(request_timeout, || {
            let mut c = client.clone();
            async move { c.lease_grant(ttl_secs, None).await }
        })
        .await?;
        // The granted TTL: etcd raises a TTL below its minimum (derived from the election
        // timeout; 2 s with the default settings).
        let ttl = Duration::from_secs(resp.ttl().max(1) as u64);
        let (state, _) = watch::channel(SessionState {
            acked_sent: sent,
            deadline: sent + ttl,
            dead: None,
            breaks: 0,
            stream_up: true,
        });
        let state = Arc::new(state);
        let (kick, kick_rx) = mpsc::unbounded_channel();
        let leases = Arc::new(Dependents::new());
        let session = Arc::new(Session {
            id: resp.id(),
            ttl,
            state: state.clone(),
            kick,
            leases: leases.clone(),
        });
        tracing::debug!(lease = %format_args!("{:016x}", resp.id() as u64), ?ttl, "etcd session granted");
        tokio::spawn(keepalive(KeepAlive {
            client: client.clone(),
            id: resp.id(),
            ttl,
            state,
            leases,
            kick_rx,
            request_timeout,
        }));
        Ok(session)
    }

    /// The etcd lease id.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The TTL the server granted.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Whether the session is over.
    pub(crate) fn is_dead(&self) -> bool {
        self.state.borrow().dead.is_some()
    }

    /// Why the session ended, if it has.
    pub(crate) fn dead_reason(&self) -> Option<LostReason> {
        self.state.borrow().dead
    }

    /// Send time of the newest acknowledged keepalive.
    pub(crate) fn acked_sent(&self) -> Instant {
        self.state.borrow().acked_sent
    }

    /// Whether the keepalive stream is open (see [`SessionState::stream_up`]).
    pub(crate) fn stream_up(&self) -> bool {
        self.state.borrow().stream_up
    }

    /// A receiver of the session's state (for the deletion worker: it stops retrying once the
    /// session is over, because the server then deletes the session's keys itself).
    pub(crate) fn watch_state(&self) -> watch::Receiver<SessionState> {
        self.state.subscribe()
    }

    /// Records that the server no longer knows the session's lease (an operation answered
    /// "lease not found"): the session is over, its leases are lost.
    pub(crate) fn mark_dead(&self, reason: LostReason) {
        end(&self.state, &self.leases, reason);
    }

    /// Sends a keepalive now (unless one sent since now is in flight), without waiting for its
    /// answer. Used when one of the session's keys vanished: if the lease behind it was revoked,
    /// the answer (TTL 0) ends the session within a round trip, so its other leases and waiters
    /// learn it at once and the next acquisition grants a new session, instead of at the next
    /// periodic keepalive (a third of the TTL later).
    pub(crate) fn probe(&self) {
        let _ = self.kick.send(Instant::now());
    }

    /// Registers a lease, whose key `key` has create revision `revision`, to be marked lost when
    /// the session ends (and in doubt while its stream is broken). Returns the slot to
    /// unregister with.
    pub(crate) fn register(&self, tracker: LeaseTracker, key: &str, revision: i64) -> u64 {
        let slot = fresh_id();
        let on = OnSession {
            tracker: tracker.clone(),
            key: key.to_owned(),
            revision,
        };
        if !self.leases.insert(slot, on) {
            // The session ended between the acquisition and the registration.
            let reason = self.dead_reason().unwrap_or(LostReason::SessionEnded);
            if reason != LostReason::Released {
                tracker.mark_lost(reason);
            }
        } else if !self.stream_up() {
            // Granted while the stream is broken: in doubt like the leases the break found (a
            // break after the insert finds this one too), held again once an acknowledgement
            // comes and our key is read back.
            tracker.in_doubt();
            if self.stream_up() {
                // The acknowledgement that reopened the stream came between the two readings
                // and looked for leases in doubt before this one was: ask for another.
                self.probe();
            }
        }
        slot
    }

    /// Forgets a registered lease.
    pub(crate) fn unregister(&self, slot: u64) {
        self.leases.remove(slot);
    }

    /// Waits until the server acknowledged a keepalive sent at or after `since` (sending one now
    /// unless one is already in flight), with the stream open, within `timeout`.
    pub(crate) async fn confirm(
        &self,
        since: Instant,
        timeout: Duration,
    ) -> Result<(), Unconfirmed> {
        let mut rx = self.state.subscribe();
        if self.kick.send(since).is_err() {
            return Err(Unconfirmed::Dead(
                self.dead_reason().unwrap_or(LostReason::SessionEnded),
            ));
        }
        let outcome = tokio::time::timeout(timeout, async {
            rx.wait_for(|s| s.dead.is_some() || (s.stream_up && s.acked_sent >= since))
                .await
                .map(|s| s.dead)
        })
        .await;
        match outcome {
            Ok(Ok(Some(reason))) => Err(Unconfirmed::Dead(reason)),
            Ok(Ok(None)) => Ok(()),
            Ok(Err(_)) => Err(Unconfirmed::Dead(LostReason::SessionEnded)),
            Err(_) => Err(Unconfirmed::Timeout),
        }
    }
}

/// Marks the session over (first reason wins) and its leases lost.
fn end(state: &watch::Sender<SessionState>, leases: &Dependents<OnSession>, reason: LostReason) {
    state.send_if_modified(|s| {
        if s.dead.is_some() {
            false
        } else {
            s.dead = Some(reason);
            true
        }
    });
    // Only the first `close` finds the leases, and they are lost for the reason recorded
    // first, which a concurrent end may have set before this one reached the set.
    let reason = state.borrow().dead.unwrap_or(reason);
    if let Some(ended) = leases.close() {
        if reason != LostReason::Released {
            for on in ended {
                on.tracker.mark_lost(reason);
            }
        }
    }
}

struct KeepAlive {
    client: Client,
    id: i64,
    ttl: Duration,
    state: Arc<watch::Sender<SessionState>>,
    leases: Arc<Dependents<OnSession>>,
    kick_rx: mpsc::UnboundedReceiver<Instant>,
    request_timeout: Duration,
}

impl KeepAlive {
    fn ack(&self, sent: Instant, server_ttl: Duration) {
        self.state.send_modify(|s| {
            s.acked_sent = s.acked_sent.max(sent);
            s.deadline = s.deadline.max(sent + server_ttl);
            s.stream_up = true;
        });
        let mut doubted = Vec::new();
        self.leases.for_each(|on| {
            if on.tracker.status() == LeaseStatus::InDoubt {
                doubted.push((on.tracker.clone(), on.key.clone(), on.revision));
            }
        });
        if !doubted.is_empty() {
            tracing::debug!(lease = %format_args!("{:016x}", self.id as u64), in_doubt = doubted.len(), "etcd session reconnected; reading its keys in doubt");
            tokio::spawn(hold_again(
                self.client.clone(),
                self.request_timeout,
                self.state.subscribe(),
                self.state.borrow().breaks,
                doubted,
            ));
        }
    }

    fn in_doubt(&self) {
        // Without notifying: nobody waits on the count.
        // Marked down before the leases are listed: one registered after the list sees it.
        self.state.send_if_modified(|s| {
            s.breaks += 1;
            s.stream_up = false;
            false
        });
        self.leases.for_each(|on| on.tracker.in_doubt());
    }

    fn deadline(&self) -> Instant {
        self.state.borrow().deadline
    }
}

/// After a keepalive acknowledged on a stream opened again: reads the keys of the leases that
/// were in doubt ([`crate::confirm::owned`], in transactions of up to
/// [`MAX_TXN_OPS`](crate::confirm::MAX_TXN_OPS) gets) and holds again, with the validity they
/// had, each one whose key is still there with its create revision, unless the session ended
/// or its stream broke again after `breaks` breaks (the count at the acknowledgement). The
/// others stay in doubt: a deleted key's guardian marks its lease lost, and a failed read is
/// tried again at the next acknowledgement.
async fn hold_again(
    client: Client,
    request_timeout: Duration,
    state: watch::Receiver<SessionState>,
    breaks: u64,
    doubted: Vec<(LeaseTracker, String, i64)>,
) {
    for chunk in doubted.chunks(crate::confirm::MAX_TXN_OPS) {
        let keys = chunk.iter().map(|(_, k, r)| (k.clone(), *r)).collect();
        let Ok(owned) = crate::confirm::owned(client.clone(), request_timeout, keys).await else {
            continue;
        };
        for ((tracker, _, _), owned) in chunk.iter().zip(owned) {
            let s = *state.borrow();
            if matches!(owned, Ok(true))
                && s.dead.is_none()
                && s.breaks == breaks
                && tracker.status() == LeaseStatus::InDoubt
            {
                tracker.renewed(tracker.valid_until());
            }
        }
    }
}

/// Why the keepalive loop ended.
enum End {
    Lost(LostReason),
    Closed,
}

async fn keepalive(mut ka: KeepAlive) {
    let interval = ka.ttl / 3;
    let mut backoff = Backoff::new(
        Duration::from_millis(50),
        interval.max(Duration::from_millis(50)),
    );
    let end_reason = 'session: loop {
        if Instant::now() >= ka.deadline() {
            break End::Lost(LostReason::Expired);
        }
        // (Re)open the stream: etcd-client sends one keepalive and waits for its answer.
        let open_sent = Instant::now();
        let lease_client = ka.client.lease_client();
        let opened = tokio::select! {
            r = retry_unapplied(ka.request_timeout.min(interval * 2), || {
                let mut lease_client = lease_client.clone();
                async move { lease_client.keep_alive(ka.id).await }
            }) => r,
            _ = tokio::time::sleep_until(ka.deadline()) => break End::Lost(LostReason::Expired),
        };
        let (mut keeper, mut stream) = match opened {
            Ok(pair) => pair,
            Err(f) if f.is_lease_not_found() => break End::Lost(LostReason::SessionEnded),
            Err(f) => {
                tracing::debug!(lease = %format_args!("{:016x}", ka.id as u64), error = %f, "etcd keepalive stream not open; retrying");
                ka.in_doubt();
                let wake = (Instant::now() + backoff.next_delay()).min(ka.deadline());
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep_until(wake) => continue 'session,
                        k = ka.kick_rx.recv() => if k.is_none() { break 'session End::Closed },
                    }
                }
            }
        };
        backoff.reset();
        ka.ack(open_sent, ka.ttl);
        let mut inflight: VecDeque<Instant> = VecDeque::new();
        let mut next_tick = open_sent + interval;
        loop {
            let deadline = ka.deadline();
            let send_now = tokio::select! {
                biased;
                m = stream.message() => match m {
                    Ok(Some(resp)) => {
                        let Some(sent) = inflight.pop_front() else { continue };
                        if resp.ttl() <= 0 {
                            break 'session End::Lost(LostReason::SessionEnded);
                        }
                        ka.ack(sent, Duration::from_secs(resp.ttl() as u64));
                        false
                    }
                    Ok(None) | Err(_) => {
                        ka.in_doubt();
                        continue 'session;
                    }
                },
                k = ka.kick_rx.recv() => match k {
                    None => break 'session End::Closed,
                    // Not when one sent since then is acknowledged or in flight.
                    Some(since) => {
                        ka.state.borrow().acked_sent < since
                            && !inflight.iter().any(|s| *s >= since)
                    }
                },
                _ = tokio::time::sleep_until(next_tick) => true,
                _ = tokio::time::sleep_until(deadline) => break 'session End::Lost(LostReason::Expired),
            };
            if send_now {
                let now = Instant::now();
                if keeper.keep_alive().await.is_err() {
                    ka.in_doubt();
                    continue 'session;
                }
                inflight.push_back(now);
                next_tick = now + interval;
            }
        }
    };
    match end_reason {
        End::Lost(reason) => {
            tracing::warn!(lease = %format_args!("{:016x}", ka.id as u64), %reason, "etcd session ended");
            end(&ka.state, &ka.leases, reason);
            // Best effort: if the server still has the lease (a partition that healed after the
            // deadline), revoking it removes the keys at once instead of at its expiry.
            let _ = retry_unapplied(ka.request_timeout, || {
                let mut c = ka.client.clone();
                async move { c.lease_revoke(ka.id).await }
            })
            .await;
        }
        End::Closed => {
            end(&ka.state, &ka.leases, LostReason::Released);
            let _ = retry_unapplied(ka.request_timeout, || {
                let mut c = ka.client.clone();
                async move { c.lease_revoke(ka.id).await }
            })
            .await;
            tracing::debug!(lease = %format_args!("{:016x}", ka.id as u64), "etcd session closed");
        }
    }
}

/// A key to delete in the background.
#[derive(Debug)]
pub(crate) struct Cleanup {
    key: String,
    how: How,
    session: watch::Receiver<SessionState>,
    /// The slot of the key's name, held until the cleanup is done ([`crate::keys::Slots`]).
    slot: Option<crate::keys::Slot>,
    /// Counts this cleanup among the coordinator's, until it is done ([`Cleaner::delete`]).
    pending: Option<PendingCleanup>,
}

/// How a [`Cleanup`] deletes its key.
#[derive(Debug)]
enum How {
    /// Delete only if the key still has this create revision.
    Created(i64),
    /// The request that writes the key got no answer, so it may still be applied later (etcd
    /// keeps applying a proposal after the client gave up). Write `marker`, attached to the
    /// session lease, and delete the key in one transaction: the request requires the marker
    /// to be absent, so if it applies after this it writes nothing. No other attempt uses the
    /// key's name until this cleanup is done (it holds the name's slot), so any key by that
    /// name is ours.
    Abandoned { marker: String, lease: i64 },
}

impl Cleanup {
    /// A key whose create revision is known: deleted only while it still has it.
    pub(crate) fn created(
        key: String,
        revision: i64,
        session: watch::Receiver<SessionState>,
    ) -> Self {
        Cleanup {
            key,
            how: How::Created(revision),
            session,
            slot: None,
            pending: None,
        }
    }

    /// A key written by a request whose outcome was not seen, guarded by `marker` (see
    /// [`crate::keys::abandoned_key`]): the marker is written on `lease` before the key is
    /// deleted, in the same transaction.
    pub(crate) fn abandoned(
        key: String,
        marker: String,
        lease: i64,
        session: watch::Receiver<SessionState>,
    ) -> Self {
        Cleanup {
            key,
            how: How::Abandoned { marker, lease },
            session,
            slot: None,
            pending: None,
        }
    }

    /// The transaction that does this cleanup (see [`How`]).
    pub(crate) fn txn(&self) -> Txn {
        match &self.how {
            How::Created(rev) => Txn::new()
                .when([Compare::create_revision(
                    self.key.clone(),
                    CompareOp::Equal,
                    *rev,
                )])
                .and_then([TxnOp::delete(self.key.clone(), None)]),
            // Only while the marker is absent: once one copy of this transaction has
            // applied, a copy applied late (a retry's predecessor that got no answer)
            // writes nothing, so it cannot delete a newer key that reuses the name after
            // the slot is freed.
            How::Abandoned { marker, lease } => Txn::new()
                .when([Compare::create_revision(
                    marker.clone(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([
                    TxnOp::put(
                        marker.clone(),
                        "",
                        Some(PutOptions::new().with_lease(*lease)),
                    ),
                    TxnOp::delete(self.key.clone(), None),
                ]),
        }
    }

    /// Holds `slot` (of the key's name) until the cleanup is done.
    pub(crate) fn holding(mut self, slot: crate::keys::Slot) -> Self {
        self.slot = Some(slot);
        self
    }
}

/// The sending side of the deletion worker: cheap to clone, never blocks (usable in `Drop`).
#[derive(Debug, Clone)]
pub(crate) struct Cleaner {
    tx: mpsc::UnboundedSender<Cleanup>,
    cleanups: Cleanups,
}

impl Cleaner {
    /// Starts the worker on the current runtime.
    pub(crate) fn start(client: Client, request_timeout: Duration) -> Cleaner {
        Cleaner::spawn(client, request_timeout, LINGER).0
    }

    /// Starts the worker, which gives up `linger` after every handle on it is dropped.
    fn spawn(
        client: Client,
        request_timeout: Duration,
        linger: Duration,
    ) -> (Cleaner, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(cleaner(client, request_timeout, linger, rx));
        let cleanups = Cleanups::new();
        (Cleaner { tx, cleanups }, task)
    }

    /// The deletions under way, counted from [`Cleaner::delete`] until each is done or given up.
    pub(crate) fn cleanups(&self) -> &Cleanups {
        &self.cleanups
    }

    /// Deletes `c.key` in the background, retrying until it is gone: a created key until its
    /// compare-and-delete applies or finds another key (even after its session ended: the key
    /// may have been detached from it), an abandoned one until its session is over. Once the
    /// coordinator and all its leases are dropped, retries end after [`LINGER`].
    pub(crate) fn delete(&self, mut c: Cleanup) {
        c.pending = Some(self.cleanups.begin());
        let _ = self.tx.send(c);
    }
}

/// How long the deletion worker keeps retrying once every handle on it is dropped (the
/// coordinator and all its leases). Its sessions are revoked then, or expire at their TTL when
/// the revoke cannot be sent, taking their keys; only a key detached from its session by a
/// write from outside outlives them, and that one is left (with a `warn` naming it) rather
/// than retried for as long as the process lives while etcd is unreachable.
const LINGER: Duration = Duration::from_secs(30);

struct Pending {
    c: Cleanup,
    due: Instant,
    /// The pause before its next try (100 ms doubling to 1.6 s, with jitter).
    backoff: Backoff,
}

async fn cleaner(
    client: Client,
    request_timeout: Duration,
    linger: Duration,
    mut rx: mpsc::UnboundedReceiver<Cleanup>,
) {
    let mut pending: Vec<Pending> = Vec::new();
    let mut open = true;
    // When every handle was dropped: retries end `linger` after it.
    let mut closed_at: Option<Instant> = None;
    loop {
        if !open && pending.is_empty() {
            return;
        }
        let next_due = pending.iter().map(|p| p.due).min();
        tokio::select! {
            m = rx.recv(), if open => match m {
                Some(c) => pending.push(Pending {
                    c,
                    due: Instant::now(),
                    backoff: Backoff::new(Duration::from_millis(100), Duration::from_millis(1600)),
                }),
                None => {
                    open = false;
                    closed_at = Some(Instant::now());
                }
            },
            _ = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now)), if next_due.is_some() => {}
        }
        let now = Instant::now();
        let (due, rest): (Vec<_>, Vec<_>) = pending.drain(..).partition(|p| p.due <= now);
        pending = rest;
        let results = futures::future::join_all(due.into_iter().map(|p| {
            let c = client.clone();
            async move {
                if matches!(p.c.how, How::Abandoned { .. }) && p.c.session.borrow().dead.is_some() {
                    // Its put names the ended lease, so it could only be refused; the key, on
                    // that lease, went with it. A created key is deleted even then: it may
                    // outlive the session, detached by an outside write without the lease, or
                    // the session may have ended only as far as this client knows.
                    return (p, true);
                }
                let txn = p.c.txn();
                let ok = match retry_unapplied(request_timeout, || {
                    let (mut c, txn) = (c.clone(), txn.clone());
                    async move { c.txn(txn).await }
                })
                .await
                {
                    Ok(_) => true,
                    // The session lease is gone: so is the key, and a late request, which puts
                    // the key on that lease, is rejected.
                    Err(f) => f.is_lease_not_found(),
                };
                (p, ok)
            }
        }))
        .await;
        let now = Instant::now();
        for (mut p, ok) in results {
            if !ok {
                if closed_at.is_some_and(|closed| now >= closed + linger) {
                    tracing::warn!(
                        key = %p.c.key,
                        "etcd cleanup given up {linger:?} after its coordinator was dropped \
                         (etcd unreachable): if a write from outside detached this key from its \
                         session, it holds the lock until that session is over and the next \
                         attempt deletes it, or until `fenced force-release`"
                    );
                    continue;
                }
                p.due = now + p.backoff.next_delay();
                tracing::debug!(key = %p.c.key, "etcd cleanup failed; retrying");
                pending.push(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Once every handle on the deletion worker is dropped (the coordinator and all its
    /// leases), a deletion that keeps failing (etcd unreachable) is given up after the linger
    /// and the task ends. Before, it retried a created key's deletion for as long as the runtime
    /// lived.
    #[tokio::test]
    async fn the_cleaner_gives_up_once_its_coordinator_is_dropped() {
        // A loopback port nothing listens on: every request is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = Client::connect([format!("127.0.0.1:{port}")], None)
            .await
            .unwrap();
        let linger = Duration::from_millis(500);
        let (cleaner, task) = Cleaner::spawn(client, Duration::from_millis(100), linger);
        let now = Instant::now();
        let (_state, session) = watch::channel(SessionState {
            acked_sent: now,
            deadline: now,
            dead: Some(LostReason::SessionEnded),
            breaks: 0,
            stream_up: false,
        });
        cleaner.delete(Cleanup::created("fenced/lock/k/x".into(), 7, session));
        drop(cleaner);
        tokio::time::timeout(linger + Duration::from_secs(10), task)
            .await
            .expect("the worker ends after its linger")
            .unwrap();
    }
}
