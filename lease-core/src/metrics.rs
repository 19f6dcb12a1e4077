//! Signals, through the `metrics` facade (install any recorder) and `tracing`.
//!
//! Every name starts with `fenced_` and is recorded in one place, this module; adapters emit
//! nothing themselves. Every metric carries a `backend` label (`memory`, `redis`, `etcd`,
//! `zookeeper`, `consul`, `postgres`, ...); the other labels are `mode` (`wait` or `try`),
//! `outcome` (the operation's result: a success word such as `acquired`, or the error's
//! [`Error::kind`]), `reason` (a [`LostReason`]) and `op` (`write` or `claim`). See
//! `docs/metrics.md` for PromQL queries.
//!
//! | name | kind | unit | labels | meaning | emitted by |
//! |---|---|---|---|---|---|
//! | `fenced_acquire_total` | counter | count | backend, mode, outcome | acquisitions by outcome (`acquired`, `held`, `timeout`, ...) | [`Instrumented`](crate::Instrumented) |
//! | `fenced_acquire_wait_seconds` | histogram | seconds | backend, mode, outcome | time from call to outcome | [`Instrumented`](crate::Instrumented) |
//! | `fenced_renew_seconds` | histogram | seconds | backend, outcome | renew latency (`renewed`, `lost`, `unavailable`, ...) | [`Instrumented`](crate::Instrumented) |
//! | `fenced_renew_failures_total` | counter | count | backend, outcome | renewals not confirmed, by error kind | [`Instrumented`](crate::Instrumented) |
//! | `fenced_renew_validity_left_seconds` | histogram | seconds | backend | local validity left when a keeper's renewal was confirmed | the keeper |
//! | `fenced_leases_held` | gauge | count | backend | leases this process holds now | the lease tracker |
//! | `fenced_leases_lost_total` | counter | count | backend, reason | leases lost (not counting plain releases) | the lease tracker |
//! | `fenced_release_total` | counter | count | backend, outcome | releases by outcome (`released`, `lost`, ...) | [`Instrumented`](crate::Instrumented) |
//! | `fenced_fence_operations_total` | counter | count | backend, op, outcome | fence writes and claims by outcome (`accepted`, `stale`, ...) | [`Instrumented`](crate::Instrumented) |
//! | `fenced_fence_stale_rejected_total` | counter | count | backend, op | stale tokens rejected at a fence | [`Instrumented`](crate::Instrumented) |
//! | `fenced_critical_section_seconds` | histogram | seconds | backend, outcome | bounded-section duration (`completed`, `lost`, `failed`) | [`crate::bounded`] |
//! | `fenced_work_after_loss_total` | counter | count | backend | bounded sections whose work finished after their lease was lost | [`crate::bounded`] |
//! | `fenced_forced_releases_total` | counter | count | backend | operator force-releases carried out | [`Instrumented`](crate::Instrumented) |
//!
//! # Which handles are measured
//!
//! The lease-level signals (`fenced_leases_held`, `fenced_leases_lost_total`,
//! `fenced_renew_validity_left_seconds`, and the bounded-section metrics) come from code every
//! backend shares (the [`crate::adapter::LeaseTracker`], the keeper, [`crate::bounded`]), so they are
//! emitted for every lease, however its coordinator was built. The request-level signals
//! (acquire, renew latency, release, fence operations, forced releases) are measured by the
//! [`Instrumented`](crate::Instrumented) wrapper: [`crate::Registry::connect`] always returns instrumented handles; an
//! adapter built directly (for example `RedisCoordinator::connect(config)`) is measured the same
//! way once wrapped, `Instrumented::new(coordinator)`.
//!
//! `fenced_leases_held` counts a lease from its grant until it is released, known lost, or
//! dropped; a lease whose validity ran out while nothing looked at it (no keeper, no status call)
//! is counted until then.
//!
//! # Descriptions and units
//!
//! [`describe`] registers a description (Prometheus `# HELP`) and a unit for every metric above.
//! lease-core calls it by itself before the first signal it emits to a recorder it has not
//! described yet (so installing the recorder before or after the first lease both work); calling
//! it again is harmless.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use metrics::Unit;

use crate::error::{Error, LostReason};

