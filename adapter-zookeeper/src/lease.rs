//! [`ZkLease`]: a held lock node, its validity, and the guardian task that watches it.

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use lease_core::adapter::{
    forced_release_of, fresh_id, resend, retry_until_settled, Backoff, CleanupFailures,
    LeaseTracker, PendingCleanup, SendAgain, FORCED_LOOKBACK,
};
use lease_core::{Error, Lease, LeaseStatus, LostReason, Result};
use tokio::sync::oneshot;
use tokio::time::Instant;
use zookeeper_client::{Error as ZkError, EventType, WatchedEvent};

use crate::error::{
    connection_lost, disconnected, from_zk, ops, session_ended, timed_out, BACKEND,
};
use crate::session::{Session, SessionLease};

/// The shared state of one held lock node.
pub(crate) struct LeaseState {
    pub(crate) id: u64,
    pub(crate) session: Arc<Session>,
    pub(crate) tracker: LeaseTracker,
    /// The full path of our node.
    pub(crate) path: String,
    /// Our node's creation zxid (the token).
    pub(crate) czxid: i64,
    /// Our node's data version at creation (release deletes with it).
    pub(crate) version: i32,
    margin: Duration,
    /// The lease's own deadline: the send time of the last confirmed acquire or renew plus the
    /// TTL asked for (before the drift margin).
    deadline: Mutex<Instant>,
    /// Set once our node is known to be gone.
    node_gone: AtomicBool,
    /// `(lock dir, attempt prefix)` when a create of this acquisition had its answer lost: a
    /// second node of the attempt may still show up, so the lease's end deletes every node with
    /// the prefix.
    sweep: Option<(String, String)>,
}

impl fmt::Debug for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseState")
            .field("path", &self.path)
            .field("czxid", &self.czxid)
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

impl LeaseState {
    /// A new state for a node confirmed held by a request sent at `sent`; `sweep` as the field.
    pub(crate) fn new(
        session: Arc<Session>,
        tracker: LeaseTracker,
        path: String,
        czxid: i64,
        version: i32,
        sent: Instant,
        sweep: Option<(String, String)>,
    ) -> Arc<Self> {
        let margin = tracker.drift_margin();
        let deadline = sent + tracker.ttl();
        Arc::new(LeaseState {
            id: fresh_id(),
            session,
            tracker,
            path,
            czxid,
            version,
            margin,
            deadline: Mutex::new(deadline),
            node_gone: AtomicBool::new(false),
            sweep,
        })
    }

    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn extend(&self, sent: Instant) {
        let mut d = self.deadline.lock().unwrap_or_else(|p| p.into_inner());
        let new = sent + self.tracker.ttl();
        if new > *d {
            *d = new;
        }
    }

    /// Sets validity to `min(own deadline, session bound) − margin` if the lease is held (or in
    /// doubt, when `allow_in_doubt`); marks it expired if that is already past. Returns whether
    /// the lease is held afterwards. Called with the session's connection state locked.
    pub(crate) fn apply(&self, bound: Instant, allow_in_doubt: bool) -> bool {
        match self.tracker.status() {
            LeaseStatus::Held => {}
            LeaseStatus::InDoubt if allow_in_doubt => {}
            _ => return false,
        }
        let until = self.deadline().min(bound);
        let until = until.checked_sub(self.margin).unwrap_or(until);
        if Instant::now() >= until {
            self.tracker.mark_lost(LostReason::Expired);
            return false;
        }
        self.tracker.renewed(until)
    }

    /// Whether the lease has ended with its node known gone and nothing to sweep: what its
    /// guardian would do from here is forget it.
    fn ended_cleanly(&self) -> bool {
        self.node_gone.load(Ordering::SeqCst)
            && self.sweep.is_none()
            && matches!(self.tracker.status(), LeaseStatus::Lost(_))
    }

    /// The session ended: the node is gone with it.
    pub(crate) fn on_session_ended(&self) {
        self.node_gone.store(true, Ordering::SeqCst);
        self.tracker.mark_lost(LostReason::SessionEnded);
    }

