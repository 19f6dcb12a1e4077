//! The holder monitor: notices promptly when the lock of a lease this coordinator holds is
//! deleted or overwritten behind its back, and marks every lease in doubt while the connection to
//! the server is broken.
//!
//! One background task per coordinator owns a dedicated RESP3 connection with
//! `CLIENT TRACKING ON` (Redis client-side caching, default mode, since Redis 6). Every key this
//! connection reads is remembered by the server, which pushes an `invalidate` message on the same
//! connection the next time anyone changes it (a write, a delete, an expiry, a flush). The task
//! reads the lock key of each lease it is told about ([`Monitor::watch`](crate::core::Monitor::watch)), at most [`WATCH_DELAY`]
//! after its grant (a lease released before then is never read), and nothing else, so
//! the server's tracking table and the messages grow with the number of held leases only. On an
//! invalidation of a held key it reads the key once more (which also re-arms the tracking):
//! still this lease's nonce, nothing happens (our own renew's `PEXPIRE` causes exactly that);
//! gone, or force-released (the key's `revoked` record, read next only for a key no longer this
//! lease's, is this lease's), the lease is `Lost(Revoked)`; another value, `Lost(Superseded)`.
//! A notification alone never marks a lease lost.
//!
//! Where tracking is unavailable (a server before 6.0, RESP3 refused, or `CLIENT` not permitted
//! by the ACL) the task falls back to polling: every `poll_interval` it reads every held lock key
//! in one pipeline on the command connection.
//!
//! While leases are held the task also `PING`s its connection every `poll_interval`; a ping
//! without a reply within the request timeout, or the connection closing, marks every lease of
//! the coordinator in doubt ([`lease_core::adapter::LeaseTracker::in_doubt`]) until its next confirmed
//! renew, and the task reconnects (and re-reads every held key) with a capped backoff.

use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::mpsc;

use lease_core::adapter::Backoff;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ProtocolVersion, PushInfo, PushKind, Value};
use tokio::time::Instant;

use crate::core::{Inner, WatchQueue};
use crate::error::BACKEND;

/// Starts the monitor task for `inner` (needs a tokio runtime, as `connect` does). The returned
/// receiver resolves once the first attempt to set up tracking has finished (either way), so
/// that `connect` can return with the monitor in place.
pub(crate) fn spawn(
    inner: Weak<Inner>,
    queue: Arc<WatchQueue>,
) -> tokio::sync::oneshot::Receiver<()> {
    let (ready, started) = tokio::sync::oneshot::channel();
    tokio::spawn(run(inner, queue, ready));
    started
}

/// How long after a grant the monitor first reads (and so starts tracking) the lease's key.
/// A lease released before then costs the server no read and no invalidation message, and this
/// task no work: under load most holdings are that short (measured with lease-bench, 64 tasks
/// on their own keys). A write by someone else in between is still seen by that first read:
/// detection of an outside write to a new lease is at most this much later.
pub(crate) const WATCH_DELAY: Duration = Duration::from_millis(50);

/// When the monitor wakes to read the keys of new leases, it also reads those granted up to this
/// much later than the one due, so that it wakes once per this period under a steady stream of
/// grants rather than once per grant (each key is read between `WATCH_DELAY - WATCH_BATCH` and
/// `WATCH_DELAY` after its grant).
const WATCH_BATCH: Duration = Duration::from_millis(25);

/// Why the tracking connection could not be set up.
enum Setup {
    /// The server answered with an error (no RESP3, no `CLIENT TRACKING`, not permitted):
    /// poll instead, for the life of the coordinator.
    Unsupported(String),
    /// The server could not be reached: try again later.
    Unavailable(String),
}

struct Tracking {
    conn: MultiplexedConnection,
    pushes: mpsc::UnboundedReceiver<PushInfo>,
}

async fn open_tracking(inner: &Inner) -> Result<Tracking, Setup> {
    let info = inner.conn.client().get_connection_info().clone();
    let settings = info
        .redis_settings()
        .clone()
        .set_protocol(ProtocolVersion::RESP3);
    let client = redis::Client::open(info.set_redis_settings(settings))
        .map_err(|e| Setup::Unsupported(e.to_string()))?;
    let (tx, pushes) = mpsc::unbounded_channel();
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(inner.config.connect_timeout()))
        .set_response_timeout(Some(inner.config.request_timeout()))
        .set_push_sender(tx);
    let classify = |e: redis::RedisError| {
        if e.code().is_some() {
            Setup::Unsupported(e.to_string())
        } else {
            Setup::Unavailable(e.to_string())
        }
    };
    let connect = client.get_multiplexed_async_connection_with_config(&config);
    let mut conn = tokio::time::timeout(inner.config.connect_timeout(), connect)
        .await
        .map_err(|_| Setup::Unavailable("connect timed out".to_owned()))?
        .map_err(classify)?;
    redis::cmd("CLIENT")
        .arg("TRACKING")
        .arg("ON")
        .query_async::<()>(&mut conn)
        .await
        .map_err(classify)?;
    Ok(Tracking { conn, pushes })
}