/// Counter: acquisitions by outcome.
pub const ACQUIRE_TOTAL: &str = "fenced_acquire_total";
/// Histogram: time from acquire call to outcome, in seconds.
pub const ACQUIRE_WAIT_SECONDS: &str = "fenced_acquire_wait_seconds";
/// Histogram: renew latency, in seconds.
pub const RENEW_SECONDS: &str = "fenced_renew_seconds";
/// Counter: renewals not confirmed, by outcome (the error kind).
pub const RENEW_FAILURES_TOTAL: &str = "fenced_renew_failures_total";
/// Histogram: local validity left when a keeper's renewal was confirmed, in seconds.
pub const RENEW_VALIDITY_LEFT_SECONDS: &str = "fenced_renew_validity_left_seconds";
/// Gauge: leases this process holds now.
pub const LEASES_HELD: &str = "fenced_leases_held";
/// Counter: leases lost, by reason.
pub const LOST_TOTAL: &str = "fenced_leases_lost_total";
/// Counter: releases by outcome.
pub const RELEASE_TOTAL: &str = "fenced_release_total";
/// Counter: fence writes and claims by outcome.
pub const FENCE_WRITES_TOTAL: &str = "fenced_fence_operations_total";
/// Counter: stale tokens rejected at a fence.
pub const STALE_REJECTED_TOTAL: &str = "fenced_fence_stale_rejected_total";
/// Histogram: bounded critical-section duration, in seconds.
pub const CRITICAL_SECTION_SECONDS: &str = "fenced_critical_section_seconds";
/// Counter: work that ended after its lease was lost.
pub const WORK_AFTER_LOSS_TOTAL: &str = "fenced_work_after_loss_total";
/// Counter: operator force-releases.
pub const FORCED_RELEASES_TOTAL: &str = "fenced_forced_releases_total";

/// Every metric name above, in table order.
pub const ALL: [&str; 13] = [
    ACQUIRE_TOTAL,
    ACQUIRE_WAIT_SECONDS,
    RENEW_SECONDS,
    RENEW_FAILURES_TOTAL,
    RENEW_VALIDITY_LEFT_SECONDS,
    LEASES_HELD,
    LOST_TOTAL,
    RELEASE_TOTAL,
    FENCE_WRITES_TOTAL,
    STALE_REJECTED_TOTAL,
    CRITICAL_SECTION_SECONDS,
    WORK_AFTER_LOSS_TOTAL,
    FORCED_RELEASES_TOTAL,
];

/// Registers the description and unit of every metric with the recorder in use (the global one,
/// or a local one set with `metrics::with_local_recorder`).
///
/// lease-core calls this itself before it first emits to a recorder; call it yourself only if
/// your exporter needs the descriptions before any lease is taken.
pub fn describe() {
    metrics::describe_counter!(
        ACQUIRE_TOTAL,
        Unit::Count,
        "Lease acquisitions, by mode (wait or try) and outcome (acquired or the error kind)."
    );
    metrics::describe_histogram!(
        ACQUIRE_WAIT_SECONDS,
        Unit::Seconds,
        "Time from an acquire call to its outcome, by mode and outcome."
    );
    metrics::describe_histogram!(
        RENEW_SECONDS,
        Unit::Seconds,
        "Lease renewal latency, by outcome (renewed or the error kind)."
    );
    metrics::describe_counter!(
        RENEW_FAILURES_TOTAL,
        Unit::Count,
        "Lease renewals not confirmed, by outcome (the error kind)."
    );
    metrics::describe_histogram!(
        RENEW_VALIDITY_LEFT_SECONDS,
        Unit::Seconds,
        "Local lease validity left when a keeper's renewal was confirmed; near zero means renewals barely make it."
    );
    metrics::describe_gauge!(
        LEASES_HELD,
        Unit::Count,
        "Leases this process holds now (granted, not yet released, lost or dropped)."
    );
    metrics::describe_counter!(
        LOST_TOTAL,
        Unit::Count,
        "Leases lost, by reason (expired, revoked, superseded, session_ended, keeper_stopped); plain releases are not counted."
    );
    metrics::describe_counter!(
        RELEASE_TOTAL,
        Unit::Count,
        "Lease releases, by outcome (released or the error kind)."
    );
    metrics::describe_counter!(
        FENCE_WRITES_TOTAL,
        Unit::Count,
        "Fence writes and claims, by op (write or claim) and outcome (accepted or the error kind)."
    );
    metrics::describe_counter!(
        STALE_REJECTED_TOTAL,
        Unit::Count,
        "Stale fencing tokens rejected at a fence, by op (write or claim)."
    );
    metrics::describe_histogram!(
        CRITICAL_SECTION_SECONDS,
        Unit::Seconds,
        "Duration of bounded critical sections, by outcome (completed, lost, failed)."
    );
    metrics::describe_counter!(
        WORK_AFTER_LOSS_TOTAL,
        Unit::Count,
        "Bounded sections whose work finished after their lease was lost (result discarded)."
    );
    metrics::describe_counter!(
        FORCED_RELEASES_TOTAL,
        Unit::Count,
        "Operator force-releases carried out."
    );
}