    /// Our node is gone: revoked, unless a release began, which decides the reason itself (its
    /// delete, or a force-release it finds recorded, see [`ZkLease::forced`]).
    fn on_node_gone(&self) {
        self.node_gone.store(true, Ordering::SeqCst);
        self.tracker.gone_unless_releasing(LostReason::Revoked);
    }

    /// The `Lost` error with the reason recorded (or `fallback`).
    fn lost_error(&self, fallback: LostReason) -> Error {
        self.tracker.lost_error(fallback)
    }

    /// After a reconnect: checks that our node still exists (`sync` + `exists`, which confirms
    /// the session if the sync succeeds) and, if so, holds the lease again.
    ///
    /// A check that fails otherwise (no answer within the request timeout, say) is sent again
    /// with backoff while the lease is in doubt and the connection is the one it was called for:
    /// the heartbeat never moves an in-doubt lease, so a single failed check would leave a
    /// healthy lease in doubt until its validity ran out and it was lost.
    pub(crate) async fn verify(self: Arc<Self>, epoch: u64) {
        let s = &self.session;
        let mut pause = Backoff::new(Duration::from_millis(50), Duration::from_millis(500));
        loop {
            if self.tracker.status() != LeaseStatus::InDoubt || s.epoch() != epoch {
                return;
            }
            match s.synced_exists(&self.path).await {
                Some(Ok(Some(stat))) if stat.czxid == self.czxid => {
                    s.with_epoch(epoch, |bound| self.apply(bound, true));
                    return;
                }
                Some(Ok(_)) => return self.on_node_gone(),
                Some(Err(e)) if session_ended(&e) => return self.on_session_ended(),
                _ => {}
            }
            if s.is_terminated() {
                return;
            }
            tokio::time::sleep(pause.next_delay()).await;
        }
    }

    /// Sets a watch on our node: `Ok(Some(event future))` if it exists, `Ok(None)` if it is gone;
    /// `Err(true)` when the session has ended, `Err(false)` to retry later.
    async fn arm_watch(&self) -> Result<Option<NodeWatch>, bool> {
        let s = &self.session;
        if !s.is_connected() {
            return Err(s.is_terminated());
        }
        // A plain read: it does not confirm the session.
        match tokio::time::timeout(
            s.request_timeout(),
            s.client().check_and_watch_stat(&self.path),
        )
        .await
        {
            Ok(Ok((Some(stat), watcher))) if stat.czxid == self.czxid => {
                Ok(Some(Box::pin(watcher.changed())))
            }
            Ok(Ok(_)) => Ok(None),
            Ok(Err(e)) if session_ended(&e) => Err(true),
            _ => Err(false),
        }
    }

    /// Deletes our node, retrying through disconnections and refusals until it is gone or the
    /// session ends (which removes it anyway); failures are reported through
    /// [`CleanupFailures`].
    async fn delete_own(&self) {
        let s = &self.session;
        let mut version = Some(self.version);
        let mut backoff = Backoff::new(Duration::from_millis(10), s.timeout() / 4);
        let failures = CleanupFailures::new(BACKEND, &self.path);
        while !self.node_gone.load(Ordering::SeqCst) {
            if s.is_terminated() {
                return;
            }
            if !s.is_connected() {
                s.wait_connected(s.timeout()).await;
                continue;
            }
            let sent = Instant::now();
            match tokio::time::timeout(s.request_timeout(), s.client().delete(&self.path, version))
                .await
            {
                Ok(Ok(())) | Ok(Err(ZkError::NoNode)) => {
                    s.confirm(sent);
                    self.node_gone.store(true, Ordering::SeqCst);
                }
                // Someone changed our node's data; the path is unique to this acquisition, so it
                // is still ours.
                Ok(Err(ZkError::BadVersion)) => version = None,
                Ok(Err(e)) if session_ended(&e) => return,
                // A refusal (`NoAuth`: someone changed the node's ACL) is retried like any
                // failure: the node blocks the queue for as long as the session lives.
                Ok(Err(e)) => {
                    failures.failed("deleting our lock node", &from_zk(ops::CLEANUP, e));
                    backoff.sleep().await;
                }
                Err(_) => {
                    let e = timed_out(ops::CLEANUP, s.request_timeout());
                    failures.failed("deleting our lock node", &e);
                    backoff.sleep().await;
                }
            }
        }
    }
}

