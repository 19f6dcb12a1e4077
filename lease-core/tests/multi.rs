//! Multi-lock (`acquire_many`) over the in-memory backend.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    acquire_many, Capabilities, Coordinator, Error, ForceRelease, HolderInfo, InvalidInput, Lease,
    LeaseOptions, LeaseState, LockKey, LostReason,
};
use tokio::time::Instant;

/// The memory backend behind a coordinator that records each `acquire` call (key and wait
/// bound) before delegating, and can be made slow: its leases' `release` first sleeps
/// `release_delay`, and an `acquire` of `late.0` is answered `late.1` after its wait ends (a
/// request sent at the end of the wait may be answered after it, decision 0036), granted if the
/// key is free then.
#[derive(Debug, Default)]
struct Recording {
    inner: MemoryCoordinator,
    calls: Mutex<Vec<(String, Duration)>>,
    release_delay: Duration,
    late: Option<(LockKey, Duration)>,
}

impl Recording {
    fn calls(&self) -> Vec<(String, Duration)> {
        self.calls.lock().unwrap().clone()
    }
}

#[derive(Debug)]
struct SlowRelease {
    inner: Box<dyn Lease>,
    delay: Duration,
}

#[async_trait]
impl Lease for SlowRelease {
    fn state(&self) -> &LeaseState {
        self.inner.state()
    }
    async fn renew(&self) -> lease_core::Result<Instant> {
        self.inner.renew().await
    }
    async fn release(&self) -> lease_core::Result<()> {
        tokio::time::sleep(self.delay).await;
        self.inner.release().await
    }
}

#[async_trait]
impl Coordinator for Recording {
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    async fn acquire(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
    ) -> lease_core::Result<Box<dyn Lease>> {
        self.calls
            .lock()
            .unwrap()
            .push((key.to_string(), options.wait_value()));
        let lease = match &self.late {
            Some((k, by)) if k == key => {
                tokio::time::sleep(options.wait_value() + *by).await;
                self.inner.try_acquire(key, options).await?
            }
            _ => self.inner.acquire(key, options).await?,
        };
        if self.release_delay.is_zero() {
            return Ok(lease);
        }
        Ok(Box::new(SlowRelease {
            inner: lease,
            delay: self.release_delay,
        }))
    }
    async fn try_acquire(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
    ) -> lease_core::Result<Box<dyn Lease>> {
        self.inner.try_acquire(key, options).await
    }
    async fn inspect(&self, key: &LockKey) -> lease_core::Result<Option<HolderInfo>> {
        self.inner.inspect(key).await
    }
    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> lease_core::Result<Option<HolderInfo>> {
        self.inner.force_release(key, request).await
    }
}

fn keys(names: &[&str]) -> Vec<LockKey> {
    names.iter().map(|n| key(n)).collect()
}

#[tokio::test(start_paused = true)]
async fn acquires_in_sorted_order_without_duplicates() {
    let rec = Recording::default();
    let m = acquire_many(
        &rec,
        &keys(&["c", "a", "b", "a", "a/b", "c"]),
        &exact(secs(10)).wait(secs(5)),
    )
    .await
    .unwrap();
    let order: Vec<String> = rec.calls().into_iter().map(|(k, _)| k).collect();
    assert_eq!(order, ["a", "a/b", "b", "c"]);
    assert_eq!(
        m.tokens(),
        vec![
            (key("a"), tok(1)),
            (key("a/b"), tok(1)),
            (key("b"), tok(1)),
            (key("c"), tok(1)),
        ]
    );
    assert_eq!(m.leases().len(), 4);
    for k in ["a", "a/b", "b", "c"] {
        assert!(rec.inspect(&key(k)).await.unwrap().is_some(), "{k}");
    }
    assert_eq!(m.valid_until(), Instant::now() + secs(10));
    assert!(format!("{m:?}").contains("\"a/b\""));
    m.release().await.unwrap();
    for k in ["a", "a/b", "b", "c"] {
        assert!(rec.inspect(&key(k)).await.unwrap().is_none(), "{k}");
    }
}

