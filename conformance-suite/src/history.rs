//! A history of lease and fence operations, and a checker for it, in the spirit of Jepsen's
//! histories and Elle's checkers.
//!
//! Every worker (a task in the harness, or a separate OS process reporting to it) records each
//! operation it performs: when it was invoked, when it completed, and what it returned. All
//! instants are taken on **one** monotonic clock owned by the harness process: a [`History`]
//! holds a `start: std::time::Instant` and stores every instant as an offset from it. A worker
//! process never timestamps: the harness timestamps its lines on receipt (see [`wire`]).
//!
//! [`check`] then decides whether the history could have been produced by a correct lock service
//! and a correct fence (the properties are listed on [`Property`]), and on failure returns a
//! [`Violation`] carrying only the few operations that form it.
//!
//! # Unknown outcomes
//!
//! An operation whose outcome was not observed (a timeout, a lost reply:
//! [`lease_core::Error::OutcomeUnknown`], or a worker killed mid-call) is recorded as
//! [`Grant::Unknown`], [`Done::Unknown`] or [`FenceOutcome::Unknown`], or with no completion at
//! all. The checker treats it as *maybe applied*: it is never counted as an acceptance or a grant,
//! and it is never assumed not to have happened where a rejection proves that it did (property
//! (d) reads the fence's own report of its newest token instead).
//!
//! # Recording
//!
//! ```
//! use conformance_suite::history::{check, FenceOutcome, History, OpKind};
//!
//! let history = History::new(Some(7));
//! let rec = history.recorder("w0");
//! let call = rec.invoke();
//! // ... the fence call happens here ...
//! call.complete(OpKind::Claim {
//!     resource: "r".into(),
//!     token: 3,
//!     outcome: FenceOutcome::Accepted,
//! });
//! assert_eq!(check(&history).unwrap().accepted_claims, 1);
//! ```

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use lease_core::{
    Accepted, Bytes, Error, Fence, FencedValue, HolderInfo, Lease, LockKey, ResourceId, Token,
};

mod check;
pub mod wire;

#[cfg(test)]
mod tests;

pub use check::{check, check_except, CheckSummary, Property, Violation};

/// A shared, append-only history of operations on one monotonic clock.
///
/// Cheap to clone (an `Arc`), `Send + Sync`: give a clone (or a [`Recorder`]) to every task.
/// Operations are stored in the order they were *completed* (or abandoned); their ids are their
/// positions in that order.
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

struct Inner {
    start: Instant,
    seed: Option<u64>,
    ops: Mutex<Vec<Op>>,
}

impl fmt::Debug for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("History")
            .field("seed", &self.inner.seed)
            .field("ops", &self.len())
            .finish()
    }
}

