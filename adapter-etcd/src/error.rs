//! The one place where etcd-client's errors become the workspace's [`Error`].
//!
//! | what etcd-client reports | read-only call | call that may write |
//! |---|---|---|
//! | transport error, gRPC `Unavailable` while connecting | `Unavailable` | `Unavailable` (nothing was sent) |
//! | a refusal etcd makes before proposing anything ([`REFUSED_BEFORE_PROPOSING`]: `etcdserver: no leader`, `not capable`, `rpc not supported for learner`, `too many requests`, `raft proposal dropped`) | `Unavailable` | `Unavailable` (nothing was applied) |
//! | refused as too large (`etcdserver: request is too large`, gRPC's `received message larger than max`) | `Misconfigured` naming `--max-request-bytes` | same (nothing was applied; never sent again) |
//! | gRPC `Unavailable` after sending, `Unknown`, `Cancelled`, `DeadlineExceeded`, our own timeout | `Unavailable` | `OutcomeUnknown` |
//! | gRPC `Unauthenticated`, `PermissionDenied`, "authentication failed" | `Misconfigured` (credentials or roles) | same |
//! | TLS handshake refused: the member's certificate is not trusted or not for the name (`invalid peer certificate`), or the member refused ours (`received fatal alert`, e.g. no client certificate under `--client-cert-auth`) | `Misconfigured` naming the TLS problem | same (nothing was processed: the handshake failed) |
//! | `etcdserver: requested lease not found` | the session ended: callers treat it as `Lost(SessionEnded)` or start a new session; otherwise `Unavailable` | `Unavailable` (etcd rejects the whole request) |
//! | anything else (`etcdserver: request timed out`, `... due to previous leader failure`, `... due to connection lost`, `request cancelled`, `server stopped`: all may come after the proposal) | `Unavailable` | `OutcomeUnknown` |
//!
//! Both "not sent" and "refused before proposing" are also what [`retry_unapplied`] sends again
//! within the request timeout, so the client's balancer can pick another member.
//!
//! Messages carry the gRPC status text, never the URL's password (etcd-client never puts
//! credentials in its errors; the adapter formats URLs only through `BackendUrl`).

use std::time::Duration;

use lease_core::adapter::{resend, Backoff, Delivery, Op, SendAgain, TlsRefusal};
use lease_core::Error;

pub(crate) const BACKEND: &str = "etcd";

/// A failed request: etcd-client's error, or no answer within the request timeout. Cheap to
/// clone: the failure of a request sent for several callers ([`crate::coalesce`]) is each
/// caller's failure.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The client library's error.
    Etcd(std::sync::Arc<etcd_client::Error>),
    /// No answer within this bound; the request may or may not have applied.
    Timeout(Duration),
    /// No answer for another reason (said here); the request may or may not have applied.
    NoAnswer(String),
}

impl From<etcd_client::Error> for Failure {
    fn from(e: etcd_client::Error) -> Self {
        Failure::Etcd(std::sync::Arc::new(e))
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Etcd(e) => std::fmt::Display::fmt(e, f),
            Failure::Timeout(d) => write!(f, "no answer within {d:?}"),
            Failure::NoAnswer(why) => write!(f, "no answer: {why}"),
        }
    }
}

impl Failure {
    /// The client library's error, if this is one.
    fn etcd(&self) -> Option<&etcd_client::Error> {
        match self {
            Failure::Etcd(e) => Some(e),
            Failure::Timeout(_) | Failure::NoAnswer(_) => None,
        }
    }

    /// Whether the server said our session lease does not exist (expired or revoked).
    pub(crate) fn is_lease_not_found(&self) -> bool {
        match self.etcd() {
            Some(etcd_client::Error::GRpcStatus(s)) => {
                s.message().contains("requested lease not found")
            }
            Some(etcd_client::Error::LeaseKeepAliveError(m)) => m.contains("lease not found"),
            _ => false,
        }
    }

