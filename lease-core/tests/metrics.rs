//! Instrumentation: every signal lease-core emits, seen through a `DebuggingRecorder`.
//!
//! The recorder is process-global, so this binary holds exactly one test.

mod common;

use std::time::Duration;

use common::*;
use lease_core::memory::{MemoryCoordinator, MemoryFence};
use lease_core::metrics::*;
use lease_core::{
    bounded, keep, Bytes, Coordinator, Error, Fence, ForceRelease, Instrumented, KeeperOptions,
    Lease, LeaseStatus, LostReason, ResourceId,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// One metric as recorded: name, labels, value.
type Entry = (String, Vec<(String, String)>, DebugValue);

struct Seen(Vec<Entry>);

impl Seen {
    fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a DebugValue> + 'a {
        self.0.iter().filter_map(move |(n, ls, v)| {
            let all = labels
                .iter()
                .all(|(k, val)| ls.iter().any(|(lk, lv)| lk == k && lv == val));
            (n == name && all).then_some(v)
        })
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.matching(name, labels)
            .map(|v| match v {
                DebugValue::Counter(c) => *c,
                other => panic!("{name} is not a counter: {other:?}"),
            })
            .sum()
    }

    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.matching(name, labels)
            .flat_map(|v| match v {
                DebugValue::Histogram(h) => h.iter().map(|x| x.into_inner()).collect::<Vec<_>>(),
                other => panic!("{name} is not a histogram: {other:?}"),
            })
            .collect()
    }
}

#[test]
fn instrumented_backends_keeper_and_sections_emit_every_signal() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder in this binary");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(scenario());

    let seen = Seen(
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(ck, _, _, v)| {
                let k = ck.key();
                let labels = k
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                (k.name().to_owned(), labels, v)
            })
            .collect(),
    );
    let m = [("backend", "memory")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = m.to_vec();
        v.extend_from_slice(extra);
        v
    };

    // Acquisitions by mode and outcome.
    assert_eq!(
        seen.counter(
            ACQUIRE_TOTAL,
            &with(&[("mode", "try"), ("outcome", "acquired")])
        ),
        6
    );
    assert_eq!(
        seen.counter(
            ACQUIRE_TOTAL,
            &with(&[("mode", "try"), ("outcome", "held")])
        ),
        1
    );
    assert_eq!(
        seen.counter(
            ACQUIRE_TOTAL,
            &with(&[("mode", "wait"), ("outcome", "timeout")])
        ),
        1
    );
    assert_eq!(
        seen.counter(
            ACQUIRE_TOTAL,
            &with(&[("mode", "wait"), ("outcome", "acquired")])
        ),
        1
    );
    assert_eq!(
        seen.counter(
            ACQUIRE_TOTAL,
            &with(&[("mode", "try"), ("outcome", "invalid_input")])
        ),
        1
    );
    // Wait time, in seconds of (paused) time.
    assert_eq!(
        seen.histogram(
            ACQUIRE_WAIT_SECONDS,
            &with(&[("mode", "wait"), ("outcome", "timeout")])
        ),
        vec![5.0]
    );
    assert_eq!(
        seen.histogram(
            ACQUIRE_WAIT_SECONDS,
            &with(&[("mode", "wait"), ("outcome", "acquired")])
        ),
        vec![2.0]
    );

    // Renewals: three by the keeper (at 1 s, 2 s, 3 s) through the instrumented lease, plus one
    // refused by hand after the revocation.
    assert_eq!(
        seen.histogram(RENEW_SECONDS, &with(&[("outcome", "renewed")])),
        vec![0.0; 3]
    );
    assert_eq!(
        seen.histogram(RENEW_SECONDS, &with(&[("outcome", "lost")]))
            .len(),
        1
    );
    assert_eq!(
        seen.counter(RENEW_FAILURES_TOTAL, &with(&[("outcome", "lost")])),
        1
    );
    assert_eq!(
        seen.counter(RELEASE_TOTAL, &with(&[("outcome", "released")])),
        2
    );
    assert_eq!(
        seen.counter(RELEASE_TOTAL, &with(&[("outcome", "lost")])),
        1
    );

    // Losses by reason (a plain release is not a loss).
    assert_eq!(seen.counter(LOST_TOTAL, &with(&[("reason", "revoked")])), 2);
    assert_eq!(seen.counter(LOST_TOTAL, &with(&[("reason", "expired")])), 1);
    assert_eq!(
        seen.counter(LOST_TOTAL, &with(&[("reason", "keeper_stopped")])),
        1
    );
    assert_eq!(
        seen.counter(LOST_TOTAL, &with(&[("reason", "released")])),
        0
    );

    // The fence.
    assert_eq!(
        seen.counter(STALE_REJECTED_TOTAL, &with(&[("op", "write")])),
        1
    );
    assert_eq!(
        seen.counter(STALE_REJECTED_TOTAL, &with(&[("op", "claim")])),
        1
    );
    assert_eq!(
        seen.counter(
            FENCE_WRITES_TOTAL,
            &with(&[("op", "write"), ("outcome", "accepted")])
        ),
        2
    );
    assert_eq!(
        seen.counter(
            FENCE_WRITES_TOTAL,
            &with(&[("op", "claim"), ("outcome", "accepted")])
        ),
        1
    );

    // Critical sections and work after loss.
    assert_eq!(
        seen.histogram(CRITICAL_SECTION_SECONDS, &[("outcome", "completed")]),
        vec![1.0]
    );
    assert_eq!(
        seen.histogram(CRITICAL_SECTION_SECONDS, &[("outcome", "lost")]),
        vec![0.5]
    );
    assert_eq!(seen.counter(WORK_AFTER_LOSS_TOTAL, &[]), 1);

    // Operator force-releases.
    assert_eq!(seen.counter(FORCED_RELEASES_TOTAL, &m), 2);
}

