//! [`HolderRecord`] and [`StoredAudit`]: what a lock stores about its holder, and what an
//! audit trail stores about a forced release, in one JSON format for every backend that stores
//! documents (etcd and Consul key values, ZooKeeper node data). Redis keeps its positional lock
//! value and a stream, which its scripts read field by field.
//!
//! Neither ever holds a credential or a lease's private value: only the labels the caller gave
//! (owner, operation, actor, reason), tokens, and wall-clock times for display.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::audit::AuditRecord;
use crate::coordinator::HolderInfo;
use crate::error::Error;
use crate::key::LockKey;
use crate::options::{ForceRelease, LeaseOptions, OwnerId};
use crate::token::Token;

/// Wall-clock milliseconds since the Unix epoch (0 for a clock before it). For display only.
fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn from_unix_ms(ms: u64) -> Option<SystemTime> {
    (ms > 0)
        .then(|| UNIX_EPOCH.checked_add(Duration::from_millis(ms)))
        .flatten()
}

/// What a lock stores about its holder (and `inspect` shows):
/// `{"owner":"…","operation":"…","acquired_at_ms":…,"ttl_ms":…}`.
///
/// Readers accept records of earlier versions (etcd's `at_ms`) and ignore fields they do not
/// know; a value that is not a record (written by another tool) parses as `None`, and the
/// holder is then shown with an unknown owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderRecord {
    /// The owner label ([`LeaseOptions::owner`], or the coordinator's default).
    pub owner: String,
    /// The operation name, if the caller gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
    /// When the attempt was made, by the acquiring process's wall clock (display only).
    #[serde(default, alias = "at_ms")]
    pub acquired_at_ms: u64,
    /// The TTL asked for, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
}

impl HolderRecord {
    /// The record of an attempt with `options`, now; the owner is `default_owner` unless the
    /// options name one.
    pub fn new(options: &LeaseOptions, default_owner: &OwnerId) -> Self {
        HolderRecord {
            owner: options
                .owner_value()
                .unwrap_or(default_owner)
                .as_str()
                .to_owned(),
            operation: options.operation_value().map(str::to_owned),
            acquired_at_ms: unix_ms(SystemTime::now()),
            ttl_ms: Some(options.ttl_value().as_millis() as u64),
        }
    }

    /// The record as stored.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record of strings and numbers serialises")
    }

    /// A stored record; `None` if `value` is not one.
    pub fn parse(value: &[u8]) -> Option<Self> {
        serde_json::from_slice(value).ok()
    }

    /// What `inspect` shows of the holder of `key` with `token` whose lock stores `value`: the
    /// record's labels and time, or (a value that is not a record, or an owner label that is no
    /// longer valid) the owner `unknown_owner` gives.
    pub fn holder_info(
        value: &[u8],
        key: &LockKey,
        token: Token,
        unknown_owner: impl FnOnce() -> String,
    ) -> HolderInfo {
        let record = Self::parse(value);
        let owner = record
            .as_ref()
            .and_then(|r| OwnerId::new(r.owner.clone()).ok())
            .or_else(|| OwnerId::new(unknown_owner()).ok())
            .unwrap_or_else(|| OwnerId::new("unknown").expect("a valid label"));
        let (operation, at) = match record {
            Some(r) => (r.operation, from_unix_ms(r.acquired_at_ms)),
            None => (None, None),
        };
        HolderInfo::new(key.clone(), owner, token)
            .with_operation(operation)
            .with_acquired_at(at)
    }
}

/// How many of a key's newest audit records a release reads when, sent again after its first
/// send's answer was lost, it finds its lock gone ([`forced_release_of`]), on a backend that
/// reads records one by one (ZooKeeper's audit nodes); a trail kept in one value is read whole.
pub const FORCED_LOOKBACK: usize = 8;

/// Whether `records` (a key's newest audit records) show a force-release that removed the lock
/// of `token`. A release sent again after its first send's answer was lost, finding its lock
/// gone, cannot otherwise tell an operator's force-release (its lease is `Lost(Revoked)`) from
/// its own first send (released); a force-release records the token it removed.
pub fn forced_release_of(records: &[AuditRecord], token: Token) -> bool {
    records.iter().any(|r| r.removed_token == Some(token))
}

