//! The key layout: where each lock, attempt marker and audit record lives.
//!
//! ```text
//! <prefix>/locks/<escaped key>                  the lock: locked by the holder's session, its
//!                                               value the holder record
//! <prefix>/attempts/<session>/<attempt>         an acquire attempt whose outcome was not seen
//!                                               (locked by the session, deleted with it)
//! <prefix>/forced/<escaped key>                 the newest 100 forced releases of the lock
//! ```
//!
//! An attempt's marker is written by the client when it gives up on a lock request whose answer
//! it did not see; the request's transaction requires the marker to be absent
//! (`check-not-exists`), so if Consul applies it late it locks nothing.
//!
//! `<escaped key>` is [`escape_key`]'s: every `/`-separated segment in Consul's KV alphabet.

use lease_core::LockKey;

/// The Consul KV key holding the lock on `key` under `prefix`: `<prefix>/locks/<escaped key>`.
pub(crate) fn lock_key(prefix: &str, key: &LockKey) -> String {
    format!("{prefix}/locks/{}", escape_key(key))
}

/// Where the forced releases of `key` under `prefix` are recorded: `<prefix>/forced/<escaped key>`.
pub(crate) fn audit_key(prefix: &str, key: &LockKey) -> String {
    format!("{prefix}/forced/{}", escape_key(key))
}

/// The prefix every lock key ([`lock_key`]) under `prefix` starts with.
pub(crate) fn locks_prefix(prefix: &str) -> String {
    format!("{prefix}/locks/")
}

/// The marker that cancels the acquire attempt `attempt` of `session` whose outcome was not seen.
pub(crate) fn attempt_key(prefix: &str, session: &str, attempt: &str) -> String {
    format!("{prefix}/attempts/{session}/{attempt}")
}

/// Maps a lock key onto Consul's KV key alphabet.
///
/// Current Consul releases accept only `A-Z a-z 0-9 , - _ . /` in KV keys and refuse keys ending
/// in a file extension such as `.json`; older ones accept anything. Every `/`-separated segment
/// keeps `A-Z a-z 0-9 - _` and writes every other byte of its UTF-8 form as `,XX` (upper-case
/// hex), so no key contains `.` and distinct lock keys never collide: `orders/42` stays
/// `orders/42`, `with space` becomes `with,20space`, `q.r` becomes `q,2Er`.
pub fn escape_key(key: &LockKey) -> String {
    let mut out = String::with_capacity(key.as_str().len());
    for (i, segment) in key.segments().enumerate() {
        if i > 0 {
            out.push('/');
        }
        for b in segment.bytes() {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                out.push(b as char);
            } else {
                out.push_str(&format!(",{b:02X}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_escape_into_consuls_alphabet_without_collisions() {
        let k = |s: &str| LockKey::new(s).unwrap();
        assert_eq!(escape_key(&k("orders/42")), "orders/42");
        assert_eq!(escape_key(&k("with space")), "with,20space");
        assert_eq!(escape_key(&k("q.r")), "q,2Er");
        assert_eq!(escape_key(&k("a,b")), "a,2Cb");
        assert_eq!(escape_key(&k("é")), ",C3,A9");
        assert_ne!(escape_key(&k("a,2Eb")), escape_key(&k("a.b")));
        assert_eq!(
            lock_key("fenced", &k("report.json")),
            "fenced/locks/report,2Ejson"
        );
        assert_eq!(audit_key("a/b", &k("x y")), "a/b/forced/x,20y");
        assert_eq!(locks_prefix("fenced"), "fenced/locks/");
        assert_eq!(attempt_key("fenced", "s1", "7"), "fenced/attempts/s1/7");
    }
}