impl History {
    /// An empty history whose clock starts now. `seed` is the run's seed, if it has one; it is
    /// printed with any [`Violation`].
    pub fn new(seed: Option<u64>) -> History {
        History {
            inner: Arc::new(Inner {
                start: Instant::now(),
                seed,
                ops: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The instant all offsets are measured from.
    pub fn start(&self) -> Instant {
        self.inner.start
    }

    /// The run's seed, as given to [`History::new`].
    pub fn seed(&self) -> Option<u64> {
        self.inner.seed
    }

    /// The current instant, as an offset from [`History::start`].
    pub fn now(&self) -> Duration {
        self.inner.start.elapsed()
    }

    /// `at` as an offset from [`History::start`] (zero for an instant before the start).
    pub fn offset(&self, at: Instant) -> Duration {
        at.saturating_duration_since(self.inner.start)
    }

    /// A lease deadline `at` (tokio's clock, as [`lease_core::Lease::valid_until`] gives it) as
    /// an offset from [`History::start`], no later than the true one (by the moment between two
    /// clock reads), also for a deadline already passed. Histories are recorded in real time:
    /// under tokio's paused clock the two clocks part, and so would this.
    pub fn deadline(&self, at: tokio::time::Instant) -> Duration {
        // The history's clock is read first, so that its "now" is no later than tokio's.
        let now = self.now();
        let tokio_now = tokio::time::Instant::now();
        if at >= tokio_now {
            now + (at - tokio_now)
        } else {
            now.saturating_sub(tokio_now - at)
        }
    }

    /// A recorder for the worker called `process` (any label, for the excerpts: `w3`,
    /// `pid 4242`).
    pub fn recorder(&self, process: impl Into<String>) -> Recorder {
        Recorder {
            history: self.clone(),
            process: Arc::from(process.into()),
        }
    }

    /// Appends `op` as given, except its `id`, which is set to its position; returns that id.
    ///
    /// For histories built by hand or decoded from elsewhere; workers use a [`Recorder`]. The
    /// caller is responsible for `invoked <= completed`.
    pub fn push(&self, mut op: Op) -> usize {
        let mut ops = self.inner.ops.lock().expect("history lock");
        op.id = ops.len();
        ops.push(op);
        ops.len() - 1
    }

    /// A copy of every operation so far, by id.
    pub fn ops(&self) -> Vec<Op> {
        self.inner.ops.lock().expect("history lock").clone()
    }

    /// How many operations are recorded.
    pub fn len(&self) -> usize {
        self.inner.ops.lock().expect("history lock").len()
    }

    /// Whether no operation is recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One worker's handle on a [`History`]: stamps each operation with the worker's label and the
/// harness clock. Cheap to clone, `Send + Sync`.
#[derive(Clone, Debug)]
pub struct Recorder {
    history: History,
    process: Arc<str>,
}

impl Recorder {
    /// The worker's label.
    pub fn process(&self) -> &str {
        &self.process
    }

    /// The history recorded into.
    pub fn history(&self) -> &History {
        &self.history
    }

    /// Takes the invocation instant of an operation about to be called. Call it *before* the
    /// operation starts, then [`Invocation::complete`] once its result is known.
    pub fn invoke(&self) -> Invocation {
        Invocation {
            recorder: self.clone(),
            invoked: self.history.now(),
        }
    }

    /// Records an instantaneous event (a [`OpKind::Lost`] signal): invoked and completed now.
    pub fn signal(&self, kind: OpKind) -> usize {
        let now = self.history.now();
        self.push(now, Some(now), kind)
    }

    /// Records that the holder of `lease` sees it [`Held`](lease_core::LeaseStatus::Held), valid
    /// until its [`valid_until`](lease_core::Lease::valid_until) (an [`OpKind::Valid`]
    /// observation, for property (e)); records nothing for a lease not held. Take it just
    /// before a release, so that a renewed lease's tenure is checked to its end.
    pub fn valid(&self, lease: &dyn Lease) -> Option<usize> {
        // The deadline before the status: `Held` then says it had not passed when read.
        let valid_until = self.history.deadline(lease.valid_until());
        (lease.status() == lease_core::LeaseStatus::Held).then(|| {
            self.signal(OpKind::Valid {
                key: lease.key().as_str().to_owned(),
                token: lease.token().get(),
                valid_until,
            })
        })
    }

    /// Records an operation with explicit offsets (used by [`wire::WorkerFeed`]).
    pub fn record(&self, invoked: Duration, completed: Option<Duration>, kind: OpKind) -> usize {
        self.push(invoked, completed, kind)
    }

    fn push(&self, invoked: Duration, completed: Option<Duration>, kind: OpKind) -> usize {
        self.history.push(Op {
            id: 0,
            process: self.process.clone(),
            invoked,
            completed,
            kind,
        })
    }
}

/// An operation in flight: its invocation instant is taken. Complete it, or abandon it if its
/// result will never be known.
#[derive(Debug)]
#[must_use = "an invocation records nothing until completed or abandoned"]
pub struct Invocation {
    recorder: Recorder,
    invoked: Duration,
}

impl Invocation {
    /// The invocation instant (offset from the history's start).
    pub fn invoked(&self) -> Duration {
        self.invoked
    }

    /// Records the operation as completed now with `kind` (which carries the outcome); returns
    /// its id.
    pub fn complete(self, kind: OpKind) -> usize {
        let now = self.recorder.history.now();
        self.recorder.push(self.invoked, Some(now), kind)
    }

    /// Records an acquisition of `key` completed now with `result`: the token granted and the
    /// validity the lease reports, or the error. Returns its id.
    pub fn acquired(self, key: &LockKey, result: &lease_core::Result<Box<dyn Lease>>) -> usize {
        let valid_until = result
            .as_ref()
            .ok()
            .map(|lease| self.recorder.history.deadline(lease.valid_until()));
        self.complete(OpKind::Acquire {
            key: key.as_str().to_owned(),
            outcome: Grant::from_result(result.as_ref().map(|l| l.token())),
            valid_until,
        })
    }

    /// Records the operation as never completed (the worker crashed or was cancelled mid-call):
    /// it may take effect at any instant after its invocation. `kind` should carry an unknown
    /// outcome.
    pub fn abandon(self, kind: OpKind) -> usize {
        self.recorder.push(self.invoked, None, kind)
    }
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    /// Its position in the history.
    pub id: usize,
    /// The worker that performed it.
    pub process: Arc<str>,
    /// When it was invoked, as an offset from the history's start.
    pub invoked: Duration,
    /// When it completed, or `None` if it never did (it may take effect at any later instant).
    pub completed: Option<Duration>,
    /// What it was and what it returned.
    pub kind: OpKind,
}

impl Op {
    /// Whether this operation completed strictly before `other` was invoked (real-time order).
    pub fn precedes(&self, other: &Op) -> bool {
        self.completed.is_some_and(|c| c < other.invoked)
    }
}

fn secs(d: Duration) -> String {
    format!("{:.6}s", d.as_secs_f64())
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let completed = self.completed.map_or("never".to_owned(), secs);
        write!(
            f,
            "#{} [{} .. {}] {} {}",
            self.id,
            secs(self.invoked),
            completed,
            self.process,
            self.kind
        )
    }
}

/// What an operation was, with its outcome. Tokens are [`Token::get`] values.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpKind {
    /// An acquisition of `key`.
    Acquire {
        /// The lock key.
        key: String,
        /// The token granted, or why not.
        outcome: Grant,
        /// For a grant, the end of the validity the lease reported when it was granted
        /// ([`lease_core::Lease::valid_until`]), as an offset from the history's start; `None`
        /// when not known. It must not be later than the true one (a worker process's is its
        /// feed's floor plus when it printed the grant and the validity it had left then).
        /// Renewals only move it later ([`OpKind::Valid`] records what a holder saw since), so
        /// the grant's is a lower bound of the whole tenure. On a history line ([`wire`]) it is
        /// the validity *left* when the line was printed, which the feed turns into this.
        valid_until: Option<Duration>,
    },
    /// A renewal of the lease `token` on `key`.
    Renew {
        /// The lock key.
        key: String,
        /// The lease's token.
        token: u64,
        /// Whether it was renewed.
        outcome: Done,
    },
    /// A release of the lease `token` on `key`.
    Release {
        /// The lock key.
        key: String,
        /// The lease's token.
        token: u64,
        /// Whether it was released.
        outcome: Done,
    },
    /// The holder of `token` on `key` saw its lease held, valid until `valid_until` (an offset
    /// from the history's start, no later than the true one): an instantaneous observation, such
    /// as after a renewal. Property (e) checks a tenure to the latest one seen.
    Valid {
        /// The lock key.
        key: String,
        /// The lease's token.
        token: u64,
        /// The end of the validity seen.
        valid_until: Duration,
    },
    /// An operator's forced release of `key` ([`lease_core::Coordinator::force_release`]).
    ForceRelease {
        /// The lock key.
        key: String,
        /// The token the request expected the holder to have
        /// ([`lease_core::ForceRelease::expect_token`]), if it named one: such a request removes
        /// that holder or nothing, whenever it applies.
        expected: Option<u64>,
        /// The holder it removed, or why not.
        outcome: Forced,
    },
    /// The holder of `token` on `key` was told its lease is lost (an instantaneous signal).
    Lost {
        /// The lock key.
        key: String,
        /// The lease's token.
        token: u64,
    },
    /// A fence claim of `resource` with `token`.
    Claim {
        /// The protected resource.
        resource: String,
        /// The token presented.
        token: u64,
        /// What the fence answered.
        outcome: FenceOutcome,
    },
    /// A fenced write of `value` to `resource` with `token`.
    Write {
        /// The protected resource.
        resource: String,
        /// The token presented.
        token: u64,
        /// The value written.
        value: Bytes,
        /// What the fence answered.
        outcome: FenceOutcome,
    },
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpKind::Acquire {
                key,
                outcome,
                valid_until,
            } => {
                write!(f, "acquire key={key} {outcome}")?;
                match valid_until {
                    Some(v) => write!(f, " valid-until={}", secs(*v)),
                    None => Ok(()),
                }
            }
            OpKind::ForceRelease {
                key,
                expected,
                outcome,
            } => {
                write!(f, "force-release key={key} ")?;
                if let Some(t) = expected {
                    write!(f, "expecting={t} ")?;
                }
                write!(f, "{outcome}")
            }
            OpKind::Valid {
                key,
                token,
                valid_until,
            } => write!(
                f,
                "valid key={key} token={token} until={}",
                secs(*valid_until)
            ),
            OpKind::Renew {
                key,
                token,
                outcome,
            } => write!(f, "renew key={key} token={token} {outcome}"),
            OpKind::Release {
                key,
                token,
                outcome,
            } => write!(f, "release key={key} token={token} {outcome}"),
            OpKind::Lost { key, token } => write!(f, "lost key={key} token={token}"),
            OpKind::Claim {
                resource,
                token,
                outcome,
            } => write!(f, "claim resource={resource} token={token} {outcome}"),
            OpKind::Write {
                resource,
                token,
                value,
                outcome,
            } => {
                let shown: String = String::from_utf8_lossy(value).chars().take(40).collect();
                write!(
                    f,
                    "write resource={resource} token={token} value={shown:?} {outcome}"
                )
            }
        }
    }
}

/// Whether an error leaves the outcome unknown (the request may have applied).
fn unknown(e: &Error) -> bool {
    matches!(e, Error::OutcomeUnknown { .. })
}

/// The outcome of an acquisition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// Granted with this token.
    Granted(u64),
    /// Definitely not granted (held, timed out waiting, unavailable...): the error text.
    Failed(String),
    /// Maybe granted, with a token nobody saw: the error text.
    Unknown(String),
}

