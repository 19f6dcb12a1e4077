//! Lost replies, broken connections and writes from outside, through the fault proxy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator};
use conformance_tests::contend::concurrent_try_acquires;
use conformance_tests::proxy::FaultProxy;
use lease_core::{
    Coordinator, Error, ForceRelease, Lease, LeaseOptions, LeaseStatus, LostReason, Token,
};
use tokio::time::Instant;

use crate::common::{coordinator, durable, eventually, key, raw, server};

const SEC: Duration = Duration::from_secs(1);

/// A coordinator that talks to the server through `proxy`.
async fn via(proxy: &FaultProxy, options: &str) -> RedisCoordinator {
    let url = format!("redis://{}/?{options}", proxy.addr());
    RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .unwrap_or_else(|e| panic!("connect via proxy: {e}"))
}

/// Defect 5: B's first acquire attempt is lost (its request and reply are held past B's request
/// timeout) while A holds the key for several TTLs, renewing. Once A releases, B must acquire
/// promptly with (nearly) its full validity, and the counter must have advanced once per real
/// grant: before the fix B's validity counted from its first, long-ago send, so every grant
/// looked expired on arrival and B granted, deleted and re-granted until its wait ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_reply_lost_while_held_then_granted_with_full_validity() {
    let Some(srv) = server(
        "acquire_reply_lost_while_held_then_granted_with_full_validity",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    // Counter-only tokens, so that "one grant" is "the counter moved by one".
    let a = coordinator(&srv, "clock_tokens=false").await;
    let b = via(
        &proxy,
        "request_timeout_ms=300&poll_interval_ms=50&clock_tokens=false",
    )
    .await;
    let k = key("lost-acquire-reply");
    let ttl = Duration::from_millis(600);
    // A's own TTL is longer: its renewals, every quarter of B's TTL, then have seconds of slack
    // on a loaded machine, and nothing below depends on it.
    let held = a
        .try_acquire(&k, &LeaseOptions::new(10 * ttl))
        .await
        .unwrap();
    let first = held.token();

    // A keeps renewing until told to release.
    let stop = Arc::new(AtomicBool::new(false));
    let holder = {
        let stop = stop.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                held.renew().await.expect("A renews");
                tokio::time::sleep(ttl / 4).await;
            }
            held.release().await.expect("A releases");
            Instant::now()
        })
    };

    // B's first attempt is held in the network: B times out and reconnects to re-read.
    proxy.blackhole();
    let accepted = proxy.accepted_connections();
    let waiter = {
        let k = k.clone();
        tokio::spawn(async move {
            let r = b.acquire(&k, &LeaseOptions::new(ttl).wait(30 * SEC)).await;
            (r, Instant::now(), b)
        })
    };
    let reconnected = eventually(10 * SEC, || async {
        (proxy.accepted_connections() > accepted).then_some(())
    })
    .await;
    assert!(reconnected.is_some(), "B never timed out and re-read");
    // The held request is delivered late (it finds A's lock and writes nothing).
    proxy.heal();

    // A holds for several more TTLs; B keeps waiting.
    let hold_until = Instant::now() + 5 * ttl;
    while Instant::now() < hold_until {
        assert!(!waiter.is_finished(), "B finished while A held the key");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let released_at = holder.await.unwrap();

    let (result, got_at, b) = tokio::time::timeout(10 * SEC, waiter)
        .await
        .expect("B still waiting long after A released")
        .unwrap();
    let lease = result.unwrap_or_else(|e| panic!("B: {e}"));
    let hand_off = got_at - released_at;
    assert!(hand_off < 2 * SEC, "hand-off took {hand_off:?}");
    assert_eq!(lease.status(), LeaseStatus::Held);
    // B's grant was sent after A's release began, so after `hold_until`: validity counted from
    // that send ends past `hold_until + ttl / 2`, and from B's first send, 5 TTLs earlier, before
    // it. (Measured from `hold_until`, not from B's return, so a slow reply cannot fail it.)
    assert!(
        lease.valid_until() > hold_until + ttl / 2,
        "B's lease is valid until {:?} after A's holding ended: validity counted from an old send",
        lease.valid_until().saturating_duration_since(hold_until)
    );

    // One real grant after A's: the counter moved by exactly one.
    assert_eq!(lease.token(), Token::new(first.get() + 1).unwrap());
    let keys = adapter_redis::storage_keys(b.config(), &k);
    let mut conn = raw(&srv).await;
    let counter: u64 = redis::cmd("GET")
        .arg(&keys[1])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(counter, lease.token().get());
    lease.release().await.unwrap();
}

