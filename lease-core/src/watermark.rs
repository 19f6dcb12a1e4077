//! The per-process token watermark: fail closed when a backend's token goes backwards.
//!
//! Every adapter whose native token can regress in some failure (a snapshot restore, a lost
//! counter, a failover to a lagging replica) remembers the highest token it has been granted per
//! lock and refuses a grant that is not above it, or not above a configured floor, with
//! [`Error::TokenRegression`]. Written once here and shared by every client in the process, so two
//! coordinators of the same cluster in one process also protect each other.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::error::Error;
use crate::key::LockKey;
use crate::token::Token;

/// The highest token granted per lock in this process, for the most recently granted
/// [`Watermarks::CAPACITY`] locks.
///
/// A lock is named by a *scope* (which cluster and namespace: for example the hosts and key
/// prefix) and its [`LockKey`].
///
/// # Memory
///
/// A service that locks one key per entity (`orders/<id>`) would otherwise keep an entry for
/// every key it ever locked. Past the capacity, the eighth of the entries granted longest ago is
/// forgotten (about 150 bytes each, so at most some 15 MB): a regression of a lock this process
/// has not been granted for that long is then caught only by the configured floor, as in a
/// process that just started.
#[derive(Debug)]
pub struct Watermarks {
    seen: Mutex<Seen>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Seen {
    /// Per lock: its highest token, and when it was last granted (`next` at the time).
    map: HashMap<(String, LockKey), (Token, u64)>,
    next: u64,
}

impl Seen {
    /// Sets the lock's token (the larger of it and what was recorded) and stamps it as granted
    /// now, first forgetting the oldest entries if a new one would pass
    /// `capacity`.
    fn put(&mut self, slot: (String, LockKey), token: Token, capacity: usize) {
        let stamp = self.next;
        self.next += 1;
        if !self.map.contains_key(&slot) && self.map.len() >= capacity {
            self.forget_oldest(capacity);
        }
        let entry = self.map.entry(slot).or_insert((token, stamp));
        *entry = (entry.0.max(token), stamp);
    }

    /// Forgets the eighth (at least one) of the entries granted longest ago.
    fn forget_oldest(&mut self, capacity: usize) {
        let mut stamps: Vec<u64> = self.map.values().map(|&(_, stamp)| stamp).collect();
        let drop = (capacity / 8).clamp(1, stamps.len().max(1));
        let (_, &mut cut, _) = stamps.select_nth_unstable(drop - 1);
        self.map.retain(|_, &mut (_, stamp)| stamp > cut);
    }
}

impl Default for Watermarks {
    fn default() -> Self {
        Self::with_capacity(Self::CAPACITY)
    }
}

impl Watermarks {
    /// How many locks the process's set remembers.
    pub const CAPACITY: usize = 100_000;

    /// An empty set (tests; adapters use [`Watermarks::process`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty set remembering at most `capacity` locks (at least 1).
    pub fn with_capacity(capacity: usize) -> Self {
        Watermarks {
            seen: Mutex::default(),
            capacity: capacity.max(1),
        }
    }

    /// The set shared by the whole process.
    pub fn process() -> &'static Watermarks {
        static PROCESS: OnceLock<Watermarks> = OnceLock::new();
        PROCESS.get_or_init(Watermarks::new)
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The highest token granted for the lock in this process, if any (and still remembered).
    pub fn highest(&self, scope: &str, key: &LockKey) -> Option<Token> {
        self.seen()
            .map
            .get(&(scope.to_owned(), key.clone()))
            .map(|&(token, _)| token)
    }

    /// Records `token` as granted (keeps the larger of it and what was recorded).
    pub fn record(&self, scope: &str, key: &LockKey, token: Token) {
        self.seen()
            .put((scope.to_owned(), key.clone()), token, self.capacity);
    }

    /// Admits a freshly granted `token`: it must be above `floor` and above every token granted
    /// for the lock in this process; it is then recorded. Otherwise `Err(TokenRegression)` naming
    /// the bound it failed, and nothing is recorded. Check and record are one step.
    pub fn admit(
        &self,
        backend: &'static str,
        scope: &str,
        key: &LockKey,
        token: Token,
        floor: Option<Token>,
    ) -> Result<(), Error> {
        let mut seen = self.seen();
        let slot = (scope.to_owned(), key.clone());
        let bound = seen.map.get(&slot).map(|&(t, _)| t).max(floor);
        if let Some(bound) = bound.filter(|b| token <= *b) {
            return Err(Error::TokenRegression {
                backend,
                key: key.to_string(),
                observed: token,
                floor: bound,
            });
        }
        seen.put(slot, token, self.capacity);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(n: u64) -> Token {
        Token::new(n).unwrap()
    }

    #[test]
    fn admits_only_increasing_tokens_above_the_floor() {
        let w = Watermarks::new();
        let k = LockKey::new("k").unwrap();
        assert!(w.admit("x", "s", &k, t(5), Some(t(3))).is_ok());
        assert_eq!(w.highest("s", &k), Some(t(5)));
        match w.admit("x", "s", &k, t(5), None) {
            Err(Error::TokenRegression {
                observed, floor, ..
            }) => assert_eq!((observed, floor), (t(5), t(5))),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            w.admit("x", "s", &k, t(9), Some(t(10))),
            Err(Error::TokenRegression { .. })
        ));
        assert_eq!(
            w.highest("s", &k),
            Some(t(5)),
            "a refused token is not recorded"
        );
        assert!(
            w.admit("x", "other-cluster", &k, t(1), None).is_ok(),
            "scopes are independent"
        );
        w.record("s", &k, t(2));
        assert_eq!(w.highest("s", &k), Some(t(5)), "record keeps the larger");
        assert!(w.admit("x", "s", &k, t(6), None).is_ok());
    }

    /// Past its capacity the set forgets the locks granted longest ago, an eighth at a time, and
    /// keeps the recent ones (a lock granted again is recent again).
    #[test]
    fn past_capacity_the_oldest_grants_are_forgotten() {
        let w = Watermarks::with_capacity(16);
        let k = |i: usize| LockKey::new(format!("k{i}")).unwrap();
        for i in 0..16 {
            w.admit("x", "s", &k(i), t(10), None).unwrap();
        }
        // k0 granted again: the most recent now.
        w.admit("x", "s", &k(0), t(11), None).unwrap();
        // A 17th lock: the two granted longest ago (k1, k2) go.
        w.admit("x", "s", &k(16), t(10), None).unwrap();
        assert_eq!(w.highest("s", &k(1)), None);
        assert_eq!(w.highest("s", &k(2)), None);
        for i in [0, 3, 15, 16] {
            assert!(w.highest("s", &k(i)).is_some(), "k{i}");
        }
        assert_eq!(w.highest("s", &k(0)), Some(t(11)));
        // Still refusing regressions of what it remembers.
        assert!(w.admit("x", "s", &k(0), t(11), None).is_err());
        // Many more locks never grow it past the capacity.
        for i in 100..10_000 {
            w.admit("x", "s", &k(i), t(1), None).unwrap();
            assert!(w.seen().map.len() <= 16);
        }
    }
}