/// A watch set on a node (`exists` with a watch): its first event.
pub(crate) type NodeWatch = Pin<Box<dyn Future<Output = WatchedEvent> + Send>>;

enum End {
    /// The node is gone (deleted, or with the session).
    Gone,
    /// The lease was lost or its validity passed; the node may still exist.
    Lost(LostReason),
    /// The lease object was dropped without release (with the count of its clean-up).
    Dropped(Option<PendingCleanup>),
}

enum Wake {
    Event(WatchedEvent),
    Lost(LostReason),
    Dropped(Option<PendingCleanup>),
    Retry,
}

/// Watches our node (from `watch`, the waiter's watch on it, when given), and deletes it when
/// the lease ends without a release (validity passed, lease dropped, release not confirmed).
/// Ends when the node is gone.
pub(crate) async fn guard(
    state: Arc<LeaseState>,
    mut dropped: oneshot::Receiver<PendingCleanup>,
    mut watch: Option<NodeWatch>,
) {
    let mut signal = state.tracker.signal();
    // Without a watch, one is set at once (the guardian starts a moment after the acquisition,
    // `session::GUARD_DELAY`); after a failed try, at `retry_at`.
    let mut retry_at: Option<Instant> = None;
    let mut backoff = Backoff::new(Duration::from_millis(10), state.session.timeout() / 4);
    let end = loop {
        if watch.is_none() && retry_at.is_none_or(|t| Instant::now() >= t) {
            retry_at = None;
            match state.arm_watch().await {
                Ok(Some(w)) => watch = Some(w),
                Ok(None) => {
                    state.on_node_gone();
                    break End::Gone;
                }
                Err(true) => {
                    state.on_session_ended();
                    break End::Gone;
                }
                Err(false) => {
                    retry_at = Some(Instant::now() + backoff.next_delay());
                }
            }
        }
        let wake = {
            let event = async {
                match watch.as_mut() {
                    Some(w) => w.await,
                    None => std::future::pending().await,
                }
            };
            let retry = async {
                match retry_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                e = event => Wake::Event(e),
                r = signal.wait() => Wake::Lost(r),
                pending = &mut dropped => Wake::Dropped(pending.ok()),
                _ = retry => Wake::Retry,
            }
        };
        match wake {
            Wake::Event(e) => {
                watch = None;
                match e.event_type {
                    EventType::NodeDeleted => {
                        state.on_node_gone();
                        break End::Gone;
                    }
                    EventType::Session if e.session_state.is_terminated() => {
                        state.on_session_ended();
                        break End::Gone;
                    }
                    // A data change by someone else, or a session event: watch again.
                    _ => {}
                }
            }
            Wake::Lost(r) => break End::Lost(r),
            Wake::Dropped(pending) => break End::Dropped(pending),
            Wake::Retry => {}
        }
    };
    // A dropped lease's clean-up counts until its node (and a sweep's) is deleted.
    let pending = match end {
        End::Gone => None,
        End::Lost(reason) => {
            // Validity passed without a confirmed renewal: record it before deleting, so that a
            // renewal racing with us cannot bring the lease back.
            state.tracker.mark_lost(reason);
            state.delete_own().await;
            None
        }
        End::Dropped(pending) => {
            state.tracker.mark_lost(LostReason::Released);
            state.delete_own().await;
            pending
        }
    };
    state.session.unregister(state.id);
    if let Some((dir, prefix)) = &state.sweep {
        cleanup(state.session.clone(), dir.clone(), prefix.clone()).await;
    }
    drop(pending);
}

impl SessionLease for LeaseState {
    fn disconnected(&self) {
        self.tracker.in_doubt();
    }

    fn reconnected(self: Arc<Self>, epoch: u64) -> futures::future::BoxFuture<'static, ()> {
        Box::pin(self.verify(epoch))
    }

    fn refresh(&self, bound: Instant) {
        self.apply(bound, false);
    }

    fn session_ended(&self) {
        self.on_session_ended();
    }
}

