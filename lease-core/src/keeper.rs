//! The keeper: auto-renewal written once over the [`Lease`] trait, timed by one thread for every
//! lease kept on a multi-thread runtime (decision 0024).

use std::collections::BinaryHeap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::FutureExt;
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
    jitter: f64,
    max_hold: Option<Duration>,
    require_progress: bool,
}

impl Default for KeeperOptions {
    fn default() -> Self {
        KeeperOptions {
            renew_fraction: 1.0 / 3.0,
            jitter: 0.1,
            max_hold: None,
            require_progress: false,
        }
    }
}

impl KeeperOptions {
    /// Renew every third of the validity window (the TTL less the drift margin; up to a tenth of
    /// that early, at random), forever, without requiring progress.
    pub fn new() -> Self {
        Self::default()
    }

    /// Renew when this fraction of the lease's validity window (its TTL less its drift margin)
    /// has passed since the last confirmed renewal was sent. Must be in `(0, 0.9]`; checked by
    /// [`keep`].
    pub fn renew_fraction(mut self, fraction: f64) -> Self {
        self.renew_fraction = fraction;
        self
    }

    /// Renew up to this fraction of the renewal interval early, at random (default 0.1), so that
    /// leases whose validity starts together (acquired within one session keepalive, say) do
    /// not all renew at the same instant ever after. Must be in `[0, 0.5]`; checked by
    /// [`keep`]. Renewing early never shortens a lease.
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = fraction;
        self
    }

    /// Never hold the lease longer than this in total (counted from acquisition): the keeper sends
    /// no renewal (first try or retry) whose TTL, counted from its sending, would reach past
    /// `acquired_at + max`, so the lease's validity runs out at or before that point and it
    /// reports `Lost(KeeperStopped)`. The server counts a TTL from when it applies the renewal, so
    /// the lock itself may outlive that point by as long as the last renewal took to reach it (at
    /// most the backend's request timeout): a limit for holders, not a promise to waiters. A limit too large
    /// to add to the clock (`Duration::MAX`, say) is no limit; one shorter than the lease's TTL
    /// is refused by [`keep`] (`InvalidInput`), since the grant alone holds the lock that long.
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
/// - The keeper renews when `renew_fraction` of the validity window (the TTL less the drift
///   margin; less up to `jitter` of that, at random) has passed since the last confirmed renewal
///   was *sent*; sooner when the validity a renewal confirmed (a backend's cap, such as a
///   session's bound) ends before that leaves a try's time: then at `renew_fraction` of that
///   validity, unless something else has moved it by then (a session's heartbeat), in which
///   case it only looks again, shortly before that validity ends, and renews only if it has
///   not moved since. It retries failed renewals (with backoff, capped at a quarter to a half
///   of the validity left, so that tries go on until its end), each try bounded by half the
///   validity left so that a lost reply leaves time for another, until local validity ends; if
///   no renewal is confirmed by then, the lease reports `Lost(Expired)` and the keeper exits.
/// - A try that is not confirmed (the backend unavailable, an unknown outcome, no answer in its
///   bound) marks the lease [`InDoubt`](LeaseStatus::InDoubt) until a renewal confirms (a later
///   try, or where the backend renews a whole session, as etcd and Consul do, that session's
///   own confirmed keepalive): renewal
///   has become uncertain, so a section's guard refuses new sub-work meanwhile
///   ([`SectionGuard::check`](crate::SectionGuard::check)), while work already running goes on
///   to the validity it has.
/// - It stops when the lease is lost or released, when [`Kept`] is dropped (a renewal under way
///   is aborted and the lease dropped with it), on [`Kept::stop`], when the maximum hold passes,
///   or when progress is required and none was reported. It never outlives its `Kept`.
/// - After stopping on purpose it lets the lease run out, which then reads as
///   `Lost(KeeperStopped)` everywhere (status, lost signal, errors), unless the lease was lost
///   otherwise first.
/// - A panic in an adapter's renewal ends that lease's keeping (logged; the lease runs out at its
///   validity); it never stops the timer that wakes the other kept leases.
///
/// # Cost
///
/// On a multi-thread runtime a kept lease has no task of its own while it waits for its next
/// renewal: one timer thread per process wakes every such lease and spawns each renewal as a
/// short task on the runtime `keep` was called on, so holding many kept leases costs a few
/// hundred bytes each (decision 0024). On a current-thread runtime each kept lease has a small
/// timer task of its own on that runtime.
pub struct Kept {
    /// `None` only while dropping.
    keeping: Option<Arc<Keeping>>,
}

