//! Everyday helpers over the traits: [`with_lease`] (acquire, keep, run, release) and
//! [`IntoLockKey`] (a key as `&str` or [`LockKey`]).
//!
//! ```
//! use std::time::Duration;
//! use lease_core::memory::MemoryCoordinator;
//! use lease_core::{with_lease, Coordinator, LeaseOptions};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> lease_core::Result<()> {
//! let coord = MemoryCoordinator::new();
//! let options = LeaseOptions::new(Duration::from_secs(10)).wait(Duration::from_secs(1));
//! // The key is checked like `LockKey::new` before anything is sent.
//! let token = with_lease(&coord, "jobs/nightly", &options, |lease| async move {
//!     // Carry `lease.token()` on every protected write; check before each piece of work.
//!     lease.check()?;
//!     Ok::<_, lease_core::Error>(lease.token())
//! })
//! .await??;
//! assert!(token.get() > 0);
//! // Released afterwards: the key is free again.
//! assert!(coord.inspect(&"jobs/nightly".parse()?).await?.is_none());
//! # Ok(())
//! # }
//! ```

use std::future::Future;
use std::time::Duration;

use crate::coordinator::Coordinator;
use crate::error::{Error, InvalidInput, Result};
use crate::keeper::{keep, KeeperOptions, Progress};
use crate::key::LockKey;
use crate::lease::{LeaseStatus, LostSignal};
use crate::options::LeaseOptions;
use crate::section::{bounded_with, SectionGuard, SectionOptions};
use crate::token::Token;

/// A lock key given as a [`LockKey`] or as text, validated at the call.
///
/// Text (`&str`, `String`, `&String`) is checked by [`LockKey::new`], so a bad key fails with
/// the same typed [`InvalidInput`] before anything is sent to a backend. A [`LockKey`] (owned or
/// borrowed) is already valid and converts for free.
///
/// A small trait rather than `TryInto<LockKey>`: `LockKey`'s own `TryInto<LockKey>` has the
/// error `Infallible`, so one bound could not accept both forms with one error type.
pub trait IntoLockKey {
    /// The validated key, or the reason the text is not one.
    fn into_lock_key(self) -> Result<LockKey, InvalidInput>;
}

impl IntoLockKey for LockKey {
    fn into_lock_key(self) -> Result<LockKey, InvalidInput> {
        Ok(self)
    }
}

impl IntoLockKey for &LockKey {
    fn into_lock_key(self) -> Result<LockKey, InvalidInput> {
        Ok(self.clone())
    }
}

impl IntoLockKey for &str {
    fn into_lock_key(self) -> Result<LockKey, InvalidInput> {
        LockKey::new(self)
    }
}

impl IntoLockKey for String {
    fn into_lock_key(self) -> Result<LockKey, InvalidInput> {
        LockKey::new(self)
    }
}

impl IntoLockKey for &String {
    fn into_lock_key(self) -> Result<LockKey, InvalidInput> {
        LockKey::new(self.as_str())
    }
}

/// What the body of [`with_lease`] gets: the lease's key and token, a check that the lease is
/// still certainly held, its lost signal and the keeper's progress handle. Cheap to clone and
/// `'static`, so the body may hand it to spawned tasks.
#[derive(Debug, Clone)]
pub struct LeaseScope {
    key: LockKey,
    token: Token,
    ttl: Duration,
    guard: SectionGuard,
    lost: LostSignal,
    progress: Progress,
}

impl LeaseScope {
    /// The key held.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The fencing token of this acquisition: carry it on every protected write.
    pub fn token(&self) -> Token {
        self.token
    }

    /// The TTL the backend granted.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// `Ok` while the lease is held with more than the section's margin left; otherwise
    /// `Err(Lost)`, or a retryable `Err(Unavailable)` while it is in doubt
    /// ([`SectionGuard::check`]): call it before starting each piece of sub-work.
    pub fn check(&self) -> Result<()> {
        self.guard.check()
    }

    /// The lease's status now.
    pub fn status(&self) -> LeaseStatus {
        self.lost.status()
    }

    /// A signal that fires when the lease is lost (for sub-tasks that must stop with it).
    pub fn lost(&self) -> LostSignal {
        self.lost.clone()
    }

    /// The keeper's progress handle. [`with_lease`] does not require progress, so ticking it is
    /// optional; it is here for bodies shared with [`KeeperOptions::require_progress`] code.
    pub fn progress(&self) -> Progress {
        self.progress.clone()
    }
}

