//! Connection plumbing: an etcd-client `Client` from an [`EtcdConfig`] (shared by the
//! coordinator and the fence).

use etcd_client::Client;
use lease_core::adapter::Op;
use lease_core::{Error, Result};

use crate::config::EtcdConfig;
use crate::error::{bounded, Failure, BACKEND};

/// How many connections a TLS check opens, at most, for a definite answer (see [`client_for`]).
const TLS_CHECK_ATTEMPTS: usize = 10;

/// Makes an etcd-client from a config (shared with the fence).
///
/// Over TLS the connection is checked now with one `Status` request: a member that refuses
/// our client certificate (or its absence) under TLS 1.3 sends its alert after the handshake
/// and closes the connection, usually with a reset that loses the alert, so the first request
/// would see only "connection closed". The check opens a few connections until one reports the
/// refusal itself (`Misconfigured`), or answers; connections that keep closing right after the
/// handshake give `Unavailable` saying so. Any other failure (refused, no answer) leaves the
/// connection lazy, as without TLS.
pub(crate) async fn client_for(config: &EtcdConfig) -> Result<Client> {
    let bound = config.connect_timeout() + config.request_timeout();
    let mut closed = None;
    for _ in 0..TLS_CHECK_ATTEMPTS {
        let options = config.connect_options()?;
        let connected =
            tokio::time::timeout(bound, Client::connect(config.endpoints(), Some(options))).await;
        let failure = match connected {
            Ok(Ok(mut client)) => {
                if !config.tls() {
                    return Ok(client);
                }
                match bounded(bound, client.status()).await {
                    Ok(_) => return Ok(client),
                    Err(f) if f.is_tls_problem() => return Err(f.into_error(Op::read("connect"))),
                    Err(f) if f.closed_after_handshake() => f,
                    // Unreachable, no leader, not permitted…: the calls will say.
                    Err(_) => return Ok(client),
                }
            }
            Ok(Err(
                e @ (etcd_client::Error::InvalidUri(_)
                | etcd_client::Error::InvalidArgs(_)
                | etcd_client::Error::EndpointError(_)),
            )) => {
                return Err(config
                    .url()
                    .invalid(format!("the etcd client rejected it: {e}"))
                    .into())
            }
            Ok(Err(e)) => {
                let f = Failure::from(e);
                if !config.tls() || f.is_tls_problem() || !f.closed_after_handshake() {
                    return Err(f.into_error(Op::read("connect")));
                }
                f
            }
            Err(_) => return Err(Failure::Timeout(bound).into_error(Op::read("connect"))),
        };
        closed = Some(failure);
    }
    let failure = closed.expect("at least one attempt");
    let hint = if config.tls_client_cert().is_some() {
        "a member run with --client-cert-auth does this when it does not trust the client \
         certificate (tls_cert_file must be signed by its --trusted-ca-file)"
    } else {
        "a member run with --client-cert-auth does this when no client certificate is given \
         (set tls_cert_file and tls_key_file)"
    };
    Err(Error::Unavailable {
        backend: BACKEND,
        message: format!(
            "connect: every TLS connection ({TLS_CHECK_ATTEMPTS} tried) was closed by the member \
             right after the handshake; {hint}; last error: {failure}"
        ),
        source: match failure {
            Failure::Etcd(e) => Some(Box::new(e)),
            Failure::Timeout(_) | Failure::NoAnswer(_) => None,
        },
    })
}
