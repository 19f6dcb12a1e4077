//! The state a ZooKeeper coordinator shares with the lock recipe (`acquire.rs`) and the operator
//! actions (`operator.rs`), so that they import it from here, not from `coordinator.rs`.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use futures::future::{BoxFuture, Shared};

use lease_core::adapter::{LocalWaiters, TokenAdmission};
use lease_core::{Capabilities, OwnerId};

use crate::config::ZkConfig;
use crate::session::Session;

/// What a coordinator shares with its recipe and operator actions.
pub(crate) struct Inner {
    pub(crate) config: ZkConfig,
    pub(crate) caps: Capabilities,
    /// The turns of this coordinator's waiting acquires.
    pub(crate) local_waiters: LocalWaiters,
    /// Locked only to look up the session or start opening one, never across a request.
    pub(crate) session: std::sync::Mutex<SessionSlot>,
    pub(crate) client_id: u64,
    pub(crate) attempts: AtomicU64,
    pub(crate) owner: OwnerId,
    /// Admits grants: in range, above the floor and above every token this process was granted
    /// for the lock on this ensemble and base path.
    pub(crate) tokens: TokenAdmission,
}

/// The opening of a session, shared by every caller that asks while it is under way.
pub(crate) type Opening =
    Shared<BoxFuture<'static, std::result::Result<Arc<Session>, Arc<lease_core::Error>>>>;

/// The coordinator's session: the one it has, or the opening of a new one after that ended,
/// which every caller asking meanwhile awaits (one attempt, its failure reaching them all at
/// once, each within one connect timeout of asking).
pub(crate) enum SessionSlot {
    /// The session it connected or was given.
    Open(Arc<Session>),
    /// A new session, opened or being opened.
    Opening(Opening),
}

impl SessionSlot {
    /// The session, when one is open and not terminated.
    pub(crate) fn open(&self) -> Option<&Arc<Session>> {
        let session = match self {
            SessionSlot::Open(s) => s,
            SessionSlot::Opening(o) => o.peek()?.as_ref().ok()?,
        };
        (!session.is_terminated()).then_some(session)
    }

    /// The opening under way, if one is.
    pub(crate) fn opening(&self) -> Option<&Opening> {
        match self {
            SessionSlot::Opening(o) if o.peek().is_none() => Some(o),
            _ => None,
        }
    }
}
