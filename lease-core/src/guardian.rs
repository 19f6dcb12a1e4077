//! [`spawn_guardian`] and [`retry_until_settled`]: how an adapter makes sure that an ended
//! lease's key is not left locked, written once (an adapter whose guardian also watches the key,
//! like etcd's and ZooKeeper's, keeps its own task and uses the retry loop where it fits).
//!
//! A lease ends in many ways (released, dropped, expired locally, revoked, its session ended),
//! and in several of them the key may still be locked on the server: a release whose answer was
//! lost, a lease dropped without a release, a lease whose validity passed while its server-side
//! TTL (or session) lives on. The guardian waits for the end, records why, and runs the
//! adapter's compare-and-delete until it settles.

use std::future::Future;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::error::{Error, LostReason};
use crate::lease::LeaseTracker;

/// Starts, on the current tokio runtime, the guardian of the lease `tracker`: it waits until the
/// lease is lost, for any reason, records that reason, then runs `cleanup(reason)`.
///
/// Recording first matters: the loss signal fires when validity passes, and a renewal
/// completing in between would otherwise leave a lease that reports `Held` while its key is
/// being deleted (the first recorded reason wins, so the lease reads `Lost` from then on).
///
/// Returns false, and starts nothing, outside a runtime: the lock then lasts until its TTL or
/// session ends on the server.
pub fn spawn_guardian<F, Fut>(tracker: &LeaseTracker, cleanup: F) -> bool
where
    F: FnOnce(LostReason) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return false;
    };
    let tracker = tracker.clone();
    runtime.spawn(async move {
        let reason = tracker.signal().wait().await;
        tracker.mark_lost(reason);
        cleanup(reason).await;
    });
    true
}

/// Runs `attempt` until it answers [`ControlFlow::Break`] (settled: the key deleted, found not
/// ours, or nothing left to do), sleeping `backoff`'s next delay after each
/// [`ControlFlow::Continue`] (the server could not be reached, the outcome is not known).
///
/// With `give_up`, stops once the next delay would end after it (the caller passes the instant
/// after which the server has removed the key anyway) and returns `None`; otherwise returns the
/// settled value.
pub async fn retry_until_settled<T, F, Fut>(
    mut backoff: Backoff,
    give_up: Option<Instant>,
    mut attempt: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ControlFlow<T>>,
{
    loop {
        if let ControlFlow::Break(v) = attempt().await {
            return Some(v);
        }
        if give_up.is_some_and(|at| Instant::now() + backoff.ceiling() >= at) {
            return None;
        }
        backoff.sleep().await;
    }
}

/// How a background cleanup that retries until settled reports its failed tries.
///
/// Such a cleanup does not give up while the key may still be locked by the lease it cleans up
/// after. A refusal that will not pass by itself (an error that is neither retryable nor an
/// unknown outcome: the credentials may no longer delete the key) is logged at `error` level
/// once per cleanup, naming the backend, the key and the error, since the key stays locked
/// until an operator acts or the lock's session or TTL ends; every other failure (unreachable
/// server, a delete whose answer was lost, which the next try settles) is logged at `debug`
/// level.
#[derive(Debug)]
pub struct CleanupFailures {
    backend: &'static str,
    key: String,
    refusal_reported: AtomicBool,
}

impl CleanupFailures {
    /// For one cleanup of `key` (the backend's own name for it: a path, a KV key) on `backend`.
    pub fn new(backend: &'static str, key: &str) -> Self {
        CleanupFailures {
            backend,
            key: key.to_owned(),
            refusal_reported: AtomicBool::new(false),
        }
    }

    /// Logs that `what` failed with `error`; the cleanup tries again after its backoff.
    pub fn failed(&self, what: &str, error: &Error) {
        let (backend, key) = (self.backend, &self.key);
        let refused = !error.is_retryable() && !matches!(error, Error::OutcomeUnknown { .. });
        if refused && !self.refusal_reported.swap(true, Ordering::Relaxed) {
            tracing::error!(
                backend,
                %key,
                %error,
                "{what} was refused; retrying until it is settled, the key may stay locked \
                 meanwhile"
            );
        } else {
            tracing::debug!(backend, %key, %error, "{what} failed; retrying");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::LockKey;
    use crate::token::Token;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn the_guardian_records_the_reason_before_it_cleans_up() {
        let tracker = LeaseTracker::new(
            "test",
            LockKey::new("k").unwrap(),
            Token::new(1).unwrap(),
            Duration::from_secs(5),
            Duration::ZERO,
            Instant::now(),
        );
        let (tx, rx) = tokio::sync::oneshot::channel();
        let seen = tracker.clone();
        assert!(spawn_guardian(&tracker, move |reason| async move {
            // Recorded before the cleanup runs: a late renewal cannot bring it back.
            let _ = tx.send((reason, seen.status(), seen.renewed(Instant::now())));
        }));
        let (reason, status, renewed) = rx.await.unwrap();
        assert_eq!(reason, LostReason::Expired);
        assert_eq!(status, crate::LeaseStatus::Lost(LostReason::Expired));
        assert!(!renewed);
    }

    #[tokio::test(start_paused = true)]
    async fn retries_until_settled_or_the_bound() {
        let ms = Duration::from_millis;
        let tries = Arc::new(AtomicUsize::new(0));
        let t = tries.clone();
        let settled = retry_until_settled(Backoff::new(ms(10), ms(40)), None, move || {
            let n = t.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 3 {
                    ControlFlow::Continue(())
                } else {
                    ControlFlow::Break(n)
                }
            }
        })
        .await;
        assert_eq!(settled, Some(3));
        let start = Instant::now();
        let never = retry_until_settled(
            Backoff::new(ms(10), ms(40)),
            Some(start + ms(200)),
            || async { ControlFlow::<()>::Continue(()) },
        )
        .await;
        assert_eq!(never, None);
        assert!(start.elapsed() <= ms(200), "{:?}", start.elapsed());
    }

    /// A tracing writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_cleanup_reports_a_lasting_refusal_once_and_other_failures_quietly() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let refused = Error::misconfigured("test", "permission denied");
        let lost = Error::unavailable("test", "timed out");
        // A delete whose answer was lost (a write timed out): the next try settles it.
        let unanswered = Error::OutcomeUnknown {
            backend: "test",
            operation: "delete",
            message: "no answer within 1s".into(),
            source: None,
        };
        tracing::subscriber::with_default(subscriber, || {
            let failures = CleanupFailures::new("test", "locks/a");
            // The unknown outcome first: it must not take the one error-level report.
            for _ in 0..3 {
                failures.failed("deleting the key", &unanswered);
                failures.failed("deleting the key", &refused);
                failures.failed("deleting the key", &lost);
            }
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let errors: Vec<_> = lines
            .iter()
            .filter(|l| l.contains("refused; retrying until"))
            .collect();
        assert_eq!(errors.len(), 1, "{lines:?}");
        assert!(errors[0].contains("ERROR"), "{errors:?}");
        assert!(errors[0].contains("locks/a") && errors[0].contains("permission denied"));
        let quiet = lines.iter().filter(|l| l.contains("failed; retrying"));
        assert!(quiet.clone().all(|l| l.contains("DEBUG")), "{lines:?}");
        assert_eq!(quiet.count(), 8, "{lines:?}");
    }
}
