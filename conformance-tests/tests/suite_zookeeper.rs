//! The whole conformance suite against a real ZooKeeper started by the harness (or
//! `FENCED_ZK_URL`). Without a JVM or the ZooKeeper jars the run is a named skip, and a failure
//! under `CI=true`.

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    conformance_tests::suite::main_for(|| {
        conformance_tests::subjects::subject_for(
            "zookeeper",
            Some(PathBuf::from(env!("CARGO_BIN_EXE_conformance-worker"))),
        )
    })
}