/// A lease on a ZooKeeper lock: our ephemeral sequential node was first among the lock's
/// contenders.
///
/// - [`token`](Lease::token) is the node's creation zxid.
/// - [`renew`](Lease::renew) sends a `sync` and an `exists` on the node, pipelined (one round
///   trip only when both leave in one segment, which zookeeper-client, writing each request on
///   its own with Nagle's algorithm on, seldom does): the sync's answer comes through the
///   leader and confirms the session, the exists (answered after the sync) that the node is
///   still there.
///   Validity is measured from the moment the sync was sent; a failed or unanswered sync extends
///   nothing.
/// - [`release`](Lease::release) deletes the node with the version it was created with; a lease
///   whose node is gone returns `Lost` and deletes nothing (the path is unique to this
///   acquisition, so it can never name another holder's node). A delete whose connection was
///   lost is sent again once the session is connected again, and a resend that finds the node
///   gone while the lease was valid and the session alive reports `Ok` (the first send deleted
///   it), unless a force-release's audit record names our token (`Lost(Revoked)`).
/// - Dropping it releases best-effort: a background task deletes the node (and in any case the
///   session's end removes it).
pub struct ZkLease {
    state: Arc<LeaseState>,
    /// Tells the guardian the lease was dropped, with the count of the clean-up that follows.
    dropped: Mutex<Option<oneshot::Sender<PendingCleanup>>>,
}

impl fmt::Debug for ZkLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ZkLease")
            .field("path", &self.state.path)
            .field("tracker", &self.state.tracker)
            .finish()
    }
}

impl ZkLease {
    /// Wraps a confirmed holding and starts its guardian (on `watch`, a watch already set on the
    /// node, when there is one).
    pub(crate) fn start(
        state: Arc<LeaseState>,
        bound_epoch: u64,
        watch: Option<NodeWatch>,
    ) -> ZkLease {
        let weak: std::sync::Weak<LeaseState> = Arc::downgrade(&state);
        if !state.session.register(state.id, weak) {
            // The session ended since the grant (its nodes are gone), before this lease could
            // hear of it.
            state.on_session_ended();
        }
        // Cap the initial validity by the session bound (the tracker started from the TTL).
        let applied = state
            .session
            .with_epoch(bound_epoch, |bound| state.apply(bound, false));
        if applied.is_none() {
            // The connection dropped meanwhile: validity is still capped by the last confirmation.
            let bound = state.session.bound();
            state.apply(bound, false);
            state.tracker.in_doubt();
            // A reconnect that came before this lease was marked in doubt checked it as held
            // and left it: check it on the current connection (the next reconnect does too).
            if state.session.is_connected() {
                tokio::spawn(state.clone().verify(state.session.epoch()));
            }
        }
        let (tx, rx) = oneshot::channel();
        match watch {
            // A waiter's watch on its own node: the guardian takes it over now.
            Some(watch) => {
                tokio::spawn(guard(state.clone(), rx, Some(watch)));
            }
            None => {
                let st = state.clone();
                state.session.guardians().push(move || {
                    if st.ended_cleanly() {
                        // Released within the delay: nothing left to watch or delete.
                        st.session.unregister(st.id);
                    } else {
                        tokio::spawn(guard(st, rx, None));
                    }
                });
            }
        }
        ZkLease {
            state,
            dropped: Mutex::new(Some(tx)),
        }
    }

    /// The path of this lease's node.
    pub fn node_path(&self) -> &str {
        &self.state.path
    }
}

impl Drop for ZkLease {
    fn drop(&mut self) {
        if let Some(tx) = self
            .dropped
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            // Counted from now (a guardian not started yet gets it when it starts), and dropped
            // at once when the guardian has ended already.
            let _ = tx.send(self.state.session.cleanups().begin());
        }
    }
}

#[async_trait]
impl Lease for ZkLease {
    fn state(&self) -> &lease_core::LeaseState {
        &self.state.tracker
    }

