//! The in-memory backend: a [`MemoryCoordinator`] and a [`MemoryFence`].
//!
//! Both live in one process and vanish with it. They are the embedded default (tests, single
//! process tools, the stale-holder demo) and the reference implementation every adapter is
//! compared with by the conformance suite.

mod coordinator;
mod fence;

pub use coordinator::{ForcedReleaseRecord, MemoryCoordinator, MemoryLease};
pub use fence::{FenceEvent, MemoryFence, DEFAULT_HISTORY_LIMIT};
