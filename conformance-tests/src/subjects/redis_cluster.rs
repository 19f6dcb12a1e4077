//! The `redis-sentinel` subject: the shared suite against a Redis primary with two replicas and
//! three Sentinels the harness starts ([`RedisCluster`]). Clients, workers and the fence connect
//! with the cluster's `redis+sentinel://` URL through `fenced::connect`, so every grant follows
//! the current primary across failovers; the cluster control drives the cluster cases.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::harness::redis_cluster::RedisCluster;
use crate::harness::{server_unavailable, Backend, ClusterControl};
use crate::suite::Subject;

/// The lease TTL of the cases: shorter than a Sentinel failover here (about 2 to 5 s), so a lease
/// held through a primary's crash is usually lost (and reported so) rather than carried over;
/// both outcomes are checked.
const TTL: Duration = Duration::from_secs(2);

/// Extra URL options for the cluster's clients (see [`subject`]).
const OPTIONS_ENV: &str = "CONFORMANCE_REDIS_CLUSTER_OPTIONS";

/// The subject, or why it cannot be built (see the module docs).
pub(crate) async fn subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    if let Err(reason) = Backend::Redis.local_availability() {
        server_unavailable("redis-sentinel", reason)
            .map_err(|e| e.to_string())?
            .report();
        return Ok(None);
    }
    let cluster = Arc::new(
        RedisCluster::start()
            .await
            .map_err(|e| format!("starting the Redis cluster: {e}"))?,
    );
    let prefix = format!("conformance-{:08x}", rand::random::<u32>());
    let mut url = format!(
        "{}?key_prefix={prefix}&request_timeout_ms=1000&connect_timeout_ms=1000",
        cluster.url()
    );
    // For reproducing what a guard prevents, e.g.
    // `CONFORMANCE_REDIS_CLUSTER_OPTIONS=clock_tokens=false&unguarded_replicas=true`
    // (decision 0016: `failover_to_lagging_replica` then fails).
    if let Ok(extra) = std::env::var(OPTIONS_ENV) {
        if !extra.trim().is_empty() {
            println!("note: redis-sentinel: URL options {extra:?} from {OPTIONS_ENV}");
            url = format!("{url}&{}", extra.trim());
        }
    }
    let fence = fenced::connect_fence(&url)
        .await
        .map_err(|e| format!("redis-sentinel fence: {e}"))?;
    let connect_url = url.clone();
    let mut subject = Subject::new(
        "redis-sentinel",
        Arc::new(move || {
            let url = connect_url.clone();
            Box::pin(async move { fenced::connect(&url).await })
        }),
        fence,
        TTL,
    )
    .with_cluster(cluster.clone() as Arc<dyn ClusterControl>)
    // Replication is asynchronous: a promoted replica may not have the last grant (README).
    .without_exclusion_across_failover();
    let (members, member_prefix) = (cluster.clone(), prefix.clone());
    subject = subject.with_member_connect(Arc::new(move |m| {
        let url = format!(
            "{}?key_prefix={member_prefix}&request_timeout_ms=1000&connect_timeout_ms=1000",
            members.member_url(m)
        );
        Box::pin(async move { fenced::connect(&url).await })
    }));
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
