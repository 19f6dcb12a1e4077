//! The state an etcd coordinator shares with its acquire recipe, operator actions, leases and
//! background tasks (so that they import it from here, not from `coordinator.rs`).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use etcd_client::Client;
use lease_core::adapter::{DelayedStarts, Op, SharedOpening, StoredAudit, TokenAdmission};
use lease_core::{Capabilities, OwnerId, Result};

use crate::coalesce::Txns;
use crate::config::EtcdConfig;
use crate::confirm::Confirmer;
use crate::error::{retry_unapplied, BACKEND};
use crate::keys::Slots;
use crate::session::{Cleaner, Session};
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

impl Handle {
    /// The audit key's mod revision (0 when it does not exist) and its records, oldest first.
    pub(crate) async fn read_audit(
        &self,
        audit_key: &str,
        operation: &'static str,
    ) -> Result<(i64, Vec<StoredAudit>)> {
        let client = &self.client;
        let mut got = retry_unapplied(self.config.request_timeout(), || {
            let mut c = client.clone();
            async move { c.get(audit_key, None).await }
        })
        .await
        .map_err(|f| f.into_error(Op::read(operation)))?;
        Ok(match got.take_kvs().into_iter().next() {
            Some(kv) => (
                kv.mod_revision(),
                StoredAudit::parse_trail(kv.value())
                    .ok_or_else(|| StoredAudit::unreadable(BACKEND, audit_key))?,
            ),
            None => (0, Vec::new()),
        })
    }
}

/// What a coordinator shares with its acquire recipe and operator actions.
pub(crate) struct Inner {
    pub(crate) handle: Arc<Handle>,
    pub(crate) caps: Capabilities,
    pub(crate) owner: OwnerId,
    /// One session per granted TTL, in whole seconds, or its grant under way, which every
    /// caller asking for that TTL meanwhile awaits (the map is locked only to look one up).
    pub(crate) sessions: std::sync::Mutex<HashMap<i64, Arc<SharedOpening<Arc<Session>>>>>,
    /// Numbers each acquisition attempt, so that every attempt has its own abandonment marker.
    pub(crate) attempts: AtomicU64,
    /// The slots of holders' and waiters' own key names ([`Slots`]).
    pub(crate) slots: Arc<Slots>,
    /// Admits grants: in range, above the floor and above every token granted for the lock in
    /// this process on this cluster and key prefix.
    pub(crate) tokens: TokenAdmission,
}
