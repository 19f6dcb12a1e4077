//! A lease's lost signal as a [`CancellationToken`], for code that is already cancelled that way.

use tokio_util::sync::CancellationToken;

use crate::lease::{Lease, LostSignal};

/// A [`CancellationToken`] cancelled when `lease` is lost: expired, revoked, superseded, its
/// session ended, its keeper stopped, released, or the lease object dropped. The same moment
/// [`LostSignal::wait`] resolves; an in-doubt lease does not cancel it (use
/// [`LostSignal::uncertain`] to stop starting new work then).
///
/// A token made for a lease that is already lost is returned already cancelled. Cancelling the
/// token yourself does nothing to the lease (it is not released); it only ends the small task
/// that watches the lease for this token. Each call makes an independent token: cancelling one
/// leaves the others alone. Make child tokens with [`CancellationToken::child_token`] to cancel
/// a tree of work when the lease goes.
///
/// The token tells work to stop; it cannot stop a write already on its way to storage. Carry the
/// lease's token on every write ([`crate::Fence`]) so that storage rejects what a stale holder
/// still sends.
///
/// # Panics
///
/// If the lease is not lost yet, a task is spawned on the current Tokio runtime: like
/// [`tokio::spawn`], this panics outside a runtime.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use lease_core::memory::MemoryCoordinator;
/// use lease_core::{lost_token, Coordinator, Lease, LeaseOptions};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> lease_core::Result<()> {
/// let coordinator = MemoryCoordinator::new();
/// let lease = coordinator
///     .try_acquire(&"jobs/nightly".parse()?, &LeaseOptions::new(Duration::from_secs(10)))
///     .await?;
/// let cancel = lost_token(&*lease);
/// let worker = tokio::spawn({
///     let cancel = cancel.clone();
///     async move {
///         tokio::select! {
///             _ = cancel.cancelled() => "stopped: the lease is gone",
///             _ = tokio::time::sleep(Duration::from_secs(3600)) => "finished",
///         }
///     }
/// });
/// lease.release().await?;
/// assert_eq!(worker.await.unwrap(), "stopped: the lease is gone");
/// assert!(cancel.is_cancelled());
/// # Ok(())
/// # }
/// ```
pub fn lost_token<L: Lease + ?Sized>(lease: &L) -> CancellationToken {
    signal_token(lease.lost())
}

/// A [`CancellationToken`] cancelled when `signal` fires; see [`lost_token`]. Useful where only
/// the signal was passed along (for example [`crate::Kept::lost`]).
///
/// # Panics
///
/// Outside a Tokio runtime, if the lease is not lost yet (see [`lost_token`]).
pub fn signal_token(mut signal: LostSignal) -> CancellationToken {
    let token = CancellationToken::new();
    if signal.is_lost() {
        token.cancel();
        return token;
    }
    let watched = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            // Cancelled by its user: nothing left to do.
            _ = watched.cancelled() => {}
            _ = signal.wait() => watched.cancel(),
        }
    });
    token
}

/// [`lost_token`] as a method, on every [`Lease`] and on a [`LostSignal`].
pub trait LostTokenExt {
    /// A [`CancellationToken`] cancelled when the lease is lost; see [`lost_token`].
    fn lost_token(&self) -> CancellationToken;
}

impl<L: Lease + ?Sized> LostTokenExt for L {
    fn lost_token(&self) -> CancellationToken {
        lost_token(self)
    }
}

