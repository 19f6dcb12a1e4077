//! The keeper (`lease_core::keep`) over the in-memory backend and over a scripted lease.

mod common;

use common::*;
use lease_core::adapter::LeaseTracker;
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    keep, Coordinator, Error, ForceRelease, InvalidInput, KeeperOptions, KeeperStop, Lease,
    LeaseOptions, LeaseStatus, LostReason,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

async fn assert_held_by_other(c: &MemoryCoordinator, k: &lease_core::LockKey) {
    match c.try_acquire(k, &exact(secs(1))).await {
        Err(Error::Held { .. }) => {}
        other => panic!("expected Held, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn keeps_a_lease_alive_past_several_ttls() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let kept = keep(lease, KeeperOptions::new().jitter(0.0)).unwrap();
    let t0 = Instant::now();
    while Instant::now() - t0 < secs(15) {
        tokio::time::sleep(ms(250)).await;
        assert_held_by_other(&c, &k).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
        let info = c.inspect(&k).await.unwrap().unwrap();
        assert_eq!(info.token, tok(1));
        // Renewed every second: never less than 2 s left on the server.
        assert!(info.expires_in.unwrap() >= secs(2), "{info:?}");
    }
    assert_eq!(kept.stopped(), None);
    assert_eq!(c.last_token(&k), Some(tok(1)));
}

#[tokio::test(start_paused = true)]
async fn renews_at_the_configured_fraction_of_the_ttl() {
    let lease = ScriptedLease::new(secs(4), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(
        Box::new(lease),
        KeeperOptions::new().jitter(0.0).renew_fraction(0.5),
    )
    .unwrap();
    tokio::time::sleep(ms(1999)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 0);
    tokio::time::sleep(ms(2)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 1);
    tokio::time::sleep(secs(4)).await; // t = 6.001
    assert_eq!(renews.load(Ordering::SeqCst), 3);
    assert_eq!(
        kept.lease().valid_until(),
        kept.lease().state().acquired_at() + secs(10)
    );
}

#[tokio::test(start_paused = true)]
async fn dropping_kept_stops_renewal_and_drops_the_lease() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let mut sig = kept.lost();
    tokio::time::sleep(ms(3500)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 3);
    let dropped_at = Instant::now();
    drop(kept);
    // The keeper task is gone and took the lease with it: the signal sees the lease dropped.
    assert_eq!(
        within(secs(600), "lost signal", sig.wait()).await,
        LostReason::Released
    );
    assert_eq!(Instant::now(), dropped_at);
    tokio::time::sleep(secs(30)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 3, "no renewal after drop");
}

#[tokio::test(start_paused = true)]
async fn dropping_kept_frees_the_memory_lock_by_the_ttl() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c.try_acquire(&k, &exact(secs(3))).await.unwrap();
    let kept = keep(lease, KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(5)).await;
    assert_held_by_other(&c, &k).await;
    let dropped_at = Instant::now();
    drop(kept);
    // Without renewal the lock is gone at the latest one TTL later (in memory, as soon as the
    // aborted keeper task drops the lease).
    let next = c.acquire(&k, &exact(secs(3)).wait(secs(3))).await.unwrap();
    assert!(Instant::now() - dropped_at <= secs(3));
    assert_eq!(next.token(), tok(2));
}

#[tokio::test(start_paused = true)]
async fn kept_release_frees_at_once() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c.try_acquire(&k, &exact(secs(3))).await.unwrap();
    let kept = keep(lease, KeeperOptions::new().jitter(0.0)).unwrap();
    let mut sig = kept.lost();
    tokio::time::sleep(secs(7)).await;
    assert_held_by_other(&c, &k).await;
    kept.release().await.unwrap();
    // No await on time: free now.
    let next = c.try_acquire(&k, &exact(secs(3))).await.unwrap();
    assert_eq!(next.token(), tok(2));
    assert_eq!(
        within(secs(600), "lost signal", sig.wait()).await,
        LostReason::Released
    );
}

