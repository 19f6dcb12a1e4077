//! The Redis fence against a real redis-server.

use std::time::Duration;

use adapter_redis::RedisFence;
use conformance_tests::proxy::{sockets_closed, FaultProxy};
use lease_core::{Bytes, Coordinator, Error, Fence, Lease, LeaseOptions, ResourceId, Token};

use crate::common::{coordinator, durable, eventually, fence, key, raw, server};

const SEC: Duration = Duration::from_secs(1);

fn t(n: u64) -> Token {
    Token::new(n).unwrap()
}

#[tokio::test]
async fn fence_accepts_newer_and_equal_rejects_older_and_claims() {
    let Some(srv) = server(
        "fence_accepts_newer_and_equal_rejects_older_and_claims",
        durable(),
    ) else {
        return;
    };
    let f = fence(&srv, "").await;
    let r = ResourceId::from(&key("fence"));
    assert_eq!(f.read(&r).await.unwrap(), None);

    let a = f
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();
    assert_eq!(a.previous, None);
    // An equal token is accepted: one holder writes many times.
    let a = f
        .write(&r, t(5), Bytes::from_static(b"five again"))
        .await
        .unwrap();
    assert_eq!(a.previous, Some(t(5)));
    match f.write(&r, t(4), Bytes::from_static(b"stale")).await {
        Err(Error::Stale {
            presented,
            current,
            resource,
        }) => {
            assert_eq!((presented, current), (t(4), t(5)));
            assert_eq!(resource, r.to_string());
        }
        other => panic!("expected Stale, got {other:?}"),
    }
    // A claim advances without writing and cuts off the older holder.
    assert_eq!(f.claim(&r, t(7)).await.unwrap().previous, Some(t(5)));
    assert_eq!(f.claim(&r, t(7)).await.unwrap().previous, Some(t(7)));
    assert!(matches!(
        f.write(&r, t(6), Bytes::from_static(b"cut off")).await,
        Err(Error::Stale { .. })
    ));
    assert!(matches!(f.claim(&r, t(6)).await, Err(Error::Stale { .. })));
    let v = f.read(&r).await.unwrap().unwrap();
    assert_eq!(v.newest, t(7));
    assert_eq!(v.value, Some((t(5), Bytes::from_static(b"five again"))));

    // Binary values and large tokens round-trip exactly (no floating-point rounding in Lua).
    let big = t(9_007_199_254_740_993); // 2^53 + 1
    let bytes = Bytes::from((0u8..=255).collect::<Vec<u8>>());
    f.write(&r, big, bytes.clone()).await.unwrap();
    assert!(matches!(
        f.write(&r, t(9_007_199_254_740_992), Bytes::new()).await,
        Err(Error::Stale { .. })
    ));
    let v = f.read(&r).await.unwrap().unwrap();
    assert_eq!(v.newest, big);
    assert_eq!(v.value, Some((big, bytes)));

    // Only claims: a newest token and no value.
    let r2 = ResourceId::from(&key("claims-only"));
    f.claim(&r2, t(3)).await.unwrap();
    let v = f.read(&r2).await.unwrap().unwrap();
    assert_eq!((v.newest, v.value), (t(3), None));
}