/// Waits (bounded) until `lease`'s status satisfies `want`.
async fn status_becomes(
    lease: &dyn Lease,
    limit: Duration,
    want: impl Fn(LeaseStatus) -> bool,
) -> Option<LeaseStatus> {
    eventually(limit, || async {
        let s = lease.status();
        want(s).then_some(s)
    })
    .await
}

/// A broken connection marks the lease in doubt promptly (a reset at once, a silent partition
/// within a ping's timeout); a confirmed renew makes it held again, or lost if the key went
/// while the connection was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_connection_marks_leases_in_doubt_until_a_confirmed_renew() {
    let Some(srv) = server(
        "broken_connection_marks_leases_in_doubt_until_a_confirmed_renew",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = via(&proxy, "request_timeout_ms=500&poll_interval_ms=100").await;
    let k = key("in-doubt");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(20 * SEC))
        .await
        .unwrap();
    assert_eq!(lease.status(), LeaseStatus::Held);

    // A reset: in doubt at once; the renew after it confirms.
    proxy.cut();
    let s = status_becomes(&*lease, 3 * SEC, |s| s == LeaseStatus::InDoubt).await;
    assert_eq!(s, Some(LeaseStatus::InDoubt), "not in doubt after a reset");
    lease.renew().await.unwrap();
    assert_eq!(lease.status(), LeaseStatus::Held);

    // A silent partition: in doubt within the monitor's ping timeout.
    proxy.blackhole();
    let began = Instant::now();
    let s = status_becomes(&*lease, 5 * SEC, |s| s == LeaseStatus::InDoubt).await;
    assert_eq!(s, Some(LeaseStatus::InDoubt), "not in doubt in a partition");
    eprintln!("in doubt {:?} after the partition began", began.elapsed());
    proxy.heal();
    let renewed = eventually(5 * SEC, || async { lease.renew().await.ok() }).await;
    assert!(renewed.is_some(), "no renew confirmed after healing");
    assert_eq!(lease.status(), LeaseStatus::Held);

    // The key goes while the connection is down: lost, never held again.
    proxy.blackhole();
    let s = status_becomes(&*lease, 5 * SEC, |s| s == LeaseStatus::InDoubt).await;
    assert_eq!(s, Some(LeaseStatus::InDoubt));
    let lock_key = adapter_redis::storage_keys(c.config(), &k).remove(0);
    let mut conn = raw(&srv).await;
    let _: i64 = redis::cmd("DEL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    proxy.heal();
    let lost = eventually(5 * SEC, || async {
        match lease.renew().await {
            Err(e) if e.is_lost() => Some(()),
            _ => matches!(lease.status(), LeaseStatus::Lost(_)).then_some(()),
        }
    })
    .await;
    assert!(lost.is_some(), "still {:?}", lease.status());
    assert!(matches!(lease.status(), LeaseStatus::Lost(_)));
}

