//! The [`Coordinator`] trait: a backend handle that grants leases.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::audit::AuditRecord;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::lease::Lease;
use crate::options::{Capabilities, ForceRelease, LeaseOptions, OwnerId};
use crate::token::Token;

/// What an operator may see about the current holder of a key.
///
/// It carries a safe owner label and operation name, never the lease's private nonce, a
/// credential or a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HolderInfo {
    /// The key.
    pub key: LockKey,
    /// The holder's owner label.
    pub owner: OwnerId,
    /// The holder's operation name, if it gave one.
    pub operation: Option<String>,
    /// The holder's fencing token.
    pub token: Token,
    /// When the holder acquired the key, by the wall clock of whoever recorded it (for display
    /// only: never compare it with another machine's clock to decide ownership).
    pub acquired_at: Option<SystemTime>,
    /// How long until the coordinator expires the lock, as it reported at inspection time.
    pub expires_in: Option<Duration>,
}

impl HolderInfo {
    /// A holder with the required fields; the optional ones start empty.
    pub fn new(key: LockKey, owner: OwnerId, token: Token) -> Self {
        HolderInfo {
            key,
            owner,
            operation: None,
            token,
            acquired_at: None,
            expires_in: None,
        }
    }

    /// Sets the operation name.
    pub fn with_operation(mut self, operation: Option<String>) -> Self {
        self.operation = operation;
        self
    }

    /// Sets the acquisition time.
    pub fn with_acquired_at(mut self, at: Option<SystemTime>) -> Self {
        self.acquired_at = at;
        self
    }

    /// Sets the time to expiry.
    pub fn with_expires_in(mut self, d: Option<Duration>) -> Self {
        self.expires_in = d;
        self
    }
}

/// A backend handle that grants leases on keys.
///
/// Object-safe: library code holds an `Arc<dyn Coordinator>` and never names the backend.
///
/// # Contract (every implementation; the conformance suite checks each point)
///
/// 1. At most one live lease per key at any coordinator state.
/// 2. Each successful acquisition of a key gets a token strictly greater than every token issued
///    before for that key, or the call fails closed with `TokenRegression`.
/// 3. Options are validated with [`LeaseOptions::validate`] against
///    [`capabilities`](Coordinator::capabilities) before anything is sent.
/// 4. An unreachable backend yields `Unavailable`, never a lease. A request whose outcome was not
///    seen is resolved (by re-reading or cleaning up) or reported as `OutcomeUnknown`, and never
///    leaves an orphaned lock past its TTL.
/// 5. Dropping an `acquire` future at any await point leaves no lock held beyond its TTL and no
///    waiter entry that blocks others.
#[async_trait]
pub trait Coordinator: Send + Sync + fmt::Debug {
    /// What this backend supports.
    fn capabilities(&self) -> &Capabilities;

    /// Acquires `key`, waiting up to `options.wait` for it to come free.
    ///
    /// # Behaviour
    /// - `Ok(lease)`: held, with a fresh token.
    /// - `Err(Timeout)`: the key stayed busy for the whole wait (also with a zero wait).
    /// - `Err(InvalidInput)`: nothing was sent.
    /// - `Err(Unavailable)`: retry later. `Err(OutcomeUnknown)`: re-read (`inspect`) first.
    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>>;

    /// Acquires `key` only if it is free now (ignores `options.wait`).
    ///
    /// # Behaviour
    /// - `Ok(lease)`: held. `Err(Held)`: someone else has it (or, on a FIFO backend, is queued
    ///   for it). Other errors as for [`acquire`](Coordinator::acquire).
    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>>;

    /// Who holds `key` now, if anyone. Read-only.
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>>;

    /// Removes the lock on `key` whoever holds it, recording `request`'s actor and reason (in
    /// the backend's audit trail, read with [`audit_trail`](Coordinator::audit_trail), and in a
    /// `warn` log event and the `fenced_forced_releases_total` counter). Returns the
    /// holder that was removed, or `None` if the key was free.
    ///
    /// The removed holder's lease reports `Lost(Revoked)` where the backend can tell it, and
    /// otherwise on its next renew. Its token stays below every later token, so a fence rejects
    /// its writes once the next holder has claimed.
    ///
    /// With [`ForceRelease::expect_token`] the holder is removed only if its token is exactly
    /// the expected one, compared on the server in the same atomic step as the delete; if the
    /// key is held under another token or is free, nothing is removed and the call returns
    /// `Err(HolderChanged { expected, found })` (`found` is `None` for a free key). Never
    /// `Ok(None)` then: `Ok(Some(holder))` is the expected holder, removed.
    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>>;

    /// The forced releases of `key`, newest first, at most `limit` (1 to
    /// [`AuditRecord::MAX_LIMIT`]; otherwise `Err(InvalidInput)` naming `limit`, and nothing is
    /// sent). Read-only. See [`AuditRecord`] for what is recorded on each backend.
    ///
    /// The default implementation checks `limit` and returns `Err(Unsupported)`; every adapter
    /// of this workspace implements it.
    async fn audit_trail(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
        let _ = key;
        AuditRecord::check_limit(limit)?;
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            what: "reading the audit trail".to_owned(),
        })
    }
}

macro_rules! forward_coordinator {
    ($ty:ty) => {
        #[async_trait]
        impl<C: Coordinator + ?Sized> Coordinator for $ty {
            fn capabilities(&self) -> &Capabilities {
                (**self).capabilities()
            }
            async fn acquire(
                &self,
                key: &LockKey,
                options: &LeaseOptions,
            ) -> Result<Box<dyn Lease>> {
                (**self).acquire(key, options).await
            }
            async fn try_acquire(
                &self,
                key: &LockKey,
                options: &LeaseOptions,
            ) -> Result<Box<dyn Lease>> {
                (**self).try_acquire(key, options).await
            }
            async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
                (**self).inspect(key).await
            }
            async fn force_release(
                &self,
                key: &LockKey,
                request: &ForceRelease,
            ) -> Result<Option<HolderInfo>> {
                (**self).force_release(key, request).await
            }
            async fn audit_trail(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
                (**self).audit_trail(key, limit).await
            }
        }
    };
}

forward_coordinator!(Arc<C>);
forward_coordinator!(Box<C>);