#[tokio::test(start_paused = true)]
async fn without_progress_the_keeper_stops_and_the_lease_ends_keeper_stopped() {
    // Repeated: the end of the lease must be recorded as KeeperStopped every time, not by chance.
    for round in 0..16 {
        let c = MemoryCoordinator::new();
        let k = key("k");
        let opts = LeaseOptions::new(secs(3));
        let lease = c.try_acquire(&k, &opts).await.unwrap();
        let valid_until = lease.valid_until();
        let kept = keep(
            lease,
            KeeperOptions::new().jitter(0.0).require_progress(true),
        )
        .unwrap();
        let t0 = Instant::now();

        tokio::time::sleep(secs(2)).await;
        assert_eq!(
            kept.stopped(),
            Some(KeeperStop::NoProgress),
            "round {round}"
        );
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
        // Not renewed: the server expiry is still the original one.
        assert_eq!(
            c.inspect(&k).await.unwrap().unwrap().expires_in,
            Some(secs(1))
        );
        assert_eq!(kept.lease().valid_until(), valid_until);

        tokio::time::sleep_until(t0 + secs(3)).await;
        assert_eq!(
            kept.lease().status(),
            LeaseStatus::Lost(LostReason::KeeperStopped),
            "round {round}"
        );
        // The server expired it at its TTL.
        assert_eq!(
            c.try_acquire(&k, &exact(secs(1))).await.unwrap().token(),
            tok(2)
        );
    }
}

#[tokio::test(start_paused = true)]
async fn with_progress_the_keeper_keeps_renewing_until_progress_stops() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let kept = keep(
        lease,
        KeeperOptions::new().jitter(0.0).require_progress(true),
    )
    .unwrap();
    let progress = kept.progress();
    let ticker = tokio::spawn(async move {
        loop {
            tokio::time::sleep(ms(400)).await;
            progress.tick();
        }
    });
    tokio::time::sleep(secs(10)).await;
    assert_eq!(kept.stopped(), None);
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    assert_held_by_other(&c, &k).await;

    ticker.abort();
    let stuck_at = Instant::now();
    let mut sig = kept.lost();
    // `LostSignal::wait` reports the run-out at the instant validity passes, as the keeper's
    // stop.
    let r = within(secs(600), "lost signal", sig.wait()).await;
    assert_eq!(r, LostReason::KeeperStopped);
    // Stopped within one renewal interval, then ran out: at most interval + TTL after stalling.
    assert!(Instant::now() - stuck_at <= secs(4));
    tokio::time::sleep(ms(1)).await;
    assert_eq!(kept.stopped(), Some(KeeperStop::NoProgress));
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::KeeperStopped)
    );
}

#[tokio::test(start_paused = true)]
async fn max_hold_stops_renewing_after_the_maximum() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let margin = lease.ttl() - (lease.valid_until() - Instant::now());
    // Renewals every third of the validity window (the TTL less the margin).
    let interval = (secs(3) - margin) / 3;
    let t0 = Instant::now();
    let kept = keep(lease, KeeperOptions::new().jitter(0.0).max_hold(secs(7))).unwrap();

    tokio::time::sleep(interval * 4 + ms(10)).await;
    assert_eq!(kept.stopped(), None);
    // The renewal due at 5 intervals would have let the lock live past 7 s, so it was skipped.
    tokio::time::sleep(interval).await;
    assert_eq!(kept.stopped(), Some(KeeperStop::MaxHold));
    // The last renewal was sent at 4 intervals (each woken on the timer's next millisecond):
    // valid until that + TTL - margin.
    let last_sent = kept.lease().valid_until() - (secs(3) - margin);
    let expected = t0 + interval * 4;
    assert!(
        last_sent >= expected && last_sent <= expected + ms(4),
        "{:?} after the expected send",
        last_sent - expected
    );
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    assert_held_by_other(&c, &k).await;

    tokio::time::sleep_until(last_sent + secs(3)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::KeeperStopped)
    );
    // Never held longer than max_hold.
    let next = c.try_acquire(&k, &exact(secs(1))).await.unwrap();
    assert_eq!(next.token(), tok(2));
    assert!(Instant::now() - t0 <= secs(7));
}

