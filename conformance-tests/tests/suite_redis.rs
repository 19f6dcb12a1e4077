//! The whole conformance suite against a real redis-server started by the harness (or
//! `FENCED_REDIS_URL`). Without `redis-server` the run is a named skip, and a failure under
//! `CI=true`.

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    conformance_tests::suite::main_for(|| {
        conformance_tests::subjects::subject_for(
            "redis",
            Some(PathBuf::from(env!("CARGO_BIN_EXE_conformance-worker"))),
        )
    })
}
