//! The ZooKeeper adapter with several servers: connecting while no server serves (within the
//! connect timeout), the session cap that covers a follower's session-touch lag (`tick_ms`),
//! and, against a three-server ensemble the conformance harness runs, a session that moves to
//! another server when its server dies or is cut from clients, and a holder whose follower is
//! cut from its peers right after answering its sync (`follower_cut_after_sync`). Without a JVM
//! or the ZooKeeper jars each test is a named skip (a failure under `CI=true`).

use std::time::Duration;

use adapter_zookeeper::{ZkConfig, ZkCoordinator};
use conformance_tests::harness::zookeeper_ensemble::ZooKeeperEnsemble;
use conformance_tests::harness::{
    server_unavailable, start_or_skip_async, Backend, ClusterControl, ZooKeeperServer,
};
use conformance_tests::proxy::FaultProxy;
use futures::FutureExt;
use lease_core::{Coordinator, Lease, LeaseOptions, LeaseStatus, LockKey};
use tokio::time::Instant;

const PASSWORD: &str = "zk-ensemble-s3cret";

async fn server(test: &str) -> Option<ZooKeeperServer> {
    start_or_skip_async(test, Backend::ZooKeeper, ZooKeeperServer::start).await
}

async fn ensemble(test: &str) -> Option<ZooKeeperEnsemble> {
    if let Err(reason) = ZooKeeperEnsemble::install() {
        server_unavailable(test, reason)
            .unwrap_or_else(|e| panic!("{e}"))
            .report();
        return None;
    }
    Some(
        ZooKeeperEnsemble::start()
            .await
            .unwrap_or_else(|e| panic!("{test}: the ensemble did not start: {e}")),
    )
}

fn url(hosts: &str, params: &str) -> ZkConfig {
    let base = format!("/ensemble-test-{:08x}", rand::random::<u32>());
    ZkConfig::from_url(&format!(
        "zk://{hosts}{base}?{params}&digest=alice:{PASSWORD}"
    ))
    .expect("valid url")
}

/// `connect_timeout_ms` bounds the whole connect: a session that cannot be opened at first (no
/// server answers: an election, a restart) is still opened once a server serves within it, not
/// given up after one session timeout by the client library.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_waits_out_an_unavailable_server_within_the_connect_timeout() {
    let Some(server) = server("connect_waits_out_an_unavailable_server").await else {
        return;
    };
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    proxy.blackhole();
    let cfg = url(
        &proxy.addr().to_string(),
        "session_timeout_ms=1000&connect_timeout_ms=8000",
    );
    let began = Instant::now();
    let connect = tokio::spawn(ZkCoordinator::connect(cfg));
    // Unavailable for three session timeouts, then it serves.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    assert!(!connect.is_finished(), "connect gave up before its timeout");
    proxy.cut();
    proxy.heal();
    let coord = tokio::time::timeout(Duration::from_secs(10), connect)
        .await
        .expect("bounded")
        .unwrap()
        .unwrap_or_else(|e| panic!("connect failed after {:?}: {e}", began.elapsed()));
    let key: LockKey = "after-wait".parse().unwrap();
    let lease = coord
        .acquire(&key, &LeaseOptions::new(Duration::from_secs(1)))
        .await
        .unwrap();
    lease.release().await.unwrap();
}