/// A hold limit shorter than the TTL cannot be kept (the grant alone holds the lock for its
/// TTL): refused naming the option. Before, it was accepted and the lock outlived it up to six
/// times.
#[tokio::test(start_paused = true)]
async fn a_max_hold_shorter_than_the_ttl_is_invalid_input() {
    let c = MemoryCoordinator::new();
    let lease = c.try_acquire(&key("k"), &exact(secs(30))).await.unwrap();
    match keep(lease, KeeperOptions::new().max_hold(secs(5))) {
        Err(Error::InvalidInput(e)) => assert!(e.to_string().contains("max_hold"), "{e}"),
        other => panic!("expected InvalidInput, got {:?}", other.map(|_| ())),
    }
}

/// A limit too large to add to the clock is no limit: nothing panics (the timer thread that
/// wakes every kept lease least of all) and the lease is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_hold_beyond_the_clock_is_no_limit() {
    let lease = ScriptedLease::new(ms(300), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(
        Box::new(lease),
        KeeperOptions::new().max_hold(Duration::MAX),
    )
    .unwrap();
    let deadline = Instant::now() + secs(30);
    while renews.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline, "not renewed");
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(kept.stopped(), None);
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
}

/// Failing renewals are retried, but no retry is sent that would let the lock outlive
/// `max_hold`: the keeper stops instead, and the lease runs out as `KeeperStopped`.
#[tokio::test(start_paused = true)]
async fn max_hold_also_bounds_the_retries() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Unavailable);
    let renews = lease.renews.clone();
    let t0 = Instant::now();
    let kept = keep(
        Box::new(lease),
        KeeperOptions::new().jitter(0.0).max_hold(ms(4500)),
    )
    .unwrap();
    let mut sig = kept.lost();
    // The first try at 1 s (ends by 4 s); retries after 1.5 s would end past 4.5 s.
    assert_eq!(
        within(secs(600), "lost signal", sig.wait()).await,
        LostReason::KeeperStopped
    );
    assert_eq!(Instant::now() - t0, secs(3));
    assert_eq!(kept.stopped(), Some(KeeperStop::MaxHold));
    let tries = renews.load(Ordering::SeqCst);
    assert!(tries >= 2, "retried before the limit: {tries}");
    tokio::time::sleep(secs(30)).await;
    assert_eq!(
        renews.load(Ordering::SeqCst),
        tries,
        "nothing sent after the stop"
    );
}

/// Renewals are timed from the validity a renewal buys, not from the TTL: with a drift margin
/// of 7 s on a 10 s TTL (valid for 3 s) the lease is renewed every second and never runs out.
#[tokio::test(start_paused = true)]
async fn a_large_drift_margin_is_renewed_in_time() {
    let lease = ScriptedLease::with_margin(secs(10), secs(7), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let t0 = Instant::now();
    while Instant::now() - t0 < secs(20) {
        tokio::time::sleep(ms(250)).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
        assert!(kept.lease().remaining() >= secs(2), "{:?}", kept.lease());
    }
    // Due every second; the one due at 20 s may not have run yet.
    let renewed = renews.load(Ordering::SeqCst);
    assert!((19..=20).contains(&renewed), "{renewed}");
}

/// An adapter's renewal that panics ends that lease's keeping (it runs out at its validity);
/// the other kept leases, woken by the same timer thread, go on being renewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_renewal_stops_only_its_own_lease() {
    let broken = ScriptedLease::new(ms(600), RenewScript::Panic);
    let broken_renews = broken.renews.clone();
    let broken = keep(Box::new(broken), KeeperOptions::new()).unwrap();
    let healthy = ScriptedLease::new(ms(600), RenewScript::Ok);
    let renews = healthy.renews.clone();
    let healthy = keep(Box::new(healthy), KeeperOptions::new()).unwrap();
    let mut sig = broken.lost();
    assert_eq!(
        tokio::time::timeout(secs(30), sig.wait()).await.unwrap(),
        LostReason::Expired
    );
    assert_eq!(broken_renews.load(Ordering::SeqCst), 1);
    let seen = renews.load(Ordering::SeqCst);
    let deadline = Instant::now() + secs(30);
    while renews.load(Ordering::SeqCst) < seen + 3 {
        assert!(
            Instant::now() < deadline,
            "the other lease is no longer renewed"
        );
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(healthy.lease().status(), LeaseStatus::Held);
}

#[tokio::test(start_paused = true)]
async fn stop_lets_the_lease_run_out() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(ms(1500)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 1);
    kept.stop();
    tokio::time::sleep(ms(2499)).await; // t = 3.999, valid until 4
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    assert_eq!(kept.stopped(), Some(KeeperStop::Requested));
    tokio::time::sleep(ms(2)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::KeeperStopped)
    );
    assert_eq!(renews.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn failing_renewals_fire_lost_when_validity_ends_and_not_before() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Unavailable);
    let renews = lease.renews.clone();
    let t0 = Instant::now();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let mut sig = kept.lost();
    let watcher = tokio::spawn(async move {
        let r = within(secs(600), "lost signal", sig.wait()).await;
        (r, Instant::now())
    });

    tokio::time::sleep(ms(2999)).await;
    // Not lost before validity ends; in doubt since the first try failed.
    assert_eq!(kept.lease().status(), LeaseStatus::InDoubt);
    assert!(!watcher.is_finished());
    let tries = renews.load(Ordering::SeqCst);
    assert!(tries >= 3, "the keeper retries failed renewals: {tries}");

    let (reason, at) = within(secs(600), "lost watcher", watcher).await.unwrap();
    assert_eq!(reason, LostReason::Expired);
    assert_eq!(at - t0, secs(3));
    tokio::time::sleep(ms(1)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::Expired)
    );
    let after = renews.load(Ordering::SeqCst);
    tokio::time::sleep(secs(30)).await;
    assert_eq!(renews.load(Ordering::SeqCst), after, "the keeper exited");
}