impl fmt::Debug for Kept {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kept")
            .field("lease", &self.keeping().lease)
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
    if !(0.0..=0.5).contains(&options.jitter) {
        return Err(InvalidInput::OutOfRange {
            field: "jitter",
            value: options.jitter.to_string(),
            expected: "in [0, 0.5]",
        }
        .into());
    }
    if let Some(max) = options.max_hold.filter(|max| *max < lease.ttl()) {
        // The grant alone keeps the lock for its TTL: a shorter limit cannot be kept.
        return Err(InvalidInput::OutOfRange {
            field: "max_hold",
            value: format!("{max:?}"),
            expected: "at least the lease's TTL (the grant alone holds the lock that long)",
        }
        .into());
    }
    let lease: Arc<dyn Lease> = Arc::from(lease);
    let runtime = tokio::runtime::Handle::current();
    let timer = Timer::for_runtime(&runtime);
    // The validity a renewal buys (`Lease::valid_until`): the drift margin comes off the TTL.
    let window = lease
        .ttl()
        .saturating_sub(lease.state().drift_margin())
        .max(Duration::from_millis(1));
    let interval = window.mul_f64(options.renew_fraction);
    let progress = Progress::default();
    let acquired_at = lease.state().acquired_at();
    let hold_until = options
        .max_hold
        .and_then(|max| acquired_at.checked_add(max));
    let next_due = acquired_at + jittered(interval, options.jitter);
    let confirmed_until = lease.valid_until();
    let keeping = Arc::new(Keeping {
        seen_progress: AtomicU64::new(progress.count()),
        lease,
        options,
        hold_until,
        window,
        interval,
        progress,
        runtime,
        state: Mutex::new(KeepState {
            stop: None,
            next_due,
            planned: None,
            cap_moves: false,
            confirmed_until,
            progress_checked: acquired_at,
            renewing: None,
            timer,
            done: false,
        }),
    });
    keeping.schedule(&mut keeping.lock(), next_due, Wake::Renew);
    Ok(Kept {
        keeping: Some(keeping),
    })
}

impl Kept {
    fn keeping(&self) -> &Arc<Keeping> {
        self.keeping.as_ref().expect("present until dropped")
    }

    /// The lease being kept.
    pub fn lease(&self) -> &dyn Lease {
        &*self.keeping().lease
    }

    /// The lease's token.
    pub fn token(&self) -> Token {
        self.keeping().lease.token()
    }

    /// The lease's lost signal.
    pub fn lost(&self) -> LostSignal {
        self.keeping().lease.lost()
    }

    /// The progress handle to give to the protected work.
    pub fn progress(&self) -> Progress {
        self.keeping().progress.clone()
    }

    /// Why the keeper stopped renewing, if it stopped on purpose.
    pub fn stopped(&self) -> Option<KeeperStop> {
        self.keeping().lock().stop
    }

    /// Stops renewing; the lease runs out at its current validity (a renewal under way may
    /// still move it once).
    pub fn stop(&self) {
        let state = self.keeping().lock();
        if state.stop.is_none() && !state.done {
            self.keeping().stop_renewing(state, KeeperStop::Requested);
        }
    }

    /// Stops the keeper, then releases the lease (compare-and-delete).
    ///
    /// Cancel safety: the keeper is stopped before the first await; a dropped future then drops
    /// the lease mid-release, as for a dropped [`Lease::release`] followed by dropping the lease
    /// (released best-effort, and in any case it expires at its TTL).
    pub async fn release(self) -> Result<()> {
        self.keeping().end();
        self.keeping().lease.release().await
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        if let Some(keeping) = self.keeping.take() {
            keeping.end();
            // The lease may be dropped here: inside its runtime, where adapters start their
            // background delete.
            let _entered = keeping.runtime.enter();
            drop(keeping);
        }
    }
}