/// The session cap leaves room for a follower's session-touch lag: a lease's local validity is
/// at most `last confirmed send + T − (tick + T / 6) − drift margin`, where `tick` is the
/// `tick_ms` option (default `T / 2`), so it never outlives the leader's view of the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validity_leaves_a_tick_and_a_heartbeat_for_the_followers_touch_lag() {
    let Some(server) = server("validity_leaves_a_tick_and_a_heartbeat").await else {
        return;
    };
    for (params, tick) in [
        ("session_timeout_ms=2000", Duration::from_millis(1000)),
        (
            "session_timeout_ms=2000&tick_ms=200",
            Duration::from_millis(200),
        ),
    ] {
        let coord = ZkCoordinator::connect(url(&server.connect_string(), params))
            .await
            .unwrap();
        let t = coord.session_timeout();
        assert_eq!(t, Duration::from_millis(2000));
        let key: LockKey = format!("margin-{}", tick.as_millis()).parse().unwrap();
        // A TTL far above T: validity is the session cap.
        let ttl = Duration::from_secs(20);
        let drift = lease_core::adapter::clock::default_drift_margin(ttl);
        let lease = coord.acquire(&key, &LeaseOptions::new(ttl)).await.unwrap();
        let sent = Instant::now();
        let renewed = lease.renew().await.unwrap();
        let answered = Instant::now();
        let cap = t - tick - t / 6 - drift;
        assert!(
            renewed <= answered + cap,
            "{params}: validity {:?} after the renew was sent; at most {cap:?} \
             (T {t:?} − tick {tick:?} − heartbeat {:?} − drift {drift:?})",
            renewed - sent,
            t / 6
        );
        assert!(
            renewed >= sent + cap,
            "{params}: validity {:?} after the renew was sent, expected {cap:?}",
            renewed - sent
        );
        // The heartbeat keeps it held on its own: checked where the cap leaves a heartbeat
        // (every T/6) most of a second to be answered. With the default tick the cap is 465 ms
        // against heartbeats 333 ms apart: one slow sync on a loaded machine would end it.
        if tick < t / 4 {
            tokio::time::sleep(t).await;
            assert_eq!(lease.status(), LeaseStatus::Held, "{params}");
        }
        let _ = lease.release().await;
    }
    // A tick the session timeout cannot come from (T < 2 × tick) is refused at connect.
    match ZkCoordinator::connect(url(
        &server.connect_string(),
        "session_timeout_ms=2000&tick_ms=1500",
    ))
    .await
    {
        Err(lease_core::Error::Misconfigured { problems, .. }) => {
            assert!(
                problems.iter().any(|p| p.contains("tick_ms")),
                "{problems:?}"
            )
        }
        other => panic!("expected Misconfigured, got {:?}", other.map(|_| ())),
    }
}

/// The members whose `cons` lists session `sid` (asked on every member's real client port; a
/// server cut from its client may still list the dead connection).
async fn serving_members(ens: &std::sync::Arc<ZooKeeperEnsemble>, sid: i64) -> Vec<usize> {
    let needle = format!("sid=0x{:x}", sid as u64);
    let addrs: Vec<_> = (0..ens.members()).map(|m| ens.client_addr(m)).collect();
    tokio::task::spawn_blocking(move || {
        (0..addrs.len())
            .filter(|m| {
                conformance_tests::harness::tcp_exchange(
                    addrs[*m],
                    b"cons",
                    Duration::from_millis(500),
                    |_| false,
                )
                .map(|r| String::from_utf8_lossy(&r).contains(&needle))
                .unwrap_or(false)
            })
            .collect()
    })
    .await
    .unwrap()
}