#[tokio::test(start_paused = true)]
async fn transient_renewal_failures_are_retried() {
    let lease = ScriptedLease::new(secs(3), RenewScript::FailFirst(3));
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(12)).await;
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    assert!(renews.load(Ordering::SeqCst) > 3);
    assert!(kept.lease().remaining() >= secs(2));
}

/// Failed renewals are tried again until validity ends, however far the backoff has grown: a
/// retry is never put off by more than half the validity left. Here the backend answers only in
/// the last 20 ms of validity. Before, a backoff grown to its cap (a fifth of the TTL, 6 s here)
/// put the next try past the end of validity and the lease ran out untried for up to 6 s.
#[tokio::test(start_paused = true)]
async fn failed_renewals_are_tried_again_until_validity_ends() {
    let lease = ScriptedLease::new(secs(30), RenewScript::OkOnlyWithin(ms(20)));
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(31)).await;
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    let tries = renews.load(Ordering::SeqCst);
    // And the tries thin out as validity runs down, rather than spin.
    assert!(tries < 30, "{tries} tries in 31 s");
}

/// A renewal that is not confirmed puts the lease in doubt: renewal has become uncertain, so a
/// section's guard refuses new sub-work, until a later try confirms. Before, the lease stayed
/// `Held` and the guard kept letting new sub-work start until validity less its margin.
#[tokio::test(start_paused = true)]
async fn an_unconfirmed_renewal_puts_the_lease_in_doubt_until_one_confirms() {
    // Every try fails: in doubt from the first (due at 1 s) until validity ends.
    let lease = ScriptedLease::new(secs(3), RenewScript::Unavailable);
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let checked = lease_core::bounded_with(
        kept.lease(),
        lease_core::SectionOptions::new(),
        |guard| async move {
            guard.check()?;
            tokio::time::sleep(ms(1500)).await;
            Ok(guard.check())
        },
    )
    .await
    .expect("work already running goes on");
    assert!(
        matches!(checked, Err(Error::Unavailable { .. })),
        "{checked:?}"
    );
    assert_eq!(kept.lease().status(), LeaseStatus::InDoubt);
    tokio::time::sleep(secs(2)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::Expired)
    );

    // The first try fails and the retry confirms: held again.
    let lease = ScriptedLease::new(secs(3), RenewScript::FailFirst(1));
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(ms(1500)).await;
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
}

