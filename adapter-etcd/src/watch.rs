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
//! Two kinds of watch run on it:
//!
//! - A guardian waits for the **deletion** of one key from a start revision
//!   ([`Watcher::deleted`]), which resolves once: [`Seen::Deleted`], [`Seen::Detached`] when
//!   the key was written without its session lease, or [`Seen::Recheck`] when the server
//!   cancelled it (compaction past the start revision, no leader) or the watcher is gone; the
//!   caller then re-reads the key and watches again from after that read.
//! - The waiters of one lock share **one** watch of the lock's range ([`Watcher::lock`]): every
//!   deletion in the range, in revision order, goes to each of them ([`Lock::next`]), so a waiter
//!   that read the keys ahead of its own sees each of them go and knows it is first without a
//!   read, and a hand-off under contention costs no watch request at all (the watch stays while
//!   the lock has a local waiter). The watch starts at the server's current revision (etcd
//!   serves a watch whose start it has passed from its unsynced group, every 100 ms, and under
//!   contention the revision has nearly always moved on between a read and a watch), and each
//!   waiter is told the revision after which it sees every deletion ([`Range::From`]): one more
//!   read closes the gap when that is after the waiter's own read.
//!
//! When the stream breaks, the task opens a new one and creates every watch again from where it
//! had got to, so an event that happened while the stream was down is still delivered (or the
//! compaction says to re-read).
//!
//! Requests go out through a separate sending task per stream, so the task reading responses
//! never waits on a full request channel while the server waits for us to read its responses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
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
    /// The key was written without its session lease (an outside `put` without `--lease`,
    /// which detaches it from the session): read it and attach it again.
    Detached,
    /// The watch ended without an answer (compacted, cancelled by the server, watcher gone):
    /// read the key again.
    Recheck,
}

/// What a waiter's share of a lock's range watch ([`Lock`]) receives, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Range {
    /// Every deletion in the range at a revision after this one is delivered from here on
    /// (once, first).
    From(i64),
    /// Deletions in the range: each key with the revision it was deleted at, in revision order
    /// (a revision's deletions, such as a prefix delete's, all in one batch).
    Deleted(Arc<[(Vec<u8>, i64)]>),
    /// The watch ended (compacted, cancelled by the server, the watcher gone): nothing more
    /// comes; read the queue again and take a new share.
    Ended,
}

enum Command {
    Add {
        id: i64,
        key: Vec<u8>,
        lease: i64,
        from: i64,
        tx: oneshot::Sender<Seen>,
    },
    Remove(i64),
    /// `member` is unique among the watcher's ids, and is the watch's id if this is the lock's
    /// first waiter.
    Join {
        prefix: Vec<u8>,
        member: i64,
        tx: mpsc::UnboundedSender<Range>,
    },
    Leave {
        prefix: Vec<u8>,
        member: i64,
    },
}

/// The handle to a coordinator's watch task. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Watcher {
    tx: mpsc::UnboundedSender<Command>,
    next_id: Arc<AtomicI64>,
}

/// One pending deletion watch; dropping it cancels the watch on the server.
#[derive(Debug)]
pub(crate) struct Deletion {
    id: i64,
    rx: oneshot::Receiver<Seen>,
    tx: mpsc::UnboundedSender<Command>,
}

impl Deletion {
    /// Waits for the outcome (cancel-safe: may be polled again after a `select!` dropped it).
    pub(crate) async fn wait(&mut self) -> Seen {
        (&mut self.rx).await.unwrap_or(Seen::Recheck)
    }
}

impl Drop for Deletion {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Remove(self.id));
    }
}

/// A waiter's share of its lock's range watch; dropping it leaves the watch, which is cancelled
/// on the server when its last waiter leaves.
#[derive(Debug)]
pub(crate) struct Lock {
    prefix: Vec<u8>,
    member: i64,
    /// The revision of the [`Range::From`] received, once it was.
    from: Option<i64>,
    rx: mpsc::UnboundedReceiver<Range>,
    tx: mpsc::UnboundedSender<Command>,
}

impl Lock {
    /// The next thing the watch has for this waiter ([`Range::Ended`] once it is over).
    /// Cancel-safe.
    pub(crate) async fn next(&mut self) -> Range {
        let next = self.rx.recv().await.unwrap_or(Range::Ended);
        if let Range::From(from) = next {
            self.from = Some(from);
        }
        next
    }

