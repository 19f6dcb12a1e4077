//! Multi-lock: several keys, one global order, one bounded wait.

use std::fmt;

use futures::future::select_all;
use tokio::time::Instant;

use crate::coordinator::Coordinator;
use crate::error::{Error, LostReason, Result};
use crate::key::LockKey;
use crate::lease::{Lease, LeaseStatus};
use crate::options::LeaseOptions;
use crate::token::Token;

/// Leases on several keys, held together. Keys are in their global (byte) order.
pub struct MultiLease {
    leases: Vec<Box<dyn Lease>>,
}

impl fmt::Debug for MultiLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.leases.iter().map(|l| (l.key(), l.token())))
            .finish()
    }
}

/// Acquires every key in `keys`, in one global order (sorted by bytes, duplicates removed), so
/// that two callers naming the same keys in different orders cannot deadlock.
///
/// # Behaviour
/// - `options.wait` bounds the *total* wait: each key gets what is left of it, and never more
///   than the leases already taken stay valid (they are not renewed while the call waits): a
///   wait that reaches the earliest of their validities ends in `Err(Timeout)`.
/// - Every lease in an `Ok` was [`Held`](LeaseStatus::Held) when the call returned. A lease
///   already taken that is lost while the call waits for a later key (revoked, superseded) ends
///   the call at once with its `Err(Lost)`, the wait for the later key abandoned; one whose
///   validity runs out ends the wait at that bound (`Err(Timeout)`, above); one in doubt at the
///   end (its connection broken) ends it with a retryable `Err(Unavailable)`.
/// - If a key cannot be had (timeout or any error), every lease already taken is released (in
///   reverse order) before the error is returned; nothing stays held.
/// - An empty `keys` is invalid input.
/// - Not reentrant: a key this process already holds is waited for like any other, so it ends in
///   `Err(Timeout)` (see [`Coordinator`]).
///
/// # Cancel safety
///
/// Dropping the future drops the leases already taken (each is released best-effort, without
/// blocking, and expires at its TTL in any case) and the acquire in flight, with the effects of a
/// dropped [`Coordinator::acquire`]: a lock granted just before the drop is deleted in the
/// background and expires at its TTL. Nothing stays held past a TTL; nothing to do.
pub async fn acquire_many(
    coordinator: &dyn Coordinator,
    keys: &[LockKey],
    options: &LeaseOptions,
) -> Result<MultiLease> {
    if keys.is_empty() {
        return Err(crate::InvalidInput::Empty { what: "key list" }.into());
    }
    options.validate(coordinator.capabilities())?;
    let mut ordered: Vec<&LockKey> = keys.iter().collect();
    ordered.sort();
    ordered.dedup();
    let start = Instant::now();
    let deadline = start + options.wait_value();
    let mut held: Vec<Box<dyn Lease>> = Vec::with_capacity(ordered.len());
    for key in ordered {
        let earliest_end = held.iter().map(|l| l.valid_until()).min();
        let until = earliest_end.map_or(deadline, |end| end.min(deadline));
        let left = until.saturating_duration_since(Instant::now());
        let bounded = options.clone().wait(left);
        // In a block of its own, so that an acquire abandoned below is dropped (its waiter
        // entry, its local turn and any lock granted meanwhile given up) before the releases:
        // kept but unpolled while they run, it would hold up every other caller of its key.
        let got = {
            let acquire = coordinator.acquire(key, &bounded);
            tokio::pin!(acquire);
            // A lease taken earlier lost while this one is awaited ends the wait (dropping an
            // acquire is cancel-safe: a lock granted meanwhile is deleted in the background).
            // One whose validity ran out is the wait's own bound (`until`), which the acquire
            // reports as its timeout.
            tokio::select! {
                biased;
                got = &mut acquire => got,
                (i, reason) = first_lost(&held) => match reason {
                    LostReason::Expired => acquire.await,
                    reason => Err(held[i].state().lost_error(reason)),
                },
            }
        };
        let got = got.and_then(|lease| {
            held.push(lease);
            held.iter().try_for_each(|l| l.state().ensure_not_lost())
        });
        // A lease already taken whose validity ran out before this key was granted (a grant
        // answered after its wait, decision 0036) is the wait reaching its bound, as above.
        let got = got.map_err(|e| match e {
            Error::Lost {
                reason: LostReason::Expired,
                ..
            } => Error::Timeout {
                key: key.to_string(),
                waited: start.elapsed(),
            },
            e => e,
        });
        if let Err(e) = got {
            release_all(held).await;
            return Err(e);
        }
    }
    let multi = MultiLease { leases: held };
    if let Err(e) = multi.ensure_held() {
        release_all(multi.leases).await;
        return Err(e);
    }
    Ok(multi)
}