/// A renewal whose validity the backend capped short of the window (a session bound, which the
/// session's heartbeat extends on ZooKeeper and Consul) does not make the keeper renew at once
/// again: the next renewal is a fraction of the window after the send, as for any renewal. A
/// first version that counted the next renewal from the capped validity renewed back to back.
#[tokio::test(start_paused = true)]
async fn a_capped_renewal_is_not_followed_at_once_by_another() {
    let lease = ScriptedLease::new(secs(9), RenewScript::CappedAt(secs(4)));
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(10)).await;
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    let n = renews.load(Ordering::SeqCst);
    assert!(n <= 4, "{n} renewals in 10 s with a 3 s interval");
}

/// A renewal whose validity the backend capped short of the next planned renewal (here 2 s
/// after the send, where the next renewal was planned 3 s after it) is followed by another
/// within that validity, at the same fraction of it. Before, the next renewal was due after
/// the validity had ended, and a lease every renewal of which was confirmed ran out.
#[tokio::test(start_paused = true)]
async fn a_renewal_capped_short_of_the_next_one_is_followed_within_its_validity() {
    let lease = ScriptedLease::new(secs(9), RenewScript::CappedAt(secs(2)));
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    for _ in 0..20 {
        tokio::time::sleep(ms(500)).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
    }
    // Renewed every 2/3 s after the first, at 3 s: not back to back.
    let n = renews.load(Ordering::SeqCst);
    assert!((8..=12).contains(&n), "{n} renewals in 10 s");
}

/// As above, with a session heartbeat that keeps moving the capped validity (as ZooKeeper's and
/// Consul's do, with a TTL above the session timeout): the keeper renews at the planned
/// interval, not early, since validity has moved past the planned renewal by then.
#[tokio::test(start_paused = true)]
async fn a_capped_validity_that_a_heartbeat_moves_is_renewed_as_planned() {
    let lease = ScriptedLease::new(secs(9), RenewScript::CappedAt(secs(2)));
    let renews = lease.renews.clone();
    let tracker = lease.tracker.clone();
    let heartbeat = tokio::spawn(async move {
        loop {
            tokio::time::sleep(ms(300)).await;
            tracker.renewed(Instant::now() + secs(2));
        }
    });
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    for _ in 0..20 {
        tokio::time::sleep(ms(500)).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
    }
    // At 3, 6 and 9 s: every 3 s, as with no cap.
    assert_eq!(renews.load(Ordering::SeqCst), 3);
    heartbeat.abort();
}

/// A lease of 9 s under a Consul-like session of 1 s: its renewer sends every third of the TTL,
/// and a round trip (30 ms) later moves the bound to the TTL less the drift margin (12 ms) from
/// its send. The lease is granted `phase` after the renewer started. The heartbeat stops at
/// `stop`, if given. Returns the lease's renewals by 10 s, and checks it held all along.
async fn under_a_session(phase: u64, stop: Option<Duration>) -> usize {
    let bound: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
    let slot: Arc<std::sync::Mutex<Option<LeaseTracker>>> = Arc::default();
    let start = Instant::now();
    *bound.lock().unwrap() = Some(start + ms(1000 - 12));
    let heartbeat = tokio::spawn({
        let (bound, slot) = (bound.clone(), slot.clone());
        async move {
            let mut next = start + ms(333);
            loop {
                tokio::time::sleep_until(next).await;
                let sent = Instant::now();
                tokio::time::sleep(ms(30)).await;
                let until = sent + ms(1000 - 12);
                let mut b = bound.lock().unwrap();
                *b = Some(b.map_or(until, |b| b.max(until)));
                // As the adapter's `session_confirmed`: never earlier than it was.
                if let Some(t) = slot.lock().unwrap().as_ref() {
                    t.renewed(until.max(t.valid_until()));
                }
                next = sent + ms(333);
            }
        }
    });
    tokio::time::sleep(ms(phase)).await;
    let mut lease = ScriptedLease::new(secs(9), RenewScript::CappedBySession);
    lease.session_bound = bound.clone();
    let granted_under = bound.lock().unwrap().unwrap();
    lease.tracker.renewed(granted_under);
    *slot.lock().unwrap() = Some(lease.tracker.clone());
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let granted = Instant::now();
    for _ in 0..20 {
        tokio::time::sleep(ms(500)).await;
        if stop.is_some_and(|stop| granted.elapsed() >= stop) {
            heartbeat.abort();
        }
        assert_eq!(kept.lease().status(), LeaseStatus::Held, "phase {phase} ms");
    }
    heartbeat.abort();
    renews.load(Ordering::SeqCst)
}

