//! The in-memory coordinator against its documented semantics (paused tokio time throughout).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    Coordinator, Error, ForceRelease, InvalidInput, Lease, LeaseOptions, LeaseStatus, LostReason,
    OwnerId, Registry,
};
use tokio::time::Instant;

fn coord() -> MemoryCoordinator {
    MemoryCoordinator::with_owner(OwnerId::new("test-host/1").unwrap())
}

fn lost_reason(r: lease_core::Result<impl std::fmt::Debug>) -> LostReason {
    match r {
        Err(Error::Lost { reason, .. }) => reason,
        other => panic!("expected Lost, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn tokens_start_at_one_and_increase_across_release_expiry_and_revocation() {
    let c = coord();
    let k = key("orders/42");
    assert_eq!(c.last_token(&k), None);

    let l1 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l1.token(), tok(1));
    l1.release().await.unwrap();
    assert_eq!(l1.status(), LeaseStatus::Lost(LostReason::Released));

    let l2 = c.acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l2.token(), tok(2));

    // Expiry takeover: l2 is never released, it runs out.
    tokio::time::advance(secs(10)).await;
    let l3 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l3.token(), tok(3));
    // Dropping the superseded lease must not delete the new owner's lock.
    drop(l2);
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, tok(3));

    c.force_release(&k, &ForceRelease::new("op", "test").unwrap())
        .await
        .unwrap();
    let l4 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l4.token(), tok(4));
    assert!(l4.token() > l3.token());
    assert_eq!(c.last_token(&k), Some(tok(4)));
}

#[tokio::test(start_paused = true)]
async fn keys_are_independent_including_prefixes_and_unicode() {
    let c = coord();
    let names = ["a", "a/b", "ab", "a/b/c", "Ünïcødé", "日本/語", "日本"];
    let mut leases = Vec::new();
    for n in names {
        let l = c
            .try_acquire(&key(n), &exact(secs(10)))
            .await
            .unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(l.token(), tok(1), "{n}");
        assert_eq!(l.key().as_str(), n);
        leases.push(l);
    }
    for n in names {
        let h = c.inspect(&key(n)).await.unwrap().unwrap();
        assert_eq!(h.key.as_str(), n);
        assert_eq!(h.token, tok(1));
    }
    // Releasing `a` frees only `a`.
    leases.remove(0).release().await.unwrap();
    assert!(c.inspect(&key("a")).await.unwrap().is_none());
    for n in &names[1..] {
        assert!(c.inspect(&key(n)).await.unwrap().is_some(), "{n}");
        assert!(matches!(
            c.try_acquire(&key(n), &exact(secs(1))).await,
            Err(Error::Held { .. })
        ));
    }
    let a2 = c.try_acquire(&key("a"), &exact(secs(10))).await.unwrap();
    assert_eq!(a2.token(), tok(2));
    assert_eq!(c.last_token(&key("a/b")), Some(tok(1)));
    assert_eq!(c.last_token(&key("日本")), Some(tok(1)));
    assert_eq!(c.last_token(&key("never")), None);
}

#[tokio::test(start_paused = true)]
async fn try_acquire_is_held_while_held_and_while_a_waiter_is_queued() {
    let c = coord();
    let k = key("k");
    let l1 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    match c.try_acquire(&k, &exact(secs(10))).await {
        Err(Error::Held { key }) => assert_eq!(key, "k"),
        other => panic!("{other:?}"),
    }

    let c2 = c.clone();
    let k2 = k.clone();
    let waiter =
        tokio::spawn(async move { c2.acquire(&k2, &exact(secs(10)).wait(secs(60))).await });
    wait_for_waiters(&c, &k, 1).await;

    // Release: the key has no holder, but a waiter is queued, so try_acquire must not barge.
    l1.release().await.unwrap();
    assert!(c.inspect(&k).await.unwrap().is_none());
    assert!(matches!(
        c.try_acquire(&k, &exact(secs(10))).await,
        Err(Error::Held { .. })
    ));
    let start = Instant::now();
    let w = waiter.await.unwrap().unwrap();
    assert_eq!(
        Instant::now(),
        start,
        "the waiter is served at the release instant"
    );
    assert_eq!(w.token(), tok(2));
    assert_eq!(c.waiters(&k), 0);
    // The barging attempt did not consume a token.
    assert_eq!(c.last_token(&k), Some(tok(2)));
}

