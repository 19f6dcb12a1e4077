//! The state an etcd coordinator shares with its leases and background tasks (so that
//! `lease.rs` and the tasks import it from here, not from `coordinator.rs`).

use etcd_client::Client;
use lease_core::adapter::DelayedStarts;

use crate::coalesce::Txns;
use crate::config::EtcdConfig;
use crate::confirm::Confirmer;
use crate::session::Cleaner;
use crate::watch::Watcher;

/// What a coordinator shares with its leases.
pub(crate) struct Handle {
    pub(crate) client: Client,
    pub(crate) config: EtcdConfig,
    pub(crate) cleaner: Cleaner,
    /// The coordinator's one watch stream (guardians and waiters).
    pub(crate) watcher: Watcher,
    /// Batched reads of held keys (renewals).
    pub(crate) confirmer: Confirmer,
    /// The lock transactions (acquire, enqueue, release), sent together under load.
    pub(crate) txns: Txns,
    /// The guardians of leases still held a moment after their grant (`lease.rs`).
    pub(crate) guardians: DelayedStarts,
}