/// A lease capped at its session's bound, which the session's renewer moves: a look at a
/// fraction of the validity left can fall between a heartbeat's send and its confirmation,
/// find the bound unmoved, and renew for nothing. Before, this lease was renewed 5 times in
/// 10 s, not 3, and looked at every few hundred milliseconds: with 2,000 such leases on one
/// Consul client (`many_leases_kept`) the keepers took three times the CPU, and the session's
/// own renewal came late enough, during the releases after the hold, for hundreds of leases to
/// run out. Once the keeper has seen the bound move, it looks shortly before the bound ends.
#[tokio::test(start_paused = true)]
async fn a_session_bound_moved_by_its_renewer_is_not_renewed_early() {
    // Whatever the heartbeat's phase against the keeper's renewals.
    for phase in (0..333).step_by(7) {
        // At 3, 6 and 9 s: every 3 s, as with no cap.
        let n = under_a_session(phase, None).await;
        assert_eq!(
            n, 3,
            "phase {phase} ms: renewals in 10 s with a 3 s interval"
        );
    }
}

/// As above, with a heartbeat that stops: the keeper's next look finds the bound unmoved and
/// renews (which renews the session too, as a Consul lease's renewal does), in time, and goes
/// on renewing at a fraction of the bound.
#[tokio::test(start_paused = true)]
async fn a_session_bound_whose_heartbeat_stops_is_renewed_in_time() {
    for phase in (0..333).step_by(37) {
        for stop in [ms(3100), ms(4500), ms(5200)] {
            let n = under_a_session(phase, Some(stop)).await;
            assert!(n > 4, "phase {phase} ms, stop {stop:?}: {n} renewals");
        }
    }
}

/// A short TTL, uncapped, is renewed as planned: its planned renewal leaves less than the
/// least try's time before validity ends, which a first version of the capped-renewal rule
/// took for a cap and answered with a renewal 100 ms after the send, after validity ended.
#[tokio::test(start_paused = true)]
async fn a_short_ttl_is_renewed_as_planned() {
    let lease = ScriptedLease::with_margin(ms(100), ms(3), RenewScript::Ok);
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new()).unwrap();
    for _ in 0..40 {
        tokio::time::sleep(ms(25)).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
    }
    // Every 32 ms or a little sooner (the jitter) over 1 s.
    let n = renews.load(Ordering::SeqCst);
    assert!((30..=36).contains(&n), "{n} renewals in 1 s");
}

/// Renewals brought forward by a cap that does not move ask for progress once an interval, as
/// planned renewals do, not at every renewal: work that ticks every second keeps a lease whose
/// interval is 3 s, though its renewals come every 2/3 s.
#[tokio::test(start_paused = true)]
async fn renewals_brought_forward_ask_for_progress_once_an_interval() {
    let lease = ScriptedLease::new(secs(9), RenewScript::CappedAt(secs(2)));
    let kept = keep(
        Box::new(lease),
        KeeperOptions::new().jitter(0.0).require_progress(true),
    )
    .unwrap();
    let progress = kept.progress();
    for _ in 0..10 {
        progress.tick();
        tokio::time::sleep(secs(1)).await;
        assert_eq!(kept.lease().status(), LeaseStatus::Held);
    }
    assert_eq!(kept.stopped(), None);
}

/// A renewal whose reply is lost does not use up the rest of the validity: the try is given up
/// after half the validity left, and the next one confirms. Before, the keeper waited for the
/// lost reply until validity ended, and the lease was lost at 3 s.
#[tokio::test(start_paused = true)]
async fn a_renewal_whose_reply_is_lost_is_tried_again_in_time() {
    let lease = ScriptedLease::new(secs(3), RenewScript::HangFirst);
    let renews = lease.renews.clone();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(5)).await;
    assert_eq!(kept.lease().status(), LeaseStatus::Held);
    assert!(renews.load(Ordering::SeqCst) >= 2);
}

