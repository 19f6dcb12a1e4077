//! Znode layout, lock-name encoding and contender ordering.
//!
//! ```text
//! <base>/locks                          persistent
//! <base>/locks/<encoded key>            container: one per lock, flat (so `a` and `a/b` never nest)
//! <base>/locks/<encoded key>/c-<client>-<attempt>-<sequence>
//!                                       ephemeral sequential: one per contender
//! <base>/audit-trails/<encoded key>   persistent: one per key ever force-released
//! <base>/audit-trails/<encoded key>/forced-<sequence>
//!                                       persistent sequential: one per force_release, the
//!                                       newest `AuditRecord::MAX_LIMIT` kept
//! <base>/audit/forced-<encoded key>-<sequence>
//!                                       written by earlier versions (every key's records in
//!                                       one directory); read, never written
//! ```
//!
//! A key is percent-encoded into one node name: every byte outside `[A-Za-z0-9._~-]` becomes
//! `%XX`, so `/` never nests and no key is a path prefix of another.

use std::cmp::Ordering;

use lease_core::LockKey;

/// The child of `<base>` holding one node per lock.
pub(crate) const LOCKS: &str = "locks";
/// The child of `<base>` holding earlier versions' force-release audit records, every key's.
pub(crate) const AUDIT: &str = "audit";
/// The child of `<base>` holding one directory of force-release audit records per key.
pub(crate) const AUDIT_TRAILS: &str = "audit-trails";
/// The name prefix of audit records.
pub(crate) const AUDIT_PREFIX: &str = "forced-";

/// Paths under one base znode.
#[derive(Debug, Clone)]
pub(crate) struct Paths {
    base: String,
}

impl Paths {
    pub(crate) fn new(base: &str) -> Self {
        Paths {
            base: base.to_owned(),
        }
    }

    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    pub(crate) fn locks(&self) -> String {
        format!("{}/{LOCKS}", self.base)
    }

    /// The directory of earlier versions' audit records (every key's, see the module docs).
    pub(crate) fn audit(&self) -> String {
        format!("{}/{AUDIT}", self.base)
    }

    /// The directory of `key`'s audit records.
    pub(crate) fn audit_trail(&self, key: &LockKey) -> String {
        format!("{}/{AUDIT_TRAILS}/{}", self.base, encode_key(key))
    }

    /// The lock's node: the parent of its contenders.
    pub(crate) fn lock_dir(&self, key: &LockKey) -> String {
        format!("{}/{LOCKS}/{}", self.base, encode_key(key))
    }
}

/// Encodes a key into one znode name (see the module docs).
pub(crate) fn encode_key(key: &LockKey) -> String {
    lease_core::adapter::percent_encode(key.as_str())
}

/// The name prefix of `key`'s audit records: `forced-<encoded key>-`, to which ZooKeeper
/// appends the sequence. Records written before the key was in the name are `forced-<sequence>`.
pub(crate) fn audit_prefix(key: &LockKey) -> String {
    format!("{AUDIT_PREFIX}{}-", encode_key(key))
}

/// Whether the audit node `name` may be one of `key`'s records, and its sequence number: a name
/// of `key`'s (the prefix, then exactly the ten characters of a sequence) or one of the older
/// names without a key, whose data says which key it is for. `None` for another key's.
pub(crate) fn audit_sequence(name: &str, key_prefix: &str) -> Option<i64> {
    let rest = name
        .strip_prefix(key_prefix)
        .or_else(|| name.strip_prefix(AUDIT_PREFIX))?;
    if rest.len() != 10 {
        return None;
    }
    rest.parse().ok()
}

/// The name prefix of one acquisition attempt: unique per client and attempt, so that a create
/// whose answer was lost can be found (or cleaned up) by listing the lock's children.
pub(crate) fn contender_prefix(client: u64, attempt: u64) -> String {
    format!("c-{client:016x}-{attempt}-")
}

/// One contender node, parsed from its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Contender {
    /// The node name (not the path).
    pub(crate) name: String,
    /// The sequence number ZooKeeper appended (a signed 32-bit counter kept by the parent).
    pub(crate) sequence: i64,
    /// The creation zxid, when it had to be read to order the contenders.
    pub(crate) czxid: Option<i64>,
}