impl LostTokenExt for LostSignal {
    fn lost_token(&self) -> CancellationToken {
        signal_token(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::time::Instant;

    use super::*;
    use crate::memory::MemoryCoordinator;
    use crate::{keep, Coordinator, ForceRelease, KeeperOptions, LeaseOptions, LockKey};

    fn key(s: &str) -> LockKey {
        LockKey::new(s).unwrap()
    }

    fn exact(ttl: Duration) -> LeaseOptions {
        LeaseOptions::new(ttl).drift_margin(Duration::ZERO)
    }

    /// Waits for `token` (paused time advances only when every task is idle, so a bounded wait
    /// here fails only if nothing would ever cancel it).
    async fn cancelled_within(token: &CancellationToken, bound: Duration) {
        tokio::time::timeout(bound, token.cancelled())
            .await
            .expect("the token was not cancelled in time");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_cancels_its_token() {
        let coord = MemoryCoordinator::new();
        let lease = coord
            .try_acquire(&key("cancel/lost"), &exact(Duration::from_secs(60)))
            .await
            .unwrap();
        let token = lost_token(&*lease);
        let child = token.child_token();
        assert!(!token.is_cancelled());
        let start = Instant::now();
        coord
            .force_release(
                &key("cancel/lost"),
                &ForceRelease::new("op", "test").unwrap(),
            )
            .await
            .unwrap();
        cancelled_within(&token, Duration::from_secs(1)).await;
        assert_eq!(Instant::now(), start, "cancelled at the loss, not later");
        assert!(child.is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_released_lease_cancels_its_token() {
        let coord = MemoryCoordinator::new();
        let lease = coord
            .try_acquire(&key("cancel/released"), &exact(Duration::from_secs(60)))
            .await
            .unwrap();
        let token = lease.lost_token();
        let start = Instant::now();
        lease.release().await.unwrap();
        cancelled_within(&token, Duration::from_secs(1)).await;
        assert_eq!(Instant::now(), start);
    }

    #[tokio::test(start_paused = true)]
    async fn an_expiring_or_dropped_lease_cancels_its_token() {
        let coord = MemoryCoordinator::new();
        let expiring = coord
            .try_acquire(&key("cancel/expiring"), &exact(Duration::from_secs(5)))
            .await
            .unwrap();
        let token = lost_token(&*expiring);
        let start = Instant::now();
        cancelled_within(&token, Duration::from_secs(10)).await;
        assert_eq!(Instant::now() - start, Duration::from_secs(5));

        let dropped = coord
            .try_acquire(&key("cancel/dropped"), &exact(Duration::from_secs(60)))
            .await
            .unwrap();
        let token = dropped.lost().lost_token();
        drop(dropped);
        cancelled_within(&token, Duration::from_secs(1)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_token_made_after_the_loss_is_already_cancelled() {
        let coord = MemoryCoordinator::new();
        let lease = coord
            .try_acquire(&key("cancel/late"), &exact(Duration::from_secs(60)))
            .await
            .unwrap();
        lease.release().await.unwrap();
        // No await in between: cancelled before any task could run.
        assert!(lost_token(&*lease).is_cancelled());
        assert!(signal_token(lease.lost()).is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn a_kept_lease_cancels_when_its_keeper_gives_up_and_cancelling_the_token_keeps_the_lease(
    ) {
        let coord = MemoryCoordinator::new();
        let lease = coord
            .try_acquire(&key("cancel/kept"), &exact(Duration::from_secs(3)))
            .await
            .unwrap();
        let kept = keep(lease, KeeperOptions::new().require_progress(true)).unwrap();
        // Cancelled by its user: the lease stays held.
        let mine = lost_token(kept.lease());
        mine.cancel();
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(kept.lease().ensure_held().is_ok());
        // No progress reported: the keeper stops renewing and the lease runs out.
        let token = kept.lost().lost_token();
        cancelled_within(&token, Duration::from_secs(10)).await;
        assert!(kept.lease().ensure_held().is_err());
    }

    #[test]
    fn a_token_for_a_lost_lease_needs_no_runtime() {
        let signal = {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(async {
                let coord = MemoryCoordinator::new();
                let lease = coord
                    .try_acquire(&key("cancel/no-rt"), &exact(Duration::from_secs(60)))
                    .await
                    .unwrap();
                lease.release().await.unwrap();
                lease.lost()
            })
        };
        assert!(signal_token(signal).is_cancelled());
    }
}
