//! One ZooKeeper session per coordinator: connection state, the session-validity bound, and the
//! registry of live leases that connection events update.
//!
//! # What the session tells a lease
//!
//! A lease's node is ephemeral: the leader expires the session (and deletes the node) no earlier
//! than one negotiated session timeout `T` after it last heard of the client (it rounds expiry
//! *up* to its tick). Only an answer that passed through the leader proves that: a `sync`, or a
//! write (create, delete, and their `NoNode`/`NodeExists`/`BadVersion` refusals, which the
//! leader decides). An answer to a request sent at `s` proves that the session was alive and
//! touched at or after `s`, so the node lives at least until `s + T` unless someone deletes it.
//! A plain read proves nothing of the kind: in an ensemble, a follower cut off from the leader
//! keeps answering reads (for up to `syncLimit × tickTime`) while the leader expires the session,
//! so reads never confirm. The session keeps the largest confirmed `s` ("confirmed"), a heartbeat
//! (a `sync` every `T / 6`, [`heartbeat_period`]) keeps it fresh while connected, and `renew`
//! and the post-reconnect check send a `sync` pipelined in front of their `exists`
//! ([`Session::synced_exists`]); every lease's local validity is capped at
//! `confirmed + T − session margin − drift margin`, where the session margin (one `tickTime`
//! plus the heartbeat period, see [`session_margin`]) covers a follower's session-touch lag,
//! and never later than `T` after the latest confirmation answered a tick before `confirmed`
//! (which the margin alone does not cover after a pause of the process, [`Touches::bound`]).
//!
//! Connection events:
//!
//! - `Disconnected`: every live lease becomes in doubt at once ([`LeaseStatus::InDoubt`]); its
//!   validity stays capped by the last confirmation, so it is lost when that runs out.
//! - `SyncConnected` after a disconnect: each in-doubt lease checks that its node still exists
//!   (`sync` + `exists`, pipelined, each) and is held again if so, lost (`Revoked`) if not.
//! - `Expired`, `Closed`, `AuthFailed`: every live lease is lost (`SessionEnded`); the coordinator
//!   opens a new session on its next call.
//!
//! The connection epoch (bumped by every connect and disconnect) guards the transitions: an answer
//! to a request sent before a disconnect never marks a lease held again after it.
//!
//! [`LeaseStatus::InDoubt`]: lease_core::LeaseStatus::InDoubt

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lease_core::adapter::{Cleanups, DelayedStarts, Dependents, Op};
use lease_core::Result;
use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client::{
    Acl, Acls, Client, CreateMode, Error as ZkError, Permission, SessionState, StateWatcher,
};

use crate::client::open;
use crate::coalesce::Coalesced;
use crate::config::ZkConfig;
use crate::error::{from_zk, ops, timed_out};
use crate::keys::Paths;

/// The ACL of every node the adapter creates when digest credentials are configured: the
/// creator's identity (every session authenticated as the same digest user) may do anything,
/// everyone else may only read.
static SECURED_ACL: [Acl; 2] = [
    Acl::new_const(Permission::ALL, "auth", ""),
    Acl::new_const(Permission::READ, "world", "anyone"),
];

#[derive(Debug)]
struct ConnState {
    connected: bool,
    terminated: bool,
    epoch: u64,
    /// The requests answered through the leader (a `sync` or a write).
    touches: Touches,
}

/// The session's confirmations (requests answered through the leader), as much of them as the
/// session bound needs (decision 0017).
#[derive(Debug)]
struct Touches {
    /// The send time of the latest.
    confirmed: Instant,
    /// Those answered less than a tick before `confirmed`, in the order answered. Those
    /// answered within a 64th of a tick of the first of a group are merged into it (its latest
    /// send, counted from its latest answer: later than each alone, never sooner), so a tick
    /// holds about 64 at most; one sent no later than the last is left out.
    recent: VecDeque<Touch>,
    /// The latest send among the others: the leader has heard of a touch at least this late.
    settled: Instant,
    tick: Duration,
}

