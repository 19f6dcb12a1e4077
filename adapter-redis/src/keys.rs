//! The key layout and the lock value format.
//!
//! Every key of one lock shares one hash tag, so that they live in one Redis Cluster slot and a
//! script may touch them together:
//!
//! ```text
//! <prefix>:{<key>}:lock      the lock: a string, "v1|<nonce>|<token>|<acquired ms>|<owner>|<op>"
//! <prefix>:{<key>}:token     the per-key counter (INCR); never deleted by the adapter
//! <prefix>:{<key>}:revoked   the value of the last force-released holder, for its lock's TTL
//! <prefix>:{<key>}:audit     a capped stream of force releases (actor, reason, removed holder)
//! <prefix>:{<key>}:released the pub/sub channel announcing a release
//! <prefix>:{<resource>}:fence the fence: a hash {newest, vtoken, value}
//! ```
//!
//! `<key>` is the lock key with `%`, `{` and `}` percent-encoded: the encoding is injective (two
//! keys never share names), the tag ends at the first `}` (so `a` and `a/b` never overlap), and
//! the prefix may not contain braces (checked by the config).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lease_core::{HolderInfo, LockKey, OwnerId, ResourceId, Token};

/// Percent-encodes the characters that would break the hash tag or the encoding itself.
fn encode_tag(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
    out
}

/// The Redis names of one lock, in one string (a held lease keeps them for its life: one
/// allocation instead of five).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockKeys {
    /// The five names, one after the other.
    names: String,
    /// Where each name ends in `names`: lock, counter, revoked, audit, channel.
    ends: [u32; 5],
}

impl LockKeys {
    pub(crate) fn new(prefix: &str, key: &LockKey) -> Self {
        let base = format!("{prefix}:{{{}}}", encode_tag(key.as_str()));
        let suffixes = [":lock", ":token", ":revoked", ":audit", ":released"];
        let mut names =
            String::with_capacity(base.len() * 5 + suffixes.iter().map(|s| s.len()).sum::<usize>());
        let mut ends = [0u32; 5];
        for (end, suffix) in ends.iter_mut().zip(suffixes) {
            names.push_str(&base);
            names.push_str(suffix);
            // A lock key is at most a few hundred bytes (`MAX_NAME_BYTES`) plus the prefix.
            *end = u32::try_from(names.len()).expect("lock names fit in 4 GiB");
        }
        LockKeys { names, ends }
    }

    fn name(&self, i: usize) -> &str {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.names[start..self.ends[i] as usize]
    }

    /// `<prefix>:{<key>}:lock`: the lock.
    pub(crate) fn lock(&self) -> &str {
        self.name(0)
    }

    /// `<prefix>:{<key>}:token`: the per-key counter.
    pub(crate) fn counter(&self) -> &str {
        self.name(1)
    }

    /// `<prefix>:{<key>}:revoked`: the last force-released holder's value.
    pub(crate) fn revoked(&self) -> &str {
        self.name(2)
    }

    /// `<prefix>:{<key>}:audit`: the stream of force releases.
    pub(crate) fn audit(&self) -> &str {
        self.name(3)
    }

    /// `<prefix>:{<key>}:released`: the pub/sub channel announcing a release.
    pub(crate) fn channel(&self) -> &str {
        self.name(4)
    }
}

/// The Redis key of a fenced resource.
pub(crate) fn fence_key(prefix: &str, resource: &ResourceId) -> String {
    format!("{prefix}:{{{}}}:fence", encode_tag(resource.as_str()))
}

/// Escapes `%` and `|` in a label stored inside the lock value.
fn encode_field(s: &str) -> String {
    s.replace('%', "%25").replace('|', "%7C")
}

fn decode_field(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        match rest.get(i..i + 3) {
            Some("%25") => out.push('%'),
            Some("%7C") => out.push('|'),
            _ => return None,
        }
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// The parts of a lock value that the client knows before the token is issued: the acquire
/// script stores `head ++ token ++ tail`.
#[derive(Clone)]
pub(crate) struct ValueParts {
    /// The lease's private nonce (128 random bits).
    pub(crate) nonce: u128,
    /// `v1|<32 hex digits of nonce>|`: what every compare-and-X script compares with.
    pub(crate) head: String,
    /// `|<acquired unix ms>|<owner>|<operation>`.
    pub(crate) tail: String,
}

impl ValueParts {
    pub(crate) fn new(nonce: u128, owner: &OwnerId, operation: Option<&str>) -> Self {
        let acquired_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        ValueParts {
            nonce,
            head: format!("v1|{nonce:032x}|"),
            tail: format!(
                "|{acquired_ms}|{}|{}",
                encode_field(owner.as_str()),
                operation.map(encode_field).unwrap_or_default()
            ),
        }
    }
}

/// A lock value read back from Redis.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct LockValue {
    pub(crate) nonce: u128,
    pub(crate) token: Token,
    pub(crate) acquired_ms: u64,
    pub(crate) owner: OwnerId,
    pub(crate) operation: Option<String>,
}