/// An operator's `DEL` of a held lock is noticed within a fraction of a TTL (long before the
/// next renewal), and so is another tool's `SET ... KEEPTTL`; after an outside overwrite renew
/// and release report `Lost`, release deletes nothing, and the foreign value expires at the
/// lock's remaining TTL. The holder's own renewals never look like an outside write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outside_delete_or_overwrite_of_a_held_lock_is_noticed_promptly() {
    let Some(srv) = server(
        "outside_delete_or_overwrite_of_a_held_lock_is_noticed_promptly",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let mut conn = raw(&srv).await;
    let ttl = 8 * SEC;
    // Nothing but the holder monitor can notice before the lease's own 8 s: a bound a quarter
    // of that proves the monitor did, and leaves a loaded machine's stalls room.
    let bound = 2 * SEC;

    // Our own renewals (each one a PEXPIRE the server reports as a change) stay held.
    let k = key("renewed");
    let lease = c.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
    for _ in 0..5 {
        lease.renew().await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(400)).await; // no condition: nothing may happen
    assert_eq!(lease.status(), LeaseStatus::Held);
    lease.release().await.unwrap();
    assert_eq!(lease.status(), LeaseStatus::Lost(LostReason::Released));

    // DEL: Revoked.
    let k = key("deleted");
    let lease = c.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
    let lock_key = adapter_redis::storage_keys(c.config(), &k).remove(0);
    let mut lost = lease.lost();
    let began = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    let reason = tokio::time::timeout(bound, lost.wait())
        .await
        .expect("DEL not noticed within 2 s");
    eprintln!("DEL noticed after {:?}", began.elapsed());
    assert_eq!(reason, LostReason::Revoked);

    // SET KEEPTTL: Superseded; renew and release say Lost; nothing is deleted.
    let k = key("overwritten");
    let lease = c.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
    let lock_key = adapter_redis::storage_keys(c.config(), &k).remove(0);
    let mut lost = lease.lost();
    let _: () = redis::cmd("SET")
        .arg(&lock_key)
        .arg("outside-write")
        .arg("KEEPTTL")
        .query_async(&mut conn)
        .await
        .unwrap();
    let reason = tokio::time::timeout(bound, lost.wait())
        .await
        .expect("overwrite not noticed within 2 s");
    assert_eq!(reason, LostReason::Superseded);
    // inspect names no owner and only the token the overwritten holder was given.
    let info = c.inspect(&k).await.unwrap().expect("the key is occupied");
    assert_eq!(info.token, lease.token());
    assert_eq!(info.owner.as_str(), "unknown (outside write)");
    assert!(matches!(
        lease.renew().await,
        Err(lease_core::Error::Lost {
            reason: LostReason::Superseded,
            ..
        })
    ));
    assert!(matches!(
        lease.release().await,
        Err(lease_core::Error::Lost { .. })
    ));
    drop(lease);
    let value: Option<String> = redis::cmd("GET")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(value.as_deref(), Some("outside-write"));
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(pttl > 0 && pttl <= ttl.as_millis() as i64, "{pttl}");

    // force_release of that value: with another expected token it is refused naming the newest
    // issued token; without one it is removed and reported as `inspect` shows it, under the
    // newest issued token (only a key no token was ever issued for, below, has no holder to
    // report).
    let request = || ForceRelease::new("oncall", "outside value").unwrap();
    let other = Token::new(info.token.get() + 1).unwrap();
    let refused = c.force_release(&k, &request().expect_token(other)).await;
    assert!(
        matches!(&refused, Err(Error::HolderChanged { found: Some(t), .. }) if *t == info.token),
        "{refused:?}"
    );
    let removed = c.force_release(&k, &request()).await.unwrap();
    let removed = removed.expect("the outside value was removed");
    assert_eq!(
        (removed.token, removed.owner.as_str()),
        (info.token, "unknown (outside write)")
    );
    assert_eq!(c.inspect(&k).await.unwrap(), None);
    // The audit entry names the token the call reported (before, none).
    let trail = c.audit_trail(&k, 1).await.unwrap();
    assert_eq!(trail[0].removed_token, Some(info.token), "{trail:?}");
    // On a key no token was ever issued for, an expected token is refused with none found.
    let never = key("never-locked");
    let never_key = adapter_redis::storage_keys(c.config(), &never).remove(0);
    let _: () = redis::cmd("SET")
        .arg(&never_key)
        .arg("outside-write")
        .query_async(&mut conn)
        .await
        .unwrap();
    let refused = c
        .force_release(&never, &request().expect_token(Token::new(1).unwrap()))
        .await;
    assert!(
        matches!(&refused, Err(Error::HolderChanged { found: None, .. })),
        "{refused:?}"
    );
    // Without one it is removed: no holder to report (no token ever issued), so the error is a
    // misconfiguration that says the key is free now, never an unknown outcome.
    let removed = c.force_release(&never, &request()).await;
    match &removed {
        Err(Error::Misconfigured { problems, .. })
            if problems
                .iter()
                .any(|p| p.contains("removed") && p.contains("free now")) => {}
        other => panic!("{other:?}"),
    }
    let value: Option<String> = redis::cmd("GET")
        .arg(&never_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(value, None);
    // And audited, with no token to name.
    let trail = c.audit_trail(&never, 10).await.unwrap();
    assert!(
        trail.iter().any(|a| a.actor == "oncall"
            && a.reason == "outside value"
            && a.removed_token.is_none()),
        "{trail:?}"
    );

    // A value of another type (a hash) over one held lock: that lease is Superseded, and the
    // monitor goes on reading the other held locks (a DEL of one is still noticed).
    let (k, other) = (key("hashed"), key("bystander"));
    let lease = c.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
    let bystander = c
        .try_acquire(&other, &LeaseOptions::new(ttl))
        .await
        .unwrap();
    let lock_key = adapter_redis::storage_keys(c.config(), &k).remove(0);
    let other_key = adapter_redis::storage_keys(c.config(), &other).remove(0);
    let (mut lost, mut bystander_lost) = (lease.lost(), bystander.lost());
    let _: () = redis::pipe()
        .atomic()
        .cmd("DEL")
        .arg(&lock_key)
        .ignore()
        .cmd("HSET")
        .arg(&lock_key)
        .arg("f")
        .arg("v")
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    let reason = tokio::time::timeout(bound, lost.wait())
        .await
        .expect("a hash over the lock not noticed within 2 s");
    assert_eq!(reason, LostReason::Superseded);
    assert_eq!(bystander.status(), LeaseStatus::Held);
    let _: i64 = redis::cmd("DEL")
        .arg(&other_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    let reason = tokio::time::timeout(bound, bystander_lost.wait())
        .await
        .expect("a DEL of another lock not noticed within 2 s");
    assert_eq!(reason, LostReason::Revoked);
    let _: i64 = redis::cmd("DEL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
}

/// Without client-side tracking (here the ACL denies `CLIENT`), the monitor polls held keys
/// every poll interval: a `DEL` is still noticed within about one interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tracking_the_monitor_polls_held_keys() {
    let Some(srv) = server("without_tracking_the_monitor_polls_held_keys", durable()) else {
        return;
    };
    let mut conn = raw(&srv).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("notrack")
        .arg("on")
        .arg(">pw")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-client")
        .query_async(&mut conn)
        .await
        .unwrap();
    let url = format!("redis://notrack:pw@{}/?poll_interval_ms=100", srv.addr());
    let c = RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    let k = key("polled");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(8 * SEC))
        .await
        .unwrap();
    let lock_key = adapter_redis::storage_keys(c.config(), &k).remove(0);
    let mut lost = lease.lost();
    let _: i64 = redis::cmd("DEL")
        .arg(&lock_key)
        .query_async(&mut conn)
        .await
        .unwrap();
    // A quarter of the lease's TTL: only the poll can have noticed by then.
    let reason = tokio::time::timeout(2 * SEC, lost.wait())
        .await
        .expect("DEL not noticed by polling");
    assert_eq!(reason, LostReason::Revoked);
}

/// Another writer sets the token counter to something that is not a token (a negative number,
/// leading zeros, text). The acquire refuses it as out of range, naming the value, writes
/// nothing (before, each attempt incremented a negative counter, so after a few attempts tokens
/// counted up from 0 again), and leaves the key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_with_an_out_of_range_token_leaves_the_key_free() {
    let Some(srv) = server(
        "a_grant_with_an_out_of_range_token_leaves_the_key_free",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "clock_tokens=false").await;
    let mut conn = raw(&srv).await;
    let k = key("outside-counter");
    let keys = adapter_redis::storage_keys(c.config(), &k);
    let (lock_key, counter_key) = (keys[0].clone(), keys[1].clone());
    for counter in ["-2", "-5", "007", "seven"] {
        let _: () = redis::cmd("SET")
            .arg(&counter_key)
            .arg(counter)
            .query_async(&mut conn)
            .await
            .unwrap();
        for _ in 0..3 {
            match c.try_acquire(&k, &LeaseOptions::new(60 * SEC)).await {
                Err(Error::TokenOutOfRange { native: n, .. }) => {
                    assert!(n.contains(&format!("{counter:?}")), "{n}")
                }
                other => panic!("counter {counter}: expected TokenOutOfRange, got {other:?}"),
            }
        }
        let left: String = redis::cmd("GET")
            .arg(&counter_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(left, counter, "the refused attempts wrote the counter");
        let freed = eventually(10 * SEC, || {
            let mut conn = conn.clone();
            let lock_key = lock_key.clone();
            async move {
                let lock: Option<String> = redis::cmd("GET")
                    .arg(&lock_key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                lock.is_none().then_some(())
            }
        })
        .await;
        assert!(
            freed.is_some(),
            "counter {counter}: the refused grant's lock is still there"
        );
    }
    // Once the counter is a token again, the key is granted as usual.
    let _: () = redis::cmd("SET")
        .arg(&counter_key)
        .arg("41")
        .query_async(&mut conn)
        .await
        .unwrap();
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(60 * SEC))
        .await
        .unwrap();
    assert_eq!(lease.token(), Token::new(42).unwrap());
    lease.release().await.unwrap();
}

/// A lock key overwritten from outside with another type (a hash) fails that lock's renewal
/// only: the batch script answers `-3` for it and renews the others in the same run. Before,
/// its `GET` failed the whole script (`WRONGTYPE`), and with it the renewals of up to 255 other
/// leases batched with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_of_another_type_fails_only_its_own_batched_renewal() {
    let Some(srv) = server(
        "a_lock_of_another_type_fails_only_its_own_batched_renewal",
        durable(),
    ) else {
        return;
    };
    let mut conn = raw(&srv).await;
    let source = adapter_redis::script_source("renew_many").unwrap();
    let (a, b, c) = (key("wrong-type"), key("healthy"), key("wrong-type-revoked"));
    let config = RedisConfig::from_url("redis://127.0.0.1/").unwrap();
    let keys = |k: &lease_core::LockKey| adapter_redis::storage_keys(&config, k);
    let (ka, kb, kc) = (keys(&a), keys(&b), keys(&c));
    // a: the lock is a hash. b: our value. c: the lock is gone and its revocation record is a
    // list.
    let _: () = redis::pipe()
        .cmd("HSET")
        .arg(&ka[0])
        .arg("f")
        .arg("v")
        .ignore()
        .cmd("SET")
        .arg(&kb[0])
        .arg("v1|ab|7|rest")
        .arg("PX")
        .arg(60_000)
        .ignore()
        .cmd("RPUSH")
        .arg(&kc[2])
        .arg("x")
        .ignore()
        .query_async(&mut conn)
        .await
        .unwrap();
    let codes: Vec<i64> = redis::cmd("EVAL")
        .arg(source)
        .arg(6)
        .arg(&[&ka[0], &ka[2], &kb[0], &kb[2], &kc[0], &kc[2]])
        .arg(&["v1|ab|", "30000", "v1|ab|", "30000", "v1|cd|", "30000"])
        .query_async(&mut conn)
        .await
        .expect("one lock of another type fails the whole script");
    assert_eq!(codes, vec![-3, 1, -3]);
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&kb[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        pttl <= 30_000,
        "the healthy lock was not renewed: PTTL {pttl}"
    );
}

