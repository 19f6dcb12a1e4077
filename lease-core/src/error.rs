//! The one error type of the workspace.
//!
//! Each variant names the caller's next step, not the layer that failed:
//!
//! | variant | what happened | what the caller does next |
//! |---|---|---|
//! | [`Error::Held`] | another owner holds the key (`try_acquire`) | back off, or `acquire` with a wait |
//! | [`Error::Timeout`] | the wait bound passed before the key came free | back off; the key is busy |
//! | [`Error::Lost`] | this lease is gone (expired, revoked, released, superseded) | stop working under it |
//! | [`Error::Stale`] | the fence rejected an older token | stop: a newer holder has written or claimed |
//! | [`Error::Unavailable`] | the backend could not be reached; nothing was applied | retry later ([`Error::is_retryable`]) |
//! | [`Error::OutcomeUnknown`] | a request was sent and its outcome was not seen | re-read before acting |
//! | [`Error::InvalidInput`] | the call itself is wrong; nothing was sent (but for a TTL below a server's own minimum, which only its grant shows: that grant is given back) | fix the call |
//! | [`Error::Unsupported`] | the backend cannot do this | use another backend or another call |
//! | [`Error::Misconfigured`] | the backend's settings cannot keep the guarantees | fix the server's configuration |
//! | [`Error::NotFound`] | the thing to act on does not exist | create it first |
//! | [`Error::TokenRegression`] | the backend issued a token not above one seen before | stop: the token source went backwards |
//! | [`Error::TokenOutOfRange`] | the backend's native token is not a fencing token (negative, or above `i64::MAX`) | stop: the token source is broken |
//! | [`Error::HolderChanged`] | a `force_release` with an expected token found another holder, or none; nothing was removed | `inspect` again and decide anew |

use std::time::Duration;

use crate::token::Token;

/// A convenient alias for results in this workspace.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A boxed error from a backend's client library, kept as the `source` of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why a lease stopped being held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LostReason {
    /// Local validity ran out before a renewal was confirmed.
    Expired,
    /// An operator (or `force_release`) removed the lock.
    Revoked,
    /// The lease was released by its owner.
    Released,
    /// The coordinator shows another owner, or no owner, for the key.
    Superseded,
    /// The backend's session ended (for example a ZooKeeper session expiry or a revoked etcd lease).
    SessionEnded,
    /// The keeper stopped renewing on purpose (no progress, or the maximum hold time passed).
    KeeperStopped,
}

impl std::fmt::Display for LostReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LostReason::Expired => "expired before renewal was confirmed",
            LostReason::Revoked => "revoked",
            LostReason::Released => "released",
            LostReason::Superseded => "superseded by another owner",
            LostReason::SessionEnded => "backend session ended",
            LostReason::KeeperStopped => "keeper stopped renewing",
        })
    }
}

