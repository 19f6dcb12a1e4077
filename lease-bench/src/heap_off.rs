//! The heap scenario in a build without the `count-allocations` feature: it cannot measure (the
//! global allocator does not count), so it says how to run it. See `heap.rs`.

use std::sync::Arc;
use std::time::Duration;

use fenced::Coordinator;

use crate::locks::BenchResult;

/// Whether this build counts allocations.
pub(crate) const COUNTING: bool = false;

/// Never measured in this build (see [`COUNTING`]).
#[derive(Debug, Clone)]
pub(crate) struct HeapFigures;

/// Not available in this build.
pub(crate) async fn per_kept_lease(
    _coordinator: Arc<dyn Coordinator>,
    _prefix: &str,
    _n: usize,
    _ttl: Duration,
    _quick: bool,
) -> BenchResult<HeapFigures> {
    Err("built without the count-allocations feature".into())
}

/// The section's heading and how to get the figures.
pub(crate) fn markdown(_rows: &[(String, HeapFigures)]) -> String {
    "\n## Heap per kept lease\n\nNot measured: this build does not count allocations (the \
     counting allocator would slow every other scenario). Run `cargo run --release -p \
     lease-bench --features count-allocations -- --scenarios heap`.\n"
        .to_owned()
}
