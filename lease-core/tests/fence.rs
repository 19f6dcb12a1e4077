//! The in-memory fence, alone and together with the in-memory coordinator.

mod common;

use std::sync::Arc;

use common::*;
use lease_core::memory::{FenceEvent, MemoryCoordinator, MemoryFence};
use lease_core::{
    Accepted, Bytes, Coordinator, Error, Fence, FencedValue, Lease, ResourceId, Token,
};

fn res(s: &str) -> ResourceId {
    s.parse().unwrap()
}

fn stale(r: lease_core::Result<Accepted>) -> (String, Token, Token) {
    match r {
        Err(Error::Stale {
            resource,
            presented,
            current,
        }) => (resource, presented, current),
        other => panic!("expected Stale, got {other:?}"),
    }
}

#[tokio::test]
async fn equal_token_is_accepted_older_is_stale() {
    let f = MemoryFence::new();
    let r = res("accounts/1");
    assert_eq!(f.read(&r).await.unwrap(), None);

    let a = f
        .write(&r, tok(5), Bytes::from_static(b"v1"))
        .await
        .unwrap();
    assert_eq!(a.previous, None);
    // One holder writes many times with the same token.
    let a = f
        .write(&r, tok(5), Bytes::from_static(b"v2"))
        .await
        .unwrap();
    assert_eq!(a.previous, Some(tok(5)));

    let (name, presented, current) = stale(f.write(&r, tok(4), Bytes::from_static(b"old")).await);
    assert_eq!(
        (name.as_str(), presented, current),
        ("accounts/1", tok(4), tok(5))
    );
    let (_, presented, current) = stale(f.claim(&r, tok(1)).await);
    assert_eq!((presented, current), (tok(1), tok(5)));
    let e = f.write(&r, Token::ZERO, Bytes::new()).await.unwrap_err();
    assert!(e.is_lost() && !e.is_retryable(), "{e}");

    // Rejections changed nothing.
    assert_eq!(
        f.read(&r).await.unwrap(),
        Some(FencedValue::new(
            tok(5),
            Some((tok(5), Bytes::from_static(b"v2")))
        ))
    );

    // A newer token is accepted and becomes the floor.
    let a = f
        .write(&r, tok(9), Bytes::from_static(b"v3"))
        .await
        .unwrap();
    assert_eq!(a.previous, Some(tok(5)));
    let (_, presented, current) = stale(f.write(&r, tok(5), Bytes::from_static(b"x")).await);
    assert_eq!((presented, current), (tok(5), tok(9)));
}

#[tokio::test]
async fn claim_advances_without_writing() {
    let f = MemoryFence::new();
    let r = res("r");
    f.write(&r, tok(1), Bytes::from_static(b"first"))
        .await
        .unwrap();
    let a = f.claim(&r, tok(2)).await.unwrap();
    assert_eq!(a.previous, Some(tok(1)));
    let v = f.read(&r).await.unwrap().unwrap();
    assert_eq!(v.newest, tok(2));
    assert_eq!(v.value, Some((tok(1), Bytes::from_static(b"first"))));

    // The old holder is cut off by the claim alone.
    let (_, presented, current) = stale(f.write(&r, tok(1), Bytes::from_static(b"late")).await);
    assert_eq!((presented, current), (tok(1), tok(2)));
    assert_eq!(
        f.read(&r).await.unwrap().unwrap().value,
        Some((tok(1), Bytes::from_static(b"first")))
    );
    // The claimer may claim again and write with its token.
    f.claim(&r, tok(2)).await.unwrap();
    f.write(&r, tok(2), Bytes::from_static(b"second"))
        .await
        .unwrap();
    assert_eq!(
        f.read(&r).await.unwrap(),
        Some(FencedValue::new(
            tok(2),
            Some((tok(2), Bytes::from_static(b"second")))
        ))
    );

    // A claim on a fresh resource: newest set, no value.
    let fresh = res("fresh");
    assert_eq!(f.claim(&fresh, tok(3)).await.unwrap().previous, None);
    assert_eq!(
        f.read(&fresh).await.unwrap(),
        Some(FencedValue::new(tok(3), None))
    );
}

#[tokio::test]
async fn resources_are_independent() {
    let f = MemoryFence::new();
    let (a, ab, b) = (res("a"), res("a/b"), res("b"));
    f.write(&a, tok(100), Bytes::from_static(b"a"))
        .await
        .unwrap();
    // A high token on `a` does not fence `a/b` or `b`.
    f.write(&ab, tok(1), Bytes::from_static(b"ab"))
        .await
        .unwrap();
    f.claim(&b, tok(2)).await.unwrap();
    assert_eq!(f.read(&a).await.unwrap().unwrap().newest, tok(100));
    assert_eq!(f.read(&ab).await.unwrap().unwrap().newest, tok(1));
    assert_eq!(f.read(&b).await.unwrap().unwrap().newest, tok(2));
    stale(f.write(&b, tok(1), Bytes::new()).await);
    // ... and the rejection on `b` did not touch `a/b`.
    f.write(&ab, tok(1), Bytes::from_static(b"ab2"))
        .await
        .unwrap();
}

