//! The zookeeper-ensemble subject: the shared suite against a three-server ZooKeeper ensemble
//! the harness runs ([`ZooKeeperEnsemble`](crate::harness::zookeeper_ensemble::ZooKeeperEnsemble)).
//!
//! Like the single-server subject (`subjects/zookeeper.rs`): clients (connected as
//! `fenced::connect` would, each kept weakly so the operator can find a holder's session) and
//! workers with a digest user and a random base path, the in-memory fence (ZooKeeper is no
//! fence), the same operator; but the URL names all three servers through their client-side
//! proxies (`zk://p0,p1,p2/base?session_timeout_ms=1500&tick_ms=200&connect_timeout_ms=<failover
//! bound>&digest=...`), the cluster
//! control is the ensemble, the single-server restart cases crash and restart the whole
//! ensemble, and the proxy cases place their proxy in front of server 0 only.

use std::path::PathBuf;

use crate::suite::Subject;

/// The session timeout (and so the minimum and the suite's TTL) of the ensemble subject.
const ZK_SESSION_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);

/// The subject, or why it cannot be built (a named skip when Java or the jars are missing,
/// a failure under `CI=true`).
pub(crate) async fn subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    use std::sync::Arc;

    use adapter_zookeeper::ZkCoordinator;

    use super::zookeeper::{track, Clients, ZkOperator};
    use crate::harness::zookeeper_ensemble::{WholeEnsemble, ZooKeeperEnsemble};
    use crate::harness::{server_unavailable, ClusterControl};
    use crate::suite::ConnectViaFn;

    if let Err(reason) = ZooKeeperEnsemble::install() {
        let skip = server_unavailable("zookeeper-ensemble", reason).map_err(|e| e.to_string())?;
        skip.report();
        return Ok(None);
    }
    let ensemble = Arc::new(
        ZooKeeperEnsemble::start()
            .await
            .map_err(|e| e.to_string())?,
    );
    let password = format!("pw-{:016x}", rand::random::<u64>());
    let digest = format!("conformance:{password}");
    let base = format!("/conformance-{:08x}", rand::random::<u32>());
    let tick_ms = ensemble.config().tick_time.as_millis();
    // A connect during an election waits it out.
    let connect_ms = ensemble.failover_bound().as_millis();
    let params = format!(
        "session_timeout_ms={}&tick_ms={tick_ms}&connect_timeout_ms={connect_ms}&digest={digest}",
        ZK_SESSION_TIMEOUT.as_millis()
    );
    let url = format!("zk://{}{base}?{params}", ensemble.connect_string());
    let config = adapter_zookeeper::ZkConfig::from_url(&url).map_err(|e| e.to_string())?;
    let clients: Clients = Arc::default();
    let (connect_config, connect_clients) = (config.clone(), clients.clone());
    let upstream = ensemble.client_addr(0);
    let mut subject = Subject::new(
        "zookeeper-ensemble",
        // What `fenced::connect(url)` does (parse, connect, instrument), keeping a handle.
        Arc::new(move || {
            let (config, clients) = (connect_config.clone(), connect_clients.clone());
            Box::pin(async move { Ok(track(&clients, ZkCoordinator::connect(config).await?)) })
        }),
        Arc::new(lease_core::memory::MemoryFence::new()),
        ZK_SESSION_TIMEOUT,
    )
    .with_server(Box::new(WholeEnsemble(ensemble.clone())))
    .with_cluster(ensemble.clone())
    .with_operator(Arc::new(ZkOperator {
        config: config.clone(),
        digest,
        clients: clients.clone(),
    }))
    .with_secret(password);
    // A client pinned to one server: the same base path and options, one host.
    let (members, member_base, member_params) = (ensemble.clone(), base.clone(), params.clone());
    subject = subject.with_member_connect(Arc::new(move |m| {
        let url = format!("{}{member_base}?{member_params}", members.member_url(m));
        Box::pin(async move { fenced::connect(&url).await })
    }));
    let connect_via: ConnectViaFn = Arc::new(move |addr| {
        let (config, clients) = (config.clone(), clients.clone());
        Box::pin(async move {
            let c = ZkCoordinator::connect(config.with_hosts([addr.to_string()])?).await?;
            Ok(track(&clients, c))
        })
    });
    subject = subject.with_proxy(upstream, connect_via);
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
