//! The one place where etcd-client's errors become the workspace's [`Error`].
//!
//! | what etcd-client reports | read-only call | call that may write |
//! |---|---|---|
//! | transport error, gRPC `Unavailable` while connecting | `Unavailable` | `Unavailable` (nothing was sent) |
//! | gRPC `Unavailable` after sending, `Unknown`, `Cancelled`, `DeadlineExceeded`, our own timeout | `Unavailable` | `OutcomeUnknown` |
//! | gRPC `Unauthenticated`, `PermissionDenied`, "authentication failed" | `Misconfigured` (credentials or roles) | same |
//! | TLS handshake refused: the member's certificate is not trusted or not for the name (`invalid peer certificate`), or the member refused ours (`received fatal alert`, e.g. no client certificate under `--client-cert-auth`) | `Misconfigured` naming the TLS problem | same (nothing was processed: the handshake failed) |
//! | `etcdserver: requested lease not found` | the session ended: callers treat it as `Lost(SessionEnded)` or start a new session; otherwise `Unavailable` | `Unavailable` (etcd rejects the whole request) |
//! | anything else | `Unavailable` | `OutcomeUnknown` |
//!
//! Messages carry the gRPC status text, never the URL's password (etcd-client never puts
//! credentials in its errors; the adapter formats URLs only through `BackendUrl`).

use std::time::Duration;

use lease_core::Error;

pub(crate) const BACKEND: &str = "etcd";

/// A failed request: etcd-client's error, or no answer within the request timeout.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The client library's error.
    Etcd(etcd_client::Error),
    /// No answer within this bound; the request may or may not have applied.
    Timeout(Duration),
}

impl From<etcd_client::Error> for Failure {
    fn from(e: etcd_client::Error) -> Self {
        Failure::Etcd(e)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Etcd(e) => std::fmt::Display::fmt(e, f),
            Failure::Timeout(d) => write!(f, "no answer within {d:?}"),
        }
    }
}

impl Failure {
    /// Whether the server said our session lease does not exist (expired or revoked).
    pub(crate) fn is_lease_not_found(&self) -> bool {
        match self {
            Failure::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                s.message().contains("requested lease not found")
            }
            Failure::Etcd(etcd_client::Error::LeaseKeepAliveError(m)) => {
                m.contains("lease not found")
            }
            _ => false,
        }
    }

    /// Whether the request certainly never reached the server (connection refused, no
    /// connection could be made, the TLS handshake failed).
    pub(crate) fn certainly_not_sent(&self) -> bool {
        if self.tls_problem().is_some() {
            return true;
        }
        match self {
            Failure::Etcd(etcd_client::Error::TransportError(_)) => true,
            Failure::Etcd(etcd_client::Error::GRpcStatus(s)) => {
                s.code() as i32 == tonic_code::UNAVAILABLE && {
                    // Only the phrases of a connection that was never made: "connection reset"
                    // or "connection closed" may come after the request was sent.
                    let m = s.message().to_ascii_lowercase();
                    m.contains("error trying to connect")
                        || m.contains("tcp connect error")
                        || m.contains("failed to connect")
                        || m.contains("refused")
                        || m.contains("dns")
                }
            }
            _ => false,
        }
    }

    /// A failed TLS handshake, described for the operator. Found by walking the error's
    /// sources for rustls' messages (etcd-client and tonic wrap them in gRPC statuses and
    /// transport errors; a refusal by the server may only surface with the first request, as
    /// `Unknown: transport error`).
    fn tls_problem(&self) -> Option<String> {
        let Failure::Etcd(e) = self else {
            return None;
        };
        let mut detail = None;
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(err) = next {
            let shown = format!("{err:?} {err}");
            for marker in ["invalid peer certificate", "received fatal alert"] {
                if let Some(at) = shown.find(marker) {
                    detail = Some(quoted_text(&shown[at..]));
                }
            }
            if detail.is_some() {
                break;
            }
            next = err.source();
        }
        let detail = detail?;
        Some(if detail.contains("invalid peer certificate") {
            format!(
                "TLS: the member's certificate was refused ({detail}); check tls_ca_file (the CA \
                 that signed the members' certificates, system roots when absent) and tls_domain \
                 (the name in the certificate, the URL's host when absent)"
            )
        } else {
            format!(
                "TLS: the member refused the handshake ({detail}); if it runs with \
                 --client-cert-auth, give tls_cert_file and tls_key_file with a client \
                 certificate signed by its --trusted-ca-file"
            )
        })
    }

    /// Whether this is a refused TLS handshake (see [`Failure::tls_problem`]).
    pub(crate) fn is_tls_problem(&self) -> bool {
        self.tls_problem().is_some()
    }

    /// Whether the connection was closed or reset under the request without an answer (as a
    /// member refusing a client certificate does right after the TLS handshake, and as a
    /// member that is going down does).
    pub(crate) fn closed_after_handshake(&self) -> bool {
        let Failure::Etcd(e) = self else {
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
        let Failure::Etcd(etcd_client::Error::GRpcStatus(s)) = self else {
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

    /// The workspace error for a failure of `operation`. `may_have_written`: the request could
    /// have changed state if it reached the server.
    pub(crate) fn into_error(self, operation: &'static str, may_have_written: bool) -> Error {
        if let Some(problem) = self.tls_problem().or_else(|| self.auth_problem()) {
            return Error::Misconfigured {
                backend: BACKEND,
                problems: vec![problem],
            };
        }
        let message = format!("{operation}: {self}");
        // "lease not found" rejects a request that puts on that lease as a whole.
        if !may_have_written || self.certainly_not_sent() || self.is_lease_not_found() {
            return match self {
                Failure::Etcd(e) => Error::unavailable(BACKEND, message, e),
                Failure::Timeout(_) => Error::Unavailable {
                    backend: BACKEND,
                    message,
                    source: None,
                },
            };
        }
        let source: Option<lease_core::BoxError> = match self {
            Failure::Etcd(e) => Some(Box::new(e)),
            Failure::Timeout(_) => None,
        };
        Error::OutcomeUnknown {
            backend: BACKEND,
            operation,
            message,
            source,
        }
    }
}

/// The text up to the end of the quoted string it starts in (`\"` unescaped), at most 300
/// characters: rustls' message out of a wrapper's `Debug`.
fn quoted_text(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(n) => out.push(n),
                None => break,
            },
            '"' => break,
            c => out.push(c),
        }
        if out.len() >= 300 {
            break;
        }
    }
    out.trim_end().to_owned()
}