/// Waits (bounded) until the session `sid` is served by a member other than `not`, and returns it.
async fn moved_off(
    ens: &std::sync::Arc<ZooKeeperEnsemble>,
    sid: i64,
    not: usize,
    within: Duration,
) -> usize {
    let until = Instant::now() + within;
    loop {
        if let Some(m) = serving_members(ens, sid)
            .await
            .into_iter()
            .find(|m| *m != not)
        {
            return m;
        }
        assert!(
            Instant::now() < until,
            "session {sid:#x} did not move off member {not} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With every server in the connect string, the client moves to another server when its server
/// is cut from clients or dies, within the session timeout, keeping its session. After a
/// follower's kill the kept lease is held again on the other server (the move takes tens of
/// milliseconds); after the leader's kill, or a silent cut, it is held again or, if the election
/// or noticing the cut outlasted its validity, lost as expired. (The leader's kill used to be
/// held to the follower's rule: an election of 2.8 s here, 5.3 s once under load, against 4.7 s
/// of validity, failed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_moves_to_another_server_when_its_server_is_cut_or_dies() {
    let Some(ens) = ensemble("the_session_moves_to_another_server").await else {
        return;
    };
    let ens = std::sync::Arc::new(ens);
    let coord = ZkCoordinator::connect(url(
        &ens.connect_string(),
        "session_timeout_ms=6000&tick_ms=200&connect_timeout_ms=12000",
    ))
    .await
    .unwrap();
    let t = coord.session_timeout();
    let sid = coord.current_session().await.unwrap().id().0;
    let key: LockKey = "moves".parse().unwrap();
    let kept = lease_core::keep(
        coord.acquire(&key, &LeaseOptions::new(t)).await.unwrap(),
        lease_core::KeeperOptions::new(),
    )
    .unwrap();
    let first = serving_members(&ens, sid).await[0];

    // Cut silently from clients: the library notices after its connection timeout (0.4 T, more
    // if it tries the cut server again) and moves; the session is kept. The lease is held again,
    // or, if the move outlasted its validity, lost (never held past it).
    ens.isolate_from_clients(first).await.unwrap();
    let cut_at = Instant::now();
    let second = moved_off(&ens, sid, first, t).await;
    assert_eq!(coord.current_session().await.unwrap().id().0, sid);
    let settled = tokio::time::timeout(t, async {
        loop {
            match kept.lease().status() {
                LeaseStatus::Held | LeaseStatus::Lost(_) => return kept.lease().status(),
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    })
    .await
    .expect("the lease is held again or lost after the move");
    assert!(
        matches!(
            settled,
            LeaseStatus::Held | LeaseStatus::Lost(lease_core::LostReason::Expired)
        ),
        "after the move to member {second} ({:?} after the cut): {settled:?}",
        cut_at.elapsed()
    );
    let _ = kept.release().await;
    ens.heal(first).await.unwrap();

    // The server dies: the client hears at once (its connection closes) and moves; a lease
    // taken on the same session is held again, never lost. If the server was the leader, the
    // others first elect a new one and serve no session meanwhile: the lease is held again, or,
    // if that outlasted its validity, lost as expired (never held past it).
    let current = serving_members(&ens, sid)
        .await
        .into_iter()
        .find(|m| *m != first)
        .unwrap_or(second);
    // The connection may still be settling after the heal (a retryable error): ask again.
    let until = Instant::now() + t * 2;
    let lease = loop {
        match coord.acquire(&key, &LeaseOptions::new(t).wait(t)).await {
            Ok(l) => break l,
            Err(e)
                if (e.is_retryable() || matches!(e, lease_core::Error::OutcomeUnknown { .. }))
                    && Instant::now() < until =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("acquire after the heal: {e}"),
        }
    };
    let kept = lease_core::keep(lease, lease_core::KeeperOptions::new()).unwrap();
    let mut lost = kept.lost();
    let was_leader = ens.leader().await.unwrap() == current;
    let left_at_kill = kept.lease().remaining();
    let killed_at = Instant::now();
    ens.kill(current).await.unwrap();
    let third = moved_off(&ens, sid, current, t + ens.failover_bound()).await;
    let moved_after = killed_at.elapsed();
    assert_eq!(coord.current_session().await.unwrap().id().0, sid);
    let held_again = tokio::time::timeout(t, async {
        while kept.lease().status() != LeaseStatus::Held {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .is_ok();
    let status = kept.lease().status();
    let context = format!(
        "member {current} (the leader: {was_leader}) killed; the session was served by member \
         {third} {moved_after:?} later, with {left_at_kill:?} of validity left at the kill"
    );
    if !held_again {
        // Only an election that outlasted the validity may end the lease, and only as expired.
        assert!(
            was_leader
                && status == LeaseStatus::Lost(lease_core::LostReason::Expired)
                && moved_after + Duration::from_secs(1) >= left_at_kill,
            "not held again: {status:?} ({context})"
        );
        ens.restart(current).await.unwrap();
        return;
    }
    assert!(
        lost.wait().now_or_never().is_none(),
        "the lease was lost while its session moved ({context})"
    );
    ens.restart(current).await.unwrap();
    // The connection may be settling again after the restart: a release refused with nothing
    // sent (retryable) is asked again.
    kept.stop();
    let until = Instant::now() + t * 2;
    loop {
        match kept.lease().release().await {
            Ok(()) => break,
            Err(e) if e.is_retryable() && Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("release after the restart: {e}"),
        }
    }
}

/// `follower_cut_after_sync`: the holder is connected to a follower only; right after the
/// follower answered the holder's sync (a renew), the follower is cut from its peers. The
/// leader then expires the session with the last touch the follower passed on, which may be
/// older than that sync; the holder's local validity must end no later than the moment an
/// observer on another server sees the holder's node gone (the ensemble's session expiry, seen
/// within the observer's 10 ms polling).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_cut_after_sync() {
    use adapter_zookeeper::zookeeper_client as zk;
    let Some(ens) = ensemble("follower_cut_after_sync").await else {
        return;
    };
    let ens = std::sync::Arc::new(ens);
    let leader = ens.leader().await.unwrap();
    let follower = (0..ens.members()).find(|m| *m != leader).unwrap();
    let config = url(
        &ens.client_proxy_addr(follower).to_string(),
        "session_timeout_ms=2000&tick_ms=200",
    );
    let coord = ZkCoordinator::connect(config.clone()).await.unwrap();
    let key: LockKey = "follower-cut".parse().unwrap();
    // A TTL far above T: the lease's validity is the session cap alone.
    let lease = coord
        .acquire(&key, &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    let observer = zk::Client::connector()
        .with_session_timeout(Duration::from_secs(10))
        .connect(
            &(0..ens.members())
                .filter(|m| *m != follower)
                .map(|m| ens.client_proxy_addr(m).to_string())
                .collect::<Vec<_>>()
                .join(","),
        )
        .await
        .unwrap();
    let dir = config.lock_path(&key);
    assert_eq!(observer.list_children(&dir).await.unwrap().len(), 1);

    // Let a few pings pass so the follower has passed on earlier touches, then sync and cut.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let validity = lease.renew().await.unwrap();
    ens.isolate_from_peers(follower).await.unwrap();
    let cut_at = Instant::now();

    let gone_at = loop {
        match observer.list_children(&dir).await {
            Ok(c) if c.is_empty() => break Instant::now(),
            Err(zk::Error::NoNode) => break Instant::now(),
            Ok(_) => {}
            // The observer's server may be busy with the cut; it reconnects to the other one.
            Err(zk::Error::ConnectionLoss) => {}
            Err(e) => panic!("observer: {e}"),
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(15),
            "the holder's session never expired"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let latest = lease.valid_until();
    assert!(
        latest.max(validity) <= gone_at,
        "the holder believed in its lease {:?} past the session's expiry (validity {:?} after \
         the cut, expiry seen {:?} after it)",
        latest.max(validity) - gone_at,
        latest.max(validity).saturating_duration_since(cut_at),
        gone_at - cut_at
    );
    assert!(
        !matches!(lease.status(), LeaseStatus::Held) || Instant::now() < latest,
        "status {:?}",
        lease.status()
    );
    ens.heal(follower).await.unwrap();
}

/// `inspect` and `force_release` read the holder behind a `sync`: on a follower cut from the
/// leader (still answering reads until it gives up, `syncLimit` ticks later) they fail rather
/// than report a key held through another server as free. Before, the plain read said free:
/// `inspect` printed "free", and `force_release` audited a free key and removed nothing while
/// reporting success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_reads_on_a_follower_cut_from_the_leader_never_say_free() {
    let Some(ens) = ensemble("operator_reads_on_a_follower_cut_from_the_leader").await else {
        return;
    };
    let leader = ens.leader().await.unwrap();
    let follower = (0..ens.members()).find(|m| *m != leader).unwrap();
    let others = (0..ens.members())
        .filter(|m| *m != follower)
        .map(|m| ens.client_proxy_addr(m).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let base = format!("/ensemble-test-{:08x}", rand::random::<u32>());
    let config = |hosts: &str| {
        ZkConfig::from_url(&format!(
            "zk://{hosts}{base}?request_timeout_ms=3000&digest=alice:{PASSWORD}"
        ))
        .expect("valid url")
    };
    let operator = ZkCoordinator::connect(config(&ens.client_proxy_addr(follower).to_string()))
        .await
        .unwrap();
    let holder = ZkCoordinator::connect(config(&others)).await.unwrap();
    let key: LockKey = "cut-follower".parse().unwrap();
    assert!(operator.inspect(&key).await.unwrap().is_none());

    ens.isolate_from_peers(follower).await.unwrap();
    // Granted through the leader's side; the cut follower never hears of it.
    let lease = holder
        .try_acquire(&key, &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    let inspected = operator.inspect(&key).await;
    assert!(
        !matches!(inspected, Ok(None)),
        "inspect on the cut follower said free for a held key"
    );
    let request = lease_core::ForceRelease::new("ops", "cut follower test").unwrap();
    let forced = operator.force_release(&key, &request).await;
    assert!(
        !matches!(forced, Ok(None)),
        "force_release on the cut follower found a held key free"
    );
    ens.heal(follower).await.unwrap();
    assert_eq!(
        holder.inspect(&key).await.unwrap().map(|h| h.token),
        Some(lease.token())
    );
    lease.release().await.unwrap();
}