#[tokio::test(start_paused = true)]
async fn refused_renewal_marks_the_lease_lost_at_once() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Lost);
    let renews = lease.renews.clone();
    let t0 = Instant::now();
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let mut sig = kept.lost();
    assert_eq!(
        within(secs(600), "lost signal", sig.wait()).await,
        LostReason::Superseded
    );
    assert_eq!(Instant::now() - t0, secs(1));
    tokio::time::sleep(secs(10)).await;
    assert_eq!(renews.load(Ordering::SeqCst), 1);
}

/// A refusal records the reason the error carries, not `Superseded` whatever it was.
#[tokio::test(start_paused = true)]
async fn a_refused_renewal_records_the_errors_own_reason() {
    let lease = ScriptedLease::new(secs(3), RenewScript::Revoked);
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let mut sig = kept.lost();
    assert_eq!(
        within(secs(600), "lost signal", sig.wait()).await,
        LostReason::Revoked
    );
}

#[tokio::test(start_paused = true)]
async fn force_release_stops_the_keeper() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c.try_acquire(&k, &exact(secs(3))).await.unwrap();
    let kept = keep(lease, KeeperOptions::new().jitter(0.0)).unwrap();
    tokio::time::sleep(secs(4)).await;
    c.force_release(&k, &ForceRelease::new("alice", "drill").unwrap())
        .await
        .unwrap();
    let next = c.try_acquire(&k, &exact(secs(30))).await.unwrap();
    tokio::time::sleep(secs(10)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::Revoked)
    );
    // The keeper never renewed (or released) the new owner's lock.
    let info = c.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, next.token());
    assert_eq!(info.expires_in, Some(secs(20)));
    assert!(matches!(kept.release().await, Err(Error::Lost { .. })));
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, tok(2));
}

#[tokio::test(start_paused = true)]
async fn invalid_renew_fraction_is_rejected() {
    for f in [0.0, -0.5, 0.95, 1.0, f64::NAN, f64::INFINITY] {
        let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
        let renews = lease.renews.clone();
        match keep(
            Box::new(lease),
            KeeperOptions::new().jitter(0.0).renew_fraction(f),
        ) {
            Err(Error::InvalidInput(InvalidInput::OutOfRange { field, .. })) => {
                assert_eq!(field, "renew_fraction", "{f}")
            }
            other => panic!("{f}: {other:?}"),
        }
        tokio::time::sleep(secs(5)).await;
        assert_eq!(
            renews.load(Ordering::SeqCst),
            0,
            "nothing was spawned for {f}"
        );
    }
    for f in [0.01, 0.5, 0.9] {
        let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
        assert!(keep(
            Box::new(lease),
            KeeperOptions::new().jitter(0.0).renew_fraction(f)
        )
        .is_ok());
    }
}

/// On a multi-thread runtime kept leases have no task each: one timer wakes them all and each
/// renewal is a short task of its own. 500 kept leases, right after `keep`: a handful of tasks
/// alive (the timer, and whatever else the runtime runs), not 500; then every lease is renewed
/// on time and still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_leases_on_a_multi_thread_runtime_share_one_timer() {
    let ttl = secs(6);
    let began = Instant::now();
    let mut kept = Vec::new();
    let mut renews = Vec::new();
    for _ in 0..500 {
        let lease = ScriptedLease::new(ttl, RenewScript::Ok);
        renews.push(lease.renews.clone());
        kept.push(keep(Box::new(lease), KeeperOptions::new()).unwrap());
    }
    let alive = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    assert!(
        began.elapsed() < ttl / 3,
        "the first renewals started before the tasks were counted"
    );
    assert!(alive < 20, "{alive} tasks alive for 500 kept leases");
    let deadline = Instant::now() + secs(30);
    while renews.iter().any(|r| r.load(Ordering::SeqCst) < 1) {
        assert!(Instant::now() < deadline, "not every lease was renewed");
        tokio::time::sleep(ms(20)).await;
    }
    for k in &kept {
        assert_eq!(k.lease().status(), LeaseStatus::Held);
    }
}