/// One kept lease: owned by its [`Kept`] and, while a renewal runs, by that renewal's task; the
/// timer holds it weakly, so dropping the `Kept` drops the lease at once.
struct Keeping {
    lease: Arc<dyn Lease>,
    options: KeeperOptions,
    /// `acquired_at + max_hold`, if that is a limit (`None`: no limit).
    hold_until: Option<Instant>,
    /// The validity window: the TTL less the drift margin (what a renewal buys uncapped).
    window: Duration,
    /// `renew_fraction` of the validity window.
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
    /// When the next renewal is due: `renew_fraction` of the validity window (less the jitter)
    /// after the send time of the last confirmed renewal (the acquisition at first).
    next_due: Instant,
    /// When `next_due` was brought forward because the validity confirmed ended too soon (see
    /// [`Keeping::next_renewal`]): the renewal first planned, and the validity seen then. If
    /// something else has moved validity by `next_due` (a session's heartbeat), the keeper
    /// looks again later instead of renewing, up to the renewal first planned.
    planned: Option<(Instant, Instant)>,
    /// Whether the last look, or the last planned renewal, found validity moved by something
    /// else: a cap is then taken for one a heartbeat keeps moving, and looked at shortly before
    /// it ends ([`Keeping::look_at`]) rather than at `renew_fraction` of it. One that finds it
    /// unmoved (the heartbeat stalled, or a cap nothing moves) clears it.
    cap_moves: bool,
    /// The validity right after the last confirmed renewal (the grant's, at first): a planned
    /// renewal that finds validity moved past it knows something else moves it.
    confirmed_until: Instant,
    /// When progress was last checked (`require_progress`): at every planned renewal, and at
    /// most once an interval at renewals brought forward.
    progress_checked: Instant,
    /// The renewal under way.
    renewing: Option<AbortHandle>,
    /// The timer that wakes this lease.
    timer: Timer,
    /// Nothing more to do: lost, ended, or run out after a stop.
    done: bool,
}

impl Keeping {
    fn lock(&self) -> MutexGuard<'_, KeepState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Asks the timer to wake this lease at `at`.
    fn schedule(self: &Arc<Self>, state: &mut KeepState, at: Instant, what: Wake) {
        state.timer.send(Due {
            at,
            keeping: Arc::downgrade(self),
            what,
        });
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
        self.lease.state().runs_out_as(LostReason::KeeperStopped);
        tracing::warn!(
            key = %self.lease.key(),
            token = %self.lease.token(),
            reason = ?why,
            "keeper stopped renewing; the lease runs out at its validity"
        );
        self.schedule(&mut state, self.lease.valid_until(), Wake::RunOut);
    }