impl std::fmt::Debug for LockValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The nonce is a lease's private proof of ownership: never shown.
        f.debug_struct("LockValue")
            .field("token", &self.token)
            .field("owner", &self.owner)
            .field("operation", &self.operation)
            .finish_non_exhaustive()
    }
}

impl LockValue {
    /// Parses a value written by the acquire script; `None` for anything else.
    pub(crate) fn parse(s: &str) -> Option<Self> {
        let mut it = s.splitn(6, '|');
        if it.next()? != "v1" {
            return None;
        }
        let nonce_hex = it.next()?;
        if nonce_hex.len() != 32 {
            return None;
        }
        let nonce = u128::from_str_radix(nonce_hex, 16).ok()?;
        let token: Token = it.next()?.parse().ok()?;
        let acquired_ms: u64 = it.next()?.parse().ok()?;
        let owner = OwnerId::new(decode_field(it.next()?)?).ok()?;
        let op = decode_field(it.next()?)?;
        Some(LockValue {
            nonce,
            token,
            acquired_ms,
            owner,
            operation: (!op.is_empty()).then_some(op),
        })
    }

    /// What an operator may see (no nonce).
    pub(crate) fn holder_info(&self, key: &LockKey, pttl_ms: i64) -> HolderInfo {
        HolderInfo::new(key.clone(), self.owner.clone(), self.token)
            .with_operation(self.operation.clone())
            .with_acquired_at(UNIX_EPOCH.checked_add(Duration::from_millis(self.acquired_ms)))
            .with_expires_in((pttl_ms >= 0).then(|| Duration::from_millis(pttl_ms as u64)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_share_one_tag_and_never_collide() {
        let k = |s: &str| LockKeys::new("p", &LockKey::new(s).unwrap());
        let a = k("a");
        assert_eq!(a.lock(), "p:{a}:lock");
        assert_eq!(a.counter(), "p:{a}:token");
        assert_eq!(a.revoked(), "p:{a}:revoked");
        assert_eq!(a.audit(), "p:{a}:audit");
        assert_eq!(a.channel(), "p:{a}:released");
        let ab = k("a/b");
        assert_eq!(ab.lock(), "p:{a/b}:lock");
        assert!(!ab.lock().starts_with("p:{a}"));
        // Braces and percent signs cannot end the tag early or alias another key.
        assert_eq!(k("x}y").lock(), "p:{x%7Dy}:lock");
        assert_eq!(k("x{y").lock(), "p:{x%7By}:lock");
        assert_eq!(k("x%7Dy").lock(), "p:{x%257Dy}:lock");
        assert_ne!(k("x}y").lock(), k("x%7Dy").lock());
        let r = fence_key("p", &ResourceId::new("orders/42").unwrap());
        assert_eq!(r, "p:{orders/42}:fence");
    }

    #[test]
    fn value_round_trip_with_awkward_labels() {
        let owner = OwnerId::new("host|1/%7C").unwrap();
        let parts = ValueParts::new(0xabc, &owner, Some("op|x"));
        let value = format!("{}{}{}", parts.head, 42, parts.tail);
        assert!(value.starts_with("v1|00000000000000000000000000000abc|42|"));
        let v = LockValue::parse(&value).unwrap();
        assert_eq!(v.nonce, 0xabc);
        assert_eq!(v.token, Token::new(42).unwrap());
        assert_eq!(v.owner, owner);
        assert_eq!(v.operation.as_deref(), Some("op|x"));
        assert!(!format!("{v:?}").contains("abc"));
        let none = ValueParts::new(1, &owner, None);
        let v = LockValue::parse(&format!("{}7{}", none.head, none.tail)).unwrap();
        assert_eq!(v.operation, None);
        assert!(LockValue::parse("hello").is_none());
        assert!(LockValue::parse("v1|zz|1|2|o|").is_none());
    }
}
