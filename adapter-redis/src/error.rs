//! The one place where Redis client errors become [`lease_core::Error`]s.
//!
//! The mapping uses redis-rs's own classification ([`redis::RedisError::kind`],
//! [`redis::RedisError::retry_method`], `is_timeout`, `is_connection_dropped`) and one more fact
//! only the adapter knows: whether the failed request could have changed state (a *write*: the
//! acquire, renew, release, force-release and fence scripts) or not (a *read*).
//!
//! | what happened | read | write |
//! |---|---|---|
//! | could not connect (refused, unreachable, connect timeout) | `Unavailable` | `Unavailable` |
//! | response timeout, connection dropped after sending | `Unavailable` | `OutcomeUnknown` |
//! | `LOADING`, `BUSY`, `MASTERDOWN`, `TRYAGAIN`, `CLUSTERDOWN`, `READONLY`, `OOM`, `NOREPLICAS` (`min-replicas-to-write`) | `Unavailable` | `Unavailable` (the server refused before running anything) |
//! | `MOVED` / `ASK` (a Redis Cluster node that does not own the slot) | `Unsupported` | `Unsupported` |
//! | `NOPERM`, `NOAUTH`, `WRONGPASS`, unknown command (`CONFIG` renamed) | `Misconfigured` | `Misconfigured` |
//! | TLS handshake refused: the server's certificate not trusted or not for the host (`invalid peer certificate`), or ours refused or missing under `tls-auth-clients` (`received fatal alert`) | `Misconfigured` naming the option to set | same (nothing was sent) |
//! | `WRONGTYPE` and other script errors (a foreign value in the adapter's keys) | `Misconfigured` | `Misconfigured` |

use lease_core::adapter::{Delivery, Op, TlsRefusal};
use lease_core::Error;
use redis::{ErrorKind, RedisError, RetryMethod, ServerErrorKind};

/// The backend name used in every error, metric and capability.
pub(crate) const BACKEND: &str = "redis";

/// The requests this adapter sends ([`Op`]: the operation's name, whether it writes, whether it
/// may be sent twice). A script's writes are ordered so that a failure leaves nothing behind, and
/// the acquire and release scripts are idempotent per nonce; a fence write is not idempotent: re-sent, it can
/// apply after a later write of the same token and replace its value.
pub(crate) mod ops {
    use lease_core::adapter::Op;

    pub(crate) const ACQUIRE: Op = Op::write("acquire", true);
    pub(crate) const RENEW: Op = Op::write("renew", true);
    pub(crate) const RELEASE: Op = Op::write("release", true);
    pub(crate) const FORCE_RELEASE: Op = Op::write("force_release", false);
    pub(crate) const FENCE_WRITE: Op = Op::write("write", false);
    pub(crate) const FENCE_CLAIM: Op = Op::write("claim", true);
    pub(crate) const INSPECT: Op = Op::read("inspect");
    pub(crate) const FENCE_READ: Op = Op::read("read");
    pub(crate) const RESOLVE: Op = Op::read("re-read after an unseen acquire outcome");
    pub(crate) const CHECK: Op = Op::read("durability check");
    pub(crate) const RECOUNT: Op = Op::read("count of replicas");
    pub(crate) const AUDIT: Op = Op::read("audit trail read");
}

/// The server's error inside a pipeline's failure (a script and its `WAIT`), as if the script
/// had been sent alone. redis-rs gives a pipeline's failure a code only when the code is one it
/// knows, and never a detail: `OOM`, `BUSY` and `NOREPLICAS` would read as a foreign value in
/// the adapter's keys. Any other error is returned as it is.
pub(crate) fn unpipelined(err: RedisError) -> RedisError {
    if err.is_io_error() || err.is_timeout() {
        return err;
    }
    match err.clone().into_server_errors() {
        Some(items) => match items.first() {
            Some((_, first)) => RedisError::from(first.clone()),
            None => err,
        },
        None => err,
    }
}

/// Maps an error of a request that was handed to an established connection.
pub(crate) fn from_redis(op: Op, err: RedisError) -> Error {
    let code = err.code().unwrap_or("").to_owned();
    let kind = err.kind();

    // The server answered with an error: it either ran the script (whose writes are ordered so
    // that a failure leaves nothing behind) or refused it before running anything.
    match kind {
        ErrorKind::Server(ServerErrorKind::Moved) | ErrorKind::Server(ServerErrorKind::Ask) => {
            return Error::Unsupported {
                backend: BACKEND,
                what: format!(
                    "Redis Cluster redirection ({code}) during {}: connect to the node that owns \
                     the key's slot (all keys of one lock share a hash tag)",
                    op.name
                ),
            };
        }
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            return Error::misconfigured(
                BACKEND,
                format!(
                    "the Redis user may not run {} ({}): grant it EVALSHA, SCRIPT LOAD, GET, SET, \
                     INCR, PEXPIRE, PTTL, DEL, TIME, TYPE, PUBLISH, SUBSCRIBE, XADD, XREVRANGE, \
                     HGET, HSET, HMGET, MULTI, EXEC, WAIT, PING, INFO, CLIENT INFO and CONFIG GET \
                     (the scripts' own commands included)",
                    op.name,
                    detail(&err)
                ),
            );
        }
        ErrorKind::AuthenticationFailed => return auth_failed(&err),
        _ => {}
    }
    if matches!(code.as_str(), "NOAUTH" | "WRONGPASS") {
        return auth_failed(&err);
    }
    if matches!(code.as_str(), "OOM" | "BUSY" | "NOREPLICAS")
        || matches!(err.retry_method(), RetryMethod::WaitAndRetry)
    {
        return Error::unavailable_from(
            BACKEND,
            format!(
                "{} refused by the server ({}): {}",
                op.name,
                code,
                detail(&err)
            ),
            err,
        );
    }
    if let ErrorKind::Server(ServerErrorKind::ReadOnly) = kind {
        return Error::unavailable_from(
            BACKEND,
            format!(
                "{} refused: the server is a read-only replica (after a failover, connect to \
                 the new primary)",
                op.name
            ),
            err,
        );
    }
    if matches!(
        kind,
        ErrorKind::Server(ServerErrorKind::ResponseError) | ErrorKind::Extension
    ) {
        let text = detail(&err);
        if text.contains("unknown command") {
            return Error::misconfigured(BACKEND, format!("{} failed: {}", op.name, text));
        }
        return Error::misconfigured(
            BACKEND,
            format!(
                "{} failed on the server ({code}): {text}; another client may have written a \
                 different type of value into this adapter's keys",
                op.name
            ),
        );
    }

    // No answer: the request may or may not have reached the server.
    if err.is_timeout() || err.is_io_error() || err.is_unrecoverable_error() {
        let what = if err.is_timeout() {
            "no response within the request timeout"
        } else {
            "the connection failed"
        };
        let message = if op.writes {
            format!("{what}; the request may have been applied")
        } else {
            what.to_owned()
        };
        return op.failed(BACKEND, Delivery::Unanswered, message, Some(Box::new(err)));
    }
    Error::unavailable_from(
        BACKEND,
        format!("{} failed: {}", op.name, detail(&err)),
        err,
    )
}