    /// The revision after which this waiter sees every deletion, once [`Range::From`] told it.
    pub(crate) fn from(&self) -> Option<i64> {
        self.from
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Leave {
            prefix: std::mem::take(&mut self.prefix),
            member: self.member,
        });
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
            next_id: Arc::new(AtomicI64::new(1)),
        }
    }

    fn next_id(&self) -> i64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Watches for the deletion of `key`, attached to the session lease `lease`, at revision
    /// `from` or later, and for a write that detaches it from that lease.
    pub(crate) fn deleted(&self, key: Vec<u8>, lease: i64, from: i64) -> Deletion {
        let id = self.next_id();
        let (tx, rx) = oneshot::channel();
        // If the task is gone (the coordinator is being dropped), `wait` says Recheck.
        let _ = self.tx.send(Command::Add {
            id,
            key,
            lease,
            from,
            tx,
        });
        Deletion {
            id,
            rx,
            tx: self.tx.clone(),
        }
    }

    /// Joins the range watch of the lock whose keys start with `prefix` (creating it, from the
    /// server's current revision, if this is its first waiter). The first thing received is
    /// [`Range::From`].
    pub(crate) fn lock(&self, prefix: Vec<u8>) -> Lock {
        let member = self.next_id();
        let (tx, rx) = mpsc::unbounded_channel();
        // If the task is gone, `next` says Ended.
        let _ = self.tx.send(Command::Join {
            prefix: prefix.clone(),
            member,
            tx,
        });
        Lock {
            prefix,
            member,
            from: None,
            rx,
            tx: self.tx.clone(),
        }
    }
}

/// A guardian's watch of one key.
struct Entry {
    key: Vec<u8>,
    /// The session lease the key is attached to.
    lease: i64,
    from: i64,
    tx: oneshot::Sender<Seen>,
}

/// A lock's range watch and the waiters sharing it.
struct Shared {
    prefix: Vec<u8>,
    /// The revision after which every deletion has been or will be delivered: the creation
    /// answer's, then the last delivered deletion's; `None` until the server created it.
    seen: Option<i64>,
    members: HashMap<i64, mpsc::UnboundedSender<Range>>,
}

impl Shared {
    /// Where a watch created again on a new stream starts: after what was delivered, or at the
    /// current revision (0) if the first creation was never answered.
    fn from(&self) -> i64 {
        self.seen.map_or(0, |s| s + 1)
    }
}

/// Every watch of the task: guardians' and locks' (each by its watch id).
#[derive(Default)]
struct Watches {
    keys: HashMap<i64, Entry>,
    locks: HashMap<i64, Shared>,
    /// A lock's watch id, by the lock's prefix.
    lock_ids: HashMap<Vec<u8>, i64>,
}

impl Watches {
    fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.locks.is_empty()
    }

    /// Every watch as the request that creates it.
    fn requests(&self) -> Vec<Out> {
        let keys = self
            .keys
            .iter()
            .map(|(&id, e)| Out::Watch(id, e.key.clone(), e.from, false));
        let locks = self
            .locks
            .iter()
            .map(|(&id, s)| Out::Watch(id, s.prefix.clone(), s.from(), true));
        keys.chain(locks).collect()
    }
}

/// A lock's range watch (`prefix`) sees deletions only: a waiter enqueuing is no news to the
/// others. A guardian's watch of its key also sees writes, which may detach it from its session.
fn options(id: i64, from: i64, prefix: bool) -> WatchOptions {
    let o = WatchOptions::new()
        .with_start_revision(from)
        .with_watch_id(id);
    if prefix {
        o.with_filters([WatchFilterType::NoPut]).with_prefix()
    } else {
        o
    }
}

/// A request for the sending task of the current stream: a watch (id, key, start revision (0:
/// the current one), whether the key is a prefix), or a cancel.
enum Out {
    Watch(i64, Vec<u8>, i64, bool),
    Cancel(i64),
}

/// The current stream: its response half, and the channel to its sending task.
struct Stream {
    responses: etcd_client::WatchResponseStream,
    out: mpsc::UnboundedSender<Out>,
}

impl Stream {
    fn send(&self, out: Out) {
        let _ = self.out.send(out);
    }
}

async fn run(client: Client, timeout: Duration, mut rx: mpsc::UnboundedReceiver<Command>) {
    let mut watches = Watches::default();
    let mut stream: Option<Stream> = None;
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    loop {
        if stream.is_none() && !watches.is_empty() {
            match open(&client, timeout, watches.requests()).await {
                Some(s) => {
                    backoff.reset();
                    tracing::debug!(
                        watches = watches.keys.len() + watches.locks.len(),
                        "etcd watch stream open"
                    );
                    stream = Some(s);
                }
                None => {
                    // Keep taking commands while waiting to retry.
                    let wake = tokio::time::Instant::now() + backoff.next_delay();
                    loop {
                        tokio::select! {
                            _ = tokio::time::sleep_until(wake) => break,
                            c = rx.recv() => match c {
                                Some(c) => apply(&mut watches, None, c),
                                None => return,
                            },
                        }
                    }
                    continue;
                }
            }
        }
        tokio::select! {
            biased;
            c = rx.recv() => match c {
                Some(c) => apply(&mut watches, stream.as_ref(), c),
                None => return,
            },
            m = async {
                match stream.as_mut() {
                    Some(s) => s.responses.message().await,
                    None => std::future::pending().await,
                }
            } => match m {
                Ok(Some(resp)) => dispatch(&mut watches, stream.as_ref(), resp),
                Ok(None) | Err(_) => {
                    tracing::debug!("etcd watch stream broken; reopening");
                    stream = None;
                }
            },
        }
    }
}

