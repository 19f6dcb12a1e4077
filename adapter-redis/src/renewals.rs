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
//! With replicas (`replica_acks`), a round's script goes with a `WAIT` in the same pipeline, as
//! a grant does: a renewal that fewer replicas than asked acknowledged in time extends nothing
//! (`Unavailable`), so a primary cut off from its replicas, which a failover may already have
//! replaced, cannot keep its leases held.
//!
//! A batch script touches keys of many locks, so it is for a standalone server or a Sentinel
//! primary. On a Redis Cluster node (the server says so in `INFO server`), where keys of
//! different hash slots cannot meet in one script, a round sends one script per lock instead.

use std::sync::Arc;
use std::time::Duration;

use lease_core::adapter::batch::{Rounds, RoundsConfig};
use lease_core::{Error, Result};

use crate::client::{Connection, WAITING_CONNECTIONS};
use crate::config::ReplicaAcks;
use crate::error::{bad_reply, ops, wrong_type, BACKEND};
use crate::keys::LockKeys;
use crate::scripts::{self, reply};

/// Locks per batch script (the script holds the server for its run: keep it short).
pub(crate) const MAX_PER_SCRIPT: usize = 256;

/// The least time between the starts of two rounds.
pub(crate) const ROUND_SPACING: Duration = Duration::from_millis(5);

/// One renewal: the lock, the owner's head, the TTL in milliseconds.
type Renewal = (Arc<LockKeys>, String, String);

/// The handle to a coordinator's renewal rounds ([`lease_core::adapter::batch::Rounds`]).
#[derive(Debug)]
pub(crate) struct Renewals {
    rounds: Rounds<Renewal, i64>,
}

impl Renewals {
    /// Rounds on `conn` (the task starts with the first renewal and ends with the coordinator),
    /// each acknowledged by the replicas `acks` asks for within `wait`.
    pub(crate) fn start(conn: Arc<Connection>, acks: ReplicaAcks, wait: Duration) -> Renewals {
        Renewals {
            rounds: Rounds::new(
                BACKEND,
                // As many scripts in flight as there are connections for writes that wait
                // (`replica_acks`): more would only queue for them.
                RoundsConfig::new(ROUND_SPACING, MAX_PER_SCRIPT).parallel(WAITING_CONNECTIONS),
                move |chunk| {
                    let conn = conn.clone();
                    async move { renew_chunk(&conn, acks, wait, chunk).await }
                },
            ),
        }
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
        self.rounds.ask((keys, head.to_owned(), ttl_ms)).await
    }
}

/// The renewals of `chunk`: one code per lock. On a Redis Cluster node, where the keys of
/// different locks are in different hash slots and one script touching several is refused
/// (`CROSSSLOT`), one script per lock, sent together.
async fn renew_chunk(
    conn: &Connection,
    acks: ReplicaAcks,
    wait: Duration,
    chunk: Vec<Renewal>,
) -> Result<Vec<Result<i64>>> {
    if chunk.len() == 1 || !conn.cluster_mode() {
        return renew_script(conn, acks, wait, chunk).await;
    }
    let each = chunk
        .into_iter()
        .map(|renewal| renew_script(conn, acks, wait, vec![renewal]));
    Ok(futures::future::join_all(each)
        .await
        .into_iter()
        .map(|answer| match answer {
            Ok(mut codes) => codes
                .pop()
                .unwrap_or_else(|| Err(bad_reply(ops::RENEW, "no answer for the lock"))),
            Err(e) => Err(e),
        })
        .collect())
}

/// One script for `chunk` (the single-lock script for a chunk of one): one code per lock;
/// `Unavailable` for each lock it extended when fewer replicas than `acks` asks for
/// acknowledged it within `wait`.
async fn renew_script(
    conn: &Connection,
    acks: ReplicaAcks,
    wait: Duration,
    chunk: Vec<Renewal>,
) -> Result<Vec<Result<i64>>> {
    let keys: Vec<&str> = chunk
        .iter()
        .flat_map(|(k, _, _)| [k.lock(), k.revoked()])
        .collect();
    let args: Vec<&[u8]> = chunk
        .iter()
        .flat_map(|(_, head, ttl)| [head.as_bytes(), ttl.as_bytes()])
        .collect();
    let script = if chunk.len() == 1 {
        &scripts::RENEW
    } else {
        &scripts::RENEW_MANY
    };
    let replicas = conn.acks_for(acks).await?;
    // Too few acknowledgements fail only the locks the script extended: a lock found not ours
    // (revoked, superseded, gone) is lost whatever the replicas have.
    let (v, unacked) = if replicas == 0 {
        (conn.eval(ops::RENEW, script, &keys, &args).await?, None)
    } else {
        let (v, acked) = conn
            .eval_and_wait(ops::RENEW, script, &keys, &args, replicas, wait, None)
            .await?;
        let unacked = ((acked as usize) < replicas).then(|| {
            format!(
                "renew: {acked} of the {replicas} replica(s) replica_acks asks for \
                 acknowledged it within {wait:?}; validity not extended"
            )
        });
        (v, unacked)
    };
    let codes = if chunk.len() == 1 {
        reply::int(&v).map(|c| vec![c])
    } else {
        reply::array(v).and_then(|items| items.iter().map(reply::int).collect())
    };
    let codes = codes
        .filter(|c| c.len() == chunk.len())
        .ok_or_else(|| bad_reply(ops::RENEW, "not one integer per lock"))?;
    Ok(codes
        .into_iter()
        .map(|c| match (c, &unacked) {
            (-3, _) => Err(wrong_type(ops::RENEW)),
            (1, Some(message)) => Err(Error::unavailable(BACKEND, message.clone())),
            (c, _) => Ok(c),
        })
        .collect())
}