/// Two (four) workers naming the same keys in opposite orders, many times: no deadlock (every
/// acquisition succeeds well inside its bounded wait) and never overlapping holds.
#[tokio::test(start_paused = true)]
async fn opposite_orders_never_deadlock_or_overlap() {
    let c = Arc::new(MemoryCoordinator::new());
    let in_use: Arc<[AtomicBool; 3]> = Arc::new(Default::default());
    let names = ["a", "b", "c"];
    let orders: Vec<Vec<usize>> = vec![vec![0, 1, 2], vec![2, 1, 0], vec![1, 0], vec![2, 0]];
    let mut tasks = Vec::new();
    for (w, order) in orders.into_iter().enumerate() {
        let (c, in_use) = (c.clone(), in_use.clone());
        tasks.push(tokio::spawn(async move {
            let ks: Vec<LockKey> = order.iter().map(|&i| key(names[i])).collect();
            for round in 0..200u64 {
                let m = acquire_many(&*c, &ks, &exact(secs(10)).wait(secs(60)))
                    .await
                    .unwrap_or_else(|e| panic!("worker {w} round {round}: {e}"));
                for &i in &order {
                    assert!(
                        !in_use[i].swap(true, Ordering::SeqCst),
                        "worker {w} round {round}: key {} already in use",
                        names[i]
                    );
                }
                tokio::time::sleep(ms(1 + (round + w as u64) % 3)).await;
                for &i in &order {
                    in_use[i].store(false, Ordering::SeqCst);
                }
                m.release().await.unwrap();
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(secs(3600), all)
        .await
        .expect("workers finished");
}

/// The same on a multi-thread runtime with real time (no sleeps: bounded by a real timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opposite_orders_on_threads_never_deadlock_or_overlap() {
    let c = Arc::new(MemoryCoordinator::new());
    let in_use: Arc<[AtomicBool; 2]> = Arc::new(Default::default());
    let mut tasks = Vec::new();
    for (w, order) in [[0usize, 1], [1, 0], [0, 1], [1, 0]]
        .into_iter()
        .enumerate()
    {
        let (c, in_use) = (c.clone(), in_use.clone());
        tasks.push(tokio::spawn(async move {
            let ks: Vec<LockKey> = order.iter().map(|&i| key(["a", "b"][i])).collect();
            for round in 0..300 {
                let m = acquire_many(&*c, &ks, &exact(secs(30)).wait(secs(20)))
                    .await
                    .unwrap_or_else(|e| panic!("worker {w} round {round}: {e}"));
                for i in 0..2 {
                    assert!(
                        !in_use[i].swap(true, Ordering::SeqCst),
                        "overlap on key {i}"
                    );
                }
                tokio::task::yield_now().await;
                for i in 0..2 {
                    in_use[i].store(false, Ordering::SeqCst);
                }
                m.release().await.unwrap();
            }
        }));
    }
    tokio::time::timeout(Duration::from_secs(20), async {
        for t in tasks {
            t.await.unwrap();
        }
    })
    .await
    .expect("no deadlock");
    assert_eq!(c.last_token(&key("a")), Some(tok(1200)));
}

#[tokio::test(start_paused = true)]
async fn releases_what_it_took_when_the_next_key_times_out() {
    let c = MemoryCoordinator::new();
    let _b = c.try_acquire(&key("b"), &exact(secs(3600))).await.unwrap();
    let t0 = Instant::now();
    match acquire_many(&c, &keys(&["b", "a"]), &exact(secs(10)).wait(secs(5))).await {
        Err(Error::Timeout { key, waited }) => {
            assert_eq!(key, "b");
            assert_eq!(waited, secs(5));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - t0, secs(5));
    // `a` was taken (token 1) and given back.
    assert_eq!(c.last_token(&key("a")), Some(tok(1)));
    assert!(c.inspect(&key("a")).await.unwrap().is_none());
    assert_eq!(c.waiters(&key("b")), 0);
    assert_eq!(
        c.try_acquire(&key("a"), &exact(secs(1)))
            .await
            .unwrap()
            .token(),
        tok(2)
    );
}

#[tokio::test(start_paused = true)]
async fn the_wait_bound_is_total_not_per_key() {
    let rec = Arc::new(Recording::default());
    let a = rec
        .inner
        .try_acquire(&key("a"), &exact(secs(3600)))
        .await
        .unwrap();
    let b = rec
        .inner
        .try_acquire(&key("b"), &exact(secs(3600)))
        .await
        .unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(secs(4)).await;
        a.release().await.unwrap();
        tokio::time::sleep(secs(4)).await;
        b.release().await.unwrap();
    });
    let t0 = Instant::now();
    // `a` comes free at 4 s, `b` at 8 s; the total wait of 6 s ends at 6 s.
    match acquire_many(&*rec, &keys(&["a", "b"]), &exact(secs(10)).wait(secs(6))).await {
        Err(Error::Timeout { key, waited }) => {
            assert_eq!(key, "b");
            assert_eq!(waited, secs(2));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - t0, secs(6));
    assert_eq!(
        rec.calls(),
        vec![("a".to_owned(), secs(6)), ("b".to_owned(), secs(2))]
    );
    assert!(rec.inspect(&key("a")).await.unwrap().is_none());

    // Within the total it succeeds, as soon as the last key comes free.
    tokio::time::sleep(secs(3)).await; // t = 9: b is free now
    let c = MemoryCoordinator::new();
    let x = c.try_acquire(&key("x"), &exact(secs(3600))).await.unwrap();
    let y = c.try_acquire(&key("y"), &exact(secs(3600))).await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(secs(2)).await;
        x.release().await.unwrap();
        tokio::time::sleep(secs(1)).await;
        y.release().await.unwrap();
    });
    let t1 = Instant::now();
    let m = acquire_many(&c, &keys(&["y", "x"]), &exact(secs(10)).wait(secs(6)))
        .await
        .unwrap();
    assert_eq!(Instant::now() - t1, secs(3));
    assert_eq!(m.tokens(), vec![(key("x"), tok(2)), (key("y"), tok(2))]);
}

#[tokio::test(start_paused = true)]
async fn empty_key_list_and_bad_options_are_invalid_input() {
    let c = MemoryCoordinator::new();
    match acquire_many(&c, &[], &exact(secs(10))).await {
        Err(Error::InvalidInput(InvalidInput::Empty { what })) => assert_eq!(what, "key list"),
        other => panic!("{other:?}"),
    }
    let r = acquire_many(&c, &keys(&["a", "b"]), &LeaseOptions::new(Duration::ZERO)).await;
    assert!(matches!(r, Err(Error::InvalidInput(InvalidInput::ZeroTtl))));
    let r = acquire_many(
        &c,
        &keys(&["a", "b"]),
        &exact(secs(1)).wait(LeaseOptions::MAX_WAIT + secs(1)),
    )
    .await;
    assert!(matches!(
        r,
        Err(Error::InvalidInput(InvalidInput::WaitTooLarge { .. }))
    ));
    assert_eq!(c.last_token(&key("a")), None);
    assert_eq!(c.last_token(&key("b")), None);
}

#[tokio::test(start_paused = true)]
async fn lost_renew_release_and_drop_cover_every_key() {
    let c = MemoryCoordinator::new();
    let m = acquire_many(&c, &keys(&["a", "b", "c"]), &exact(secs(10)))
        .await
        .unwrap();
    tokio::time::advance(secs(4)).await;
    let until = m.renew().await.unwrap();
    assert_eq!(until, Instant::now() + secs(10));
    for k in ["a", "b", "c"] {
        assert_eq!(
            c.inspect(&key(k)).await.unwrap().unwrap().expires_in,
            Some(secs(10))
        );
    }

    let (c2, kb) = (c.clone(), key("b"));
    tokio::spawn(async move {
        tokio::time::sleep(secs(1)).await;
        c2.force_release(&kb, &ForceRelease::new("alice", "drill").unwrap())
            .await
            .unwrap();
    });
    assert_eq!(m.lost().await, (key("b"), LostReason::Revoked));

    // Renew reports the loss but still renews the others.
    tokio::time::advance(secs(2)).await;
    assert!(matches!(m.renew().await, Err(Error::Lost { .. })));
    assert_eq!(
        c.inspect(&key("c")).await.unwrap().unwrap().expires_in,
        Some(secs(10))
    );
    // Release reports the first error but releases the rest.
    assert!(matches!(m.release().await, Err(Error::Lost { .. })));
    for k in ["a", "b", "c"] {
        assert!(c.inspect(&key(k)).await.unwrap().is_none(), "{k}");
    }

    // Dropping a multi-lease releases every key.
    let m = acquire_many(&c, &keys(&["a", "c"]), &exact(secs(10)))
        .await
        .unwrap();
    drop(m);
    for k in ["a", "c"] {
        assert!(c.inspect(&key(k)).await.unwrap().is_none(), "{k}");
    }
}

/// The leases already taken are not renewed while the call waits for the next key: the wait
/// ends when the first of them runs out (`Timeout`), so an `Ok` never carries a lease that
/// expired meanwhile; what was taken is given back.
#[tokio::test(start_paused = true)]
async fn the_wait_ends_before_a_lease_already_taken_runs_out() {
    let c = MemoryCoordinator::new();
    let b = c.try_acquire(&key("b"), &exact(secs(3600))).await.unwrap();
    tokio::spawn(async move {
        tokio::time::sleep(secs(5)).await;
        b.release().await.unwrap();
    });
    let t0 = Instant::now();
    // `a` is valid for 3 s; `b` comes free at 5 s, inside the 10 s wait.
    match acquire_many(&c, &keys(&["a", "b"]), &exact(secs(3)).wait(secs(10))).await {
        Err(Error::Timeout { key, waited }) => {
            assert_eq!(key, "b");
            assert_eq!(waited, secs(3));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - t0, secs(3));
    assert!(c.inspect(&key("a")).await.unwrap().is_none());
    assert_eq!(c.waiters(&key("b")), 0);
}

/// A lease already taken that is revoked while the call waits for the next key ends the call at
/// once with its loss: the wait for the next key is abandoned (before, the call waited on, took
/// the next key when it came free, and only then gave both back), and nothing is left held.
#[tokio::test(start_paused = true)]
async fn a_lease_lost_while_waiting_for_the_next_key_fails_the_call() {
    let c = MemoryCoordinator::new();
    let b = c.try_acquire(&key("b"), &exact(secs(3600))).await.unwrap();
    let c2 = c.clone();
    tokio::spawn(async move {
        tokio::time::sleep(secs(1)).await;
        c2.force_release(&key("a"), &ForceRelease::new("alice", "drill").unwrap())
            .await
            .unwrap();
        tokio::time::sleep(secs(1)).await;
        b.release().await.unwrap();
    });
    let t0 = Instant::now();
    match acquire_many(&c, &keys(&["a", "b"]), &exact(secs(30)).wait(secs(10))).await {
        Err(Error::Lost { key, reason, .. }) => {
            assert_eq!(key, "a");
            assert_eq!(reason, LostReason::Revoked);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - t0, secs(1));
    // The wait for `b` ended with the call: no waiter is left, and `b` was never ours.
    assert_eq!(c.waiters(&key("b")), 0);
    tokio::time::sleep(secs(2)).await;
    assert_eq!(c.last_token(&key("b")), Some(tok(1)));
    assert!(c.inspect(&key("b")).await.unwrap().is_none());
}

/// The wait for the next key, abandoned because a lease already taken was revoked, is given up
/// before the leases taken are released: while a slow release runs, the key it waited for is
/// served to another caller as soon as it comes free. Before, the abandoned acquire was kept,
/// unpolled, until the releases ended, at the head of the key's queue.
#[tokio::test(start_paused = true)]
async fn an_abandoned_wait_holds_up_nobody_while_the_leases_taken_are_released() {
    let c = Arc::new(Recording {
        release_delay: secs(5),
        ..Recording::default()
    });
    let b = c
        .inner
        .try_acquire(&key("b"), &exact(secs(3600)))
        .await
        .unwrap();
    let c2 = c.clone();
    let multi = tokio::spawn(async move {
        acquire_many(&*c2, &keys(&["a", "b"]), &exact(secs(30)).wait(secs(20))).await
    });
    wait_for_waiters(&c.inner, &key("b"), 1).await;
    tokio::time::sleep(secs(1)).await;
    c.force_release(&key("a"), &ForceRelease::new("alice", "drill").unwrap())
        .await
        .unwrap();
    settle().await;
    assert_eq!(c.inner.waiters(&key("b")), 0, "the abandoned wait is gone");
    b.release().await.unwrap();
    let t = Instant::now();
    let other = c
        .inner
        .acquire(&key("b"), &exact(secs(10)).wait(secs(1)))
        .await
        .expect("b is served while the multi-lock still releases");
    assert_eq!(Instant::now(), t, "served at once");
    assert_eq!(other.token(), tok(2));
    match multi.await.unwrap() {
        Err(Error::Lost { key, reason, .. }) => {
            assert_eq!(key, "a");
            assert_eq!(reason, LostReason::Revoked);
        }
        other => panic!("{other:?}"),
    }
}

/// A lease already taken whose validity runs out while the next key's grant is answered late
/// (after its wait, decision 0036) ends the call in `Timeout` for that key, as the documented
/// bound says, not in `Lost(Expired)`: the caller may retry. Nothing is left held.
#[tokio::test(start_paused = true)]
async fn a_grant_answered_after_a_lease_taken_ran_out_is_a_timeout() {
    let c = Recording {
        late: Some((key("b"), secs(1))),
        ..Recording::default()
    };
    let t0 = Instant::now();
    match acquire_many(&c, &keys(&["a", "b"]), &exact(secs(3)).wait(secs(10))).await {
        Err(e @ Error::Timeout { .. }) => {
            assert!(e.is_retryable());
            let Error::Timeout { key, waited } = e else {
                unreachable!()
            };
            assert_eq!(key, "b");
            assert_eq!(waited, secs(4));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(Instant::now() - t0, secs(4));
    assert!(c.inspect(&key("a")).await.unwrap().is_none());
    assert!(
        c.inspect(&key("b")).await.unwrap().is_none(),
        "b given back"
    );
}

/// One key of a set lost is the set's status, and its lease reports no validity left, while
/// its local deadline is still ahead; the other keys stay held until the set is released.
#[tokio::test(start_paused = true)]
async fn one_key_lost_is_the_status_of_the_set() {
    let c = MemoryCoordinator::new();
    let m = acquire_many(&c, &keys(&["a", "b"]), &exact(secs(30)))
        .await
        .unwrap();
    assert_eq!(m.status(), lease_core::LeaseStatus::Held);
    m.ensure_held().unwrap();
    c.force_release(&key("b"), &ForceRelease::new("alice", "drill").unwrap())
        .await
        .unwrap();
    assert_eq!(
        m.status(),
        lease_core::LeaseStatus::Lost(LostReason::Revoked)
    );
    match m.ensure_held() {
        Err(Error::Lost { key, reason, .. }) => {
            assert_eq!((key.as_str(), reason), ("b", LostReason::Revoked));
        }
        other => panic!("{other:?}"),
    }
    let b = &m.leases()[1];
    assert!(b.valid_until() > Instant::now());
    assert_eq!(b.remaining(), Duration::ZERO);
    assert_eq!(m.leases()[0].status(), lease_core::LeaseStatus::Held);
    m.release().await.unwrap_err();
    assert!(c.inspect(&key("a")).await.unwrap().is_none());
}