/// Opens a stream with the first of `watches`, sends the others on it, and starts its sending
/// task.
async fn open(client: &Client, timeout: Duration, watches: Vec<Out>) -> Option<Stream> {
    let mut watches = watches.into_iter();
    let Some(Out::Watch(id, key, from, prefix)) = watches.next() else {
        return None;
    };
    let opened = retry_unapplied(timeout, || {
        let mut watch_client = client.watch_client();
        let (key, opts) = (key.clone(), options(id, from, prefix));
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
    let stream = Stream { responses, out };
    for other in watches {
        stream.send(other);
    }
    Some(stream)
}

fn apply(watches: &mut Watches, stream: Option<&Stream>, c: Command) {
    match c {
        Command::Add {
            id,
            key,
            lease,
            from,
            tx,
        } => {
            if let Some(s) = stream {
                s.send(Out::Watch(id, key.clone(), from, false));
            }
            watches.keys.insert(
                id,
                Entry {
                    key,
                    lease,
                    from,
                    tx,
                },
            );
        }
        Command::Remove(id) => {
            if watches.keys.remove(&id).is_some() {
                if let Some(s) = stream {
                    s.send(Out::Cancel(id));
                }
            }
        }
        Command::Join { prefix, member, tx } => {
            let id = match watches.lock_ids.get(&prefix) {
                Some(&id) => id,
                None => {
                    let id = member;
                    if let Some(s) = stream {
                        s.send(Out::Watch(id, prefix.clone(), 0, true));
                    }
                    watches.lock_ids.insert(prefix.clone(), id);
                    let members = HashMap::new();
                    let seen = None;
                    watches.locks.insert(
                        id,
                        Shared {
                            prefix,
                            seen,
                            members,
                        },
                    );
                    id
                }
            };
            let shared = watches
                .locks
                .get_mut(&id)
                .expect("a lock id names its watch");
            if let Some(seen) = shared.seen {
                let _ = tx.send(Range::From(seen));
            }
            shared.members.insert(member, tx);
        }
        Command::Leave { prefix, member } => {
            let Some(&id) = watches.lock_ids.get(&prefix) else {
                return;
            };
            let Some(shared) = watches.locks.get_mut(&id) else {
                return;
            };
            shared.members.remove(&member);
            if shared.members.is_empty() {
                watches.locks.remove(&id);
                watches.lock_ids.remove(&prefix);
                if let Some(s) = stream {
                    s.send(Out::Cancel(id));
                }
            }
        }
    }
}

fn dispatch(watches: &mut Watches, stream: Option<&Stream>, resp: WatchResponse) {
    let id = resp.watch_id();
    let ended = resp.canceled() || resp.compact_revision() > 0;
    if let Some(shared) = watches.locks.get_mut(&id) {
        if ended {
            // Cancelled by the server (compacted, no leader): every waiter reads again and joins
            // a new watch.
            for tx in shared.members.values() {
                let _ = tx.send(Range::Ended);
            }
            let prefix = shared.prefix.clone();
            watches.locks.remove(&id);
            watches.lock_ids.remove(&prefix);
            return;
        }
        if resp.created() {
            // Its start: the header of the first creation answer (a creation again on a new
            // stream resumes where the first left off, and says nothing new).
            if shared.seen.is_none() {
                let Some(revision) = resp.header().map(|h| h.revision()).filter(|r| *r > 0) else {
                    // Without the revision nobody knows what it covers: end it.
                    for tx in shared.members.values() {
                        let _ = tx.send(Range::Ended);
                    }
                    let prefix = shared.prefix.clone();
                    watches.locks.remove(&id);
                    watches.lock_ids.remove(&prefix);
                    if let Some(s) = stream {
                        s.send(Out::Cancel(id));
                    }
                    return;
                };
                shared.seen = Some(revision);
                for tx in shared.members.values() {
                    let _ = tx.send(Range::From(revision));
                }
            }
            return;
        }
        let deleted: Arc<[(Vec<u8>, i64)]> = resp
            .events()
            .iter()
            .filter(|e| e.event_type() == EventType::Delete)
            .filter_map(|e| e.kv())
            .map(|kv| (kv.key().to_vec(), kv.mod_revision()))
            .collect();
        if let Some(&(_, last)) = deleted.last() {
            shared.seen = Some(shared.seen.map_or(last, |s| s.max(last)));
            for tx in shared.members.values() {
                let _ = tx.send(Range::Deleted(deleted.clone()));
            }
        }
        return;
    }
    let seen = if ended {
        // Cancelled by the server (compacted past the start, no leader): the watch is over.
        Seen::Recheck
    } else {
        let Some(entry) = watches.keys.get(&id) else {
            return;
        };
        let events = resp.events();
        if events.iter().any(|e| e.event_type() == EventType::Delete) {
            Seen::Deleted
        } else if events
            .iter()
            .filter_map(|e| e.kv())
            .any(|kv| kv.lease() != entry.lease)
        {
            Seen::Detached
        } else {
            // A write that keeps the key on its session (the guardian attaching it again).
            return;
        }
    };
    if let Some(e) = watches.keys.remove(&id) {
        let _ = e.tx.send(seen);
        // A watch the server ended needs no cancel.
        if !ended {
            if let Some(s) = stream {
                s.send(Out::Cancel(id));
            }
        }
    }
}
