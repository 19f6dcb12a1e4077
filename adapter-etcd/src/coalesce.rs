//! The lock transactions of one coordinator, sent together under load
//! ([`lease_core::adapter::batch::Coalesce`]): `try_acquire`'s and `acquire`'s transactions and
//! the release's delete.
//!
//! A transaction is sent at once, as it is, while fewer than [`IN_FLIGHT`] are in flight: an
//! uncontended acquire costs what it did. Otherwise it waits for one of them to finish and goes
//! with every transaction that queued meanwhile, up to [`MAX_PER_TXN`], as the nested
//! transactions of one outer transaction with no compare of its own (etcd 3.3 and later). etcd
//! evaluates each nested transaction's compares and applies its branch as it would the
//! transaction alone, so each caller gets the answer its own transaction would have had, with the
//! revision of the outer one: one gRPC request, one Raft entry and one apply for all of them. A
//! lone client sending many transactions costs the server a few requests where it cost one each;
//! measured with lease-bench's own-keys scenario in `docs/bench/performance.md`.
//!
//! etcd evaluates *every* compare of the outer transaction before it applies any branch, so two
//! transactions on the same lock must never share one: the first's put would be invisible to the
//! second's compare (two holders), and two enqueues would get the same create revision. A batch
//! therefore takes at most one transaction per lock range; a second one on the same lock goes in
//! the next outer transaction, sent after the first is answered. Lock ranges never overlap
//! ([`crate::keys`]), so transactions on different locks cannot see each other's keys either, and
//! the put and delete keys of one batch are distinct (etcd refuses a transaction that writes a
//! key twice).

use std::collections::HashSet;
use std::time::Duration;

use etcd_client::{Client, Txn, TxnOp, TxnOpResponse};
use lease_core::adapter::batch::{Coalesce, CoalesceConfig};

use crate::error::{bounded, Failure, BACKEND};

/// Transactions per outer transaction (etcd's `--max-txn-ops`, 128 by default, bounds the outer
/// transaction's operations plus those of each nested one).
pub(crate) const MAX_PER_TXN: usize = 64;

/// Lock transactions in flight at once before the next ones queue.
pub(crate) const IN_FLIGHT: usize = 2;

/// What a lock transaction answered: whether its compares held, the revision of the store after
/// it (of the outer transaction when it went with others), and its branch's responses.
#[derive(Debug)]
pub(crate) struct TxnAnswer {
    pub(crate) succeeded: bool,
    pub(crate) revision: i64,
    pub(crate) responses: Vec<TxnOpResponse>,
}

impl TxnAnswer {
    /// The keys read by the branch's `index`-th operation (empty when it is not a read).
    pub(crate) fn range(&self, index: usize) -> &[etcd_client::KeyValue] {
        match self.responses.get(index) {
            Some(TxnOpResponse::Get(g)) => g.kvs(),
            _ => &[],
        }
    }
}

/// One lock transaction: the lock's key range (at most one per batch) and the transaction.
type LockTxn = (String, Txn);

/// The coordinator's coalesced lock transactions.
pub(crate) struct Txns {
    coalesce: Coalesce<LockTxn, Result<TxnAnswer, Failure>>,
    client: Client,
    bound: Duration,
}

impl std::fmt::Debug for Txns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Txns").finish_non_exhaustive()
    }
}

impl Txns {
    /// Sends on `client`; a send gets no answer after `bound` (the request timeout) is a
    /// `Failure::Timeout` for each of its transactions.
    pub(crate) fn new(client: Client, bound: Duration) -> Txns {
        let config = CoalesceConfig::new(IN_FLIGHT, MAX_PER_TXN);
        let chunks = client.clone();
        let coalesce = Coalesce::new(BACKEND, config, move |chunk| {
            let client = chunks.clone();
            async move { Ok(send_chunk(client, bound, chunk).await) }
        });
        Txns {
            coalesce,
            client,
            bound,
        }
    }

