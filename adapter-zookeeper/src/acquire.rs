//! The lock recipe on ZooKeeper: contender nodes, turns, the grant.
//!
//! # Acquire (round trips)
//!
//! 1. `create` an ephemeral sequential node `<lock>/c-<client>-<attempt>-` (1 RTT; 2 more the
//!    first time a lock is used or after its container node was removed: create the lock node,
//!    create again). Its `Stat` carries the czxid: the token.
//! 2. `getChildren` of the lock (1 RTT). Contenders are ordered by their sequence numbers parsed
//!    as integers, or by czxid (one more multi-read) once a sequence has wrapped negative. First
//!    means held.
//! 3. Otherwise watch only the predecessor (`exists` with a watch, 1 RTT) and go back to 2 when it
//!    changes or the wait bound passes. A waiter right behind the holder also watches its own
//!    node (the two `exists` pipelined) and takes its turn from the holder's deletion event
//!    without going back to 2 (see `wait_turn`; decision 0028); its own node's watch becomes the
//!    lease's.
//!
//! So an uncontended acquire is 2 round trips, a release 1, a renew 2 requests pipelined (`sync`,
//! `exists`); the waiter right behind the holder holds as soon as the holder's deletion event
//! arrives, one further back needs 1 round trip to confirm. Under load, listings (2.) and
//! releases share requests ([`crate::coalesce`]).
//!
//! Only writes and syncs (answered through the leader) confirm the session; reads do not (see
//! [`crate::session`]).
//!
//! # Cancellation and outcomes not seen
//!
//! The node name's prefix is unique to one client and one attempt. If a create's answer is lost
//! (connection loss, request timeout), the adapter lists the lock's children and adopts its own
//! node instead of creating a second one. If the acquire ends in any other way than a lease
//! (error, timeout, the future dropped at any await point), a guard spawns a cleanup task that
//! lists the lock's children behind a `sync` and deletes every node with the attempt's prefix;
//! the create was sent before the sync, so the listing sees it whatever happened to its answer,
//! also after a reconnect to another server. Without a runtime to spawn on, or if the process dies, the session's end removes the
//! node (at most one session timeout later).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lease_core::adapter::{ended_during_acquire, HolderRecord, LeaseTracker};
use lease_core::{Error, Lease, LeaseOptions, LeaseStatus, LockKey, Result, Token};
use tokio::time::Instant;
use zookeeper_client::{CreateMode, Error as ZkError, EventType, MultiReadResult, WatchedEvent};

use crate::coordinator::ZkCoordinator;
use crate::error::{
    connection_lost, disconnected, from_zk, ops, session_ended, timed_out, BACKEND,
};
use crate::keys::{
    contender_prefix, parse_contender, sequence_orders, sort_by_creation, Contender,
};
use crate::lease::{cleanup, LeaseState, NodeWatch, ZkLease};
use crate::session::Session;

/// How many times one acquire call starts over when its node vanished under it, or retries a
/// create whose answer was lost.
const MAX_RESTARTS: usize = 3;

/// What ended a waiter's wait on the watches.
enum Woke {
    /// An event on our own node.
    Own(WatchedEvent),
    /// An event on the predecessor.
    Predecessor(WatchedEvent),
    /// The wait bound passed.
    Deadline,
}

/// A contender node we created.
#[derive(Debug, Clone)]
struct Node {
    name: String,
    path: String,
    czxid: i64,
    version: i32,
}

enum Mode {
    Try,
    Wait(Instant),
}

impl Mode {
    /// Whether a waiter's bound has passed (never for `try_acquire`, which gives up at once by
    /// other means).
    fn expired(&self) -> bool {
        match self {
            Mode::Try => false,
            Mode::Wait(d) => Instant::now() >= *d,
        }
    }
}

enum Turn {
    /// First among the contenders: as a `getChildren` sent at `sent` in connection `epoch` saw,
    /// or (`watch` given) as the deletion of the holder we waited behind showed, our node
    /// having been seen, with `watch` set on it, by an `exists` sent at `sent`.
    Holder {
        sent: Instant,
        epoch: u64,
        watch: Option<NodeWatch>,
    },
    /// Not first, and not waiting (any more).
    Busy,
    /// Our node is gone (deleted by someone, or the lock node was removed).
    Vanished,
}

