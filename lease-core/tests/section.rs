//! Bounded critical sections (`bounded`, `bounded_with`) over the in-memory backend.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    bounded, bounded_with, keep, Coordinator, Error, ForceRelease, KeeperOptions, Lease,
    LeaseOptions, LeaseStatus, LostReason, SectionGuard, SectionOptions,
};
use tokio::time::Instant;

fn lost_reason<T: std::fmt::Debug>(r: lease_core::Result<T>) -> LostReason {
    match r {
        Err(Error::Lost { reason, .. }) => reason,
        other => panic!("expected Lost, got {other:?}"),
    }
}

/// Work that sets `started`, sleeps `d`, then sets `finished` and returns 42.
fn work(
    d: std::time::Duration,
) -> (
    Arc<AtomicBool>,
    Arc<AtomicBool>,
    impl std::future::Future<Output = u32>,
) {
    let started = Arc::new(AtomicBool::new(false));
    let finished = Arc::new(AtomicBool::new(false));
    let (s, f) = (started.clone(), finished.clone());
    let fut = async move {
        s.store(true, Ordering::SeqCst);
        tokio::time::sleep(d).await;
        f.store(true, Ordering::SeqCst);
        42
    };
    (started, finished, fut)
}

#[tokio::test(start_paused = true)]
async fn completes_and_returns_the_value_while_held() {
    let c = MemoryCoordinator::new();
    let lease = c.try_acquire(&key("k"), &exact(secs(10))).await.unwrap();
    let t0 = Instant::now();
    let (_, finished, fut) = work(secs(2));
    assert_eq!(bounded(&*lease, fut).await.unwrap(), 42);
    assert!(finished.load(Ordering::SeqCst));
    assert_eq!(Instant::now() - t0, secs(2));
    // Errors from the work itself pass through unchanged.
    let r: lease_core::Result<()> = bounded_with(&*lease, SectionOptions::new(), |_| async {
        Err(Error::Held { key: "x".into() })
    })
    .await;
    assert!(matches!(r, Err(Error::Held { .. })));
}

#[tokio::test(start_paused = true)]
async fn force_release_mid_work_cancels_the_future() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let (c2, k2) = (c.clone(), k.clone());
    tokio::spawn(async move {
        tokio::time::sleep(secs(2)).await;
        c2.force_release(&k2, &ForceRelease::new("alice", "drill").unwrap())
            .await
            .unwrap();
    });
    let t0 = Instant::now();
    let (started, finished, fut) = work(secs(5));
    assert_eq!(
        lost_reason(bounded(&*lease, fut).await),
        LostReason::Revoked
    );
    assert_eq!(Instant::now() - t0, secs(2));
    assert!(started.load(Ordering::SeqCst));
    tokio::time::sleep(secs(60)).await;
    assert!(
        !finished.load(Ordering::SeqCst),
        "the cancelled future never resumed"
    );
}

#[tokio::test(start_paused = true)]
async fn expiry_without_renewal_ends_the_section_before_validity() {
    let c = MemoryCoordinator::new();
    let lease = c
        .try_acquire(&key("k"), &LeaseOptions::new(secs(10)))
        .await
        .unwrap();
    let valid_until = lease.valid_until();
    let (started, finished, fut) = work(secs(20));
    assert_eq!(
        lost_reason(bounded(&*lease, fut).await),
        LostReason::Expired
    );
    assert!(Instant::now() < valid_until);
    // The default section margin is a tenth of the TTL.
    assert_eq!(valid_until - Instant::now(), secs(1));
    assert!(started.load(Ordering::SeqCst));
    tokio::time::sleep(secs(60)).await;
    assert!(!finished.load(Ordering::SeqCst));
}

#[tokio::test(start_paused = true)]
async fn explicit_margin_moves_the_deadline() {
    let c = MemoryCoordinator::new();
    let lease = c.try_acquire(&key("k"), &exact(secs(10))).await.unwrap();
    let t0 = Instant::now();
    let (_, finished, fut) = work(secs(20));
    let r = bounded_with(&*lease, SectionOptions::new().margin(secs(4)), |_| async {
        Ok(fut.await)
    })
    .await;
    assert_eq!(lost_reason(r), LostReason::Expired);
    assert_eq!(Instant::now() - t0, secs(6));
    assert!(!finished.load(Ordering::SeqCst));
}