    /// Sends `txn`, a transaction on the lock whose key range is `lock` (alone, or nested with
    /// others queued meanwhile), and returns its answer.
    pub(crate) async fn send(&self, lock: &str, txn: Txn) -> Result<TxnAnswer, Failure> {
        let alone =
            |(_, txn): LockTxn| async move { Ok(send_one(&self.client, self.bound, txn).await) };
        match self.coalesce.ask_with((lock.to_owned(), txn), alone).await {
            Ok(answer) => answer,
            // The sending task went away without an answer (the runtime is shutting down): the
            // transaction may or may not have been sent.
            Err(e) => Err(Failure::NoAnswer(e.to_string())),
        }
    }
}

/// Sends a chunk as outer transactions of at most one transaction per lock, one after the
/// other, each answered before the next is sent.
async fn send_chunk(
    client: Client,
    bound: Duration,
    chunk: Vec<LockTxn>,
) -> Vec<lease_core::Result<Result<TxnAnswer, Failure>>> {
    let mut answers: Vec<Option<Result<TxnAnswer, Failure>>> = Vec::new();
    answers.resize_with(chunk.len(), || None);
    let mut rest: Vec<(usize, LockTxn)> = chunk.into_iter().enumerate().collect();
    while !rest.is_empty() {
        let mut locks = HashSet::new();
        let (now, later): (Vec<_>, Vec<_>) = rest
            .into_iter()
            .partition(|(_, (lock, _))| locks.insert(lock.clone()));
        rest = later;
        let (at, txns): (Vec<usize>, Vec<Txn>) =
            now.into_iter().map(|(i, (_, txn))| (i, txn)).unzip();
        for (i, answer) in at.into_iter().zip(send(&client, bound, txns).await) {
            answers[i] = Some(answer);
        }
    }
    answers
        .into_iter()
        .map(|a| Ok(a.expect("every transaction of the chunk was sent")))
        .collect()
}

/// Sends one transaction as it is.
async fn send_one(client: &Client, bound: Duration, txn: Txn) -> Result<TxnAnswer, Failure> {
    let r = bounded(bound, client.kv_client().txn(txn)).await?;
    Ok(TxnAnswer {
        succeeded: r.succeeded(),
        revision: r.header().map_or(0, |h| h.revision()),
        responses: r.op_responses(),
    })
}

/// Sends `txns` (on distinct locks): alone when there is one, else nested in one transaction.
async fn send(client: &Client, bound: Duration, txns: Vec<Txn>) -> Vec<Result<TxnAnswer, Failure>> {
    let n = txns.len();
    if n == 1 {
        let txn = txns.into_iter().next().expect("one transaction");
        return vec![send_one(client, bound, txn).await];
    }
    let mut kv = client.kv_client();
    let outer = Txn::new().and_then(txns.iter().cloned().map(TxnOp::txn).collect::<Vec<_>>());
    let resp = match bounded(bound, kv.txn(outer)).await {
        Ok(resp) => resp,
        // etcd checks the session lease of every put before it applies any, and refuses the
        // whole request when one is gone: one ended session must not fail the transactions of
        // the others (whose callers would take it for their own session's end). Nothing was
        // applied, so each is sent again alone, and only those on the ended lease fail.
        Err(f) if f.is_lease_not_found() => {
            // At once: they are on distinct locks.
            let alone = txns.into_iter().map(|txn| send_one(client, bound, txn));
            return futures::future::join_all(alone).await;
        }
        Err(f) => return (0..n).map(|_| Err(f.clone())).collect(),
    };
    let revision = resp.header().map_or(0, |h| h.revision());
    let nested = resp.op_responses();
    if nested.len() != n {
        let f = Failure::NoAnswer(format!(
            "a transaction of {n} nested ones got {} answers",
            nested.len()
        ));
        return (0..n).map(|_| Err(f.clone())).collect();
    }
    nested
        .into_iter()
        .map(|op| match op {
            TxnOpResponse::Txn(t) => Ok(TxnAnswer {
                succeeded: t.succeeded(),
                revision,
                responses: t.op_responses(),
            }),
            _ => Err(Failure::NoAnswer(
                "a nested transaction's answer is not a transaction's".into(),
            )),
        })
        .collect()
}
