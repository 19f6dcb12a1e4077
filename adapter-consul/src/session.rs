//! One Consul session per client: created on the first acquire with no health checks, renewed in
//! the background every third of its TTL, shared by every lease of the client, destroyed when the client
//! and its last lease are gone.
//!
//! The session's **local validity** is the send time of its last confirmed renewal (or creation)
//! plus its TTL minus the drift margin: Consul never invalidates a session by its TTL before the
//! TTL has passed since the last renewal it saw, so until then every lock the session holds
//! stays held, unless someone deletes it or ends the session early (`session destroy`, or its
//! node deregistered by a client agent leaving the cluster). Those the lock monitor sees, or,
//! when the agent stops answering, it puts the leases in doubt (`monitor.rs`). Each lease's
//! validity is capped by it.

use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lease_core::adapter::{
    retry_until_settled, Backoff, CleanupFailures, Dependents, SharedOpening,
};
use lease_core::{Error, Result};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::client::Http;

/// What a session tells the leases it holds (implemented by the lease's shared state in
/// `lease.rs`; the session knows leases only through this, so it does not depend on them).
pub(crate) trait SessionLease: Send + Sync {
    /// The lease's Consul key.
    fn kv_key(&self) -> &str;
    /// The lease's token (its key's `CreateIndex`).
    fn token(&self) -> lease_core::Token;
    /// A renewal confirmed the session until `until`.
    fn session_confirmed(self: Arc<Self>, until: Instant);
    /// A renewal failed for a transient reason: in doubt until one is confirmed.
    fn in_doubt(&self);
    /// The session is gone, and the lease's lock with it.
    fn session_ended(&self);
    /// This client force-released the lease's lock.
    fn revoked(&self);
    /// The concrete state (for the crate's tests).
    #[cfg(test)]
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

struct SessionState {
    valid_until: Instant,
    /// The validity last pushed to the leases ([`Session::confirm`]).
    pushed_until: Instant,
    /// How many renewals failed for a transient reason ([`Session::doubts`]).
    doubts: u64,
}

/// The outcome of one session renewal, as every caller that shares it sees it: `Ok(true)`
/// renewed, `Ok(false)` the session is gone (404).
type RenewOutcome = std::result::Result<bool, Arc<Error>>;

/// The session renewal most recently sent: its send time and, once answered, its outcome.
struct Renewal {
    sent: Instant,
    done: watch::Receiver<Option<RenewOutcome>>,
}

/// A live (or ended) Consul session and the leases that hold locks with it.
pub(crate) struct Session {
    pub(crate) id: String,
    ttl: Duration,
    margin: Duration,
    state: Mutex<SessionState>,
    leases: Dependents<Weak<dyn SessionLease>>,
    ended_tx: watch::Sender<bool>,
    /// The last renewal sent (shared by every caller that needs one sent after it started).
    renewal: Mutex<Option<Renewal>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.id)
            .field("ttl", &self.ttl)
            .field("ended", &self.is_ended())
            .finish()
    }
}

impl Session {
    fn new(id: String, ttl: Duration, margin: Duration, created_sent_at: Instant) -> Self {
        let (ended_tx, _) = watch::channel(false);
        Session {
            id,
            ttl,
            margin,
            state: Mutex::new(SessionState {
                valid_until: lease_core::adapter::clock::valid_until(created_sent_at, ttl, margin),
                pushed_until: created_sent_at,
                doubts: 0,
            }),
            leases: Dependents::new(),
            ended_tx,
            renewal: Mutex::new(None),
        }
    }

    /// Whether the session's validity has at least half its TTL left at `at`: a renewal starting
    /// then needs no session renewal of its own.
    pub(crate) fn fresh_at(&self, at: Instant) -> bool {
        self.valid_until() >= at + self.ttl / 2
    }

    fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Until when the session is known to be alive (local monotonic estimate).
    pub(crate) fn valid_until(&self) -> Instant {
        self.lock().valid_until
    }

    /// Whether a renewal answered at `answered_at` may have reached Consul after it decided to
    /// end the session: its timer fires twice the TTL after the last renewal it received, and
    /// once fired, the destroy still lands (it is retried) even if a renewal then succeeds.
    /// Counted from the last confirmed renewal's send (before Consul received it) to this
    /// renewal's answer (after Consul received it), less one more drift margin, so it errs on
    /// the side of ending.
    pub(crate) fn lapsed_at(&self, answered_at: Instant) -> bool {
        answered_at + self.margin >= self.valid_until() + self.ttl
    }

