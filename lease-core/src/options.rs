//! Lease options, backend capabilities, and the validation that runs before anything is sent.

use std::fmt;
use std::time::Duration;

use crate::error::{Error, InvalidInput};
use crate::token::Token;

/// What a backend supports, declared by each [`crate::Coordinator`].
///
/// The conformance suite reads these to decide which cases apply; a case that needs a missing
/// capability is reported as skipped by name. [`LeaseOptions::validate`] checks a TTL against
/// `min_ttl` and `max_ttl`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// A short, stable backend name (`memory`, `redis`, `etcd`, `zookeeper`, `consul`).
    pub backend: &'static str,
    /// The smallest TTL the backend honours; smaller requests are rejected as invalid input.
    pub min_ttl: Duration,
    /// The largest TTL the backend honours.
    pub max_ttl: Duration,
    /// Whether each acquisition gets exactly its own TTL (false when leases share a session whose
    /// TTL is fixed per client, as on etcd, ZooKeeper and Consul).
    pub per_lease_ttl: bool,
    /// Whether the coordinator's tokens survive a coordinator restart.
    pub durable_tokens: bool,
    /// Whether other OS processes can reach the same coordinator (needed by the fault cases that
    /// pause or kill a holder process).
    pub shared_across_processes: bool,
    /// How long the backend keeps every other client from taking a key after the session that
    /// held it was invalidated out of band (Consul's session lock-delay), so that the old
    /// holder learns of its loss first. Zero where the backend has no such delay.
    pub lock_delay: Duration,
}

impl Capabilities {
    /// Capabilities with conservative defaults: per-lease TTL, no minimum beyond 1 ms,
    /// tokens neither durable nor shared across processes. Adapters override what they offer.
    pub fn new(backend: &'static str) -> Self {
        Capabilities {
            backend,
            min_ttl: Duration::from_millis(1),
            max_ttl: LeaseOptions::MAX_TTL,
            per_lease_ttl: true,
            durable_tokens: false,
            shared_across_processes: false,
            lock_delay: Duration::ZERO,
        }
    }

    /// Sets the minimum TTL.
    pub fn min_ttl(mut self, d: Duration) -> Self {
        self.min_ttl = d;
        self
    }

    /// Sets the maximum TTL (never above [`LeaseOptions::MAX_TTL`]).
    pub fn max_ttl(mut self, d: Duration) -> Self {
        self.max_ttl = d.min(LeaseOptions::MAX_TTL);
        self
    }

    /// Sets whether each lease has its own TTL.
    pub fn per_lease_ttl(mut self, yes: bool) -> Self {
        self.per_lease_ttl = yes;
        self
    }

    /// Sets whether tokens survive a coordinator restart.
    pub fn durable_tokens(mut self, yes: bool) -> Self {
        self.durable_tokens = yes;
        self
    }

    /// Sets whether other processes share this coordinator.
    pub fn shared_across_processes(mut self, yes: bool) -> Self {
        self.shared_across_processes = yes;
        self
    }

    /// Sets the lock-delay after an out-of-band session invalidation.
    pub fn lock_delay(mut self, d: Duration) -> Self {
        self.lock_delay = d;
        self
    }
}

/// A short, safe label for who holds a lock (host and process by default).
///
/// It is shown by `inspect` and in logs, so it must never carry a credential. It is *not* what a
/// backend compares on release: each lease also has a private random nonce for that.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OwnerId(String);

/// The longest owner id, operation name, actor or reason, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;

fn validate_label(field: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() {
        return Err(InvalidInput::Empty { what: field });
    }
    if value.len() > MAX_LABEL_BYTES {
        return Err(InvalidInput::TooLong {
            what: field,
            value: value.chars().take(32).collect::<String>() + "...",
            len: value.len(),
            max: MAX_LABEL_BYTES,
        });
    }
    if let Some((index, ch)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(InvalidInput::ControlCharacter {
            what: field,
            value: value.to_owned(),
            ch,
            index,
        });
    }
    Ok(())
}