/// Validity that a renewal brings closer (a backend's cap: a session's bound) moves the
/// deadline closer too: the section ends the margin before the new end of validity. Before, it
/// slept on to the old deadline, and ended only when validity itself ran out, with no margin.
#[tokio::test(start_paused = true)]
async fn validity_brought_closer_brings_the_deadline_closer() {
    let lease = ScriptedLease::new(secs(10), RenewScript::Ok);
    let t0 = Instant::now();
    let (_, finished, fut) = work(secs(20));
    let capped = async {
        tokio::time::sleep(secs(1)).await;
        assert!(lease.tracker.renewed(Instant::now() + secs(3)));
    };
    let (r, ()) = tokio::join!(
        bounded_with(&lease, SectionOptions::new().margin(secs(1)), |_| async {
            Ok(fut.await)
        }),
        capped
    );
    assert_eq!(lost_reason(r), LostReason::Expired);
    assert_eq!(Instant::now() - t0, secs(3));
    assert!(!finished.load(Ordering::SeqCst));
    assert_eq!(lease.status(), LeaseStatus::Held);
}

/// A margin that leaves no validity (the TTL less the lease's drift margin) is refused as
/// input, naming the margin, rather than failing every call with `Lost(Expired)` on a fresh,
/// held lease.
#[tokio::test(start_paused = true)]
async fn a_margin_beyond_the_validity_window_is_invalid_input() {
    let c = MemoryCoordinator::new();
    let options = LeaseOptions::new(secs(10)).drift_margin(ms(9500));
    let lease = c.try_acquire(&key("k"), &options).await.unwrap();
    let r = bounded_with(&*lease, SectionOptions::new().margin(secs(1)), |_| async {
        Ok(())
    })
    .await;
    match r {
        Err(Error::InvalidInput(e)) => assert!(e.to_string().contains("margin"), "{e}"),
        other => panic!("expected InvalidInput, got {other:?}"),
    }
    assert_eq!(lease.status(), LeaseStatus::Held);
}

#[tokio::test(start_paused = true)]
async fn with_a_keeper_a_section_longer_than_the_ttl_completes() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let kept = keep(lease, KeeperOptions::new()).unwrap();
    let t0 = Instant::now();
    let (_, finished, fut) = work(secs(20));
    assert_eq!(bounded(kept.lease(), fut).await.unwrap(), 42);
    assert_eq!(Instant::now() - t0, secs(20));
    assert!(finished.load(Ordering::SeqCst));
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, tok(1));
}

#[tokio::test(start_paused = true)]
async fn a_keeper_that_stops_renewing_ends_the_section_before_validity() {
    let c = MemoryCoordinator::new();
    let lease = c
        .try_acquire(&key("k"), &LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let kept = keep(lease, KeeperOptions::new().require_progress(true)).unwrap();
    let (_, finished, fut) = work(secs(20));
    assert_eq!(
        lost_reason(bounded(kept.lease(), fut).await),
        LostReason::Expired
    );
    assert!(Instant::now() < kept.lease().valid_until());
    assert!(!finished.load(Ordering::SeqCst));
}

#[tokio::test(start_paused = true)]
async fn max_duration_cuts_the_section() {
    let c = MemoryCoordinator::new();
    let lease = c.try_acquire(&key("k"), &exact(secs(3))).await.unwrap();
    let kept = keep(lease, KeeperOptions::new()).unwrap();
    let t0 = Instant::now();
    let (_, finished, fut) = work(secs(20));
    let r = bounded_with(
        kept.lease(),
        SectionOptions::new().max_duration(secs(5)),
        |_| async { Ok(fut.await) },
    )
    .await;
    assert_eq!(lost_reason(r), LostReason::Expired);
    assert_eq!(Instant::now() - t0, secs(5));
    assert!(!finished.load(Ordering::SeqCst));
    // The lease itself is fine: the limit was the section's own.
    assert!(kept.lease().ensure_held().is_ok());
}

#[tokio::test(start_paused = true)]
async fn work_that_finishes_after_its_lease_was_lost_returns_lost() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let lease = c.try_acquire(&k, &exact(secs(60))).await.unwrap();
    let (c2, k2) = (c.clone(), k.clone());
    let r = bounded(&*lease, async move {
        // The work itself causes the loss and then "succeeds" in the same poll.
        c2.force_release(&k2, &ForceRelease::new("self", "test").unwrap())
            .await
            .unwrap();
        "done"
    })
    .await;
    assert_eq!(lost_reason(r), LostReason::Revoked);

    // Same when the work releases its own lease.
    let lease = c.try_acquire(&k, &exact(secs(60))).await.unwrap();
    let r = bounded_with(&*lease, SectionOptions::new(), |_| async {
        lease.release().await?;
        Ok(1)
    })
    .await;
    assert_eq!(lost_reason(r), LostReason::Released);
}

