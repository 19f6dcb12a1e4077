//! [`Dependents`]: the leases that live on one session or connection, told when it ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// A number no other call in this process gets: the id a lease is [`insert`ed](Dependents::insert)
/// under (one id can name the same lease in several sets).
pub fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What an acquire returns when its lease could not join its session's [`Dependents`] (the
/// session ended between the grant and the registration): `Unavailable`, never a lease that is
/// already lost. The key went with the session.
pub fn ended_during_acquire(backend: &'static str) -> crate::Error {
    crate::Error::Unavailable {
        backend,
        message: "the client's session ended during the acquire".into(),
        source: None,
    }
}

/// The leases that depend on one session (an etcd lease, a ZooKeeper session, a Consul
/// session), each under an id to remove it by ([`fresh_id`]), all of them handed back once when
/// the session ends, and none added after that.
///
/// An adapter's session keeps its leases here (usually as [`Weak`] references, so that a
/// dropped lease needs no removal to be forgotten) to tell each one of a connection event, and
/// every one of them that the session is over:
///
/// - [`insert`](Dependents::insert) refuses a lease once [`close`](Dependents::close) has run,
///   so a lease granted while its session was ending is not left unaware of the end: its caller
///   marks it lost itself;
/// - `close` hands back every lease it had exactly once (`None` to every later call), so the
///   first reason a session ends for is the one its leases are lost for.
///
/// ```
/// use std::sync::{Arc, Weak};
/// use lease_core::adapter::{fresh_id, Dependents};
///
/// let leases: Dependents<Weak<str>> = Dependents::new();
/// let lease: Arc<str> = Arc::from("lease on jobs/nightly");
/// let id = fresh_id();
/// assert!(leases.insert(id, Arc::downgrade(&lease)), "the session is open");
/// assert_eq!(leases.live().len(), 1);
/// assert_eq!(leases.close().map(|ended| ended.len()), Some(1));
/// assert!(leases.close().is_none(), "handed back once");
/// assert!(!leases.insert(fresh_id(), Arc::downgrade(&lease)), "refused once closed");
/// leases.remove(id); // harmless after the close
/// ```
#[derive(Debug)]
pub struct Dependents<T> {
    state: Mutex<State<T>>,
}

#[derive(Debug)]
struct State<T> {
    items: HashMap<u64, T>,
    closed: bool,
}

impl<T> Default for Dependents<T> {
    fn default() -> Self {
        Dependents::new()
    }
}

impl<T> Dependents<T> {
    /// None yet, open.
    pub fn new() -> Self {
        Dependents {
            state: Mutex::new(State {
                items: HashMap::new(),
                closed: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `item` under `id` (replacing one there), or drops it and returns `false` once
    /// [`close`](Dependents::close) has run.
    pub fn insert(&self, id: u64, item: T) -> bool {
        let mut s = self.lock();
        if !s.closed {
            s.items.insert(id, item);
        }
        !s.closed
    }

    /// Removes the item `id` (nothing when it is gone already).
    pub fn remove(&self, id: u64) -> Option<T> {
        self.lock().items.remove(&id)
    }

    /// Whether [`close`](Dependents::close) has run.
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Ends the set: hands back every item the first time (`None` on every later call) and
    /// refuses every later [`insert`](Dependents::insert).
    pub fn close(&self) -> Option<Vec<T>> {
        let mut s = self.lock();
        if s.closed {
            return None;
        }
        s.closed = true;
        Some(s.items.drain().map(|(_, item)| item).collect())
    }

    /// Calls `f` on every item, under the set's lock: `f` must not call back into the set.
    pub fn for_each(&self, f: impl FnMut(&T)) {
        self.lock().items.values().for_each(f);
    }
}

impl<T: ?Sized> Dependents<Weak<T>> {
    /// Every item still alive; the dropped ones are forgotten on the way.
    pub fn live(&self) -> Vec<Arc<T>> {
        let mut s = self.lock();
        let mut live = Vec::with_capacity(s.items.len());
        s.items.retain(|_, w| match w.upgrade() {
            Some(item) => {
                live.push(item);
                true
            }
            None => false,
        });
        live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_remove_once_and_dropped_items_are_forgotten() {
        let set: Dependents<Weak<u32>> = Dependents::new();
        let (a, b) = (Arc::new(1), Arc::new(2));
        let (ia, ib) = (fresh_id(), fresh_id());
        assert_ne!(ia, ib);
        assert!(set.insert(ia, Arc::downgrade(&a)));
        assert!(set.insert(ib, Arc::downgrade(&b)));
        drop(b);
        assert_eq!(set.live().iter().map(|x| **x).collect::<Vec<_>>(), vec![1]);
        assert!(
            set.remove(ib).is_none(),
            "the dropped one is forgotten by live()"
        );
        assert!(set.remove(ia).is_some());
        assert!(set.remove(ia).is_none());
        assert_eq!(set.close().map(|left| left.len()), Some(0));
    }

    #[test]
    fn close_hands_back_once_and_refuses_later_inserts() {
        let set: Dependents<u32> = Dependents::new();
        assert!(set.insert(1, 7));
        assert!(set.insert(2, 8));
        let mut seen = 0;
        set.for_each(|_| seen += 1);
        assert_eq!(seen, 2);
        let mut ended = set.close().unwrap();
        ended.sort_unstable();
        assert_eq!(ended, vec![7, 8]);
        assert!(set.is_closed());
        assert!(set.close().is_none());
        assert!(!set.insert(3, 9));
        set.for_each(|_| panic!("nothing is left once closed"));
    }
}
