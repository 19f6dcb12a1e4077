//! A session's lock listings, releases and renewal checks, sent together under load
//! ([`lease_core::adapter::batch::Coalesce`]): the `getChildren` by which an acquire finds its
//! turn, the release's `delete`, and the `sync` + `exists` by which a renewal (or the check
//! after a reconnect) finds its node.
//!
//! A request is sent at once, as it is, while fewer than [`IN_FLIGHT`] of its kind are in flight:
//! an uncontended acquire or release costs what it did. Otherwise it waits for one of them to
//! finish and goes with every request of its kind that queued meanwhile, up to [`MAX_PER_MULTI`],
//! in one ZooKeeper multi: listings in one read-only multi (ZooKeeper 3.6 and later), where each
//! listing gets its own answer; deletes in one multi-op, which ZooKeeper applies all or nothing:
//! when one delete fails (its node is gone, its version changed), nothing was applied, that
//! delete gets its own error and the others are sent again without it. Each caller gets the
//! answer its request alone would have had.
//!
//! Renewal checks under load go behind one `sync`: a `sync`, then each check's `exists`,
//! pipelined (each request leaves when the client library's method is called, in call order).
//! The server answers each `exists` only after the `sync`, so each sees at least the leader's
//! state when it took the `sync`, which was sent after every check in the chunk was asked for:
//! what a `sync` + `exists` of its own would prove. 10,000 kept leases cost one `sync` per chunk
//! instead of one per renewal.
//!
//! The contender's `create` is not coalesced: the cleanup of an abandoned attempt lists the lock
//! after it and relies on the session processing requests in order, which a create waiting in a
//! queue would not keep.

use std::future::Future;
use std::time::Duration;

use lease_core::adapter::batch::{Coalesce, CoalesceConfig};
use tokio::time::Instant;
use zookeeper_client::{Client, Error as ZkError, MultiReadResult, MultiWriteError, Stat};

use crate::error::BACKEND;

/// Requests per multi.
pub(crate) const MAX_PER_MULTI: usize = 64;

/// Requests of one kind in flight at once before the next ones queue.
pub(crate) const IN_FLIGHT: usize = 2;

/// Checks behind one `sync`. They are requests of their own, pipelined, not a multi: a chunk
/// this large lets the thousands of in-doubt leases of a reconnect be checked in a few round
/// trips, before their validity runs out.
pub(crate) const CHECKS_PER_SYNC: usize = 1024;

type ZkResult<T> = std::result::Result<T, ZkError>;

/// A delete of one node, with the version it must have (`None`: any).
type Delete = (String, Option<i32>);

/// A check's answer: when the `sync` in front of it was sent (it succeeded, so it confirms the
/// session from then), and the node's stat (`None`: gone).
pub(crate) type Checked = (Instant, Option<Stat>);

/// A session's coalesced listings, deletes and renewal checks.
pub(crate) struct Coalesced {
    lists: Coalesce<String, ZkResult<Vec<String>>>,
    deletes: Coalesce<Delete, ZkResult<()>>,
    checks: Coalesce<String, ZkResult<Checked>>,
    client: Client,
    bound: Duration,
}

impl std::fmt::Debug for Coalesced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coalesced").finish_non_exhaustive()
    }
}

impl Coalesced {
    /// Sends on `client`, the checks' `sync` on `base`; a send without an answer after `bound`
    /// (the request timeout) is a `ConnectionLoss` for each of its requests (its callers, bounded
    /// by the same timeout from before they queued, have stopped waiting by then).
    pub(crate) fn new(client: &Client, bound: Duration, base: &str) -> Coalesced {
        let config = CoalesceConfig::new(IN_FLIGHT, MAX_PER_MULTI);
        let on = client.clone();
        let lists = Coalesce::new(BACKEND, config, move |dirs| {
            let client = on.clone();
            async move { Ok(list_chunk(&client, bound, dirs).await) }
        });
        let on = client.clone();
        let deletes = Coalesce::new(BACKEND, config, move |nodes| {
            let client = on.clone();
            async move { Ok(delete_chunk(&client, bound, nodes).await) }
        });
        let on = client.clone();
        let base = base.to_owned();
        let checks_config = CoalesceConfig::new(IN_FLIGHT, CHECKS_PER_SYNC);
        // A little past the callers' own bound (the same request timeout, from before they
        // queued), so that a check sent alone and not answered is reported by its caller as the
        // timeout it is, not as the connection loss the chunk's bound stands for.
        let checks_bound = bound + Duration::from_millis(10);
        let checks = Coalesce::new(BACKEND, checks_config, move |paths| {
            let (client, base) = (on.clone(), base.clone());
            async move { Ok(check_chunk(&client, checks_bound, &base, paths).await) }
        });
        Coalesced {
            lists,
            deletes,
            checks,
            client: client.clone(),
            bound,
        }
    }

    /// The children of `dir` (`getChildren`, alone or in a read-only multi).
    pub(crate) async fn children(&self, dir: &str) -> ZkResult<Vec<String>> {
        let alone = |dir: String| async move {
            Ok(bounded(self.bound, self.client.list_children(&dir)).await)
        };
        self.lists
            .ask_with(dir.to_owned(), alone)
            .await
            .unwrap_or(Err(ZkError::ConnectionLoss))
    }