impl Grant {
    /// From an acquisition's result mapped to its token (`result.as_ref().map(|l| l.token())`).
    /// [`Error::OutcomeUnknown`] is [`Grant::Unknown`]; every other error is [`Grant::Failed`].
    pub fn from_result(result: Result<Token, &Error>) -> Grant {
        match result {
            Ok(t) => Grant::Granted(t.get()),
            Err(e) if unknown(e) => Grant::Unknown(e.to_string()),
            Err(e) => Grant::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Grant::Granted(t) => write!(f, "granted token={t}"),
            Grant::Failed(e) => write!(f, "failed ({e})"),
            Grant::Unknown(e) => write!(f, "unknown ({e})"),
        }
    }
}

/// The outcome of an operator's forced release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forced {
    /// The holder with this token was removed.
    Removed(u64),
    /// Nobody held the key: nothing was removed.
    NoneHeld,
    /// It failed with an error that says it removed no holder (unavailable, refused...): the
    /// error text. (An adapter may still have cleared a value no holder owned.)
    Failed(String),
    /// It may have removed a holder: the error text.
    Unknown(String),
}

impl Forced {
    /// From a forced release's result. [`Error::OutcomeUnknown`] is [`Forced::Unknown`]; every
    /// other error is [`Forced::Failed`].
    pub fn from_result(result: &lease_core::Result<Option<HolderInfo>>) -> Forced {
        match result {
            Ok(Some(holder)) => Forced::Removed(holder.token.get()),
            Ok(None) => Forced::NoneHeld,
            Err(e) if unknown(e) => Forced::Unknown(e.to_string()),
            Err(e) => Forced::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for Forced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Forced::Removed(t) => write!(f, "removed token={t}"),
            Forced::NoneHeld => f.write_str("none held"),
            Forced::Failed(e) => write!(f, "failed ({e})"),
            Forced::Unknown(e) => write!(f, "unknown ({e})"),
        }
    }
}