impl OwnerId {
    /// A validated owner label: 1 to [`MAX_LABEL_BYTES`] bytes, no control characters.
    pub fn new(value: impl Into<String>) -> Result<Self, InvalidInput> {
        let value = value.into();
        validate_label("owner id", &value)?;
        Ok(OwnerId(value))
    }

    /// `host/pid` for this process (the host from `/proc/sys/kernel/hostname` or `$HOSTNAME`).
    pub fn for_this_process() -> Self {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .map(|h| {
                h.trim()
                    .chars()
                    .filter(|c| !c.is_control())
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unknown-host".to_owned());
        let host: String = host.chars().take(200).collect();
        OwnerId(format!("{host}/{}", std::process::id()))
    }

    /// The label.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for OwnerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How to acquire a lease: its TTL, how long to wait, and labels shown to operators.
///
/// Built with [`LeaseOptions::new`] and setters; checked by [`LeaseOptions::validate`], which every
/// coordinator calls before sending anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseOptions {
    ttl: Duration,
    wait: Duration,
    owner: Option<OwnerId>,
    operation: Option<String>,
    drift_margin: Option<Duration>,
}

impl LeaseOptions {
    /// The largest TTL any backend accepts: 24 hours (Consul's session limit). Longer work renews.
    pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
    /// The largest wait bound: 24 hours.
    pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

    /// Options with this TTL, no wait (`acquire` tries once), the coordinator's default owner id,
    /// no operation name, and the default drift margin ([`crate::adapter::clock::default_drift_margin`]).
    pub fn new(ttl: Duration) -> Self {
        LeaseOptions {
            ttl,
            wait: Duration::ZERO,
            owner: None,
            operation: None,
            drift_margin: None,
        }
    }

    /// How long `acquire` may wait for the key to come free (ignored by `try_acquire`).
    ///
    /// Requests keep the coordinator's request timeout, the one that puts the attempt in line
    /// included: against a slow or unreachable backend `acquire` may return up to about two
    /// request timeouts after the wait, with `Unavailable` or `OutcomeUnknown` when it never saw
    /// the key busy, never `Timeout` (decision 0036).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The owner label shown by `inspect` (default: the coordinator's, usually `host/pid`).
    pub fn owner(mut self, owner: OwnerId) -> Self {
        self.owner = Some(owner);
        self
    }

    /// An operation name shown by `inspect` (for example `nightly-reconcile`). Checked by
    /// [`LeaseOptions::validate`]: 1 to [`MAX_LABEL_BYTES`] bytes, no control characters.
    pub fn operation(mut self, operation: impl Into<String>) -> Self {
        self.operation = Some(operation.into());
        self
    }

    /// Overrides the margin subtracted from the TTL when computing local validity. It must be
    /// smaller than the TTL.
    pub fn drift_margin(mut self, margin: Duration) -> Self {
        self.drift_margin = Some(margin);
        self
    }

    /// The TTL asked for.
    pub fn ttl_value(&self) -> Duration {
        self.ttl
    }

    /// The wait bound.
    pub fn wait_value(&self) -> Duration {
        self.wait
    }

    /// The owner label, if set.
    pub fn owner_value(&self) -> Option<&OwnerId> {
        self.owner.as_ref()
    }

    /// The operation name, if set.
    pub fn operation_value(&self) -> Option<&str> {
        self.operation.as_deref()
    }

    /// The drift margin for a lease granted `granted_ttl`: the override if set, else the default.
    pub fn drift_margin_for(&self, granted_ttl: Duration) -> Duration {
        self.drift_margin
            .unwrap_or_else(|| crate::adapter::clock::default_drift_margin(granted_ttl))
    }

    /// Checks the options against a backend's capabilities. Every coordinator calls this before
    /// sending anything; an error names the offending value.
    pub fn validate(&self, caps: &Capabilities) -> Result<(), Error> {
        if self.ttl.is_zero() {
            return Err(InvalidInput::ZeroTtl.into());
        }
        let max = caps.max_ttl.min(Self::MAX_TTL);
        if self.ttl > max {
            return Err(InvalidInput::TtlTooLarge { ttl: self.ttl, max }.into());
        }
        if self.ttl < caps.min_ttl {
            return Err(InvalidInput::TtlBelowMinimum {
                ttl: self.ttl,
                min: caps.min_ttl,
                backend: caps.backend,
            }
            .into());
        }
        if self.wait > Self::MAX_WAIT {
            return Err(InvalidInput::WaitTooLarge {
                wait: self.wait,
                max: Self::MAX_WAIT,
            }
            .into());
        }
        if let Some(op) = &self.operation {
            validate_label("operation", op)?;
        }
        if let Some(m) = self.drift_margin {
            if m >= self.ttl {
                return Err(InvalidInput::OutOfRange {
                    field: "drift_margin",
                    value: format!("{m:?}"),
                    expected: "smaller than the TTL",
                }
                .into());
            }
        }
        Ok(())
    }
}

/// Parses a duration option written in whole milliseconds (a URL's `..._ms` parameter) and
/// checks that it lies in `min..=max`. `None` otherwise: the caller names the option and the
/// range in its own `InvalidInput`.
pub fn parse_millis(value: &str, min: Duration, max: Duration) -> Option<Duration> {
    value
        .parse::<u64>()
        .ok()
        .map(Duration::from_millis)
        .filter(|d| (min..=max).contains(d))
}

/// Checks a duration set through a builder against `min..=max`; otherwise
/// `InvalidInput::OutOfRange` naming `field`, the value and `expected` (the range in words).
pub fn duration_in_range(
    field: &'static str,
    d: Duration,
    min: Duration,
    max: Duration,
    expected: &'static str,
) -> Result<Duration, InvalidInput> {
    if (min..=max).contains(&d) {
        Ok(d)
    } else {
        Err(InvalidInput::OutOfRange {
            field,
            value: format!("{d:?}"),
            expected,
        })
    }
}

/// An operator's request to remove a lock regardless of its owner: who and why, both recorded.
///
/// By default [`Coordinator::force_release`](crate::Coordinator::force_release) removes whoever
/// holds the key. With [`expect_token`](ForceRelease::expect_token) it becomes a
/// compare-and-delete: the holder is removed only if its token is exactly the expected one, and
/// that comparison is made on the server in the same atomic step as the delete (never a read
/// from the client followed by a delete), so a holder that arrived after the operator's
/// `inspect` is never removed. If the key is held under another token, or is free, nothing is
/// removed and the call returns [`Error::HolderChanged`](crate::Error::HolderChanged) naming the
/// expected token and the token found (`None` for a free key).
///
/// A refused attempt is not a forced release and is not written to any backend's audit trail
/// (the trail lists what was removed); it is logged as a `warn` event naming the actor, the
/// reason, the expected and the found token. (One exception: ZooKeeper writes its audit node
/// before its delete, so if the expected holder leaves between the adapter's read and that
/// delete, an audit node stays behind for an attempt that is then refused; see its README.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForceRelease {
    actor: String,
    reason: String,
    expected: Option<Token>,
}

impl ForceRelease {
    /// Both are required: 1 to [`MAX_LABEL_BYTES`] bytes, no control characters.
    pub fn new(actor: impl Into<String>, reason: impl Into<String>) -> Result<Self, InvalidInput> {
        let (actor, reason) = (actor.into(), reason.into());
        validate_label("actor", &actor)?;
        validate_label("reason", &reason)?;
        Ok(ForceRelease {
            actor,
            reason,
            expected: None,
        })
    }

