//! Batched renewals: one script renews the leases of many locks.
//!
//! A held lease renews every third of its TTL with one `EVALSHA` of [`scripts::RENEW`]: 10,000
//! leases on a 10 s TTL are 3,000 script runs a second, each a write the server appends to its
//! AOF. Here every renewal hands its lock to one task per coordinator, which sends **rounds**:
//! one [`scripts::RENEW_MANY`] per round of up to [`MAX_PER_SCRIPT`] locks (the same compare
//! and `PEXPIRE` per lock, the same answer per lock). A round starts at once when the previous one
//! started at least [`ROUND_SPACING`] ago, otherwise at that point, and takes every renewal asked
//! for until then: a lone renewal pays nothing extra; under load the server runs at most one
//! script per spacing (per `MAX_PER_SCRIPT` locks).
//!
//! A batch script touches keys of many locks, so it is for a standalone server or a Sentinel
//! primary (what the adapter connects to), not for a Redis Cluster, where keys of different hash
//! slots cannot meet in one script.

use std::sync::Arc;
use std::time::Duration;

use lease_core::{Error, Result};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::connection::Connection;
use crate::error::{bad_reply, Op};
use crate::keys::LockKeys;
use crate::scripts::{self, reply};

/// Locks per batch script (the script holds the server for its run: keep it short).
pub(crate) const MAX_PER_SCRIPT: usize = 256;

/// The least time between the starts of two rounds.
pub(crate) const ROUND_SPACING: Duration = Duration::from_millis(5);

struct Ask {
    keys: Arc<LockKeys>,
    head: String,
    ttl_ms: String,
    reply: oneshot::Sender<Result<i64>>,
}

/// The handle to a coordinator's renewal task.
#[derive(Debug, Clone)]
pub(crate) struct Renewals {
    tx: mpsc::UnboundedSender<Ask>,
}

impl Renewals {
    /// Starts the task on the current runtime. It ends when every handle is gone.
    pub(crate) fn start(conn: Arc<Connection>) -> Renewals {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(conn, rx));
        Renewals { tx }
    }

    /// Renews the lock `keys` for the owner `head` to `ttl_ms`, in the next round. The answer
    /// is the renew script's: `1` extended, else why not (`-2` revoked, `-1` another owner, `0`
    /// nobody).
    pub(crate) async fn renew(
        &self,
        keys: Arc<LockKeys>,
        head: &str,
        ttl_ms: String,
    ) -> Result<i64> {
        let (reply, rx) = oneshot::channel();
        let gone = || Error::Unavailable {
            backend: crate::error::BACKEND,
            message: "renew: the coordinator is shutting down".into(),
            source: None,
        };
        self.tx
            .send(Ask {
                keys,
                head: head.to_owned(),
                ttl_ms,
                reply,
            })
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

async fn run(conn: Arc<Connection>, mut rx: mpsc::UnboundedReceiver<Ask>) {
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
        let mut chunks = Vec::new();
        while !round.is_empty() {
            let rest = round.split_off(round.len().min(MAX_PER_SCRIPT));
            chunks.push(std::mem::replace(&mut round, rest));
        }
        futures::future::join_all(chunks.into_iter().map(|c| renew_chunk(&conn, c))).await;
    }
}

/// One script for `chunk` (the single-lock script for a chunk of one); answers every ask.
async fn renew_chunk(conn: &Connection, chunk: Vec<Ask>) {
    let keys: Vec<&str> = chunk
        .iter()
        .flat_map(|a| [a.keys.lock.as_str(), a.keys.revoked.as_str()])
        .collect();
    let args: Vec<&[u8]> = chunk
        .iter()
        .flat_map(|a| [a.head.as_bytes(), a.ttl_ms.as_bytes()])
        .collect();
    let script = if chunk.len() == 1 {
        &scripts::RENEW
    } else {
        &scripts::RENEW_MANY
    };
    let answer = conn.eval(Op::RENEW, script, &keys, &args).await;
    let codes: std::result::Result<Vec<i64>, Error> = answer.and_then(|v| {
        let codes = if chunk.len() == 1 {
            reply::int(&v).map(|c| vec![c])
        } else {
            reply::array(v).and_then(|items| items.iter().map(reply::int).collect())
        };
        codes
            .filter(|c| c.len() == chunk.len())
            .ok_or_else(|| bad_reply(Op::RENEW, "not one integer per lock"))
    });
    match codes {
        Ok(codes) => {
            for (a, code) in chunk.into_iter().zip(codes) {
                let _ = a.reply.send(Ok(code));
            }
        }
        Err(e) => {
            for a in chunk {
                let _ = a.reply.send(Err(e.replicate()));
            }
        }
    }
}
