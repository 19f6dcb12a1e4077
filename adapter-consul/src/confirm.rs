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
use std::sync::Arc;
use std::time::Duration;

use lease_core::adapter::batch::{Rounds, RoundsConfig};
use lease_core::adapter::Op;
use lease_core::Error;

use crate::client::{Http, TxnOp, TxnRead};
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

/// The handle to a coordinator's confirmation rounds ([`lease_core::adapter::batch::Rounds`]; its task
/// starts on first use, from a runtime).
#[derive(Debug)]
pub(crate) struct Confirmer {
    rounds: Rounds<(String, String), Ownership>,
}

impl Confirmer {
    pub(crate) fn new(http: Arc<Http>) -> Self {
        let config = RoundsConfig::new(ROUND_SPACING, MAX_TXN_OPS).parallel(MAX_PARALLEL_TXNS);
        Confirmer {
            rounds: Rounds::new(BACKEND, config, move |chunk| {
                let http = http.clone();
                async move { Ok(confirm(&http, chunk).await) }
            }),
        }
    }

    /// Whether `key` is locked by `session`, read (`?consistent`) after this call started.
    /// `Err` when the read failed (read-only: never `OutcomeUnknown`).
    pub(crate) async fn check(&self, key: &str, session: &str) -> Result<Ownership, Error> {
        self.rounds.ask((key.to_owned(), session.to_owned())).await
    }
}

/// Read-only transactions of `check-session` for `chunk` until every check is answered: one
/// answer per check, in order.
async fn confirm(http: &Http, chunk: Vec<(String, String)>) -> Vec<Result<Ownership, Error>> {
    let mut answers: Vec<Option<Result<Ownership, Error>>> = chunk.iter().map(|_| None).collect();
    // Indices into `chunk` still to answer.
    let mut pending: Vec<usize> = (0..chunk.len()).collect();
    while !pending.is_empty() {
        let ops: Vec<TxnOp> = pending
            .iter()
            .map(|&i| TxnOp::check_session(&chunk[i].0, &chunk[i].1))
            .collect();
        match http.txn_read(&ops, "renew").await {
            Ok(TxnRead::Passed) => {
                for i in pending.drain(..) {
                    answers[i] = Some(Ok(Ownership::Ours));
                }
            }
            Ok(TxnRead::Failed(errors)) => {
                let mut failed: HashMap<usize, Ownership> = HashMap::new();
                for (op, what) in &errors {
                    if let Some(op) = op.filter(|op| *op < pending.len()) {
                        let found = if what.contains("doesn't exist") {
                            Ownership::Missing
                        } else {
                            Ownership::NotOurs
                        };
                        failed.insert(op, found);
                    }
                }
                if failed.is_empty() {
                    // Nothing to attribute the failure to: no check can be answered either way.
                    let what: Vec<&str> = errors.iter().map(|(_, w)| w.as_str()).collect();
                    let e = crate::error::unreadable(Op::read("renew"), what.join("; "));
                    for i in pending.drain(..) {
                        answers[i] = Some(Err(e.replicate()));
                    }
                    break;
                }
                // The failed ones have their answer; the rest are asked again (only a 200
                // confirms a key).
                let mut rest = Vec::with_capacity(pending.len() - failed.len());
                for (op, i) in pending.drain(..).enumerate() {
                    match failed.get(&op) {
                        Some(found) => answers[i] = Some(Ok(*found)),
                        None => rest.push(i),
                    }
                }
                pending = rest;
            }
            Err(e) => {
                for i in pending.drain(..) {
                    answers[i] = Some(Err(e.replicate()));
                }
            }
        }
    }
    answers
        .into_iter()
        .map(|a| a.expect("every check is answered"))
        .collect()
}