    /// Deletes `path` if its version is `version` (any for `None`), alone or in a multi.
    pub(crate) async fn delete(&self, path: &str, version: Option<i32>) -> ZkResult<()> {
        let alone = |(path, version): Delete| async move {
            Ok(bounded(self.bound, self.client.delete(&path, version)).await)
        };
        self.deletes
            .ask_with((path.to_owned(), version), alone)
            .await
            .unwrap_or(Err(ZkError::ConnectionLoss))
    }

    /// `sync(<base>)` and then `exists(path)`, pipelined, alone or behind one `sync` with other
    /// checks. A failed `sync` is the error of every check behind it, whatever their answers.
    pub(crate) async fn synced_exists(&self, path: &str) -> ZkResult<Checked> {
        self.checks
            .ask(path.to_owned())
            .await
            .unwrap_or(Err(ZkError::ConnectionLoss))
    }
}

/// Answers for a chunk, none of which can fail as a whole (each caller gets its own result).
type Answers<T> = Vec<lease_core::Result<ZkResult<T>>>;

/// `request` within `bound`; one unanswered by then is `ConnectionLoss` for its callers (who,
/// bounded by the same timeout from before they queued, have stopped waiting).
async fn bounded<T>(bound: Duration, request: impl Future<Output = ZkResult<T>>) -> ZkResult<T> {
    tokio::time::timeout(bound, request)
        .await
        .unwrap_or(Err(ZkError::ConnectionLoss))
}

async fn list_chunk(client: &Client, bound: Duration, dirs: Vec<String>) -> Answers<Vec<String>> {
    if let [dir] = dirs.as_slice() {
        return vec![Ok(bounded(bound, client.list_children(dir)).await)];
    }
    let mut reader = client.new_multi_reader();
    let mut refused: Vec<Option<ZkError>> = Vec::with_capacity(dirs.len());
    for dir in &dirs {
        refused.push(reader.add_get_children(dir).err());
    }
    let results = match bounded(bound, reader.commit()).await {
        Ok(results) => results,
        Err(e) => return dirs.iter().map(|_| Ok(Err(e.clone()))).collect(),
    };
    let mut results = results.into_iter();
    refused
        .into_iter()
        .map(|refused| {
            Ok(match refused {
                Some(e) => Err(e),
                None => match results.next() {
                    Some(MultiReadResult::Children { children }) => Ok(children),
                    Some(MultiReadResult::Error { err }) => Err(err),
                    _ => Err(ZkError::UnexpectedError(
                        "a multi-read answered a listing with something else".into(),
                    )),
                },
            })
        })
        .collect()
}

async fn delete_chunk(client: &Client, bound: Duration, nodes: Vec<Delete>) -> Answers<()> {
    if let [(path, version)] = nodes.as_slice() {
        return vec![Ok(bounded(bound, client.delete(path, *version)).await)];
    }
    let mut answers: Vec<Option<ZkResult<()>>> = nodes.iter().map(|_| None).collect();
    // The deletes not answered yet, by their index in `nodes`.
    let mut pending: Vec<usize> = (0..nodes.len()).collect();
    while !pending.is_empty() {
        let mut writer = client.new_multi_writer();
        let mut sent = Vec::with_capacity(pending.len());
        for &i in &pending {
            let (path, version) = &nodes[i];
            match writer.add_delete(path, *version) {
                Ok(()) => sent.push(i),
                Err(e) => answers[i] = Some(Err(e)),
            }
        }
        if sent.is_empty() {
            break;
        }
        pending = match tokio::time::timeout(bound, writer.commit()).await {
            Ok(Ok(_)) => {
                for &i in &sent {
                    answers[i] = Some(Ok(()));
                }
                Vec::new()
            }
            // All or nothing: only this delete failed; the others were not applied, so they go
            // again without it.
            Ok(Err(MultiWriteError::OperationFailed { index, source })) if index < sent.len() => {
                answers[sent[index]] = Some(Err(source));
                sent.into_iter()
                    .enumerate()
                    .filter(|(at, _)| *at != index)
                    .map(|(_, i)| i)
                    .collect()
            }
            Ok(Err(e)) => {
                let e = ZkError::from(e);
                for &i in &sent {
                    answers[i] = Some(Err(e.clone()));
                }
                Vec::new()
            }
            Err(_) => {
                for &i in &sent {
                    answers[i] = Some(Err(ZkError::ConnectionLoss));
                }
                Vec::new()
            }
        };
    }
    answers
        .into_iter()
        .map(|a| Ok(a.unwrap_or(Err(ZkError::ConnectionLoss))))
        .collect()
}

async fn check_chunk(
    client: &Client,
    bound: Duration,
    base: &str,
    paths: Vec<String>,
) -> Answers<Checked> {
    let sent = Instant::now();
    let sync = client.sync(base);
    let exists = futures::future::join_all(paths.iter().map(|p| client.check_stat(p)));
    let Ok((synced, answers)) =
        tokio::time::timeout(bound, futures::future::join(sync, exists)).await
    else {
        return paths
            .iter()
            .map(|_| Ok(Err(ZkError::ConnectionLoss)))
            .collect();
    };
    match synced {
        Ok(()) => answers
            .into_iter()
            .map(|answer| Ok(answer.map(|stat| (sent, stat))))
            .collect(),
        Err(e) => paths.iter().map(|_| Ok(Err(e.clone()))).collect(),
    }
}
