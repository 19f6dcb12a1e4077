//! [`TokenAdmission`]: turning a backend's native token into a fencing token, once.

use crate::error::Error;
use crate::key::LockKey;
use crate::token::Token;
use crate::watermark::Watermarks;

/// One coordinator's rule for the tokens it hands out: a native value (an etcd revision, a
/// ZooKeeper zxid, a Consul index, a Redis counter) becomes a [`Token`] only if it is in range,
/// above the configured floor and above every token this process was granted for the lock in
/// the same scope ([`Watermarks::process`]).
///
/// Every adapter admits its grants through [`TokenAdmission::admit`]: conversion, floor and
/// watermark are checked and the token recorded in one step, with one error for each way it can
/// fail ([`Error::TokenOutOfRange`], [`Error::TokenRegression`]).
#[derive(Debug, Clone)]
pub struct TokenAdmission {
    backend: &'static str,
    scope: String,
    floor: Option<Token>,
}

/// A native token: the integer types backends use.
pub trait NativeToken: Copy + std::fmt::Display {
    /// The value as a token, if it is one.
    fn to_token(self) -> Option<Token>;
}

impl NativeToken for i64 {
    fn to_token(self) -> Option<Token> {
        Token::from_i64(self).ok()
    }
}

impl NativeToken for u64 {
    fn to_token(self) -> Option<Token> {
        Token::new(self).ok()
    }
}

impl NativeToken for Token {
    fn to_token(self) -> Option<Token> {
        Some(self)
    }
}

impl TokenAdmission {
    /// The rule for `backend`'s grants in `scope` (which cluster and namespace: for example the
    /// hosts and key prefix), above `floor` when one is configured.
    pub fn new(backend: &'static str, scope: impl Into<String>, floor: Option<Token>) -> Self {
        TokenAdmission {
            backend,
            scope: scope.into(),
            floor,
        }
    }

    /// The scope the watermarks are kept in.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The configured floor, if any.
    pub fn floor(&self) -> Option<Token> {
        self.floor
    }

    /// Converts `native` to a token; [`Error::TokenOutOfRange`] if it is not one.
    pub fn convert(&self, key: &LockKey, native: impl NativeToken) -> Result<Token, Error> {
        native.to_token().ok_or_else(|| Error::TokenOutOfRange {
            backend: self.backend,
            key: key.to_string(),
            native: native.to_string(),
        })
    }

    /// Admits a fresh grant: converts `native`, checks it against the floor and the process's
    /// watermark for the lock, and records it, in one step. A refused grant records nothing and
    /// is [`Error::TokenOutOfRange`] or [`Error::TokenRegression`] naming the bound it failed.
    pub fn admit(&self, key: &LockKey, native: impl NativeToken) -> Result<Token, Error> {
        let token = self.convert(key, native)?;
        Watermarks::process().admit(self.backend, &self.scope, key, token, self.floor)?;
        Ok(token)
    }

    /// Checks `native` as [`admit`](TokenAdmission::admit) does without recording it (a grant
    /// the adapter will not hand out, for example one whose validity ended in flight).
    pub fn check(&self, key: &LockKey, native: impl NativeToken) -> Result<Token, Error> {
        let token = self.convert(key, native)?;
        let bound = self.highest(key).max(self.floor);
        match bound.filter(|b| token <= *b) {
            Some(bound) => Err(Error::TokenRegression {
                backend: self.backend,
                key: key.to_string(),
                observed: token,
                floor: bound,
            }),
            None => Ok(token),
        }
    }

    /// The highest token this process was granted for `key` in this scope, if any.
    pub fn highest(&self, key: &LockKey) -> Option<Token> {
        Watermarks::process().highest(&self.scope, key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversion_floor_and_watermark_are_one_step_with_one_error_each() {
        let key = LockKey::new("tokens/one-step").unwrap();
        let t = |n| Token::new(n).unwrap();
        let scope = format!("test-{}", std::process::id());
        let a = TokenAdmission::new("x", scope.clone(), Some(t(10)));
        for native in [-1i64, i64::MIN] {
            match a.admit(&key, native) {
                Err(Error::TokenOutOfRange { native: n, .. }) => assert_eq!(n, native.to_string()),
                other => panic!("{other:?}"),
            }
        }
        assert!(matches!(
            a.admit(&key, u64::MAX),
            Err(Error::TokenOutOfRange { .. })
        ));
        assert!(matches!(
            a.admit(&key, 10i64),
            Err(Error::TokenRegression { floor, .. }) if floor == t(10)
        ));
        assert_eq!(a.highest(&key), None, "a refused grant records nothing");
        assert_eq!(a.check(&key, 12u64).unwrap(), t(12));
        assert_eq!(a.highest(&key), None, "check records nothing");
        assert_eq!(a.admit(&key, 12u64).unwrap(), t(12));
        assert!(matches!(
            a.admit(&key, 11u64),
            Err(Error::TokenRegression { floor, .. }) if floor == t(12)
        ));
        assert!(matches!(
            a.check(&key, 12u64),
            Err(Error::TokenRegression { .. })
        ));
        let other = TokenAdmission::new("x", format!("{scope}-other"), None);
        assert_eq!(
            other.admit(&key, 1i64).unwrap(),
            t(1),
            "scopes are independent"
        );
    }
}