/// The outcome of a renewal or a release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Done {
    /// It took effect.
    Ok,
    /// It definitely did not (the lease was lost, the backend unavailable...): the error text.
    Failed(String),
    /// It may or may not have taken effect: the error text.
    Unknown(String),
}

impl Done {
    /// From a renewal's or release's result. [`Error::OutcomeUnknown`] is [`Done::Unknown`];
    /// every other error is [`Done::Failed`].
    pub fn from_result<T>(result: &lease_core::Result<T>) -> Done {
        match result {
            Ok(_) => Done::Ok,
            Err(e) if unknown(e) => Done::Unknown(e.to_string()),
            Err(e) => Done::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for Done {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Done::Ok => f.write_str("ok"),
            Done::Failed(e) => write!(f, "failed ({e})"),
            Done::Unknown(e) => write!(f, "unknown ({e})"),
        }
    }
}

/// What a fence answered to a claim or write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FenceOutcome {
    /// Accepted: the resource's newest token is now the one presented.
    Accepted,
    /// Rejected as stale: the fence reported `current` as its newest accepted token.
    Rejected {
        /// The newest token the fence reported.
        current: u64,
    },
    /// Definitely not applied, for another reason (unavailable, invalid): the error text.
    Failed(String),
    /// Maybe applied: the error text.
    Unknown(String),
}

