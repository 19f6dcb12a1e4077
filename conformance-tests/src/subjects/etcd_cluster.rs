//! The etcd_cluster subject: the shared suite against a three-member etcd cluster.
//!
//! As the single-server etcd subject ([`super::etcd`]), over the cluster URL
//! `etcd://<proxy 0>,<proxy 1>,<proxy 2>` (every member, each through its client-side fault
//! proxy), with the cluster's [`ClusterControl`](crate::harness::ClusterControl), workers, the
//! etcd fence, an operator, and:
//!
//! - the single-server restart cases run against the **whole cluster** (every member crashed and
//!   restarted on its data, [`EtcdCluster::whole`]);
//! - the proxy cases put their proxy in front of member 0 and connect a client naming that member
//!   only (a client-to-member fault; the cluster cases cover member faults).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::etcd::EtcdOperator;
use crate::harness::etcd_cluster::EtcdCluster;
use crate::harness::{server_unavailable, ClusterControl};
use crate::suite::{ConnectViaFn, FenceViaFn, Subject};

/// The subject, or why it cannot be built.
pub(crate) async fn subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    if let Err(reason) = EtcdCluster::availability() {
        let skip = server_unavailable("etcd-cluster", reason).map_err(|e| e.to_string())?;
        skip.report();
        return Ok(None);
    }
    let cluster = Arc::new(EtcdCluster::start().await.map_err(|e| e.to_string())?);
    let key_prefix = format!("conformance-{:08x}", rand::random::<u32>());
    let url = format!("{}?key_prefix={key_prefix}", cluster.url());
    let fence = fenced::connect_fence(&url)
        .await
        .map_err(|e| format!("etcd fence: {e}"))?;
    let operator = adapter_etcd::EtcdCoordinator::connect_url(&url)
        .await
        .map_err(|e| format!("etcd operator client: {e}"))?;
    let connect_url = url.clone();
    let mut subject = Subject::new(
        "etcd-cluster",
        Arc::new(move || {
            let url = connect_url.clone();
            Box::pin(async move { fenced::connect(&url).await })
        }),
        fence,
        adapter_etcd::MIN_TTL.max(Duration::from_secs(2)),
    )
    .with_server(cluster.whole())
    .with_operator(Arc::new(EtcdOperator {
        client: operator.client(),
        key_prefix: key_prefix.clone(),
    }));
    let upstream = cluster.direct_addr(0);
    let prefix = key_prefix.clone();
    let connect_via: ConnectViaFn = Arc::new(move |addr| {
        let url = format!("etcd://{addr}?key_prefix={prefix}");
        Box::pin(async move {
            let c = adapter_etcd::EtcdCoordinator::connect_url(&url).await?;
            Ok(Arc::new(lease_core::Instrumented::new(c)) as Arc<dyn lease_core::Coordinator>)
        })
    });
    subject = subject.with_proxy(upstream, connect_via);
    let prefix = key_prefix.clone();
    let fence_via: FenceViaFn = Arc::new(move |addr| {
        let url = format!("etcd://{addr}?key_prefix={prefix}&request_timeout_ms=1000");
        Box::pin(async move {
            let f = adapter_etcd::EtcdFence::connect_url(&url).await?;
            Ok(Arc::new(f) as Arc<dyn lease_core::Fence>)
        })
    });
    subject = subject.with_fence_proxy(upstream, fence_via);
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    let (members, prefix) = (cluster.clone(), key_prefix.clone());
    subject = subject.with_member_connect(Arc::new(move |m| {
        let url = format!("{}?key_prefix={prefix}", members.member_url(m));
        Box::pin(async move { fenced::connect(&url).await })
    }));
    Ok(Some(
        subject.with_cluster(cluster as Arc<dyn ClusterControl>),
    ))
}