    /// Whether the request certainly never reached the server (connection refused, no
    /// connection could be made, the TLS handshake failed).
    pub(crate) fn certainly_not_sent(&self) -> bool {
        if self.tls_problem().is_some() {
            return true;
        }
        match self.etcd() {
            Some(etcd_client::Error::TransportError(_)) => true,
            Some(etcd_client::Error::GRpcStatus(s)) => {
                status_not_sent(s.code() as i32, s.message())
            }
            _ => false,
        }
    }

    /// Whether etcd refused the request before proposing it to Raft, so that it certainly was
    /// not applied and never will be (see [`REFUSED_BEFORE_PROPOSING`]).
    pub(crate) fn refused_before_proposing(&self) -> bool {
        match self.etcd() {
            Some(etcd_client::Error::GRpcStatus(s)) => is_refused_before_proposing(s.message()),
            _ => false,
        }
    }

    /// Whether the request certainly did not change anything on the server: it never reached
    /// etcd ([`Failure::certainly_not_sent`]) or etcd refused it before proposing it
    /// ([`Failure::refused_before_proposing`]). Such a request is safe to send again, a write
    /// included, and its failure is `Unavailable`, never `OutcomeUnknown`.
    pub(crate) fn certainly_not_applied(&self) -> bool {
        self.certainly_not_sent() || self.refused_before_proposing()
    }