    /// The timer woke this lease at `now`.
    fn wake(self: &Arc<Self>, now: Instant) {
        let mut state = self.lock();
        if state.done {
            return;
        }
        if state.stop.is_some() {
            // Running out: record it once validity ended (as `KeeperStopped`, set at the stop;
            // the first recorded reason wins, so a revocation or release seen earlier stays). A
            // renewal that was under way at the stop may have moved validity.
            if self.lease.lost().is_lost() {
                state.done = true;
                drop(state);
                let _recorded = self.lease.status();
            } else {
                self.schedule(&mut state, self.lease.valid_until(), Wake::RunOut);
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
        let due = state.next_due;
        if now < due {
            self.schedule(&mut state, due, Wake::Renew);
            return;
        }
        let taken = state.planned.take();
        let early = taken.is_some_and(|(planned, _)| now < planned);
        if taken.is_none() {
            // A planned renewal: has something else moved validity since the last one?
            state.cap_moves = self.lease.valid_until() > state.confirmed_until;
        }
        if let Some((planned, seen)) = taken {
            // Brought forward for a validity that ended too soon, and moved since by something
            // else (a session's heartbeat extends it on ZooKeeper and Consul): no renewal yet;
            // look again shortly before that validity ends, up to the renewal first planned.
            // Only while that validity leaves a try's time: a heartbeat nudging a validity about
            // to end would otherwise bring the next look to now, again and again.
            let valid_until = self.lease.valid_until();
            state.cap_moves = valid_until > seen;
            if state.cap_moves && now < planned && valid_until >= now + MIN_TRY {
                let next = self.look_at(now, valid_until, true).min(planned);
                state.planned = (next < planned).then_some((planned, valid_until));
                state.next_due = next;
                self.schedule(&mut state, next, Wake::Renew);
                return;
            }
        }
        let ttl = self.lease.ttl();
        if outlives(now, ttl, self.hold_until) {
            return self.stop_renewing(state, KeeperStop::MaxHold);
        }
        // A renewal brought forward checks progress only if an interval has passed since the
        // last check: progress is asked for once an interval, not once a renewal.
        let check_progress = !early || now >= state.progress_checked + self.interval;
        if self.options.require_progress && check_progress {
            state.progress_checked = now;
            let count = self.progress.count();
            if self.seen_progress.swap(count, Ordering::Relaxed) == count {
                return self.stop_renewing(state, KeeperStop::NoProgress);
            }
        }
        let this = self.clone();
        // Boxed: the renewal's future lives only while it runs.
        let renewal = self.runtime.spawn(Box::pin(async move {
            let renewing = renew_until_confirmed(&*this.lease, ttl, this.hold_until);
            let outcome = std::panic::AssertUnwindSafe(renewing)
                .catch_unwind()
                .await
                .unwrap_or_else(|_| {
                    tracing::error!(key = %this.lease.key(), token = %this.lease.token(),
                        "keeper: the renewal panicked; the lease runs out at its validity");
                    Renewal::Ended
                });
            this.renewed(outcome);
        }));
        state.renewing = Some(renewal.abort_handle());
    }

    /// When to renew after a renewal sent at `sent` was confirmed: at `planned`, unless the
    /// backend capped the validity short of the whole window (a session's bound its heartbeat
    /// has not moved yet, an adapter's own limit) and it ends before `planned` leaves a try's
    /// time ([`MIN_TRY`]). Then at `renew_fraction` of the validity left after the send, never
    /// later than `planned`, and no sooner than `MIN_TRY` after the send unless half that
    /// validity is less ([`Self::early`]), so a cap that does not move is not renewed back to
    /// back. A cap that leaves time before `planned` changes nothing, and one that something
    /// else keeps moving (a session's heartbeat on ZooKeeper and Consul) sends nothing early:
    /// the keeper only looks again ([`KeepState::planned`]), shortly before it ends once it has
    /// been seen to move (`cap_moves`, [`Self::look_at`]).
    fn next_renewal(&self, sent: Instant, planned: Instant, cap_moves: bool) -> Instant {
        let valid_until = self.lease.valid_until();
        // Uncapped, a renewal buys the whole window from its send: a short TTL whose planned
        // renewal leaves less than `MIN_TRY` is renewed as planned, not later.
        let capped = valid_until + CAP_TOLERANCE < sent + self.window;
        if !capped || planned + MIN_TRY <= valid_until {
            return planned;
        }
        self.look_at(sent, valid_until, cap_moves).min(planned)
    }

    /// When to look at a capped validity next, from `from`: at `renew_fraction` of what is left
    /// ([`Self::early`]); or, for a cap something else keeps moving (`moves`), shortly before it
    /// ends: half of what the fraction rule would leave, and at least [`LOOK_LEAD`], and no
    /// sooner than that fraction. Not at the fraction then: a session's heartbeat comes every
    /// third of its timeout, so a look at a fraction of the validity left often falls between
    /// two heartbeats, finds the cap unmoved, and renews for nothing (every lease of the
    /// session, every heartbeat period).
    fn look_at(&self, from: Instant, valid_until: Instant, moves: bool) -> Instant {
        let early = self.early(from, valid_until);
        if !moves {
            return early;
        }
        let left = valid_until.saturating_duration_since(from);
        let lead = LOOK_LEAD.max(left.mul_f64((1.0 - self.options.renew_fraction) / 2.0));
        valid_until
            .checked_sub(lead)
            .map_or(early, |before_end| before_end.max(early))
    }

    /// `renew_fraction` of the validity left after `from`, and no sooner than `MIN_TRY` after
    /// it unless half the validity left is less.
    fn early(&self, from: Instant, valid_until: Instant) -> Instant {
        let left = valid_until.saturating_duration_since(from);
        from + left
            .mul_f64(self.options.renew_fraction)
            .max(MIN_TRY.min(left / 2))
    }

    /// A renewal ended.
    fn renewed(self: &Arc<Self>, outcome: Renewal) {
        let mut state = self.lock();
        state.renewing = None;
        match outcome {
            _ if state.done => {}
            // Stopped meanwhile: running out is already scheduled.
            Renewal::MaxHold if state.stop.is_some() => {}
            Renewal::MaxHold => self.stop_renewing(state, KeeperStop::MaxHold),
            Renewal::Confirmed { sent } => {
                let planned = sent + jittered(self.interval, self.options.jitter);
                let valid_until = self.lease.valid_until();
                let mut next = self.next_renewal(sent, planned, state.cap_moves);
                if next < planned {
                    // Never back to back: a confirmation that came late leaves the next look
                    // a try's time away (or half the validity left, if that is less).
                    let now = Instant::now();
                    let floor = now + MIN_TRY.min(valid_until.saturating_duration_since(now) / 2);
                    next = next.max(floor).min(planned);
                }
                state.next_due = next;
                state.planned = (next < planned).then_some((planned, valid_until));
                state.confirmed_until = valid_until;
                if state.stop.is_none() {
                    let due = state.next_due;
                    self.schedule(&mut state, due, Wake::Renew);
                }
            }
            Renewal::Ended => state.done = true,
        }
    }
}

/// Whether a renewal sent at `now` would let the lock outlive `hold_until` (the server counts
/// `ttl` from when it applies the renewal, which is no earlier than `now`).
fn outlives(now: Instant, ttl: Duration, hold_until: Option<Instant>) -> bool {
    hold_until.is_some_and(|limit| now.checked_add(ttl).is_none_or(|end| end > limit))
}

/// `interval`, up to `jitter` of it shorter at random.
fn jittered(interval: Duration, jitter: f64) -> Duration {
    if jitter == 0.0 {
        return interval;
    }
    interval.mul_f64(1.0 - jitter * rand::random::<f64>())
}

/// A kept lease to wake at `at`.
struct Due {
    at: Instant,
    keeping: Weak<Keeping>,
    what: Wake,
}

/// What a wake-up is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// A renewal is due: a few milliseconds early is fine ([`COALESCE`]).
    Renew,
    /// Validity ends (after a stop): not before.
    RunOut,
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

/// Which timer wakes a kept lease.
enum Timer {
    /// The process's timer thread ([`SharedTimer`]), for leases kept on multi-thread runtimes.
    Shared,
    /// A timer task of the lease's own on its current-thread runtime.
    Own(mpsc::UnboundedSender<Due>),
}

impl Timer {
    /// The timer for a lease kept on `runtime`.
    ///
    /// On a multi-thread runtime: the process's timer thread (it spawns each renewal on the
    /// lease's own runtime, so the lease depends on no other runtime's being responsive or
    /// alive). On a current-thread runtime (which runs only inside its `block_on`, with its own
    /// clock, paused in tests): a timer task of the lease's own on that runtime, which ends with
    /// the lease or the runtime.
    fn for_runtime(runtime: &tokio::runtime::Handle) -> Timer {
        if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
            return Timer::Shared;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        drop(runtime.spawn(run_own_timer(rx)));
        Timer::Own(tx)
    }

    /// Asks for `due`. A lease whose own runtime shut down is not woken again (its renewals
    /// could not run anyway).
    fn send(&self, due: Due) {
        match self {
            Timer::Shared => SharedTimer::get().push(due),
            Timer::Own(tx) => {
                let _ = tx.send(due);
            }
        }
    }
}

/// The process's timer thread for leases kept on multi-thread runtimes: a heap of wake-ups
/// under a mutex, and a thread that sleeps until the earliest (`Condvar::wait_timeout`).
/// (A multi-thread runtime's clock cannot be paused, so the monotonic clock is the runtime's.)
struct SharedTimer {
    heap: Mutex<BinaryHeap<Due>>,
    changed: std::sync::Condvar,
    /// The heap's length above which [`push`](Self::push) drops the wake-ups of leases no longer
    /// kept (read and written under `heap`'s lock).
    purge_above: std::sync::atomic::AtomicUsize,
}

/// The least length of the shared timer's heap at which wake-ups of leases no longer kept are
/// dropped in bulk.
const PURGE_FLOOR: usize = 1024;

impl SharedTimer {
    fn get() -> &'static SharedTimer {
        static TIMER: std::sync::OnceLock<&'static SharedTimer> = std::sync::OnceLock::new();
        TIMER.get_or_init(|| {
            let timer: &'static SharedTimer = Box::leak(Box::new(SharedTimer {
                heap: Mutex::new(BinaryHeap::new()),
                changed: std::sync::Condvar::new(),
                purge_above: std::sync::atomic::AtomicUsize::new(PURGE_FLOOR),
            }));
            std::thread::Builder::new()
                .name("fenced-keeper".into())
                .spawn(move || timer.run())
                .expect("the keeper's timer thread starts");
            timer
        })
    }

    fn push(&self, due: Due) {
        let mut heap = self.heap.lock().unwrap_or_else(|p| p.into_inner());
        let earliest = heap.peek().is_none_or(|first| due.at < first.at);
        heap.push(due);
        if heap.len() > self.purge_above.load(Ordering::Relaxed) {
            // A lease released or dropped before its wake-up leaves that wake-up (and its
            // allocation, through the weak reference) in the heap until it is due: with a long
            // TTL and many short holdings, millions. Dropped in bulk here, so the heap stays
            // within about twice the kept leases (amortized: the next purge waits until the
            // heap has doubled again).
            heap.retain(|d| d.keeping.strong_count() > 0);
            self.purge_above
                .store((heap.len() * 2).max(PURGE_FLOOR), Ordering::Relaxed);
        }
        drop(heap);
        if earliest {
            self.changed.notify_one();
        }
    }

    fn run(&self) {
        let mut heap = self.heap.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let now = Instant::now();
            let mut woken = Vec::new();
            // Wake-ups due within the next few milliseconds go together: a renewal a moment
            // early costs nothing, and one wake-up (and one batch at the backend) for several
            // leases is cheaper than one each.
            while heap
                .peek()
                .is_some_and(|d| d.at <= now || (d.what == Wake::Renew && d.at <= now + COALESCE))
            {
                woken.push(heap.pop().expect("peeked"));
            }
            if !woken.is_empty() {
                drop(heap);
                for due in woken {
                    // One lease's panic must not stop the thread that wakes all the others.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wake(due, now)))
                        .is_err()
                    {
                        tracing::error!("keeper: waking a kept lease panicked; it is not renewed");
                    }
                }
                heap = self.heap.lock().unwrap_or_else(|p| p.into_inner());
                continue;
            }
            heap = match heap.peek().map(|d| d.at) {
                None => self.changed.wait(heap).unwrap_or_else(|p| p.into_inner()),
                Some(at) => {
                    self.changed
                        .wait_timeout(heap, at.saturating_duration_since(now))
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }
}

/// How early the timer thread wakes a lease to wake it together with others.
const COALESCE: Duration = Duration::from_millis(5);

/// Wakes the lease of `due`, if it is still kept, inside its own runtime's context (the lease
/// may be dropped here, and adapters start their background delete on the current runtime).
fn wake(due: Due, now: Instant) {
    if let Some(keeping) = due.keeping.upgrade() {
        let _entered = keeping.runtime.enter();
        // A renewal woken early by the timer thread counts as due.
        let now = match due.what {
            Wake::Renew => now.max(due.at),
            Wake::RunOut => now,
        };
        keeping.wake(now);
        drop(keeping);
    }
}

/// A lease's own timer task (current-thread runtimes): ends when the lease goes (its sender is
/// dropped) or with the runtime.
async fn run_own_timer(mut rx: mpsc::UnboundedReceiver<Due>) {
    let mut heap = BinaryHeap::new();
    loop {
        let next = heap.peek().map(|d: &Due| d.at);
        tokio::select! {
            got = rx.recv() => match got {
                Some(due) => heap.push(due),
                None => return,
            },
            () = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                let now = Instant::now();
                while heap.peek().is_some_and(|d| d.at <= now) {
                    wake(heap.pop().expect("peeked"), now);
                }
            }
        }
    }
}

