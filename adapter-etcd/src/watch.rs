//! One watch stream per coordinator, shared by every lease and waiter.
//!
//! etcd multiplexes any number of watches on one `Watch` stream, each under its own watch id.
//! Every guardian (is our key still there?) and every waiter (is my predecessor gone?) used to
//! open a stream of its own: 10,000 held leases meant 10,000 HTTP/2 streams, each reset when its
//! lease ended (h2 closes a connection after 1,024 local resets), and 10,000 streams to re-open
//! after a reconnect. Here a coordinator has **one** stream, owned by one task; a watch is one
//! create request on it (client-chosen id, so its answers are matched by id) and one cancel
//! request when it is no longer needed.
//!
//! A watch here waits for the **deletion** of one key from a start revision ([`Watcher::deleted`])
//! and resolves once: [`Seen::Deleted`], or [`Seen::Recheck`] when the server cancelled it
//! (compaction past the start revision, no leader) or the watcher is gone; the caller then
//! re-reads the key and watches again from after that read. A waiter whose predecessor is the
//! only key ahead of its own watches the lock's whole range instead ([`Watcher::turn`]): the
//! deletions of the range come in revision order, so the predecessor's deletion with no deletion
//! of the waiter's own key at or before it proves, without a read, that the waiter is first.
//!
//! A waiter's watch starts at the server's current revision ([`Watcher::deleted_from_now`],
//! [`Watcher::turn`]), which the creation answer tells ([`Deletion::created`]): etcd serves a
//! watch whose start it has already passed from its unsynced group, every 100 ms, and under
//! contention the revision has nearly always moved on between a waiter's read and its watch. The
//! waiter reads once more when the creation came after its read. When the stream breaks, the task
//! opens a new one and creates every pending watch again from its own start revision, so an event
//! that happened while the stream was down is still delivered (or the compaction says to re-read).
//!
//! Requests go out through a separate sending task per stream, so the task reading responses
//! never waits on a full request channel while the server waits for us to read its responses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use etcd_client::{Client, EventType, WatchFilterType, WatchOptions, WatchResponse};
use lease_core::adapter::Backoff;
use tokio::sync::{mpsc, oneshot};

use crate::error::retry_unapplied;

/// What a deletion watch saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// The key was deleted at or after the start revision.
    Deleted,
    /// ([`Watcher::turn`]) The predecessor was deleted at this revision, and the waiter's own key
    /// was not deleted at or before it.
    Turn(i64),
    /// The watch ended without an answer (compacted, cancelled by the server, watcher gone):
    /// read the key again.
    Recheck,
}

enum Command {
    Add {
        id: i64,
        key: Vec<u8>,
        from: i64,
        turn: Option<Turn>,
        tx: oneshot::Sender<Seen>,
        created: Option<oneshot::Sender<i64>>,
    },
    Remove(i64),
}

/// The handle to a coordinator's watch task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Watcher {
    tx: mpsc::UnboundedSender<Command>,
    next_id: std::sync::Arc<AtomicI64>,
}

/// One pending deletion watch; dropping it cancels the watch on the server.
#[derive(Debug)]
pub(crate) struct Deletion {
    id: i64,
    rx: oneshot::Receiver<Seen>,
    /// For a watch from the current revision: the server's answer to its creation.
    created: Option<oneshot::Receiver<i64>>,
    /// The outcome, when it came while waiting for the creation.
    ended: Option<Seen>,
    tx: mpsc::UnboundedSender<Command>,
}

impl Deletion {
    /// Waits for the outcome (cancel-safe: may be polled again after a `select!` dropped it).
    pub(crate) async fn wait(&mut self) -> Seen {
        if let Some(seen) = self.ended.take() {
            return seen;
        }
        (&mut self.rx).await.unwrap_or(Seen::Recheck)
    }

    /// For a watch from the current revision ([`Watcher::deleted_from_now`],
    /// [`Watcher::turn`]): the revision the server was at when it created the watch, whose
    /// events start at the next one. `None` if the watch ended first (its outcome is then
    /// [`Deletion::wait`]'s), if the server's answer had no revision, or if the watch was given
    /// its start (or this was asked before). Cancel-safe.
    pub(crate) async fn created(&mut self) -> Option<i64> {
        let created = self.created.as_mut()?;
        let answer = tokio::select! {
            biased;
            r = created => r.ok(),
            seen = &mut self.rx => {
                self.ended = Some(seen.unwrap_or(Seen::Recheck));
                None
            }
        };
        self.created = None;
        answer
    }
}

impl Drop for Deletion {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Remove(self.id));
    }
}

