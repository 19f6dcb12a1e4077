//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use lease_core::adapter::LeaseTracker;
use lease_core::memory::MemoryCoordinator;
use lease_core::{Error, Lease, LeaseOptions, LeaseState, LockKey, Result, Token};
use tokio::time::Instant;

pub(crate) fn key(s: &str) -> LockKey {
    s.parse()
        .unwrap_or_else(|e| panic!("bad test key {s:?}: {e}"))
}

pub(crate) fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub(crate) fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub(crate) fn tok(n: u64) -> Token {
    Token::new(n).unwrap()
}

/// Options with this TTL, no wait, and no drift margin (local validity == server expiry), so
/// that time assertions are exact.
pub(crate) fn exact(ttl: Duration) -> LeaseOptions {
    LeaseOptions::new(ttl).drift_margin(Duration::ZERO)
}

/// Lets spawned tasks run (without advancing paused time) until `cond` holds; panics after a
/// bounded number of scheduler turns.
pub(crate) async fn settle_until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("condition never held: {what}");
}

/// Waits (scheduler turns only, no time) until `key` has exactly `n` queued waiters.
pub(crate) async fn wait_for_waiters(c: &MemoryCoordinator, k: &LockKey, n: usize) {
    settle_until(&format!("{n} waiters on {k}"), || c.waiters(k) == n).await;
}

/// Lets every ready task run without advancing time.
pub(crate) async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

/// What a [`ScriptedLease`] answers to `renew`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RenewScript {
    /// Always confirm.
    Ok,
    /// Always fail with a retryable `Unavailable`.
    Unavailable,
    /// Fail with `Unavailable` this many times, then confirm.
    FailFirst(usize),
    /// Refuse with `Lost`.
    Lost,
    /// Refuse with `Lost(Revoked)`, without recording it (as a lease outside this workspace
    /// may).
    Revoked,
    /// Panic (an adapter's bug).
    Panic,
    /// The first call never answers (a lost reply); later calls confirm.
    HangFirst,
    /// Confirm, with validity capped this long after the send (as a session bound caps a
    /// ZooKeeper or Consul lease, which the session's own heartbeat then extends).
    CappedAt(Duration),
    /// Confirm, with validity capped at [`ScriptedLease::session_bound`] when one is set (as a
    /// Consul lease's is at its session's bound, which the session's renewer moves); a bound
    /// with less than 500 ms left is first renewed to 988 ms after the send, as a Consul lease's
    /// renewal renews a 1 s session that is no longer fresh.
    CappedBySession,
    /// Fail with `Unavailable` unless the try is sent within this long of the end of validity
    /// (an outage that ends just before the lease would run out), then confirm.
    OkOnlyWithin(Duration),
}

/// A hand-written `Lease` over `LeaseTracker`, with a scripted `renew` and counters.
#[derive(Debug)]
pub(crate) struct ScriptedLease {
    pub(crate) tracker: LeaseTracker,
    pub(crate) script: RenewScript,
    pub(crate) renews: Arc<AtomicUsize>,
    pub(crate) releases: Arc<AtomicUsize>,
    /// The session's bound, for [`RenewScript::CappedBySession`].
    pub(crate) session_bound: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl ScriptedLease {
    /// A lease acquired now with `ttl` and no drift margin.
    pub(crate) fn new(ttl: Duration, script: RenewScript) -> Self {
        Self::with_margin(ttl, Duration::ZERO, script)
    }

    /// A lease acquired now with `ttl` and this drift margin: valid for `ttl - margin`.
    pub(crate) fn with_margin(ttl: Duration, margin: Duration, script: RenewScript) -> Self {
        ScriptedLease {
            tracker: LeaseTracker::new(
                "scripted",
                key("scripted"),
                tok(7),
                ttl,
                margin,
                Instant::now(),
            ),
            script,
            renews: Arc::default(),
            releases: Arc::default(),
            session_bound: Arc::default(),
        }
    }
}

#[async_trait]
impl Lease for ScriptedLease {
    fn state(&self) -> &LeaseState {
        &self.tracker
    }

    async fn renew(&self) -> Result<Instant> {
        let sent = Instant::now();
        let n = self.renews.fetch_add(1, Ordering::SeqCst);
        self.tracker.ensure_not_lost()?;
        let unavailable = || Error::Unavailable {
            backend: "scripted",
            message: "scripted outage".into(),
            source: None,
        };
        match self.script {
            RenewScript::Ok => self.tracker.renewed_from(sent),
            RenewScript::Unavailable => Err(unavailable()),
            RenewScript::FailFirst(k) if n < k => Err(unavailable()),
            RenewScript::FailFirst(_) => self.tracker.renewed_from(sent),
            RenewScript::OkOnlyWithin(d) if sent + d < self.tracker.valid_until() => {
                Err(unavailable())
            }
            RenewScript::OkOnlyWithin(_) => self.tracker.renewed_from(sent),
            RenewScript::Lost => Err(self.tracker.lost_error(lease_core::LostReason::Superseded)),
            RenewScript::Revoked => Err(self.tracker.lost_error(lease_core::LostReason::Revoked)),
            RenewScript::Panic => panic!("scripted panic in renew"),
            RenewScript::HangFirst if n == 0 => std::future::pending().await,
            RenewScript::HangFirst => self.tracker.renewed_from(sent),
            RenewScript::CappedAt(d) => {
                self.tracker.renewed(sent + d);
                Ok(sent + d)
            }
            RenewScript::CappedBySession => {
                let own = sent + self.ttl();
                let until = {
                    let mut bound = self.session_bound.lock().unwrap();
                    // As a Consul lease's renewal: a session with less than half its TTL of
                    // validity left is renewed with it (a 1 s TTL less a 12 ms margin here).
                    if let Some(b) = bound.as_mut() {
                        if *b < sent + ms(500) {
                            *b = sent + ms(1000 - 12);
                        }
                    }
                    bound.map_or(own, |b| b.min(own))
                };
                self.tracker.renewed(until);
                Ok(self.tracker.valid_until())
            }
        }
    }

    async fn release(&self) -> Result<()> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.tracker.ensure_not_lost()?;
        self.tracker.mark_lost(lease_core::LostReason::Released);
        Ok(())
    }
}

/// Awaits `fut` for at most `limit` (of paused time), so that a regression fails instead of
/// running forever in virtual time.
pub(crate) async fn within<T>(
    limit: Duration,
    what: &str,
    fut: impl std::future::Future<Output = T>,
) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}
