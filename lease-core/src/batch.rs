//! Group commit for adapter authors: many callers' requests go to the server together.
//!
//! Two schedulers, for two kinds of traffic:
//!
//! - [`Rounds`], for background work that may wait a little (renewals): thousands of held leases
//!   renew every third of their TTL; one request per renewal is thousands of requests a second.
//!   [`Rounds`] hands every request to one task, which sends a round at once when the previous
//!   round started at least [`RoundsConfig::spacing`] ago, otherwise at that point, and takes
//!   every request asked for until then: a lone request costs one server call and waits for
//!   nothing; under load the server sees at most one round per spacing. A round is cut into
//!   chunks of at most [`RoundsConfig::chunk`] requests (a backend's limit on operations per
//!   call), at most [`RoundsConfig::parallel`] chunks in flight. A round does not wait for the
//!   chunks of earlier rounds to finish: one slow server call holds up only its own requests.
//! - [`Coalesce`], for requests a caller is waiting on (acquires, releases): a request is sent at
//!   once, from the caller's own task, while fewer than [`CoalesceConfig::in_flight`] sends are
//!   in flight; otherwise it waits for the next send to finish and goes with every request that
//!   queued meanwhile, in one call. An idle coordinator sends each request alone, as a
//!   hand-written client would (no timer, no task hop); a busy one sends fewer, larger calls.
//!
//! The adapter supplies what one chunk does on the server: one answer per request, in order, or
//! one error for the whole chunk (each caller then gets a copy, [`Error::replicate`]).
//!
//! ```
//! use std::time::Duration;
//! use lease_core::adapter::batch::{Rounds, RoundsConfig};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> lease_core::Result<()> {
//! // Doubles numbers, a chunk at a time (a real adapter sends one script or transaction).
//! let rounds = Rounds::new(
//!     "example",
//!     RoundsConfig::new(Duration::from_millis(5), 128),
//!     |chunk: Vec<u64>| async move { Ok(chunk.into_iter().map(|n| Ok(n * 2)).collect()) },
//! );
//! assert_eq!(rounds.ask(21).await?, 42);
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// How a [`Rounds`] cuts and spaces its rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundsConfig {
    /// The least time between the starts of two rounds.
    pub spacing: Duration,
    /// The most requests in one chunk (one server call). At least 1.
    pub chunk: usize,
    /// The most chunks in flight at once, of all rounds together. At least 1.
    pub parallel: usize,
}

impl RoundsConfig {
    /// `spacing` and `chunk`, with no bound on the chunks in flight.
    pub fn new(spacing: Duration, chunk: usize) -> Self {
        RoundsConfig {
            spacing,
            chunk: chunk.max(1),
            parallel: usize::MAX,
        }
    }

    /// At most `parallel` chunks in flight at once, across rounds (at least 1).
    pub fn parallel(mut self, parallel: usize) -> Self {
        self.parallel = parallel.max(1);
        self
    }
}

type ChunkFuture<Resp> = Pin<Box<dyn Future<Output = Result<Vec<Result<Resp>>>> + Send>>;
type ChunkFn<Req, Resp> = dyn Fn(Vec<Req>) -> ChunkFuture<Resp> + Send + Sync;

struct Ask<Req, Resp> {
    req: Req,
    reply: oneshot::Sender<Result<Resp>>,
}

/// One task that sends its callers' requests in rounds (see the [module docs](self)). Cheap to
/// share behind an `Arc`; the task starts with the first [`Rounds::ask`] (on that caller's
/// runtime) and ends when the `Rounds` is dropped. If that runtime shuts down (taking the task
/// with it), the next `ask` starts the task again on its own caller's runtime.
pub struct Rounds<Req, Resp> {
    backend: &'static str,
    config: RoundsConfig,
    run: Arc<ChunkFn<Req, Resp>>,
    tx: std::sync::Mutex<Option<mpsc::UnboundedSender<Ask<Req, Resp>>>>,
}