/// The address of the recorder last described (0: none yet).
static DESCRIBED: AtomicUsize = AtomicUsize::new(0);

/// Calls [`describe`] if the recorder in use is not the one last described.
fn described() {
    let current =
        metrics::with_recorder(|r| r as *const dyn metrics::Recorder as *const () as usize);
    if DESCRIBED.swap(current, Ordering::Relaxed) != current {
        describe();
    }
}

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
    described();
    metrics::counter!(ACQUIRE_TOTAL, "backend" => backend, "mode" => mode, "outcome" => outcome)
        .increment(1);
    metrics::histogram!(ACQUIRE_WAIT_SECONDS, "backend" => backend, "mode" => mode, "outcome" => outcome)
        .record(d.as_secs_f64());
}

pub(crate) fn renew(backend: &'static str, outcome: &'static str, d: Duration) {
    described();
    metrics::histogram!(RENEW_SECONDS, "backend" => backend, "outcome" => outcome)
        .record(d.as_secs_f64());
    if outcome != "renewed" {
        metrics::counter!(RENEW_FAILURES_TOTAL, "backend" => backend, "outcome" => outcome)
            .increment(1);
    }
}

/// Records the local validity a lease had left when its renewal was confirmed.
pub(crate) fn renew_validity_left(backend: &'static str, left: Duration) {
    described();
    metrics::histogram!(RENEW_VALIDITY_LEFT_SECONDS, "backend" => backend)
        .record(left.as_secs_f64());
}

pub(crate) fn release(backend: &'static str, outcome: &'static str) {
    described();
    metrics::counter!(RELEASE_TOTAL, "backend" => backend, "outcome" => outcome).increment(1);
}

pub(crate) fn lease_lost(backend: &'static str, reason: LostReason) {
    described();
    metrics::counter!(LOST_TOTAL, "backend" => backend, "reason" => reason_label(reason))
        .increment(1);
}

pub(crate) fn fence_op(backend: &'static str, op: &'static str, outcome: &'static str) {
    described();
    metrics::counter!(FENCE_WRITES_TOTAL, "backend" => backend, "op" => op, "outcome" => outcome)
        .increment(1);
    if outcome == "stale" {
        metrics::counter!(STALE_REJECTED_TOTAL, "backend" => backend, "op" => op).increment(1);
    }
}

pub(crate) fn critical_section(backend: &'static str, outcome: &'static str, d: Duration) {
    described();
    metrics::histogram!(CRITICAL_SECTION_SECONDS, "backend" => backend, "outcome" => outcome)
        .record(d.as_secs_f64());
}

pub(crate) fn work_after_loss(backend: &'static str) {
    described();
    metrics::counter!(WORK_AFTER_LOSS_TOTAL, "backend" => backend).increment(1);
}

pub(crate) fn forced_release(backend: &'static str) {
    described();
    metrics::counter!(FORCED_RELEASES_TOTAL, "backend" => backend).increment(1);
}

/// One lease counted in `fenced_leases_held`: added when created, taken away once, at
/// [`HeldLease::ended`] or on drop, from the same recorder it was added to.
pub(crate) struct HeldLease {
    gauge: metrics::Gauge,
    counted: std::sync::atomic::AtomicBool,
}

