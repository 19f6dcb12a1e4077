//! The worker *process* of the suite's process cases for this workspace's backends: the suite's
//! [`conformance_suite::worker::main_with`] over `fenced`'s registry (every URL scheme of this
//! workspace, `memory://` included). See that module for the command line and output.

fn main() -> std::process::ExitCode {
    conformance_suite::worker::main_with(fenced::registry())
}
