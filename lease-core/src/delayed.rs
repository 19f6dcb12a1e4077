//! [`DelayedStarts`]: a lease's background task started only if the lease outlives its first
//! moment.
//!
//! An adapter whose lease needs a task of its own (a monitor that watches the key, a guardian
//! that deletes it when the lease ends without a release) pays for that task at every grant: a
//! spawn, a timer, and at the release a wake-up of the task on another worker thread. Under
//! load most leases are released within a millisecond (measured with lease-bench: sequential
//! ZooKeeper pairs took 25-30 µs longer with the monitor task than without it, most of it in the
//! release). [`DelayedStarts`] queues each lease's start instead and runs it on one task per
//! queue, `delay` after the grant: a lease released by then needs no task at all, and a stream of
//! grants wakes that one task at most once per `batch`.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

type Start = Box<dyn FnOnce() + Send>;

struct Shared {
    delay: Duration,
    batch: Duration,
    queue: Mutex<VecDeque<(Instant, Start)>>,
    /// Woken when the queue stops being empty, and when the owner is dropped.
    wake: Notify,
    closed: AtomicBool,
    /// The task running the queue, once started (again if it went with its runtime).
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, VecDeque<(Instant, Start)>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs each queued start `delay` after it was queued (or up to `batch` earlier, together with
/// the starts due before then), in queue order, on one background task.
///
/// A start is a plain closure run on that task: it looks at the lease and either spawns the
/// lease's task or, when the lease has already ended cleanly, does what that task would have
/// done at its end (for example forget the lease in a registry). It must not block.
///
/// Dropping the `DelayedStarts` runs the starts still queued at once (their leases may live on);
/// the task then ends. Outside a tokio runtime a start runs at once, where it is queued.
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use lease_core::adapter::DelayedStarts;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let starts = DelayedStarts::new(Duration::from_millis(20), Duration::from_millis(10));
/// let released = Arc::new(AtomicBool::new(false));
/// let ran = Arc::new(AtomicBool::new(false));
/// let (r, seen) = (released.clone(), ran.clone());
/// starts.push(move || {
///     // Spawn the lease's monitor here, unless the lease was released meanwhile.
///     seen.store(!r.load(Ordering::SeqCst), Ordering::SeqCst);
/// });
/// released.store(true, Ordering::SeqCst); // released within the delay
/// tokio::time::sleep(Duration::from_millis(40)).await;
/// assert!(!ran.load(Ordering::SeqCst));
/// # }
/// ```
pub struct DelayedStarts {
    shared: Arc<Shared>,
}

impl fmt::Debug for DelayedStarts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DelayedStarts")
            .field("delay", &self.shared.delay)
            .field("batch", &self.shared.batch)
            .field("queued", &self.shared.queue().len())
            .finish()
    }
}

impl DelayedStarts {
    /// A queue whose starts run `delay` after they are queued, a start due within `batch` of an
    /// earlier one together with it (`batch` is capped at `delay`). The task is spawned on the
    /// current runtime with the first start.
    pub fn new(delay: Duration, batch: Duration) -> Self {
        DelayedStarts {
            shared: Arc::new(Shared {
                delay,
                batch: batch.min(delay),
                queue: Mutex::new(VecDeque::new()),
                wake: Notify::new(),
                closed: AtomicBool::new(false),
                task: Mutex::new(None),
            }),
        }
    }

    /// The delay after which a queued start runs.
    pub fn delay(&self) -> Duration {
        self.shared.delay
    }

    /// Queues `start`, to run `delay` from now on the queue's task.
    pub fn push(&self, start: impl FnOnce() + Send + 'static) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            start();
            return;
        };
        let was_empty = {
            let mut queue = self.shared.queue();
            let was_empty = queue.is_empty();
            queue.push_back((Instant::now() + self.shared.delay, Box::new(start)));
            was_empty
        };
        {
            let mut task = self.shared.task.lock().unwrap_or_else(|p| p.into_inner());
            // First use, or the task went with the runtime it ran on (what that runtime had
            // queued runs on this one).
            if task.as_ref().is_none_or(|t| t.is_finished()) {
                *task = Some(runtime.spawn(run(self.shared.clone())));
            }
        }
        if was_empty {
            self.shared.wake.notify_one();
        }
    }
}