/// Marks every live lease of the coordinator in doubt.
pub(crate) fn all_in_doubt(inner: &Inner) {
    for live in inner.live_leases() {
        live.tracker.in_doubt();
    }
}

/// Reads `lock_keys` (all held ones for `None`) on `conn` and judges the leases on them. `Err`
/// when the read failed (the connection is in doubt).
async fn confirm(
    inner: &Weak<Inner>,
    conn: &mut MultiplexedConnection,
    lock_keys: Option<&[String]>,
) -> Result<(), ()> {
    let Some(strong) = inner.upgrade() else {
        return Ok(());
    };
    // The leases to judge are taken *before* the read: a lease granted after it is not judged
    // on a value read before its grant.
    let snapshot = match lock_keys {
        Some(keys) => strong.live_on(keys),
        None => strong.live_leases(),
    };
    drop(strong);
    if snapshot.is_empty() {
        return Ok(());
    }
    let mut keys: Vec<(&str, &str)> = snapshot
        .iter()
        .map(|l| (l.keys.lock(), l.keys.revoked()))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let index: std::collections::HashMap<&str, usize> =
        keys.iter().enumerate().map(|(i, (k, _))| (*k, i)).collect();
    let values = get_each(conn, keys.iter().map(|(lock, _)| *lock)).await?;
    // A lock that still holds its lease's value needs nothing more: our own renewal's `PEXPIRE`
    // invalidates the key, so that is the common case, one read per renewal. For the others the
    // key's revoked record (a force-release) is read next, so that a force-released lease whose
    // key the next holder has already taken is `Revoked`, not `Superseded`. Read after the lock,
    // it names only a force-release of this lease's value, which the lock's read already found
    // gone or replaced; the lease is lost either way, the record only names why.
    let mut stale: Vec<usize> = snapshot
        .iter()
        .filter_map(|lease| {
            let &i = index.get(lease.keys.lock())?;
            let ours = values[i]
                .as_deref()
                .is_some_and(|v| v.starts_with(lease.head.as_bytes()));
            (!ours).then_some(i)
        })
        .collect();
    stale.sort_unstable();
    stale.dedup();
    let mut revoked = vec![None; keys.len()];
    if !stale.is_empty() {
        let records = get_each(conn, stale.iter().map(|&i| keys[i].1)).await?;
        for (i, record) in stale.into_iter().zip(records) {
            revoked[i] = record;
        }
    }
    let Some(strong) = inner.upgrade() else {
        return Ok(());
    };
    for lease in &snapshot {
        let Some(&i) = index.get(lease.keys.lock()) else {
            continue;
        };
        strong.judge(lease, values[i].as_deref(), revoked[i].as_deref());
    }
    Ok(())
}

/// `GET`s `keys` in one pipeline on `conn`. `Err` when the read failed (the connection is in
/// doubt).
async fn get_each<'a>(
    conn: &mut MultiplexedConnection,
    keys: impl Iterator<Item = &'a str>,
) -> Result<Vec<Option<Vec<u8>>>, ()> {
    let mut pipe = redis::pipe();
    for key in keys {
        pipe.cmd("GET").arg(key);
    }
    // Each reply on its own: one key holding another type (an outside `HSET` of a lock key)
    // must not fail the read of every other lease's key.
    let replies: Vec<redis::RedisResult<Option<Vec<u8>>>> =
        pipe.ignore_errors().query_async(conn).await.map_err(|e| {
            tracing::debug!(backend = BACKEND, error = %e, "holder monitor read failed");
        })?;
    replies
        .into_iter()
        .map(|reply| match reply {
            Ok(value) => Ok(value),
            // Not a string, so not ours: judged as a foreign value.
            Err(e) if e.code() == Some("WRONGTYPE") => Ok(Some(Vec::new())),
            Err(e) => {
                tracing::debug!(backend = BACKEND, error = %e, "holder monitor read refused");
                Err(())
            }
        })
        .collect()
}