    /// How many of the session's renewals failed for a transient reason so far: a check of a
    /// lease in doubt that started before a later failure restores nothing.
    pub(crate) fn doubts(&self) -> u64 {
        self.lock().doubts
    }

    /// Whether the session is known to be gone.
    pub(crate) fn is_ended(&self) -> bool {
        self.leases.is_closed()
    }

    /// A background cleanup's step: runs `op` until it succeeds or this session ends (which
    /// takes its locks with it), pausing after each failure (50 ms, doubling with jitter to 5 s)
    /// and reporting it through `failures`, as `what`.
    pub(crate) async fn clean_up<T, Fut>(
        &self,
        failures: &CleanupFailures,
        what: &str,
        mut op: impl FnMut() -> Fut,
    ) where
        Fut: std::future::Future<Output = Result<T>>,
    {
        let backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
        retry_until_settled(backoff, None, || {
            let attempt = (!self.is_ended()).then(&mut op);
            async move {
                match attempt {
                    None => ControlFlow::Break(()),
                    Some(attempt) => match attempt.await {
                        Ok(_) => ControlFlow::Break(()),
                        Err(e) => {
                            failures.failed(what, &e);
                            ControlFlow::Continue(())
                        }
                    },
                }
            }
        })
        .await;
    }

    /// A renewal sent at `sent_at` was confirmed: extends the session's validity and, through it,
    /// every lease's (each up to its own deadline).
    ///
    /// The leases are walked only when the validity moved by at least a quarter of the TTL since
    /// the last walk: renewals that follow each other closely (many lease renewals each needing
    /// one) cost one walk per quarter TTL, not one per renewal (N leases x N renewals). A lease's
    /// validity then lags the session's by at most a quarter TTL (never exceeds it); a renewing
    /// lease reads the session's validity itself.
    pub(crate) fn confirm(&self, sent_at: Instant) {
        if self.is_ended() {
            return;
        }
        let until = {
            let mut st = self.lock();
            let until = lease_core::adapter::clock::valid_until(sent_at, self.ttl, self.margin);
            st.valid_until = st.valid_until.max(until);
            if st.valid_until < st.pushed_until + self.ttl / 4 {
                return;
            }
            st.pushed_until = st.valid_until;
            st.valid_until
        };
        for l in self.leases.live() {
            l.session_confirmed(until);
        }
    }

    /// A renewal failed for a transient reason: the leases may still be held, but nothing new
    /// should start under them until a renewal is confirmed.
    fn in_doubt(&self) {
        self.lock().doubts += 1;
        for l in self.leases.live() {
            l.in_doubt();
        }
    }

    /// The session is gone (Consul answered 404 or refused it, or the client destroyed it):
    /// every lease on it is lost. Idempotent.
    pub(crate) fn end(&self) {
        let Some(leases) = self.leases.close() else {
            return;
        };
        self.ended_tx.send_replace(true);
        for l in leases.iter().filter_map(Weak::upgrade) {
            l.session_ended();
        }
    }

    /// Registers the lease `id`; `false` if the session has ended meanwhile.
    pub(crate) fn register(&self, id: u64, lease: Weak<dyn SessionLease>) -> bool {
        self.leases.insert(id, lease)
    }

    /// Forgets a lease.
    pub(crate) fn unregister(&self, id: u64) {
        self.leases.remove(id);
    }

    /// The live lease of this session on `kv_key` with `token`, if any (a lease released or
    /// revoked a moment ago may still be listed beside the next one on the same key).
    pub(crate) fn lease_on(
        &self,
        kv_key: &str,
        token: lease_core::Token,
    ) -> Option<Arc<dyn SessionLease>> {
        self.leases
            .live()
            .into_iter()
            .find(|l| l.kv_key() == kv_key && l.token() == token)
    }

    /// The live leases of this session on `kv_key` (for the crate's tests).
    #[cfg(test)]
    pub(crate) fn leases_on(&self, kv_key: &str) -> Vec<Arc<dyn SessionLease>> {
        let mut leases = self.leases.live();
        leases.retain(|l| l.kv_key() == kv_key);
        leases
    }

    fn ended_signal(&self) -> watch::Receiver<bool> {
        self.ended_tx.subscribe()
    }
}

/// Creates, renews and ends the client's session.
pub(crate) struct SessionManager {
    http: Arc<Http>,
    ttl: Duration,
    lock_delay: Duration,
    name: String,
    /// The current session, or its creation under way, which every caller asking meanwhile
    /// awaits (one request; its failure reaches them all at once, rather than each making an
    /// attempt of its own in turn, the k-th of them waiting k request timeouts).
    current: SharedOpening<Arc<Session>>,
}