impl Watcher {
    /// Starts the watch task on the current runtime.
    pub(crate) fn start(client: Client, request_timeout: Duration) -> Watcher {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(client, request_timeout, rx));
        Watcher {
            tx,
            // 0 asks the server to choose the id: ours start at 1.
            next_id: std::sync::Arc::new(AtomicI64::new(1)),
        }
    }

    /// Watches for the deletion of `key` at revision `from` or later.
    pub(crate) fn deleted(&self, key: Vec<u8>, from: i64) -> Deletion {
        self.add(key, Some(from), None)
    }

    /// Watches for the deletion of `key` from the server's current revision, which
    /// [`Deletion::created`] tells. A watch whose start the server has already passed waits in
    /// etcd's unsynced group, served every 100 ms; this one is synced from its creation, so a
    /// caller that read the key at an earlier revision reads it once more if the creation came
    /// later (the deletions in between are not delivered).
    pub(crate) fn deleted_from_now(&self, key: Vec<u8>) -> Deletion {
        self.add(key, None, None)
    }

    /// Watches the deletions in the lock range `prefix` from the current revision (as
    /// [`Watcher::deleted_from_now`]), for the deletion of `predecessor` (the only key ahead of
    /// `own` as of the caller's last read, at or after the revision [`Deletion::created`] tells):
    /// [`Seen::Turn`] once it is deleted and `own` was not deleted at or before that revision;
    /// [`Seen::Recheck`] once `own` is deleted first (or together, as by a prefix delete), or the
    /// watch ends without an answer.
    pub(crate) fn turn(&self, prefix: Vec<u8>, predecessor: Vec<u8>, own: Vec<u8>) -> Deletion {
        self.add(prefix, None, Some(Turn { predecessor, own }))
    }

    /// `from`: the start revision, or `None` for the server's current one.
    fn add(&self, key: Vec<u8>, from: Option<i64>, turn: Option<Turn>) -> Deletion {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let (created_tx, created) = match from {
            Some(_) => (None, None),
            None => {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            }
        };
        let add = Command::Add {
            id,
            key,
            // 0 asks the server for its current revision.
            from: from.unwrap_or(0),
            turn,
            tx,
            created: created_tx,
        };
        if self.tx.send(add).is_err() {
            // The task is gone (the coordinator is being dropped): `wait` says Recheck.
        }
        Deletion {
            id,
            rx,
            created,
            ended: None,
            tx: self.tx.clone(),
        }
    }
}

/// What a range watch of [`Watcher::turn`] waits for.
#[derive(Debug, Clone)]
struct Turn {
    predecessor: Vec<u8>,
    own: Vec<u8>,
}

struct Entry {
    /// The key, or the range's prefix for a [`Turn`].
    key: Vec<u8>,
    /// The start revision; 0 (the current one) until the server's creation answer sets it, so
    /// a watch created again on a new stream resumes where the first one started.
    from: i64,
    turn: Option<Turn>,
    tx: oneshot::Sender<Seen>,
    /// Told the revision of the creation answer, for a watch from the current revision.
    created: Option<oneshot::Sender<i64>>,
}

fn options(id: i64, from: i64, prefix: bool) -> WatchOptions {
    let o = WatchOptions::new()
        .with_start_revision(from)
        .with_filters([WatchFilterType::NoPut])
        .with_watch_id(id);
    if prefix {
        o.with_prefix()
    } else {
        o
    }
}

/// A request for the sending task of the current stream: a watch (id, key, start revision, whether
/// the key is a prefix), or a cancel.
enum Out {
    Watch(i64, Vec<u8>, i64, bool),
    Cancel(i64),
}

/// The current stream: its response half, and the channel to its sending task.
struct Stream {
    responses: etcd_client::WatchResponseStream,
    out: mpsc::UnboundedSender<Out>,
}

async fn run(client: Client, timeout: Duration, mut rx: mpsc::UnboundedReceiver<Command>) {
    let mut entries: HashMap<i64, Entry> = HashMap::new();
    let mut stream: Option<Stream> = None;
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        if stream.is_none() {
            if let Some((&id, first)) = entries.iter().next() {
                match open(&client, timeout, id, first).await {
                    Some(s) => {
                        for (&other, e) in &entries {
                            if other != id {
                                let _ = s.out.send(Out::Watch(
                                    other,
                                    e.key.clone(),
                                    e.from,
                                    e.turn.is_some(),
                                ));
                            }
                        }
                        backoff.reset();
                        tracing::debug!(watches = entries.len(), "etcd watch stream open");
                        stream = Some(s);
                    }
                    None => {
                        // Keep taking commands while waiting to retry.
                        let wake = tokio::time::Instant::now() + backoff.next_delay();
                        loop {
                            tokio::select! {
                                _ = tokio::time::sleep_until(wake) => break,
                                c = rx.recv() => match c {
                                    Some(c) => apply(&mut entries, None, c),
                                    None => return,
                                },
                            }
                        }
                        continue;
                    }
                }
            }
        }
        tokio::select! {
            biased;
            c = rx.recv() => match c {
                Some(c) => apply(&mut entries, stream.as_ref(), c),
                None => return,
            },
            m = async {
                match stream.as_mut() {
                    Some(s) => s.responses.message().await,
                    None => std::future::pending().await,
                }
            } => match m {
                Ok(Some(resp)) => dispatch(&mut entries, stream.as_ref(), resp),
                Ok(None) | Err(_) => {
                    tracing::debug!(watches = entries.len(), "etcd watch stream broken; reopening");
                    stream = None;
                }
            },
        }
    }
}

