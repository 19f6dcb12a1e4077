//! The one place where ZooKeeper client errors become [`lease_core::Error`]s.
//!
//! The mapping uses zookeeper-client's own distinction between "certainly not applied" and
//! "may have applied", plus one fact only the adapter knows: whether the request could have
//! changed state (a *write*: create, delete) or not (a *read*: exists, get children, get data).
//!
//! | what happened | read | write |
//! |---|---|---|
//! | not connected when the call was made (nothing sent) | `Unavailable` | `Unavailable` |
//! | the connection lost with the request pending (`ConnectionLoss`, or the I/O error or ping timeout that ended the connection, which the client hands every pending request as `Custom`), or no answer within the request timeout | `Unavailable` | `OutcomeUnknown` |
//! | session expired or closed, no hosts, connect timeout | `Unavailable` (a new session is opened on the next call) | same |
//! | `Throttled`, `NotReadOnly`, `SessionMoved` | `Unavailable` | `Unavailable` (refused before applying) |
//! | `NoAuth`, `InvalidAcl`, `AuthFailed` | `Misconfigured` | `Misconfigured` |
//! | anything else unexpected | `Unavailable` with the client's message | same |
//!
//! `NoNode`, `NodeExists`, `BadVersion` and `NotEmpty` are answers, not failures: the callers
//! handle them where they mean something (a lost lease, a vanished parent).

use std::time::Duration;

use lease_core::adapter::{Delivery, Op};
use lease_core::Error;
use zookeeper_client::Error as ZkError;

/// The backend name used in every error, metric and capability.
pub(crate) const BACKEND: &str = "zookeeper";

/// The requests this adapter sends ([`Op`]: the operation's name and whether it writes).
pub(crate) mod ops {
    use lease_core::adapter::Op;

    pub(crate) const ACQUIRE: Op = Op::write("acquire", false);
    pub(crate) const WAIT: Op = Op::read("acquire (queue read)");
    pub(crate) const RENEW: Op = Op::read("renew");
    pub(crate) const RELEASE: Op = Op::write("release", true);
    pub(crate) const INSPECT: Op = Op::read("inspect");
    pub(crate) const FORCE_RELEASE: Op = Op::write("force_release", false);
    pub(crate) const AUDIT_READ: Op = Op::read("audit trail read");
    pub(crate) const SETUP: Op = Op::write("creating the lock's parent nodes", true);
    pub(crate) const ADOPT: Op = Op::read("confirming the application's session (sync)");
    pub(crate) const CLEANUP: Op = Op::write("deleting a node left by an ended lease", true);
    pub(crate) const CLEANUP_LIST: Op = Op::read("listing the contenders to clean up after");
}

/// Whether `err` says the session is over (expired, closed, failed): its ephemeral nodes are gone
/// or going, and the next call needs a new session.
///
/// `SessionMoved` is not such an end: the leader refuses a request that reached it through a
/// server the session has since left (the client reconnected elsewhere). The request did not
/// apply, and the session and its nodes live on; taking it for an end would let a lease's own
/// node stay (nobody deletes a node whose session "ended") for as long as the session lives.
pub(crate) fn session_ended(err: &ZkError) -> bool {
    matches!(
        err,
        ZkError::SessionExpired | ZkError::ClientClosed | ZkError::AuthFailed | ZkError::NoHosts
    )
}

/// Whether a request's error says the connection was lost while it was pending (it may have
/// been applied). zookeeper-client hands every pending request the error that ended the
/// connection: `ConnectionLoss` for a closed connection, `Custom` for an I/O error such as a
/// reset, or for a connection that stopped answering pings.
pub(crate) fn connection_lost(err: &ZkError) -> bool {
    matches!(err, ZkError::ConnectionLoss | ZkError::Custom(_))
}

/// Maps an error of a request handed to the client library.
pub(crate) fn from_zk(op: Op, err: ZkError) -> Error {
    match err {
        e if connection_lost(&e) && op.writes => op.failed(
            BACKEND,
            Delivery::Unanswered,
            format!("the connection was lost after the request was sent ({e})"),
            Some(Box::new(e)),
        ),
        ZkError::NoAuth | ZkError::InvalidAcl | ZkError::AuthFailed => Error::misconfigured(
            BACKEND,
            format!(
                "{} was refused ({err}): the digest credentials in the URL must be those that \
                 created the base path and lock nodes (ACL creator: all, world: read)",
                op.name
            ),
        ),
        e if session_ended(&e) => Error::unavailable_from(
            BACKEND,
            format!(
                "{} failed: the ZooKeeper session ended ({e}); a new session is opened on the \
                 next call",
                op.name
            ),
            e,
        ),
        e => Error::unavailable_from(BACKEND, format!("{} failed: {e}", op.name), e),
    }
}

/// The error for a request whose answer did not come within `after`.
pub(crate) fn timed_out(op: Op, after: Duration) -> Error {
    op.failed(
        BACKEND,
        Delivery::Unanswered,
        format!("no answer within {after:?}"),
        None,
    )
}

/// The error for a call made while the session is disconnected (nothing was sent).
pub(crate) fn disconnected(op: Op) -> Error {
    Error::unavailable(
        BACKEND,
        format!(
            "{}: not connected to ZooKeeper (the session is reconnecting); nothing was sent",
            op.name
        ),
    )
}

/// The error for a session that could not be established.
pub(crate) fn connect_failed(hosts: &str, message: String, source: Option<ZkError>) -> Error {
    match source {
        Some(ZkError::AuthFailed) => Error::misconfigured(
            BACKEND,
            format!("authentication with the digest credentials failed at {hosts}"),
        ),
        source => Error::Unavailable {
            backend: BACKEND,
            message: format!("could not open a session with {hosts}: {message}"),
            source: source.map(|e| Box::new(e) as lease_core::BoxError),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_loss_is_unknown_only_for_writes() {
        assert!(matches!(
            from_zk(ops::ACQUIRE, ZkError::ConnectionLoss),
            Error::OutcomeUnknown { .. }
        ));
        assert!(matches!(
            from_zk(ops::RENEW, ZkError::ConnectionLoss),
            Error::Unavailable { .. }
        ));
        // (A reset reaches pending requests as `Custom`, which only the client library can
        // build: the suite's `release_connection_reset_after_applied` case covers it.)
        assert!(matches!(
            timed_out(ops::RELEASE, Duration::from_secs(1)),
            Error::OutcomeUnknown { .. }
        ));
        assert!(timed_out(ops::INSPECT, Duration::from_secs(1)).is_retryable());
    }

    #[test]
    fn acl_refusals_are_misconfiguration_and_expiry_is_retryable() {
        assert!(matches!(
            from_zk(ops::FORCE_RELEASE, ZkError::NoAuth),
            Error::Misconfigured { .. }
        ));
        let e = from_zk(ops::ACQUIRE, ZkError::SessionExpired);
        assert!(e.is_retryable(), "{e}");
        assert!(session_ended(&ZkError::SessionExpired));
    }

    #[test]
    fn a_moved_session_refused_the_request_and_lives_on() {
        assert!(!session_ended(&ZkError::SessionMoved));
        let e = from_zk(ops::RELEASE, ZkError::SessionMoved);
        assert!(
            matches!(e, Error::Unavailable { .. }) && e.is_retryable(),
            "{e:?}"
        );
    }
}