/// The least time one renewal try is given (unless less validity is left).
const MIN_TRY: Duration = Duration::from_millis(100);

/// The floor of the cap on a renewal retry's delay (half the validity left, at most): below it
/// the backoff alone decides, so tries near the end of validity are not sent back to back.
const MIN_RETRY_GAP: Duration = Duration::from_millis(10);

/// The least time before a validity that something else keeps moving (a session's heartbeat)
/// ends that the keeper looks at it again ([`Keeping::look_at`]): if it has not moved by then,
/// the keeper renews, with at least this left.
const LOOK_LEAD: Duration = Duration::from_millis(200);

/// How much short of the whole window a renewal's validity may be and still count as uncapped
/// (an adapter may count it from a slightly later instant than the send).
const CAP_TOLERANCE: Duration = Duration::from_millis(1);

/// How a renewal (with its retries) ended.
enum Renewal {
    /// Confirmed for the request sent at `sent`.
    Confirmed { sent: Instant },
    /// The next try would let the lock outlive `max_hold`: none was sent.
    MaxHold,
    /// The lease is lost (validity passed, or the backend said so), or the renewal panicked.
    Ended,
}

/// Renews, retrying transient failures with backoff until validity ends, and sending no try that
/// would let the lock outlive `hold_until`.
async fn renew_until_confirmed(
    lease: &dyn Lease,
    ttl: Duration,
    hold_until: Option<Instant>,
) -> Renewal {
    let mut backoff = Backoff::new((ttl / 50).max(Duration::from_millis(5)), ttl / 5);
    loop {
        if matches!(lease.status(), LeaseStatus::Lost(_)) {
            return Renewal::Ended;
        }
        let sent = Instant::now();
        if outlives(sent, ttl, hold_until) {
            return Renewal::MaxHold;
        }
        let deadline = lease.valid_until();
        // One try may take at most half the validity left (and no less than `MIN_TRY` unless
        // less is left): a try whose reply is lost leaves time for another instead of waiting
        // for the backend's own request timeout up to the end of validity.
        let left = deadline.saturating_duration_since(sent);
        let bound = deadline.min(sent + (left / 2).max(MIN_TRY));
        match tokio::time::timeout_at(bound, lease.renew()).await {
            Ok(Ok(_)) => {
                crate::metrics::renew_validity_left(
                    lease.state().backend(),
                    deadline.saturating_duration_since(Instant::now()),
                );
                return Renewal::Confirmed { sent };
            }
            Ok(Err(e @ (Error::Lost { .. } | Error::Stale { .. }))) => {
                tracing::warn!(key = %lease.key(), error = %e, "keeper: renewal refused, lease lost");
                // The error's own reason (`Stale`: superseded at the fence).
                let reason = match &e {
                    Error::Lost { reason, .. } => *reason,
                    _ => LostReason::Superseded,
                };
                // A release under way decides the reason itself (it may find the lock revoked):
                // the renewal's error then carries only its stand-in, `Released`.
                if !lease.state().release_begun() {
                    lease.state().mark_lost(reason);
                }
                return Renewal::Ended;
            }
            Ok(Err(e)) => {
                tracing::warn!(key = %lease.key(), error = %e, "keeper: renewal not confirmed, retrying");
                lease.state().in_doubt();
            }
            Err(_) if bound < deadline => {
                tracing::warn!(key = %lease.key(), "keeper: renewal not answered within half the validity left, trying again");
                lease.state().in_doubt();
                continue;
            }
            Err(_) => {
                tracing::warn!(key = %lease.key(), "keeper: renewal timed out at the end of validity");
            }
        }
        if matches!(lease.status(), LeaseStatus::Lost(_)) {
            // Validity passed (recorded as `Expired`, or `KeeperStopped` after a stop).
            return Renewal::Ended;
        }
        // Never put the next try off by more than half the validity left (a quarter to a half,
        // at random, so that leases sharing one validity do not retry in step; and no less than
        // `MIN_RETRY_GAP`): a backoff grown past what is left would skip the last tries, and an
        // outage that ends before validity does would still lose the lease.
        let now = Instant::now();
        let valid_until = lease.valid_until();
        let left = valid_until.saturating_duration_since(now);
        let share = 0.25 + 0.25 * rand::random::<f64>();
        let delay = backoff
            .next_delay()
            .min(left.mul_f64(share).max(MIN_RETRY_GAP));
        tokio::time::sleep_until((now + delay).min(valid_until)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryCoordinator;
    use crate::{Coordinator, LeaseOptions, LockKey};

    /// Leases kept and then dropped long before their first renewal leave no wake-ups behind in
    /// the shared timer. Before, each stayed (with its allocation) until its renewal was due: an
    /// hour's TTL and 10,000 short holdings left 10,000 wake-ups for 20 minutes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_keepers_do_not_pile_up_in_the_shared_timer() {
        let c = MemoryCoordinator::new();
        let options = LeaseOptions::new(Duration::from_secs(3600));
        for i in 0..10_000 {
            let key = LockKey::new(format!("purge/{i}")).unwrap();
            let lease = c.try_acquire(&key, &options).await.unwrap();
            drop(keep(lease, KeeperOptions::new()).unwrap());
        }
        let len = SharedTimer::get()
            .heap
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len();
        assert!(
            len < 5_000,
            "{len} wake-ups left in the shared timer's heap"
        );
    }
}
