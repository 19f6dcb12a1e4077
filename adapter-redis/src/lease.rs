//! [`RedisLease`]: a lease held on Redis.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use lease_core::adapter::LeaseTracker;
use lease_core::{Error, Lease, LeaseState, LeaseStatus, LostReason, Result};
use tokio::time::Instant;

use crate::core::{nothing_to_delete, px_millis, spawn_cleanup, Cleanup, Inner};
use crate::keys::LockKeys;

/// A lease from [`crate::RedisCoordinator`].
///
/// Renew and release are one script each and act only while the lock still carries this lease's
/// private nonce. Dropping the lease without releasing it releases it in the background on the
/// current tokio runtime (never blocking in `Drop`); without a runtime the lock expires at its TTL.
pub struct RedisLease {
    inner: Arc<Inner>,
    keys: Arc<LockKeys>,
    /// `v1|<nonce>|`: the prefix of our lock value, compared by every script. Never shown.
    head: Arc<str>,
    nonce: u128,
    tracker: LeaseTracker,
}

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The nonce is the lease's private proof of ownership: never shown.
        f.debug_struct("RedisLease")
            .field("tracker", &self.tracker)
            .finish_non_exhaustive()
    }
}

impl RedisLease {
    pub(crate) fn new(
        inner: Arc<Inner>,
        keys: Arc<LockKeys>,
        head: Arc<str>,
        nonce: u128,
        tracker: LeaseTracker,
    ) -> Self {
        RedisLease {
            inner,
            keys,
            head,
            nonce,
            tracker,
        }
    }

    /// Records why the lock is not ours (from a script's code) and returns the `Lost` error with
    /// the first recorded reason.
    fn lost(&self, code: i64) -> Error {
        self.tracker.lose(lost_reason(code))
    }
}

/// Why the lock is not ours, from a script's code.
fn lost_reason(code: i64) -> LostReason {
    match code {
        -2 => LostReason::Revoked,
        -1 => LostReason::Superseded,
        _ => LostReason::Expired,
    }
}

#[async_trait]
impl Lease for RedisLease {
    fn state(&self) -> &LeaseState {
        &self.tracker
    }

    async fn renew(&self) -> Result<Instant> {
        self.tracker.ensure_not_lost()?;
        let ttl_ms = px_millis(self.tracker.ttl()).to_string();
        let sent_at = Instant::now();
        let code = self
            .inner
            .renewals
            .renew(self.keys.clone(), &self.head, ttl_ms)
            .await?;
        match code {
            1 => self.tracker.renewed_from(sent_at),
            // Our own release's delete, if one runs: it decides.
            code => Err(self.tracker.lose_unless_releasing(lost_reason(code))),
        }
    }

    async fn release(&self) -> Result<()> {
        let status = self.tracker.status();
        if let Some(reason) = nothing_to_delete(status) {
            return Err(self.tracker.lost_error(reason));
        }
        // The lease ends with this request whatever its outcome: the holder monitor stops
        // judging it, so our own delete is never taken for an outside one. A release dropped
        // before it ends leaves the lease released and the delete to the background.
        self.inner.forget(self.nonce);
        self.tracker
            .release_with(self.release_lock(status), || self.clean_up())
            .await
    }
}

impl RedisLease {
    /// The body of `release`: the compare-and-delete, sent again after a dropped connection.
    /// `status` is the lease's status before it.
    async fn release_lock(&self, status: LeaseStatus) -> Result<()> {
        let (code, resent) = self.inner.release_by_head(&self.keys, &self.head).await;
        let code = match code {
            Ok(code) => code,
            Err(e) => {
                // Whether the delete applied is not known; the holder asked to stop, so the lease
                // is over for it either way. The delete is retried in the background (a no-op if
                // it applied), so the key does not stay locked until its TTL.
                self.tracker.mark_lost(LostReason::Released);
                self.clean_up();
                return Err(e);
            }
        };
        if let LeaseStatus::Lost(reason) = status {
            // Locally expired (or the keeper stopped): the delete above frees the key early if it
            // was still ours, but the lease was already gone for its holder.
            return Err(self.tracker.lost_error(reason));
        }
        // Sent again after its connection dropped, and the lock is not ours: the first send
        // deleted it, unless a force-release record names this lease (`-2`).
        if code == 1
            || (resent
                && self
                    .tracker
                    .released_by_earlier_send(code == -2, Instant::now()))
        {
            self.tracker.mark_lost(LostReason::Released);
            Ok(())
        } else {
            Err(self.lost(code))
        }
    }

    /// Deletes our lock in the background if it is still ours (compare-and-delete), retrying
    /// while the server cannot be reached.
    fn clean_up(&self) {
        spawn_cleanup(
            self.inner.clone(),
            self.keys.clone(),
            self.head.clone(),
            self.tracker.ttl(),
            Cleanup::Once,
        );
    }
}

impl Drop for RedisLease {
    fn drop(&mut self) {
        self.inner.forget(self.nonce);
        let status = self.tracker.status();
        if nothing_to_delete(status).is_some() {
            return;
        }
        // Expired locally or still held: delete it if it is still ours (compare-and-delete).
        self.tracker.mark_lost(LostReason::Released);
        self.clean_up();
    }
}
