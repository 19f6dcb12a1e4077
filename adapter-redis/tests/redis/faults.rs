//! Lost replies, broken connections and writes from outside, through the fault proxy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator};
use conformance_tests::proxy::FaultProxy;
use lease_core::{Coordinator, Lease, LeaseOptions, LeaseStatus, Token};
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
    let a = coordinator(&srv, "").await;
    let b = via(&proxy, "command_timeout_ms=300&poll_interval_ms=50").await;
    let k = key("lost-acquire-reply");
    let ttl = Duration::from_millis(600);
    let held = a.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
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
    let left = lease.valid_until().saturating_duration_since(got_at);
    assert!(
        left > ttl / 2,
        "B's lease has {left:?} of {ttl:?} left: validity counted from an old send"
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
