//! Bounded critical sections: run work under a lease, and stop it when the lease goes.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, LostReason, Result};
use crate::lease::{Lease, LeaseStatus, LostSignal};

/// How a bounded section ends early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionOptions {
    margin: Option<Duration>,
    max_duration: Option<Duration>,
}

impl Default for SectionOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl SectionOptions {
    /// The default: stop a tenth of the TTL before validity ends (at least 1 ms), no other limit.
    pub fn new() -> Self {
        SectionOptions {
            margin: None,
            max_duration: None,
        }
    }

    /// Stop this long before the lease's local validity ends. Must be smaller than the lease's
    /// TTL (checked by [`bounded_with`], `InvalidInput` otherwise).
    pub fn margin(mut self, margin: Duration) -> Self {
        self.margin = Some(margin);
        self
    }

    /// Stop after this long, whatever the lease's validity. A duration too large to add to the
    /// clock is no limit.
    pub fn max_duration(mut self, d: Duration) -> Self {
        self.max_duration = Some(d);
        self
    }

    /// The margin a section keeps for a lease of `ttl` whose validity ends `drift` short of it:
    /// the one set, or a tenth of the TTL (at least 1 ms). `Err(InvalidInput)` when it leaves no
    /// validity window (the guard would refuse even a fresh lease).
    pub(crate) fn margin_for(&self, ttl: Duration, drift: Duration) -> Result<Duration> {
        let margin = self
            .margin
            .unwrap_or_else(|| (ttl / 10).max(Duration::from_millis(1)));
        // The guard refuses once less than `margin` of validity is left; validity is the TTL
        // less the drift margin, so a margin that leaves nothing would refuse a fresh lease.
        if margin >= ttl.saturating_sub(drift) {
            return Err(crate::InvalidInput::OutOfRange {
                field: "margin",
                value: format!("{margin:?}"),
                expected:
                    "smaller than the lease's validity window (its TTL less its drift margin)",
            }
            .into());
        }
        Ok(margin)
    }
}

/// Given to the work inside [`bounded_with`]: lets it check, before starting each piece of
/// sub-work, that the lease is still certainly held. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SectionGuard {
    signal: LostSignal,
    margin: Duration,
    key: String,
    token: crate::Token,
    backend: &'static str,
}

impl SectionGuard {
    /// `Ok` while the lease is held with more than the margin left; otherwise `Err(Lost)`. An
    /// in-doubt lease (its last renewal unconfirmed, its connection lost) starts no new sub-work
    /// either, with a retryable `Err(Unavailable)`, as [`Lease::ensure_held`] reports it: it may
    /// still be held, so do not treat it as gone; but once no more than the margin is left,
    /// in doubt or not, it is `Err(Lost)` with reason `Expired`, as for a held one (no retry
    /// can start sub-work in time).
    pub fn check(&self) -> Result<()> {
        let time_left = self
            .signal
            .valid_until()
            .checked_sub(self.margin)
            .is_some_and(|stop_at| stop_at > Instant::now());
        let reason = match self.signal.status() {
            LeaseStatus::Held if time_left => return Ok(()),
            LeaseStatus::Held => LostReason::Expired,
            LeaseStatus::InDoubt if !time_left => LostReason::Expired,
            LeaseStatus::InDoubt => {
                return Err(Error::unavailable(
                    self.backend,
                    format!(
                        "lease on {:?} is in doubt (its connection was lost, or its last renewal \
                         was not confirmed): no new sub-work starts until a renewal is confirmed",
                        self.key
                    ),
                ))
            }
            LeaseStatus::Lost(r) => r,
        };
        Err(Error::Lost {
            key: self.key.clone(),
            token: self.token,
            reason,
        })
    }
}

/// Runs `work` under `lease`; see [`bounded_with`] (also for cancel safety: dropping this
/// future drops `work` and leaves the lease held).
pub async fn bounded<T, F>(lease: &dyn Lease, work: F) -> Result<T>
where
    F: Future<Output = T>,
{
    bounded_with(
        lease,
        SectionOptions::new(),
        |_| async move { Ok(work.await) },
    )
    .await
}

/// Runs the future made by `work` under `lease`, with a deadline below the lease's validity.
///
/// # Behaviour
///
/// - Refuses a margin not smaller than the lease's validity window, its TTL less its drift
///   margin (`Err(InvalidInput)`: the section could never start), and refuses to start unless
///   the lease is held with more than the margin left: `Err(Lost)`, or a retryable
///   `Err(Unavailable)` while it is in doubt ([`SectionGuard::check`]).
/// - The deadline is the lease's local validity minus the margin, set again whenever validity
///   changes (a keeper renewing the lease moves it later; a backend's cap, such as a session's
///   bound, can bring it closer), and at most `max_duration` after the start.
/// - When the lease is lost or the deadline passes, the future is dropped (cancelled) and the
///   call returns `Err(Lost)` (reason `Expired` for a deadline).
/// - If the work finishes but the lease was lost meanwhile, its result is discarded and the call
///   returns `Err(Lost)`, counted in `fenced_work_after_loss_total`: never a silent success.
/// - The duration is recorded in `fenced_critical_section_seconds` by backend and outcome.
///
/// # Cancel safety
///
/// Dropping the returned future drops `work` (whatever it already sent is its own: fence its
/// writes) and sends nothing for the lease: the lease stays held and is still the caller's to
/// release or keep using.
pub async fn bounded_with<T, W, F>(lease: &dyn Lease, options: SectionOptions, work: W) -> Result<T>
where
    W: FnOnce(SectionGuard) -> F,
    F: Future<Output = Result<T>>,
{
    let margin = options.margin_for(lease.ttl(), lease.state().drift_margin())?;
    let guard = SectionGuard {
        signal: lease.lost(),
        margin,
        key: lease.key().to_string(),
        token: lease.token(),
        backend: lease.state().backend(),
    };
    guard.check()?;
    let start = Instant::now();
    let hard_deadline = options.max_duration.and_then(|d| start.checked_add(d));
    let mut signal = lease.lost();
    let watch = lease.lost();
    let fut = work(guard);
    tokio::pin!(fut);
    let outcome: Result<T> = loop {
        // Any change of validity (a renewal, or a backend's cap that brought it closer) sets
        // the deadline again.
        let changed = watch.next_change();
        tokio::pin!(changed);
        changed.as_mut().enable();
        let soft = watch.valid_until().checked_sub(margin).unwrap_or(start);
        let deadline = hard_deadline.map_or(soft, |h| h.min(soft));
        tokio::select! {
            biased;
            reason = signal.wait() => break Err(lease.state().lost_error(reason)),
            out = &mut fut => {
                break match lease.status() {
                    LeaseStatus::Lost(reason) => {
                        crate::metrics::work_after_loss(lease.state().backend());
                        tracing::warn!(key = %lease.key(), token = %lease.token(), %reason,
                            "work finished after its lease was lost; result discarded");
                        Err(lease.state().lost_error(reason))
                    }
                    _ => out,
                };
            }
            _ = tokio::time::sleep_until(deadline) => {
                let moved = signal.valid_until().checked_sub(margin).unwrap_or(start) > deadline;
                let hard_hit = hard_deadline.is_some_and(|h| Instant::now() >= h);
                if hard_hit || !moved {
                    break Err(lease.state().lost_error(LostReason::Expired));
                }
            }
            () = &mut changed => {}
        }
    };
    let label = match &outcome {
        Ok(_) => "completed",
        Err(Error::Lost { .. }) => "lost",
        Err(_) => "failed",
    };
    crate::metrics::critical_section(lease.state().backend(), label, start.elapsed());
    outcome
}
