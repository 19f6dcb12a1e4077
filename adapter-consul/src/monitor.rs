//! Loss detection per coordinator, not per lease: ONE `?consistent` blocking query over the
//! coordinator's lock prefix (`GET /v1/kv/<prefix>/locks/?recurse`) watches every held key.
//!
//! Consul's Go `api.Lock` watches each lock with its own blocking query (`monitorLock`); each
//! holds one HTTP/1.1 connection for up to its wait, so N held leases were N connections (a real
//! agent refuses more than `limits.http_max_conns_per_client`, 200 by default, from one address).
//! Here one task per coordinator, running while the coordinator's leases are held, sends one
//! blocking query from the last `X-Consul-Index`; every answer is **dispatched** to the held
//! leases: a held key that is gone is `Lost(Revoked)` (`SessionEnded` if the session is known
//! gone), a key locked by another session (or unlocked) is `Lost(Superseded)`, a key still
//! locked by the lease's session is nothing (an outside write keeps the session: still ours).
//!
//! `recurse` rather than `keys`: only the entries carry `Session`, and "still ours" is the session
//! (decision 0011); a key list would show a vanished key but not a key that changed hands between
//! two answers. The answer holds every key under the prefix, other clients' locks included: its
//! size follows the prefix's keys (about 250 bytes each), not ours alone (decision 0015).
//!
//! Cost bounds (Consul's blocking-query guidance):
//! - an answer is judged only for leases whose token (the acquire's index) is at most the answer's
//!   `X-Consul-Index`: an older answer (a query sent before the acquire committed) says nothing
//!   about them;
//! - the index is reset to 0 when it goes backwards (a snapshot restore) and kept at least 1;
//! - queries start at most once per [`spacing`] (100 ms plus 100 µs per entry of the previous
//!   answer, at most 2 s), so other clients' writes under the prefix cost at most that rate;
//! - errors back off from 20 ms to 1 s. A query that fails for any reason but a refusal (the
//!   agent unreachable, a timeout, a 5xx, a 429) puts every watched lease in doubt: an agent
//!   that leaves the cluster ends its node's sessions, ours included, and stops answering, so a
//!   key may change hands unseen before the next renewal would fail. The session's next
//!   renewal, and a read of the key, make a lease held again (renewals stay the authority on
//!   ownership). A refused query (`Misconfigured`, such as a token without `key:list` on the
//!   prefix) is logged as a warning once and puts no lease in doubt: loss is then noticed by
//!   renewals alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lease_core::adapter::Backoff;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::client::{Http, KvEntry};

/// The least time between the starts of two monitor queries.
pub(crate) const MIN_SPACING: Duration = Duration::from_millis(100);

/// The most time between the starts of two monitor queries when the prefix keeps changing.
pub(crate) const MAX_SPACING: Duration = Duration::from_secs(2);

/// The spacing after an answer of `entries` entries: 100 ms plus 100 µs per entry, at most 2 s
/// (10,000 keys: 1.1 s), so the work of reading and judging a large prefix stays a bounded share
/// of the time even when other clients write under it all the time.
pub(crate) fn spacing(entries: usize) -> Duration {
    (MIN_SPACING + Duration::from_micros(100) * u32::try_from(entries).unwrap_or(u32::MAX))
        .min(MAX_SPACING)
}

/// What the monitor judges (implemented by the lease's shared state in `lease.rs`; the monitor
/// knows leases only through this, so it does not depend on them).
pub(crate) trait Watched: Send + Sync {
    /// The lease's Consul key.
    fn kv_key(&self) -> &str;
    /// The index of the write that acquired it: an answer older than that says nothing of it.
    fn acquired_at_index(&self) -> u64;
    /// Whether it is lost already (no longer watched).
    fn is_lost(&self) -> bool;
    /// What an answer showed of its key (`None`: gone).
    fn seen(&self, entry: Option<&KvEntry>);
    /// A query went unanswered: the key may have changed hands unseen.
    fn in_doubt(&self);
}

#[derive(Default)]
struct Held {
    leases: HashMap<u64, Weak<dyn Watched>>,
    /// Whether the monitor task runs (it stops when nothing is held).
    running: bool,
}

struct State {
    held: Mutex<Held>,
    /// Woken when the last held lease is gone: the query in flight is abandoned.
    idle: Notify,
}