async fn scenario() {
    let coord = Instrumented::new(MemoryCoordinator::new());
    let fence = Instrumented::new(MemoryFence::new());
    let (k1, k2, k3, k4) = (key("m/1"), key("m/2"), key("m/3"), key("m/4"));

    // try: acquired, held, invalid input.
    let l1 = coord.try_acquire(&k1, &exact(secs(3600))).await.unwrap();
    assert!(matches!(
        coord.try_acquire(&k1, &exact(secs(1))).await,
        Err(Error::Held { .. })
    ));
    assert!(coord
        .try_acquire(&k1, &exact(Duration::ZERO))
        .await
        .is_err());
    // wait: timeout after 5 s.
    assert!(matches!(
        coord.acquire(&k1, &exact(secs(1)).wait(secs(5))).await,
        Err(Error::Timeout { .. })
    ));
    // wait: acquired after 2 s (l1 released by a task).
    let coord2 = coord.clone();
    let releaser = tokio::spawn(async move {
        tokio::time::sleep(secs(2)).await;
        l1.release().await.unwrap();
        coord2
    });
    let l1b = coord
        .acquire(&k1, &exact(secs(3600)).wait(secs(60)))
        .await
        .unwrap();
    releaser.await.unwrap();
    drop(l1b);

    // Keeper renewing an instrumented lease, and a section that completes.
    let l2 = coord.try_acquire(&k2, &exact(secs(3))).await.unwrap();
    let kept = keep(l2, KeeperOptions::new()).unwrap();
    let out = bounded(kept.lease(), async {
        tokio::time::sleep(secs(1)).await;
        7
    })
    .await
    .unwrap();
    assert_eq!(out, 7);
    tokio::time::sleep(ms(2500)).await; // t = 3.5 s after the keeper started: 3 renewals
    let removed = coord
        .force_release(&k2, &ForceRelease::new("alice", "drill").unwrap())
        .await
        .unwrap();
    assert!(removed.is_some());
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::Revoked)
    );
    assert!(matches!(
        kept.lease().renew().await,
        Err(Error::Lost { .. })
    ));
    assert!(matches!(kept.release().await, Err(Error::Lost { .. })));

    // A section whose work loses its lease (a force-release) and then finishes.
    let l3 = coord.try_acquire(&k3, &exact(secs(60))).await.unwrap();
    let r = bounded(&*l3, async {
        tokio::time::sleep(ms(500)).await;
        coord
            .force_release(&k3, &ForceRelease::new("bob", "again").unwrap())
            .await
            .unwrap();
        1
    })
    .await;
    assert!(matches!(r, Err(Error::Lost { .. })));

    // An expiry, and a keeper that stops for lack of progress.
    let l4 = coord.try_acquire(&k4, &exact(secs(1))).await.unwrap();
    tokio::time::sleep(secs(1)).await;
    assert_eq!(l4.status(), LeaseStatus::Lost(LostReason::Expired));
    drop(l4);
    let l4b = coord
        .try_acquire(&k4, &lease_core::LeaseOptions::new(secs(3)))
        .await
        .unwrap();
    let kept = keep(l4b, KeeperOptions::new().require_progress(true)).unwrap();
    tokio::time::sleep(secs(4)).await;
    assert_eq!(
        kept.lease().status(),
        LeaseStatus::Lost(LostReason::KeeperStopped)
    );
    drop(kept);

    // A plain release.
    let l5 = coord.try_acquire(&k1, &exact(secs(5))).await.unwrap();
    l5.release().await.unwrap();

    // The fence: accepted write and claim, stale write and claim.
    let r = ResourceId::from(&k1);
    fence
        .write(&r, tok(1), Bytes::from_static(b"a"))
        .await
        .unwrap();
    fence.claim(&r, tok(3)).await.unwrap();
    fence
        .write(&r, tok(3), Bytes::from_static(b"b"))
        .await
        .unwrap();
    assert!(matches!(
        fence.write(&r, tok(2), Bytes::from_static(b"late")).await,
        Err(Error::Stale { .. })
    ));
    assert!(matches!(
        fence.claim(&r, tok(1)).await,
        Err(Error::Stale { .. })
    ));
}