impl HeldLease {
    /// Counts one more held lease on `backend`.
    pub(crate) fn new(backend: &'static str) -> Self {
        described();
        let gauge = metrics::gauge!(LEASES_HELD, "backend" => backend);
        gauge.increment(1.0);
        HeldLease {
            gauge,
            counted: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// The lease is no longer held; only the first call counts.
    pub(crate) fn ended(&self) {
        if self.counted.swap(false, Ordering::Relaxed) {
            self.gauge.decrement(1.0);
        }
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        self.ended();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeSet;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use crate::memory::{MemoryCoordinator, MemoryFence};
    use crate::{
        bounded, keep, Bytes, Coordinator, Fence, ForceRelease, Instrumented, KeeperOptions, Lease,
        LeaseOptions, LockKey, ResourceId, Token,
    };

    /// One metric as recorded: name, labels, unit, description, value.
    struct Entry {
        name: String,
        labels: Vec<(String, String)>,
        unit: Option<Unit>,
        description: Option<String>,
        value: DebugValue,
    }

    /// Runs `body` on a paused current-thread runtime with a fresh local recorder, and returns
    /// what it recorded. The recorder is leaked so that no later one shares its address.
    fn record<F: std::future::Future<Output = ()>>(body: impl FnOnce() -> F) -> Vec<Entry> {
        let recorder: &'static DebuggingRecorder = Box::leak(Box::new(DebuggingRecorder::new()));
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(recorder, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap()
                .block_on(body())
        });
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(ck, unit, description, value)| {
                let k = ck.key();
                Entry {
                    name: k.name().to_owned(),
                    labels: k
                        .labels()
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect(),
                    unit,
                    description: description.map(|d| d.to_string()),
                    value,
                }
            })
            .collect()
    }

    fn key(s: &str) -> LockKey {
        LockKey::new(s).unwrap()
    }

    fn exact(ttl: Duration) -> LeaseOptions {
        LeaseOptions::new(ttl).drift_margin(Duration::ZERO)
    }

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    fn gauge(seen: &[Entry], name: &str) -> f64 {
        seen.iter()
            .filter(|e| e.name == name)
            .map(|e| match e.value {
                DebugValue::Gauge(g) => g.into_inner(),
                ref other => panic!("{name} is not a gauge: {other:?}"),
            })
            .sum()
    }

    fn histogram(seen: &[Entry], name: &str) -> Vec<f64> {
        seen.iter()
            .filter(|e| e.name == name)
            .flat_map(|e| match &e.value {
                DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .collect()
    }

    /// A force-release that finds the key free removed nothing: it is not counted as a forced
    /// release (an alerting counter must not move on a no-op).
    #[test]
    fn a_force_release_of_a_free_key_is_not_counted() {
        let seen = record(|| async {
            let coord = Instrumented::new(MemoryCoordinator::new());
            let removed = coord
                .force_release(
                    &key("metrics/free"),
                    &ForceRelease::new("ops", "drill").unwrap(),
                )
                .await
                .unwrap();
            assert!(removed.is_none());
        });
        let counted: u64 = seen
            .iter()
            .filter(|e| e.name == FORCED_RELEASES_TOTAL)
            .map(|e| match e.value {
                DebugValue::Counter(c) => c,
                ref other => panic!("not a counter: {other:?}"),
            })
            .sum();
        assert_eq!(counted, 0);
    }

    /// Touches every signal once, through the memory backend.
    async fn every_signal() {
        let coord = Instrumented::new(MemoryCoordinator::new());
        let fence = Instrumented::new(MemoryFence::new());
        let k = key("metrics/all");
        // Acquire (try and wait), a renewal refused, a release refused, a forced release.
        let lease = coord.try_acquire(&k, &exact(secs(3))).await.unwrap();
        let kept = keep(lease, KeeperOptions::new()).unwrap();
        bounded(kept.lease(), tokio::time::sleep(secs(1)))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await; // one keeper renewal
        assert!(coord
            .acquire(&k, &exact(secs(1)).wait(secs(1)))
            .await
            .is_err());
        coord
            .force_release(&k, &ForceRelease::new("alice", "drill").unwrap())
            .await
            .unwrap();
        assert!(kept.lease().renew().await.is_err());
        // Work that finishes after its lease was lost.
        let r = bounded(kept.lease(), async {}).await;
        assert!(r.is_err());
        assert!(kept.release().await.is_err());
        let lease = coord.try_acquire(&k, &exact(secs(3))).await.unwrap();
        let section = bounded(&*lease, async {
            coord
                .force_release(&k, &ForceRelease::new("bob", "again").unwrap())
                .await
                .unwrap();
        })
        .await;
        assert!(section.is_err());
        // A fence write accepted and one rejected as stale.
        let r = ResourceId::from(&k);
        fence
            .write(&r, Token::new(2).unwrap(), Bytes::from_static(b"a"))
            .await
            .unwrap();
        assert!(fence.claim(&r, Token::new(1).unwrap()).await.is_err());
    }

    #[test]
    fn every_metric_is_prefixed_described_with_its_unit_and_labelled_by_backend() {
        let seen = record(every_signal);
        let allowed: BTreeSet<&str> = ["backend", "mode", "outcome", "reason", "op"].into();
        for name in ALL {
            assert!(name.starts_with("fenced_"), "{name}");
            let entries: Vec<&Entry> = seen.iter().filter(|e| e.name == name).collect();
            assert!(!entries.is_empty(), "{name} was not emitted");
            for e in entries {
                let expected = if name.ends_with("_seconds") {
                    Unit::Seconds
                } else {
                    Unit::Count
                };
                assert_eq!(e.unit, Some(expected), "{name}'s unit");
                assert!(
                    e.description.as_deref().is_some_and(|d| d.len() > 10),
                    "{name} has no description"
                );
                assert!(
                    e.labels
                        .iter()
                        .any(|(k, v)| k == "backend" && v == "memory"),
                    "{name} has no backend label: {:?}",
                    e.labels
                );
                for (k, _) in &e.labels {
                    assert!(allowed.contains(k.as_str()), "{name}: label {k}");
                }
            }
        }
        // Nothing outside the table.
        for e in &seen {
            assert!(ALL.contains(&e.name.as_str()), "unlisted metric {}", e.name);
        }
        // The renew failure is labelled by outcome, like every other result.
        assert!(seen.iter().any(|e| e.name == RENEW_FAILURES_TOTAL
            && e.labels.contains(&("outcome".into(), "lost".into()))));
    }

    #[test]
    fn describe_alone_registers_every_description() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            describe();
            // Descriptions show in a snapshot only next to a value.
            for name in ALL {
                if name == LEASES_HELD {
                    metrics::gauge!(name, "backend" => "x").set(0.0);
                } else if name.ends_with("_seconds") {
                    metrics::histogram!(name, "backend" => "x").record(0.0);
                } else {
                    metrics::counter!(name, "backend" => "x").increment(0);
                }
            }
        });
        let described = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(_, unit, desc, _)| unit.is_some() && desc.is_some())
            .count();
        assert_eq!(described, ALL.len());
    }

    #[test]
    fn leases_held_follows_grants_releases_losses_and_drops_without_instrumented() {
        let seen = record(|| async {
            // A coordinator used directly, as an adapter built without `connect`.
            let coord = MemoryCoordinator::new();
            let a = coord
                .try_acquire(&key("held/a"), &exact(secs(60)))
                .await
                .unwrap();
            let b = coord
                .try_acquire(&key("held/b"), &exact(secs(60)))
                .await
                .unwrap();
            let c = coord
                .try_acquire(&key("held/c"), &exact(secs(60)))
                .await
                .unwrap();
            let d = coord
                .try_acquire(&key("held/d"), &exact(secs(1)))
                .await
                .unwrap();
            a.release().await.unwrap();
            coord
                .force_release(&key("held/b"), &ForceRelease::new("op", "test").unwrap())
                .await
                .unwrap();
            drop(c);
            tokio::time::sleep(secs(2)).await;
            // Seen expired (the first status call after validity records the loss).
            assert!(d.ensure_held().is_err());
            // Still counted once each, however many times the end is seen.
            a.release().await.unwrap_err();
            drop((a, b, d));
            let e = coord
                .try_acquire(&key("held/e"), &exact(secs(60)))
                .await
                .unwrap();
            std::mem::forget(e);
        });
        assert_eq!(gauge(&seen, LEASES_HELD), 1.0);
        // Only the lease-level loss counter is emitted without `Instrumented`; no request-level
        // ones.
        assert!(seen
            .iter()
            .all(|e| e.name == LEASES_HELD || e.name == LOST_TOTAL));
    }

    #[test]
    fn keeper_records_validity_left_at_each_confirmed_renewal() {
        let seen = record(|| async {
            let coord = MemoryCoordinator::new();
            let lease = coord
                .try_acquire(&key("validity"), &exact(secs(3)))
                .await
                .unwrap();
            let kept = keep(lease, KeeperOptions::new().jitter(0.0)).unwrap();
            // Renewals at 1 s, 2 s and 3 s, each confirmed with 2 s of validity left.
            tokio::time::sleep(Duration::from_millis(3500)).await;
            kept.release().await.unwrap();
        });
        assert_eq!(histogram(&seen, RENEW_VALIDITY_LEFT_SECONDS), vec![2.0; 3]);
    }
}
