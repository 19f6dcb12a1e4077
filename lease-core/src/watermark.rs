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

/// The highest token granted per lock in this process.
///
/// A lock is named by a *scope* (which cluster and namespace: for example the hosts and key
/// prefix) and its [`LockKey`].
#[derive(Debug, Default)]
pub struct Watermarks {
    seen: Mutex<HashMap<(String, LockKey), Token>>,
}

impl Watermarks {
    /// An empty set (tests; adapters use [`Watermarks::process`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// The set shared by the whole process.
    pub fn process() -> &'static Watermarks {
        static PROCESS: OnceLock<Watermarks> = OnceLock::new();
        PROCESS.get_or_init(Watermarks::new)
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<(String, LockKey), Token>> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The highest token granted for the lock in this process, if any.
    pub fn highest(&self, scope: &str, key: &LockKey) -> Option<Token> {
        self.map().get(&(scope.to_owned(), key.clone())).copied()
    }

    /// Records `token` as granted (keeps the larger of it and what was recorded).
    pub fn record(&self, scope: &str, key: &LockKey, token: Token) {
        let mut map = self.map();
        let entry = map.entry((scope.to_owned(), key.clone())).or_insert(token);
        *entry = (*entry).max(token);
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
        let mut map = self.map();
        let slot = (scope.to_owned(), key.clone());
        let bound = map.get(&slot).copied().max(floor);
        if let Some(bound) = bound.filter(|b| token <= *b) {
            return Err(Error::TokenRegression {
                backend,
                key: key.to_string(),
                observed: token,
                floor: bound,
            });
        }
        map.insert(slot, token);
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
}
