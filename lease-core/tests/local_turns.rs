//! The waiting acquires of one coordinator built with `coordinator_from_primitives!` take turns
//! per key: only one asks the backend at a time (no herd), in arrival order (a task that
//! releases and acquires again does not overtake a waiter), the time in line counts against the
//! wait bound, and bad input is refused before any turn. Checked on an adapter whose primitives
//! are the memory backend's, counting every call that would reach a server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lease_core::adapter::{Cleanups, LocalWaiters};
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    AuditRecord, Capabilities, Coordinator, Error, ForceRelease, HolderInfo, Lease, LeaseOptions,
    LockKey, Result,
};

/// An adapter whose "server" is a memory coordinator; counts the acquire calls that reach it.
#[derive(Debug)]
struct Counted {
    server: MemoryCoordinator,
    waiters: LocalWaiters,
    /// Calls of `acquire_for` with `wait`, running now.
    asking: AtomicUsize,
    /// The most of those running at once.
    most_asking: AtomicUsize,
    /// None begun: the memory backend cleans up as it goes.
    cleanups: Cleanups,
}

impl Counted {
    fn new() -> Self {
        Counted {
            server: MemoryCoordinator::new(),
            waiters: LocalWaiters::default(),
            asking: AtomicUsize::new(0),
            most_asking: AtomicUsize::new(0),
            cleanups: Cleanups::new(),
        }
    }
    fn caps(&self) -> &Capabilities {
        self.server.capabilities()
    }
    fn local_waiters(&self) -> Option<&LocalWaiters> {
        Some(&self.waiters)
    }
    fn cleanups(&self) -> &Cleanups {
        &self.cleanups
    }
    async fn acquire_for(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Box<dyn Lease>> {
        let Some(wait) = wait else {
            return self.server.try_acquire(key, options).await;
        };
        let now = self.asking.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_asking.fetch_max(now, Ordering::SeqCst);
        let r = self.server.acquire(key, &options.clone().wait(wait)).await;
        self.asking.fetch_sub(1, Ordering::SeqCst);
        r
    }
    async fn inspect_key(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.server.inspect(key).await
    }
    async fn force_release_key(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        self.server.force_release(key, request).await
    }
    async fn audit_trail_of(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
        self.server.audit_trail(key, limit).await
    }
}

lease_core::coordinator_from_primitives!(Counted);

fn key() -> LockKey {
    LockKey::new("orders/7").unwrap()
}

fn opts() -> LeaseOptions {
    LeaseOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(30))
}

/// Polls `fut` once (so it takes its place in line), then runs it to the end in a task.
async fn enter<F>(fut: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut fut = Box::pin(fut);
    assert!(
        futures::poll!(&mut fut).is_pending(),
        "the key is held: a waiter cannot finish at once"
    );
    tokio::spawn(fut)
}

#[tokio::test]
async fn one_waiter_asks_at_a_time_and_turns_come_in_arrival_order() {
    let c = Arc::new(Counted::new());
    let holder = c.try_acquire(&key(), &opts()).await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for i in 0..5 {
        let (c, order) = (c.clone(), order.clone());
        waiters.push(
            enter(async move {
                let lease = c.acquire(&key(), &opts()).await.unwrap();
                order.lock().unwrap().push(i);
                // Held a moment, so the next in line would overlap if it were not waiting.
                tokio::task::yield_now().await;
                lease.release().await.unwrap();
            })
            .await,
        );
    }
    assert_eq!(c.asking.load(Ordering::SeqCst), 1, "only the first asks");
    holder.release().await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(
        c.most_asking.load(Ordering::SeqCst),
        1,
        "never two asking at once"
    );
    assert_eq!(c.waiters.waiting_keys(), 0, "no line is left behind");
}

#[tokio::test]
async fn a_releasing_task_that_acquires_again_queues_behind_the_waiter() {
    let c = Arc::new(Counted::new());
    let first = c.acquire(&key(), &opts()).await.unwrap();
    let waiter = {
        let c = c.clone();
        enter(async move { c.acquire(&key(), &opts()).await.unwrap().token() }).await
    };
    first.release().await.unwrap();
    // At once again, as a loop would: in line behind the waiter, not ahead of it.
    let again = {
        let c = c.clone();
        enter(async move { c.acquire(&key(), &opts()).await.unwrap().token() }).await
    };
    let waiter_token = waiter.await.unwrap();
    assert!(again.await.unwrap() > waiter_token, "the waiter went first");
}

#[tokio::test]
async fn time_in_line_counts_against_the_wait_bound() {
    let c = Arc::new(Counted::new());
    let _holder = c.try_acquire(&key(), &opts()).await.unwrap();
    let _first = {
        let c = c.clone();
        enter(async move { c.acquire(&key(), &opts()).await }).await
    };
    let start = tokio::time::Instant::now();
    let bound = Duration::from_millis(200);
    let e = c
        .acquire(&key(), &opts().wait(bound))
        .await
        .expect_err("the key stays held");
    assert!(
        matches!(&e, Error::Timeout { key, .. } if key == "orders/7"),
        "{e:?}"
    );
    let took = start.elapsed();
    assert!(took >= bound && took < bound * 10, "took {took:?}");
}

#[tokio::test]
async fn bad_input_is_refused_before_any_turn() {
    let c = Arc::new(Counted::new());
    let _holder = c.try_acquire(&key(), &opts()).await.unwrap();
    let _first = {
        let c = c.clone();
        enter(async move { c.acquire(&key(), &opts()).await }).await
    };
    let bad = LeaseOptions::new(Duration::ZERO).wait(Duration::from_secs(30));
    let e = tokio::time::timeout(Duration::from_secs(5), c.acquire(&key(), &bad))
        .await
        .expect("refused at once, not after the line");
    assert!(matches!(e, Err(Error::InvalidInput(_))), "{:?}", e.err());
}

#[tokio::test]
async fn a_timeout_after_the_line_reports_the_whole_wait() {
    let c = Arc::new(Counted::new());
    let _holder = c.try_acquire(&key(), &opts()).await.unwrap();
    // The first waiter gives up at the backend after 100 ms, handing the turn on.
    let first = {
        let c = c.clone();
        enter(async move {
            c.acquire(&key(), &opts().wait(Duration::from_millis(100)))
                .await
        })
        .await
    };
    let bound = Duration::from_millis(300);
    let start = tokio::time::Instant::now();
    let e = c
        .acquire(&key(), &opts().wait(bound))
        .await
        .expect_err("the key stays held");
    assert!(first.await.unwrap().is_err());
    match e {
        Error::Timeout { waited, .. } => assert!(
            waited >= bound && waited <= start.elapsed(),
            "waited {waited:?}: the time in line and at the backend, {bound:?} or more"
        ),
        other => panic!("expected Timeout, got {other:?}"),
    }
}
