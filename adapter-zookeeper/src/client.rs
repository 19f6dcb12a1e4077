//! Connection plumbing: a zookeeper-client `Client` (one ZooKeeper session) from a
//! [`ZkConfig`], opened by [`Session`](crate::session::Session) at connect and after a session
//! ended, within the chroot of the client the coordinator was given, if any.

use std::time::Duration;

use lease_core::Result;
use tokio::time::Instant;
use zookeeper_client::Client;

use crate::config::ZkConfig;
use crate::error::connect_failed;

/// Opens the client library's session with the config's hosts, retrying (while the error is not final) until the
/// connect timeout: the library gives up after one session timeout, which an election or a
/// restarting server can outlast. Every path the client is asked for is then under `chroot`
/// (`/` for none): the chroot of an application's client the coordinator was built on
/// ([`ZkCoordinator::from_client`](crate::ZkCoordinator::from_client)), so that a new session
/// queues where the first one did.
///
/// Also returns when the attempt that opened the session began: the session was created after
/// that, by the leader, which knows of it from then on.
pub(crate) async fn open(config: &ZkConfig, chroot: &str) -> Result<(Client, Instant)> {
    let hosts = &config.connect_string();
    let limit = config.connect_timeout();
    let deadline = Instant::now() + limit;
    loop {
        let mut connector = Client::connector().with_session_timeout(config.session_timeout());
        if let Some(auth) = config.digest_auth() {
            connector = connector.with_auth("digest", &auth);
        }
        let began = Instant::now();
        let left = deadline.saturating_duration_since(began);
        let error = match tokio::time::timeout(left, connector.connect(hosts)).await {
            Err(_) => {
                return Err(connect_failed(
                    hosts,
                    format!("no session within {limit:?}"),
                    None,
                ))
            }
            Ok(Ok(c)) if chroot == "/" => return Ok((c, began)),
            Ok(Ok(c)) => {
                // The path came from a client's own `path()`, so it is valid; refused all the
                // same, the session would lock elsewhere than the first one did.
                let c = c.chroot(chroot).map_err(|_| {
                    connect_failed(hosts, format!("the chroot {chroot:?} was refused"), None)
                })?;
                return Ok((c, began));
            }
            Ok(Err(e)) => e,
        };
        let retryable = matches!(
            error,
            zookeeper_client::Error::Timeout
                | zookeeper_client::Error::ConnectionLoss
                | zookeeper_client::Error::NoHosts
        );
        if !retryable || Instant::now() + Duration::from_millis(50) >= deadline {
            return Err(connect_failed(hosts, error.to_string(), Some(error)));
        }
        tracing::debug!(hosts = %hosts, error = %error, "no zookeeper session yet; retrying");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