#[tokio::test(start_paused = true)]
async fn section_guard_fails_once_in_doubt_or_lost() {
    // A scripted lease: a holder cannot put its own lease in doubt (its state is read-only),
    // only the adapter's tracker can.
    let lease = ScriptedLease::new(secs(10), RenewScript::Ok);
    let sub_work = Arc::new(AtomicUsize::new(0));
    let mut kept_guard: Option<SectionGuard> = None;
    let sw = sub_work.clone();
    let r = bounded_with(&lease, SectionOptions::new(), |guard| {
        kept_guard = Some(guard.clone());
        let lease = &lease;
        async move {
            for i in 0..10 {
                guard.check()?;
                sw.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(ms(100)).await;
                if i == 2 {
                    lease.tracker.in_doubt();
                }
            }
            Ok(())
        }
    })
    .await;
    // Three pieces of sub-work ran; the fourth was refused because the lease is in doubt: a
    // retryable `Unavailable`, as `ensure_held` says, not `Lost` (it may still be held).
    // Before, it was `Lost(Expired)`.
    match r {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(e.is_retryable());
            assert!(e.to_string().contains("in doubt"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(sub_work.load(Ordering::SeqCst), 3);

    let guard = kept_guard.unwrap();
    assert!(matches!(guard.check(), Err(Error::Unavailable { .. })));
    // A section does not start on it either.
    let r = bounded(&lease, async {}).await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    // In doubt with no more than the margin (1 s) left: no retry could start sub-work in time.
    let left = lease.tracker.valid_until() - Instant::now();
    tokio::time::advance(left - ms(900)).await;
    assert_eq!(lease.status(), LeaseStatus::InDoubt);
    assert_eq!(lost_reason(guard.check()), LostReason::Expired);
    // A confirmed renewal makes it certain again.
    lease.renew().await.unwrap();
    guard.check().unwrap();
    // Near the end of validity (within the default margin of 1 s) no new sub-work starts.
    tokio::time::advance(secs(9) - ms(1)).await;
    guard.check().unwrap();
    tokio::time::advance(ms(1)).await;
    assert_eq!(lost_reason(guard.check()), LostReason::Expired);

    // Lost: the reason is the recorded one.
    lease.renew().await.unwrap();
    guard.check().unwrap();
    // (What a force-release does to the holder's tracker.)
    lease.tracker.mark_lost(LostReason::Revoked);
    assert_eq!(lost_reason(guard.check()), LostReason::Revoked);
}

#[tokio::test(start_paused = true)]
async fn refuses_to_start_on_a_lost_or_nearly_expired_lease() {
    let c = MemoryCoordinator::new();
    let k = key("k");
    let called = Arc::new(AtomicBool::new(false));

    let lease = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    lease.release().await.unwrap();
    let cl = called.clone();
    let r = bounded_with(&*lease, SectionOptions::new(), |_| async move {
        cl.store(true, Ordering::SeqCst);
        Ok(())
    })
    .await;
    assert_eq!(lost_reason(r), LostReason::Released);
    assert!(!called.load(Ordering::SeqCst));

    // Held, but with no more than the margin left.
    let lease = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    tokio::time::advance(secs(9)).await;
    let cl = called.clone();
    let r = bounded(&*lease, async move { cl.store(true, Ordering::SeqCst) }).await;
    assert_eq!(lost_reason(r), LostReason::Expired);
    assert!(!called.load(Ordering::SeqCst));
    // An expired one.
    tokio::time::advance(secs(2)).await;
    let cl = called.clone();
    let r = bounded(&*lease, async move { cl.store(true, Ordering::SeqCst) }).await;
    assert_eq!(lost_reason(r), LostReason::Expired);
    assert!(!called.load(Ordering::SeqCst));
}

/// Durations too large for the clock do not panic: a margin not below the TTL is refused before
/// the work starts (it could never start), and an unbounded `max_duration` is no limit.
#[tokio::test(start_paused = true)]
async fn durations_beyond_the_clock_are_refused_or_unbounded() {
    let c = MemoryCoordinator::new();
    let lease = c.try_acquire(&key("k"), &exact(secs(10))).await.unwrap();
    for margin in [secs(10), std::time::Duration::MAX] {
        let (started, _, fut) = work(secs(1));
        let r = bounded_with(&*lease, SectionOptions::new().margin(margin), |_| async {
            Ok(fut.await)
        })
        .await;
        match r {
            Err(Error::InvalidInput(lease_core::InvalidInput::OutOfRange { field, .. })) => {
                assert_eq!(field, "margin")
            }
            other => panic!("margin {margin:?}: {other:?}"),
        }
        assert!(!started.load(Ordering::SeqCst));
    }
    let (_, finished, fut) = work(secs(2));
    let r = bounded_with(
        &*lease,
        SectionOptions::new().max_duration(std::time::Duration::MAX),
        |guard| async move {
            guard.check()?;
            Ok(fut.await)
        },
    )
    .await;
    assert_eq!(r.unwrap(), 42);
    assert!(finished.load(Ordering::SeqCst));
}