/// Acquires `key`, keeps the lease renewed, runs `body` under it as a bounded section, and
/// releases it. Returns the body's value.
///
/// # Behaviour
///
/// - The key is validated first ([`IntoLockKey`]), then the options (as every acquire does),
///   and then that the section's margin (a tenth of the TTL) leaves a validity window after the
///   drift margin: a bad value is `Err(InvalidInput)` naming it, and nothing is sent. The check
///   uses the TTL asked for, on every backend alike, even where the backend would round it up
///   (etcd, to whole seconds) and leave a window.
/// - Acquisition waits up to `options.wait` ([`Coordinator::acquire`]): `Err(Timeout)` if the key
///   stayed busy, `Err(Unavailable)` / `Err(OutcomeUnknown)` as the backend reports them. The
///   body does not run then.
/// - While the body runs, a keeper ([`keep`], default [`KeeperOptions`]) renews the lease.
/// - The body runs as [`bounded_with`] runs work, with the default [`SectionOptions`]: it is
///   cancelled (its future dropped) as soon as the lease is lost or its validity, less a tenth of
///   the TTL, runs out without a confirmed renewal, and the call returns `Err(Lost)`. A body that
///   finishes after its lease was lost has its value discarded: `Err(Lost)`, never a silent
///   success.
/// - Then the lease is released (compare-and-delete). A release that fails after the body
///   finished under the lease (the backend unreachable: the lock expires at its TTL) is logged
///   at `warn` and the body's value is still returned: the work was done while held.
/// - Not reentrant: a body that calls `with_lease` on the same key waits for itself until its
///   own wait bound passes (`Err(Timeout)`), like every lease of this workspace.
///
/// The body's own errors are its value: return a `Result` from it and get
/// `Result<Result<T, E>>` back (`.await??` with compatible error types).
///
/// # Cancel safety
///
/// Dropping the returned future drops the body and the keeper; the lease is released
/// best-effort without blocking (as any dropped lease is) and in any case expires at its TTL.
/// Dropped while acquiring, it has the effects of a dropped [`Coordinator::acquire`]. Whatever
/// the body already sent is its own business: fence its writes, and read the fence to learn
/// what was written.
pub async fn with_lease<C, K, B, F, T>(
    coord: &C,
    key: K,
    options: &LeaseOptions,
    body: B,
) -> Result<T>
where
    C: Coordinator + ?Sized,
    K: IntoLockKey,
    B: FnOnce(LeaseScope) -> F,
    F: Future<Output = T>,
{
    let key = key.into_lock_key()?;
    // The section's margin is checked against the TTL asked for before anything is sent, so a
    // body that could never run costs no lock and no token (a TTL the backend rounds up is
    // checked again, against the granted TTL, by `bounded_with`).
    options.validate(coord.capabilities())?;
    SectionOptions::new().margin_for(
        options.ttl_value(),
        options.drift_margin_for(options.ttl_value()),
    )?;
    let lease = coord.acquire(&key, options).await?;
    let kept = keep(lease, KeeperOptions::new())?;
    let progress = kept.progress();
    let lost = kept.lost();
    let outcome = bounded_with(kept.lease(), SectionOptions::new(), |guard| {
        let scope = LeaseScope {
            key: key.clone(),
            token: kept.token(),
            ttl: kept.lease().ttl(),
            guard,
            lost,
            progress,
        };
        async move { Ok(body(scope).await) }
    })
    .await;
    let released = kept.release().await;
    match (&outcome, released) {
        (Ok(_), Err(e)) => {
            tracing::warn!(key = %key, error = %e,
                "with_lease: the body finished under the lease, but its release failed");
        }
        (Err(Error::Lost { .. }), _) | (_, Ok(())) => {}
        (Err(_), Err(e)) => {
            tracing::debug!(key = %key, error = %e, "with_lease: release after a failed body");
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::LostReason;
    use crate::memory::MemoryCoordinator;
    use crate::options::ForceRelease;

    fn options() -> LeaseOptions {
        LeaseOptions::new(Duration::from_secs(10))
    }

    #[tokio::test]
    async fn returns_the_body_value_and_releases_after() {
        let coord = MemoryCoordinator::new();
        let key = LockKey::new("jobs/a").unwrap();
        let c = &coord;
        let (token, seen) = with_lease(c, "jobs/a", &options(), |lease| async move {
            let holder = c.inspect(lease.key()).await.unwrap().expect("held");
            lease.check().unwrap();
            (lease.token(), holder.token)
        })
        .await
        .unwrap();
        assert_eq!(token, seen, "the body ran while its own lease held the key");
        assert_eq!(coord.last_token(&key), Some(token));
        assert!(coord.inspect(&key).await.unwrap().is_none(), "released");
        // A LockKey (owned or borrowed) is accepted as well.
        let again = with_lease(&coord, &key, &options(), |l| async move { l.token() })
            .await
            .unwrap();
        assert!(again > token);
        with_lease(&coord, key.clone(), &options(), |_| async {})
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn a_lease_force_lost_during_the_body_is_lost_and_the_body_is_cancelled() {
        let coord = MemoryCoordinator::new();
        let key = LockKey::new("jobs/b").unwrap();
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (finished_tx, mut finished_rx) = tokio::sync::oneshot::channel::<()>();
        let c = &coord;
        let options = options();
        let run = with_lease(c, "jobs/b", &options, |_lease| async move {
            started_tx.send(()).unwrap();
            std::future::pending::<()>().await;
            finished_tx.send(()).unwrap();
        });
        let force = async {
            started_rx.await.unwrap();
            let request = ForceRelease::new("test", "lost during the body").unwrap();
            c.force_release(&key, &request)
                .await
                .unwrap()
                .expect("held")
        };
        let (outcome, removed) = tokio::join!(run, force);
        match outcome {
            Err(Error::Lost { reason, token, .. }) => {
                assert_eq!(reason, LostReason::Revoked);
                assert_eq!(token, removed.token);
            }
            other => panic!("expected Lost, got {other:?}"),
        }
        assert!(
            matches!(
                finished_rx.try_recv(),
                Err(tokio::sync::oneshot::error::TryRecvError::Closed)
            ),
            "the body was dropped, not run to completion"
        );
        assert!(coord.inspect(&key).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_bad_key_is_rejected_before_anything_is_sent() {
        let coord = MemoryCoordinator::new();
        let ran = std::sync::atomic::AtomicBool::new(false);
        for bad in ["", "/a", "a//b", "a/../b", "a\nb"] {
            let e = with_lease(&coord, bad, &options(), |_| async {
                ran.store(true, std::sync::atomic::Ordering::SeqCst);
            })
            .await
            .unwrap_err();
            let expected = LockKey::new(bad).unwrap_err();
            match e {
                Error::InvalidInput(i) => assert_eq!(i, expected, "{bad:?}"),
                other => panic!("{bad:?}: expected InvalidInput, got {other:?}"),
            }
        }
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        // Nothing reached the coordinator: no key was ever issued a token.
        assert_eq!(coord.last_token(&LockKey::new("a").unwrap()), None);
        let e = with_lease(&coord, String::from("a//b"), &options(), |_| async {})
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
    }

    /// A drift margin that leaves the section no validity window is refused before the lock is
    /// taken: before, the lock was acquired (a token spent), released, and only then refused.
    #[tokio::test]
    async fn a_margin_that_leaves_no_window_is_rejected_before_anything_is_sent() {
        let coord = MemoryCoordinator::new();
        let key = LockKey::new("jobs/margin").unwrap();
        let tight = options().drift_margin(Duration::from_millis(9_500));
        let e = with_lease(&coord, &key, &tight, |_| async {})
            .await
            .unwrap_err();
        match e {
            Error::InvalidInput(InvalidInput::OutOfRange { field, .. }) => {
                assert_eq!(field, "margin")
            }
            other => panic!("expected InvalidInput for the margin, got {other:?}"),
        }
        assert_eq!(coord.last_token(&key), None, "no lock was taken");
        // A zero TTL is the options' own error, named as such, not the margin's.
        let e = with_lease(
            &coord,
            &key,
            &LeaseOptions::new(Duration::ZERO),
            |_| async {},
        )
        .await
        .unwrap_err();
        assert!(
            matches!(e, Error::InvalidInput(InvalidInput::ZeroTtl)),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn a_busy_key_times_out_without_running_the_body() {
        let coord = MemoryCoordinator::new();
        let key = LockKey::new("jobs/c").unwrap();
        let _held = coord.acquire(&key, &options()).await.unwrap();
        let e = with_lease(
            &coord,
            &key,
            &options().wait(Duration::from_millis(20)),
            |_| async { panic!("the body must not run") },
        )
        .await
        .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    }
}
