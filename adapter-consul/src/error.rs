//! The one place where HTTP transport failures and Consul's status codes become
//! [`lease_core::Error`]s.
//!
//! | what happened | read (idempotent) | write |
//! |---|---|---|
//! | connection refused / DNS / TLS handshake (nothing sent) | `Unavailable` | `Unavailable` |
//! | timeout or connection lost after sending | `Unavailable` | `OutcomeUnknown` |
//! | 403 (ACL token missing, unknown or lacking permission) | `Misconfigured` | `Misconfigured` |
//! | 429, 502, 503, 504, 500 `No cluster leader` / `rpc error` (not applied) | `Unavailable` | `Unavailable` |
//! | other 500 | `Unavailable` | `OutcomeUnknown` |
//! | 400, 405, 413 (the request itself was refused) | `Unsupported` | `Unsupported` |
//!
//! Messages never carry the ACL token: it travels only in a header, and Consul does not echo it.

use std::time::Duration;

use lease_core::{BoxError, Error};

use crate::BACKEND;

/// A request that got no HTTP answer.
#[derive(Debug)]
pub(crate) enum Transport {
    /// The request certainly did not reach the server (connect failed).
    NotSent(BoxError),
    /// No answer within the bound; the server may have applied it.
    TimedOut(Duration),
    /// The connection failed after the request may have been sent.
    Failed(BoxError),
}

impl Transport {
    /// Classifies a hyper client error.
    pub(crate) fn from_client(e: hyper_util::client::legacy::Error) -> Self {
        if e.is_connect() {
            Transport::NotSent(Box::new(e))
        } else {
            Transport::Failed(Box::new(e))
        }
    }
}

/// Maps a transport failure of `operation`. `idempotent` operations (reads, checks) never report
/// an unknown outcome.
pub(crate) fn transport(operation: &'static str, idempotent: bool, t: Transport) -> Error {
    match t {
        Transport::NotSent(source) => Error::Unavailable {
            backend: BACKEND,
            message: format!("{operation}: could not reach the Consul agent"),
            source: Some(source),
        },
        Transport::TimedOut(after) if idempotent => Error::Unavailable {
            backend: BACKEND,
            message: format!("{operation}: no answer within {after:?}"),
            source: None,
        },
        Transport::Failed(source) if idempotent => Error::Unavailable {
            backend: BACKEND,
            message: format!("{operation}: the connection failed"),
            source: Some(source),
        },
        Transport::TimedOut(after) => Error::OutcomeUnknown {
            backend: BACKEND,
            operation,
            message: format!("no answer within {after:?}"),
            source: None,
        },
        Transport::Failed(source) => Error::OutcomeUnknown {
            backend: BACKEND,
            operation,
            message: "the connection failed after the request was sent".into(),
            source: Some(source),
        },
    }
}

/// Maps an HTTP answer that the caller did not expect (anything but its success codes).
pub(crate) fn status(operation: &'static str, idempotent: bool, code: u16, body: &[u8]) -> Error {
    let text: String = String::from_utf8_lossy(body)
        .chars()
        .filter(|c| !c.is_control())
        .take(300)
        .collect();
    let message = format!("{operation}: HTTP {code}: {text}");
    match code {
        403 => Error::Misconfigured {
            backend: BACKEND,
            problems: vec![format!(
                "the ACL token was refused ({text}); it needs key:write on the key prefix and \
                 session:write on the agent's node"
            )],
        },
        429 | 502 | 503 | 504 => Error::Unavailable {
            backend: BACKEND,
            message,
            source: None,
        },
        500 if idempotent
            || text.contains("No cluster leader")
            || text.contains("rpc error")
            || text.contains("No path to datacenter") =>
        {
            Error::Unavailable {
                backend: BACKEND,
                message,
                source: None,
            }
        }
        500 => Error::OutcomeUnknown {
            backend: BACKEND,
            operation,
            message,
            source: None,
        },
        _ => Error::Unsupported {
            backend: BACKEND,
            what: message,
        },
    }
}

/// A malformed answer (not the JSON Consul sends).
pub(crate) fn protocol(operation: &'static str, problem: impl Into<String>) -> Error {
    Error::Unsupported {
        backend: BACKEND,
        what: format!(
            "{operation}: unexpected answer from Consul: {}",
            problem.into()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert!(matches!(
            status("acquire", false, 403, b"Permission denied"),
            Error::Misconfigured { .. }
        ));
        assert!(status("read", true, 500, b"boom").is_retryable());
        assert!(matches!(
            status("acquire", false, 500, b"boom"),
            Error::OutcomeUnknown { .. }
        ));
        assert!(status("acquire", false, 500, b"No cluster leader").is_retryable());
        assert!(matches!(
            transport(
                "release",
                false,
                Transport::TimedOut(Duration::from_secs(1))
            ),
            Error::OutcomeUnknown { .. }
        ));
        assert!(
            transport("read", true, Transport::TimedOut(Duration::from_secs(1))).is_retryable()
        );
    }
}