/// The lock keys named by an `invalidate` push, or `None` for "every key" (a flush).
fn invalidated(push: &PushInfo) -> Option<Vec<String>> {
    match push.data.first() {
        Some(Value::Array(keys)) | Some(Value::Set(keys)) => Some(
            keys.iter()
                .filter_map(|k| match k {
                    Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
                    Value::SimpleString(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
        ),
        _ => None,
    }
}

async fn run(inner: Weak<Inner>, watch: Arc<WatchQueue>, ready: tokio::sync::oneshot::Sender<()>) {
    let mut ready = Some(ready);
    let (poll, request_timeout) = match inner.upgrade() {
        Some(i) => (i.config.poll_interval(), i.config.request_timeout()),
        None => return,
    };
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut polling = false;
    loop {
        let opened = match inner.upgrade() {
            Some(i) if !polling => Some(open_tracking(&i).await),
            Some(_) => None,
            None => return,
        };
        if let Some(r) = ready.take() {
            let _ = r.send(());
        }
        match opened {
            Some(Ok(tracking)) => {
                backoff.reset();
                if track(&inner, &watch, tracking, poll).await.is_none() {
                    return;
                }
            }
            Some(Err(Setup::Unsupported(why))) => {
                tracing::info!(
                    backend = BACKEND,
                    reason = %why,
                    "client-side tracking unavailable; the holder monitor polls held keys every \
                     poll interval"
                );
                polling = true;
                continue;
            }
            Some(Err(Setup::Unavailable(why))) => {
                tracing::debug!(backend = BACKEND, reason = %why, "holder monitor cannot connect");
            }
            None => {
                if poll_held(&inner, &watch, poll, request_timeout)
                    .await
                    .is_none()
                {
                    return;
                }
            }
        }
        // The connection is gone (or never came): every lease is in doubt until renewed.
        if let Some(i) = inner.upgrade() {
            all_in_doubt(&i);
        }
        // Reconnected, the task reads every held key: the queued ones are not needed.
        let sleep = tokio::time::sleep(backoff.next_delay());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = &mut sleep => break,
                () = watch.changed() => {
                    if watch.is_closed() {
                        return;
                    }
                    watch.clear();
                }
            }
        }
    }
}

/// Serves one tracking connection until it breaks (`Some(())`) or the coordinator is gone
/// (`None`).
async fn track(
    inner: &Weak<Inner>,
    watch: &WatchQueue,
    mut t: Tracking,
    poll: Duration,
) -> Option<()> {
    // (Re)connected: read (and so track) every held key, judging each lease.
    watch.clear();
    if confirm(inner, &mut t.conn, None).await.is_err() {
        return Some(());
    }
    let mut heartbeat = tokio::time::interval(poll);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // The keys of new leases are read `WATCH_DELAY` after their grant.
        let next_due = watch.oldest().map(|at| at + WATCH_DELAY);
        tokio::select! {
            () = watch.changed() => {
                if watch.is_closed() {
                    return None;
                }
            }
            _ = async {
                match next_due {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                // Every key due now in one pipeline; `confirm` skips the leases that ended.
                let now = Instant::now();
                let keys = watch.take_granted_by(
                    now.checked_sub(WATCH_DELAY - WATCH_BATCH).unwrap_or(now),
                );
                if confirm(inner, &mut t.conn, Some(&keys)).await.is_err() {
                    return Some(());
                }
            }
            push = t.pushes.recv() => {
                let Some(push) = push else { return Some(()) };
                // Every invalidation already received is judged with this one, in one pipeline:
                // with thousands of held leases each renewal's `PEXPIRE` sends one.
                let mut keys = Some(Vec::new());
                let mut closed = false;
                let mut next = Some(push);
                while let Some(push) = next.take() {
                    match push.kind {
                        PushKind::Invalidate => match (invalidated(&push), keys.as_mut()) {
                            (Some(more), Some(all)) => all.extend(more),
                            // A flush: every held key.
                            (None, _) => keys = None,
                            (Some(_), None) => {}
                        },
                        PushKind::Disconnection => closed = true,
                        _ => {}
                    }
                    next = t.pushes.try_recv().ok();
                }
                if keys.as_ref().is_none_or(|k| !k.is_empty())
                    && confirm(inner, &mut t.conn, keys.as_deref()).await.is_err()
                {
                    return Some(());
                }
                if closed {
                    tracing::debug!(backend = BACKEND, "holder monitor connection closed");
                    return Some(());
                }
            }
            _ = heartbeat.tick() => {
                let held = inner.upgrade()?.has_live_leases();
                if held {
                    let ping = redis::cmd("PING").query_async::<()>(&mut t.conn).await;
                    if ping.is_err() {
                        tracing::debug!(backend = BACKEND, "holder monitor ping failed");
                        return Some(());
                    }
                }
            }
        }
    }
}

/// The fallback without tracking: reads every held key each `poll`, on the command connection.
/// Returns `Some(())` when a read failed (the leases are in doubt), `None` when the coordinator
/// is gone.
async fn poll_held(
    inner: &Weak<Inner>,
    watch: &WatchQueue,
    poll: Duration,
    request_timeout: Duration,
) -> Option<()> {
    let mut tick = tokio::time::interval(poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = watch.changed() => {
                if watch.is_closed() {
                    return None;
                }
                // Every held key is read at the next tick: the queued ones are not needed.
                watch.clear();
            }
            _ = tick.tick() => {
                let strong = inner.upgrade()?;
                if !strong.has_live_leases() {
                    continue;
                }
                let conn = strong.conn.clone();
                drop(strong);
                let got = tokio::time::timeout(request_timeout, conn.raw()).await;
                let Ok(Ok((generation, mut c))) = got else { return Some(()) };
                if confirm(inner, &mut c, None).await.is_err() {
                    conn.discard(Some(generation));
                    return Some(());
                }
            }
        }
    }
}