/// A Sentinel that takes connections and never answers (a partition) gets its share of the
/// connect timeout, not all of it: the others are still asked in time, and it is asked after
/// them next time. Before, the first Sentinel in the list took the whole budget on every connect
/// and the coordinator could not connect at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_sentinel_does_not_spend_the_whole_connect_timeout() {
    // The missing-server policy (a named skip, or a failure under CI=true).
    let Some(_probe) = server(
        "a_silent_sentinel_does_not_spend_the_whole_connect_timeout",
        durable(),
    ) else {
        return;
    };
    let cluster = conformance_tests::harness::redis_cluster::RedisCluster::start()
        .await
        .expect("a Sentinel cluster");
    let sentinels = cluster.sentinel_addrs();
    let silent = FaultProxy::start(sentinels[0]).await.unwrap();
    silent.blackhole();
    let url = format!(
        "redis+sentinel://{},{},{}/{}?connect_timeout_ms=3000",
        silent.addr(),
        sentinels[1],
        sentinels[2],
        conformance_tests::harness::redis_cluster::PRIMARY_NAME
    );
    let c = RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .expect("connected through the Sentinels that answer");
    let k = key("silent-sentinel");
    c.try_acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// An `acquire` whose wait ends while its script's outcome is unknown, on a key it never found
