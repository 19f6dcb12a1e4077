//! The one place where HTTP transport failures and Consul's status codes become
//! [`lease_core::Error`]s.
//!
//! | what happened | read (idempotent) | write |
//! |---|---|---|
//! | connection refused / DNS / TLS handshake (nothing sent) | `Unavailable` | `Unavailable` |
//! | TLS certificate refused: the server's by this client (unknown CA, wrong name, expired), or this client's (or its absence) by the agent | `Misconfigured` | `Misconfigured` |
//! | timeout or connection lost after sending | `Unavailable` | `OutcomeUnknown` |
//! | 403 (ACL token missing, unknown or lacking permission), or a 409 transaction error `Permission denied` / `ACL not found` (how `/v1/txn` refuses one operation) | `Misconfigured` | `Misconfigured` |
//! | 429; 500, 502, 503, 504 saying `No cluster leader`, `No path to datacenter`, `rate limit exceeded` (not applied) | `Unavailable` | `Unavailable` |
//! | any other 500, 502, 503, 504, e.g. 500 `rpc error making call: EOF` / `leadership lost while committing log`, a proxy's 502/503/504 (may have applied) | `Unavailable` | `OutcomeUnknown` |
//! | 200 whose body cannot be read (applied, results unknown) | `Misconfigured` | `OutcomeUnknown` |
//! | 400, 405, 413 (the request itself was refused) | `Unsupported` | `Unsupported` |
//!
//! Consul's agent prefixes every error of a forwarded RPC with `rpc error making call:`, whether
//! or not the server applied the write, so that prefix says nothing: a write is `Unavailable`
//! only when the error certainly means "not applied".
//!
//! Messages never carry the ACL token: it travels only in a header, and Consul does not echo it.

use std::time::Duration;

use lease_core::adapter::{Delivery, Op};
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

    /// Whether the failure is a TLS problem (sending again cannot fix it).
    pub(crate) fn is_tls_problem(&self) -> bool {
        match self {
            Transport::NotSent(source) | Transport::Failed(source) => {
                find_tls_error(source.as_ref()).is_some()
            }
            Transport::TimedOut(_) => false,
        }
    }
}

/// The TLS error in `e`'s source chain, if any (tokio-rustls wraps it in an `io::Error`, whose
/// `source()` skips it, so wrapped errors are unwrapped too).
fn find_tls_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut cur: Option<&'a (dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<rustls::Error>() {
            return Some(t);
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if let Some(inner) = io.get_ref() {
                if let Some(t) = find_tls_error(inner) {
                    return Some(t);
                }
            }
        }
        cur = err.source();
    }
    None
}

/// A TLS failure that configuration, not a retry, fixes: the server certificate was refused by
/// this client, or the client's certificate (or its absence) by the server. Both end the
/// handshake before the server reads a request, so nothing was applied. The problem is named with
/// the setting that fixes it.
fn tls_misconfiguration(operation: &'static str, tls: &rustls::Error) -> Option<Error> {
    use rustls::{AlertDescription as A, CertificateError as C};
    let hint = match tls {
        rustls::Error::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
 "the server certificate does not name this host (connect by a name it carries, or set tls_server_name / CONSUL_TLS_SERVER_NAME)"
 }
 rustls::Error::InvalidCertificate(
 C::Expired | C::ExpiredContext { .. } | C::NotValidYet | C::NotValidYetContext { .. },
 ) => "the server certificate is outside its validity period (renew it, or check the clock)",
 rustls::Error::InvalidCertificate(_) => {
 "the server certificate is not signed by a trusted CA (set tls_ca_file / tls_ca_path, or CONSUL_CACERT / CONSUL_CAPATH, to the CA that signed the agent's certificate)"
 }
 rustls::Error::AlertReceived(A::CertificateRequired) => {
 "the agent requires a client certificate (verify_incoming): set tls_cert_file and tls_key_file, or CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY"
 }
 rustls::Error::AlertReceived(
 A::BadCertificate
 | A::UnknownCA
 | A::UnsupportedCertificate
 | A::CertificateRevoked
 | A::CertificateExpired
 | A::CertificateUnknown
 | A::AccessDenied,
 ) => {
 "the agent refused the client certificate (is it signed by the CA the agent trusts, and still valid?)"
        }
        _ => return None,
    };
    Some(Error::misconfigured(
        BACKEND,
        format!("{operation}: TLS with the Consul agent failed: {tls}: {hint}"),
    ))
}

/// Maps a transport failure of `op` ([`Op::failed`]): never sent is `Unavailable`; sent without
/// an answer is `OutcomeUnknown` for a write. A TLS certificate problem is `Misconfigured` (see
/// [`tls_misconfiguration`]); any other TLS failure is named in the message.
pub(crate) fn transport(op: Op, t: Transport) -> Error {
    let tls = match &t {
        Transport::NotSent(source) | Transport::Failed(source) => {
            find_tls_error(source.as_ref()).cloned()
        }
        Transport::TimedOut(_) => None,
    };
    if let Some(tls) = &tls {
        if let Some(e) = tls_misconfiguration(op.name, tls) {
            return e;
        }
    }
    let tls_note = tls.map(|e| format!(" (TLS: {e})")).unwrap_or_default();
    let (delivery, message, source) = match t {
        Transport::NotSent(source) => (
            Delivery::NotSent,
            format!("could not reach the Consul agent{tls_note}"),
            Some(source),
        ),
        Transport::TimedOut(after) => (
            Delivery::Unanswered,
            format!("no answer within {after:?}"),
            None,
        ),
        Transport::Failed(source) => (
            Delivery::Unanswered,
            format!("the connection failed after the request was sent{tls_note}"),
            Some(source),
        ),
    };
    op.failed(BACKEND, delivery, message, source)
}