/// One forced release as an audit trail stores it:
/// `{"key":"…","actor":"…","reason":"…","removed_token":…,"removed_owner":"…","at_ms":…}`.
///
/// A trail kept in one value ([`StoredAudit::parse_trail`], [`StoredAudit::appended_to`]) is a
/// JSON array of the newest [`AuditRecord::MAX_LIMIT`] records, oldest first. Readers accept
/// earlier versions' records (one object instead of an array; etcd's `token` and `owner`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAudit {
    /// The key, for a trail that holds several keys' records (ZooKeeper's one audit directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Who forced the release.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// The removed holder's token; `None` when the key was free.
    #[serde(default, alias = "token", skip_serializing_if = "Option::is_none")]
    pub removed_token: Option<u64>,
    /// The removed holder's owner label.
    #[serde(default, alias = "owner", skip_serializing_if = "Option::is_none")]
    pub removed_owner: Option<String>,
    /// When, by the forcing process's wall clock (display only; 0 when not recorded).
    #[serde(default)]
    pub at_ms: u64,
}

impl StoredAudit {
    /// The record of `request` removing `removed` (`None`: the key was free), now.
    pub fn new(request: &ForceRelease, removed: Option<&HolderInfo>) -> Self {
        StoredAudit {
            key: None,
            actor: request.actor().to_owned(),
            reason: request.reason().to_owned(),
            removed_token: removed.map(|h| h.token.get()),
            removed_owner: removed.map(|h| h.owner.as_str().to_owned()),
            at_ms: unix_ms(SystemTime::now()),
        }
    }

    /// The same record, naming `key` (for a trail shared by every key).
    pub fn for_key(mut self, key: &LockKey) -> Self {
        self.key = Some(key.as_str().to_owned());
        self
    }