#[tokio::test(start_paused = true)]
async fn acquire_times_out_with_the_waited_duration() {
    let c = coord();
    let k = key("k");
    let _held = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();

    let start = Instant::now();
    match c.acquire(&k, &exact(secs(10)).wait(secs(5))).await {
        Err(Error::Timeout { key, waited }) => {
            assert_eq!(key, "k");
            assert_eq!(waited, secs(5));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - start, secs(5));
    assert_eq!(c.waiters(&k), 0);

    // A zero wait tries once.
    match c.acquire(&k, &exact(secs(10))).await {
        Err(Error::Timeout { waited, .. }) => assert_eq!(waited, Duration::ZERO),
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - start, secs(5));
    assert_eq!(c.waiters(&k), 0);
    assert_eq!(c.last_token(&k), Some(tok(1)));
}

#[tokio::test(start_paused = true)]
async fn three_waiters_are_served_in_arrival_order() {
    let c = coord();
    let k = key("fifo");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, name) in ["A", "B", "C"].into_iter().enumerate() {
        let (c2, k2, log2) = (c.clone(), k.clone(), log.clone());
        tasks.push(tokio::spawn(async move {
            let l = c2
                .acquire(&k2, &exact(secs(3600)).wait(secs(3600)))
                .await
                .unwrap();
            log2.lock()
                .unwrap()
                .push((name, l.token().get(), Instant::now() - t0));
            tokio::time::sleep(secs(1)).await;
            l.release().await.unwrap();
        }));
        wait_for_waiters(&c, &k, i + 1).await;
    }
    tokio::time::sleep(secs(2)).await;
    assert!(log.lock().unwrap().is_empty());
    holder.release().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        *log.lock().unwrap(),
        vec![("A", 2, secs(2)), ("B", 3, secs(3)), ("C", 4, secs(4))]
    );
}

#[tokio::test(start_paused = true)]
async fn waiter_is_woken_by_release_at_that_instant() {
    let c = coord();
    let k = key("k");
    // Long TTL and long wait: only a notification can serve the waiter at t=3s.
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let t0 = Instant::now();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(3001)).await;
        holder.release().await.unwrap();
    });
    let (c2, k2) = (c.clone(), k.clone());
    let waiter = tokio::spawn(async move {
        let l = c2
            .acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        (l, Instant::now() - t0)
    });
    wait_for_waiters(&c, &k, 1).await;
    tokio::time::sleep(secs(3)).await;
    assert_eq!(c.waiters(&k), 1, "still queued at t=3s");
    let (l, at) = waiter.await.unwrap();
    assert_eq!(at, Duration::from_millis(3001));
    assert_eq!(l.token(), tok(2));
    assert_eq!(c.waiters(&k), 0);
}

#[tokio::test(start_paused = true)]
async fn head_waiter_takes_over_exactly_at_expiry() {
    let c = coord();
    let k = key("k");
    let _holder = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    let t0 = Instant::now();
    let l = c
        .acquire(&k, &exact(secs(10)).wait(secs(3600)))
        .await
        .unwrap();
    assert_eq!(Instant::now() - t0, secs(10));
    assert_eq!(l.token(), tok(2));
}

/// A waiter that becomes head because the one ahead of it was *served* must be woken at the
/// expiry of the new holder, not at the end of its own wait bound.
#[tokio::test(start_paused = true)]
async fn second_waiter_takes_over_at_expiry_of_first_waiter() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let t0 = Instant::now();
    let spawn_waiter = |ttl: Duration| {
        let (c2, k2) = (c.clone(), k.clone());
        tokio::spawn(async move {
            let l = c2.acquire(&k2, &exact(ttl).wait(secs(1000))).await.unwrap();
            (l, Instant::now() - t0)
        })
    };
    let a = spawn_waiter(secs(10));
    wait_for_waiters(&c, &k, 1).await;
    let b = spawn_waiter(secs(10));
    wait_for_waiters(&c, &k, 2).await;

    tokio::time::sleep(secs(1)).await;
    holder.release().await.unwrap();
    // A gets it at t=1 and then simply lets it run out (kept alive, never renewed).
    let (la, at_a) = a.await.unwrap();
    assert_eq!(at_a, secs(1));
    let (lb, at_b) = b.await.unwrap();
    assert_eq!(at_b, secs(11), "B must take over when A's lease expires");
    assert_eq!((la.token(), lb.token()), (tok(2), tok(3)));
}