    async fn renew(&self) -> Result<Instant> {
        let st = &self.state;
        st.tracker.ensure_not_lost()?;
        let s = &st.session;
        if !s.is_connected() {
            if s.is_terminated() {
                st.on_session_ended();
                return Err(st.lost_error(LostReason::SessionEnded));
            }
            return Err(disconnected(ops::RENEW));
        }
        let epoch = s.epoch();
        // Only a sync proves the leader still has the session: a follower cut off from the leader
        // answers the exists alone. `synced_exists` confirms the session only if the sync
        // succeeded; the sync is sent after `sent`, so validity from `sent` is never too long.
        let sent = Instant::now();
        match s.synced_exists(&st.path).await {
            None => Err(timed_out(ops::RENEW, s.request_timeout())),
            Some(Ok(Some(stat))) if stat.czxid == st.czxid => {
                st.extend(sent);
                match s.with_epoch(epoch, |bound| st.apply(bound, true)) {
                    Some(true) => Ok(st.tracker.valid_until()),
                    Some(false) => Err(st.lost_error(LostReason::Expired)),
                    None => Err(Error::unavailable(
                        crate::error::BACKEND,
                        "the connection dropped while renewing: the lease is in doubt",
                    )),
                }
            }
            Some(Ok(_)) => {
                st.on_node_gone();
                // Our own release's delete, if one runs: it decides.
                Err(st.tracker.lose_unless_releasing(LostReason::Revoked))
            }
            Some(Err(e)) if session_ended(&e) => {
                st.on_session_ended();
                Err(st.lost_error(LostReason::SessionEnded))
            }
            Some(Err(e)) => Err(from_zk(ops::RENEW, e)),
        }
    }

    async fn release(&self) -> Result<()> {
        let st = &self.state;
        st.tracker.ensure_not_lost()?;
        // A release dropped before it ends leaves the lease released; its guardian, woken by
        // that, deletes the node if it is still there.
        st.tracker.release_with(self.release_node(), || {}).await
    }
}

impl ZkLease {
    /// The body of `release`.
    async fn release_node(&self) -> Result<()> {
        let st = &self.state;
        let s = &st.session;
        if !s.is_connected() {
            // The guardian deletes the node once the connection is back (or the session ends).
            st.tracker.mark_lost(LostReason::Released);
            return Err(disconnected(ops::RELEASE));
        }
        // The delete is keyed on our node's path (unique to this acquisition): sent again after
        // the connection was lost under it, it can only delete our own node.
        let again = |e: &Option<ZkError>| {
            e.as_ref()
                .is_some_and(connection_lost)
                .then_some(SendAgain::InDoubt)
        };
        let pause = Backoff::new(Duration::from_millis(10), Duration::from_millis(80));
        let (outcome, in_doubt) = resend(s.request_timeout(), pause, again, |left, resend| {
            self.delete_node(left, resend)
        })
        .await;
        match outcome {
            Ok(()) => {
                st.node_gone.store(true, Ordering::SeqCst);
                st.tracker.mark_lost(LostReason::Released);
                Ok(())
            }
            Err(Some(ZkError::NoNode)) => {
                let answered = Instant::now();
                st.node_gone.store(true, Ordering::SeqCst);
                // Deleted by an earlier send whose answer was lost, or else not by us: revoked
                // (or expired by our own guardian, whose reason was recorded first). A
                // force-release says so in its audit record.
                if in_doubt
                    && !self.forced().await
                    && st
                        .tracker
                        .released_by_earlier_send(s.is_terminated(), answered)
                {
                    return Ok(());
                }
                Err(st.tracker.lose(LostReason::Revoked))
            }
            Err(Some(e)) if session_ended(&e) => {
                st.on_session_ended();
                Err(st.lost_error(LostReason::SessionEnded))
            }
            Err(Some(e)) => {
                st.tracker.mark_lost(LostReason::Released);
                // A refusal of the resend says nothing of the earlier send, which may have
                // deleted the node.
                let e = from_zk(ops::RELEASE, e);
                Err(if in_doubt {
                    ops::RELEASE.after_doubt(e)
                } else {
                    e
                })
            }
            Err(None) => {
                st.tracker.mark_lost(LostReason::Released);
                Err(timed_out(ops::RELEASE, s.request_timeout()))
            }
        }
    }
}

