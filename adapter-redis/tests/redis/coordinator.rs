//! Coordinator behaviour against a real redis-server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator};
use conformance_tests::contend::one_holder_across;
use lease_core::{
    Coordinator, Error, Fence, ForceRelease, Lease, LeaseOptions, LeaseStatus, LostReason, OwnerId,
    Registry, Token,
};
use redis::AsyncCommands;
use tokio::time::Instant;

use crate::common::{self, coordinator, durable, key, raw, server};

const SEC: Duration = Duration::from_secs(1);

fn opts(ttl: Duration) -> LeaseOptions {
    LeaseOptions::new(ttl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_and_strictly_increasing_tokens() {
    let Some(srv) = server("mutual_exclusion_and_strictly_increasing_tokens", durable()) else {
        return;
    };
    // Two coordinators (two connections, as two processes would have) contend on one key.
    let a = Arc::new(coordinator(&srv, "poll_interval_ms=20").await);
    let b = Arc::new(coordinator(&srv, "poll_interval_ms=20").await);
    let k = key("mutex");
    let inside = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(Mutex::new(Vec::<Token>::new()));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (k, inside, tokens) = (k.clone(), inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..15 {
                let lease = c
                    .acquire(&k, &opts(10 * SEC).wait(30 * SEC))
                    .await
                    .unwrap_or_else(|e| panic!("acquire: {e}"));
                assert_eq!(
                    inside.fetch_add(1, Ordering::SeqCst),
                    0,
                    "two holders at once"
                );
                tokens.lock().unwrap().push(lease.token());
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                lease.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let tokens = tokens.lock().unwrap().clone();
    assert_eq!(tokens.len(), 120);
    for w in tokens.windows(2) {
        assert!(w[0] < w[1], "tokens not strictly increasing: {tokens:?}");
    }
}

#[tokio::test]
async fn try_acquire_held_timeout_and_inspect() {
    let Some(srv) = server("try_acquire_held_timeout_and_inspect", durable()) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let k = key("held");
    let owner = OwnerId::new("worker|7 %x").unwrap();
    let lease = c
        .try_acquire(
            &k,
            &opts(30 * SEC)
                .owner(owner.clone())
                .operation("nightly-reconcile"),
        )
        .await
        .unwrap();
    assert_eq!(lease.status(), LeaseStatus::Held);
    assert!(lease.remaining() > 25 * SEC);

    match c.try_acquire(&k, &opts(SEC)).await {
        Err(Error::Held { key }) => assert_eq!(key, k.to_string()),
        other => panic!("expected Held, got {other:?}"),
    }
    // A zero wait is a timeout for `acquire`; a short one too.
    assert!(matches!(
        c.acquire(&k, &opts(SEC)).await,
        Err(Error::Timeout { .. })
    ));
    let began = Instant::now();
    match c
        .acquire(&k, &opts(SEC).wait(Duration::from_millis(300)))
        .await
    {
        Err(Error::Timeout { waited, .. }) => assert!(waited >= Duration::from_millis(300)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(began.elapsed() < 5 * SEC);

    let info = c.inspect(&k).await.unwrap().expect("held");
    assert_eq!(info.owner, owner);
    assert_eq!(info.operation.as_deref(), Some("nightly-reconcile"));
    assert_eq!(info.token, lease.token());
    let left = info.expires_in.expect("a TTL");
    assert!(left > 25 * SEC && left <= 30 * SEC, "{left:?}");
    assert!(info.acquired_at.is_some());

    // The nonce in the stored value never shows in Debug output or inspect.
    let mut conn = raw(&srv).await;
    let stored: String = conn
        .get(format!("fenced:{{{}}}:lock", k.as_str()))
        .await
        .unwrap();
    let nonce = stored.split('|').nth(1).unwrap().to_owned();
    assert_eq!(nonce.len(), 32);
    for shown in [format!("{lease:?}"), format!("{info:?}"), format!("{c:?}")] {
        assert!(!shown.contains(&nonce), "{shown}");
    }

    lease.release().await.unwrap();
    assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Released));
    assert!(c.inspect(&k).await.unwrap().is_none());
    // Released twice: Lost, and nothing else is touched.
    assert!(matches!(lease.release().await, Err(Error::Lost { .. })));
}

#[tokio::test]
async fn keys_with_shared_prefixes_and_braces_are_independent() {
    let Some(srv) = server(
        "keys_with_shared_prefixes_and_braces_are_independent",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "key_prefix=app:locks&clock_tokens=false").await;
    let base = key("p");
    let names = [
        base.to_string(),
        format!("{base}/b"),
        format!("{base}{{x}}"),
        format!("{base}%7Bx%7D"),
    ];
    let mut leases = Vec::new();
    for n in &names {
        let k = lease_core::LockKey::new(n.clone()).unwrap();
        let l = c.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
        // Each key has its own counter.
        assert_eq!(l.token(), Token::new(1).unwrap(), "{n}");
        leases.push(l);
    }
    let mut conn = raw(&srv).await;
    let lock_keys: Vec<String> = conn.keys("app:locks:*:lock").await.unwrap();
    assert_eq!(lock_keys.len(), 4, "{lock_keys:?}");
    for l in leases {
        l.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_is_woken_by_the_release_notification() {
    let Some(srv) = server("waiter_is_woken_by_the_release_notification", durable()) else {
        return;
    };
    // A poll interval far above the hand-off bound: only the pub/sub wake-up can explain a fast
    // hand-off (the holder's TTL is long, so expiry cannot either).
    let holder_side = coordinator(&srv, "").await;
    let waiter_side = coordinator(&srv, "poll_interval_ms=20000").await;
    let k = key("wake");
    let lease = holder_side.try_acquire(&k, &opts(60 * SEC)).await.unwrap();
    let k2 = k.clone();
    let waiter = tokio::spawn(async move {
        let l = waiter_side
            .acquire(&k2, &opts(10 * SEC).wait(50 * SEC))
            .await;
        (l, Instant::now())
    });
    // Let the waiter fail once and subscribe.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    let released_at = Instant::now();
    lease.release().await.unwrap();
    let (l, got_at) = tokio::time::timeout(10 * SEC, waiter)
        .await
        .unwrap()
        .unwrap();
    let l = l.unwrap();
    let hand_off = got_at - released_at;
    eprintln!("hand-off after release: {hand_off:?}");
    assert!(
        hand_off < 5 * SEC,
        "woken by polling, not by the release: {hand_off:?}"
    );
    assert!(l.token() > lease.token());
    l.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_takes_over_when_a_crashed_holder_expires() {
    let Some(srv) = server("waiter_takes_over_when_a_crashed_holder_expires", durable()) else {
        return;
    };
    let c = coordinator(&srv, "poll_interval_ms=20000").await;
    let k = key("expiry");
    let crashed = c
        .try_acquire(&k, &opts(Duration::from_millis(400)))
        .await
        .unwrap();
    let first = crashed.token();
    // A holder that vanishes without releasing (no Drop runs).
    std::mem::forget(crashed);
    let began = Instant::now();
    let l = c.acquire(&k, &opts(10 * SEC).wait(30 * SEC)).await.unwrap();
    let waited = began.elapsed();
    assert!(waited < 5 * SEC, "retry at the holder's expiry: {waited:?}");
    assert!(l.token() > first);
    l.release().await.unwrap();
}

#[tokio::test]
async fn stale_renew_and_release_never_touch_the_new_owner() {
    let Some(srv) = server(
        "stale_renew_and_release_never_touch_the_new_owner",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let mut conn = raw(&srv).await;

    // 1. Expired: the old lease's release finds another owner and deletes nothing.
    let k = key("stale");
    let old = c
        .try_acquire(&k, &opts(Duration::from_millis(150)))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let new = c.try_acquire(&k, &opts(30 * SEC)).await.unwrap();
    assert!(new.token() > old.token());
    assert!(matches!(
        old.renew().await,
        Err(Error::Lost {
            reason: LostReason::Expired,
            ..
        })
    ));
    assert!(matches!(old.release().await, Err(Error::Lost { .. })));
    drop(old);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, new.token());

    // 2. Superseded while still valid locally: an operator deleted the key and someone else took
    //    it. The server-side compare refuses both renew and release.
    let k = key("superseded");
    let old = c.try_acquire(&k, &opts(30 * SEC)).await.unwrap();
    let _: i64 = conn
        .del(format!("fenced:{{{}}}:lock", k.as_str()))
        .await
        .unwrap();
    let new = c.try_acquire(&k, &opts(30 * SEC)).await.unwrap();
    // The holder monitor may see the DEL (Revoked) before the new grant, or the new grant's
    // value (Superseded); either way the old lease is lost.
    let mut lost = old.lost();
    let expected = [LostReason::Revoked, LostReason::Superseded];
    match old.renew().await {
        Err(Error::Lost { reason, .. }) => assert!(expected.contains(&reason), "{reason:?}"),
        other => panic!("expected Lost, got {other:?}"),
    }
    let reason = tokio::time::timeout(SEC, lost.wait()).await.unwrap();
    assert!(expected.contains(&reason), "{reason:?}");
    assert!(matches!(old.release().await, Err(Error::Lost { .. })));
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, new.token());

    // 3. Renewal extends the lock and local validity.
    let before = new.valid_until();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let after = new.renew().await.unwrap();
    assert!(after > before);
    new.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_revokes_records_and_wakes_waiters() {
    let Some(srv) = server("force_release_revokes_records_and_wakes_waiters", durable()) else {
        return;
    };
    let operator = coordinator(&srv, "").await;
    let worker = coordinator(&srv, "").await;
    let waiter_side = coordinator(&srv, "poll_interval_ms=20000").await;
    let k = key("forced");

    // A free key: nothing removed, but the attempt is audited.
    let req = ForceRelease::new("alice", "stuck job INC-42").unwrap();
    assert!(operator.force_release(&k, &req).await.unwrap().is_none());

    let held = worker
        .try_acquire(&k, &opts(60 * SEC).operation("batch"))
        .await
        .unwrap();
    let k2 = k.clone();
    let waiter = tokio::spawn(async move {
        waiter_side
            .acquire(&k2, &opts(10 * SEC).wait(50 * SEC))
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let removed = operator
        .force_release(&k, &req)
        .await
        .unwrap()
        .expect("removed the holder");
    assert_eq!(removed.token, held.token());
    assert_eq!(removed.operation.as_deref(), Some("batch"));
    assert!(removed.expires_in.unwrap() > 50 * SEC);

    let next = tokio::time::timeout(10 * SEC, waiter)
        .await
        .expect("woken by the forced release")
        .unwrap()
        .unwrap();
    assert!(next.token() > held.token());

    // The removed holder (another coordinator, as another process) learns it on its next renew.
    match held.renew().await {
        Err(Error::Lost { reason, .. }) => assert_eq!(reason, LostReason::Revoked),
        other => panic!("expected Lost(Revoked), got {other:?}"),
    }
    assert!(matches!(held.release().await, Err(Error::Lost { .. })));
    assert_eq!(
        worker.inspect(&k).await.unwrap().unwrap().token,
        next.token()
    );

    // A holder in the operator's own process is marked at once.
    let k3 = key("forced-local");
    let local = operator.try_acquire(&k3, &opts(60 * SEC)).await.unwrap();
    let mut signal = local.lost();
    operator.force_release(&k3, &req).await.unwrap().unwrap();
    assert_eq!(
        tokio::time::timeout(SEC, signal.wait()).await.unwrap(),
        LostReason::Revoked
    );

    let trail = operator.audit_trail(&k, 10).await.unwrap();
    assert_eq!(trail.len(), 2);
    assert_eq!(trail[0].actor, "alice");
    assert_eq!(trail[0].reason, "stuck job INC-42");
    assert_eq!(trail[0].removed_token, Some(held.token()));
    assert!(trail[0].removed_owner.is_some());
    assert!(trail[0].at.is_some());
    assert_eq!(trail[1].removed_token, None);
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_leases_and_acquire_futures_leave_nothing_behind() {
    let Some(srv) = server(
        "dropped_leases_and_acquire_futures_leave_nothing_behind",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "poll_interval_ms=20000").await;
    let mut conn = raw(&srv).await;

    // Dropping a lease releases it in the background, long before its TTL.
    let k = key("drop");
    let l = c.try_acquire(&k, &opts(60 * SEC)).await.unwrap();
    drop(l);
    let freed = common::eventually(5 * SEC, || async {
        c.try_acquire(&k, &opts(60 * SEC)).await.ok()
    })
    .await
    .expect("dropped lease released");

    // Dropping a waiting acquire leaves no subscription and no lock.
    let channel = format!("fenced:{{{}}}:released", k.as_str());
    let long_wait = opts(SEC).wait(30 * SEC);
    let waiting = c.acquire(&k, &long_wait);
    assert!(tokio::time::timeout(Duration::from_millis(300), waiting)
        .await
        .is_err());
    let unsubscribed = common::eventually(5 * SEC, || {
        let mut conn = conn.clone();
        let channel = channel.clone();
        async move {
            let v: Vec<(String, i64)> = redis::cmd("PUBSUB")
                .arg("NUMSUB")
                .arg(&channel)
                .query_async(&mut conn)
                .await
                .unwrap();
            (v[0].1 == 0).then_some(())
        }
    })
    .await;
    assert!(
        unsubscribed.is_some(),
        "the dropped waiter's subscription remains"
    );
    freed.release().await.unwrap();
    assert!(c.try_acquire(&k, &opts(SEC)).await.is_ok());
    let _: () = conn.flushdb().await.unwrap();
}

#[tokio::test]
async fn bad_inputs_are_rejected_before_anything_is_sent() {
    let Some(srv) = server("bad_inputs_are_rejected_before_anything_is_sent", durable()) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let mut conn = raw(&srv).await;
    let before: i64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    let k = key("bad");
    let bad = [
        opts(Duration::ZERO),
        opts(Duration::from_millis(5)),
        opts(LeaseOptions::MAX_TTL + SEC),
        opts(SEC).drift_margin(SEC),
        opts(SEC).operation("evil\r\nop"),
        opts(SEC).operation(""),
        opts(SEC).wait(LeaseOptions::MAX_WAIT + SEC),
    ];
    for o in &bad {
        for r in [c.try_acquire(&k, o).await, c.acquire(&k, o).await] {
            match r {
                Err(Error::InvalidInput(_)) => {}
                other => panic!("{o:?}: expected InvalidInput, got {other:?}"),
            }
        }
    }
    let after: i64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(before, after, "a rejected call wrote to Redis");
    assert_eq!(c.capabilities().min_ttl, adapter_redis::MIN_TTL);
    assert!(c
        .try_acquire(&k, &opts(adapter_redis::MIN_TTL))
        .await
        .is_ok());
}

#[tokio::test]
async fn registry_serves_redis_urls() {
    let Some(srv) = server("registry_serves_redis_urls", durable()) else {
        return;
    };
    let mut registry = Registry::new();
    adapter_redis::register(&mut registry);
    let c = registry.connect(&srv.url()).await.unwrap();
    assert_eq!(c.capabilities().backend, "redis");
    assert!(c.capabilities().durable_tokens);
    assert!(c.capabilities().shared_across_processes);
    let f = registry.connect_fence(&srv.url()).await.unwrap();
    assert_eq!(f.backend(), "redis");
    let k = key("registry");
    let l = c.try_acquire(&k, &opts(SEC)).await.unwrap();
    f.claim(&(&k).into(), l.token()).await.unwrap();
    l.release().await.unwrap();
    let e = registry
        .connect(&format!("{}/?bogus=1", srv.url()))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
}

/// Rough numbers for the report: sequential try_acquire + release pairs on one connection, and
/// the hand-off from a release to a waiting acquire. Asserts only that they finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latency_smoke() {
    let Some(srv) = server("latency_smoke", durable()) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let k = key("latency");
    let mut samples = Vec::new();
    for i in 0..1100 {
        let t = Instant::now();
        let l = c.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
        l.release().await.unwrap();
        if i >= 100 {
            samples.push(t.elapsed());
        }
    }
    samples.sort();
    let p = |q: f64| samples[((samples.len() as f64 - 1.0) * q) as usize];
    eprintln!(
        "acquire+release (AOF always, {} build): p50 {:?} p99 {:?}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        p(0.5),
        p(0.99)
    );

    let waiter_side = Arc::new(coordinator(&srv, "poll_interval_ms=20000").await);
    let mut hand_offs = Vec::new();
    for _ in 0..20 {
        let l = c.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
        let (w, kk) = (waiter_side.clone(), k.clone());
        let waiter = tokio::spawn(async move {
            let l = w
                .acquire(&kk, &opts(10 * SEC).wait(10 * SEC))
                .await
                .unwrap();
            let at = Instant::now();
            l.release().await.unwrap();
            at
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        let released = Instant::now();
        l.release().await.unwrap();
        hand_offs.push(waiter.await.unwrap() - released);
    }
    hand_offs.sort();
    eprintln!(
        "hand-off release -> waiter holds: p50 {:?} max {:?}",
        hand_offs[hand_offs.len() / 2],
        hand_offs[hand_offs.len() - 1]
    );
}

/// `calls` of `EVALSHA` in the server's `INFO commandstats`.
async fn evalsha_calls(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_renewals_share_scripts_and_each_gets_its_own_answer() {
    let Some(srv) = server(
        "concurrent_renewals_share_scripts_and_each_gets_its_own_answer",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let mut conn = raw(&srv).await;
    const N: usize = 200;
    let mut leases = Vec::new();
    let mut keys = Vec::new();
    for _ in 0..N {
        let k = key("batched");
        leases.push(c.try_acquire(&k, &opts(30 * SEC)).await.unwrap());
        keys.push(k);
    }
    // Three leases are no longer ours on the server: deleted, deleted and taken by another
    // owner, force-released.
    let other = coordinator(&srv, "").await;
    let _: i64 = conn
        .del(format!("fenced:{{{}}}:lock", keys[10].as_str()))
        .await
        .unwrap();
    let _: i64 = conn
        .del(format!("fenced:{{{}}}:lock", keys[20].as_str()))
        .await
        .unwrap();
    let taken = other.try_acquire(&keys[20], &opts(30 * SEC)).await.unwrap();
    let req = ForceRelease::new("ops", "batch test").unwrap();
    assert!(other
        .force_release(&keys[30], &req)
        .await
        .unwrap()
        .is_some());

    let before_calls = evalsha_calls(&mut conn).await;
    let before: Vec<Instant> = leases.iter().map(|l| l.valid_until()).collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let results = futures::future::join_all(leases.iter().map(|l| l.renew())).await;
    let scripts = evalsha_calls(&mut conn).await - before_calls;

    for (i, r) in results.iter().enumerate() {
        match i {
            10 => assert!(
                matches!(
                    r,
                    Err(Error::Lost {
                        reason: LostReason::Revoked | LostReason::Expired,
                        ..
                    })
                ),
                "deleted: {r:?}"
            ),
            20 => assert!(
                matches!(
                    r,
                    Err(Error::Lost {
                        reason: LostReason::Revoked | LostReason::Superseded,
                        ..
                    })
                ),
                "taken over: {r:?}"
            ),
            30 => assert!(
                matches!(
                    r,
                    Err(Error::Lost {
                        reason: LostReason::Revoked,
                        ..
                    })
                ),
                "force-released: {r:?}"
            ),
            _ => {
                let until = r.as_ref().unwrap_or_else(|e| panic!("lease {i}: {e}"));
                assert!(*until > before[i], "lease {i}: validity did not move");
            }
        }
    }
    // A lease lost before the call never reaches the server; the rest go in batches.
    assert!(
        scripts <= 20,
        "{} renewals took {scripts} scripts; expected them batched",
        N - 3
    );
    assert_eq!(
        c.inspect(&keys[20]).await.unwrap().unwrap().token,
        taken.token()
    );
    for l in &leases {
        if l.status() == LeaseStatus::Held {
            l.release().await.unwrap();
        }
    }
}

/// `from_client` builds a coordinator (and a fence) on the application's own redis-rs client:
/// the same guarantees (tokens increase across the two coordinators, the key is exclusive, the
/// fence refuses the older token).
#[tokio::test]
async fn a_coordinator_from_the_applications_own_client_behaves_like_one_from_a_url() {
    let Some(srv) = server(
        "a_coordinator_from_the_applications_own_client_behaves_like_one_from_a_url",
        durable(),
    ) else {
        return;
    };
    let url = common::url(&srv, "");
    let config = adapter_redis::RedisConfig::from_url(&url).unwrap();
    let own = adapter_redis::redis::Client::open(url.as_str()).unwrap();
    let fence = adapter_redis::RedisFence::from_client(own.clone(), config.clone())
        .await
        .unwrap();
    let from_client = adapter_redis::RedisCoordinator::from_client(own, config)
        .await
        .unwrap();
    let from_url = coordinator(&srv, "").await;
    one_holder_across(
        &from_client,
        &from_url,
        &key("from-client"),
        &opts(10 * SEC),
    )
    .await;
    let k = key("from-client-fence");
    let older = from_client.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
    let older_token = older.token();
    older.release().await.unwrap();
    let newer = from_url.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
    let resource = lease_core::ResourceId::from(&k);
    fence
        .write(
            &resource,
            newer.token(),
            lease_core::Bytes::from_static(b"new"),
        )
        .await
        .unwrap();
    let stale = fence
        .write(
            &resource,
            older_token,
            lease_core::Bytes::from_static(b"old"),
        )
        .await;
    assert!(
        matches!(stale, Err(Error::Stale { .. })),
        "the fence on the application's client took an older token: {stale:?}"
    );
    newer.release().await.unwrap();
}

/// `SCRIPT FLUSH` (or a restart) empties the server's script cache: every operation's `EVALSHA`
/// is then answered `NOSCRIPT`, and the adapter loads the script and runs it again, once.
#[tokio::test]
async fn scripts_flushed_from_the_server_are_loaded_again() {
    let Some(srv) = server(
        "scripts_flushed_from_the_server_are_loaded_again",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let conn = raw(&srv).await;
    let k = key("flushed");
    let flush = |mut conn: redis::aio::MultiplexedConnection| async move {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .unwrap();
    };
    let first = c.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
    flush(conn.clone()).await;
    first.renew().await.unwrap();
    assert_eq!(first.status(), LeaseStatus::Held);
    flush(conn.clone()).await;
    let first_token = first.token();
    first.release().await.unwrap();
    assert!(
        c.inspect(&k).await.unwrap().is_none(),
        "the release after a flush deleted the lock"
    );
    flush(conn).await;
    let second = c.try_acquire(&k, &opts(10 * SEC)).await.unwrap();
    assert!(second.token() > first_token);
    second.release().await.unwrap();
}

async fn connections_received(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("total_connections_received:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_connections_received in INFO stats")
}

/// An ACL user without the release channels (Redis 7's default `acl-pubsub-default
/// resetchannels`) is refused `SUBSCRIBE` with `NOPERM`. Its waiters poll, and the refusal is not
/// taken for a broken connection: before, the pub/sub task reconnected at once in a loop, each
/// round waking every waiter to run the acquire script, for as long as anyone waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_subscription_makes_waiters_poll_without_reconnecting() {
    let Some(srv) = server(
        "a_refused_subscription_makes_waiters_poll_without_reconnecting",
        durable(),
    ) else {
        return;
    };
    let mut admin = raw(&srv).await;
    let _: () = redis::cmd("ACL")
        .arg(&[
            "SETUSER",
            "nochannels",
            "on",
            ">pw-nochannels",
            "~*",
            "+@all",
            "resetchannels",
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let holder = coordinator(&srv, "").await;
    let k = key("refused-subscription");
    let ttl = Duration::from_secs(10);
    let held = holder
        .try_acquire(&k, &LeaseOptions::new(ttl))
        .await
        .unwrap();
    let waiter = Arc::new(
        RedisCoordinator::connect(
            RedisConfig::from_url(&format!(
                "redis://nochannels:pw-nochannels@{}/?poll_interval_ms=100",
                srv.addr()
            ))
            .unwrap(),
        )
        .await
        .unwrap(),
    );
    let before = connections_received(&mut admin).await;
    match waiter
        .acquire(&k, &LeaseOptions::new(ttl).wait(Duration::from_secs(1)))
        .await
    {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected Timeout while the key is held, got {other:?}"),
    }
    let opened = connections_received(&mut admin).await - before;
    assert!(
        opened < 10,
        "{opened} connections opened while one waiter waited 1 s"
    );
    // Polling still hands the key over once it is released.
    let pending = {
        let (waiter, k) = (waiter.clone(), k.clone());
        tokio::spawn(async move {
            waiter
                .acquire(&k, &LeaseOptions::new(ttl).wait(Duration::from_secs(10)))
                .await
        })
    };
    held.release().await.unwrap();
    let lease = pending
        .await
        .unwrap()
        .expect("the waiter gets the key by polling");
    // The release script's `PUBLISH` is refused for this user too: the release still succeeds.
    lease.release().await.unwrap();
    assert!(holder.inspect(&k).await.unwrap().is_none());
}

/// On a Redis Cluster node (here one node owning every slot, as a one-shard managed cluster is),
/// the keys of different locks are in different hash slots, and a script touching several is
/// refused with `CROSSSLOT`. Renewals asked for together used to share one batch script there:
/// every renewal of the round failed `Unavailable`, and a process holding two locks could keep
/// neither. A round now sends one script per lock on a cluster node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_asked_together_on_a_cluster_node_each_succeed() {
    let mut config = durable();
    config.extra_args = vec!["--cluster-enabled".into(), "yes".into()];
    let Some(srv) = server("renewals_asked_together_on_a_cluster_node", config) else {
        return;
    };
    let mut conn = raw(&srv).await;
    let _: () = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16383)
        .query_async(&mut conn)
        .await
        .unwrap();
    let ready = common::eventually(10 * SEC, || {
        let mut conn = conn.clone();
        async move {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut conn)
                .await
                .ok()?;
            info.contains("cluster_state:ok").then_some(())
        }
    })
    .await;
    assert!(ready.is_some(), "the one-node cluster never came up");
    let c = coordinator(&srv, "").await;
    let mut leases = Vec::new();
    for _ in 0..20 {
        leases.push(
            c.try_acquire(&key("cluster"), &opts(30 * SEC))
                .await
                .unwrap(),
        );
    }
    let results = futures::future::join_all(leases.iter().map(|l| l.renew())).await;
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "renewal {i}: {r:?}");
    }
    for l in leases {
        l.release().await.unwrap();
    }
}