#[tokio::test]
async fn history_records_accepted_operations_in_order() {
    let f = MemoryFence::new();
    let (r1, r2) = (res("r1"), res("r2"));
    f.write(&r1, tok(1), Bytes::from_static(b"x"))
        .await
        .unwrap();
    f.claim(&r2, tok(4)).await.unwrap();
    f.claim(&r1, tok(2)).await.unwrap();
    let _ = f.write(&r1, tok(1), Bytes::from_static(b"rejected")).await;
    let _ = f.claim(&r2, tok(3)).await;
    f.write(&r1, tok(2), Bytes::from_static(b"y"))
        .await
        .unwrap();
    let want = vec![
        FenceEvent::Write {
            resource: r1.clone(),
            token: tok(1),
            value: Bytes::from_static(b"x"),
        },
        FenceEvent::Claim {
            resource: r2.clone(),
            token: tok(4),
        },
        FenceEvent::Claim {
            resource: r1.clone(),
            token: tok(2),
        },
        FenceEvent::Write {
            resource: r1.clone(),
            token: tok(2),
            value: Bytes::from_static(b"y"),
        },
    ];
    assert_eq!(f.history(), want);
    // Clones share the store.
    let g = f.clone();
    g.claim(&r2, tok(5)).await.unwrap();
    assert_eq!(f.history().len(), 5);
    assert_eq!(f.forgotten(), 0);
}

#[tokio::test]
async fn the_history_keeps_the_newest_operations_and_counts_the_rest() {
    let f = MemoryFence::with_history_limit(3);
    let r = res("bounded");
    for t in 1..=5 {
        f.write(&r, tok(t), Bytes::from(format!("v{t}")))
            .await
            .unwrap();
    }
    let tokens: Vec<u64> = f
        .history()
        .into_iter()
        .map(|e| match e {
            FenceEvent::Write { token, .. } => token.get(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(tokens, [3, 4, 5]);
    assert_eq!(f.forgotten(), 2);
    // The fence itself forgets nothing: an older token is still refused.
    assert!(matches!(
        f.write(&r, tok(2), Bytes::new()).await,
        Err(Error::Stale { .. })
    ));
    let none = MemoryFence::with_history_limit(0);
    none.claim(&r, tok(1)).await.unwrap();
    assert_eq!((none.history().len(), none.forgotten()), (0, 1));
}

#[test]
fn concurrent_writers_cannot_lower_the_fence() {
    // Many tasks on a multi-thread runtime racing writes with random tokens: the accepted tokens
    // per resource never decrease and each rejection names a current token above the presented.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    rt.block_on(async {
        let f = Arc::new(MemoryFence::new());
        let r = res("shared");
        let mut tasks = Vec::new();
        for w in 0..8u64 {
            let (f, r) = (f.clone(), r.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..200u64 {
                    let t = tok((i * 7 + w * 13) % 50 + 1);
                    match f.write(&r, t, Bytes::from(format!("{w}:{i}"))).await {
                        Ok(_) => {}
                        Err(Error::Stale {
                            presented, current, ..
                        }) => assert!(presented < current),
                        Err(e) => panic!("{e}"),
                    }
                    tokio::task::yield_now().await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(f.forgotten(), 0, "the history below is whole");
        let tokens: Vec<Token> = f
            .history()
            .into_iter()
            .map(|e| match e {
                FenceEvent::Write { token, .. } | FenceEvent::Claim { token, .. } => token,
                _ => unreachable!(),
            })
            .collect();
        assert!(!tokens.is_empty());
        assert!(tokens.windows(2).all(|w| w[0] <= w[1]), "{tokens:?}");
        let last = f.read(&r).await.unwrap().unwrap();
        assert_eq!(last.newest, *tokens.last().unwrap());
    });
}

#[tokio::test(start_paused = true)]
async fn a_paused_holder_is_fenced_off_after_takeover_and_claim() {
    let c = MemoryCoordinator::new();
    let f: Arc<dyn Fence> = Arc::new(MemoryFence::new());
    assert_eq!(f.backend(), "memory");
    let k = key("orders/42");
    let r = ResourceId::from(&k);
    let old = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    f.write(&r, old.token(), Bytes::from_static(b"old-1"))
        .await
        .unwrap();

    // The old holder "pauses" past its TTL; a new holder takes over and claims before reading.
    tokio::time::advance(secs(11)).await;
    let new = c.try_acquire(&k, &exact(secs(10))).await.unwrap();
    assert!(new.token() > old.token());
    f.claim(&r, new.token()).await.unwrap();
    let seen = f.read(&r).await.unwrap().unwrap();
    assert_eq!(
        seen.value,
        Some((old.token(), Bytes::from_static(b"old-1")))
    );

    // The old holder resumes and writes: rejected.
    let (_, presented, current) =
        stale(f.write(&r, old.token(), Bytes::from_static(b"old-2")).await);
    assert_eq!((presented, current), (old.token(), new.token()));
    f.write(&r, new.token(), Bytes::from_static(b"new-1"))
        .await
        .unwrap();
    assert_eq!(
        f.read(&r).await.unwrap().unwrap().value,
        Some((new.token(), Bytes::from_static(b"new-1")))
    );
}
