//! The ZooKeeper adapter with several servers: connecting while no server serves (within the
//! connect timeout), the session cap that covers a follower's session-touch lag (`tick_ms`),
//! and, against a three-server ensemble the conformance harness runs, a session that moves to
//! another server when its server dies or is cut from clients, and a holder whose follower is
//! cut from its peers right after answering its sync (`follower_cut_after_sync`). Without a JVM
//! or the ZooKeeper jars each test is a named skip (a failure under `CI=true`).

use std::time::Duration;

use adapter_zookeeper::{ZkConfig, ZkCoordinator};
use conformance_tests::harness::zookeeper_ensemble::{MemberState, ZooKeeperEnsemble};
use conformance_tests::harness::{
    server_unavailable, start_or_skip_async, Backend, ClusterControl, ZooKeeperServer,
};
use conformance_tests::proxy::FaultProxy;
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
        let drift = lease_core::clock::default_drift_margin(ttl);
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
        // The heartbeat keeps it held on its own.
        tokio::time::sleep(t).await;
        assert_eq!(lease.status(), LeaseStatus::Held, "{params}");
        lease.release().await.unwrap();
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