impl std::fmt::Debug for SessionManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionManager")
            .field("ttl", &self.ttl)
            .field("current", &self.peek())
            .finish()
    }
}

impl SessionManager {
    pub(crate) fn new(http: Arc<Http>, ttl: Duration, lock_delay: Duration, name: String) -> Self {
        SessionManager {
            http,
            ttl,
            lock_delay,
            name,
            current: SharedOpening::new(crate::BACKEND),
        }
    }

    fn margin(&self) -> Duration {
        lease_core::adapter::clock::default_drift_margin(self.ttl)
    }

    /// The current session, if one is live.
    pub(crate) fn peek(&self) -> Option<Arc<Session>> {
        self.current.current(|s| !s.is_ended())
    }

    /// The current session, creating one (one round trip) if there is none; callers asking
    /// while one is being created await that creation.
    pub(crate) async fn session(self: &Arc<Self>) -> Result<Arc<Session>> {
        self.current.get(|s| !s.is_ended(), || self.create()).await
    }

    /// Creates a session and starts its renewer; destroys it again if the coordinator was
    /// dropped meanwhile (the creation outlives its callers).
    fn create(self: &Arc<Self>) -> impl std::future::Future<Output = Result<Arc<Session>>> {
        let body = serde_json::json!({
            "Name": self.name,
            "TTL": format!("{}ms", self.ttl.as_millis()),
            "Behavior": "delete",
            "LockDelay": format!("{}ms", self.lock_delay.as_millis()),
            // No health checks: only the TTL decides. (Without these fields Consul attaches the
            // node's serfHealth check, which can invalidate the session at any time.)
            "Checks": [],
            "NodeChecks": [],
            "ServiceChecks": [],
        });
        let (http, ttl, margin, manager) = (
            self.http.clone(),
            self.ttl,
            self.margin(),
            Arc::downgrade(self),
        );
        async move {
            let sent = Instant::now();
            let id = http.session_create(&body).await?;
            if manager.strong_count() == 0 {
                // Created after the coordinator was dropped (the creation outlives its
                // callers): nobody will use or end it.
                if let Err(e) = http.session_destroy(&id).await {
                    tracing::debug!(error = %e, "consul session destroy failed");
                }
                return Err(Error::unavailable(
                    crate::BACKEND,
                    "the coordinator was dropped while its session was created",
                ));
            }
            let session = Arc::new(Session::new(id, ttl, margin, sent));
            tracing::debug!(session = %session.id, ?ttl, "consul session created");
            tokio::spawn(renewer(manager, http, session.clone()));
            Ok(session)
        }
    }

    /// Marks `session` ended (its leases are lost) and stops using it.
    pub(crate) fn ended(&self, session: &Arc<Session>) {
        session.end();
        self.current.discard(|c| Arc::ptr_eq(c, session));
    }

    /// The bound on one session renewal.
    fn renew_timeout(&self) -> Duration {
        self.http
            .request_timeout()
            .min(self.ttl / 2)
            .max(Duration::from_millis(50))
    }

    /// A renewal of `session` **sent at or after `not_before`** (one round trip), shared: every
    /// caller whose `not_before` the renewal in flight (or just answered) satisfies awaits that
    /// one instead of sending its own, so N concurrent callers cost one `PUT`. `Ok(false)` if
    /// Consul no longer knows the session (it is then ended and its leases lost). A confirmed
    /// renewal extends the session's validity (and every lease's) from its send time.
    pub(crate) async fn renew_after(
        &self,
        session: &Arc<Session>,
        not_before: Instant,
    ) -> Result<bool> {
        let mut done = {
            let mut slot = session.renewal.lock().unwrap_or_else(|p| p.into_inner());
            match slot.as_ref() {
                Some(r) if r.sent >= not_before => r.done.clone(),
                _ => {
                    let sent = Instant::now();
                    let (tx, done) = watch::channel(None);
                    *slot = Some(Renewal {
                        sent,
                        done: done.clone(),
                    });
                    // Its own task: a caller that gives up does not cancel it for the others.
                    let (http, session, timeout) =
                        (self.http.clone(), session.clone(), self.renew_timeout());
                    tokio::spawn(async move {
                        let outcome = match http.session_renew(&session.id, timeout).await {
                            Ok(true) if session.lapsed_at(Instant::now()) => {
                                // Renewed, but perhaps after Consul's timer fired: a
                                // destroy may still come, after leases are granted on it
                                // again. End it here; the next acquire makes a new one.
                                tracing::warn!(session = %session.id, "consul session renewed after twice its TTL without a renewal; ending it");
                                session.end();
                                if let Err(e) = http.session_destroy(&session.id).await {
                                    tracing::debug!(error = %e, "consul session destroy failed");
                                }
                                Ok(false)
                            }
                            Ok(true) => {
                                session.confirm(sent);
                                Ok(true)
                            }
                            Ok(false) => {
                                tracing::warn!(session = %session.id, "consul session no longer exists");
                                session.end();
                                Ok(false)
                            }
                            Err(e) => Err(Arc::new(e)),
                        };
                        tx.send_replace(Some(outcome));
                    });
                    done
                }
            }
        };
        let outcome = match done.wait_for(Option::is_some).await {
            Ok(o) => o.clone().expect("waited for an outcome"),
            Err(_) => Err(Arc::new(Error::unavailable(
                crate::BACKEND,
                "session renew: the renewal task ended without an answer",
            ))),
        };
        match outcome {
            Ok(true) => Ok(true),
            Ok(false) => {
                self.ended(session);
                Ok(false)
            }
            Err(e) => Err(e.replicate()),
        }
    }
}