/// A waiter that becomes head because the one ahead of it was *cancelled* must be woken at the
/// holder's expiry, not at the end of its own wait bound.
#[tokio::test(start_paused = true)]
async fn waiter_behind_a_cancelled_head_takes_over_at_expiry() {
    let c = coord();
    let k = key("k");
    let _holder = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    let t0 = Instant::now();
    let (c2, k2) = (c.clone(), k.clone());
    let a = tokio::spawn(async move { c2.acquire(&k2, &exact(secs(5)).wait(secs(1000))).await });
    wait_for_waiters(&c, &k, 1).await;
    let (c3, k3) = (c.clone(), k.clone());
    let b = tokio::spawn(async move {
        let l = c3
            .acquire(&k3, &exact(secs(5)).wait(secs(1000)))
            .await
            .unwrap();
        (l, Instant::now() - t0)
    });
    wait_for_waiters(&c, &k, 2).await;
    tokio::time::sleep(secs(2)).await;
    a.abort();
    assert!(a.await.unwrap_err().is_cancelled());
    assert_eq!(c.waiters(&k), 1);
    let (lb, at) = b.await.unwrap();
    assert_eq!(at, secs(10));
    assert_eq!(lb.token(), tok(2));
}

#[tokio::test(start_paused = true)]
async fn expiry_takeover_happens_exactly_at_ttl() {
    let c = coord();
    let k = key("k");
    // Default drift margin: local validity ends before the server's expiry.
    let l1 = c
        .try_acquire(&k, &LeaseOptions::new(secs(10)))
        .await
        .unwrap();
    let margin = lease_core::adapter::clock::default_drift_margin(secs(10));
    assert_eq!(l1.valid_until() - Instant::now(), secs(10) - margin);

    tokio::time::advance(secs(10) - ms(1)).await;
    assert!(matches!(
        c.try_acquire(&k, &exact(secs(10))).await,
        Err(Error::Held { .. })
    ));
    assert_eq!(l1.status(), LeaseStatus::Lost(LostReason::Expired));
    assert_eq!(
        c.inspect(&k).await.unwrap().unwrap().expires_in,
        Some(ms(1))
    );
    tokio::time::advance(ms(1)).await;
    let l2 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l2.token(), tok(2));
}

#[tokio::test(start_paused = true)]
async fn renew_extends_server_side_expiry_and_fails_after_loss() {
    let c = coord();
    let k = key("k");
    let opts = LeaseOptions::new(secs(10));
    let margin = opts.drift_margin_for(secs(10));
    let l1 = c.try_acquire(&k, &opts).await.unwrap();
    tokio::time::advance(secs(8)).await;
    let until = l1.renew().await.unwrap();
    assert_eq!(until, Instant::now() + secs(10) - margin);
    assert_eq!(l1.valid_until(), until);

    // Past the original TTL (t=16 > 10): still held, another contender cannot take it.
    tokio::time::advance(secs(8)).await;
    assert!(matches!(
        c.try_acquire(&k, &exact(secs(10))).await,
        Err(Error::Held { .. })
    ));
    let info = c.inspect(&k).await.unwrap().unwrap();
    assert_eq!((info.token, info.expires_in), (tok(1), Some(secs(2))));
    assert_eq!(l1.status(), LeaseStatus::Held);

    // At the renewed expiry (t=18) it is lost and the key is free.
    tokio::time::advance(secs(2)).await;
    let l2 = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l2.token(), tok(2));
    assert_eq!(lost_reason(l1.renew().await), LostReason::Expired);
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, tok(2));

    // Renew after release is Lost(Released); it never revives.
    l2.release().await.unwrap();
    assert_eq!(lost_reason(l2.renew().await), LostReason::Released);
    assert!(c.inspect(&k).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn renew_within_drift_margin_window_is_refused_locally() {
    // Local validity has passed (ttl - margin) although the server has not expired the lock yet:
    // the client must not believe it still holds it.
    let c = coord();
    let k = key("k");
    let l = c
        .try_acquire(&k, &LeaseOptions::new(secs(10)).drift_margin(secs(1)))
        .await
        .unwrap();
    tokio::time::advance(secs(9)).await;
    assert_eq!(lost_reason(l.renew().await), LostReason::Expired);
    // The server still shows it until its own expiry; nobody else can take it before.
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, tok(1));
    tokio::time::advance(secs(1)).await;
    assert_eq!(
        c.try_acquire(&k, &exact(secs(1))).await.unwrap().token(),
        tok(2)
    );
}

