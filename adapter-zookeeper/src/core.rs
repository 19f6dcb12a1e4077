//! The state a ZooKeeper coordinator shares with the lock recipe (`acquire.rs`) and the operator
//! actions (`operator.rs`), so that they import it from here, not from `coordinator.rs`.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use lease_core::adapter::{Cleanups, LocalWaiters, SharedOpening, TokenAdmission};
use lease_core::{Capabilities, OwnerId};

use crate::config::ZkConfig;
use crate::session::Session;

/// What a coordinator shares with its recipe and operator actions.
pub(crate) struct Inner {
    pub(crate) config: ZkConfig,
    /// The chroot every session of the coordinator works in: `/` (none), or that of the
    /// application's client it was built on, which the sessions it opens later keep.
    pub(crate) chroot: String,
    pub(crate) caps: Capabilities,
    /// The turns of this coordinator's waiting acquires.
    pub(crate) local_waiters: LocalWaiters,
    /// The session it connected or was given, or the opening of a new one after that ended,
    /// which every caller asking meanwhile awaits (one attempt, its failure reaching them all
    /// at once, each within one connect timeout of asking).
    pub(crate) session: SharedOpening<Arc<Session>>,
    pub(crate) client_id: u64,
    pub(crate) attempts: AtomicU64,
    pub(crate) owner: OwnerId,
    /// Admits grants: in range, above the floor and above every token this process was granted
    /// for the lock on this ensemble and base path.
    pub(crate) tokens: TokenAdmission,
    /// The clean-ups under way on any of its sessions, which `settle` waits for.
    pub(crate) cleanups: Cleanups,
}
