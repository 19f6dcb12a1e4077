//! The zookeeper_ensemble subject: the shared suite against a three-server ZooKeeper ensemble.

use std::path::PathBuf;

use crate::suite::Subject;

/// The subject, or why it cannot be built.
pub(crate) async fn subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    let _ = worker_exe;
    Err("the zookeeper_ensemble subject is not built yet".into())
}
