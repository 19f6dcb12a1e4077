//! The ZooKeeper subject: a harness-started ZooKeeper (Debian's jars on a JVM), or
//! `FENCED_ZK_URL`; clients (connected as `fenced::connect` would, each kept weakly so the
//! operator can find a holder's session) and workers (by URL) with a digest user and a random
//! base path; the in-memory fence (ZooKeeper is no fence); a proxy hook;
//! and an operator that deletes a lock's nodes as `zkCli deleteall` would, overwrites the holder's
//! node with `setData`, and closes the holder's session with its id and password.

use std::path::PathBuf;

use crate::suite::Subject;

/// The session timeout (and so the minimum and the suite's TTL) of the ZooKeeper subject.
const ZK_SESSION_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);

use crate::suite::Operator;

use std::sync::{Arc, Mutex, Weak};

use adapter_zookeeper::zookeeper_client as zk;
use adapter_zookeeper::ZkCoordinator;
use lease_core::Instrumented;

/// Every coordinator the subject made (weakly: a dropped client is gone), so that the
/// operator can find the one whose session holds a lock.
pub(super) type Clients = Arc<Mutex<Vec<Weak<Instrumented<ZkCoordinator>>>>>;

pub(super) fn track(clients: &Clients, c: ZkCoordinator) -> Arc<dyn lease_core::Coordinator> {
    let c = Arc::new(Instrumented::new(c));
    let mut list = clients.lock().unwrap_or_else(|p| p.into_inner());
    list.retain(|w| w.strong_count() > 0);
    list.push(Arc::downgrade(&c));
    c
}

/// Deletes a lock's nodes as an operator with the digest credentials would (`deleteall`),
/// overwrites the holder's node (`set`), and closes the holder's session.
pub(super) struct ZkOperator {
    pub(super) config: adapter_zookeeper::ZkConfig,
    pub(super) digest: String,
    pub(super) clients: Clients,
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

    /// The holder's node (the contender created first) and its `Stat`, if the lock is held.
    async fn holder(
        &self,
        client: &zk::Client,
        key: &lease_core::LockKey,
    ) -> Result<Option<(String, zk::Stat)>, String> {
        let dir = self.config.lock_path(key);
        let children = match client.list_children(&dir).await {
            Ok(c) => c,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(format!("operator list {dir}: {e}")),
        };
        let mut first: Option<(String, zk::Stat)> = None;
        for c in children {
            let path = format!("{dir}/{c}");
            match client.check_stat(&path).await {
                Ok(Some(stat)) if first.as_ref().is_none_or(|(_, f)| stat.czxid < f.czxid) => {
                    first = Some((path, stat));
                }
                Ok(_) => {}
                Err(e) => return Err(format!("operator stat {path}: {e}")),
            }
        }
        Ok(first)
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

    /// `set <holder's node> <other value>`, whatever its data version.
    fn overwrite_value<'a>(
        &'a self,
        key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let client = self.client().await?;
            let (path, _) = self
                .holder(&client, key)
                .await?
                .ok_or_else(|| format!("operator: {key} is not held"))?;
            client
                .set_data(&path, b"owner=someone-else\nop=outside-write\n", None)
                .await
                .map_err(|e| format!("operator set {path}: {e}"))?;
            Ok(true)
        })
    }

    /// Finds the subject's client whose session owns the holder's node (its
    /// `ephemeralOwner`), takes that session over with its id and password from another
    /// client, and closes it; retried (bounded) until the holder's node is gone.
    fn invalidate_holder<'a>(
        &'a self,
        key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let client = self.client().await?;
            let (path, stat) = self
                .holder(&client, key)
                .await?
                .ok_or_else(|| format!("operator: {key} is not held"))?;
            let live: Vec<_> = self
                .clients
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .filter_map(Weak::upgrade)
                .collect();
            let mut session = None;
            for c in live {
                if let Some(info) = c.inner().current_session().await {
                    if info.id().0 == stat.ephemeral_owner {
                        session = Some(info);
                        break;
                    }
                }
            }
            let session = session.ok_or_else(|| {
                format!(
                    "operator: the holder's session {:#x} is no client of this subject",
                    stat.ephemeral_owner
                )
            })?;
            let server = self
                .config
                .connect_string()
                .split(',')
                .next()
                .unwrap_or_default()
                .to_owned();
            let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                // Raced or failed: look whether the session's node is gone anyway.
                let _ = adapter_zookeeper::close_session_out_of_band(
                    &server,
                    session.clone(),
                    ZK_SESSION_TIMEOUT,
                    std::time::Duration::from_secs(3),
                )
                .await;
                match client.check_stat(&path).await {
                    Ok(Some(s)) if s.ephemeral_owner == stat.ephemeral_owner => {}
                    Ok(_) => return Ok(true),
                    Err(e) => return Err(format!("operator stat {path}: {e}")),
                }
                if tokio::time::Instant::now() >= until {
                    return Err(format!(
                        "operator: could not close the holder's session {:#x}",
                        stat.ephemeral_owner
                    ));
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        })
    }
}