/// Maps an HTTP answer that the caller did not expect (anything but its success codes). A
/// server error is a refusal when its text says the write was not applied, otherwise an answer
/// that says nothing about the write ([`Op::failed`]).
pub(crate) fn status(op: Op, code: u16, body: &[u8]) -> Error {
    let text: String = String::from_utf8_lossy(body)
        .chars()
        .filter(|c| !c.is_control())
        .take(300)
        .collect();
    match code {
        403 => Error::misconfigured(
            BACKEND,
            format!(
                "the ACL token was refused ({text}); it needs key:write on the key prefix \
                 (and key:list, where enable_key_list_policy is on) and session:write on the \
                 agent's node"
            ),
        ),
        429 => op.failed(
            BACKEND,
            Delivery::Refused,
            format!("HTTP {code}: {text}"),
            None,
        ),
        // A request Consul (or a proxy) refused as a request: nothing was applied. 408 is not
        // one of them: a proxy's timeout, said after the request may have been forwarded.
        400..=499 if code != 408 => Error::Unsupported {
            backend: BACKEND,
            what: format!("{}: HTTP {code}: {text}", op.name),
        },
        // Otherwise the write may have been committed (`rpc error making call: EOF`,
        // `leadership lost while committing log`, a proxy's 502, 504 or 520-524 after it
        // forwarded the request, a status no one documented).
        _ => {
            let delivery = if not_applied(&text) {
                Delivery::Refused
            } else {
                Delivery::Unanswered
            };
            op.failed(BACKEND, delivery, format!("HTTP {code}: {text}"), None)
        }
    }
}

/// Whether a server error certainly means that the write was not applied: no leader to apply it,
/// no route to the datacenter, or refused by the servers' rate limit, all before the Raft apply.
fn not_applied(text: &str) -> bool {
    [
        "No cluster leader",
        "No path to datacenter",
        "rate limit exceeded",
    ]
    .iter()
    .any(|m| text.contains(m))
}

/// An answer to `op` that cannot be read (not the JSON Consul sends, or not what was asked
/// for): `OutcomeUnknown` for a write Consul committed, `Misconfigured` otherwise (see
/// [`Op::unreadable_answer`]).
pub(crate) fn unreadable(op: Op, problem: impl std::fmt::Display) -> Error {
    op.unreadable_answer(BACKEND, problem)
}

/// A request body that cannot be encoded: nothing was sent.
pub(crate) fn unencodable(operation: &'static str, problem: impl Into<String>) -> Error {
    Error::Unsupported {
        backend: BACKEND,
        what: format!("{operation}: cannot encode the request: {}", problem.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert!(matches!(
            status(Op::write("acquire", false), 403, b"Permission denied"),
            Error::Misconfigured { .. }
        ));
        assert!(status(Op::read("read"), 500, b"boom").is_retryable());
        assert!(matches!(
            status(Op::write("acquire", false), 500, b"boom"),
            Error::OutcomeUnknown { .. }
        ));
        assert!(status(Op::write("acquire", false), 500, b"No cluster leader").is_retryable());
        assert!(status(
            Op::write("acquire", false),
            500,
            b"rpc error making call: No cluster leader"
        )
        .is_retryable());
        assert!(status(Op::write("acquire", false), 429, b"rate limit exceeded").is_retryable());
        // The agent's prefix, the server's EOF, a lost leadership, a proxy: may have applied.
        for (code, body) in [
            (500, &b"rpc error making call: EOF"[..]),
            (
                500,
                b"rpc error making call: leadership lost while committing log",
            ),
            (502, b"Bad Gateway"),
            (
                503,
                b"upstream connect error or disconnect/reset before headers",
            ),
            (504, b"Gateway Timeout"),
            // A proxy's timeouts, and statuses no one documented: the request may have been
            // forwarded. They used to be `Unsupported`, which reads as "nothing was done".
            (408, b"Request Timeout"),
            (520, b"Web Server Returned an Unknown Error"),
            (524, b"A Timeout Occurred"),
            (302, b""),
        ] {
            assert!(
                matches!(
                    status(Op::write("acquire", false), code, body),
                    Error::OutcomeUnknown { .. }
                ),
                "{code}"
            );
            assert!(
                status(Op::read("read"), code, body).is_retryable(),
                "{code}"
            );
        }
        // A request refused as a request: nothing was applied.
        for code in [400, 404, 405, 413] {
            assert!(
                matches!(
                    status(Op::write("acquire", false), code, b"bad"),
                    Error::Unsupported { .. }
                ),
                "{code}"
            );
        }
        assert!(matches!(
            transport(
                Op::write("release", false),
                Transport::TimedOut(Duration::from_secs(1))
            ),
            Error::OutcomeUnknown { .. }
        ));
        assert!(transport(
            Op::read("read"),
            Transport::TimedOut(Duration::from_secs(1))
        )
        .is_retryable());
    }
}
