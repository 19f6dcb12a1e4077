//! [`AuditRecord`]: one forced release, in the same shape on every backend.

use std::time::SystemTime;

use crate::error::{InvalidInput, Result};
use crate::key::LockKey;
use crate::token::Token;

/// One forced release of a key, as [`Coordinator::audit_trail`](crate::Coordinator::audit_trail)
/// returns it on every backend.
///
/// # Contract
///
/// - `audit_trail(key, limit)` returns the forced releases of `key` **newest first**, at most
///   `limit` of them (`limit` is 1 to [`AuditRecord::MAX_LIMIT`]; anything else is
///   `InvalidInput` naming `limit`, and nothing is sent). Fewer records than `limit` means the
///   backend holds no more for that key.
/// - Every backend keeps at least the newest [`AuditRecord::MAX_LIMIT`] records per key (Redis,
///   etcd and Consul keep exactly that many, ZooKeeper and the in-memory backend keep all).
/// - A `force_release` with an [expected token](crate::ForceRelease::expect_token) that is
///   refused (`HolderChanged`) removes nothing and is not recorded; nor is a removal the server
///   did not apply (every backend writes the record and the delete in one atomic step).
/// - A `force_release` without an expected token that finds the key free removes nothing and
///   is recorded all the same, with no removed holder (`removed_token` and `removed_owner`
///   `None`): the trail shows who forced which key, when, and why, whatever was there.
/// - `at` is a wall-clock time for display only (the forcing process's clock on Redis, etcd,
///   Consul and in memory; the server's on ZooKeeper): never order or compare records by it.
///
/// Fields may be added later: build one with [`AuditRecord::new`] and the `with_*` setters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditRecord {
    /// The key that was force-released.
    pub key: LockKey,
    /// Who forced the release ([`ForceRelease::actor`](crate::ForceRelease::actor)).
    pub actor: String,
    /// Why ([`ForceRelease::reason`](crate::ForceRelease::reason)).
    pub reason: String,
    /// When, by a wall clock (display only), if the backend recorded it.
    pub at: Option<SystemTime>,
    /// The token of the holder that was removed, `None` if the key was free.
    pub removed_token: Option<Token>,
    /// The owner label of the holder that was removed, `None` if the key was free.
    pub removed_owner: Option<String>,
}

impl AuditRecord {
    /// The largest `limit` [`Coordinator::audit_trail`](crate::Coordinator::audit_trail)
    /// accepts, and the number of records every backend keeps at least.
    pub const MAX_LIMIT: usize = 100;

    /// A record of a forced release of `key` by `actor` for `reason`; the optional fields start
    /// empty.
    pub fn new(key: LockKey, actor: impl Into<String>, reason: impl Into<String>) -> Self {
        AuditRecord {
            key,
            actor: actor.into(),
            reason: reason.into(),
            at: None,
            removed_token: None,
            removed_owner: None,
        }
    }

    /// Sets the time of the release.
    pub fn with_at(mut self, at: Option<SystemTime>) -> Self {
        self.at = at;
        self
    }

    /// Sets the removed holder's token and owner label.
    pub fn with_removed(mut self, token: Option<Token>, owner: Option<String>) -> Self {
        self.removed_token = token;
        self.removed_owner = owner;
        self
    }

    /// Checks an `audit_trail` limit: `Ok(limit)` for 1 to [`AuditRecord::MAX_LIMIT`],
    /// otherwise `InvalidInput::OutOfRange` naming `limit`. Implementations call it before
    /// sending anything.
    pub fn check_limit(limit: usize) -> Result<usize> {
        if (1..=Self::MAX_LIMIT).contains(&limit) {
            Ok(limit)
        } else {
            Err(InvalidInput::OutOfRange {
                field: "limit",
                value: limit.to_string(),
                expected: "1 to 100 records",
            }
            .into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_is_checked_and_named() {
        assert_eq!(AuditRecord::check_limit(1).unwrap(), 1);
        assert_eq!(AuditRecord::check_limit(100).unwrap(), 100);
        for bad in [0, 101, usize::MAX] {
            let e = AuditRecord::check_limit(bad).unwrap_err();
            assert_eq!(e.kind(), "invalid_input");
            assert!(e.to_string().contains("limit"), "{e}");
        }
    }
}