impl FenceOutcome {
    /// From a fence call's result: `Ok` is accepted, [`Error::Stale`] rejected,
    /// [`Error::OutcomeUnknown`] unknown, anything else failed.
    pub fn from_result(result: &lease_core::Result<Accepted>) -> FenceOutcome {
        match result {
            Ok(_) => FenceOutcome::Accepted,
            Err(Error::Stale { current, .. }) => FenceOutcome::Rejected {
                current: current.get(),
            },
            Err(e) if unknown(e) => FenceOutcome::Unknown(e.to_string()),
            Err(e) => FenceOutcome::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for FenceOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FenceOutcome::Accepted => f.write_str("accepted"),
            FenceOutcome::Rejected { current } => write!(f, "rejected (current={current})"),
            FenceOutcome::Failed(e) => write!(f, "failed ({e})"),
            FenceOutcome::Unknown(e) => write!(f, "unknown ({e})"),
        }
    }
}

/// A [`Fence`] that records every claim and write it forwards into a [`History`], invoked just
/// before the call and completed just after it, under its recorder's label.
///
/// Reads are forwarded without recording. A call cancelled mid-flight (its future dropped) is
/// recorded as never completed with an unknown outcome. Put one in front of the fence a
/// [`lease_testkit::fence_server::FenceServer`] serves, and the claims and writes of worker *processes*
/// are timestamped by the harness at the server: the fence's effect lies between the two.
#[derive(Debug, Clone)]
pub struct HistoryFence {
    inner: Arc<dyn Fence>,
    recorder: Recorder,
}

impl HistoryFence {
    /// Records calls to `inner` with `recorder`.
    pub fn new(inner: Arc<dyn Fence>, recorder: Recorder) -> HistoryFence {
        HistoryFence { inner, recorder }
    }
}

/// Abandons the invocation (never completed, unknown outcome) unless disarmed by completion.
struct InFlight {
    call: Option<Invocation>,
    kind: Option<OpKind>,
}

impl InFlight {
    fn complete(mut self, kind: OpKind) {
        if let Some(call) = self.call.take() {
            call.complete(kind);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let (Some(call), Some(kind)) = (self.call.take(), self.kind.take()) {
            call.abandon(kind);
        }
    }
}

#[async_trait]
impl Fence for HistoryFence {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn write(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Bytes,
    ) -> lease_core::Result<Accepted> {
        let kind = |outcome| OpKind::Write {
            resource: resource.as_str().to_owned(),
            token: token.get(),
            value: value.clone(),
            outcome,
        };
        let flight = InFlight {
            call: Some(self.recorder.invoke()),
            kind: Some(kind(FenceOutcome::Unknown("cancelled".into()))),
        };
        let r = self.inner.write(resource, token, value.clone()).await;
        flight.complete(kind(FenceOutcome::from_result(&r)));
        r
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> lease_core::Result<Accepted> {
        let kind = |outcome| OpKind::Claim {
            resource: resource.as_str().to_owned(),
            token: token.get(),
            outcome,
        };
        let flight = InFlight {
            call: Some(self.recorder.invoke()),
            kind: Some(kind(FenceOutcome::Unknown("cancelled".into()))),
        };
        let r = self.inner.claim(resource, token).await;
        flight.complete(kind(FenceOutcome::from_result(&r)));
        r
    }

    async fn read(&self, resource: &ResourceId) -> lease_core::Result<Option<FencedValue>> {
        self.inner.read(resource).await
    }
}
