//! The keeper: auto-renewal written once over the [`Lease`] trait, timed by one task for every
//! lease kept on a multi-thread runtime.

use std::collections::BinaryHeap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::AbortHandle;
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
/// - It stops when the lease is lost or released, when [`Kept`] is dropped (a renewal under way
///   is aborted and the lease dropped with it), on [`Kept::stop`], when the maximum hold passes,
///   or when progress is required and none was reported. It never outlives its `Kept`.
/// - After stopping on purpose it lets the lease run out and then marks it
///   `Lost(KeeperStopped)`.
///
/// # Cost
///
/// On a multi-thread runtime a kept lease has no task of its own while it waits for its next
/// renewal: every such lease shares one timer task, which starts each renewal as a short task
/// on the runtime `keep` was called on, so holding many kept leases costs a few hundred bytes
/// each (decision 0024). On a current-thread runtime each kept lease has its own timer task.
pub struct Kept {
    keeping: Arc<Keeping>,
}

impl fmt::Debug for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kept")
            .field("lease", &self.keeping.lease)
            .field("stopped", &self.stopped())
            .finish()
    }
}

/// Starts a keeper for `lease` on the current tokio runtime.
///
/// Fails with `InvalidInput` if the options are out of range, before anything is spawned.
///
/// # Panics
///
/// Outside a tokio runtime.
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
    let runtime = tokio::runtime::Handle::current();
    let timer = timer_for(&runtime);
    let interval = lease.ttl().mul_f64(options.renew_fraction);
    let progress = Progress::default();
    let last_sent = lease.state().acquired_at();
    let keeping = Arc::new(Keeping {
        seen_progress: AtomicU64::new(progress.count()),
        lease,
        options,
        interval,
        progress,
        runtime,
        state: Mutex::new(KeepState {
            stop: None,
            last_sent,
            renewing: None,
            timer,
            done: false,
        }),
    });
    keeping.schedule(&mut keeping.lock(), last_sent + interval);
    Ok(Kept { keeping })
}

impl Kept {
    /// The lease being kept.
    pub fn lease(&self) -> &dyn Lease {
        &*self.keeping.lease
    }

    /// The lease's token.
    pub fn token(&self) -> Token {
        self.keeping.lease.token()
    }

    /// The lease's lost signal.
    pub fn lost(&self) -> LostSignal {
        self.keeping.lease.lost()
    }

    /// The progress handle to give to the protected work.
    pub fn progress(&self) -> Progress {
        self.keeping.progress.clone()
    }

    /// Why the keeper stopped renewing, if it stopped on purpose.
    pub fn stopped(&self) -> Option<KeeperStop> {
        self.keeping.lock().stop
    }

    /// Stops renewing; the lease runs out at its current validity (a renewal under way may
    /// still move it once).
    pub fn stop(&self) {
        let state = self.keeping.lock();
        if state.stop.is_none() && !state.done {
            self.keeping.stop_renewing(state, KeeperStop::Requested);
        }
    }

    /// Stops the keeper, then releases the lease (compare-and-delete).
    ///
    /// Cancel safety: the keeper is stopped before the first await; a dropped future then drops
    /// the lease mid-release, as for a dropped [`Lease::release`] followed by dropping the lease
    /// (released best-effort, and in any case it expires at its TTL).
    pub async fn release(self) -> Result<()> {
        self.keeping.end();
        self.keeping.lease.release().await
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        self.keeping.end();
    }
}

/// One kept lease: owned by its [`Kept`] and, while a renewal runs, by that renewal's task; the
/// timer holds it weakly, so dropping the `Kept` drops the lease at once.
struct Keeping {
    lease: Arc<dyn Lease>,
    options: KeeperOptions,
    /// `renew_fraction` of the TTL.
    interval: Duration,
    progress: Progress,
    /// The progress count at the previous renewal.
    seen_progress: AtomicU64,
    /// The runtime `keep` was called on: renewals run there.
    runtime: tokio::runtime::Handle,
    state: Mutex<KeepState>,
}