/// held, runs the (idempotent) script once more: the re-read found the key free, so nothing was
/// seen ahead of it. Before, it returned `Timeout`, reporting a free key as busy (decision 0036).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_reply_at_the_wait_bound_on_a_free_key_is_not_reported_busy() {
    let Some(srv) = server("a_lost_reply_at_the_wait_bound_on_a_free_key", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = via(&proxy, "request_timeout_ms=2000&poll_interval_ms=50").await;
    let k = key("lost-reply-free-key");
    // The connections open now forward nothing (never healed): the script never reaches the
    // server and its reply never comes; the re-read goes on a new connection and finds the key
    // free.
    proxy.stall_open();
    let accepted = proxy.accepted_connections();
    let r = c.acquire(&k, &LeaseOptions::new(10 * SEC)).await;
    assert!(
        proxy.accepted_connections() > accepted,
        "the script's reply was not lost: no new connection"
    );
    let lease = r.unwrap_or_else(|e| panic!("a free key with a zero wait: {e}"));
    lease.release().await.unwrap();
}

/// An acquire whose script is stalled in the network (its connection forwards nothing; new ones
/// pass) is granted on a new connection, and released. The stalled copy of the script then
/// reaches the server: it must not lock the key again for a nonce nobody holds. The adapter
/// ended the stalled connection on the server before it re-read, so the copy never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_acquire_does_not_lock_the_key_after_its_lease_was_released() {
    let Some(srv) = server("a_stalled_acquire_does_not_lock_the_key", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = via(&proxy, "request_timeout_ms=1000&poll_interval_ms=50").await;
    let k = key("stalled-acquire");
    proxy.stall_open();
    let accepted = proxy.accepted_connections();
    let lease = c
        .acquire(&k, &LeaseOptions::new(10 * SEC))
        .await
        .unwrap_or_else(|e| panic!("a free key: {e}"));
    assert!(
        proxy.accepted_connections() > accepted,
        "the script was not stalled: no new connection"
    );
    let token = lease.token();
    lease.release().await.unwrap();
    let keys = adapter_redis::storage_keys(c.config(), &k);
    // Every connection of the coordinator closes (nothing holds one once both are dropped); the
    // proxy then delivers what it held on the stalled one, and closes each once the server has
    // closed its side (the server runs what it received on a connection before it reads the end
    // of it).
    drop((lease, c));
    proxy.heal();
    let settled = eventually(10 * SEC, || async {
        (proxy.open_connections() == 0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "the proxy's connections never closed");
    let mut conn = raw(&srv).await;
    let (value, counter): (Option<String>, String) = redis::pipe()
        .cmd("GET")
        .arg(&keys[0])
        .cmd("GET")
        .arg(&keys[1])
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        value, None,
        "the stalled acquire ran after the release and locked the key"
    );
    assert_eq!(
        counter,
        token.get().to_string(),
        "a token was issued after ours"
    );
}

/// A grant whose reply is lost is found by the re-read after its validity (counted from the lost
/// request's send) has already ended: the adapter gives it back, and `try_acquire` must then
/// run the script again for a grant of its own, not report the key it held itself as `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_found_expired_after_a_lost_reply_is_tried_again_not_reported_held() {
    let Some(srv) = server("a_grant_found_expired_after_a_lost_reply", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = via(&proxy, "request_timeout_ms=1000").await;
    let k = key("grant-found-expired");
    // The script applies, its reply is lost: the re-read comes at least 1 s after the send,
    // while the key lives (3 s) but past the lease's validity (3 s less a 2.2 s drift margin).
    let options = LeaseOptions::new(3 * SEC).drift_margin(Duration::from_millis(2200));
    // The script loaded (a first `EVALSHA` would be refused `NOSCRIPT`, applying nothing).
    let warm = c.try_acquire(&k, &options).await.unwrap();
    warm.release().await.unwrap();
    proxy.drop_replies_on_open();
    let lease = c
        .try_acquire(&k, &options)
        .await
        .unwrap_or_else(|e| panic!("the key was free (our own grant, given back): {e}"));
    assert_eq!(lease.status(), LeaseStatus::Held);
    lease.release().await.unwrap();
}

/// With the server unreachable, requests that find the connection broken share one attempt to
/// open a new one, and its failure: each call fails within a few bounds of its start, not after
/// the opens of every call queued before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_the_failure_of_one_connection_open() {
    let Some(srv) = server(
        "concurrent_calls_share_the_failure_of_one_connection_open",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let bound = Duration::from_millis(300);
    let c = Arc::new(
        via(
            &proxy,
            &format!(
                "request_timeout_ms={0}&connect_timeout_ms={0}",
                bound.as_millis()
            ),
        )
        .await,
    );
    // New connections are accepted and never answered; the one open now is reset.
    proxy.blackhole();
    proxy.cut();
    let calls = (0..8)
        .map(|i| (key(&format!("shared-open/{i}")), LeaseOptions::new(5 * SEC)))
        .collect();
    for (r, took) in concurrent_try_acquires(c.clone(), calls).await {
        assert!(r.is_err(), "granted through a blackholed proxy: {r:?}");
        assert!(
            took < 6 * bound,
            "a try_acquire returned {took:?} after the start, with {bound:?} connect and \
             request timeouts"
        );
    }
}

/// A force-release whose audit key another tool overwrote with a string removes nothing and says
/// so (`Misconfigured`, naming the key): the lock stays with its holder. Before, the script
/// deleted the lock and then failed at the `XADD` (a script's writes are not rolled back): the
/// key was freed with no audit entry, and the call reported an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_force_release_whose_audit_key_holds_something_else_removes_nothing() {
    let Some(srv) = server(
        "a_force_release_whose_audit_key_holds_something_else_removes_nothing",
        durable(),
    ) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let mut conn = raw(&srv).await;
    let k = key("audit-overwritten");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(30 * SEC))
        .await
        .unwrap();
    let audit_key = adapter_redis::storage_keys(c.config(), &k).remove(3);
    assert!(audit_key.ends_with(":audit"), "{audit_key}");
    let _: () = redis::cmd("SET")
        .arg(&audit_key)
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    let request = ForceRelease::new("oncall", "stuck").unwrap();
    match c.force_release(&k, &request).await {
        Err(Error::Misconfigured { problems, .. })
            if problems
                .iter()
                .any(|p| p.contains(&audit_key) && p.contains("nothing was removed")) => {}
        other => panic!("{other:?}"),
    }
    let holder = c.inspect(&k).await.unwrap().expect("still held");
    assert_eq!(holder.token, lease.token());
    assert_eq!(lease.status(), LeaseStatus::Held);
    lease.release().await.unwrap();
}

