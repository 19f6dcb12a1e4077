//! The key layout: where each lock, waiter, fence and audit record lives.
//!
//! ```text
//! <prefix>/lock/<name>/<session lease id, 16 hex>-<slot, hex>      one key per holder or waiter
//! <prefix>/fence/<resource>/newest                                  newest accepted token, 20 digits
//! <prefix>/fence/<resource>/value                                   last written value, with its token
//! <prefix>/audit/<name>                                             the last forced release of a lock
//! <prefix>/abandoned/<name>/<session lease id>-<attempt>            an attempt whose outcome was not seen
//! <prefix>/abandoned/<name>/<session lease id>-<attempt>/resent     a try_acquire sent again in doubt
//! <prefix>/fence-retired/<resource>/<fence id, 16 hex>-<n, hex>      a fence write retired unanswered
//! ```
//!
//! An `abandoned` marker is written (attached to the session lease) by the client when it gives
//! up on an acquisition request whose answer it did not see; that request's transaction requires
//! the marker to be absent, so if etcd applies it late it writes nothing. A `resent` marker is
//! written by every `try_acquire` transaction sent again after a send in doubt, whether it
//! creates the key, finds it, or finds the lock held: every send of the attempt requires it to
//! be absent too, so an earlier send applied late writes nothing either, and the cleanup, which
//! looks only at its own marker, still deletes the key.
//!
//! `<name>` and `<resource>` are percent-encoded: every byte other than `A-Z a-z 0-9 - . _ ~` is
//! written `%XX`, so an encoded name never contains `/`. Followed by the `/` terminator, no
//! lock's key range is a prefix of another lock's (`a/` vs `a%2Fb/` vs `ab/`), which is the
//! mistake of etcd's own Lock RPC (a lock on `pfx` waits while `pfx/b` is held).

use lease_core::{LockKey, ResourceId};

/// Percent-encodes a lock or resource name so that it contains no `/` (see the module docs).
pub use lease_core::adapter::percent_encode as encode_name;

/// The key range holding `key`'s holder and waiters under `key_prefix`:
/// `<key_prefix>/lock/<encoded key>/`. An operator deleting every key with this prefix
/// (`etcdctl del --prefix`) removes the lock and its queue.
pub fn lock_prefix(key_prefix: &str, key: &LockKey) -> String {
    format!("{key_prefix}/lock/{}/", encode_name(key.as_str()))
}

/// The key range holding `resource`'s fence state: `<key_prefix>/fence/<encoded resource>/`.
pub fn fence_prefix(key_prefix: &str, resource: &ResourceId) -> String {
    format!("{key_prefix}/fence/{}/", encode_name(resource.as_str()))
}

/// The marker that retires one fence write whose outcome was not seen:
/// `<key_prefix>/fence-retired/<encoded resource>/<fence id>-<attempt>`, outside the resource's
/// range, so a read of its state never shows it. The write requires it to be absent.
pub(crate) fn retired_write_key(
    key_prefix: &str,
    resource: &ResourceId,
    fence: u64,
    attempt: u64,
) -> String {
    format!(
        "{key_prefix}/fence-retired/{}/{fence:016x}-{attempt:x}",
        encode_name(resource.as_str())
    )
}

/// The key recording the forced releases of `key`: `<key_prefix>/audit/<encoded key>`, a JSON
/// array of the newest [`lease_core::AuditRecord::MAX_LIMIT`] records, oldest first (a key
/// written by an earlier version holds one record as a JSON object).
pub fn audit_key(key_prefix: &str, key: &LockKey) -> String {
    format!("{key_prefix}/audit/{}", encode_name(key.as_str()))
}

/// A holder's or waiter's own key: the lock prefix, the session's lease id and a slot number,
/// the lowest not in use by another holder or waiter of this lock on this session (so tasks
/// sharing a client never share a key, and one client reuses the same names: see
/// [`Slots`]).
pub(crate) fn own_key(lock_prefix: &str, lease_id: i64, attempt: u64) -> String {
    format!("{lock_prefix}{:016x}-{attempt:x}", lease_id as u64)
}

/// The lease id of the session that created `key`, a key of the lock at `lock_prefix` named by
/// [`own_key`]; `None` for a key not named so (written by another tool).
pub(crate) fn session_lease_of(lock_prefix: &str, key: &[u8]) -> Option<i64> {
    let name = key.strip_prefix(lock_prefix.as_bytes())?;
    let (lease, attempt) = std::str::from_utf8(name).ok()?.split_once('-')?;
    let hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
    if lease.len() != 16 || !hex(lease) || !hex(attempt) {
        return None;
    }
    u64::from_str_radix(lease, 16).ok().map(|l| l as i64)
}

/// The resend marker of the attempt whose abandonment marker is `abandoned` (see the module
/// docs).
pub(crate) fn resent_key(abandoned: &str) -> String {
    format!("{abandoned}/resent")
}

/// The marker that retires one acquisition attempt (see the module docs): outside the lock's
/// range, so it never shows in its queue, and named like the attempt's own key.
pub(crate) fn abandoned_key(
    key_prefix: &str,
    key: &LockKey,
    lease_id: i64,
    attempt: u64,
) -> String {
    format!(
        "{key_prefix}/abandoned/{}/{:016x}-{attempt:x}",
        encode_name(key.as_str()),
        lease_id as u64
    )
}

/// A fence token as stored: 20 decimal digits, so that etcd's byte-wise value comparison in a
/// transaction orders tokens numerically.
pub(crate) fn token_bytes(t: lease_core::Token) -> String {
    format!("{:020}", t.get())
}