impl<Req, Resp> std::fmt::Debug for Rounds<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rounds")
            .field("backend", &self.backend)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> Rounds<Req, Resp> {
    /// Rounds whose chunks `run` sends. `run` answers a chunk with one result per request, in
    /// order, or with one error for all of them; a wrong number of answers is an `Unavailable`
    /// for the whole chunk (naming `backend`).
    pub fn new<F, Fut>(backend: &'static str, config: RoundsConfig, run: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp>>>> + Send + 'static,
    {
        let config = RoundsConfig {
            chunk: config.chunk.max(1),
            parallel: config.parallel.max(1),
            ..config
        };
        Rounds {
            backend,
            config,
            run: Arc::new(move |chunk| Box::pin(run(chunk)) as ChunkFuture<Resp>),
            tx: std::sync::Mutex::new(None),
        }
    }

    /// Sends `req` in the next round and waits for its answer.
    pub async fn ask(&self, req: Req) -> Result<Resp> {
        let backend = self.backend;
        let gone = || shutting_down(backend);
        let tx = {
            let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
            match &*tx {
                Some(live) if !live.is_closed() => live.clone(),
                // First use, or the task went with the runtime it ran on.
                _ => {
                    let (new, rx) = mpsc::unbounded_channel();
                    tokio::spawn(run(backend, self.config, self.run.clone(), rx));
                    tx.insert(new).clone()
                }
            }
        };
        let (reply, rx) = oneshot::channel();
        tx.send(Ask { req, reply }).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

async fn run<Req: Send + 'static, Resp: Send + 'static>(
    backend: &'static str,
    config: RoundsConfig,
    f: Arc<ChunkFn<Req, Resp>>,
    mut rx: mpsc::UnboundedReceiver<Ask<Req, Resp>>,
) {
    let mut last_start: Option<Instant> = None;
    // Chunks in flight, of this round and earlier ones: a slow chunk (a server call waiting for
    // its timeout) does not hold up the rounds after it, only `parallel` bounds them.
    let mut chunks = tokio::task::JoinSet::new();
    loop {
        let first = tokio::select! {
            a = rx.recv() => match a {
                Some(a) => a,
                None => break,
            },
            Some(_) = chunks.join_next(), if !chunks.is_empty() => continue,
        };
        if let Some(at) = last_start {
            tokio::time::sleep_until(at + config.spacing).await;
        }
        last_start = Some(Instant::now());
        let mut round = vec![first];
        while let Ok(a) = rx.try_recv() {
            round.push(a);
        }
        while !round.is_empty() {
            while chunks.len() >= config.parallel {
                chunks.join_next().await;
            }
            let rest = round.split_off(round.len().min(config.chunk));
            let chunk = std::mem::replace(&mut round, rest);
            chunks.spawn(answer(backend, f.clone(), chunk));
        }
    }
    while chunks.join_next().await.is_some() {}
}

/// How a [`Coalesce`] sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// The most sends in flight at once. At least 1.
    pub in_flight: usize,
    /// The most requests in one send (one server call). At least 1.
    pub chunk: usize,
}

impl CoalesceConfig {
    /// At most `in_flight` sends in flight, each of at most `chunk` requests.
    pub fn new(in_flight: usize, chunk: usize) -> Self {
        CoalesceConfig {
            in_flight: in_flight.max(1),
            chunk: chunk.max(1),
        }
    }
}

/// Sends its callers' requests at once while it can, and together when it cannot (see the
/// [module docs](self)).
///
/// [`ask`](Coalesce::ask) sends its request from the caller's task when fewer than
/// [`CoalesceConfig::in_flight`] sends are in flight: a chunk of one, the adapter's plain
/// request. Otherwise the request waits in a queue; each send that finishes takes up to
/// [`CoalesceConfig::chunk`] queued requests (oldest first) and sends them as one chunk, on a
/// task of its own, so the waiting callers share one server call.
///
/// # Cancel safety
///
/// A caller that stops waiting before its queued request was taken is left out of the chunk
/// (nothing is sent for it); once taken, or when sent from the caller's task, the request may
/// reach the server whether or not its answer is awaited, as with any request sent and then
/// abandoned.
pub struct Coalesce<Req, Resp> {
    shared: Arc<CoalesceShared<Req, Resp>>,
}

struct CoalesceShared<Req, Resp> {
    backend: &'static str,
    config: CoalesceConfig,
    run: Arc<ChunkFn<Req, Resp>>,
    queue: Mutex<Queue<Req, Resp>>,
}

struct Queue<Req, Resp> {
    /// Sends in flight (each holds a slot until it finishes).
    in_flight: usize,
    /// Requests waiting for a slot, oldest first. Never empty while a slot is free.
    waiting: VecDeque<Ask<Req, Resp>>,
}

impl<Req, Resp> std::fmt::Debug for Coalesce<Req, Resp> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesce")
            .field("backend", &self.shared.backend)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> Coalesce<Req, Resp> {
    /// A coalescer whose chunks `run` sends. `run` answers a chunk with one result per request,
    /// in order, or with one error for all of them; a wrong number of answers is an
    /// `Unavailable` for the whole chunk (naming `backend`). A chunk of one is a request sent
    /// alone: the adapter sends its plain request for it.
    pub fn new<F, Fut>(backend: &'static str, config: CoalesceConfig, run: F) -> Self
    where
        F: Fn(Vec<Req>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<Result<Resp>>>> + Send + 'static,
    {
        Coalesce {
            shared: Arc::new(CoalesceShared {
                backend,
                config: CoalesceConfig::new(config.in_flight, config.chunk),
                run: Arc::new(move |chunk| Box::pin(run(chunk)) as ChunkFuture<Resp>),
                queue: Mutex::new(Queue {
                    in_flight: 0,
                    waiting: VecDeque::new(),
                }),
            }),
        }
    }

    /// Sends `req` (alone now, or with the others queued at the next free slot) and waits for
    /// its answer.
    pub async fn ask(&self, req: Req) -> Result<Resp> {
        let shared = self.shared.clone();
        self.ask_with(req, |req| async move {
            let answers = (shared.run)(vec![req]).await?;
            match <[_; 1]>::try_from(answers) {
                Ok([answer]) => answer,
                Err(answers) => Err(Error::unavailable(
                    shared.backend,
                    format!("a request alone got {} answers", answers.len()),
                )),
            }
        })
        .await
    }

    /// [`ask`](Coalesce::ask), with `alone` sending the request when it goes alone (a slot is
    /// free): the adapter's plain request, awaited in the caller's task as it is, without the
    /// boxed chunk future and the chunk's vectors. `alone` must send what a chunk of one would;
    /// under load the request still goes with others, through the chunk function.
    pub async fn ask_with<F, Fut>(&self, req: Req, alone: F) -> Result<Resp>
    where
        F: FnOnce(Req) -> Fut,
        Fut: Future<Output = Result<Resp>>,
    {
        let shared = &self.shared;
        let queued = {
            let mut queue = shared.lock();
            if queue.in_flight < shared.config.in_flight {
                queue.in_flight += 1;
                Err(req)
            } else {
                let (reply, rx) = oneshot::channel();
                queue.waiting.push_back(Ask { req, reply });
                Ok(rx)
            }
        };
        match queued {
            Ok(rx) => rx.await.map_err(|_| shutting_down(shared.backend))?,
            Err(req) => {
                // Released when the send ends, however it ends (a cancelled caller included).
                let _slot = Slot(shared.clone());
                alone(req).await
            }
        }
    }
}

impl<Req, Resp> CoalesceShared<Req, Resp> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue<Req, Resp>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One send's slot: on drop, hands the slot to the queued requests (as one chunk on a task of
/// its own) or frees it.
struct Slot<Req: Send + 'static, Resp: Send + 'static>(Arc<CoalesceShared<Req, Resp>>);

impl<Req: Send + 'static, Resp: Send + 'static> Drop for Slot<Req, Resp> {
    fn drop(&mut self) {
        let shared = &self.0;
        let mut queue = shared.lock();
        let mut chunk = Vec::new();
        while chunk.len() < shared.config.chunk {
            match queue.waiting.pop_front() {
                // The caller stopped waiting: nothing to send for it.
                Some(ask) if ask.reply.is_closed() => {}
                Some(ask) => chunk.push(ask),
                None => break,
            }
        }
        if chunk.is_empty() {
            queue.in_flight -= 1;
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send on (it is shutting down): every waiting caller fails.
            queue.waiting.clear();
            queue.in_flight -= 1;
            return;
        };
        drop(queue);
        let (backend, run, slot) = (shared.backend, shared.run.clone(), Slot(shared.clone()));
        runtime.spawn(async move {
            answer(backend, run, chunk).await;
            drop(slot);
        });
    }
}

fn shutting_down(backend: &'static str) -> Error {
    Error::Unavailable {
        backend,
        message: "the coordinator is shutting down".into(),
        source: None,
    }
}

/// Runs one chunk and answers each of its callers.
async fn answer<Req, Resp>(
    backend: &'static str,
    f: Arc<ChunkFn<Req, Resp>>,
    chunk: Vec<Ask<Req, Resp>>,
) {
    let (reqs, replies): (Vec<Req>, Vec<_>) = chunk.into_iter().map(|a| (a.req, a.reply)).unzip();
    let n = reqs.len();
    match f(reqs).await {
        Ok(answers) if answers.len() == n => {
            for (reply, a) in replies.into_iter().zip(answers) {
                let _ = reply.send(a);
            }
        }
        Ok(answers) => {
            let e = Error::Unavailable {
                backend,
                message: format!("a batch of {n} got {} answers", answers.len()),
                source: None,
            };
            for reply in replies {
                let _ = reply.send(Err(e.replicate()));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.replicate()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A runtime that shuts down takes the task with it; the next caller's runtime gets a new
    /// one, so the `Rounds` (shared by a coordinator used from both) keeps answering.
    #[test]
    fn the_task_starts_again_on_another_runtime() {
        let rounds = Arc::new(Rounds::new(
            "test",
            RoundsConfig::new(Duration::from_millis(1), 10),
            |chunk: Vec<u32>| async move { Ok(chunk.into_iter().map(|n| Ok(n * 2)).collect()) },
        ));
        for n in 0..3u32 {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            let r = rounds.clone();
            assert_eq!(
                runtime.block_on(async move { r.ask(n).await }).unwrap(),
                n * 2
            );
            drop(runtime);
        }
    }

    /// A round whose server call hangs (until its timeout, in an adapter) does not hold up the
    /// next round: before, the task waited for every chunk of a round before it read the next
    /// request, so every renewal behind one slow call waited for it.
    #[tokio::test(start_paused = true)]
    async fn a_slow_round_does_not_hold_up_the_next() {
        let rounds = Arc::new(Rounds::new(
            "test",
            RoundsConfig::new(Duration::from_millis(5), 10),
            |chunk: Vec<u32>| async move {
                if chunk.contains(&0) {
                    std::future::pending::<()>().await;
                }
                Ok(chunk.into_iter().map(|n| Ok(n + 1)).collect())
            },
        ));
        let stuck = {
            let r = rounds.clone();
            tokio::spawn(async move { r.ask(0).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let answered = tokio::time::timeout(Duration::from_millis(50), rounds.ask(1)).await;
        assert_eq!(answered.expect("held up by the slow round").unwrap(), 2);
        assert!(!stuck.is_finished());
    }

    #[tokio::test]
    async fn concurrent_asks_share_chunks_and_each_gets_its_own_answer() {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let rounds = Arc::new(Rounds::new(
            "test",
            RoundsConfig::new(Duration::from_millis(5), 10).parallel(2),
            move |chunk: Vec<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    Ok(chunk
                        .into_iter()
                        .map(|n| {
                            if n == 7 {
                                Err(Error::NotFound { what: "7".into() })
                            } else {
                                Ok(n + 1)
                            }
                        })
                        .collect())
                }
            },
        ));
        let answers = futures::future::join_all((0..100u32).map(|n| {
            let r = rounds.clone();
            async move { r.ask(n).await }
        }))
        .await;
        for (n, a) in answers.iter().enumerate() {
            if n == 7 {
                assert!(matches!(a, Err(Error::NotFound { .. })), "{a:?}");
            } else {
                assert_eq!(*a.as_ref().unwrap(), n as u32 + 1);
            }
        }
        // The first ask goes alone; the other 99 in the next round, in chunks of 10.
        assert!(calls.load(Ordering::SeqCst) <= 11, "{calls:?} chunks");
    }

    #[tokio::test]
    async fn a_failed_chunk_fails_each_caller_and_a_short_answer_is_an_error() {
        let rounds = Rounds::new(
            "test",
            RoundsConfig::new(Duration::ZERO, 4),
            |chunk: Vec<u32>| async move {
                if chunk.contains(&0) {
                    Err(Error::unavailable("test", "down"))
                } else {
                    Ok(vec![Ok(1u32)])
                }
            },
        );
        assert!(matches!(
            rounds.ask(0).await,
            Err(Error::Unavailable { .. })
        ));
        // One request, one answer: fine.
        assert_eq!(rounds.ask(5).await.unwrap(), 1);
        let (a, b) = tokio::join!(rounds.ask(5), rounds.ask(6));
        // Two requests in a chunk got one answer: both fail, naming the mismatch, unless the
        // round split them (the first ask of an idle `Rounds` goes alone).
        for r in [a, b] {
            match r {
                Ok(v) => assert_eq!(v, 1),
                Err(e) => assert!(e.to_string().contains("got 1 answers"), "{e}"),
            }
        }
    }

    /// A chunk function that records the size of every chunk and holds each send until `gate`
    /// lets it go.
    fn gated(
        sizes: Arc<Mutex<Vec<usize>>>,
        gate: Arc<tokio::sync::Semaphore>,
    ) -> impl Fn(Vec<u32>) -> ChunkFuture<u32> + Send + Sync + 'static {
        move |chunk: Vec<u32>| {
            let (sizes, gate) = (sizes.clone(), gate.clone());
            Box::pin(async move {
                sizes.lock().unwrap().push(chunk.len());
                gate.acquire().await.unwrap().forget();
                Ok(chunk.into_iter().map(|n| Ok(n * 10)).collect())
            })
        }
    }

    /// A coalescer of `in_flight` sends of up to `chunk` requests whose chunks wait for permits
    /// of the returned gate (none yet), and the sizes of the chunks sent.
    #[allow(clippy::type_complexity)]
    fn held_coalescer(
        in_flight: usize,
        chunk: usize,
    ) -> (
        Arc<Coalesce<u32, u32>>,
        Arc<Mutex<Vec<usize>>>,
        Arc<tokio::sync::Semaphore>,
    ) {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let c = Arc::new(Coalesce::new(
            "test",
            CoalesceConfig::new(in_flight, chunk),
            gated(sizes.clone(), gate.clone()),
        ));
        (c, sizes, gate)
    }

    #[tokio::test]
    async fn an_idle_coalescer_sends_each_request_alone_from_the_callers_task() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(tokio::sync::Semaphore::new(usize::MAX >> 4));
        let c = Coalesce::new(
            "test",
            CoalesceConfig::new(1, 8),
            gated(sizes.clone(), gate),
        );
        for n in 0..5 {
            assert_eq!(c.ask(n).await.unwrap(), n * 10);
        }
        assert_eq!(*sizes.lock().unwrap(), vec![1; 5]);
    }

    #[tokio::test]
    async fn ask_with_sends_alone_with_its_own_function_and_queues_through_the_chunks() {
        let (c, sizes, gate) = held_coalescer(1, 8);
        // Alone: the caller's function answers, the chunk function is not called.
        assert_eq!(
            c.ask_with(3, |n| async move { Ok(n + 1) }).await.unwrap(),
            4
        );
        assert!(sizes.lock().unwrap().is_empty());
        // Alone and held open: the slot is taken, so the next two queue and go as one chunk.
        let (release, held) = tokio::sync::oneshot::channel::<()>();
        let first = tokio::spawn({
            let c = c.clone();
            async move {
                c.ask_with(0, |n| async move {
                    let _ = held.await;
                    Ok(n + 1)
                })
                .await
            }
        });
        while c.shared.lock().in_flight == 0 {
            tokio::task::yield_now().await;
        }
        let queued: Vec<_> = (1..=2u32)
            .map(|n| {
                let c = c.clone();
                tokio::spawn(async move { c.ask_with(n, |_| async { unreachable!() }).await })
            })
            .collect();
        while c.shared.lock().waiting.len() < 2 {
            tokio::task::yield_now().await;
        }
        gate.add_permits(100);
        release.send(()).unwrap();
        assert_eq!(first.await.unwrap().unwrap(), 1);
        for (n, r) in (1..=2u32).zip(queued) {
            assert_eq!(r.await.unwrap().unwrap(), n * 10);
        }
        assert_eq!(*sizes.lock().unwrap(), vec![2]);
        assert_eq!(c.shared.lock().in_flight, 0);
    }

    #[tokio::test]
    async fn requests_queued_behind_a_send_go_together_in_chunks() {
        let (c, sizes, gate) = held_coalescer(1, 4);
        let first = tokio::spawn({
            let c = c.clone();
            async move { c.ask(0).await }
        });
        // The first send is in flight (held by the gate); ten more queue behind it.
        while sizes.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = (1..=10u32)
            .map(|n| {
                let c = c.clone();
                tokio::spawn(async move { c.ask(n).await })
            })
            .collect();
        while c.shared.lock().waiting.len() < 10 {
            tokio::task::yield_now().await;
        }
        gate.add_permits(100);
        assert_eq!(first.await.unwrap().unwrap(), 0);
        for (n, r) in (1..=10u32).zip(rest) {
            assert_eq!(r.await.unwrap().unwrap(), n * 10);
        }
        // One alone, then the queue in chunks of at most four, one after the other.
        assert_eq!(*sizes.lock().unwrap(), vec![1, 4, 4, 2]);
        assert_eq!(c.shared.lock().in_flight, 0);
    }

    #[tokio::test]
    async fn a_caller_that_stops_waiting_is_left_out_and_a_cancelled_send_frees_its_slot() {
        let (c, sizes, gate) = held_coalescer(1, 8);
        // A send in flight, cancelled before it ends: its slot is handed on.
        let cancelled = tokio::spawn({
            let c = c.clone();
            async move { c.ask(0).await }
        });
        while sizes.lock().unwrap().is_empty() {
            tokio::task::yield_now().await;
        }
        let gave_up = tokio::spawn({
            let c = c.clone();
            async move { c.ask(1).await }
        });
        let kept = tokio::spawn({
            let c = c.clone();
            async move { c.ask(2).await }
        });
        while c.shared.lock().waiting.len() < 2 {
            tokio::task::yield_now().await;
        }
        gave_up.abort();
        assert!(gave_up.await.unwrap_err().is_cancelled());
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        gate.add_permits(100);
        assert_eq!(kept.await.unwrap().unwrap(), 20);
        // The abandoned request 1 was never sent.
        assert_eq!(*sizes.lock().unwrap(), vec![1, 1]);
        assert_eq!(c.shared.lock().in_flight, 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_concurrent_callers_each_get_their_answer_and_no_slot_is_lost() {
        let sends = Arc::new(AtomicUsize::new(0));
        let counted = sends.clone();
        let c = Arc::new(Coalesce::new(
            "test",
            CoalesceConfig::new(2, 16),
            move |chunk: Vec<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                async move {
                    tokio::task::yield_now().await;
                    Ok(chunk
                        .into_iter()
                        .map(|n| {
                            if n % 97 == 0 {
                                Err(Error::NotFound {
                                    what: n.to_string(),
                                })
                            } else {
                                Ok(n + 1)
                            }
                        })
                        .collect())
                }
            },
        ));
        let tasks: Vec<_> = (0..64u32)
            .map(|t| {
                let c = c.clone();
                tokio::spawn(async move {
                    for i in 0..200u32 {
                        let n = t * 1000 + i;
                        match c.ask(n).await {
                            Ok(v) => assert_eq!(v, n + 1),
                            Err(e) => assert!(n % 97 == 0, "{n}: {e}"),
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(c.shared.lock().in_flight, 0);
        assert!(c.shared.lock().waiting.is_empty());
        // Sent together: far fewer sends than the 12,800 requests.
        assert!(sends.load(Ordering::SeqCst) < 12_800, "{sends:?}");
    }
}