    /// The record as stored on its own.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a record of strings and numbers serialises")
    }

    /// A record stored on its own; `None` if `value` is not one.
    pub fn parse(value: &[u8]) -> Option<Self> {
        serde_json::from_slice(value).ok()
    }

    /// The records a trail value holds, oldest first; `None` when the value is not a trail (or
    /// a single record) this library wrote. Never treat that as an empty trail to append to: the
    /// write would erase whatever is there ([`StoredAudit::unreadable`] is the error to give).
    pub fn parse_trail(value: &[u8]) -> Option<Vec<Self>> {
        serde_json::from_slice::<Vec<Self>>(value)
            .or_else(|_| serde_json::from_slice::<Self>(value).map(|r| vec![r]))
            .ok()
    }

    /// The error for a trail value under `audit_key` that [`StoredAudit::parse_trail`] cannot
    /// read: `Misconfigured` naming the key. A force-release then removes nothing and the trail
    /// is not overwritten.
    pub fn unreadable(backend: &'static str, audit_key: &str) -> Error {
        Error::Misconfigured {
            backend,
            problems: vec![format!(
                "the audit trail under {audit_key:?} is not one this library wrote (another \
                 tool wrote there?): nothing was removed or recorded; move that value away to \
                 go on"
            )],
        }
    }

    /// `trail` with `self` appended, keeping the newest [`AuditRecord::MAX_LIMIT`], as stored.
    pub fn appended_to(self, mut trail: Vec<Self>) -> Vec<u8> {
        trail.push(self);
        let excess = trail.len().saturating_sub(AuditRecord::MAX_LIMIT);
        trail.drain(..excess);
        serde_json::to_vec(&trail).expect("records of strings and numbers serialise")
    }

    /// What [`Coordinator::audit_trail`](crate::Coordinator::audit_trail) returns of `trail` (a
    /// trail value's records, oldest first) for `key`: its newest `limit` records, newest first.
    pub fn newest_first(trail: &[Self], key: &LockKey, limit: usize) -> Vec<AuditRecord> {
        let newest = trail.iter().rev().take(limit);
        newest.map(|r| r.to_record(key, None)).collect()
    }

    /// The record as [`Coordinator::audit_trail`](crate::Coordinator::audit_trail) returns it
    /// for `key`; `at` (when the backend keeps its own time, like ZooKeeper's creation time)
    /// replaces the stored one.
    pub fn to_record(&self, key: &LockKey, at: Option<SystemTime>) -> AuditRecord {
        AuditRecord::new(key.clone(), self.actor.clone(), self.reason.clone())
            .with_at(at.or_else(|| from_unix_ms(self.at_ms)))
            .with_removed(
                self.removed_token.and_then(|t| Token::new(t).ok()),
                self.removed_owner.clone(),
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn holder_records_round_trip_and_read_earlier_versions() {
        let owner = OwnerId::new("worker-1").unwrap();
        let options = LeaseOptions::new(Duration::from_secs(5)).operation("nightly");
        let r = HolderRecord::new(&options, &owner);
        assert_eq!(HolderRecord::parse(&r.to_json()), Some(r.clone()));
        assert_eq!(r.ttl_ms, Some(5000));
        // etcd's earlier record.
        let old = br#"{"owner":"a","at_ms":1700000000000,"ttl_ms":3000}"#;
        let parsed = HolderRecord::parse(old).unwrap();
        assert_eq!(parsed.acquired_at_ms, 1_700_000_000_000);
        let key = LockKey::new("k").unwrap();
        let token = Token::new(7).unwrap();
        let info = HolderRecord::holder_info(old, &key, token, || unreachable!());
        assert_eq!(info.owner.as_str(), "a");
        assert!(info.acquired_at.is_some());
        // Not a record: the unknown owner, nothing else.
        let info = HolderRecord::holder_info(b"hello", &key, token, || "unknown (x)".into());
        assert_eq!(info.owner.as_str(), "unknown (x)");
        assert_eq!((info.operation, info.acquired_at), (None, None));
    }

    #[test]
    fn audit_trails_keep_the_newest_and_read_earlier_versions() {
        let key = LockKey::new("k").unwrap();
        let request = ForceRelease::new("ops", "stuck").unwrap();
        let holder = HolderInfo::new(
            key.clone(),
            OwnerId::new("w").unwrap(),
            Token::new(9).unwrap(),
        );
        let mut value = Vec::new();
        for _ in 0..AuditRecord::MAX_LIMIT + 3 {
            let trail = StoredAudit::parse_trail(&value).unwrap_or_default();
            value = StoredAudit::new(&request, Some(&holder)).appended_to(trail);
        }
        let trail = StoredAudit::parse_trail(&value).unwrap();
        assert_eq!(trail.len(), AuditRecord::MAX_LIMIT);
        let r = trail[0].to_record(&key, None);
        assert_eq!(r.removed_token, Some(Token::new(9).unwrap()));
        assert_eq!(r.removed_owner.as_deref(), Some("w"));
        assert!(r.at.is_some());
        // etcd's earlier record, one object.
        let old = br#"{"actor":"a","reason":"r","token":4,"owner":"o","at_ms":5}"#;
        let trail = StoredAudit::parse_trail(old).unwrap();
        assert_eq!(trail.len(), 1);
        assert_eq!(trail[0].removed_token, Some(4));
        assert_eq!(trail[0].removed_owner.as_deref(), Some("o"));
        assert!(StoredAudit::parse_trail(b"not json").is_none());
        assert!(StoredAudit::parse_trail(br#"[{"actor":"a","reason":"r"},7]"#).is_none());
        // A record of a free key, for one key of a shared trail.
        let free = StoredAudit::new(&request, None).for_key(&key);
        let back = StoredAudit::parse(&free.to_json()).unwrap();
        assert_eq!(back.key.as_deref(), Some("k"));
        assert_eq!(back.to_record(&key, None).removed_token, None);
    }

    #[test]
    fn newest_first_returns_the_last_records_reversed() {
        let key = LockKey::new("k").unwrap();
        let trail: Vec<StoredAudit> = (1..=5)
            .map(|i| {
                let request = ForceRelease::new(format!("op{i}"), "r").unwrap();
                StoredAudit::new(&request, None)
            })
            .collect();
        let actors = |records: Vec<AuditRecord>| -> Vec<String> {
            records.into_iter().map(|r| r.actor).collect()
        };
        assert_eq!(
            actors(StoredAudit::newest_first(&trail, &key, 2)),
            ["op5", "op4"]
        );
        assert_eq!(actors(StoredAudit::newest_first(&trail, &key, 9)).len(), 5);
        assert!(StoredAudit::newest_first(&[], &key, 3).is_empty());
    }
}