    /// Removes the holder only if its token is exactly `token`, compared atomically on the
    /// server; otherwise removes nothing and fails with
    /// [`Error::HolderChanged`](crate::Error::HolderChanged) (also when the key is free).
    pub fn expect_token(mut self, token: Token) -> Self {
        self.expected = Some(token);
        self
    }

    /// The token the holder must have to be removed, if the request names one.
    pub fn expected_token(&self) -> Option<Token> {
        self.expected
    }

    /// What every backend does when the holder it found is not the `expected` one: logs the
    /// refusal once (a warning naming actor, reason, expected and found) and returns
    /// [`Error::HolderChanged`]. `found` is the token of the holder the backend saw, `None` for
    /// a free key. Nothing may have been removed when this is called.
    pub fn refused(
        &self,
        backend: &'static str,
        key: &crate::LockKey,
        expected: Token,
        found: Option<Token>,
    ) -> Error {
        tracing::warn!(
            backend,
            key = %key,
            actor = self.actor(),
            reason = self.reason(),
            expected_token = expected.get(),
            found_token = found.map(|t| t.get()),
            "force_release refused: the holder is not the expected one; nothing removed"
        );
        Error::HolderChanged {
            key: key.to_string(),
            expected,
            found,
        }
    }

    /// What a backend returns when it removed something from `key` for certain (and audited
    /// it) but has no holder to report, such as a value another writer put there under a key
    /// no token was ever issued for: [`Error::Misconfigured`] with `problem` (which should say
    /// the key is free now). The call fails, so [`Instrumented`](crate::Instrumented) does not
    /// report it; this does instead, the same way: one `warn` event naming actor and reason,
    /// and one count in `fenced_forced_releases_total`.
    pub fn removed_without_holder(
        &self,
        backend: &'static str,
        key: &crate::LockKey,
        problem: String,
    ) -> Error {
        crate::metrics::forced_release(backend);
        tracing::warn!(
            backend,
            key = %key,
            actor = self.actor(),
            reason = self.reason(),
            removed_owner = None::<&str>,
            removed_token = None::<u64>,
            "lock force-released by operator: {problem}"
        );
        Error::Misconfigured {
            backend,
            problems: vec![problem],
        }
    }