impl ZkCoordinator {
    /// `acquire` (`Some(wait)`: up to `wait`) and `try_acquire` (`None`), with `options`
    /// validated.
    pub(crate) async fn acquire_for(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Box<dyn Lease>> {
        let start = Instant::now();
        let mode = match wait {
            None => Mode::Try,
            Some(wait) => Mode::Wait(start + wait),
        };
        let data = HolderRecord::new(options, &self.inner.owner).to_json();
        let mut restarts = 0;
        // Whether a listing showed the key busy: only then is `Timeout` the answer at the wait
        // bound (decision 0036).
        let mut seen_busy = false;
        loop {
            let s = self.session().await?;
            if !s.is_connected() {
                return Err(disconnected(ops::ACQUIRE));
            }
            let dir = s.paths().lock_dir(key);
            let attempt = self.inner.attempts.fetch_add(1, Ordering::Relaxed);
            let prefix = contender_prefix(self.inner.client_id, attempt);
            let mut guard = ContenderGuard {
                session: Some(s.clone()),
                dir: dir.clone(),
                prefix: prefix.clone(),
                issued: false,
                unsure: false,
            };
            let node = self
                .create_contender(&s, &dir, &prefix, &data, &mut guard)
                .await?;
            tracing::debug!(%key, node = %node.path, "zookeeper contender node created: in the queue");
            let turn = self
                .wait_turn(
                    &s,
                    &dir,
                    &prefix,
                    &node,
                    &mode,
                    options.ttl_value(),
                    &mut seen_busy,
                )
                .await?;
            // `None`: our node is gone (deleted by someone, or the lock node was removed) before
            // the grant; start over.
            let granted = match turn {
                Turn::Holder { sent, epoch, watch } => match self.confirm_turn(&s, &node).await? {
                    false => None,
                    true => match self.check_token(&s, key, &node).await {
                        Ok(token) => Some((token, sent, epoch, watch)),
                        Err(None) => None,
                        Err(Some(e)) => {
                            self.withdraw(&s, &node, &mut guard).await;
                            return Err(e);
                        }
                    },
                },
                Turn::Busy => {
                    let withdraw = self.withdraw(&s, &node, &mut guard);
                    match mode {
                        Mode::Try => withdraw.await,
                        // Past its bound, a waiter does not wait a request timeout more for the
                        // delete: if it does not finish, the guard's cleanup removes the node in
                        // the background.
                        Mode::Wait(_) => {
                            let _ = tokio::time::timeout(WAIT_GRACE, withdraw).await;
                        }
                    }
                    return Err(busy(key, &mode, start));
                }
                Turn::Vanished => None,
            };
            let Some((token, sent, epoch, watch)) = granted else {
                restarts += 1;
                if restarts > MAX_RESTARTS {
                    // Not `Held` or `Timeout`: nothing showed the key busy; someone kept
                    // deleting what we queued with.
                    return Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "acquire: our contender node under {dir} was gone before its \
                             grant {restarts} times (deleted by an operator or another client, \
                             or the lock node removed); nothing is held"
                        ),
                    ));
                }
                if mode.expired() {
                    if seen_busy {
                        return Err(busy(key, &mode, start));
                    }
                    return Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "acquire: the wait ended after {:?} with our contender node under \
                             {dir} gone before its grant; the key was not seen busy",
                            start.elapsed()
                        ),
                    ));
                }
                tracing::debug!(key = %key, node = %node.path, "contender node gone before its grant; starting over");
                continue;
            };
            let ttl = options.ttl_value();
            let margin = options.drift_margin_for(ttl);
            let tracker = LeaseTracker::new(BACKEND, key.clone(), token, ttl, margin, sent);
            // A create whose answer was lost may still leave a second node of this attempt
            // behind (applied late, shown late): the lease's end sweeps the prefix.
            let sweep = guard.unsure.then(|| (dir.clone(), prefix.clone()));
            let state = LeaseState::new(
                s.clone(),
                tracker,
                node.path,
                node.czxid,
                node.version,
                sent,
                sweep,
            );
            guard.session = None;
            let lease = ZkLease::start(state, epoch, watch);
            if let LeaseStatus::Lost(_) = lease.state().status() {
                // The session ended between the grant and the lease's registration: the node
                // went with it, and the caller gets no lease.
                return Err(ended_during_acquire(BACKEND));
            }
            return Ok(Box::new(lease));
        }
    }

    /// Whether our node, first among the contenders, is still there once the session is
    /// confirmed. A turn found soon after a reconnect or a pause comes from reads, which
    /// confirm nothing: the session's last confirmation may be too old for the lease to start
    /// held, and it would be handed back already lost. So the session is confirmed first (a
    /// `sync`, with a read of our node) when its bound is less than half a heartbeat period
    /// away; heartbeats keep it at least a period away while the link is up, so this costs
    /// nothing then.
    async fn confirm_turn(&self, s: &Session, node: &Node) -> Result<bool> {
        let heartbeat = crate::session::heartbeat_period(s.timeout());
        if s.bound() >= Instant::now() + heartbeat / 2 {
            return Ok(true);
        }
        match s.synced_exists(&node.path).await {
            Some(Ok(stat)) => Ok(stat.is_some()),
            Some(Err(e)) => Err(from_zk(ops::WAIT, e)),
            None => Err(timed_out(ops::WAIT, s.request_timeout())),
        }
    }

    /// Creates our contender node, adopting it if a lost answer hid that it was created.
    async fn create_contender(
        &self,
        s: &Arc<Session>,
        dir: &str,
        prefix: &str,
        data: &[u8],
        guard: &mut ContenderGuard,
    ) -> Result<Node> {
        let options = CreateMode::EphemeralSequential.with_acls(s.acls());
        let path_prefix = format!("{dir}/{prefix}");
        let mut tries = 0;
        loop {
            tries += 1;
            if !s.is_connected() {
                // After a create whose answer was lost, that create may have applied.
                return Err(if guard.unsure {
                    create_in_doubt()
                } else {
                    disconnected(ops::ACQUIRE)
                });
            }
            guard.issued = true;
            let sent = Instant::now();
            let answer = tokio::time::timeout(
                s.request_timeout(),
                s.client().create(&path_prefix, data, &options),
            )
            .await;
            // No answer: the create may have applied.
            let lost = match &answer {
                Ok(Err(e)) => connection_lost(e),
                Ok(Ok(_)) => false,
                Err(_) => true,
            };
            match answer {
                Ok(Ok((stat, sequence))) => {
                    s.confirm(sent);
                    let name = format!("{prefix}{sequence}");
                    return Ok(Node {
                        path: format!("{dir}/{name}"),
                        name,
                        czxid: stat.czxid,
                        version: stat.version,
                    });
                }
                Ok(Err(ZkError::NoNode)) if tries <= MAX_RESTARTS => {
                    s.confirm(sent);
                    let unsure = guard.unsure;
                    self.ensure_lock_dir(s, dir)
                        .await
                        .map_err(|e| after_doubt(unsure, e))?;
                }
                _ if lost && tries <= MAX_RESTARTS => {
                    // The create may have applied: look for our node before creating another.
                    // A server that does not show it yet lets the next create make a second
                    // node for this attempt; `wait_turn`, `withdraw` and the cleanup remove it.
                    guard.unsure = true;
                    let found = self.find_own(s, dir, prefix).await;
                    if let Some(node) = found.map_err(|e| after_doubt(true, e))? {
                        tracing::debug!(node = %node.path, "adopted a contender node whose create answer was lost");
                        return Ok(node);
                    }
                }
                Ok(Err(e)) => {
                    guard.unsure |= lost;
                    return Err(after_doubt(guard.unsure, from_zk(ops::ACQUIRE, e)));
                }
                Err(_) => {
                    guard.unsure = true;
                    return Err(timed_out(ops::ACQUIRE, s.request_timeout()));
                }
            }
        }
    }

    /// After a create whose answer was lost: our node, if the create applied.
    async fn find_own(&self, s: &Session, dir: &str, prefix: &str) -> Result<Option<Node>> {
        s.wait_connected(s.request_timeout()).await;
        if !s.is_connected() {
            return Err(create_in_doubt());
        }
        let children = match s.read(ops::ACQUIRE, s.client().list_children(dir)).await? {
            Ok(c) => c,
            Err(ZkError::NoNode) => return Ok(None),
            Err(e) => return Err(from_zk(ops::ACQUIRE, e)),
        };
        let Some(name) = children.into_iter().find(|c| c.starts_with(prefix)) else {
            return Ok(None);
        };
        let path = format!("{dir}/{name}");
        match s.read(ops::ACQUIRE, s.client().check_stat(&path)).await? {
            Ok(Some(stat)) => Ok(Some(Node {
                name,
                path,
                czxid: stat.czxid,
                version: stat.version,
            })),
            Ok(None) | Err(ZkError::NoNode) => Ok(None),
            Err(e) => Err(from_zk(ops::ACQUIRE, e)),
        }
    }

    /// Creates the lock's container node (and `<base>/locks` if it is missing).
    async fn ensure_lock_dir(&self, s: &Session, dir: &str) -> Result<()> {
        let options = CreateMode::Container.with_acls(s.acls());
        for _ in 0..2 {
            let sent = Instant::now();
            match tokio::time::timeout(s.request_timeout(), s.client().create(dir, &[], &options))
                .await
            {
                Err(_) => return Err(timed_out(ops::SETUP, s.request_timeout())),
                Ok(Ok(_)) | Ok(Err(ZkError::NodeExists)) => {
                    s.confirm(sent);
                    return Ok(());
                }
                Ok(Err(ZkError::NoNode)) => {
                    s.confirm(sent);
                    s.ensure_persistent(&s.paths().locks()).await?;
                }
                Ok(Err(e)) => return Err(from_zk(ops::SETUP, e)),
            }
        }
        Ok(())
    }

    /// Waits until our node is first (or the mode says stop). Another node with the attempt's
    /// `prefix` (a second create after a lost answer) is deleted when a listing shows it, so the
    /// attempt never queues behind itself.
    ///
    /// A waiter watches only its predecessor, so one waiter is woken per release. A waiter right
    /// behind the holder watches its own node too (both `exists` pipelined): no node can come
    /// before ours later (sequence numbers and creation order only grow), so the holder's
    /// deletion makes us first unless ours was deleted before it, and ZooKeeper delivers a
    /// session's watch events in the order of their transactions, ours first if it came first
    /// (not when one transaction deletes both, the holder's first: decision 0028's limit).
    /// That turn is taken without listing again (one round trip less on every hand-off) while
    /// the connection is the one the watches were set on and at least half of `ttl` is left
    /// since they were sent; otherwise the waiter lists again. `ever_busy` is set once a
    /// listing shows a contender ahead of ours.
    #[allow(clippy::too_many_arguments)]
    async fn wait_turn(
        &self,
        s: &Session,
        dir: &str,
        prefix: &str,
        node: &Node,
        mode: &Mode,
        ttl: Duration,
        ever_busy: &mut bool,
    ) -> Result<Turn> {
        // Whether a listing showed another contender ahead of our node: the key was seen busy
        // (also kept in `ever_busy`, across the call's restarts).
        let mut seen_busy = false;
        loop {
            let deadline = match mode {
                Mode::Try => None,
                Mode::Wait(d) => Some(*d),
            };
            let past = deadline.is_none_or(|d| Instant::now() >= d);
            // A request of a waiter that has seen the key busy gets the request timeout, but
            // never runs more than `WAIT_GRACE` past the wait bound: a partition must not keep a
            // waiter a request timeout (up to the session timeout) beyond it. The first listing
            // gets the request timeout: cut at the bound, a slow link would report a key it
            // never saw as busy (decision 0036).
            let request_bound = |seen_busy: bool| match deadline {
                Some(d) if seen_busy => s
                    .request_timeout()
                    .min(d.saturating_duration_since(Instant::now()) + WAIT_GRACE),
                _ => s.request_timeout(),
            };
            if !s.is_connected() {
                if s.is_terminated() {
                    return Err(from_zk(ops::WAIT, ZkError::SessionExpired));
                }
                if past {
                    return Err(disconnected(ops::WAIT));
                }
                let left = deadline
                    .map(|d| d.saturating_duration_since(Instant::now()))
                    .unwrap_or_default();
                s.wait_connected(left).await;
                continue;
            }
            let epoch = s.epoch();
            // Reads: they do not confirm the session (our create did).
            let sent = Instant::now();
            let list = s.coalesced().children(dir);
            let list_bound = request_bound(seen_busy);
            let children = match tokio::time::timeout(list_bound, list).await {
                Ok(Ok(children)) => children,
                Ok(Err(ZkError::NoNode)) => return Ok(Turn::Vanished),
                Ok(Err(e)) if session_ended(&e) => return Err(from_zk(ops::WAIT, e)),
                Ok(Err(ref e)) if connection_lost(e) && !past => {
                    // The state watcher may not have seen the disconnection yet: a short pause,
                    // not a spin, before looking again.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                // Not answered in time, and the bound has not passed since (`past` was read
                // before the listing): look again.
                Err(_) if deadline.is_some_and(|d| Instant::now() < d) => continue,
                Ok(Err(e)) => return Err(from_zk(ops::WAIT, e)),
                // A waiter past its bound that saw the key busy: it did not get the lock in time.
                Err(_) if deadline.is_some() && seen_busy => return Ok(Turn::Busy),
                Err(_) => return Err(timed_out(ops::WAIT, list_bound)),
            };
            let ordered = self.order(s, dir, children).await?;
            let Some(index) = ordered.iter().position(|c| c.name == node.name) else {
                return Ok(Turn::Vanished);
            };
            let duplicates: Vec<String> = ordered
                .iter()
                .filter(|c| c.name != node.name && c.name.starts_with(prefix))
                .map(|c| format!("{dir}/{}", c.name))
                .collect();
            if !duplicates.is_empty() {
                for path in duplicates {
                    self.delete_duplicate(s, &path).await?;
                }
                // Look again: the queue without them.
                continue;
            }
            if index == 0 {
                return Ok(Turn::Holder {
                    sent,
                    epoch,
                    watch: None,
                });
            }
            seen_busy = true;
            *ever_busy = true;
            let Some(deadline) = deadline.filter(|d| Instant::now() < *d) else {
                return Ok(Turn::Busy);
            };
            let predecessor = format!("{dir}/{}", ordered[index - 1].name);
            let sent = Instant::now();
            let own = async {
                if index == 1 {
                    Some(s.client().check_and_watch_stat(&node.path).await)
                } else {
                    None
                }
            };
            let watched = tokio::time::timeout(
                request_bound(seen_busy),
                futures::future::join(own, s.client().check_and_watch_stat(&predecessor)),
            )
            .await;
            let Ok((own, predecessor)) = watched else {
                // No answer: the next round waits for the connection.
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            };
            let mut own: Option<NodeWatch> = match own {
                Some(Ok((Some(stat), watcher))) if stat.czxid == node.czxid => {
                    Some(Box::pin(watcher.changed()))
                }
                Some(Ok(_)) => return Ok(Turn::Vanished),
                Some(Err(e)) if session_ended(&e) => return Err(from_zk(ops::WAIT, e)),
                // Not right behind the holder, or the watch could not be set: list again on
                // the predecessor's event.
                Some(Err(_)) | None => None,
            };
            let predecessor = match predecessor {
                Ok((Some(_), watcher)) => watcher,
                // Gone already: look again.
                Ok((None, _)) => continue,
                Err(e) if session_ended(&e) => return Err(from_zk(ops::WAIT, e)),
                // Connection trouble: the next round waits for the connection.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
            };
            let woke = tokio::select! {
                // Our node's event first: it is delivered before a later one of the holder's.
                biased;
                e = async { own.as_mut().expect("guarded").await }, if own.is_some() => {
                    Woke::Own(e)
                }
                e = predecessor.changed() => Woke::Predecessor(e),
                _ = tokio::time::sleep_until(deadline) => Woke::Deadline,
            };
            match woke {
                Woke::Own(e) if e.event_type == EventType::NodeDeleted => {
                    return Ok(Turn::Vanished)
                }
                Woke::Predecessor(e)
                    if e.event_type == EventType::NodeDeleted
                        && own.is_some()
                        && s.epoch() == epoch
                        && s.is_connected()
                        && Instant::now() < sent + ttl / 2 =>
                {
                    return Ok(Turn::Holder {
                        sent,
                        epoch,
                        watch: own,
                    });
                }
                // Anything else (a data change, a session event, the wait bound): look again.
                Woke::Own(_) | Woke::Predecessor(_) | Woke::Deadline => {}
            }
        }
    }

    /// Orders the lock's contenders by creation.
    pub(crate) async fn order(
        &self,
        s: &Session,
        dir: &str,
        children: Vec<String>,
    ) -> Result<Vec<Contender>> {
        let mut contenders: Vec<Contender> =
            children.iter().filter_map(|n| parse_contender(n)).collect();
        if !sequence_orders(&contenders) {
            // The parent's counter wrapped: order by creation zxid instead (one multi-read).
            let paths: Vec<String> = contenders
                .iter()
                .map(|c| format!("{dir}/{}", c.name))
                .collect();
            let results = {
                let mut reader = s.client().new_multi_reader();
                for p in &paths {
                    reader.add_get_data(p).map_err(|e| from_zk(ops::WAIT, e))?;
                }
                match s.read(ops::WAIT, reader.commit()).await? {
                    Ok(r) => r,
                    Err(e) => return Err(from_zk(ops::WAIT, e)),
                }
            };
            if results.len() != paths.len() {
                // The client library does not check the count: a contender left without an
                // answer could be the holder.
                return Err(from_zk(
                    ops::WAIT,
                    ZkError::UnexpectedError(format!(
                        "a multi-read of {} contenders got {} answers",
                        paths.len(),
                        results.len()
                    )),
                ));
            }
            for (c, r) in contenders.iter_mut().zip(results) {
                match r {
                    MultiReadResult::Data { stat, .. } => c.czxid = Some(stat.czxid),
                    // Deleted since the listing: no longer a contender.
                    MultiReadResult::Error {
                        err: ZkError::NoNode,
                    } => {}
                    // Any other failure (a node whose ACL hides it from us, say) leaves its
                    // place unknown: it may be the holder, so no order is claimed without it.
                    MultiReadResult::Error { err } => return Err(from_zk(ops::WAIT, err)),
                    _ => {
                        return Err(from_zk(
                            ops::WAIT,
                            ZkError::UnexpectedError(
                                "a multi-read answered a get with a listing".into(),
                            ),
                        ))
                    }
                }
            }
            contenders.retain(|c| c.czxid.is_some());
        }
        sort_by_creation(&mut contenders);
        Ok(contenders)
    }

    /// Deletes a second node of this attempt (see [`Self::wait_turn`]). A failure fails the
    /// acquire; the guard's cleanup removes what is left.
    async fn delete_duplicate(&self, s: &Session, path: &str) -> Result<()> {
        let sent = Instant::now();
        match tokio::time::timeout(s.request_timeout(), s.client().delete(path, None)).await {
            Ok(Ok(()) | Err(ZkError::NoNode)) => {
                s.confirm(sent);
                tracing::debug!(%path, "removed a second contender node of the same attempt");
                Ok(())
            }
            Ok(Err(e)) => Err(from_zk(ops::ACQUIRE, e)),
            Err(_) => Err(timed_out(ops::ACQUIRE, s.request_timeout())),
        }
    }

    /// Deletes every node of the attempt when we give up (busy, failed token check): our node
    /// and, pipelined behind it (answered after the delete), a listing of the
    /// lock's children; any other node with the attempt's prefix (a second create after a lost
    /// answer, shown late) is deleted too. Only when all of them are confirmed gone is the
    /// guard disarmed; otherwise its cleanup task finishes the job.
    async fn withdraw(&self, s: &Session, node: &Node, guard: &mut ContenderGuard) {
        if !s.is_connected() {
            return;
        }
        let sent = Instant::now();
        let delete = s.client().delete(&node.path, None);
        let list = s.client().list_children(&guard.dir);
        let Ok((deleted, listed)) =
            tokio::time::timeout(s.request_timeout(), futures::future::join(delete, list)).await
        else {
            return;
        };
        if !matches!(deleted, Ok(()) | Err(ZkError::NoNode)) {
            return;
        }
        s.confirm(sent);
        let others: Vec<String> = match listed {
            Ok(children) => children
                .into_iter()
                .filter(|c| c.starts_with(&guard.prefix) && *c != node.name)
                .collect(),
            Err(ZkError::NoNode) => Vec::new(),
            Err(_) => return,
        };
        for name in others {
            let path = format!("{}/{name}", guard.dir);
            if self.delete_duplicate(s, &path).await.is_err() {
                return;
            }
        }
        if guard.unsure {
            // A create of this attempt may still be applied after this listing: the cleanup
            // task (which runs after the acquire returns) looks once more.
            return;
        }
        guard.session = None;
    }

    /// The token of the node we hold, checked against the floor and this process's high-water
    /// mark. `Err(None)`: our node vanished meanwhile, start over.
    async fn check_token(
        &self,
        s: &Session,
        key: &LockKey,
        node: &Node,
    ) -> std::result::Result<Token, Option<Error>> {
        let tokens = &self.inner.tokens;
        match tokens.check(key, node.czxid) {
            Ok(_) => {}
            // A later token was granted in this process. Either our node was deleted after we saw
            // it first (and someone else got the lock), or the ensemble's state went backwards.
            Err(regression @ Error::TokenRegression { floor: bound, .. })
                if Some(bound) != tokens.floor() =>
            {
                return match s.read(ops::WAIT, s.client().check_stat(&node.path)).await {
                    Ok(Ok(Some(stat))) if stat.czxid == node.czxid => Err(Some(regression)),
                    Ok(Ok(_)) => Err(None),
                    Ok(Err(e)) => Err(Some(from_zk(ops::WAIT, e))),
                    Err(e) => Err(Some(e)),
                };
            }
            Err(e) => return Err(Some(e)),
        }
        tokens.admit(key, node.czxid).map_err(Some)
    }
}