/// Parses a contender name `c-<16 hex>-<attempt>-<sequence>`; other names are not contenders.
pub(crate) fn parse_contender(name: &str) -> Option<Contender> {
    let rest = name.strip_prefix("c-")?;
    let (client, rest) = rest.split_once('-')?;
    if client.len() != 16 || !client.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (attempt, seq) = rest.split_once('-')?;
    if attempt.is_empty() || !attempt.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // After the counter wraps, ZooKeeper formats negative sequences as `-000000005`.
    let sequence: i64 = seq.parse().ok()?;
    Some(Contender {
        name: name.to_owned(),
        sequence,
        czxid: None,
    })
}

/// Whether the sequence numbers alone order these contenders by creation.
///
/// Within one incarnation of the parent (its children all die before it can be deleted), the
/// sequence grows with each child change until it wraps past `i32::MAX` to negative numbers. As
/// long as none is negative, numeric order is creation order; once one is, the creation zxids
/// must be read instead.
pub(crate) fn sequence_orders(contenders: &[Contender]) -> bool {
    contenders.iter().all(|c| c.sequence >= 0)
}

/// Sorts contenders by creation: by czxid when every one has it, else by sequence number (the
/// caller checked [`sequence_orders`]). Never by comparing name strings.
pub(crate) fn sort_by_creation(contenders: &mut [Contender]) {
    contenders.sort_by(|a, b| match (a.czxid, b.czxid) {
        (Some(x), Some(y)) => x.cmp(&y),
        _ => a.sequence.cmp(&b.sequence).then(Ordering::Equal),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_names_are_told_apart_by_key_without_reading_them() {
        let a = audit_prefix(&LockKey::new("a").unwrap());
        assert_eq!(a, "forced-a-");
        assert_eq!(audit_sequence("forced-a-0000000042", &a), Some(42));
        // Written before the key was in the name: its data says whose it is.
        assert_eq!(audit_sequence("forced-0000000007", &a), Some(7));
        // Another key's, including one whose name starts like `a`'s.
        assert_eq!(audit_sequence("forced-b-0000000042", &a), None);
        assert_eq!(audit_sequence("forced-a-0000000001-0000000002", &a), None);
        assert_eq!(audit_sequence("forced-a-b-0000000003", &a), None);
        assert_eq!(audit_sequence("other-0000000003", &a), None);
    }

    #[test]
    fn keys_encode_flat_and_distinct() {
        let k = |s: &str| encode_key(&LockKey::new(s).unwrap());
        assert_eq!(k("orders/42"), "orders%2F42");
        assert_eq!(k("p"), "p");
        assert_ne!(k("p/b"), k("pb"));
        assert!(!k("a/b/c").contains('/'));
        assert_eq!(k("with space"), "with%20space");
        assert_eq!(k("ключ"), "%D0%BA%D0%BB%D1%8E%D1%87");
        assert_eq!(k("50%"), "50%25");
        assert_eq!(k("..."), "...");
    }

    #[test]
    fn contenders_parse_and_order_numerically() {
        let p = contender_prefix(0xabc, 7);
        assert_eq!(p, "c-0000000000000abc-7-");
        let c = parse_contender(&format!("{p}0000000010")).unwrap();
        assert_eq!(c.sequence, 10);
        assert_eq!(
            parse_contender(&format!("{p}-000000005")).unwrap().sequence,
            -5
        );
        assert!(parse_contender("lock-0000000001").is_none());
        assert!(parse_contender("c-xyz-1-0000000001").is_none());
        // "0000000100" sorts before "0000000099"? Numbers, not strings.
        let mut v: Vec<Contender> = ["0000000100", "0000000099", "0000001000"]
            .iter()
            .map(|s| parse_contender(&format!("{p}{s}")).unwrap())
            .collect();
        assert!(sequence_orders(&v));
        sort_by_creation(&mut v);
        assert_eq!(
            v.iter().map(|c| c.sequence).collect::<Vec<_>>(),
            [99, 100, 1000]
        );
    }

    #[test]
    fn wrapped_sequences_need_czxids() {
        let p = contender_prefix(1, 1);
        let mut v = vec![
            parse_contender(&format!("{p}2147483647")).unwrap(),
            parse_contender(&format!("{p}-2147483648")).unwrap(),
        ];
        assert!(!sequence_orders(&v));
        v[0].czxid = Some(500);
        v[1].czxid = Some(501);
        sort_by_creation(&mut v);
        assert_eq!(
            v[0].sequence, 2147483647,
            "creation order, not numeric order"
        );
    }
}