    /// How many times a backend that reads the holder and then deletes it on condition reads
    /// again when the holder (or its audit record) changed in between, before it gives up with
    /// [`Self::kept_changing`].
    pub const ATTEMPTS: usize = 8;

    /// What such a backend returns after [`Self::ATTEMPTS`] reads in a row each found the
    /// holder or its audit record changed by its conditional write: [`Error::Unavailable`]
    /// naming the key. Nothing was removed or recorded (every conditional write failed); the
    /// caller may try again.
    pub fn kept_changing(&self, backend: &'static str, key: &crate::LockKey) -> Error {
        Error::unavailable(
            backend,
            format!(
                "force_release of {key:?}: the holder or its audit record changed between the \
                 read and the write {} times in a row; nothing removed",
                Self::ATTEMPTS
            ),
        )
    }

    /// For backends that read the holder before their conditional delete: `Ok(())` when no token
    /// is expected or `found` is it, otherwise [`Self::refused`].
    pub fn check_expected(
        &self,
        backend: &'static str,
        key: &crate::LockKey,
        found: Option<Token>,
    ) -> Result<(), Error> {
        match self.expected {
            Some(expected) if found != Some(expected) => {
                Err(self.refused(backend, key, expected, found))
            }
            _ => Ok(()),
        }
    }

    /// Who forced the release.
    pub fn actor(&self) -> &str {
        &self.actor
    }

    /// Why.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> Capabilities {
        Capabilities::new("test").min_ttl(Duration::from_secs(2))
    }

    fn invalid(r: Result<(), Error>) -> InvalidInput {
        match r {
            Err(Error::InvalidInput(i)) => i,
            other => panic!("expected invalid input, got {other:?}"),
        }
    }