/// One confirmation, or a group of them answered close together ([`Touches::recent`]).
#[derive(Debug, Clone, Copy)]
struct Touch {
    /// The latest send.
    sent: Instant,
    /// The latest answer.
    answered: Instant,
    /// The first answer of the group: what later answers are compared with, so a steady stream
    /// of answers makes new groups rather than one that never ages.
    opened: Instant,
}

impl Touches {
    /// After the session's creation (or its adoption's `sync`) sent at `sent`: the leader
    /// touched it then (or, adopted, its client library kept pinging it).
    fn new(sent: Instant, tick: Duration) -> Touches {
        Touches {
            confirmed: sent,
            recent: VecDeque::new(),
            settled: sent,
            tick,
        }
    }

    /// A request sent at `sent` was answered through the leader at `answered`.
    fn confirm(&mut self, sent: Instant, answered: Instant) {
        self.confirmed = self.confirmed.max(sent);
        match self.recent.back_mut() {
            Some(back) if sent <= back.sent => {}
            Some(back) if answered.saturating_duration_since(back.opened) < self.tick / 64 => {
                back.sent = sent;
                back.answered = answered;
            }
            _ => self.recent.push_back(Touch {
                sent,
                answered,
                opened: answered,
            }),
        }
        let Some(horizon) = self.confirmed.checked_sub(self.tick) else {
            return;
        };
        while let Some(&touch) = self.recent.front() {
            if touch.answered > horizon {
                break;
            }
            self.settled = self.settled.max(touch.sent);
            self.recent.pop_front();
        }
    }

    /// The session bound: `confirmed + T − margin` ([`session_margin`]), and never later than
    /// `T` after the latest touch answered at least a tick before `confirmed` was sent. The
    /// margin counts on our touches being at most a heartbeat period apart, which a pause of the
    /// process breaks: the follower that answered the first `sync` after it may be cut off
    /// before it passes that touch on, and the leader then knows only of one answered before
    /// the pause. A touch answered a tick before `confirmed` reached the follower before that,
    /// and a follower passes touches on at every ping (twice a tick).
    fn bound(&self, timeout: Duration, margin: Duration) -> Instant {
        let capped = lease_core::adapter::clock::valid_until(self.confirmed, timeout, margin);
        capped.min(lease_core::adapter::clock::valid_until(
            self.settled,
            timeout,
            Duration::ZERO,
        ))
    }
}

/// How long after its grant a lease without a watch on its node gets its guardian (which then
/// sets the watch): a lease released before then costs no task, no watch and no wake-up of
/// another thread at its release (the client library does not disable Nagle either, so a watch
/// request sent right behind the release would cost a second round trip). A tenth of the
/// session timeout when that is shorter. An outside deletion of a newer lease's node is seen up
/// to this much later; `renew` checks the node in any case.
pub(crate) const GUARD_DELAY: Duration = Duration::from_millis(20);