struct KeepState {
    /// Why it stopped renewing on purpose (the first reason stays).
    stop: Option<KeeperStop>,
    /// Send time of the last confirmed renewal (the acquisition at first).
    last_sent: Instant,
    /// The renewal under way.
    renewing: Option<AbortHandle>,
    /// The timer that wakes this lease.
    timer: mpsc::UnboundedSender<Due>,
    /// Nothing more to do: lost, ended, or run out after a stop.
    done: bool,
}

impl Keeping {
    fn lock(&self) -> MutexGuard<'_, KeepState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the timer to wake this lease at `at`.
    fn schedule(self: &Arc<Self>, state: &mut KeepState, at: Instant) {
        let due = Due {
            at,
            keeping: Arc::downgrade(self),
            moves: 0,
        };
        if let Err(mpsc::error::SendError(due)) = state.timer.send(due) {
            // The timer's runtime shut down.
            state.timer = timer_for(&self.runtime);
            let _ = state.timer.send(due);
        }
    }

    /// The `Kept` went (dropped or releasing): abort a renewal under way, do nothing more.
    fn end(&self) {
        let mut state = self.lock();
        state.done = true;
        if let Some(renewal) = state.renewing.take() {
            renewal.abort();
        }
    }

    /// Stops renewing for `why` and lets the lease run out.
    fn stop_renewing(self: &Arc<Self>, mut state: MutexGuard<'_, KeepState>, why: KeeperStop) {
        state.stop = Some(why);
        tracing::warn!(
            key = %self.lease.key(),
            token = %self.lease.token(),
            reason = ?why,
            "keeper stopped renewing; the lease runs out at its validity"
        );
        self.schedule(&mut state, self.lease.valid_until());
    }

    /// The timer woke this lease at `now`.
    fn wake(self: &Arc<Self>, now: Instant) {
        let mut state = self.lock();
        if state.done {
            return;
        }
        if state.stop.is_some() {
            // Running out. Record `KeeperStopped` once validity ended or the lease was lost
            // otherwise (the first recorded reason wins, so a revocation or release seen
            // earlier stays); a renewal that was under way at the stop may have moved validity.
            // (The signal's status records nothing: `Lease::status` would record `Expired`.)
            if self.lease.lost().is_lost() {
                state.done = true;
                drop(state);
                self.lease.state().mark_lost(LostReason::KeeperStopped);
            } else {
                self.schedule(&mut state, self.lease.valid_until());
            }
            return;
        }
        if matches!(self.lease.status(), LeaseStatus::Lost(_)) {
            state.done = true;
            return;
        }
        if state.renewing.is_some() {
            return;
        }
        let due = state.last_sent + self.interval;
        if now < due {
            self.schedule(&mut state, due);
            return;
        }
        let ttl = self.lease.ttl();
        let acquired_at = self.lease.state().acquired_at();
        if self
            .options
            .max_hold
            .is_some_and(|max| now + ttl > acquired_at + max)
        {
            return self.stop_renewing(state, KeeperStop::MaxHold);
        }
        if self.options.require_progress {
            let count = self.progress.count();
            if self.seen_progress.swap(count, Ordering::Relaxed) == count {
                return self.stop_renewing(state, KeeperStop::NoProgress);
            }
        }
        let this = self.clone();
        // Boxed: the renewal's future lives only while it runs.
        let renewal = self.runtime.spawn(Box::pin(async move {
            let sent = renew_until_confirmed(&*this.lease, ttl).await;
            this.renewed(sent);
        }));
        state.renewing = Some(renewal.abort_handle());
    }

    /// A renewal ended: confirmed when it was sent at `sent`, or the lease is lost.
    fn renewed(self: &Arc<Self>, sent: Option<Instant>) {
        let mut state = self.lock();
        state.renewing = None;
        match sent {
            Some(sent) if !state.done => {
                state.last_sent = sent;
                if state.stop.is_none() {
                    self.schedule(&mut state, sent + self.interval);
                }
            }
            _ => state.done = true,
        }
    }
}

/// A kept lease to wake at `at`.
struct Due {
    at: Instant,
    keeping: Weak<Keeping>,
    /// How many timers this wake-up moved through ([`rehome`]).
    moves: u8,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    /// Reversed: the heap's top is the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.at.cmp(&self.at)
    }
}