/// Resolves when one of `leases` is lost, with its index and the reason; never, for none.
async fn first_lost(leases: &[Box<dyn Lease>]) -> (usize, LostReason) {
    if leases.is_empty() {
        return std::future::pending().await;
    }
    let waits = leases.iter().enumerate().map(|(i, l)| {
        let mut s = l.lost();
        Box::pin(async move { (i, s.wait().await) })
    });
    select_all(waits).await.0
}

async fn release_all(leases: Vec<Box<dyn Lease>>) -> Option<Error> {
    let mut first = None;
    for lease in leases.into_iter().rev() {
        if let Err(e) = lease.release().await {
            tracing::warn!(key = %lease.key(), error = %e, "multi-lock: release failed");
            first.get_or_insert(e);
        }
    }
    first
}

impl MultiLease {
    /// The leases, in key order.
    pub fn leases(&self) -> &[Box<dyn Lease>] {
        &self.leases
    }

    /// Each key with its token, in key order.
    pub fn tokens(&self) -> Vec<(LockKey, Token)> {
        self.leases
            .iter()
            .map(|l| (l.key().clone(), l.token()))
            .collect()
    }

    /// The status of the set: the first lost lease's (in key order) if one is lost, else
    /// `InDoubt` if one is in doubt, else `Held`. One key lost does not end the others: release
    /// the set.
    pub fn status(&self) -> LeaseStatus {
        let mut status = LeaseStatus::Held;
        for l in &self.leases {
            match l.status() {
                lost @ LeaseStatus::Lost(_) => return lost,
                LeaseStatus::InDoubt => status = LeaseStatus::InDoubt,
                LeaseStatus::Held => {}
            }
        }
        status
    }

    /// `Ok` only while every lease is held: the first lost lease's `Err(Lost)` (in key order),
    /// else a retryable `Err(Unavailable)` for one in doubt (see [`Lease::ensure_held`]).
    pub fn ensure_held(&self) -> Result<()> {
        self.leases
            .iter()
            .try_for_each(|l| l.state().ensure_not_lost())?;
        self.leases.iter().try_for_each(|l| l.ensure_held())
    }

    /// The earliest local validity among the leases. Like [`Lease::valid_until`], it says
    /// nothing of a lease lost before it: read [`status`](Self::status).
    pub fn valid_until(&self) -> Instant {
        self.leases
            .iter()
            .map(|l| l.valid_until())
            .min()
            .expect("a multi-lease is never empty")
    }

    /// Renews every lease; the first error is returned (the others are still attempted).
    ///
    /// # Cancel safety
    ///
    /// As for [`Lease::renew`], for the leases reached before the drop: a renewal may have been
    /// applied on the server, but local validity moves only on a confirmed one; renew again.
    pub async fn renew(&self) -> Result<Instant> {
        let mut first = None;
        for l in &self.leases {
            if let Err(e) = l.renew().await {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(self.valid_until()),
        }
    }

    /// Resolves when any of the leases is lost, with its key and the reason. Cancel-safe (local).
    pub async fn lost(&self) -> (LockKey, LostReason) {
        let (i, reason) = first_lost(&self.leases).await;
        (self.leases[i].key().clone(), reason)
    }

    /// Releases every lease (reverse order). All are attempted; the first error is returned.
    ///
    /// # Cancel safety
    ///
    /// The leases not reached yet are dropped, so released best-effort; the one in flight may or
    /// may not have been deleted. All expire at their TTL in any case.
    pub async fn release(self) -> Result<()> {
        match release_all(self.leases).await {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
