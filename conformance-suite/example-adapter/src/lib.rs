//! A stand-in for an adapter that lives outside this workspace: it offers lease-core's in-memory
//! coordinator and fence under a URL scheme of its own, `thirdparty-memory://`, registered the way
//! any adapter registers its schemes. Its tests run the whole conformance suite against it through
//! the suite's public entry points only (`tests/suite.rs`), and its own worker binary
//! (`src/bin/thirdparty-worker.rs`) serves the suite's process cases through
//! `conformance_suite::worker::main_with`.

use lease_core::memory::{MemoryCoordinator, MemoryFence};
use lease_core::Registry;

/// This adapter's URL scheme.
pub const SCHEME: &str = "thirdparty-memory";

/// Registers [`SCHEME`]'s coordinator and fence in `registry`.
///
/// Each connect makes a new in-process coordinator (as `memory://` does): the backend is not
/// shared across OS processes.
pub fn register(registry: &mut Registry) {
    registry.register_coordinator_fn(&[SCHEME], |_url| async { Ok(MemoryCoordinator::new()) });
    registry.register_fence_fn(&[SCHEME], |_url| async { Ok(MemoryFence::new()) });
}

/// A registry that knows [`SCHEME`] (and lease-core's own `memory://`).
pub fn registry() -> Registry {
    let mut r = Registry::new();
    register(&mut r);
    r
}