#[tokio::test(start_paused = true)]
async fn stale_release_after_takeover_is_lost_and_deletes_nothing() {
    let c = coord();
    let k = key("k");
    let old = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    tokio::time::advance(secs(10)).await;
    let new = c
        .try_acquire(
            &k,
            &exact(secs(10))
                .owner(OwnerId::new("new-owner").unwrap())
                .operation("takeover"),
        )
        .await
        .unwrap();
    assert_eq!(lost_reason(old.release().await), LostReason::Expired);
    let info = c.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.token, new.token());
    assert_eq!(info.owner.as_str(), "new-owner");
    assert_eq!(info.operation.as_deref(), Some("takeover"));
    assert_eq!(new.status(), LeaseStatus::Held);

    // Same after a revocation: the revoked lease cannot delete the next owner's lock.
    c.force_release(&k, &ForceRelease::new("alice", "stuck").unwrap())
        .await
        .unwrap();
    let newer = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(lost_reason(new.release().await), LostReason::Revoked);
    drop(new);
    drop(old);
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, newer.token());
    assert_eq!(newer.token(), tok(3));
}

#[tokio::test(start_paused = true)]
async fn lost_fires_at_local_validity_end() {
    let c = coord();
    let k = key("k");
    let t0 = Instant::now();
    let l = c
        .try_acquire(&k, &LeaseOptions::new(secs(10)))
        .await
        .unwrap();
    let mut sig = l.lost();
    assert!(!sig.is_lost());
    assert_eq!(sig.wait().await, LostReason::Expired);
    assert_eq!(
        Instant::now() - t0,
        secs(10) - lease_core::adapter::clock::default_drift_margin(secs(10))
    );
    assert_eq!(l.status(), LeaseStatus::Lost(LostReason::Expired));

    // With no margin it fires exactly at the TTL, when the server expires it.
    let k2 = key("k2");
    let t1 = Instant::now();
    let l2 = c.try_acquire(&k2, &exact(secs(7))).await.unwrap();
    let mut sig2 = l2.lost();
    assert_eq!(sig2.wait().await, LostReason::Expired);
    assert_eq!(Instant::now() - t1, secs(7));
    assert!(c.inspect(&k2).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn lost_fires_on_force_release_with_revoked() {
    let c = coord();
    let k = key("k");
    let l = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let t0 = Instant::now();
    let c2 = c.clone();
    let k2 = k.clone();
    tokio::spawn(async move {
        tokio::time::sleep(secs(2)).await;
        c2.force_release(&k2, &ForceRelease::new("alice", "drill").unwrap())
            .await
            .unwrap();
    });
    let mut sig = l.lost();
    let mut sig_clone = sig.clone();
    assert_eq!(sig.wait().await, LostReason::Revoked);
    assert_eq!(Instant::now() - t0, secs(2));
    assert_eq!(sig_clone.wait().await, LostReason::Revoked);
    assert_eq!(l.status(), LeaseStatus::Lost(LostReason::Revoked));
    assert!(matches!(l.ensure_held(), Err(Error::Lost { .. })));
}

#[tokio::test(start_paused = true)]
async fn force_release_returns_and_records_the_removed_holder() {
    let c = coord();
    let k = key("jobs/7");
    let l = c
        .try_acquire(
            &k,
            &exact(secs(30))
                .owner(OwnerId::new("svc-a/123").unwrap())
                .operation("nightly-reconcile"),
        )
        .await
        .unwrap();
    tokio::time::advance(secs(4)).await;
    let req = ForceRelease::new("alice", "stuck job").unwrap();
    let removed = c.force_release(&k, &req).await.unwrap().unwrap();
    assert_eq!(removed.key, k);
    assert_eq!(removed.owner.as_str(), "svc-a/123");
    assert_eq!(removed.operation.as_deref(), Some("nightly-reconcile"));
    assert_eq!(removed.token, tok(1));
    assert_eq!(removed.expires_in, Some(secs(26)));
    assert!(c.inspect(&k).await.unwrap().is_none());
    assert_eq!(lost_reason(l.release().await), LostReason::Revoked);

    // A free key: nothing removed, still recorded.
    let none = c
        .force_release(&key("free"), &ForceRelease::new("bob", "cleanup").unwrap())
        .await
        .unwrap();
    assert!(none.is_none());

    let recs = c.forced_releases();
    assert_eq!(recs.len(), 2);
    assert_eq!(recs[0].key, k);
    assert_eq!(recs[0].actor, "alice");
    assert_eq!(recs[0].reason, "stuck job");
    assert_eq!(recs[0].removed.as_ref(), Some(&removed));
    assert_eq!(recs[1].key, key("free"));
    assert_eq!(recs[1].actor, "bob");
    assert_eq!(recs[1].reason, "cleanup");
    assert!(recs[1].removed.is_none());

    // An expired holder is not "removed" by a force release: it was already gone.
    let _l = c.try_acquire(&k, &exact(secs(1))).await.unwrap();
    tokio::time::advance(secs(1)).await;
    assert!(c.force_release(&k, &req).await.unwrap().is_none());
}

#[tokio::test(start_paused = true)]
async fn inspect_shows_safe_holder_info_and_debug_hides_the_nonce() {
    let c = coord();
    let k = key("k");
    assert!(c.inspect(&k).await.unwrap().is_none());
    let l = c
        .try_acquire(&k, &exact(secs(10)).operation("compact"))
        .await
        .unwrap();
    tokio::time::advance(secs(3)).await;
    let info = c.inspect(&k).await.unwrap().unwrap();
    assert_eq!(info.key, k);
    assert_eq!(
        info.owner.as_str(),
        "test-host/1",
        "the coordinator's default owner"
    );
    assert_eq!(info.operation.as_deref(), Some("compact"));
    assert_eq!(info.token, tok(1));
    assert_eq!(info.expires_in, Some(secs(7)));
    assert!(info.acquired_at.is_some());
    // inspect is read-only.
    assert_eq!(c.inspect(&k).await.unwrap().unwrap(), info);
    assert_eq!(c.last_token(&k), Some(tok(1)));

    let dbg = format!("{l:?}");
    assert_eq!(
        dbg,
        r#"MemoryLease { tracker: LeaseTracker { backend: "memory", key: "k", token: Token(1), status: Held }, .. }"#
    );
    let pretty = format!("{l:#?}");
    assert!(!pretty.contains("nonce"), "{pretty}");
    // No long number (a u128 nonce would print as up to 39 digits) in either form.
    for s in [&dbg, &pretty] {
        let longest = s
            .split(|ch: char| !ch.is_ascii_digit())
            .map(str::len)
            .max()
            .unwrap_or(0);
        assert!(longest <= 2, "{s}");
    }
    let info_dbg = format!("{info:?}");
    assert!(!info_dbg.contains("nonce"), "{info_dbg}");
}

#[tokio::test(start_paused = true)]
async fn dropping_a_waiting_acquire_removes_its_entry() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();

    // Dropped by a timeout while queued as the only (head) waiter.
    let r = tokio::time::timeout(secs(2), c.acquire(&k, &exact(secs(10)).wait(secs(3600)))).await;
    assert!(r.is_err());
    assert_eq!(c.waiters(&k), 0);
    holder.release().await.unwrap();
    // No phantom waiter blocks try_acquire.
    let l = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l.token(), tok(2));

    // Dropped by select! while queued in the middle of the queue.
    let (c2, k2) = (c.clone(), k.clone());
    let first = tokio::spawn(async move {
        c2.acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .map(|l| l.token())
    });
    wait_for_waiters(&c, &k, 1).await;
    let (c3, k3) = (c.clone(), k.clone());
    let (cancel_tx, cancel_rx) = tokio::sync::oneshot::channel::<()>();
    let middle = tokio::spawn(async move {
        let opts = exact(secs(10)).wait(secs(3600));
        tokio::select! {
            r = c3.acquire(&k3, &opts) => Some(r.map(|l| l.token())),
            _ = cancel_rx => None,
        }
    });
    wait_for_waiters(&c, &k, 2).await;
    let (c4, k4) = (c.clone(), k.clone());
    let last = tokio::spawn(async move {
        let l = c4
            .acquire(&k4, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        let t = l.token();
        l.release().await.unwrap();
        t
    });
    wait_for_waiters(&c, &k, 3).await;
    cancel_tx.send(()).unwrap();
    assert!(middle.await.unwrap().is_none());
    assert_eq!(c.waiters(&k), 2);
    l.release().await.unwrap();
    // The queue is first, then last; the cancelled one took no token.
    let t_first = first.await.unwrap().unwrap();
    assert_eq!(t_first, tok(3));
    let t_last = last.await.unwrap();
    assert_eq!(t_last, tok(4));
    assert_eq!(c.waiters(&k), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_woken_head_passes_the_turn_on() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let (c2, k2) = (c.clone(), k.clone());
    let a = tokio::spawn(async move {
        c2.acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .map(|l| l.token())
    });
    wait_for_waiters(&c, &k, 1).await;
    let t0 = Instant::now();
    let (c3, k3) = (c.clone(), k.clone());
    let b = tokio::spawn(async move {
        let l = c3
            .acquire(&k3, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        (l, Instant::now())
    });
    wait_for_waiters(&c, &k, 2).await;
    tokio::time::sleep(secs(1)).await;
    // Release notifies A; A is cancelled before it runs, having consumed the wake-up.
    holder.release().await.unwrap();
    a.abort();
    assert!(a.await.unwrap_err().is_cancelled());
    let (lb, at) = b.await.unwrap();
    assert_eq!(at - t0, secs(1), "B is served at the release instant");
    assert_eq!(lb.token(), tok(2));
    assert_eq!(c.waiters(&k), 0);
}

/// An `acquire` future kept but no longer polled (a `select!` that moved on without dropping
/// it) holds up nobody past its wait: once its wait is over, the waiter behind it is served at
/// the release and `try_acquire` succeeds. Its own late poll reports `Timeout`. Before, it stayed
/// at the head until dropped: every later caller waited or was refused `Held`.
#[tokio::test(start_paused = true)]
async fn an_acquire_kept_but_not_polled_holds_up_nobody_past_its_wait() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let opts = exact(secs(10)).wait(secs(1));
    let mut stalled = Box::pin(c.acquire(&k, &opts));
    // Polled once: queued at the head.
    assert!(futures::poll!(stalled.as_mut()).is_pending());
    assert_eq!(c.waiters(&k), 1);
    let (c2, k2) = (c.clone(), k.clone());
    let behind = tokio::spawn(async move {
        let l = c2
            .acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        (l.token(), Instant::now())
    });
    wait_for_waiters(&c, &k, 2).await;
    tokio::time::sleep(secs(5)).await;
    let released = Instant::now();
    holder.release().await.unwrap();
    let (token, at) = behind.await.unwrap();
    assert_eq!((token, at), (tok(2), released), "served at the release");
    // Free again, with the stalled future still alive: try_acquire is not refused.
    tokio::time::sleep(secs(20)).await;
    let l = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert_eq!(l.token(), tok(3));
    match stalled.await {
        Err(Error::Timeout { .. }) => {}
        other => panic!("the stalled acquire, polled at last: {other:?}"),
    }
    assert_eq!(c.waiters(&k), 0);
}

/// As above, with the key released while the stalled waiter's wait still runs: the wake-up goes
/// to it and is never taken, yet the waiter behind it is served when that wait ends, not at its
/// own (far later) deadline.
#[tokio::test(start_paused = true)]
async fn the_waiter_behind_a_stalled_head_is_served_when_the_heads_wait_ends() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let opts = exact(secs(10)).wait(secs(5));
    let mut stalled = Box::pin(c.acquire(&k, &opts));
    assert!(futures::poll!(stalled.as_mut()).is_pending());
    let t0 = Instant::now();
    let (c2, k2) = (c.clone(), k.clone());
    let behind = tokio::spawn(async move {
        let l = c2
            .acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        (l.token(), Instant::now())
    });
    wait_for_waiters(&c, &k, 2).await;
    tokio::time::sleep(secs(1)).await;
    holder.release().await.unwrap();
    let (token, at) = behind.await.unwrap();
    assert_eq!(token, tok(2));
    assert_eq!(
        at - t0,
        secs(5),
        "served when the stalled head's wait ended"
    );
    drop(stalled);
    assert_eq!(c.waiters(&k), 0);
}

/// A waiter two places back, behind a head that is served and a second that is kept but no
/// longer polled, is served when the second's wait ends: it sleeps until the earliest deadline
/// ahead of it, not the deadline of the head it saw when it queued (which is served long
/// before). Before, it slept until that first head's deadline (or its own), with the key free.
#[tokio::test(start_paused = true)]
async fn a_waiter_two_back_is_served_when_a_stalled_second_waiters_wait_ends() {
    let c = coord();
    let k = key("k");
    let holder = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let t0 = Instant::now();
    let (c0, k0) = (c.clone(), k.clone());
    let first = tokio::spawn(async move {
        let l = c0
            .acquire(&k0, &exact(secs(10)).wait(secs(100)))
            .await
            .unwrap();
        let token = l.token();
        l.release().await.unwrap();
        token
    });
    wait_for_waiters(&c, &k, 1).await;
    let stalled_opts = exact(secs(10)).wait(secs(10));
    let mut stalled = Box::pin(c.acquire(&k, &stalled_opts));
    assert!(futures::poll!(stalled.as_mut()).is_pending());
    let (c2, k2) = (c.clone(), k.clone());
    let third = tokio::spawn(async move {
        let l = c2
            .acquire(&k2, &exact(secs(10)).wait(secs(60)))
            .await
            .unwrap();
        (l.token(), Instant::now())
    });
    wait_for_waiters(&c, &k, 3).await;
    tokio::time::sleep(secs(2)).await;
    holder.release().await.unwrap();
    assert_eq!(first.await.unwrap(), tok(2));
    let (token, at) = third.await.unwrap();
    assert_eq!(token, tok(3));
    assert_eq!(
        at - t0,
        secs(10),
        "served when the stalled second waiter's wait ended"
    );
    drop(stalled);
    assert_eq!(c.waiters(&k), 0);
}

/// A head polled late, past its own deadline, after the holder's lease expired while it waited,
/// takes the key: the turn was its own before its wait ended. Before, the expiry it found woke
/// the next waiter and removed the late head first, so it timed out while the one behind it
/// was served.
#[tokio::test(start_paused = true)]
async fn a_head_polled_late_takes_a_key_whose_holder_expired_during_its_wait() {
    let c = coord();
    let k = key("k");
    let _holder = c.try_acquire(&k, &exact(secs(5))).await.unwrap();
    let head_opts = exact(secs(10)).wait(secs(10));
    let mut head = Box::pin(c.acquire(&k, &head_opts));
    assert!(futures::poll!(head.as_mut()).is_pending());
    let behind_opts = exact(secs(10)).wait(secs(60));
    let mut behind = Box::pin(c.acquire(&k, &behind_opts));
    assert!(futures::poll!(behind.as_mut()).is_pending());
    assert_eq!(c.waiters(&k), 2);
    // Neither is polled again until the head's wait is over (a starved runtime).
    tokio::time::sleep(secs(11)).await;
    let granted = match futures::poll!(head.as_mut()) {
        std::task::Poll::Ready(Ok(l)) => l,
        other => panic!("the late head: {:?}", other.map(|r| r.map(|l| l.token()))),
    };
    assert_eq!(granted.token(), tok(2));
    assert!(futures::poll!(behind.as_mut()).is_pending());
}

#[tokio::test(start_paused = true)]
async fn dropping_an_acquire_future_that_won_leaves_no_lock() {
    // A future dropped before it was polled, or after it completed, leaves nothing behind.
    let c = coord();
    let k = key("k");
    let opts = exact(secs(10));
    let fut = c.acquire(&k, &opts);
    drop(fut);
    assert!(c.inspect(&k).await.unwrap().is_none());
    assert_eq!(c.last_token(&k), None);
    let l = c.acquire(&k, &exact(secs(10))).await.unwrap();
    drop(l);
    assert!(c.inspect(&k).await.unwrap().is_none());
    assert_eq!(c.waiters(&k), 0);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_lease_releases_it_and_serves_the_waiter() {
    let c = coord();
    let k = key("k");
    let l = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    let mut sig = l.lost();
    drop(l);
    assert_eq!(sig.wait().await, LostReason::Released);
    assert!(c.inspect(&k).await.unwrap().is_none());
    let l2 = c.try_acquire(&k, &exact(secs(3600))).await.unwrap();
    assert_eq!(l2.token(), tok(2));

    let (c2, k2) = (c.clone(), k.clone());
    let t0 = Instant::now();
    let waiter = tokio::spawn(async move {
        let l = c2
            .acquire(&k2, &exact(secs(10)).wait(secs(3600)))
            .await
            .unwrap();
        (l.token(), Instant::now() - t0)
    });
    wait_for_waiters(&c, &k, 1).await;
    tokio::time::sleep(secs(5)).await;
    drop(l2);
    assert_eq!(waiter.await.unwrap(), (tok(3), secs(5)));
}

#[tokio::test(start_paused = true)]
async fn invalid_input_is_rejected_and_leaves_no_state() {
    let c = coord();
    let k = key("k");
    type Case = (LeaseOptions, fn(&InvalidInput) -> bool);
    let cases: Vec<Case> = vec![
        (LeaseOptions::new(Duration::ZERO), |e| {
            matches!(e, InvalidInput::ZeroTtl)
        }),
        (LeaseOptions::new(LeaseOptions::MAX_TTL + ms(1)), |e| {
            matches!(e, InvalidInput::TtlTooLarge { .. })
        }),
        (
            LeaseOptions::new(secs(1)).wait(LeaseOptions::MAX_WAIT + ms(1)),
            |e| matches!(e, InvalidInput::WaitTooLarge { .. }),
        ),
        (LeaseOptions::new(secs(1)).operation(""), |e| {
            matches!(e, InvalidInput::Empty { what: "operation" })
        }),
        (LeaseOptions::new(secs(1)).operation("a\nb"), |e| {
            matches!(e, InvalidInput::ControlCharacter { .. })
        }),
        (LeaseOptions::new(secs(1)).operation("x".repeat(300)), |e| {
            matches!(e, InvalidInput::TooLong { .. })
        }),
        (LeaseOptions::new(secs(1)).drift_margin(secs(1)), |e| {
            matches!(
                e,
                InvalidInput::OutOfRange {
                    field: "drift_margin",
                    ..
                }
            )
        }),
        (LeaseOptions::new(secs(1)).drift_margin(secs(2)), |e| {
            matches!(
                e,
                InvalidInput::OutOfRange {
                    field: "drift_margin",
                    ..
                }
            )
        }),
    ];
    for (opts, is_expected) in &cases {
        for mode in ["acquire", "try_acquire"] {
            let r = if mode == "acquire" {
                c.acquire(&k, opts).await
            } else {
                c.try_acquire(&k, opts).await
            };
            match r {
                Err(Error::InvalidInput(e)) => assert!(is_expected(&e), "{mode} {opts:?}: {e}"),
                other => panic!("{mode} {opts:?}: {other:?}"),
            }
            assert_eq!(c.last_token(&k), None);
            assert_eq!(c.waiters(&k), 0);
            assert!(c.inspect(&k).await.unwrap().is_none());
        }
    }

    // Invalid options on a held key: rejected before queueing, held lease untouched.
    let held = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    for (opts, _) in &cases {
        let opts = if opts.wait_value().is_zero() {
            opts.clone().wait(secs(1))
        } else {
            opts.clone()
        };
        let r = c.acquire(&k, &opts).await;
        assert!(matches!(r, Err(Error::InvalidInput(_))), "{r:?}");
        assert_eq!(c.waiters(&k), 0);
    }
    assert_eq!(c.last_token(&k), Some(tok(1)));
    assert_eq!(held.status(), LeaseStatus::Held);
    // Nothing waited.
    assert_eq!(held.remaining(), secs(10));
}

#[tokio::test(start_paused = true)]
async fn works_through_the_registry_as_arc_dyn() {
    let reg = Registry::new();
    let coord = reg.connect("memory://").await.unwrap();
    assert_eq!(coord.capabilities().backend, "memory");
    let k = key("k");
    let l = coord.try_acquire(&k, &exact(secs(5))).await.unwrap();
    assert_eq!(l.token(), tok(1));
    assert!(matches!(
        coord.try_acquire(&k, &exact(secs(5))).await,
        Err(Error::Held { .. })
    ));
    // Each memory:// connect is a new coordinator.
    let other = reg.connect("memory://").await.unwrap();
    assert_eq!(
        other
            .try_acquire(&k, &exact(secs(5)))
            .await
            .unwrap()
            .token(),
        tok(1)
    );
    l.release().await.unwrap();
    assert!(coord.inspect(&k).await.unwrap().is_none());
    assert!(matches!(
        reg.connect("nope://x").await,
        Err(Error::InvalidInput(InvalidInput::Url { .. }))
    ));
}

/// A lease whose local validity ended (a large drift margin) still frees the key on release
/// and on drop, as the other backends' compare-and-delete does. Before, the entry stayed until
/// grant + TTL, with nobody holding it.
#[tokio::test(start_paused = true)]
async fn a_lease_lost_locally_still_frees_the_key_on_release_and_drop() {
    let c = MemoryCoordinator::new();
    let k = key("lost-locally");
    let options = LeaseOptions::new(secs(10)).drift_margin(secs(7));
    let lease = c.try_acquire(&k, &options).await.unwrap();
    tokio::time::sleep(secs(4)).await;
    assert!(matches!(lease.release().await, Err(Error::Lost { .. })));
    let second = c
        .try_acquire(&k, &options)
        .await
        .expect("the key is free after the release");
    tokio::time::sleep(secs(4)).await;
    drop(second);
    c.try_acquire(&k, &options)
        .await
        .expect("the key is free after the drop");
}