impl ZkLease {
    /// Whether a force-release removed our node, as its audit record says
    /// ([`forced_release_of`]). A read that fails says no (the release is then taken for done,
    /// as before).
    async fn forced(&self) -> bool {
        let st = &self.state;
        let key = st.tracker.key();
        match crate::operator::audit_records(&st.session, key, FORCED_LOOKBACK).await {
            Ok(records) => forced_release_of(&records, st.tracker.token()),
            Err(e) => {
                tracing::debug!(backend = BACKEND, key = %key, error = %e, "could not read the audit records after a release found its node gone");
                false
            }
        }
    }

    /// One send of the release's delete, within `left`: `Ok` when it deleted our node, else the
    /// client's error (`None`: no answer in time). A resend first waits for the session's
    /// connection to be back. A `BadVersion` (someone changed our node's data) is sent again
    /// without the version: the path is unique to this acquisition.
    async fn delete_node(
        &self,
        left: Duration,
        resend: bool,
    ) -> std::result::Result<(), Option<ZkError>> {
        let (st, s) = (&self.state, &self.state.session);
        let deadline = Instant::now() + left;
        if resend {
            s.wait_connected(left).await;
        }
        let mut version = Some(st.version);
        loop {
            let sent = Instant::now();
            let left = deadline.saturating_duration_since(sent);
            match tokio::time::timeout(left, s.coalesced().delete(&st.path, version)).await {
                Ok(Ok(())) => {
                    s.confirm(sent);
                    return Ok(());
                }
                Ok(Err(ZkError::BadVersion)) if version.is_some() => {
                    s.confirm(sent);
                    version = None;
                }
                Ok(Err(e)) => {
                    if e == ZkError::NoNode {
                        s.confirm(sent);
                    }
                    return Err(Some(e));
                }
                Err(_) => return Err(None),
            }
        }
    }
}

/// Deletes every node of the lock with the attempt's prefix.
///
/// The listing goes behind a `sync`, so it sees the attempt's create whatever happened to its
/// answer. Requests of one session on one connection are processed in order, but a create sent
/// on a connection that was then lost may still be committed after the client reconnected to
/// another server, and a listing there alone could be answered before that server applied it,
/// leaving a node nobody holds first in the queue for as long as the session lives. The
/// leader answers the sync only after every proposal before it is committed, and the server
/// applies them before passing the answer on.
pub(crate) async fn cleanup(s: Arc<Session>, dir: String, prefix: String) {
    let backoff = Backoff::new(Duration::from_millis(10), s.timeout() / 4);
    let failures = CleanupFailures::new(BACKEND, &format!("{dir}/{prefix}"));
    let what = "deleting an abandoned contender node";
    retry_until_settled(backoff, None, || async {
        // Waiting for the connection is not a failed try: no backoff after it.
        while !s.is_connected() {
            if s.is_terminated() {
                return ControlFlow::Break(());
            }
            s.wait_connected(s.timeout()).await;
        }
        let children = match s
            .synced_read(Instant::now(), |c| c.list_children(&dir))
            .await
        {
            Some(Ok(c)) => c,
            Some(Err(ZkError::NoNode)) => return ControlFlow::Break(()),
            Some(Err(e)) if session_ended(&e) => return ControlFlow::Break(()),
            Some(Err(e)) => {
                failures.failed(what, &from_zk(ops::CLEANUP_LIST, e));
                return ControlFlow::Continue(());
            }
            None => {
                failures.failed(what, &timed_out(ops::CLEANUP_LIST, s.request_timeout()));
                return ControlFlow::Continue(());
            }
        };
        let mut done = ControlFlow::Break(());
        for name in children.into_iter().filter(|c| c.starts_with(&prefix)) {
            let path = format!("{dir}/{name}");
            match tokio::time::timeout(s.request_timeout(), s.client().delete(&path, None)).await {
                Ok(Ok(())) | Ok(Err(ZkError::NoNode)) => {
                    tracing::debug!(%path, "removed an abandoned contender node");
                }
                Ok(Err(e)) if session_ended(&e) => return ControlFlow::Break(()),
                Ok(Err(e)) => {
                    failures.failed(what, &from_zk(ops::CLEANUP, e));
                    done = ControlFlow::Continue(());
                }
                Err(_) => {
                    failures.failed(what, &timed_out(ops::CLEANUP, s.request_timeout()));
                    done = ControlFlow::Continue(());
                }
            }
        }
        done
    })
    .await;
}