/// Input rejected before anything was sent to a backend, with one exception: a TTL below a
/// server's own minimum where only the server's grant shows it (etcd raises a TTL below its
/// cluster's minimum silently; the adapter gives that grant back and reports
/// [`InvalidInput::TtlBelowMinimum`] naming the server's minimum).
///
/// Every variant names the offending value (keys are shown escaped, so control characters are
/// visible and cannot forge log lines).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidInput {
    /// A key or resource name was empty.
    #[error("{what} is empty")]
    Empty {
        /// What kind of name it was ("lock key", "resource id", ...).
        what: &'static str,
    },
    /// A name was longer than the documented limit, in bytes.
    #[error("{what} {value:?} is {len} bytes long; the limit is {max} bytes")]
    TooLong {
        /// What kind of name it was.
        what: &'static str,
        /// The value, truncated to a readable prefix.
        value: String,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A name contained a control character, or an invisible formatting or line-separating one
    /// (Unicode categories Cc, Cf, Zl, Zp: bidirectional overrides, zero-width characters, line
    /// and paragraph separators), which would let two keys that print alike differ, or a key
    /// rewrite the log line or operator listing it appears in.
    #[error(
        "{what} {value:?} contains the control or formatting character {ch:?} at byte {index}"
    )]
    ControlCharacter {
        /// What kind of name it was.
        what: &'static str,
        /// The value.
        value: String,
        /// The character.
        ch: char,
        /// Its byte offset.
        index: usize,
    },
    /// A name was not valid UTF-8.
    #[error("{what} is not valid UTF-8 (first bad byte at {index})")]
    NotUtf8 {
        /// What kind of name it was.
        what: &'static str,
        /// Byte offset of the first invalid sequence.
        index: usize,
    },
    /// A name would escape or alias a path: `..` or `.` segments, a leading or trailing `/`, `//`.
    #[error("{what} {value:?} is not a clean path: {problem}")]
    PathEscape {
        /// What kind of name it was.
        what: &'static str,
        /// The value.
        value: String,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A TTL of zero.
    #[error("lease TTL must be positive, got 0")]
    ZeroTtl,
    /// A TTL above [`crate::LeaseOptions::MAX_TTL`].
    #[error("lease TTL {ttl:?} exceeds the maximum {max:?}")]
    TtlTooLarge {
        /// The TTL asked for.
        ttl: Duration,
        /// The maximum.
        max: Duration,
    },
    /// A TTL below the backend's declared minimum, or below the server's own where only its
    /// grant shows it (see [`InvalidInput`]).
    #[error("lease TTL {ttl:?} is below {backend}'s minimum {min:?}")]
    TtlBelowMinimum {
        /// The TTL asked for.
        ttl: Duration,
        /// The backend's minimum.
        min: Duration,
        /// The backend's name.
        backend: &'static str,
    },
    /// A wait bound above [`crate::LeaseOptions::MAX_WAIT`].
    #[error("wait bound {wait:?} exceeds the maximum {max:?}")]
    WaitTooLarge {
        /// The wait bound asked for.
        wait: Duration,
        /// The maximum.
        max: Duration,
    },
    /// A field of the options was out of range.
    #[error("{field} = {value} is out of range: {expected}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value, rendered.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A backend URL could not be used. The URL is shown with any password redacted.
    #[error("backend URL {url} is invalid: {problem}")]
    Url {
        /// The URL, redacted.
        url: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A token value outside the range a fencing token may take (`0..=i64::MAX`).
    #[error("token {value} is out of range: fencing tokens fit a signed 64-bit column (0..=9223372036854775807)")]
    TokenOutOfRange {
        /// The value, rendered.
        value: String,
    },
}

/// The workspace's error: each variant names what the caller does next.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The key is held by another owner; `try_acquire` does not wait.
    #[error("lock {key:?} is held by another owner")]
    Held {
        /// The key.
        key: String,
    },
    /// The wait bound passed before the key came free.
    #[error("lock {key:?} was not acquired within {waited:?}")]
    Timeout {
        /// The key.
        key: String,
        /// How long the call waited.
        waited: Duration,
    },
    /// The lease is no longer held: stop working under it.
    #[error("lease on {key:?} (token {token}) is lost: {reason}")]
    Lost {
        /// The key.
        key: String,
        /// The lease's token.
        token: Token,
        /// Why.
        reason: LostReason,
    },
    /// The fence rejected a token older than the newest it has accepted.
    #[error(
        "stale token for resource {resource:?}: presented {presented}, newest accepted {current}"
    )]
    Stale {
        /// The protected resource.
        resource: String,
        /// The token the caller presented.
        presented: Token,
        /// The newest token the resource has accepted.
        current: Token,
    },
    /// The backend could not be reached or refused for a transient reason; nothing was applied.
    #[error("{backend} is unavailable: {message}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// What failed, without secrets.
        message: String,
        /// The client library's error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// A request was sent and its outcome was not observed: it may or may not have applied.
    #[error("{backend}: outcome of {operation} is unknown: {message}")]
    OutcomeUnknown {
        /// The backend's name.
        backend: &'static str,
        /// The operation ("acquire", "renew", "release", "write", ...).
        operation: &'static str,
        /// What happened, without secrets.
        message: String,
        /// The client library's error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The call was rejected before anything was sent.
    #[error("invalid input: {0}")]
    InvalidInput(#[from] InvalidInput),
    /// The backend does not support this operation or option.
    #[error("{backend} does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What is not supported.
        what: String,
    },
    /// The backend's configuration cannot keep this library's guarantees.
    #[error("{backend} is misconfigured for fenced leases: {}", problems.join("; "))]
    Misconfigured {
        /// The backend's name.
        backend: &'static str,
        /// Each missing or wrong setting, named.
        problems: Vec<String>,
    },
    /// The thing to act on does not exist (for example a fenced row that was never created).
    #[error("{what} does not exist")]
    NotFound {
        /// What was looked for, without secrets.
        what: String,
    },
    /// The backend issued a token that is not above one already seen: fail closed.
    #[error("{backend} issued token {observed} for {key:?}, not above the floor {floor}: the token source went backwards")]
    TokenRegression {
        /// The backend's name.
        backend: &'static str,
        /// The key.
        key: String,
        /// The token observed.
        observed: Token,
        /// The token it must exceed.
        floor: Token,
    },
    /// The backend's native token (a revision, a zxid, an index, a counter) is not a fencing
    /// token: negative, or above `i64::MAX`. Fail closed: no lease was handed out.
    #[error("{backend} issued the native token {native} for {key:?}, which is not a fencing token (0..=9223372036854775807): the token source is broken")]
    TokenOutOfRange {
        /// The backend's name.
        backend: &'static str,
        /// The key.
        key: String,
        /// The native value, rendered.
        native: String,
    },
    /// A [`ForceRelease`](crate::ForceRelease) with an
    /// [expected token](crate::ForceRelease::expect_token) found the key held under another
    /// token, or free: the server removed nothing.
    #[error(
        "lock {key:?} was not force-released: expected holder token {expected}, found {}",
        found_text(found)
    )]
    HolderChanged {
        /// The key.
        key: String,
        /// The token the request expected the holder to have.
        expected: Token,
        /// The holder's token at the time of the attempt, or `None` if the key was free.
        found: Option<Token>,
    },
}

