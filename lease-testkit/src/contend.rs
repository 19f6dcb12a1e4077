//! Many tasks of one coordinator taking and releasing a few shared locks at once, checking the
//! two promises a lock makes under that load: at most one holder of a key at a time, and each
//! holder's token above the one before it.
//!
//! Adapters that send requests together under load (etcd's nested transactions, ZooKeeper's
//! multis) use it to show that going together never lets two holders in.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lease_core::{Coordinator, Error, LeaseOptions, LockKey};

/// How long a waiting task of [`contend_on_shared_keys`] waits for its turn.
pub const CONTEND_WAIT: Duration = Duration::from_secs(30);

/// Runs `tasks` tasks for `rounds` rounds each on `coordinator`: in round `r` task `t` takes key
/// `(t + r) % keys.len()` (every third task with a waiting `acquire` of up to [`CONTEND_WAIT`],
/// the others with `try_acquire`, which may find it held and skip the round), yields while
/// holding, and releases.
///
/// Panics when a key has two holders at once, a granted token is not above the previous
/// holder's, a call fails otherwise than `Held`, or a key is still held at the end. Returns the
/// number of leases granted (and released).
pub async fn contend_on_shared_keys(
    coordinator: Arc<dyn Coordinator>,
    keys: &[LockKey],
    tasks: usize,
    rounds: usize,
    ttl: Duration,
) -> u64 {
    let n = keys.len();
    assert!(n > 0, "no keys to contend on");
    let keys: Arc<Vec<LockKey>> = Arc::new(keys.to_vec());
    let holders: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
    let last_token: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let granted = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (c, keys, holders, last_token, granted) = (
                coordinator.clone(),
                keys.clone(),
                holders.clone(),
                last_token.clone(),
                granted.clone(),
            );
            tokio::spawn(async move {
                let o = LeaseOptions::new(ttl);
                for r in 0..rounds {
                    let i = (t + r) % keys.len();
                    let k = &keys[i];
                    let lease = if t % 3 == 0 {
                        c.acquire(k, &o.clone().wait(CONTEND_WAIT)).await
                    } else {
                        c.try_acquire(k, &o).await
                    };
                    let lease = match lease {
                        Ok(l) => l,
                        Err(Error::Held { .. }) => continue,
                        Err(e) => panic!("task {t} round {r} on {k}: {e}"),
                    };
                    assert_eq!(
                        holders[i].fetch_add(1, Ordering::SeqCst),
                        0,
                        "two holders of {k}"
                    );
                    let token = lease.token().get();
                    let before = last_token[i].swap(token, Ordering::SeqCst);
                    assert!(token > before, "{k}: token {token} after {before}");
                    tokio::task::yield_now().await;
                    holders[i].fetch_sub(1, Ordering::SeqCst);
                    lease.release().await.unwrap();
                    granted.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    for k in keys.iter() {
        assert!(
            coordinator.inspect(k).await.unwrap().is_none(),
            "{k} is still held after every task released it"
        );
    }
    granted.load(Ordering::SeqCst)
}

/// Checks that two coordinators on the same backend and key prefix (for example one made with
/// `from_client` on the application's own client and one from the URL) share their locks: a
/// lease `first` holds on `key` keeps `second`'s `try_acquire` out (`Held`), and once released,
/// `second` takes the key with a higher token. Leaves the key free.
///
/// Panics otherwise.
pub async fn one_holder_across(
    first: &dyn Coordinator,
    second: &dyn Coordinator,
    key: &LockKey,
    options: &LeaseOptions,
) {
    let held = first
        .try_acquire(key, options)
        .await
        .expect("first acquire");
    match second.try_acquire(key, options).await {
        Err(Error::Held { .. }) => {}
        other => panic!("{key} held through the first coordinator, the second got {other:?}"),
    }
    held.release().await.expect("first release");
    let next = second
        .try_acquire(key, options)
        .await
        .expect("second acquire after the release");
    assert!(
        next.token() > held.token(),
        "token {} after {}",
        next.token(),
        held.token()
    );
    next.release().await.expect("second release");
}

/// Sends one `try_acquire` per `(key, options)` through `coordinator`, all at once, and returns
/// each call's outcome (its token when granted) with how long after their common start it
/// returned, in the order given. For tests that bound every call of a burst: with the backend
/// unreachable, the calls share one attempt to open a connection or session and its failure
/// ([`SharedOpening`](lease_core::adapter::SharedOpening)), rather than queue behind each
/// other's.
pub async fn concurrent_try_acquires(
    coordinator: Arc<dyn Coordinator>,
    calls: Vec<(LockKey, LeaseOptions)>,
) -> Vec<(lease_core::Result<lease_core::Token>, Duration)> {
    let started = tokio::time::Instant::now();
    let handles: Vec<_> = calls
        .into_iter()
        .map(|(key, options)| {
            let c = coordinator.clone();
            tokio::spawn(async move {
                let r = c.try_acquire(&key, &options).await;
                (r.map(|l| l.token()), started.elapsed())
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(handles.len());
    for h in handles {
        outcomes.push(h.await.expect("a try_acquire task panicked"));
    }
    outcomes
}