/// The timer shared by the leases kept on multi-thread runtimes.
static SHARED_TIMER: Mutex<Option<mpsc::UnboundedSender<Due>>> = Mutex::new(None);

/// The timer for a lease kept on `runtime`.
///
/// On a multi-thread runtime: the process's shared timer, started on `runtime` if there is
/// none or its runtime shut down (a multi-thread runtime's tasks run whenever it is alive, and
/// each renewal is spawned on the lease's own runtime, so any live one can time every lease).
/// On a current-thread runtime (which runs only inside its `block_on`, with its own clock,
/// paused in tests): a timer of the lease's own on that runtime.
fn timer_for(runtime: &tokio::runtime::Handle) -> mpsc::UnboundedSender<Due> {
    if runtime.runtime_flavor() != tokio::runtime::RuntimeFlavor::MultiThread {
        return start_timer(runtime);
    }
    let mut shared = SHARED_TIMER.lock().unwrap_or_else(|p| p.into_inner());
    match &*shared {
        Some(timer) if !timer.is_closed() => timer.clone(),
        _ => {
            let timer = start_timer(runtime);
            *shared = Some(timer.clone());
            timer
        }
    }
}

/// Starts a timer task on `runtime`.
fn start_timer(runtime: &tokio::runtime::Handle) -> mpsc::UnboundedSender<Due> {
    let (tx, rx) = mpsc::unbounded_channel();
    let queue = Queue {
        heap: BinaryHeap::new(),
        rx,
    };
    drop(runtime.spawn(run_timer(queue)));
    tx
}

/// A timer's state. Dropped with its task when the runtime shuts down: the leases it still
/// wakes that are kept on another, running runtime move to a timer there.
struct Queue {
    heap: BinaryHeap<Due>,
    rx: mpsc::UnboundedReceiver<Due>,
}

impl Drop for Queue {
    fn drop(&mut self) {
        self.rx.close();
        let mut left: Vec<Due> = std::mem::take(&mut self.heap).into_vec();
        while let Ok(due) = self.rx.try_recv() {
            left.push(due);
        }
        for due in left {
            rehome(due);
        }
    }
}

/// Moves a lease whose timer is gone to a timer for its own runtime (it is dropped if that
/// runtime shut down too: its renewals could not run anyway).
fn rehome(mut due: Due) {
    let Some(keeping) = due.keeping.upgrade() else {
        return;
    };
    // Bounded, in case a runtime that is shutting down still accepted the new timer's task.
    due.moves += 1;
    let mut state = keeping.lock();
    if !state.done && due.moves <= MAX_MOVES {
        state.timer = timer_for(&keeping.runtime);
        let _ = state.timer.send(due);
    }
}

/// How many times a lease moves to another timer before it is left to run out.
const MAX_MOVES: u8 = 4;

async fn run_timer(mut queue: Queue) {
    let far = || Instant::now() + Duration::from_secs(86_400 * 365);
    let sleep = tokio::time::sleep_until(far());
    tokio::pin!(sleep);
    let mut open = true;
    loop {
        if !open && queue.heap.is_empty() {
            return;
        }
        let next = queue.heap.peek().map_or_else(far, |d| d.at);
        if sleep.deadline() != next {
            sleep.as_mut().reset(next);
        }
        tokio::select! {
            got = queue.rx.recv(), if open => match got {
                Some(due) => {
                    queue.heap.push(due);
                    while let Ok(due) = queue.rx.try_recv() {
                        queue.heap.push(due);
                    }
                }
                // No sender left: no thread keeps through this timer and no lease can be
                // added; it ends with its last lease.
                None => open = false,
            },
            () = &mut sleep => {
                let now = Instant::now();
                while queue.heap.peek().is_some_and(|d| d.at <= now) {
                    let due = queue.heap.pop().expect("peeked");
                    if let Some(keeping) = due.keeping.upgrade() {
                        keeping.wake(now);
                    }
                }
            }
        }
    }
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
