//! One value an adapter opens on demand and shares (a connection, a session), opened once for
//! every caller that asks while it is being opened.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::{BoxFuture, FutureExt, Shared};

use crate::error::{Error, Result};

/// An opening under way, or finished.
type Opening<T> = Shared<BoxFuture<'static, std::result::Result<T, Arc<Error>>>>;

enum Slot<T> {
    /// Nothing open, nothing being opened.
    Empty,
    Open(T),
    Opening(Opening<T>),
}

/// A value opened on demand (a connection, a session) and shared by every caller: the open one
/// while it is usable, otherwise **one** opening that every caller asking meanwhile awaits.
///
/// With the backend unreachable, N callers that ask at once therefore send one request and get
/// its failure together, each within one opening's bound of asking; callers that each made an
/// attempt of their own in turn would make the k-th of them wait k bounds, past any wait bound
/// it was given. A caller that asks after an opening failed starts a new one.
///
/// The opening runs in a Tokio task of its own: it finishes on its own schedule whether or not
/// anyone still awaits it (a caller whose future was dropped must not leave a half-run opening,
/// its deadlines long past, for the next caller), its outcome is recorded when it finishes
/// (a failure that nobody awaited is not handed to a caller that asks later), and a panic in it
/// is an [`Error::Unavailable`] for its callers, not a poisoned future every later caller would
/// hit.
///
/// Every caller of an opening that failed gets a copy of its error ([`Error::replicate`]: the
/// client library's source is kept as text). The slot is locked only to look up the value or
/// start an opening, never across a request: the `usable`, `which` and `open` closures run
/// under that lock, so they must be cheap and must not call this `SharedOpening` again. The
/// opening itself must be bounded in time (a connect timeout): callers asking while it runs
/// wait for it.
///
/// ```
/// use lease_core::adapter::SharedOpening;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> lease_core::Result<()> {
/// let connection: SharedOpening<u64> = SharedOpening::new("example");
/// // Nothing is open: this call opens (a real adapter connects here).
/// let c = connection.get(|_| true, || async { Ok(7) }).await?;
/// assert_eq!(c, 7);
/// // Open and usable: no second opening.
/// let again = connection.get(|_| true, || async { unreachable!() }).await?;
/// assert_eq!(again, 7);
/// // Once discarded (it broke), the next call opens a new one.
/// connection.discard(|c| *c == 7);
/// assert_eq!(connection.current(|_| true), None);
/// # Ok(())
/// # }
/// ```
pub struct SharedOpening<T> {
    backend: &'static str,
    slot: Mutex<Slot<T>>,
}

impl<T> std::fmt::Debug for SharedOpening<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.slot.lock().unwrap_or_else(|p| p.into_inner()) {
            Slot::Empty => "empty",
            Slot::Open(_) => "open",
            Slot::Opening(o) => match o.peek() {
                None => "opening",
                Some(Ok(_)) => "open",
                Some(Err(_)) => "failed",
            },
        };
        f.debug_struct("SharedOpening")
            .field("backend", &self.backend)
            .field("state", &state)
            .finish()
    }
}