/// A write the script committed is reported accepted whatever the hash held before: a `newest`
/// written from outside that no token can have (here `!`, which sorts below every digit, so the
/// script takes the write) is left out of the acceptance. Before, the committed write was
/// reported as a bad reply.
#[tokio::test]
async fn a_committed_write_is_accepted_whatever_newest_held_before() {
    let Some(srv) = server(
        "a_committed_write_is_accepted_whatever_newest_held_before",
        durable(),
    ) else {
        return;
    };
    let f = fence(&srv, "").await;
    let r = ResourceId::from(&key("outside-newest"));
    f.claim(&r, t(1)).await.unwrap();
    let mut conn = raw(&srv).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*outside-newest*fence")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let () = redis::cmd("HSET")
        .arg(&keys[0])
        .arg("newest")
        .arg("!")
        .query_async(&mut conn)
        .await
        .unwrap();
    let a = f
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .expect("a committed write is accepted");
    assert_eq!(a.previous, None);
    let v = f.read(&r).await.unwrap().unwrap();
    assert_eq!(v.newest, t(5));
    assert_eq!(v.value, Some((t(5), Bytes::from_static(b"five"))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_holder_is_cut_off_at_the_fence() {
    let Some(srv) = server("a_superseded_holder_is_cut_off_at_the_fence", durable()) else {
        return;
    };
    let c = coordinator(&srv, "").await;
    let f = fence(&srv, "").await;
    let k = key("stale-holder");
    let r = ResourceId::from(&k);
    let old = c
        .try_acquire(&k, &LeaseOptions::new(Duration::from_millis(100)))
        .await
        .unwrap();
    f.write(&r, old.token(), Bytes::from_static(b"old 1"))
        .await
        .unwrap();
    // The old holder stalls past its TTL; a new one takes over and claims the resource.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let new = c
        .try_acquire(&k, &LeaseOptions::new(Duration::from_secs(10)))
        .await
        .unwrap();
    f.claim(&r, new.token()).await.unwrap();
    match f.write(&r, old.token(), Bytes::from_static(b"old 2")).await {
        Err(e @ Error::Stale { .. }) => assert!(e.is_lost()),
        other => panic!("expected Stale, got {other:?}"),
    }
    f.write(&r, new.token(), Bytes::from_static(b"new"))
        .await
        .unwrap();
    let v = f.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value.unwrap().1, Bytes::from_static(b"new"));
    new.release().await.unwrap();
}

/// Defect 8 (Redis): a fence write whose connection drops after the request was sent has an
/// unknown outcome. It must be reported as `OutcomeUnknown` and never re-sent inside the fence:
/// a blind re-send can land after a later write of the same token and undo it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_write_with_unknown_outcome_is_not_retried() {
    let Some(srv) = server("fence_write_with_unknown_outcome_is_not_retried", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let direct = fence(&srv, "").await;
    // Long enough that the drop below, not the timeout, ends the request.
    let via = RedisFence::connect_url(&format!(
        "redis://{}/?request_timeout_ms=5000",
        proxy.addr()
    ))
    .await
    .unwrap();
    let r = ResourceId::from(&key("unknown-outcome"));
    via.write(&r, t(3), Bytes::from_static(b"v0"))
        .await
        .unwrap();

    // v1 reaches the server and applies; its reply is lost.
    proxy.drop_replies();
    let sent = proxy.request_bytes();
    let pending = {
        let (via, r) = (via.clone(), r.clone());
        tokio::spawn(async move { via.write(&r, t(3), Bytes::from_static(b"v1")).await })
    };
    let applied = eventually(5 * SEC, || async {
        let v = direct.read(&r).await.unwrap()?;
        (proxy.request_bytes() > sent && v.value == Some((t(3), Bytes::from_static(b"v1"))))
            .then_some(())
    })
    .await;
    assert!(
        applied.is_some(),
        "the first write never reached the server"
    );
    // The same holder writes again (another connection), and it commits.
    direct
        .write(&r, t(3), Bytes::from_static(b"v2"))
        .await
        .unwrap();
    // Now the first write's connection breaks; the network is fine again at once.
    proxy.cut();
    proxy.heal();
    match tokio::time::timeout(10 * SEC, pending)
        .await
        .unwrap()
        .unwrap()
    {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(
        v.value,
        Some((t(3), Bytes::from_static(b"v2"))),
        "a re-sent v1 replaced the later v2"
    );
    // The fence works again on a fresh connection, and a later write stands.
    via.write(&r, t(3), Bytes::from_static(b"v3"))
        .await
        .unwrap();
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(3), Bytes::from_static(b"v3"))));
}

