//! This adapter's worker process for the conformance suite's process cases: the suite's worker,
//! connecting through this adapter's registry.

fn main() -> std::process::ExitCode {
    conformance_suite::worker::main_with(thirdparty_memory_adapter::registry())
}