    #[test]
    fn validation_names_each_bad_value() {
        let s = Duration::from_secs;
        assert_eq!(
            invalid(LeaseOptions::new(Duration::ZERO).validate(&caps())),
            InvalidInput::ZeroTtl
        );
        assert!(matches!(
            invalid(LeaseOptions::new(Duration::MAX).validate(&caps())),
            InvalidInput::TtlTooLarge { .. }
        ));
        let e = invalid(LeaseOptions::new(s(1)).validate(&caps()));
        assert!(matches!(e, InvalidInput::TtlBelowMinimum { .. }));
        assert!(e.to_string().contains("test's minimum 2s"), "{e}");
        assert!(matches!(
            invalid(
                LeaseOptions::new(s(5))
                    .wait(Duration::MAX)
                    .validate(&caps())
            ),
            InvalidInput::WaitTooLarge { .. }
        ));
        assert!(matches!(
            invalid(LeaseOptions::new(s(5)).operation("").validate(&caps())),
            InvalidInput::Empty { what: "operation" }
        ));
        assert!(matches!(
            invalid(LeaseOptions::new(s(5)).operation("a\tb").validate(&caps())),
            InvalidInput::ControlCharacter { .. }
        ));
        assert!(matches!(
            invalid(LeaseOptions::new(s(5)).drift_margin(s(5)).validate(&caps())),
            InvalidInput::OutOfRange {
                field: "drift_margin",
                ..
            }
        ));
        LeaseOptions::new(s(5))
            .wait(s(60))
            .operation("reconcile")
            .validate(&caps())
            .unwrap();
    }

    #[test]
    fn duration_options() {
        let (lo, hi) = (Duration::from_millis(1), Duration::from_secs(60));
        assert_eq!(
            parse_millis("500", lo, hi),
            Some(Duration::from_millis(500))
        );
        for bad in ["0", "60001", "-1", "1.5", "", "x"] {
            assert_eq!(parse_millis(bad, lo, hi), None, "{bad}");
        }
        assert!(duration_in_range("t", Duration::from_secs(60), lo, hi, "1 ms to 60 s").is_ok());
        let e = duration_in_range("t", Duration::ZERO, lo, hi, "1 ms to 60 s").unwrap_err();
        assert!(
            e.to_string().contains("t = 0ns") && e.to_string().contains("1 ms to 60 s"),
            "{e}"
        );
    }

    #[test]
    fn capabilities_cap_max_ttl() {
        let c = Capabilities::new("x").max_ttl(Duration::MAX);
        assert_eq!(c.max_ttl, LeaseOptions::MAX_TTL);
    }

    #[test]
    fn labels() {
        assert!(OwnerId::new("svc-a/123").is_ok());
        assert!(OwnerId::new("").is_err());
        assert!(OwnerId::new("x".repeat(300)).is_err());
        let me = OwnerId::for_this_process();
        assert!(me.as_str().ends_with(&format!("/{}", std::process::id())));
        assert!(ForceRelease::new("alice", "stuck job").is_ok());
        assert!(matches!(
            ForceRelease::new("", "x"),
            Err(InvalidInput::Empty { what: "actor" })
        ));
        assert!(matches!(
            ForceRelease::new("a", ""),
            Err(InvalidInput::Empty { what: "reason" })
        ));
    }

    #[test]
    fn a_force_release_checks_the_expected_token_and_names_the_key_when_it_gives_up() {
        let key = crate::LockKey::new("jobs/nightly").unwrap();
        let any = ForceRelease::new("alice", "stuck job").unwrap();
        let t = |n| Token::new(n).unwrap();
        assert!(any.check_expected("test", &key, None).is_ok());
        assert!(any.check_expected("test", &key, Some(t(7))).is_ok());
        let exact = any.clone().expect_token(t(7));
        assert!(exact.check_expected("test", &key, Some(t(7))).is_ok());
        for found in [None, Some(t(8))] {
            match exact.check_expected("test", &key, found) {
                Err(Error::HolderChanged {
                    key: k,
                    expected,
                    found: f,
                }) => {
                    assert_eq!((k.as_str(), expected, f), ("jobs/nightly", t(7), found));
                }
                other => panic!("expected HolderChanged, got {other:?}"),
            }
        }
        match any.kept_changing("test", &key) {
            Error::Unavailable {
                backend, message, ..
            } => {
                assert_eq!(backend, "test");
                assert!(message.contains("\"jobs/nightly\""), "{message}");
                assert!(message.contains("nothing removed"), "{message}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