/// The ZooKeeper subject: a harness-started ZooKeeper (or `FENCED_ZK_URL`), clients and workers
/// with a digest user and a random base path, the in-memory fence (ZooKeeper is no fence), a
/// proxy hook, an operator that deletes a lock's nodes with zookeeper-client as `zkCli` would,
/// overwrites the holder's node and closes the holder's session, and a TTL equal to the session
/// timeout (1.5 s).
pub(super) async fn zookeeper_subject(
    worker_exe: Option<PathBuf>,
) -> Result<Option<Subject>, String> {
    use crate::harness::{
        server_unavailable, Backend, ExternalEndpoints, ServerControl, ZooKeeperServer,
    };
    use crate::suite::ConnectViaFn;

    let password = format!("pw-{:016x}", rand::random::<u64>());
    let digest = format!("conformance:{password}");
    let base = format!("/conformance-{:08x}", rand::random::<u32>());
    let external = ExternalEndpoints::from_env().get(Backend::ZooKeeper);
    // A lease lives as long as its session: against an external ensemble the suite's TTL
    // (`CONFORMANCE_TTL_MS`) is the session timeout asked for.
    let session_timeout = match &external {
        Some(_) => crate::suite::ttl_override().unwrap_or(ZK_SESSION_TIMEOUT),
        None => ZK_SESSION_TIMEOUT,
    };
    // The harness server's tickTime is known (200 ms): the follower-touch margin need not assume
    // the worst (decision 0017). An external ensemble's is not, so the default applies.
    let tick = match &external {
        Some(_) => String::new(),
        None => format!(
            "&tick_ms={}",
            crate::harness::ZooKeeperConfig::default()
                .tick_time
                .as_millis()
        ),
    };
    let params = format!(
        "session_timeout_ms={}{tick}&digest={digest}",
        session_timeout.as_millis()
    );
    let (url, server, upstream): (String, Box<dyn ServerControl>, Option<std::net::SocketAddr>) =
        match external {
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
    let clients: Clients = Arc::default();
    let (connect_config, connect_clients) = (config.clone(), clients.clone());
    let mut subject = Subject::new(
        "zookeeper",
        // What `fenced::connect(url)` does (parse, connect, instrument), keeping a handle.
        Arc::new(move || {
            let (config, clients) = (connect_config.clone(), connect_clients.clone());
            Box::pin(async move { Ok(track(&clients, ZkCoordinator::connect(config).await?)) })
        }),
        Arc::new(lease_core::memory::MemoryFence::new()),
        session_timeout,
    )
    .with_server(server)
    .with_operator(Arc::new(ZkOperator {
        config: config.clone(),
        digest,
        clients: clients.clone(),
    }))
    .with_secret(password);
    if let Some(upstream) = upstream {
        let connect_via: ConnectViaFn = Arc::new(move |addr| {
            let (config, clients) = (config.clone(), clients.clone());
            Box::pin(async move {
                let c = ZkCoordinator::connect(config.with_hosts([addr.to_string()])?).await?;
                Ok(track(&clients, c))
            })
        });
        subject = subject.with_proxy(upstream, connect_via);
    }
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
