//! The whole conformance suite against Consul: a real agent when `CONSUL_HTTP_ADDR` is set
//! (with `CONSUL_HTTP_TOKEN` if any; server-control cases are then skipped by name), otherwise the
//! in-process Consul stand-in (`conformance_tests::consul_standin`). The report's subject name
//! says which one ran: `consul (real: ...)` or `consul (stand-in)`.

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    conformance_tests::suite::main_for(|| {
        conformance_tests::subjects::subject_for(
            "consul",
            Some(PathBuf::from(env!("CARGO_BIN_EXE_conformance-worker"))),
        )
    })
}