/// Maps an error while opening a connection: nothing was sent.
pub(crate) fn connect_failed(err: RedisError) -> Error {
    if err.kind() == ErrorKind::AuthenticationFailed
        || matches!(err.code(), Some("NOAUTH" | "WRONGPASS"))
    {
        return auth_failed(&err);
    }
    if matches!(err.kind(), ErrorKind::InvalidClientConfig) {
        return Error::misconfigured(
            BACKEND,
            format!("the client rejected the configuration: {err}"),
        );
    }
    if let Some(refusal) = TlsRefusal::find(&err) {
        return Error::misconfigured(
            BACKEND,
            match refusal {
                TlsRefusal::ServerCertificate(detail) => format!(
                    "TLS: the server's certificate was refused ({detail}); check tls_ca_file (the \
                     CA that signed it, system roots when absent) and that it names the URL's host"
                ),
                TlsRefusal::ByServer(detail) => format!(
                    "TLS: the server refused the handshake ({detail}); with tls-auth-clients on \
                     (Redis's default), give tls_cert_file and tls_key_file with a client \
                     certificate signed by its tls-ca-cert-file"
                ),
            },
        );
    }
    Error::unavailable_from(BACKEND, format!("cannot connect: {err}"), err)
}

/// An `Unavailable` for a connect attempt that did not finish in time.
pub(crate) fn connect_timed_out(timeout: std::time::Duration) -> Error {
    Error::unavailable(BACKEND, format!("cannot connect within {timeout:?}"))
}

/// An error for a script reply that does not have the shape the script returns (a different
/// script version, or a foreign value in this adapter's keys): see [`Op::unreadable_answer`].
pub(crate) fn bad_reply(op: Op, what: impl std::fmt::Display) -> Error {
    op.unreadable_answer(BACKEND, what)
}

fn auth_failed(err: &RedisError) -> Error {
    Error::misconfigured(
        BACKEND,
        format!(
            "authentication failed ({}): check the user and password in the URL",
            detail(err)
        ),
    )
}

/// A lock's keys hold a value of another type (a batched renewal's `-3`): what the single-lock
/// script's `WRONGTYPE` failure reports.
pub(crate) fn wrong_type(op: Op) -> Error {
    Error::misconfigured(
        BACKEND,
        format!(
        "{} failed on the server (WRONGTYPE): a key of the lock holds the wrong kind of value; \
         another client may have written a different type of value into this adapter's keys",
        op.name
    ),
    )
}

fn detail(err: &RedisError) -> String {
    err.detail()
        .map(str::to_owned)
        .unwrap_or_else(|| err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    fn io_err(kind: io::ErrorKind) -> RedisError {
        RedisError::from(io::Error::new(kind, "x"))
    }

    #[test]
    fn timeouts_after_send_are_unknown_for_writes_only() {
        let e = from_redis(ops::ACQUIRE, io_err(io::ErrorKind::TimedOut));
        assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e}");
        let e = from_redis(ops::INSPECT, io_err(io::ErrorKind::TimedOut));
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
        let e = from_redis(ops::RELEASE, io_err(io::ErrorKind::ConnectionReset));
        assert!(matches!(e, Error::OutcomeUnknown { .. }), "{e}");
    }

    #[test]
    fn connect_errors_are_retryable() {
        let e = connect_failed(io_err(io::ErrorKind::ConnectionRefused));
        assert!(e.is_retryable(), "{e}");
        assert!(connect_timed_out(std::time::Duration::from_secs(1)).is_retryable());
    }

    #[test]
    fn server_refusals_are_unavailable() {
        let e = redis::make_extension_error("OOM".into(), Some("command not allowed".into()));
        let mapped = from_redis(ops::ACQUIRE, e);
        assert!(mapped.is_retryable(), "{mapped}");
        let e = redis::make_extension_error(
            "NOREPLICAS".into(),
            Some("Not enough good replicas to write.".into()),
        );
        let mapped = from_redis(ops::ACQUIRE, e);
        assert!(mapped.is_retryable(), "{mapped}");
        let e = redis::make_extension_error("WRONGTYPE".into(), Some("wrong kind".into()));
        assert!(matches!(
            from_redis(ops::ACQUIRE, e),
            Error::Misconfigured { .. }
        ));
    }
}