impl Drop for DelayedStarts {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::Release);
        self.shared.wake.notify_one();
    }
}

async fn run(shared: Arc<Shared>) {
    loop {
        let first = shared.queue().front().map(|(due, _)| *due);
        match first {
            None if shared.closed.load(Ordering::Acquire) => return,
            None => shared.wake.notified().await,
            Some(due) => {
                if !shared.closed.load(Ordering::Acquire) {
                    tokio::select! {
                        _ = tokio::time::sleep_until(due) => {}
                        // Closed meanwhile: run what is queued now.
                        _ = shared.wake.notified() => {}
                    }
                }
                let closed = shared.closed.load(Ordering::Acquire);
                let until = Instant::now() + shared.batch;
                let ready: Vec<Start> = {
                    let mut queue = shared.queue();
                    let mut ready = Vec::new();
                    while let Some((due, _)) = queue.front() {
                        if !closed && *due > until {
                            break;
                        }
                        ready.extend(queue.pop_front().map(|(_, start)| start));
                    }
                    ready
                };
                for start in ready {
                    start();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn counter() -> (Arc<AtomicUsize>, impl Fn() -> Box<dyn FnOnce() + Send>) {
        let n = Arc::new(AtomicUsize::new(0));
        let m = n.clone();
        (n, move || {
            let m = m.clone();
            Box::new(move || {
                m.fetch_add(1, Ordering::SeqCst);
            })
        })
    }

    /// A runtime that shuts down takes the queue's task with it; a start pushed from another
    /// runtime starts a new one, and runs.
    #[test]
    fn the_task_starts_again_on_another_runtime() {
        let starts = DelayedStarts::new(Duration::from_millis(1), Duration::ZERO);
        let (ran, start) = counter();
        for round in 1..=3 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            runtime.block_on(async {
                starts.push(start());
                let deadline = Instant::now() + Duration::from_secs(30);
                while ran.load(Ordering::SeqCst) < round {
                    assert!(
                        Instant::now() < deadline,
                        "round {round}: the start never ran"
                    );
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
            drop(runtime);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_runs_after_its_delay_and_not_before() {
        let starts = DelayedStarts::new(Duration::from_millis(20), Duration::from_millis(5));
        let (ran, start) = counter();
        starts.push(start());
        tokio::time::sleep(Duration::from_millis(14)).await;
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "ran more than the batch early"
        );
        tokio::time::sleep(Duration::from_millis(7)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn starts_due_within_the_batch_run_together_in_order() {
        let starts = DelayedStarts::new(Duration::from_millis(20), Duration::from_millis(10));
        let order = Arc::new(Mutex::new(Vec::new()));
        for i in 0..3 {
            let o = order.clone();
            starts.push(move || o.lock().unwrap().push((i, Instant::now())));
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let order = order.lock().unwrap();
        assert_eq!(order.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(
            order.iter().all(|(_, at)| *at == order[0].1),
            "one wake-up for starts due 4 and 8 ms apart: {order:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_queue_runs_what_is_queued_at_once() {
        let starts = DelayedStarts::new(Duration::from_secs(3600), Duration::from_millis(10));
        let (ran, start) = counter();
        starts.push(start());
        starts.push(start());
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(starts);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn outside_a_runtime_a_start_runs_where_it_is_queued() {
        let starts = DelayedStarts::new(Duration::from_millis(20), Duration::from_millis(10));
        let (ran, start) = counter();
        starts.push(start());
        assert_eq!(ran.load(Ordering::SeqCst), 1);
    }
}
