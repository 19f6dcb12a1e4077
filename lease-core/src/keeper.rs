//! The keeper: one auto-renewal task per lease, written once over the [`Lease`] trait.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::error::{Error, InvalidInput, LostReason, Result};
use crate::lease::{Lease, LeaseStatus, LostSignal};
use crate::token::Token;

/// How a keeper renews.
#[derive(Debug, Clone, PartialEq)]
pub struct KeeperOptions {
    renew_fraction: f64,
    max_hold: Option<Duration>,
    require_progress: bool,
}

impl Default for KeeperOptions {
    fn default() -> Self {
        KeeperOptions {
            renew_fraction: 1.0 / 3.0,
            max_hold: None,
            require_progress: false,
        }
    }
}

impl KeeperOptions {
    /// Renew every third of the TTL, forever, without requiring progress.
    pub fn new() -> Self {
        Self::default()
    }

    /// Renew when this fraction of the TTL has passed since the last confirmed renewal was sent.
    /// Must be in `(0, 0.9]`; checked by [`keep`].
    pub fn renew_fraction(mut self, fraction: f64) -> Self {
        self.renew_fraction = fraction;
        self
    }

    /// Never hold the lease longer than this in total (counted from acquisition): the keeper skips
    /// any renewal that would let the lock outlive `acquired_at + max`, so the lease runs out at
    /// or before that point and reports `Lost(KeeperStopped)`.
    pub fn max_hold(mut self, max: Duration) -> Self {
        self.max_hold = Some(max);
        self
    }

    /// Renew only if the work reported progress ([`Progress::tick`]) since the previous renewal;
    /// otherwise stop renewing, so that a stuck worker does not hold the lock forever.
    pub fn require_progress(mut self, yes: bool) -> Self {
        self.require_progress = yes;
        self
    }
}

/// A handle the protected work uses to report progress to its keeper. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<AtomicU64>);