    /// A failed TLS handshake, described for the operator. Found by walking the error's
    /// sources for rustls' messages (etcd-client and tonic wrap them in gRPC statuses and
    /// transport errors; a refusal by the server may only surface with the first request, as
    /// `Unknown: transport error`).
    fn tls_problem(&self) -> Option<String> {
        let e: &(dyn std::error::Error + 'static) = self.etcd()?;
        Some(match TlsRefusal::find(e)? {
            TlsRefusal::ServerCertificate(detail) => format!(
                "TLS: the member's certificate was refused ({detail}); check tls_ca_file (the CA \
                 that signed the members' certificates, system roots when absent) and \
                 tls_server_name (the name in the certificate, the URL's host when absent)"
            ),
            TlsRefusal::ByServer(detail) => format!(
                "TLS: the member refused the handshake ({detail}); if it runs with \
                 --client-cert-auth, give tls_cert_file and tls_key_file with a client \
                 certificate signed by its --trusted-ca-file"
            ),
        })
    }

    /// Whether this is a refused TLS handshake (see [`Failure::tls_problem`]).
    pub(crate) fn is_tls_problem(&self) -> bool {
        self.tls_problem().is_some()
    }

    /// The problem, when etcd (or gRPC in front of it) refused the request as too large: the
    /// same request will be refused again, so it is not sent again, and the error names the
    /// server's limit (`Misconfigured`: nothing was applied).
    pub(crate) fn too_large_problem(&self) -> Option<String> {
        let Some(etcd_client::Error::GRpcStatus(s)) = self.etcd() else {
            return None;
        };
        let message = s.message().trim();
        (message == "etcdserver: request is too large"
            || message.starts_with("grpc: received message larger than max"))
        .then(|| {
            format!(
                "etcd refused the request as too large ({message}); nothing was applied: the \
                 server's --max-request-bytes (1.5 MiB by default) is below what it needs"
            )
        })
    }

    /// Whether the connection was closed or reset under the request without an answer (as a
    /// member refusing a client certificate does right after the TLS handshake, and as a
    /// member that is going down does).
    pub(crate) fn closed_after_handshake(&self) -> bool {
        let Some(e) = self.etcd() else {
            return false;
        };
        let shown = format!("{e:?}");
        shown.contains("connection closed")
            || shown.contains("BrokenPipe")
            || shown.contains("ConnectionReset")
            || shown.contains("connection reset")
            || shown.contains("UnexpectedEof")
    }

    fn auth_problem(&self) -> Option<String> {
        let Some(etcd_client::Error::GRpcStatus(s)) = self.etcd() else {
            return None;
        };
        let m = s.message();
        let auth = matches!(
            s.code() as i32,
            tonic_code::UNAUTHENTICATED | tonic_code::PERMISSION_DENIED
        ) || m.contains("authentication failed")
            || m.contains("permission denied")
            || m.contains("user name is empty")
            || m.contains("invalid auth token");
        auth.then(|| format!("the etcd user cannot do this: {m}"))
    }

    /// The workspace error for a failure of `op` ([`Op::failed`]): a request that certainly
    /// did not apply (never sent, refused before proposing, or putting on a missing lease, which
    /// rejects it as a whole) is delivery `NotSent`, anything else `Unanswered`.
    pub(crate) fn into_error(self, op: Op) -> Error {
        if let Some(problem) = self
            .tls_problem()
            .or_else(|| self.auth_problem())
            .or_else(|| self.too_large_problem())
        {
            return Error::misconfigured(BACKEND, problem);
        }
        let delivery = if self.certainly_not_applied() || self.is_lease_not_found() {
            Delivery::NotSent
        } else {
            Delivery::Unanswered
        };
        let message = self.to_string();
        let source: Option<lease_core::BoxError> = match self {
            Failure::Etcd(e) => Some(Box::new(e)),
            Failure::Timeout(_) | Failure::NoAnswer(_) => None,
        };
        op.failed(BACKEND, delivery, message, source)
    }
}

/// etcd's refusals (messages of etcd 3.4's `etcdserver/api/v3rpc/rpctypes/error.go` and of
/// `raft`) that it answers before the request is proposed to Raft: such a request was not
/// applied and will not be later, on any member.
///
/// - `etcdserver: no leader` (`ErrGRPCNoLeader`): the gRPC interceptors answer it, before the
///   handler, to a request carrying `require_leader` (every request of the adapter) while the
///   member knows no leader; the server's other source, `waitLeader`, only precedes forwarding
///   a lease renewal or TTL query to the leader. Never sent after a proposal.
/// - `etcdserver: not capable` (`ErrGRPCNotCapable`) and `etcdserver: rpc not supported for
///   learner`: the same interceptors, before the handler.
/// - `etcdserver: too many requests` (`ErrGRPCTooManyRequests`): the server checks the gap
///   between committed and applied index before proposing.
/// - `raft proposal dropped`: Raft did not append the entry (no leader known, a leader
///   transfer under way); the server returns it from `Propose` itself.
/// - `etcdserver: request is too large` (`ErrGRPCRequestTooLarge`): the encoded request is
///   longer than `--max-request-bytes`, checked before proposing. (Longer still, gRPC itself
///   refuses it before any handler runs: `grpc: received message larger than max (...)`,
///   matched by its prefix.)
///
/// Deliberately absent, because etcd also answers them after the request was proposed and it
/// may still apply: `etcdserver: request timed out` (and its variants `, possibly due to
/// previous leader failure` / `, possibly due to connection lost`), `etcdserver: request
/// cancelled`, `etcdserver: server stopped` (also returned while waiting for a proposal's
/// apply), `etcdserver: leader changed`.
pub(crate) const REFUSED_BEFORE_PROPOSING: &[&str] = &[
    "etcdserver: no leader",
    "etcdserver: not capable",
    "etcdserver: rpc not supported for learner",
    "etcdserver: too many requests",
    "raft proposal dropped",
    "etcdserver: request is too large",
];

/// Whether a gRPC status `code` and `message` (the client's own, for a connection it could not
/// make) say the request was never sent. Only the phrases of a connection that was never made:
/// "connection reset" or "connection closed" may come after the request was sent.
fn status_not_sent(code: i32, message: &str) -> bool {
    code == tonic_code::UNAVAILABLE && {
        let m = message.to_ascii_lowercase();
        m.contains("error trying to connect")
            || m.contains("tcp connect error")
            || m.contains("failed to connect")
            || m.contains("refused")
            || m.contains("dns")
    }
}

/// Whether a gRPC status message is one of etcd's [`REFUSED_BEFORE_PROPOSING`] (the whole
/// message: etcd sends these texts as they are, and a longer text such as `etcdserver: request
/// timed out, possibly due to previous leader failure` must not match a shorter one).
fn is_refused_before_proposing(message: &str) -> bool {
    let message = message.trim();
    // gRPC's own refusal of a request longer than the server takes, before any handler runs.
    REFUSED_BEFORE_PROPOSING.contains(&message)
        || message.starts_with("grpc: received message larger than max")
}

/// The gRPC status codes the mapping looks at (numbers from the gRPC spec, so that the adapter
/// does not depend on tonic directly).
mod tonic_code {
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const UNAVAILABLE: i32 = 14;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// Runs the request `make` builds with the overall bound `timeout`, and makes it again while
/// it certainly did not apply ([`Failure::certainly_not_applied`]) and the bound leaves time:
/// it never reached etcd (the connection to the endpoint the client picked was refused or reset
/// before anything was sent: a member that is down, or cut off), or etcd refused it before
/// proposing it (a member cut from its peers answers `etcdserver: no leader`). The pause before
/// sending again starts at 10 ms and doubles up to 80 ms (every member may be without a leader
/// during an election). The client balances requests over every endpoint of the URL and keeps
/// picking such a member (tonic reports a dead endpoint ready with its connect error; a
/// leaderless member is healthy to it), so without this about a third to a half of the
/// requests fail while one member of three is down or cut off. Safe for any request, writes
/// included: nothing was applied. A request that finally gets no answer within the bound is
/// `Failure::Timeout` (its outcome unknown); one still refused returns that refusal.
/// TLS problems are returned at once (sending again cannot help).
pub(crate) async fn retry_unapplied<T, E, F, M>(
    timeout: Duration,
    mut make: M,
) -> Result<T, Failure>
where
    E: Into<Failure>,
    M: FnMut() -> F,
    F: std::future::Future<Output = Result<T, E>>,
{
    retry(timeout, false, |_| make()).await.0
}

/// [`retry_unapplied`], also sending the request again when its connection was closed or reset
/// under it ([`Failure::closed_after_handshake`]: a member going down, a proxy or load balancer
/// in front of one) while `timeout` leaves time. Only for a request that is safe to apply twice
/// and whose answer tells the caller what an earlier send did (a delete keyed on a create
/// revision; a create whose failure branch reads our own key). `make` is told whether an
/// earlier send may have applied (so a resend can differ). Returns the outcome and that flag.
pub(crate) async fn retry_resendable<T, E, F, M>(
    timeout: Duration,
    make: M,
) -> (Result<T, Failure>, bool)
where
    E: Into<Failure>,
    M: FnMut(bool) -> F,
    F: std::future::Future<Output = Result<T, E>>,
{
    retry(timeout, true, make).await
}

/// The loop of both (`lease_core::adapter::resend`): `resendable` also sends again after a
/// connection closed under the request. A send that gets no answer within what is left of
/// `timeout` is `Failure::Timeout(timeout)`.
async fn retry<T, E, F, M>(
    timeout: Duration,
    resendable: bool,
    mut make: M,
) -> (Result<T, Failure>, bool)
where
    E: Into<Failure>,
    M: FnMut(bool) -> F,
    F: std::future::Future<Output = Result<T, E>>,
{
    let again = |f: &Failure| {
        if f.certainly_not_applied() && !f.is_tls_problem() && f.too_large_problem().is_none() {
            Some(SendAgain::Unapplied)
        } else if resendable && f.closed_after_handshake() {
            Some(SendAgain::InDoubt)
        } else {
            None
        }
    };
    let pause = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
    let (outcome, in_doubt) = resend(timeout, pause, again, |left, in_doubt| {
        bounded(left, make(in_doubt))
    })
    .await;
    match outcome {
        Err(Failure::Timeout(_)) => (Err(Failure::Timeout(timeout)), in_doubt),
        r => (r, in_doubt),
    }
}

/// The first pause before [`retry_unapplied`] sends again.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause of [`retry_unapplied`].
const MAX_PAUSE: Duration = Duration::from_millis(80);

/// Runs `fut` with a bound; a request still unanswered at the bound is dropped (cancelled).
pub(crate) async fn bounded<T, E, F>(timeout: Duration, fut: F) -> Result<T, Failure>
where
    E: Into<Failure>,
    F: std::future::Future<Output = Result<T, E>>,
{
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(Failure::Timeout(timeout)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// etcd's status codes for its refusals (rpctypes/error.go).
    const RESOURCE_EXHAUSTED: i32 = 8;
    const UNKNOWN: i32 = 2;
    const DEADLINE_EXCEEDED: i32 = 4;
    const CANCELLED: i32 = 1;
    const INVALID_ARGUMENT: i32 = 3;

    fn not_applied(code: i32, message: &str) -> bool {
        status_not_sent(code, message) || is_refused_before_proposing(message)
    }

    #[test]
    fn refusals_before_proposing_are_not_applied() {
        for (code, message) in [
            (tonic_code::UNAVAILABLE, "etcdserver: no leader"),
            (tonic_code::UNAVAILABLE, "etcdserver: not capable"),
            (
                tonic_code::UNAVAILABLE,
                "etcdserver: rpc not supported for learner",
            ),
            (RESOURCE_EXHAUSTED, "etcdserver: too many requests"),
            (UNKNOWN, "raft proposal dropped"),
            (INVALID_ARGUMENT, "etcdserver: request is too large"),
            (
                RESOURCE_EXHAUSTED,
                "grpc: received message larger than max (2097424 vs. 2097152)",
            ),
        ] {
            assert!(
                not_applied(code, message),
                "{message} must count as not applied"
            );
        }
    }

    #[test]
    fn failures_that_may_follow_a_proposal_are_not_taken_for_refusals() {
        for (code, message) in [
            (tonic_code::UNAVAILABLE, "etcdserver: request timed out"),
            (
                tonic_code::UNAVAILABLE,
                "etcdserver: request timed out, possibly due to previous leader failure",
            ),
            (
                tonic_code::UNAVAILABLE,
                "etcdserver: request timed out, possibly due to connection lost",
            ),
            (tonic_code::UNAVAILABLE, "etcdserver: server stopped"),
            (tonic_code::UNAVAILABLE, "etcdserver: leader changed"),
            (CANCELLED, "etcdserver: request cancelled"),
            (DEADLINE_EXCEEDED, "context deadline exceeded"),
            (UNKNOWN, "transport error"),
            (
                tonic_code::UNAVAILABLE,
                "error reading a body from connection: connection reset",
            ),
            // A longer text that merely starts like a refusal is not one.
            (
                tonic_code::UNAVAILABLE,
                "etcdserver: no leader (but applied)",
            ),
        ] {
            assert!(!not_applied(code, message), "{message} may have applied");
        }
    }

    #[test]
    fn connections_never_made_are_not_sent() {
        for message in [
            "error trying to connect: tcp connect error: Connection refused (os error 111)",
            "failed to connect to all addresses",
            "dns error: failed to lookup address information",
        ] {
            assert!(
                status_not_sent(tonic_code::UNAVAILABLE, message),
                "{message}"
            );
        }
        assert!(!status_not_sent(
            tonic_code::UNAVAILABLE,
            "connection closed"
        ));
        assert!(!status_not_sent(UNKNOWN, "Connection refused"));
    }

    #[test]
    fn a_timeout_is_neither_sent_nor_refused() {
        let f = Failure::Timeout(Duration::from_secs(1));
        assert!(!f.certainly_not_applied());
        assert!(matches!(
            f.into_error(Op::write("release", false)),
            Error::OutcomeUnknown { .. }
        ));
    }
}