/// Leases whose validity starts at the same instant (as on a session backend, where it is
/// counted from the session's keepalive) renew within the jitter before their due time, and not
/// all at once: each at most a tenth of the interval early, spread over that tenth.
#[tokio::test(start_paused = true)]
async fn jitter_spreads_renewals_that_would_fall_together() {
    let t0 = Instant::now();
    let mut kept = Vec::new();
    let mut renews = Vec::new();
    for _ in 0..50 {
        let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
        renews.push(lease.renews.clone());
        kept.push(keep(Box::new(lease), KeeperOptions::new()).unwrap());
    }
    // Due at 1 s; none renews before 0.9 s, all have by 1 s, and they did not all renew in the
    // same millisecond.
    tokio::time::sleep_until(t0 + ms(899)).await;
    assert!(renews.iter().all(|r| r.load(Ordering::SeqCst) == 0));
    let mut first_round = Vec::new();
    while Instant::now() < t0 + ms(1001) {
        tokio::time::sleep(ms(1)).await;
        let done = renews
            .iter()
            .filter(|r| r.load(Ordering::SeqCst) >= 1)
            .count();
        first_round.push(done);
    }
    assert!(renews.iter().all(|r| r.load(Ordering::SeqCst) == 1));
    let distinct_steps = first_round.windows(2).filter(|w| w[1] > w[0]).count();
    assert!(
        distinct_steps > 5,
        "renewals fell together: {first_round:?}"
    );
    for k in &kept {
        assert_eq!(k.lease().status(), LeaseStatus::Held);
    }
    for jitter in [-0.1, 0.51, f64::NAN] {
        let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
        match keep(Box::new(lease), KeeperOptions::new().jitter(jitter)) {
            Err(Error::InvalidInput(InvalidInput::OutOfRange { field, .. })) => {
                assert_eq!(field, "jitter")
            }
            other => panic!("jitter {jitter}: {other:?}"),
        }
    }
}

/// A lease whose release parks until `gate` opens and then finds the lock revoked (an operator
/// force-released it just before), and whose renewal, once the release began, reports the lock
/// gone as adapters do (`lose_unless_releasing`).
#[derive(Debug)]
struct RevokedWhileReleasing {
    tracker: lease_core::adapter::LeaseTracker,
    gate: std::sync::Arc<tokio::sync::Notify>,
}

#[async_trait::async_trait]
impl Lease for RevokedWhileReleasing {
    fn state(&self) -> &lease_core::LeaseState {
        &self.tracker
    }
    async fn renew(&self) -> lease_core::Result<Instant> {
        let sent = Instant::now();
        if self.tracker.is_releasing() {
            return Err(self.tracker.lose_unless_releasing(LostReason::Revoked));
        }
        self.tracker.renewed_from(sent)
    }
    async fn release(&self) -> lease_core::Result<()> {
        self.tracker
            .release_with(
                async {
                    self.gate.notified().await;
                    Err(self.tracker.lose(LostReason::Revoked))
                },
                || {},
            )
            .await
    }
}

/// A keeper renewal that runs while the holder's own release is under way does not record the
/// loss's reason: the release decides it (here it finds the lock revoked). Before, the keeper
/// recorded the renewal's stand-in reason, `Released`, first, and the revocation was lost.
#[tokio::test(start_paused = true)]
async fn a_renewal_during_the_release_leaves_the_reason_to_the_release() {
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let lease = RevokedWhileReleasing {
        tracker: lease_core::adapter::LeaseTracker::new(
            "scripted",
            key("scripted"),
            tok(7),
            secs(3),
            Duration::ZERO,
            Instant::now(),
        ),
        gate: gate.clone(),
    };
    let kept = keep(Box::new(lease), KeeperOptions::new().jitter(0.0)).unwrap();
    let mut release = Box::pin(kept.lease().release());
    assert!(futures::poll!(release.as_mut()).is_pending());
    // The keeper's renewal is due at 1 s and runs while the release waits.
    tokio::time::sleep(ms(1500)).await;
    gate.notify_one();
    let r = within(secs(10), "release", release).await;
    assert!(matches!(r, Err(Error::Lost { .. })), "{r:?}");
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::Revoked)
    );
}
