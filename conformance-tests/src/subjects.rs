//! Subjects for the backends this workspace ships, as the runner and the per-backend suite test
//! files build them.

use std::path::PathBuf;

use crate::suite::Subject;

pub mod consul;
mod etcd;
mod etcd_cluster;
mod redis;
mod redis_cluster;
mod zookeeper;
mod zookeeper_ensemble;

/// The subject for `backend`, with its server started by the harness (or taken from the
/// environment). `Ok(None)` is a named skip (already reported); `Err` is a setup failure,
/// including a missing server under `CI=true`.
pub async fn subject_for(
    backend: &str,
    worker_exe: Option<PathBuf>,
) -> Result<Option<Subject>, String> {
    match backend {
        "memory" => Ok(Some(Subject::memory())),
        "redis" => redis::redis_subject(worker_exe).await,
        "etcd" => etcd::etcd_subject(worker_exe).await,
        "zookeeper" => zookeeper::zookeeper_subject(worker_exe).await,
        "consul" => consul::consul_subject(worker_exe).await,
        "redis-sentinel" => redis_cluster::subject(worker_exe).await,
        "etcd-cluster" => etcd_cluster::subject(worker_exe).await,
        "zookeeper-ensemble" => zookeeper_ensemble::subject(worker_exe).await,
        other => Err(format!(
            "unknown backend {other:?} (known: memory, redis, etcd, zookeeper, consul, \
             redis-sentinel, etcd-cluster, zookeeper-ensemble)"
        )),
    }
}