/// A write whose reply is lost times out as `OutcomeUnknown` (no blind re-send); a later write
/// with the same token stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_write_reply_lost_is_outcome_unknown_and_a_later_write_stands() {
    let Some(srv) = server(
        "fence_write_reply_lost_is_outcome_unknown_and_a_later_write_stands",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let direct = fence(&srv, "").await;
    let via = RedisFence::connect_url(&format!("redis://{}/?request_timeout_ms=500", proxy.addr()))
        .await
        .unwrap();
    let r = ResourceId::from(&key("reply-lost"));
    proxy.drop_replies();
    match via.write(&r, t(4), Bytes::from_static(b"lost reply")).await {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    proxy.heal();
    via.write(&r, t(4), Bytes::from_static(b"later"))
        .await
        .unwrap();
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(4), Bytes::from_static(b"later"))));
}

/// A connection the server closed while idle (a restart, a Sentinel reconfiguring the server,
/// `CLIENT KILL`) is not used for the next write: the write opens a new connection and is
/// accepted. Before, it was sent on the closed connection and reported `OutcomeUnknown`
/// although it had never left the process (the Sentinel cluster's lagging-replica case failed
/// on this in CI: its fence write came after a failover had closed the fence's connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_an_idle_connection_was_closed_goes_on_a_new_one() {
    let Some(srv) = server(
        "a_write_after_an_idle_connection_was_closed_goes_on_a_new_one",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let direct = fence(&srv, "").await;
    let via = RedisFence::connect_url(&format!("redis://{}/", proxy.addr()))
        .await
        .unwrap();
    let r = ResourceId::from(&key("idle-closed"));
    via.write(&r, t(1), Bytes::from_static(b"v1"))
        .await
        .unwrap();
    let sockets = proxy.client_sockets().unwrap();
    assert_eq!(sockets.len(), 1, "one connection to the proxy: {sockets:?}");
    proxy.cut();
    // The condition the write needs: the client has read the reset and closed its end.
    let closed = eventually(10 * SEC, || async {
        sockets_closed(&sockets).unwrap().then_some(())
    })
    .await;
    assert!(
        closed.is_some(),
        "the client never closed the reset connection"
    );
    // A write that cannot be sent twice checks a connection idle for a second or more
    // (`client::IDLE_CHECK`); here it has been idle at least that long.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    via.write(&r, t(2), Bytes::from_static(b"v2"))
        .await
        .expect("the write after the idle connection was closed");
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(2), Bytes::from_static(b"v2"))));
    assert_eq!(proxy.accepted_connections(), 2);
}

/// A write stalled in the network (its connection forwards nothing; new ones pass) is
/// `OutcomeUnknown`, and its connection was ended on the server: the caller's re-read tells the
/// truth, and the write it then makes again under the same token stands. Before, the stalled
/// copy reached the server later and replaced it (as decision 0034 found for PostgreSQL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_write_is_ended_and_never_replaces_a_later_one() {
    let Some(srv) = server("a_stalled_write_is_ended", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let direct = fence(&srv, "").await;
    let via = RedisFence::connect_url(&format!(
        "redis://{}/?request_timeout_ms=1000",
        proxy.addr()
    ))
    .await
    .unwrap();
    let r = ResourceId::from(&key("stalled-write"));
    // A write just before: the script is loaded, and the connection answered less than a second
    // ago, so the stalled write is sent on it without a `PING` first.
    let warm = ResourceId::from(&key("stalled-write-warm-up"));
    via.write(&warm, t(1), Bytes::from_static(b"warm"))
        .await
        .unwrap();
    proxy.stall_open();
    match via.write(&r, t(4), Bytes::from_static(b"stalled")).await {
        Err(Error::OutcomeUnknown { message, .. }) => assert!(
            message.contains("its connection was ended on the server"),
            "{message}"
        ),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // The re-read the error asks for.
    assert_eq!(direct.read(&r).await.unwrap(), None);
    via.write(&r, t(4), Bytes::from_static(b"again"))
        .await
        .unwrap();
    // The proxy delivers what it held once healed, and closes each connection once the server
    // has closed its side (having run what it received on it).
    drop(via);
    proxy.heal();
    let settled = eventually(10 * SEC, || async {
        (proxy.open_connections() == 0).then_some(())
    })
    .await;
    assert!(settled.is_some(), "the proxy's connections never closed");
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(4), Bytes::from_static(b"again"))));
}