/// How [`Error::HolderChanged`] shows the token it found.
fn found_text(found: &Option<Token>) -> String {
    match found {
        Some(t) => format!("token {t}"),
        None => "the lock free".to_owned(),
    }
}

impl Error {
    /// Whether the same call may succeed if retried later without changing it.
    ///
    /// True for [`Error::Unavailable`], [`Error::Held`] and [`Error::Timeout`] (the key may come
    /// free). [`Error::OutcomeUnknown`] is *not* retryable as is: re-read the state first.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::Unavailable { .. } | Error::Held { .. } | Error::Timeout { .. }
        )
    }

    /// Whether this error says the caller's lease is gone or superseded (`Lost` or `Stale`).
    pub fn is_lost(&self) -> bool {
        matches!(self, Error::Lost { .. } | Error::Stale { .. })
    }

    /// The same error for another caller: every field is copied except the client library's
    /// `source`, which is not cloneable and is kept as text in the message. For adapters that
    /// send one request on behalf of many calls (a batch of renewals) and must answer each of
    /// them with the request's failure.
    pub fn replicate(&self) -> Error {
        fn with_source(message: &str, source: &Option<BoxError>) -> String {
            match source {
                Some(s) => format!("{message} ({s})"),
                None => message.to_owned(),
            }
        }
        match self {
            Error::Held { key } => Error::Held { key: key.clone() },
            Error::Timeout { key, waited } => Error::Timeout {
                key: key.clone(),
                waited: *waited,
            },
            Error::Lost { key, token, reason } => Error::Lost {
                key: key.clone(),
                token: *token,
                reason: *reason,
            },
            Error::Stale {
                resource,
                presented,
                current,
            } => Error::Stale {
                resource: resource.clone(),
                presented: *presented,
                current: *current,
            },
            Error::Unavailable {
                backend,
                message,
                source,
            } => Error::Unavailable {
                backend,
                message: with_source(message, source),
                source: None,
            },
            Error::OutcomeUnknown {
                backend,
                operation,
                message,
                source,
            } => Error::OutcomeUnknown {
                backend,
                operation,
                message: with_source(message, source),
                source: None,
            },
            Error::InvalidInput(i) => Error::InvalidInput(i.clone()),
            Error::Unsupported { backend, what } => Error::Unsupported {
                backend,
                what: what.clone(),
            },
            Error::Misconfigured { backend, problems } => Error::Misconfigured {
                backend,
                problems: problems.clone(),
            },
            Error::NotFound { what } => Error::NotFound { what: what.clone() },
            Error::TokenRegression {
                backend,
                key,
                observed,
                floor,
            } => Error::TokenRegression {
                backend,
                key: key.clone(),
                observed: *observed,
                floor: *floor,
            },
            Error::TokenOutOfRange {
                backend,
                key,
                native,
            } => Error::TokenOutOfRange {
                backend,
                key: key.clone(),
                native: native.clone(),
            },
            Error::HolderChanged {
                key,
                expected,
                found,
            } => Error::HolderChanged {
                key: key.clone(),
                expected: *expected,
                found: *found,
            },
        }
    }

    /// An [`Error::Unavailable`] from `backend` whose `message` says what failed (without
    /// secrets), with no client library error behind it.
    pub fn unavailable(backend: &'static str, message: impl Into<String>) -> Self {
        Error::Unavailable {
            backend,
            message: message.into(),
            source: None,
        }
    }

    /// An [`Error::Unavailable`] from `backend` whose `message` says what failed (without
    /// secrets), keeping the client library's error as its `source`.
    pub fn unavailable_from(
        backend: &'static str,
        message: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Unavailable {
            backend,
            message: message.into(),
            source: Some(source.into()),
        }
    }

    /// An [`Error::Misconfigured`] from `backend` naming one missing or wrong setting.
    pub fn misconfigured(backend: &'static str, problem: impl Into<String>) -> Self {
        Error::Misconfigured {
            backend,
            problems: vec![problem.into()],
        }
    }

    /// A short, stable label for metrics (`held`, `timeout`, `lost`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Held { .. } => "held",
            Error::Timeout { .. } => "timeout",
            Error::Lost { .. } => "lost",
            Error::Stale { .. } => "stale",
            Error::Unavailable { .. } => "unavailable",
            Error::OutcomeUnknown { .. } => "outcome_unknown",
            Error::InvalidInput(_) => "invalid_input",
            Error::Unsupported { .. } => "unsupported",
            Error::Misconfigured { .. } => "misconfigured",
            Error::NotFound { .. } => "not_found",
            Error::TokenRegression { .. } => "token_regression",
            Error::TokenOutOfRange { .. } => "token_out_of_range",
            Error::HolderChanged { .. } => "holder_changed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replicated_error_keeps_its_kind_and_the_source_as_text() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = Error::OutcomeUnknown {
            backend: "redis",
            operation: "renew",
            message: "connection closed".into(),
            source: Some(Box::new(io)),
        };
        let r = e.replicate();
        assert_eq!(r.kind(), e.kind());
        assert!(
            r.to_string().contains("connection closed (reset by peer)"),
            "{r}"
        );
        let m = Error::Misconfigured {
            backend: "etcd",
            problems: vec!["a".into(), "b".into()],
        };
        assert_eq!(m.replicate().to_string(), m.to_string());
    }

    #[test]
    fn retryable_classification() {
        assert!(Error::Held { key: "k".into() }.is_retryable());
        assert!(Error::Timeout {
            key: "k".into(),
            waited: Duration::from_secs(1)
        }
        .is_retryable());
        assert!(Error::Unavailable {
            backend: "x",
            message: "down".into(),
            source: None
        }
        .is_retryable());
        let unknown = Error::OutcomeUnknown {
            backend: "x",
            operation: "acquire",
            message: "timeout".into(),
            source: None,
        };
        assert!(!unknown.is_retryable());
        let stale = Error::Stale {
            resource: "r".into(),
            presented: Token::new(1).unwrap(),
            current: Token::new(2).unwrap(),
        };
        assert!(!stale.is_retryable());
        assert!(stale.is_lost());
        assert!(Error::from(InvalidInput::ZeroTtl).kind() == "invalid_input");
    }

    #[test]
    fn stale_message_names_both_tokens() {
        let e = Error::Stale {
            resource: "orders/42".into(),
            presented: Token::new(7).unwrap(),
            current: Token::new(9).unwrap(),
        };
        let s = e.to_string();
        assert!(
            s.contains("presented 7") && s.contains("newest accepted 9"),
            "{s}"
        );
    }

    #[test]
    fn holder_changed_names_key_expected_and_found() {
        let e = Error::HolderChanged {
            key: "jobs/nightly".into(),
            expected: Token::new(7).unwrap(),
            found: Some(Token::new(9).unwrap()),
        };
        let s = e.to_string();
        assert!(
            s.contains("jobs/nightly")
                && s.contains("expected holder token 7")
                && s.contains("found token 9"),
            "{s}"
        );
        assert!(!e.is_retryable() && !e.is_lost());
        assert_eq!(e.replicate().to_string(), s);
        let free = Error::HolderChanged {
            key: "k".into(),
            expected: Token::new(7).unwrap(),
            found: None,
        };
        assert!(free.to_string().contains("found the lock free"), "{free}");
    }

    #[test]
    fn misconfigured_lists_every_problem() {
        let e = Error::Misconfigured {
            backend: "redis",
            problems: vec![
                "appendonly is no".into(),
                "maxmemory-policy is allkeys-lru".into(),
            ],
        };
        let s = e.to_string();
        assert!(
            s.contains("appendonly is no") && s.contains("allkeys-lru"),
            "{s}"
        );
    }
}