impl Progress {
    /// Reports that the work made observable progress.
    pub fn tick(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn count(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Why a keeper stopped renewing before its lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeeperStop {
    /// No progress was reported between two renewals.
    NoProgress,
    /// The maximum total hold time passed.
    MaxHold,
    /// [`Kept::stop`] was called.
    Requested,
}

/// A lease with a keeper renewing it in the background.
///
/// # Contract
///
/// - The keeper renews when `renew_fraction` of the TTL has passed since the last confirmed
///   renewal was *sent*, and retries failed renewals (with backoff) until local validity ends;
///   if no renewal is confirmed by then, the lease reports `Lost(Expired)` and the keeper exits.
/// - It stops when the lease is lost or released, when [`Kept`] is dropped (the task is aborted
///   and the lease dropped with it), on [`Kept::stop`], when the maximum hold passes, or when
///   progress is required and none was reported. It never outlives its `Kept`.
/// - After stopping on purpose it lets the lease run out and then marks it
///   `Lost(KeeperStopped)`.
pub struct Kept {
    lease: Arc<dyn Lease>,
    progress: Progress,
    stop: Arc<Mutex<Option<KeeperStop>>>,
    stop_tx: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl fmt::Debug for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kept")
            .field("lease", &self.lease)
            .field("stopped", &self.stopped())
            .finish()
    }
}

/// Starts a keeper for `lease` on the current tokio runtime.
///
/// Fails with `InvalidInput` if the options are out of range, before anything is spawned.
pub fn keep(lease: Box<dyn Lease>, options: KeeperOptions) -> Result<Kept> {
    if !(options.renew_fraction > 0.0 && options.renew_fraction <= 0.9) {
        return Err(InvalidInput::OutOfRange {
            field: "renew_fraction",
            value: options.renew_fraction.to_string(),
            expected: "in (0, 0.9]",
        }
        .into());
    }
    let lease: Arc<dyn Lease> = Arc::from(lease);
    let progress = Progress::default();
    let stop = Arc::new(Mutex::new(None));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(run(
        lease.clone(),
        options,
        progress.clone(),
        stop.clone(),
        stop_rx,
    ));
    Ok(Kept {
        lease,
        progress,
        stop,
        stop_tx,
        task,
    })
}

impl Kept {
    /// The lease being kept.
    pub fn lease(&self) -> &dyn Lease {
        &*self.lease
    }

    /// The lease's token.
    pub fn token(&self) -> Token {
        self.lease.token()
    }

    /// The lease's lost signal.
    pub fn lost(&self) -> LostSignal {
        self.lease.lost()
    }

    /// The progress handle to give to the protected work.
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }

    /// Why the keeper stopped renewing, if it stopped on purpose.
    pub fn stopped(&self) -> Option<KeeperStop> {
        *self.stop.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops renewing; the lease runs out at its current validity.
    pub fn stop(&self) {
        self.stop_tx.send_replace(true);
    }

    /// Stops the keeper, then releases the lease (compare-and-delete).
    ///
    /// Cancel safety: the keeper is stopped before the first await; a dropped future then drops
    /// the lease mid-release, as for a dropped [`Lease::release`] followed by dropping the lease
    /// (released best-effort, and in any case it expires at its TTL).
    pub async fn release(self) -> Result<()> {
        self.task.abort();
        self.lease.release().await
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn record_stop(stop: &Mutex<Option<KeeperStop>>, why: KeeperStop) {
    let mut s = stop.lock().unwrap_or_else(|p| p.into_inner());
    s.get_or_insert(why);
}

async fn run(
    lease: Arc<dyn Lease>,
    options: KeeperOptions,
    progress: Progress,
    stop: Arc<Mutex<Option<KeeperStop>>>,
    mut stop_rx: tokio::sync::watch::Receiver<bool>,
) {
    let ttl = lease.ttl();
    let interval = ttl.mul_f64(options.renew_fraction);
    let acquired_at = lease.state().acquired_at();
    let mut lost = lease.lost();
    let mut last_sent = acquired_at;
    let mut seen_progress = progress.count();
    let give_up = loop {
        let next = last_sent + interval;
        tokio::select! {
            _ = lost.wait() => return,
            _ = stop_rx.wait_for(|s| *s) => break KeeperStop::Requested,
            _ = tokio::time::sleep_until(next) => {}
        }
        if options
            .max_hold
            .is_some_and(|max| Instant::now() + ttl > acquired_at + max)
        {
            break KeeperStop::MaxHold;
        }
        if options.require_progress {
            let now = progress.count();
            if now == seen_progress {
                break KeeperStop::NoProgress;
            }
            seen_progress = now;
        }
        match renew_until_confirmed(&*lease, ttl).await {
            Some(sent) => last_sent = sent,
            None => return,
        }
    };
    record_stop(&stop, give_up);
    tracing::warn!(
        key = %lease.key(),
        token = %lease.token(),
        reason = ?give_up,
        "keeper stopped renewing; the lease runs out at its validity"
    );
    // `wait` resolves when validity ends (re-read if the lease is renewed meanwhile) or when the
    // lease is lost for another reason. Record `KeeperStopped` in either case: the first recorded
    // reason wins, so a revocation or release seen earlier stays. (A `select!` between `wait` and
    // a sleep until validity would pick either branch at random at that instant, and the lease
    // then ended `Lost(Expired)` half of the time.)
    lost.wait().await;
    lease.state().mark_lost(LostReason::KeeperStopped);
}

/// Renews, retrying transient failures with backoff until validity ends. Returns the send time of
/// the confirmed renewal, or `None` when the lease is lost (validity passed, or the backend said
/// so).
async fn renew_until_confirmed(lease: &dyn Lease, ttl: Duration) -> Option<Instant> {
    let mut backoff = Backoff::new((ttl / 50).max(Duration::from_millis(5)), ttl / 5);
    loop {
        if matches!(lease.status(), LeaseStatus::Lost(_)) {
            return None;
        }
        let sent = Instant::now();
        let deadline = lease.valid_until();
        match tokio::time::timeout_at(deadline, lease.renew()).await {
            Ok(Ok(_)) => {
                crate::metrics::renew_validity_left(
                    lease.state().backend(),
                    deadline.saturating_duration_since(Instant::now()),
                );
                return Some(sent);
            }
            Ok(Err(e @ (Error::Lost { .. } | Error::Stale { .. }))) => {
                tracing::warn!(key = %lease.key(), error = %e, "keeper: renewal refused, lease lost");
                lease.state().mark_lost(LostReason::Superseded);
                return None;
            }
            Ok(Err(e)) => {
                tracing::warn!(key = %lease.key(), error = %e, "keeper: renewal not confirmed, retrying");
            }
            Err(_) => {
                tracing::warn!(key = %lease.key(), "keeper: renewal timed out at the end of validity");
            }
        }
        let now = Instant::now();
        if now >= lease.valid_until() {
            lease.state().mark_lost(LostReason::Expired);
            return None;
        }
        let wake = (now + backoff.next_delay()).min(lease.valid_until());
        tokio::time::sleep_until(wake).await;
    }
}