/// Opens a stream with `first`'s watch and starts its sending task.
async fn open(client: &Client, timeout: Duration, id: i64, first: &Entry) -> Option<Stream> {
    let opened = retry_unapplied(timeout, || {
        let mut watch_client = client.watch_client();
        let (key, opts) = (
            first.key.clone(),
            options(id, first.from, first.turn.is_some()),
        );
        async move { watch_client.watch(key, Some(opts)).await }
    })
    .await
    .ok()?;
    let (mut sender, responses) = opened.split();
    let (out, mut out_rx) = mpsc::unbounded_channel::<Out>();
    tokio::spawn(async move {
        while let Some(o) = out_rx.recv().await {
            let sent = match o {
                Out::Watch(id, key, from, prefix) => {
                    sender.watch(key, Some(options(id, from, prefix))).await
                }
                Out::Cancel(id) => sender.cancel(id).await,
            };
            if sent.is_err() {
                return;
            }
        }
    });
    Some(Stream { responses, out })
}

fn apply(entries: &mut HashMap<i64, Entry>, stream: Option<&Stream>, c: Command) {
    match c {
        Command::Add {
            id,
            key,
            from,
            turn,
            tx,
            created,
        } => {
            if let Some(s) = stream {
                let _ = s
                    .out
                    .send(Out::Watch(id, key.clone(), from, turn.is_some()));
            }
            entries.insert(
                id,
                Entry {
                    key,
                    from,
                    turn,
                    tx,
                    created,
                },
            );
        }
        Command::Remove(id) => {
            if entries.remove(&id).is_some() {
                if let Some(s) = stream {
                    let _ = s.out.send(Out::Cancel(id));
                }
            }
        }
    }
}

fn dispatch(entries: &mut HashMap<i64, Entry>, stream: Option<&Stream>, resp: WatchResponse) {
    let id = resp.watch_id();
    if resp.created() && !resp.canceled() {
        // A creation answer carries no events; for a watch from the current revision its header
        // is that revision, and its events start at the next one.
        if let Some(entry) = entries.get_mut(&id) {
            if let Some(created) = entry.created.take() {
                // Without a header the start is unknown: dropping `created` tells the caller
                // (its `created()` says `None`), which reads again.
                if let Some(revision) = resp.header().map(|h| h.revision()).filter(|r| *r > 0) {
                    entry.from = revision + 1;
                    let _ = created.send(revision);
                }
            }
        }
        return;
    }
    let seen = if resp.canceled() || resp.compact_revision() > 0 {
        // Cancelled by the server (compacted past the start, no leader): the watch is over.
        Seen::Recheck
    } else {
        let Some(entry) = entries.get(&id) else {
            return;
        };
        let mut deletions = resp
            .events()
            .iter()
            .filter(|e| e.event_type() == EventType::Delete)
            .filter_map(|e| e.kv())
            .map(|kv| (kv.key(), kv.mod_revision()));
        let seen = match &entry.turn {
            None => deletions.next().map(|_| Seen::Deleted),
            Some(turn) => turn_seen(turn, deletions),
        };
        match seen {
            Some(seen) => seen,
            None => return,
        }
    };
    if let Some(e) = entries.remove(&id) {
        let _ = e.tx.send(seen);
        // A watch the server ended needs no cancel.
        if !resp.canceled() && resp.compact_revision() == 0 {
            if let Some(s) = stream {
                let _ = s.out.send(Out::Cancel(id));
            }
        }
    }
}

/// What a [`Turn`] watch learns from one response's deletions (key, revision), in revision
/// order: `Recheck` if the own key is deleted (the server never splits a revision's events
/// across responses, so a prefix delete that removes both keys is seen whole), `Turn` if only the
/// predecessor is, nothing yet otherwise.
fn turn_seen<'a>(
    turn: &Turn,
    mut deletions: impl Iterator<Item = (&'a [u8], i64)>,
) -> Option<Seen> {
    let mut pred_at = None;
    for (key, rev) in deletions.by_ref() {
        if key == turn.own.as_slice() {
            return Some(Seen::Recheck);
        }
        if key == turn.predecessor.as_slice() {
            pred_at = Some(rev);
        }
    }
    pred_at.map(Seen::Turn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turn_is_the_predecessors_deletion_without_ours() {
        let turn = Turn {
            predecessor: b"l/p".to_vec(),
            own: b"l/o".to_vec(),
        };
        let seen = |d: &[(&'static [u8], i64)]| turn_seen(&turn, d.iter().copied());
        assert_eq!(seen(&[]), None);
        // A key behind ours leaving changes nothing.
        assert_eq!(seen(&[(b"l/z", 5)]), None);
        assert_eq!(seen(&[(b"l/z", 5), (b"l/p", 6)]), Some(Seen::Turn(6)));
        // Ours gone first, or in the same response (a prefix delete): read again.
        assert_eq!(seen(&[(b"l/o", 5), (b"l/p", 6)]), Some(Seen::Recheck));
        assert_eq!(seen(&[(b"l/p", 7), (b"l/o", 7)]), Some(Seen::Recheck));
        assert_eq!(seen(&[(b"l/o", 7)]), Some(Seen::Recheck));
    }
}