/// A Sentinel of our own, monitoring the cluster's primary name at an address where nothing
/// answers: what a Sentinel cut off from the others says after they failed over. Stopped (by the
/// PID this test started) and its directory removed when dropped.
struct StaleSentinel {
    child: std::process::Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl StaleSentinel {
    async fn start() -> StaleSentinel {
        use conformance_tests::harness::{find_in_path, free_ports, tcp_exchange};
        let ports = free_ports(2).unwrap();
        let (port, nobody) = (ports[0], ports[1]);
        let dir = std::env::temp_dir().join(format!(
            "fenced-stale-sentinel-{}-{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor {} 127.0.0.1 {nobody} 2\n",
                dir.display(),
                conformance_tests::harness::redis_cluster::PRIMARY_NAME
            ),
        )
        .unwrap();
        let child = std::process::Command::new(find_in_path("redis-server").unwrap())
            .arg(&conf)
            .arg("--sentinel")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let sentinel = StaleSentinel { child, dir, port };
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let ready = eventually(Duration::from_secs(15), || async move {
            tokio::task::spawn_blocking(move || {
                tcp_exchange(addr, b"PING\r\n", Duration::from_millis(250), |b| {
                    b.ends_with(b"\r\n")
                })
            })
            .await
            .ok()?
            .ok()
            .filter(|reply| reply.starts_with(b"+PONG"))
        })
        .await;
        assert!(ready.is_some(), "the stale Sentinel did not start");
        sentinel
    }
}

impl Drop for StaleSentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Sentinel cut off from the others still names the primary they failed over from, which no
/// longer answers, while the others name the one serving. Before, the Sentinel that answered
/// last was asked first at every connect whether or not the server it named could be opened:
/// listed first, the stale one made every connect and reconnect fail. Now, when the server a
/// Sentinel named cannot be opened as the primary, the next is asked (within the connect
/// timeout), and the stale one is asked last from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_naming_a_primary_that_does_not_answer_is_passed_over() {
    let Some(_srv) = server(
        "a_sentinel_naming_a_primary_that_does_not_answer_is_passed_over",
        durable(),
    ) else {
        return;
    };
    let cluster = conformance_tests::harness::redis_cluster::RedisCluster::start()
        .await
        .expect("a Sentinel cluster");
    let sentinels = cluster.sentinel_addrs();
    let stale = StaleSentinel::start().await;
    let url = format!(
        "redis+sentinel://127.0.0.1:{},{},{}/{}?connect_timeout_ms=2000",
        stale.port,
        sentinels[1],
        sentinels[2],
        conformance_tests::harness::redis_cluster::PRIMARY_NAME
    );
    let c = RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .expect("connected through the Sentinels that name the serving primary");
    let k = key("stale-sentinel");
    for _ in 0..3 {
        c.try_acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}