/// The gRPC status codes the mapping looks at (numbers from the gRPC spec, so that the adapter
/// does not depend on tonic directly).
mod tonic_code {
    pub(super) const PERMISSION_DENIED: i32 = 7;
    pub(super) const UNAVAILABLE: i32 = 14;
    pub(super) const UNAUTHENTICATED: i32 = 16;
}

/// Runs `fut` with a bound; a request still unanswered at the bound is dropped (cancelled).
/// Like [`bounded`], but a request that certainly never reached etcd (the connection to the
/// endpoint the client picked was refused or reset before anything was sent: a member that is
/// down, or cut off) is made again with `make` after 10 ms, as long as the overall bound
/// `timeout` leaves time. The client balances requests over every endpoint of the URL, and a
/// dead endpoint keeps being picked (tonic reports it ready with its connect error), so without
/// this about half of the requests fail while one member of three is down. Safe for any
/// request, writes included: nothing was sent.
pub(crate) async fn retry_unsent<T, F, M>(timeout: Duration, mut make: M) -> Result<T, Failure>
where
    M: FnMut() -> F,
    F: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match bounded(left, make()).await {
            Err(f) if f.certainly_not_sent() && !f.is_tls_problem() => {
                if tokio::time::Instant::now() + UNSENT_PAUSE >= deadline {
                    return Err(f);
                }
                tracing::trace!(error = %f, "etcd request never sent; trying another endpoint");
                tokio::time::sleep(UNSENT_PAUSE).await;
            }
            Err(Failure::Timeout(_)) => return Err(Failure::Timeout(timeout)),
            r => return r,
        }
    }
}

/// The pause before [`retry_unsent`] sends again.
const UNSENT_PAUSE: Duration = Duration::from_millis(10);

pub(crate) async fn bounded<T, F>(timeout: Duration, fut: F) -> Result<T, Failure>
where
    F: std::future::Future<Output = Result<T, etcd_client::Error>>,
{
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r.map_err(Failure::Etcd),
        Err(_) => Err(Failure::Timeout(timeout)),
    }
}
