//! The shared suite against a zookeeper-ensemble the harness starts: the cluster cases plus
//! `suite::CLUSTER_CORE_CASES` (`CONFORMANCE_CLUSTER_FULL=1` runs every case). Without the
//! servers the run is a named skip, and a failure under `CI=true`.

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    conformance_tests::suite::main_for_cluster(|| {
        conformance_tests::subjects::subject_for(
            "zookeeper-ensemble",
            Some(PathBuf::from(env!("CARGO_BIN_EXE_conformance-worker"))),
        )
    })
}
