//! The ZooKeeper subject: a harness-started ZooKeeper (Debian's jars on a JVM), or
//! `FENCED_ZK_URL`; clients and workers that connect by URL through `fenced::connect` with a
//! digest user and a random base path; the in-memory fence (ZooKeeper is no fence); a proxy hook;
//! and an operator that deletes a lock's nodes as `zkCli deleteall` would.

use std::path::PathBuf;

use crate::suite::Subject;

/// The session timeout (and so the minimum and the suite's TTL) of the ZooKeeper subject.
const ZK_SESSION_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);

/// The ZooKeeper subject: a harness-started ZooKeeper (or `FENCED_ZK_URL`), clients and workers
/// that connect by URL through `fenced::connect` with a digest user and a random base path, the
/// in-memory fence (ZooKeeper is no fence), a proxy hook, an operator that deletes a lock's nodes
/// with zookeeper-client as `zkCli` would, and a TTL equal to the session timeout (1.5 s).
pub(super) async fn zookeeper_subject(
    worker_exe: Option<PathBuf>,
) -> Result<Option<Subject>, String> {
    use std::sync::Arc;

    use adapter_zookeeper::zookeeper_client as zk;

    use crate::harness::{
        server_unavailable, Backend, ExternalEndpoints, ServerControl, ZooKeeperServer,
    };
    use crate::suite::{ConnectViaFn, Operator};

    /// Deletes a lock's nodes as an operator with the digest credentials would (`deleteall`).
    struct ZkOperator {
        config: adapter_zookeeper::ZkConfig,
        digest: String,
    }

    impl ZkOperator {
        async fn client(&self) -> Result<zk::Client, String> {
            zk::Client::connector()
                .with_session_timeout(ZK_SESSION_TIMEOUT)
                .with_auth("digest", self.digest.as_bytes())
                .connect(&self.config.connect_string())
                .await
                .map_err(|e| format!("operator connect: {e}"))
        }

        async fn delete_children(&self, client: &zk::Client, dir: &str) -> Result<(), String> {
            let children = match client.list_children(dir).await {
                Ok(c) => c,
                Err(zk::Error::NoNode) => return Ok(()),
                Err(e) => return Err(format!("operator list {dir}: {e}")),
            };
            for c in children {
                match client.delete(&format!("{dir}/{c}"), None).await {
                    Ok(()) | Err(zk::Error::NoNode) => {}
                    Err(e) => return Err(format!("operator delete {dir}/{c}: {e}")),
                }
            }
            Ok(())
        }
    }

    impl Operator for ZkOperator {
        fn delete_key<'a>(
            &'a self,
            key: &'a lease_core::LockKey,
        ) -> futures::future::BoxFuture<'a, Result<(), String>> {
            Box::pin(async move {
                let client = self.client().await?;
                self.delete_children(&client, &self.config.lock_path(key))
                    .await
            })
        }

        fn delete_parent<'a>(
            &'a self,
            key: &'a lease_core::LockKey,
        ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
            Box::pin(async move {
                let client = self.client().await?;
                let dir = self.config.lock_path(key);
                self.delete_children(&client, &dir).await?;
                match client.delete(&dir, None).await {
                    Ok(()) | Err(zk::Error::NoNode) => Ok(true),
                    Err(e) => Err(format!("operator delete {dir}: {e}")),
                }
            })
        }
    }

    let password = format!("pw-{:016x}", rand::random::<u64>());
    let digest = format!("conformance:{password}");
    let base = format!("/conformance-{:08x}", rand::random::<u32>());
    let params = format!(
        "session_timeout_ms={}&digest={digest}",
        ZK_SESSION_TIMEOUT.as_millis()
    );
    let (url, server, upstream): (String, Box<dyn ServerControl>, Option<std::net::SocketAddr>) =
        match ExternalEndpoints::from_env().get(Backend::ZooKeeper) {
            Some(external) => {
                let hosts = external
                    .url
                    .trim_start_matches("zk://")
                    .split(['/', '?'])
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                (
                    format!("zk://{hosts}{base}?{params}"),
                    Box::new(external),
                    None,
                )
            }
            None => {
                if let Err(reason) = ZooKeeperServer::install() {
                    let skip =
                        server_unavailable("zookeeper", reason).map_err(|e| e.to_string())?;
                    skip.report();
                    return Ok(None);
                }
                let server = tokio::task::spawn_blocking(ZooKeeperServer::start)
                    .await
                    .map_err(|e| format!("starting zookeeper panicked: {e}"))?
                    .map_err(|e| e.to_string())?;
                let addr = server.addr();
                (
                    format!("zk://{addr}{base}?{params}"),
                    Box::new(server),
                    Some(addr),
                )
            }
        };
    let config = adapter_zookeeper::ZkConfig::from_url(&url).map_err(|e| e.to_string())?;
    let connect_url = url.clone();
    let mut subject = Subject::new(
        "zookeeper",
        Arc::new(move || {
            let url = connect_url.clone();
            Box::pin(async move { fenced::connect(&url).await })
        }),
        Arc::new(lease_core::memory::MemoryFence::new()),
        ZK_SESSION_TIMEOUT,
    )
    .with_server(server)
    .with_operator(Arc::new(ZkOperator {
        config: config.clone(),
        digest,
    }))
    .with_secret(password);
    if let Some(upstream) = upstream {
        let connect_via: ConnectViaFn = Arc::new(move |addr| {
            let config = config.clone();
            Box::pin(async move {
                let c = adapter_zookeeper::ZkCoordinator::connect(
                    config.with_hosts([addr.to_string()])?,
                )
                .await?;
                Ok(Arc::new(lease_core::Instrumented::new(c)) as Arc<dyn lease_core::Coordinator>)
            })
        });
        subject = subject.with_proxy(upstream, connect_via);
    }
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
