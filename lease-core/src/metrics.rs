//! Signals, through the `metrics` facade (install any recorder) and `tracing`.
//!
//! Every name is recorded in one place in lease-core; adapters emit nothing themselves:
//! [`crate::Instrumented`] wraps any coordinator or fence, the lease tracker counts losses, and the
//! bounded section times critical sections.
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `lease_acquire_total` | counter | backend, mode, outcome | acquisitions by outcome (`acquired`, `held`, `timeout`, ...) |
//! | `lease_acquire_wait_seconds` | histogram | backend, mode, outcome | time from call to outcome |
//! | `lease_renew_seconds` | histogram | backend, outcome | renew latency |
//! | `lease_renew_failures_total` | counter | backend, kind | renewals not confirmed |
//! | `lease_lost_total` | counter | backend, reason | leases lost (not counting plain releases) |
//! | `lease_release_total` | counter | backend, outcome | releases by outcome |
//! | `fence_writes_total` | counter | backend, op, outcome | fence writes and claims by outcome |
//! | `fence_stale_rejected_total` | counter | backend, op | stale tokens rejected at a fence |
//! | `lease_critical_section_seconds` | histogram | outcome | bounded-section duration |
//! | `lease_work_after_loss_total` | counter | | bounded sections that ended after their lease was lost |
//! | `lease_forced_releases_total` | counter | backend | operator force-releases |

use std::time::Duration;

use crate::error::{Error, LostReason};

/// Counter: acquisitions by outcome.
pub const ACQUIRE_TOTAL: &str = "lease_acquire_total";
/// Histogram: time from acquire call to outcome.
pub const ACQUIRE_WAIT_SECONDS: &str = "lease_acquire_wait_seconds";
/// Histogram: renew latency.
pub const RENEW_SECONDS: &str = "lease_renew_seconds";
/// Counter: renewals not confirmed.
pub const RENEW_FAILURES_TOTAL: &str = "lease_renew_failures_total";
/// Counter: leases lost.
pub const LOST_TOTAL: &str = "lease_lost_total";
/// Counter: releases by outcome.
pub const RELEASE_TOTAL: &str = "lease_release_total";
/// Counter: fence writes and claims by outcome.
pub const FENCE_WRITES_TOTAL: &str = "fence_writes_total";
/// Counter: stale tokens rejected at a fence.
pub const STALE_REJECTED_TOTAL: &str = "fence_stale_rejected_total";
/// Histogram: bounded critical-section duration.
pub const CRITICAL_SECTION_SECONDS: &str = "lease_critical_section_seconds";
/// Counter: work that ended after its lease was lost.
pub const WORK_AFTER_LOSS_TOTAL: &str = "lease_work_after_loss_total";
/// Counter: operator force-releases.
pub const FORCED_RELEASES_TOTAL: &str = "lease_forced_releases_total";

fn reason_label(r: LostReason) -> &'static str {
    match r {
        LostReason::Expired => "expired",
        LostReason::Revoked => "revoked",
        LostReason::Released => "released",
        LostReason::Superseded => "superseded",
        LostReason::SessionEnded => "session_ended",
        LostReason::KeeperStopped => "keeper_stopped",
    }
}

pub(crate) fn outcome<T>(r: &Result<T, Error>, ok: &'static str) -> &'static str {
    match r {
        Ok(_) => ok,
        Err(e) => e.kind(),
    }
}

pub(crate) fn acquire(
    backend: &'static str,
    mode: &'static str,
    outcome: &'static str,
    d: Duration,
) {
    metrics::counter!(ACQUIRE_TOTAL, "backend" => backend, "mode" => mode, "outcome" => outcome)
        .increment(1);
    metrics::histogram!(ACQUIRE_WAIT_SECONDS, "backend" => backend, "mode" => mode, "outcome" => outcome)
        .record(d.as_secs_f64());
}

pub(crate) fn renew(backend: &'static str, outcome: &'static str, d: Duration) {
    metrics::histogram!(RENEW_SECONDS, "backend" => backend, "outcome" => outcome)
        .record(d.as_secs_f64());
    if outcome != "renewed" {
        metrics::counter!(RENEW_FAILURES_TOTAL, "backend" => backend, "kind" => outcome)
            .increment(1);
    }
}

pub(crate) fn release(backend: &'static str, outcome: &'static str) {
    metrics::counter!(RELEASE_TOTAL, "backend" => backend, "outcome" => outcome).increment(1);
}

pub(crate) fn lease_lost(backend: &'static str, reason: LostReason) {
    metrics::counter!(LOST_TOTAL, "backend" => backend, "reason" => reason_label(reason))
        .increment(1);
}

pub(crate) fn fence_op(backend: &'static str, op: &'static str, outcome: &'static str) {
    metrics::counter!(FENCE_WRITES_TOTAL, "backend" => backend, "op" => op, "outcome" => outcome)
        .increment(1);
    if outcome == "stale" {
        metrics::counter!(STALE_REJECTED_TOTAL, "backend" => backend, "op" => op).increment(1);
    }
}

pub(crate) fn critical_section(outcome: &'static str, d: Duration) {
    metrics::histogram!(CRITICAL_SECTION_SECONDS, "outcome" => outcome).record(d.as_secs_f64());
}

pub(crate) fn work_after_loss() {
    metrics::counter!(WORK_AFTER_LOSS_TOTAL).increment(1);
}

pub(crate) fn forced_release(backend: &'static str) {
    metrics::counter!(FORCED_RELEASES_TOTAL, "backend" => backend).increment(1);
}
