//! The whole conformance suite against this adapter, through the suite's public entry points
//! only: a [`Subject`] built from the adapter's own registry, run by [`main_for`].
//!
//! `cargo test -p thirdparty-memory-adapter --test suite [case-name-filter]`

use std::time::Duration;

use conformance_suite::suite::{main_for, Subject};

const URL: &str = "thirdparty-memory://";

fn main() -> std::process::ExitCode {
    main_for(|| async {
        let registry = thirdparty_memory_adapter::registry();
        // One backend for every client of the run: the cases make several clients and expect
        // them to contend for the same keys.
        let coordinator = registry.connect(URL).await.map_err(|e| e.to_string())?;
        let fence = registry
            .connect_fence(URL)
            .await
            .map_err(|e| e.to_string())?;
        let subject = Subject::shared(
            "thirdparty-memory",
            coordinator,
            fence,
            Duration::from_millis(300),
        );
        // A backend shared across OS processes (a server) also names its worker binary, so that
        // the process cases run instead of being skipped by name:
        //
        //     subject.with_workers(server_url, env!("CARGO_BIN_EXE_thirdparty-worker"))
        //
        // This backend lives inside each process, so a worker would not contend with the test's
        // clients; `tests/worker.rs` runs the worker binary on its own instead.
        Ok(Some(subject))
    })
}