fn busy(key: &LockKey, mode: &Mode, start: Instant) -> Error {
    match mode {
        Mode::Try => Error::Held {
            key: key.to_string(),
        },
        Mode::Wait(_) => Error::Timeout {
            key: key.to_string(),
            waited: start.elapsed(),
        },
    }
}

/// The error of an acquire whose contender `create` got no answer and whose node could not be
/// looked for since (the connection is down): the create may have applied.
fn create_in_doubt() -> Error {
    Error::OutcomeUnknown {
        backend: BACKEND,
        operation: ops::ACQUIRE.name,
        message: "the connection was lost while creating the contender node; it is removed in \
                  the background if it was created"
            .into(),
        source: None,
    }
}

/// An acquire's error `e`, saying the outcome is unknown when an earlier create of the attempt
/// got no answer (`unsure`): that create may have applied.
fn after_doubt(unsure: bool, e: Error) -> Error {
    if unsure {
        ops::ACQUIRE.after_doubt(e)
    } else {
        e
    }
}

/// How far past its wait bound one request of a waiter may run (see `wait_turn`).
const WAIT_GRACE: Duration = Duration::from_millis(100);

/// Removes an acquisition attempt's node(s) when the attempt ends without a lease, however it
/// ends (error, timeout, the future dropped).
struct ContenderGuard {
    /// `None` once disarmed (the node became a lease, or is confirmed deleted).
    session: Option<Arc<Session>>,
    dir: String,
    prefix: String,
    /// Whether a create was sent.
    issued: bool,
    /// Whether a create's answer was lost (so a second node of the attempt may exist).
    unsure: bool,
}

impl Drop for ContenderGuard {
    fn drop(&mut self) {
        let Some(s) = self.session.take() else { return };
        if !self.issued {
            return;
        }
        let (dir, prefix) = (
            std::mem::take(&mut self.dir),
            std::mem::take(&mut self.prefix),
        );
        let cleanups = s.cleanups().clone();
        if !cleanups.spawn(cleanup(s, dir.clone(), prefix.clone())) {
            tracing::debug!(
                %dir, %prefix,
                "no runtime to clean up an abandoned contender node; the session's end removes it"
            );
        }
    }
}
