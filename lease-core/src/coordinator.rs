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
///
/// # Not reentrant
///
/// A second acquisition of a key this process already holds, even through the same handle and
/// from the same task, is a contender like any other: `try_acquire` returns `Err(Held)` and
/// `acquire` waits until the key is free or its wait bound passes (`Err(Timeout)`). There is no
/// hold count; pass the lease down instead of acquiring again.
///
/// # Cancel safety
///
/// Each method below says what a dropped future may have done on the server; the crate docs have
/// the same in one table.
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
    /// - A key this process already holds is waited for like any other (not reentrant).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future at any await point leaves no waiter entry behind. The lock may have
    /// been granted on the server just before the drop (a token used up): no one holds that
    /// lease, the adapter deletes the lock in the background (compare-and-delete) and in any
    /// case it expires at its TTL. Nothing to do; a new `acquire` may have to wait for that
    /// cleanup, so give it a wait of at least one TTL.
    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>>;

    /// Acquires `key` only if it is free now (ignores `options.wait`).
    ///
    /// # Behaviour
    /// - `Ok(lease)`: held. `Err(Held)`: someone else has it (or, on a FIFO backend, is queued
    ///   for it), this process included (not reentrant). Other errors as for
    ///   [`acquire`](Coordinator::acquire).
    ///
    /// # Cancel safety
    ///
    /// As for [`acquire`](Coordinator::acquire): a lock granted just before the drop is deleted
    /// in the background and expires at its TTL in any case; nobody holds it.
    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>>;

    /// Who holds `key` now, if anyone. Read-only.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: read-only, a dropped future changed nothing; call again.
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>>;

    /// Removes the lock on `key` whoever holds it, recording `request`'s actor and reason (in
    /// the backend's audit trail, read with [`audit_trail`](Coordinator::audit_trail), and in a
    /// `warn` log event, and in the `fenced_forced_releases_total` counter when a holder was
    /// removed). Returns the holder that was removed, or `None` if the key was free (logged, not
    /// counted: nothing was removed).
    ///
    /// One removal is not `Ok`: on Redis, a value something else wrote under a key for which no
    /// token was ever issued has no holder to report; it is removed, audited, logged and
    /// counted, and the call returns `Err(Misconfigured)` saying so (the key is free now; see
    /// [`ForceRelease::removed_without_holder`]).
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
    ///
    /// # Cancel safety
    ///
    /// Not cancel-safe: a dropped future may or may not have removed the holder, and may or may
    /// not have written the audit record. Look with [`inspect`](Coordinator::inspect) and
    /// [`audit_trail`](Coordinator::audit_trail); retry with [`ForceRelease::expect_token`] set
    /// to the token you meant to remove, so that a holder that arrived since is never removed.
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
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: read-only, a dropped future changed nothing; call again.
    async fn audit_trail(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
        let _ = key;
        AuditRecord::check_limit(limit)?;
        Err(Error::Unsupported {
            backend: self.capabilities().backend,
            what: "reading the audit trail".to_owned(),
        })
    }

    /// Waits until the clean-ups this coordinator has begun in the background are done: the
    /// waiter entry or lock of every acquire given up (its future dropped, or ended in an error
    /// while a request may still have applied) deleted, and the lock of every lease dropped
    /// without a confirmed release deleted if still its own. Clean-ups begun while it waits are
    /// waited for too; a lease still held, or an acquire still waiting, is not a clean-up.
    ///
    /// Call it before the process exits, after dropping what it gives up: a tokio runtime that
    /// shuts down drops unfinished tasks, and what they would have deleted stays until its TTL
    /// or session ends, in the way of every waiter behind it.
    ///
    /// Each clean-up retries until it settles or the server has removed what it cleans up
    /// anyway. On Redis that is at most the lock's TTL (and a second). Where the key lives on a
    /// session (etcd, ZooKeeper, Consul), it is until the delete gets through or the session is
    /// known to have ended, and this coordinator's own heartbeat keeps its session alive. With
    /// the server unreachable, or refusing the delete, that has no bound: bound the wait with a
    /// timeout.
    ///
    /// The default implementation returns at once, for an adapter that starts nothing in the
    /// background (the in-memory backend cleans up as it goes); every adapter of this workspace
    /// with a server implements it.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: it sends nothing; a dropped future leaves the clean-ups running.
    async fn settle(&self) {}
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
            async fn settle(&self) {
                (**self).settle().await
            }
        }
    };
}

forward_coordinator!(Arc<C>);
forward_coordinator!(Box<C>);

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use crate::memory::MemoryCoordinator;
    use crate::{acquire_many, Coordinator, Error, Lease, LeaseOptions, LockKey};

    /// Not reentrant: the same handle, from the same task, is one more contender for its own key.
    #[tokio::test(start_paused = true)]
    async fn a_second_acquire_of_a_held_key_by_the_same_handle_waits_like_any_contender() {
        let coord = MemoryCoordinator::new();
        let key = LockKey::new("reentrant/no").unwrap();
        let options = LeaseOptions::new(Duration::from_secs(60));
        let held = coord.try_acquire(&key, &options).await.unwrap();
        assert!(matches!(
            coord.try_acquire(&key, &options).await,
            Err(Error::Held { .. })
        ));
        let start = Instant::now();
        let wait = Duration::from_secs(2);
        assert!(matches!(
            coord.acquire(&key, &options.clone().wait(wait)).await,
            Err(Error::Timeout { .. })
        ));
        assert_eq!(start.elapsed(), wait);
        assert!(matches!(
            acquire_many(
                &coord,
                std::slice::from_ref(&key),
                &options.clone().wait(wait)
            )
            .await,
            Err(Error::Timeout { .. })
        ));
        // The first lease is untouched, and once released the key is free again.
        assert!(held.ensure_held().is_ok());
        held.release().await.unwrap();
        let again = coord.try_acquire(&key, &options).await.unwrap();
        assert!(again.token() > held.token());
    }
}
