//! The whole conformance suite against the in-memory backend (runs on every `cargo test`).

fn main() -> std::process::ExitCode {
    conformance_tests::suite::main_for(|| async {
        Ok(Some(conformance_tests::suite::Subject::memory()))
    })
}