/// The numbers in use in holders' and waiters' own key names, per session and lock.
///
/// A key is named `<lock prefix><session>-<slot>` with the lowest slot free for that session
/// and lock, so one client acquiring a lock again and again writes the same key name each time.
/// etcd keeps an index entry for every key name ever written until the next compaction, and
/// every read of a lock's range (the `try_acquire` check, the queue read) walks them all: with a
/// new name per attempt, each acquisition of a lock cost more than the one before (measured with
/// lease-bench, server CPU per acquire+release rose from 362 to 429 µs between a 1 s and a 6 s
/// run, while a client reusing its key name stayed at 256 µs).
///
/// A slot stays taken for as long as a key by its name may exist or may still be written by a
/// request in flight: by the attempt, then by the lease, then by a background cleanup, each
/// holding a [`Slot`] clone.
#[derive(Debug, Default)]
pub(crate) struct Slots {
    used: std::sync::Mutex<std::collections::HashMap<String, std::collections::BTreeSet<u64>>>,
}

/// A slot in use (see [`Slots`]); the last clone dropped frees it.
#[derive(Debug, Clone)]
pub(crate) struct Slot(std::sync::Arc<Taken>);

#[derive(Debug)]
struct Taken {
    slots: std::sync::Arc<Slots>,
    base: String,
    number: u64,
}

impl Slots {
    /// Takes the lowest free slot of `base` (a lock prefix and a session).
    pub(crate) fn take(self: &std::sync::Arc<Self>, base: String) -> Slot {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let set = used.entry(base.clone()).or_default();
        let number = (0..).find(|n| !set.contains(n)).unwrap_or(0);
        set.insert(number);
        Slot(std::sync::Arc::new(Taken {
            slots: self.clone(),
            base,
            number,
        }))
    }

    /// Slots in use over every lock and session (for tests).
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        let used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        used.values().map(|s| s.len()).sum()
    }
}

impl Slot {
    /// Its number in the key name.
    pub(crate) fn number(&self) -> u64 {
        self.0.number
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut used = self.slots.used.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(set) = used.get_mut(&self.base) {
            set.remove(&self.number);
            if set.is_empty() {
                used.remove(&self.base);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn p(k: &str) -> String {
        lock_prefix("fenced", &LockKey::new(k).unwrap())
    }

    #[test]
    fn no_name_is_a_prefix_of_another() {
        let names = [
            "a", "a/b", "ab", "a/b/c", "a b", "a%2Fb", "ключ", "a.b", "a-b", "a~", "a_",
        ];
        for x in names {
            for y in names {
                if x != y {
                    assert!(
                        !p(y).starts_with(&p(x)),
                        "{x:?} -> {} vs {y:?} -> {}",
                        p(x),
                        p(y)
                    );
                }
            }
        }
        assert_eq!(p("a/b"), "fenced/lock/a%2Fb/");
        assert_eq!(p("a%2Fb"), "fenced/lock/a%252Fb/");
        assert_eq!(p("with space"), "fenced/lock/with%20space/");
    }

    #[test]
    fn own_keys_sit_under_the_lock_prefix() {
        let k = own_key(&p("x"), 0x1234, 10);
        assert_eq!(k, "fenced/lock/x/0000000000001234-a");
        assert!(k.starts_with(&p("x")));
        // Negative lease ids (never issued by etcd, but the type allows them) stay 16 digits.
        assert_eq!(own_key("q/", -1, 1), "q/ffffffffffffffff-1");
    }

    #[test]
    fn an_own_key_names_its_session_lease() {
        for lease in [0x1234, -1, i64::MAX] {
            let k = own_key(&p("x"), lease, 10);
            assert_eq!(session_lease_of(&p("x"), k.as_bytes()), Some(lease));
        }
        for other in [
            "fenced/lock/x/1234-a",
            "fenced/lock/x/0000000000001234",
            "fenced/lock/y/0000000000001234-a",
            "fenced/lock/x/000000000000123g-a",
            "fenced/lock/x/0000000000001234-",
            "fenced/lock/x/+000000000001234-a",
        ] {
            assert_eq!(session_lease_of(&p("x"), other.as_bytes()), None, "{other}");
        }
    }

    #[test]
    fn abandoned_markers_sit_outside_every_lock_range() {
        let k = LockKey::new("x").unwrap();
        let m = abandoned_key("fenced", &k, 0x1234, 10);
        assert_eq!(m, "fenced/abandoned/x/0000000000001234-a");
        assert!(!m.starts_with("fenced/lock/"));
    }

    #[test]
    fn tokens_compare_as_bytes_like_numbers() {
        let t = |n| lease_core::Token::new(n).unwrap();
        assert!(token_bytes(t(9)) < token_bytes(t(10)));
        assert!(token_bytes(t(99)) < token_bytes(lease_core::Token::MAX));
        assert_eq!(token_bytes(lease_core::Token::MAX).len(), 20);
    }

    #[test]
    fn the_lowest_free_slot_is_reused_once_every_clone_is_dropped() {
        let slots = Arc::new(Slots::default());
        let a = slots.take("p/s".into());
        let b = slots.take("p/s".into());
        assert_eq!((a.number(), b.number()), (0, 1));
        assert_eq!(slots.take("q/s".into()).number(), 0, "per lock and session");
        let a2 = a.clone();
        drop(a);
        assert_eq!(
            slots.take("p/s".into()).number(),
            2,
            "a clone still holds 0"
        );
        drop(a2);
        assert_eq!(slots.take("p/s".into()).number(), 0);
        drop(b);
        assert_eq!(slots.in_use(), 0, "nothing left behind");
    }
}