impl State {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The lock monitor of one coordinator (see the module documentation).
pub(crate) struct Monitor {
    http: Arc<Http>,
    prefix: String,
    max_block: Duration,
    state: Arc<State>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("prefix", &self.prefix)
            .field("held", &self.state.lock().leases.len())
            .finish_non_exhaustive()
    }
}

impl Monitor {
    /// A monitor of the keys under `prefix`, blocking up to `max_block` per query. Sends nothing
    /// until a lease is watched.
    pub(crate) fn new(http: Arc<Http>, prefix: String, max_block: Duration) -> Self {
        Monitor {
            http,
            prefix,
            max_block,
            state: Arc::new(State {
                held: Mutex::new(Held::default()),
                idle: Notify::new(),
            }),
        }
    }

    /// Watches the key of the lease `id` until it is lost or unwatched; starts the task if it
    /// is not running.
    pub(crate) fn watch(&self, id: u64, lease: Weak<dyn Watched>) {
        let mut held = self.state.lock();
        held.leases.insert(id, lease);
        if !held.running {
            held.running = true;
            tokio::spawn(run(
                self.http.clone(),
                self.prefix.clone(),
                self.max_block,
                self.state.clone(),
            ));
        }
    }

    /// Stops watching the lease `id` (idempotent); the task stops when nothing is left.
    pub(crate) fn unwatch(&self, id: u64) {
        let mut held = self.state.lock();
        held.leases.remove(&id);
        if held.leases.is_empty() {
            self.state.idle.notify_one();
        }
    }
}

/// The live, unsettled leases watched; `None` (and the task marked stopped) if there are none.
fn live(state: &State) -> Option<Vec<Arc<dyn Watched>>> {
    let mut held = state.lock();
    let mut live = Vec::with_capacity(held.leases.len());
    held.leases.retain(|_, w| match w.upgrade() {
        Some(l) if !l.is_lost() => {
            live.push(l);
            true
        }
        _ => false,
    });
    if live.is_empty() {
        held.running = false;
        None
    } else {
        Some(live)
    }
}

async fn run(http: Arc<Http>, prefix: String, max_block: Duration, state: Arc<State>) {
    let mut index = 0u64;
    let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
    let mut next_start = Instant::now();
    let mut warned = false;
    loop {
        if live(&state).is_none() {
            return;
        }
        tokio::time::sleep_until(next_start).await;
        let started = Instant::now();
        let read = tokio::select! {
            r = http.kv_list(&prefix, index, max_block, "monitor") => Some(r),
            () = state.idle.notified() => None,
        };
        let Some(read) = read else { continue };
        match read {
            Ok((seen, entries)) => {
                backoff.reset();
                // Consul's guidance: reset when the index goes backwards, never block from 0.
                index = if seen < index { 0 } else { seen.max(1) };
                next_start = started + spacing(entries.len());
                let Some(leases) = live(&state) else { return };
                dispatch(&leases, seen, &entries);
            }
            Err(e @ lease_core::Error::Misconfigured { .. }) => {
                if !std::mem::replace(&mut warned, true) {
                    tracing::warn!(prefix = %prefix, error = %e, "consul lock monitor refused (a token without key:list on the prefix is refused so): a lost lock is noticed by renewals alone");
                }
                next_start = Instant::now() + backoff.next_delay();
            }
            Err(e) => {
                tracing::debug!(prefix = %prefix, error = %e, "consul lock monitor: read failed; its leases are in doubt; retrying");
                if let Some(leases) = live(&state) {
                    for lease in &leases {
                        lease.in_doubt();
                    }
                }
                next_start = Instant::now() + backoff.next_delay();
            }
        }
    }
}

/// Judges every lease the answer (at index `seen`) speaks for.
fn dispatch(leases: &[Arc<dyn Watched>], seen: u64, entries: &[KvEntry]) {
    let by_key: HashMap<&str, &KvEntry> = entries.iter().map(|e| (e.key.as_str(), e)).collect();
    for lease in leases {
        // An answer older than the lease's acquire says nothing about it.
        if lease.acquired_at_index() > seen {
            continue;
        }
        lease.seen(by_key.get(lease.kv_key()).copied());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spacing_grows_with_the_answer_and_is_bounded() {
        assert_eq!(spacing(0), MIN_SPACING);
        assert_eq!(spacing(10_000), Duration::from_millis(1_100));
        assert_eq!(spacing(usize::MAX), MAX_SPACING);
    }
}