impl Drop for SessionManager {
    fn drop(&mut self) {
        if let Some(session) = self.current.current(|_| true) {
            session.end();
            // Best effort: the session expires at its TTL anyway.
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                let http = self.http.clone();
                handle.spawn(async move {
                    if let Err(e) = http.session_destroy(&session.id).await {
                        tracing::debug!(error = %e, "consul session destroy failed");
                    }
                });
            }
        }
    }
}

/// Renews `session` every third of its TTL until it ends or the manager is gone (then destroys
/// it, in case the manager's drop missed it while it was being created); on failure,
/// retries sooner and marks the leases in doubt. A third, not a half: the session then stays
/// "fresh" (half its TTL of validity left, [`Session::fresh_at`]) through a renewal's round trip
/// of up to a sixth of the TTL, so lease renewals need no session renewal of their own.
async fn renewer(manager: Weak<SessionManager>, http: Arc<Http>, session: Arc<Session>) {
    let half = session.ttl / 3;
    let mut backoff = Backoff::new((session.ttl / 20).max(Duration::from_millis(20)), half);
    let mut ended = session.ended_signal();
    let mut next = Instant::now() + half;
    loop {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = ended.wait_for(|e| *e) => return,
        }
        let Some(m) = manager.upgrade() else {
            // The coordinator is gone; its drop missed this session if it was still being
            // created then: nobody will use it.
            if let Err(e) = http.session_destroy(&session.id).await {
                tracing::debug!(error = %e, "consul session destroy failed");
            }
            return;
        };
        let sent = Instant::now();
        match m.renew_after(&session, sent).await {
            Ok(true) => {
                next = sent + half;
                backoff.reset();
            }
            Ok(false) => {
                tracing::warn!(session = %session.id, "consul session invalidated; its leases are lost");
                return;
            }
            Err(e) => {
                tracing::debug!(session = %session.id, error = %e, "consul session renewal failed");
                session.in_doubt();
                next = Instant::now() + backoff.next_delay();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ConsulConfig;
    use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions};

    /// Twenty renewals that each need a session renewal sent after they started share ONE
    /// `PUT /v1/session/renew`, and it extends the session's validity from its send time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_session_renewals_share_one_put() {
        let s = ConsulStandIn::start(StandInOptions::default()).expect("stand-in");
        let config =
            ConsulConfig::from_url(&format!("consul://{}?session_ttl_ms=10000", s.addr())).unwrap();
        let http = Arc::new(Http::new(&config).unwrap());
        let m = Arc::new(SessionManager::new(
            http,
            Duration::from_secs(10),
            Duration::from_millis(100),
            "t".into(),
        ));
        let session = m.session().await.unwrap();
        let before_validity = session.valid_until();
        let started = Instant::now();
        let before = s.requests();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..20 {
            let (m, session) = (m.clone(), session.clone());
            set.spawn(async move { m.renew_after(&session, started).await });
        }
        while let Some(r) = set.join_next().await {
            assert!(r.unwrap().unwrap(), "renewed");
        }
        assert_eq!(s.requests() - before, 1, "one PUT for twenty callers");
        assert!(session.valid_until() > before_validity);
        // A caller that started after that renewal was sent gets a new one.
        let later = Instant::now();
        let before = s.requests();
        assert!(m.renew_after(&session, later).await.unwrap());
        assert_eq!(s.requests() - before, 1);
    }
}
