//! Group commit for adapter authors: many callers' requests go to the server in **rounds**.
//!
//! Thousands of held leases renew every third of their TTL; one request per renewal is
//! thousands of requests a second. [`Rounds`] hands every request to one task, which sends a
//! round at once when the previous round started at least [`RoundsConfig::spacing`] ago,
//! otherwise at that point, and takes every request asked for until then: a lone request costs one
//! server call and waits for nothing; under load the server sees at most one round per spacing.
//! A round is cut into chunks of at most [`RoundsConfig::chunk`] requests (a backend's limit on
//! operations per call), at most [`RoundsConfig::parallel`] chunks in flight.
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

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
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
    /// The most chunks of one round in flight at once. At least 1.
    pub parallel: usize,
}

impl RoundsConfig {
    /// `spacing` and `chunk`, with every chunk of a round in flight at once.
    pub fn new(spacing: Duration, chunk: usize) -> Self {
        RoundsConfig {
            spacing,
            chunk: chunk.max(1),
            parallel: usize::MAX,
        }
    }

    /// At most `parallel` chunks of a round in flight at once (at least 1).
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
/// runtime) and ends when the `Rounds` is dropped.
pub struct Rounds<Req, Resp> {
    backend: &'static str,
    config: RoundsConfig,
    run: Arc<ChunkFn<Req, Resp>>,
    tx: OnceLock<mpsc::UnboundedSender<Ask<Req, Resp>>>,
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
        Rounds {
            backend,
            config,
            run: Arc::new(move |chunk| Box::pin(run(chunk)) as ChunkFuture<Resp>),
            tx: OnceLock::new(),
        }
    }

    /// Sends `req` in the next round and waits for its answer.
    pub async fn ask(&self, req: Req) -> Result<Resp> {
        let backend = self.backend;
        let gone = || Error::Unavailable {
            backend,
            message: "the coordinator is shutting down".into(),
            source: None,
        };
        let tx = self.tx.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(backend, self.config, self.run.clone(), rx));
            tx
        });
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
    while let Some(first) = rx.recv().await {
        if let Some(at) = last_start {
            tokio::time::sleep_until(at + config.spacing).await;
        }
        last_start = Some(Instant::now());
        let mut round = vec![first];
        while let Ok(a) = rx.try_recv() {
            round.push(a);
        }
        let mut chunks = tokio::task::JoinSet::new();
        while !round.is_empty() {
            if chunks.len() >= config.parallel {
                chunks.join_next().await;
            }
            let rest = round.split_off(round.len().min(config.chunk));
            let chunk = std::mem::replace(&mut round, rest);
            chunks.spawn(answer(backend, f.clone(), chunk));
        }
        while chunks.join_next().await.is_some() {}
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
                    Err(Error::Unavailable {
                        backend: "test",
                        message: "down".into(),
                        source: None,
                    })
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
}