impl<T: Clone + Send + Sync + 'static> SharedOpening<T> {
    /// Nothing open yet: the first [`get`](Self::get) opens. `backend` names the backend in the
    /// error of an opening whose task failed.
    pub fn new(backend: &'static str) -> Self {
        SharedOpening {
            backend,
            slot: Mutex::new(Slot::Empty),
        }
    }

    /// `value` is open (a connection made before the adapter was built).
    pub fn with_open(backend: &'static str, value: T) -> Self {
        SharedOpening {
            backend,
            slot: Mutex::new(Slot::Open(value)),
        }
    }

    /// The slot, with a finished opening turned into its outcome: its value, or nothing (a
    /// failure is for the callers that awaited it; a later caller opens again).
    fn lock(&self) -> MutexGuard<'_, Slot<T>> {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Slot::Opening(o) = &*slot {
            match o.peek() {
                None => {}
                Some(Ok(v)) => *slot = Slot::Open(v.clone()),
                Some(Err(_)) => *slot = Slot::Empty,
            }
        }
        slot
    }

    /// The open value if there is one and `usable` accepts it. Opens nothing, sends nothing.
    pub fn current(&self, usable: impl FnOnce(&T) -> bool) -> Option<T> {
        match &*self.lock() {
            Slot::Open(v) if usable(v) => Some(v.clone()),
            _ => None,
        }
    }

    /// The open value if `usable` accepts it; otherwise the opening under way, or a new one:
    /// `open()`'s future, run in a task of its own. `open` is called only to start an opening.
    /// The value an opening yields is handed to the callers that awaited it as it is; `usable`
    /// judges it at later calls.
    ///
    /// Must be called within a Tokio runtime.
    pub async fn get<F, Fut>(&self, usable: impl FnOnce(&T) -> bool, open: F) -> Result<T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T>> + Send + 'static,
    {
        let opening = {
            let mut slot = self.lock();
            match &*slot {
                Slot::Open(v) if usable(v) => return Ok(v.clone()),
                Slot::Opening(o) => o.clone(),
                Slot::Open(_) | Slot::Empty => {
                    let o = self.start(open());
                    *slot = Slot::Opening(o.clone());
                    o
                }
            }
        };
        opening.await.map_err(|e| e.replicate())
    }

    /// Forgets the open value if `which` accepts it (it broke, or its session ended), so that
    /// the next [`get`](Self::get) opens a new one. An opening under way is left alone.
    pub fn discard(&self, which: impl FnOnce(&T) -> bool) {
        let mut slot = self.lock();
        if matches!(&*slot, Slot::Open(v) if which(v)) {
            *slot = Slot::Empty;
        }
    }

    fn start(&self, open: impl Future<Output = Result<T>> + Send + 'static) -> Opening<T> {
        let backend = self.backend;
        let task = tokio::spawn(open);
        let opening = async move {
            task.await
                .unwrap_or_else(|e| {
                    Err(Error::Unavailable {
                        backend,
                        message: format!("opening a connection or session: its task failed: {e}"),
                        source: None,
                    })
                })
                .map_err(Arc::new)
        }
        .boxed()
        .shared();
        // A `Shared` records its outcome (`peek`) only once a clone polled it to the end: this
        // one does, so a finished opening is seen as finished even when no caller awaits it.
        tokio::spawn(opening.clone());
        opening
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    fn unavailable(message: &str) -> Error {
        Error::unavailable("test", message.to_owned())
    }

    /// A caller of `opening` whose opening yields `outcome` once the returned sender sends
    /// `true`; returns when that opening is under way.
    async fn held_opening(
        opening: &Arc<SharedOpening<u32>>,
        outcome: Result<u32>,
    ) -> (
        tokio::task::JoinHandle<Result<u32>>,
        tokio::sync::watch::Sender<bool>,
    ) {
        let (release, mut released) = tokio::sync::watch::channel(false);
        let caller = {
            let opening = opening.clone();
            tokio::spawn(async move {
                opening
                    .get(
                        |_| true,
                        || async move {
                            released.wait_for(|r| *r).await.unwrap();
                            outcome
                        },
                    )
                    .await
            })
        };
        while !format!("{opening:?}").contains("\"opening\"") {
            tokio::task::yield_now().await;
        }
        (caller, release)
    }

    #[tokio::test]
    async fn callers_asking_meanwhile_share_one_opening_and_its_failure() {
        let opening: Arc<SharedOpening<u32>> = Arc::new(SharedOpening::new("test"));
        let attempts = Arc::new(AtomicU32::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (opening, attempts, released) =
                    (opening.clone(), attempts.clone(), released.clone());
                tokio::spawn(async move {
                    opening
                        .get(
                            |_| true,
                            || async move {
                                attempts.fetch_add(1, Ordering::SeqCst);
                                let mut released = released;
                                released.wait_for(|r| *r).await.unwrap();
                                Err::<u32, _>(unavailable("refused"))
                            },
                        )
                        .await
                })
            })
            .collect();
        // Every call has joined the opening before it fails.
        while attempts.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tokio::task::yield_now().await;
        release.send(true).unwrap();
        for call in calls {
            let e = call.await.unwrap().unwrap_err();
            assert!(e.to_string().contains("refused"), "{e}");
        }
        assert_eq!(attempts.load(Ordering::SeqCst), 1);
        // A caller asking after the failure opens again.
        let v = opening.get(|_| true, || async { Ok(5) }).await.unwrap();
        assert_eq!((v, opening.current(|_| true)), (5, Some(5)));
    }

    #[tokio::test]
    async fn an_opening_that_failed_while_nobody_awaited_it_is_not_handed_out_later() {
        let opening = Arc::new(SharedOpening::<u32>::new("test"));
        let (caller, release) = held_opening(&opening, Err(unavailable("refused long ago"))).await;
        // The only caller gives up; the opening then fails with nobody awaiting it.
        caller.abort();
        let _ = caller.await;
        release.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), async {
            while format!("{opening:?}").contains("\"opening\"") {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the finished opening is still seen as under way");
        // A caller asking now gets a new opening, not the old failure.
        let v = opening.get(|_| true, || async { Ok(8) }).await.unwrap();
        assert_eq!(v, 8);
    }

    #[tokio::test]
    async fn an_unusable_or_discarded_value_is_opened_again() {
        let opening = SharedOpening::with_open("test", 1u32);
        assert_eq!(opening.current(|v| *v == 1), Some(1));
        let v = opening.get(|v| *v != 1, || async { Ok(2) }).await.unwrap();
        assert_eq!(v, 2);
        opening.discard(|v| *v == 1);
        assert_eq!(opening.current(|_| true), Some(2), "another value stays");
        opening.discard(|v| *v == 2);
        assert_eq!(opening.current(|_| true), None);
        assert_eq!(opening.get(|_| true, || async { Ok(3) }).await.unwrap(), 3);
    }

    #[tokio::test]
    async fn an_opening_outlives_a_dropped_caller_and_a_panic_is_an_error() {
        let opening = Arc::new(SharedOpening::<u32>::new("test"));
        let (first, release) = held_opening(&opening, Ok(9)).await;
        first.abort();
        let _ = first.await;
        release.send(true).unwrap();
        let v = opening
            .get(
                |_| true,
                || async { unreachable!("the first opening serves") },
            )
            .await
            .unwrap();
        assert_eq!(v, 9);

        let panicking = SharedOpening::<u32>::new("test");
        let e = panicking
            .get(|_| true, || async { panic!("boom") })
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        let v = panicking.get(|_| true, || async { Ok(4) }).await.unwrap();
        assert_eq!(v, 4);
    }
}