/// A live ZooKeeper session and what depends on it.
pub(crate) struct Session {
    client: Client,
    timeout: Duration,
    /// What the session bound leaves for a follower's session-touch lag: `tick + heartbeat`
    /// (see [`session_margin`]).
    margin: Duration,
    request_timeout: Duration,
    secured: bool,
    paths: Paths,
    conn: Mutex<ConnState>,
    /// `(connected, terminated)`, for tasks that wait for the connection to come back.
    link: watch::Sender<(bool, bool)>,
    leases: Dependents<Weak<dyn SessionLease>>,
    /// Lock listings and releases, sent together under load ([`crate::coalesce`]).
    coalesced: Coalesced,
    /// The guardians of leases still held [`GUARD_DELAY`] after their grant.
    guardians: DelayedStarts,
    /// The coordinator's clean-ups under way (shared by its sessions), which `settle` waits for.
    cleanups: Cleanups,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.client.session_id())
            .field("timeout", &self.timeout)
            .field("conn", &*self.conn())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Opens a session (bounded by the connect timeout) within `chroot` (`/` for none), makes
    /// sure `<base>/locks` exists, and starts the state and heartbeat tasks.
    pub(crate) async fn connect(
        config: &ZkConfig,
        chroot: &str,
        cleanups: Cleanups,
    ) -> Result<Arc<Session>> {
        // The session's creation is its first confirmation (the leader's own touch).
        let (client, sent) = open(config, chroot).await?;
        Self::start(config, client, sent, cleanups).await
    }

    /// A session on a client the application opened. When its session was last confirmed is
    /// not known, so a `sync` (which passes through the leader) confirms it first; then as
    /// [`Session::connect`].
    pub(crate) async fn adopt(
        config: &ZkConfig,
        client: Client,
        cleanups: Cleanups,
    ) -> Result<Arc<Session>> {
        let sent = Instant::now();
        match tokio::time::timeout(config.request_timeout(), client.sync(&config.base_path())).await
        {
            Ok(Ok(())) => Self::start(config, client, sent, cleanups).await,
            Ok(Err(e)) => Err(from_zk(ops::ADOPT, e)),
            Err(_) => Err(timed_out(ops::ADOPT, config.request_timeout())),
        }
    }

    /// Checks the negotiated timeout, makes sure `<base>/locks` exists and starts the state and
    /// heartbeat tasks, on a client whose session was confirmed at `sent`; its clean-ups count
    /// among the coordinator's `cleanups`.
    async fn start(
        config: &ZkConfig,
        client: Client,
        sent: Instant,
        cleanups: Cleanups,
    ) -> Result<Arc<Session>> {
        let hosts = config.connect_string();
        let timeout = client.session_timeout();
        let tick = config.tick().unwrap_or(timeout / 2);
        let margin = match session_margin(timeout, config.tick()) {
            Ok(m) => m,
            Err(problem) => {
                drop(client); // closes the session
                return Err(lease_core::Error::misconfigured(
                    crate::error::BACKEND,
                    problem,
                ));
            }
        };
        let state_watcher = client.state_watcher();
        let (link, _) = watch::channel((true, false));
        let session = Arc::new(Session {
            timeout,
            margin,
            coalesced: Coalesced::new(&client, config.request_timeout(), &config.base_path()),
            client,
            request_timeout: config.request_timeout(),
            secured: config.digest_auth().is_some(),
            paths: Paths::new(&config.base_path()),
            conn: Mutex::new(ConnState {
                connected: true,
                terminated: false,
                epoch: 0,
                touches: Touches::new(sent, tick),
            }),
            link,
            leases: Dependents::new(),
            guardians: {
                let delay = GUARD_DELAY.min(timeout / 10);
                DelayedStarts::new(delay, delay / 2)
            },
            cleanups,
        });
        tracing::debug!(
            session = %session.client.session_id(),
            timeout = ?session.timeout,
            hosts = %hosts,
            "zookeeper session established"
        );
        // Observers without credentials may not create (not even an existing node), so look
        // first. A read confirms nothing (the session's creation did).
        let locks = session.paths.locks();
        match tokio::time::timeout(session.request_timeout, session.client.check_stat(&locks)).await
        {
            Ok(Ok(Some(_))) => {}
            _ => session.ensure_persistent(&locks).await?,
        }
        tokio::spawn(watch_state(Arc::downgrade(&session), state_watcher));
        tokio::spawn(heartbeat(Arc::downgrade(&session)));
        Ok(session)
    }

    fn conn(&self) -> MutexGuard<'_, ConnState> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The client library's handle.
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// Where a lease granted without a watch on its node queues its guardian's start.
    pub(crate) fn guardians(&self) -> &DelayedStarts {
        &self.guardians
    }

    /// The coordinator's clean-ups under way, which `settle` waits for.
    pub(crate) fn cleanups(&self) -> &Cleanups {
        &self.cleanups
    }

    /// The session's coalesced lock listings and releases ([`crate::coalesce`]).
    pub(crate) fn coalesced(&self) -> &Coalesced {
        &self.coalesced
    }

    /// The negotiated session timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The bound on one request's answer.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The paths under the base node.
    pub(crate) fn paths(&self) -> &Paths {
        &self.paths
    }

    /// The ACL for new nodes.
    pub(crate) fn acls(&self) -> Acls<'static> {
        if self.secured {
            Acls::new(&SECURED_ACL)
        } else {
            Acls::anyone_all()
        }
    }

    /// Whether the connection is up now (a call made now is sent at once).
    pub(crate) fn is_connected(&self) -> bool {
        matches!(
            self.client.state(),
            SessionState::SyncConnected | SessionState::ConnectedReadOnly
        ) && !self.conn().terminated
    }

    /// Whether the session is over for good.
    pub(crate) fn is_terminated(&self) -> bool {
        self.conn().terminated || self.client.state().is_terminated()
    }

    /// The connection epoch now.
    pub(crate) fn epoch(&self) -> u64 {
        self.conn().epoch
    }

    /// Records that the leader answered a request sent at `sent`: a `sync` or a write, never a
    /// plain read (a follower cut off from the leader still answers reads).
    pub(crate) fn confirm(&self, sent: Instant) {
        let answered = Instant::now();
        self.conn().touches.confirm(sent, answered);
    }

    /// Sends `sync(<base>)` and then the read `read` makes, pipelined (the client library sends
    /// a request when its method is called, in call order), and waits for both within the request
    /// timeout. On the wire that is usually two round trips: the library writes each request on
    /// its own and does not disable Nagle, so the read leaves once the sync is acknowledged
    /// (docs/bench/performance.md, 2026-12-07). The server answers the read only after the
    /// sync, so the read sees at least the leader's state when it took the sync; the sync's
    /// answer comes from the leader, so it confirms the session with `sent` (read by the caller
    /// before calling). A failed sync confirms nothing and its error is returned whatever the
    /// read's answer. `None`: the request timeout passed first.
    pub(crate) async fn synced_read<'a, T, F>(
        &'a self,
        sent: Instant,
        read: impl FnOnce(&'a Client) -> F,
    ) -> Option<std::result::Result<T, zookeeper_client::Error>>
    where
        F: std::future::Future<Output = std::result::Result<T, zookeeper_client::Error>>,
    {
        let sync = self.client.sync(self.paths.base());
        let read = read(&self.client);
        let (synced, answer) =
            tokio::time::timeout(self.request_timeout, futures::future::join(sync, read))
                .await
                .ok()?;
        match synced {
            Ok(()) => {
                self.confirm(sent);
                Some(answer)
            }
            Err(e) => Some(Err(e)),
        }
    }

    /// Whether the node at `path` exists, read behind a `sync` sent after this call ([`Coalesced`]:
    /// under load, one `sync` for many checks), waiting at most the request timeout; the `sync`
    /// confirms the session if it succeeds. `None`: the request timeout passed first.
    pub(crate) async fn synced_exists(
        &self,
        path: &str,
    ) -> Option<std::result::Result<Option<zookeeper_client::Stat>, zookeeper_client::Error>> {
        let checked =
            tokio::time::timeout(self.request_timeout, self.coalesced.synced_exists(path))
                .await
                .ok()?;
        Some(checked.map(|(synced, stat)| {
            self.confirm(synced);
            stat
        }))
    }

    /// Runs `f` with the session bound ([`Touches::bound`]) if the connection is up and still in
    /// `epoch`; `None` otherwise.
    pub(crate) fn with_epoch<R>(&self, epoch: u64, f: impl FnOnce(Instant) -> R) -> Option<R> {
        let c = self.conn();
        if c.connected && !c.terminated && c.epoch == epoch {
            Some(f(c.touches.bound(self.timeout, self.margin)))
        } else {
            None
        }
    }

    /// The session bound now: no ephemeral node of this session disappears by expiry before it.
    pub(crate) fn bound(&self) -> Instant {
        self.conn().touches.bound(self.timeout, self.margin)
    }

    /// Waits (at most `max`) until the connection is up or the session is over, as the client
    /// library's state says. A request can fail with the connection lost before the state
    /// watcher has seen the disconnection (the link still says up), so every change of the link
    /// is checked against the client's state, not taken for it.
    pub(crate) async fn wait_connected(&self, max: Duration) {
        let mut rx = self.link.subscribe();
        let _ = tokio::time::timeout(max, async {
            while !(self.is_connected() || self.is_terminated()) {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }

    /// Registers the live lease `id` for connection events; `false` once the session is over
    /// (the lease is lost: its node went with the session).
    pub(crate) fn register(&self, id: u64, lease: Weak<dyn SessionLease>) -> bool {
        self.leases.insert(id, lease)
    }

    /// Forgets a lease (its guardian ended).
    pub(crate) fn unregister(&self, id: u64) {
        self.leases.remove(id);
    }

    /// Runs one read request with the request timeout. It does not confirm the session: the
    /// server that answers a read may be a follower cut off from the leader. The outer error is
    /// the adapter's (timed out); the inner result is the server's answer.
    pub(crate) async fn read<T>(
        &self,
        op: Op,
        request: impl std::future::Future<Output = std::result::Result<T, ZkError>>,
    ) -> Result<std::result::Result<T, ZkError>> {
        tokio::time::timeout(self.request_timeout(), request)
            .await
            .map_err(|_| timed_out(op, self.request_timeout()))
    }

    /// Creates `path` and its missing ancestors as persistent nodes with the adapter's ACL.
    pub(crate) async fn ensure_persistent(&self, path: &str) -> Result<()> {
        let options = CreateMode::Persistent.with_acls(self.acls());
        let sent = Instant::now();
        match tokio::time::timeout(self.request_timeout, self.client.mkdir(path, &options)).await {
            Err(_) => Err(timed_out(ops::SETUP, self.request_timeout)),
            Ok(Ok(())) => {
                self.confirm(sent);
                Ok(())
            }
            Ok(Err(e)) => Err(from_zk(ops::SETUP, e)),
        }
    }

    fn on_disconnected(&self) {
        // The leases are listed under the connection's lock: a lease registered after the list
        // is taken checks the epoch under the same lock (`with_epoch`), and so finds it moved.
        // Listed before the lock, a lease granted in between was neither marked in doubt nor
        // refused by the epoch, and stayed held with the link down.
        let mut c = self.conn();
        let leases = self.leases.live();
        c.connected = false;
        c.epoch += 1;
        for l in &leases {
            l.disconnected();
        }
        drop(c);
        self.link.send_replace((false, false));
        if !leases.is_empty() {
            tracing::info!(
                session = %self.client.session_id(),
                leases = leases.len(),
                "zookeeper connection lost: leases are in doubt until the session reconnects"
            );
        }
    }

    fn on_connected(self: &Arc<Self>) {
        let (epoch, leases) = {
            let mut c = self.conn();
            let leases = self.leases.live();
            if c.connected {
                // The client library reports changes of state only, in a channel that keeps the
                // latest: connected again while we thought we were means the `Disconnected`
                // before it was replaced before this task read it (the process was paused, say).
                // The connection the leases and a waiter's watches were confirmed on is gone
                // all the same: a new epoch, and the leases in doubt until verified.
                tracing::info!(
                    session = %self.client.session_id(),
                    "zookeeper connection replaced without its loss being seen"
                );
                for l in &leases {
                    l.disconnected();
                }
            }
            c.connected = true;
            c.epoch += 1;
            (c.epoch, leases)
        };
        self.link.send_replace((true, false));
        if !leases.is_empty() {
            tokio::spawn(async move {
                futures::future::join_all(leases.into_iter().map(|l| l.reconnected(epoch))).await;
            });
        }
    }

    fn on_terminated(&self, state: SessionState) {
        let leases: Vec<_> = (self.leases.close().into_iter().flatten())
            .filter_map(|l| l.upgrade())
            .collect();
        {
            let mut c = self.conn();
            c.connected = false;
            c.terminated = true;
            c.epoch += 1;
        }
        self.link.send_replace((false, true));
        for l in &leases {
            l.session_ended();
        }
        tracing::warn!(
            session = %self.client.session_id(),
            %state,
            leases = leases.len(),
            "zookeeper session ended: its leases are lost; the next call opens a new session"
        );
    }

    /// Refreshes the validity of every held lease after a heartbeat answered in `epoch`.
    fn refresh(&self, epoch: u64) {
        let leases = self.leases.live();
        self.with_epoch(epoch, |bound| {
            for l in &leases {
                l.refresh(bound);
            }
        });
    }
}

/// What a session tells each lease it holds about its connection (implemented by the lease's
/// state in `lease.rs`; the session knows leases only through this, so it does not depend on
/// them).
pub(crate) trait SessionLease: Send + Sync {
    /// The connection was lost: the lease is in doubt until it is back.
    fn disconnected(&self);
    /// The connection is back in `epoch`: confirm the lease's node, and hold it again.
    fn reconnected(self: Arc<Self>, epoch: u64) -> futures::future::BoxFuture<'static, ()>;
    /// A heartbeat was answered: the session is alive until `bound`.
    fn refresh(&self, bound: Instant);
    /// The session is over: its ephemeral nodes are gone and the lease is lost.
    fn session_ended(&self);
}

/// Follows the client library's session state.
async fn watch_state(session: Weak<Session>, mut states: StateWatcher) {
    loop {
        let state = states.changed().await;
        let Some(s) = session.upgrade() else { return };
        match state {
            SessionState::Disconnected => s.on_disconnected(),
            SessionState::SyncConnected | SessionState::ConnectedReadOnly => s.on_connected(),
            SessionState::Expired | SessionState::Closed | SessionState::AuthFailed => {
                s.on_terminated(state);
                return;
            }
        }
    }
}

/// Confirms the session every [`heartbeat_period`] while connected, with a `sync` (answered
/// through the leader; a read would not do). The syncs are sent on a fixed schedule, each on its
/// own task (bounded by the request timeout), so a slow answer never delays the next send: two
/// touches of the session are never more than one period apart while the connection is up,
/// which the session margin counts on.
async fn heartbeat(session: Weak<Session>) {
    let period = match session.upgrade() {
        Some(s) => heartbeat_period(s.timeout),
        None => return,
    };
    let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(s) = session.upgrade() else { return };
        if s.is_terminated() {
            return;
        }
        if !s.is_connected() {
            continue;
        }
        let epoch = s.epoch();
        let sent = Instant::now();
        // The task holds the session for at most the request timeout.
        tokio::spawn(async move {
            let answer =
                tokio::time::timeout(s.request_timeout, s.client.sync(s.paths.base())).await;
            if let Ok(Ok(())) = answer {
                s.confirm(sent);
                s.refresh(epoch);
            }
        });
    }
}

/// How often the heartbeat confirms the session: a sixth of the negotiated timeout `T`.
pub(crate) fn heartbeat_period(timeout: Duration) -> Duration {
    (timeout / 6).max(Duration::from_millis(10))
}

/// What the session bound leaves for a follower's session-touch lag (decision 0017).
///
/// A follower records a client's touch when the request arrives and passes it on to the leader
/// only with its next answer to the leader's ping (pings every half `tickTime`); the leader
/// expires the session `T` after the last touch it heard of. A follower cut off from the leader
/// right after answering our `sync` leaves the leader with an earlier touch: at worst the one
/// before the last ping it answered, which is less than half a tick plus the gap between two of
/// our requests (at most one heartbeat period) older than the sync. The margin is a whole tick
/// (half a tick of slack for the ping's scheduling and the network) plus the heartbeat period.
/// `tick` is the `tick_ms` option; without it `T / 2`, the largest tick with which a server
/// can have granted `T` under the default `minSessionTimeout` (two ticks). A tick above `T / 2`
/// leaves no usable validity (less than two heartbeat periods) and is refused.
pub(crate) fn session_margin(
    timeout: Duration,
    tick: Option<Duration>,
) -> Result<Duration, String> {
    let tick = tick.unwrap_or(timeout / 2);
    if tick > timeout / 2 {
        return Err(format!(
            "tick_ms={} cannot be the ensemble's tickTime: the negotiated session timeout {} ms \
             is less than two ticks (fix tick_ms, or ask for a longer session_timeout_ms)",
            tick.as_millis(),
            timeout.as_millis()
        ));
    }
    Ok(tick + heartbeat_period(timeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(10);
    const TICK: Duration = Duration::from_secs(2);
    const RTT: Duration = Duration::from_millis(1);

    fn margin() -> Duration {
        session_margin(T, Some(TICK)).unwrap()
    }

    /// Heartbeats a period apart from `from`, each answered a round trip later, until `until`.
    fn beats(touches: &mut Touches, from: Instant, until: Instant) -> Instant {
        let mut at = from;
        while at <= until {
            touches.confirm(at, at + RTT);
            at += heartbeat_period(T);
        }
        at - heartbeat_period(T)
    }

    /// With touches a heartbeat period apart the bound is the margin's (decision 0017), give or
    /// take a round trip.
    #[test]
    fn touches_a_period_apart_bound_the_session_by_the_margin() {
        let start = Instant::now();
        let mut touches = Touches::new(start, TICK);
        assert_eq!(touches.bound(T, margin()), start + T - margin());
        let last = beats(&mut touches, start, start + Duration::from_secs(30));
        let bound = touches.bound(T, margin());
        assert!(bound <= last + T - margin());
        assert!(
            bound + RTT >= last + T - margin(),
            "{:?}",
            last + T - margin() - bound
        );
        assert!(touches.recent.len() < 8, "{}", touches.recent.len());
    }

    /// After a pause, the first `sync` answered (by a follower then cut off from the leader) may
    /// be all the leader never hears of: the bound stays within `T` of the touch before the
    /// pause, also with a renewal's `sync` right behind the heartbeat's.
    #[test]
    fn a_touch_after_a_pause_does_not_bound_the_session_past_the_touch_before_it() {
        let start = Instant::now();
        let mut touches = Touches::new(start, TICK);
        let before = beats(&mut touches, start, start + Duration::from_secs(20));
        for pause in [3, 5, 7, 9].map(Duration::from_secs) {
            let mut t = Touches::new(start, TICK);
            beats(&mut t, start, start + Duration::from_secs(20));
            let resumed = before + pause;
            t.confirm(resumed, resumed + RTT);
            assert!(t.bound(T, margin()) <= before + T, "pause {pause:?}");
            let renewal = resumed + Duration::from_millis(100);
            t.confirm(renewal, renewal + RTT);
            assert!(
                t.bound(T, margin()) <= before + T,
                "pause {pause:?}, renewed"
            );
            // Touches a period apart again: the bound is the margin's once a tick has passed.
            let last = beats(&mut t, renewal, renewal + Duration::from_secs(5));
            assert!(t.bound(T, margin()) + RTT >= last + T - margin());
        }
    }

    /// A steady stream of confirmations (renewals' syncs, every 10 ms here) keeps about 64
    /// entries a tick, not one each, and the bound moves with it: merging never makes a group
    /// that keeps growing and so never ages past a tick.
    #[test]
    fn a_steady_stream_of_confirmations_keeps_few_entries_and_the_bound_moving() {
        let start = Instant::now();
        let mut touches = Touches::new(start, TICK);
        let step = Duration::from_millis(10);
        let mut sent = start;
        let mut most = 0;
        while sent < start + 3 * T {
            touches.confirm(sent, sent + RTT);
            most = most.max(touches.recent.len());
            if sent > start + TICK {
                let left = touches.bound(T, margin()) - sent;
                assert!(
                    left + TICK / 64 + step + RTT >= T - margin(),
                    "{left:?} left at {:?}",
                    sent - start
                );
            }
            sent += step;
        }
        assert!(most <= 70, "{most} entries");
        // A burst: 10,000 answers 100 µs apart.
        for i in 0..10_000u32 {
            let at = sent + Duration::from_micros(u64::from(i) * 100);
            touches.confirm(at, at + RTT);
        }
        assert!(touches.recent.len() <= 70, "{}", touches.recent.len());
    }
}
