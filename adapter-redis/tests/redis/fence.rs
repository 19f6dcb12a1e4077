//! The Redis fence against a real redis-server.

use std::time::Duration;

use lease_core::{Bytes, Coordinator, Error, Fence, Lease, LeaseOptions, ResourceId, Token};

use crate::common::{coordinator, durable, fence, key, server};

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
