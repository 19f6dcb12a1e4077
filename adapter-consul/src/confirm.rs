//! Batched ownership checks: one read-only transaction confirms many held keys.
//!
//! A renewal must see its key still locked by the client's session, read after the renewal
//! started (the session's renewals prove the session lives; only a read proves nobody deleted or
//! took our key). One `GET ?consistent` per renewal is one request per lease per renewal. Here
//! every renewal hands its key to one task per coordinator, which sends **rounds**: read-only
//! `PUT /v1/txn?consistent` transactions of up to [`MAX_TXN_OPS`] `check-session` operations
//! (Consul's limit on operations per transaction), as many as the round needs, up to
//! [`MAX_PARALLEL_TXNS`] in parallel. A
//! round starts at once when the previous one started at least [`ROUND_SPACING`] ago, otherwise
//! at that point, and takes every key asked for until then: a lone renewal costs one request;
//! under load the server sees at most one round per spacing.
//!
//! Consul serves a transaction of reads only with `Txn.Read`, which honours `?consistent` (a
//! read through the leader, as `GET /v1/kv/:key?consistent`). `check-session` passes when the key
//! exists and is locked by the given session, and fails otherwise ("doesn't exist", or "current
//! session ... != ..."). A transaction with a failed operation answers 409 with one error per
//! failed operation (`OpIndex`, `What`) and no results, so the asks it names get their answer and
//! the others are asked again at once in a transaction of their own: only a 200 confirms a key.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lease_core::Error;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::http::{Http, TxnOp, TxnRead};
use crate::BACKEND;

/// Operations per transaction: Consul's `maxTxnOps` (64).
pub(crate) const MAX_TXN_OPS: usize = 64;

/// At most this many transactions of one round are in flight at once (the rest of the round
/// follows as they finish): a burst of renewals never opens more than this many connections.
pub(crate) const MAX_PARALLEL_TXNS: usize = 8;

/// The least time between the starts of two rounds.
pub(crate) const ROUND_SPACING: Duration = Duration::from_millis(20);

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// The key exists and is locked by the session.
    Ours,
    /// The key does not exist.
    Missing,
    /// The key exists but is not locked by the session (unlocked, or another session's).
    NotOurs,
}

struct Ask {
    key: String,
    session: String,
    reply: oneshot::Sender<Result<Ownership, Error>>,
}

/// The handle to a coordinator's confirmation task, started on first use (from a runtime).
#[derive(Debug)]
pub(crate) struct Confirmer {
    http: Arc<Http>,
    tx: OnceLock<mpsc::UnboundedSender<Ask>>,
}

impl Confirmer {
    pub(crate) fn new(http: Arc<Http>) -> Self {
        Confirmer {
            http,
            tx: OnceLock::new(),
        }
    }

    /// Whether `key` is locked by `session`, read (`?consistent`) after this call started.
    /// `Err` when the read failed (read-only: never `OutcomeUnknown`).
    pub(crate) async fn check(&self, key: &str, session: &str) -> Result<Ownership, Error> {
        let tx = self.tx.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(self.http.clone(), rx));
            tx
        });
        let (reply, rx) = oneshot::channel();
        let gone = || Error::Unavailable {
            backend: BACKEND,
            message: "renew: the coordinator is shutting down".into(),
            source: None,
        };
        tx.send(Ask {
            key: key.to_owned(),
            session: session.to_owned(),
            reply,
        })
        .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

async fn run(http: Arc<Http>, mut rx: mpsc::UnboundedReceiver<Ask>) {
    let mut last_start: Option<Instant> = None;
    while let Some(first) = rx.recv().await {
        if let Some(at) = last_start {
            tokio::time::sleep_until(at + ROUND_SPACING).await;
        }
        last_start = Some(Instant::now());
        let mut round = vec![first];
        while let Ok(a) = rx.try_recv() {
            round.push(a);
        }
        let mut chunks = tokio::task::JoinSet::new();
        while !round.is_empty() {
            if chunks.len() >= MAX_PARALLEL_TXNS {
                chunks.join_next().await;
            }
            let rest = round.split_off(round.len().min(MAX_TXN_OPS));
            let chunk = std::mem::replace(&mut round, rest);
            let http = http.clone();
            chunks.spawn(async move { confirm(&http, chunk).await });
        }
        while chunks.join_next().await.is_some() {}
    }
}

/// Read-only transactions of `check-session` for `chunk` until every ask is answered.
async fn confirm(http: &Http, mut pending: Vec<Ask>) {
    while !pending.is_empty() {
        let ops: Vec<TxnOp> = pending
            .iter()
            .map(|a| TxnOp::check_session(&a.key, &a.session))
            .collect();
        match http.txn_read(&ops, "renew").await {
            Ok(TxnRead::Passed) => {
                for a in pending.drain(..) {
                    let _ = a.reply.send(Ok(Ownership::Ours));
                }
            }
            Ok(TxnRead::Failed(errors)) => {
                let mut failed: HashMap<usize, Ownership> = HashMap::new();
                for (i, what) in &errors {
                    if let Some(i) = i.filter(|i| *i < pending.len()) {
                        let found = if what.contains("doesn't exist") {
                            Ownership::Missing
                        } else {
                            Ownership::NotOurs
                        };
                        failed.insert(i, found);
                    }
                }
                if failed.is_empty() {
                    // Nothing to attribute the failure to: no ask can be answered either way.
                    let what: Vec<&str> = errors.iter().map(|(_, w)| w.as_str()).collect();
                    let e = crate::error::protocol("renew", what.join("; "));
                    for a in pending.drain(..) {
                        let _ = a.reply.send(Err(copy(&e)));
                    }
                    return;
                }
                // The failed ones have their answer; the rest are asked again (only a 200
                // confirms a key).
                let mut rest = Vec::with_capacity(pending.len() - failed.len());
                for (i, a) in pending.drain(..).enumerate() {
                    match failed.get(&i) {
                        Some(found) => {
                            let _ = a.reply.send(Ok(*found));
                        }
                        None => rest.push(a),
                    }
                }
                pending = rest;
            }
            Err(e) => {
                for a in pending.drain(..) {
                    let _ = a.reply.send(Err(copy(&e)));
                }
            }
        }
    }
}

/// The same read-only failure for another caller of the round.
pub(crate) fn copy(e: &Error) -> Error {
    match e {
        Error::Misconfigured { backend, problems } => Error::Misconfigured {
            backend,
            problems: problems.clone(),
        },
        Error::Unsupported { backend, what } => Error::Unsupported {
            backend,
            what: what.clone(),
        },
        Error::Unavailable { message, .. } => Error::Unavailable {
            backend: BACKEND,
            message: message.clone(),
            source: None,
        },
        other => Error::Unavailable {
            backend: BACKEND,
            message: other.to_string(),
            source: None,
        },
    }
}
