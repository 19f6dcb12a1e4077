//! One coordinator's waiting acquires of the same key take turns, first come first served, so
//! that only one of them at a time asks the server.
//!
//! Without this, every local waiter of a key asks the server on every release it hears of
//! (a thundering herd: 16 waiters in one process cost 16 attempts per grant on Redis), and a task
//! that releases and at once acquires again overtakes the ones already waiting. With it, a
//! waiting `acquire` first waits for its turn among this coordinator's waiters of that key
//! (in arrival order; time spent there counts against its `wait`), then runs the backend's
//! waiting recipe alone; the next one's turn starts when it returns (granted or not) or is
//! dropped. Across processes the backend's own order applies (FIFO on etcd and ZooKeeper).
//! `try_acquire` never waits for a turn.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use crate::{Error, LockKey, Result};

type Line = Arc<tokio::sync::Mutex<()>>;

/// The turns of one coordinator's waiting acquires, per key (see the module docs). Holds an
/// entry only for keys somebody waits on.
#[derive(Debug, Default)]
pub struct LocalWaiters {
    lines: Arc<Mutex<HashMap<LockKey, Line>>>,
}

/// A waiting acquire's turn on its key; the next waiter's turn starts when this is dropped.
#[derive(Debug)]
pub struct Turn {
    key: LockKey,
    lines: Arc<Mutex<HashMap<LockKey, Line>>>,
    guard: Option<OwnedMutexGuard<()>>,
}

impl LocalWaiters {
    /// Waits for `key`'s turn, at most `wait`: `Error::Timeout` naming the key when it does not
    /// come in time. Cancel-safe: dropping the future leaves the line.
    pub async fn turn(&self, key: &LockKey, wait: Duration) -> Result<Turn> {
        let start = Instant::now();
        let line = {
            let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
            lines.entry(key.clone()).or_default().clone()
        };
        // Built before waiting, so that a cancelled or timed-out wait still drops its entry.
        let mut turn = Turn {
            key: key.clone(),
            lines: self.lines.clone(),
            guard: None,
        };
        // Awaited in its own statement: the future (and its reference to the line) is dropped
        // here, before `turn` can be dropped, so a timed-out last waiter removes the line.
        let got = tokio::time::timeout(wait, line.lock_owned()).await;
        match got {
            Ok(guard) => {
                turn.guard = Some(guard);
                Ok(turn)
            }
            Err(_) => Err(Error::Timeout {
                key: key.to_string(),
                waited: start.elapsed(),
            }),
        }
    }

    /// Keys somebody waits on or holds a turn for (for tests and diagnostics).
    pub fn waiting_keys(&self) -> usize {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        // Let the next waiter in before deciding whether the line is empty.
        drop(self.guard.take());
        let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        // The map's reference is the only one left: nobody else waits on this key.
        if lines
            .get(&self.key)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            lines.remove(&self.key);
        }
    }
}

/// Runs a waiting acquire of `key` in its turn: waits for the turn (its time counts against
/// `wait`), then calls `acquire` with what is left of `wait` (possibly zero: one attempt). A
/// `Timeout` from `acquire` reports the whole call's wait.
pub async fn in_turn<T, F, Fut>(
    waiters: &LocalWaiters,
    key: &LockKey,
    wait: Duration,
    acquire: F,
) -> Result<T>
where
    F: FnOnce(Duration) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let start = Instant::now();
    let _turn = waiters.turn(key, wait).await?;
    // Even with nothing left the backend is asked once (as a zero wait is): a key freed just as
    // the turn came is taken, not reported busy.
    let left = wait.saturating_sub(start.elapsed());
    match acquire(left).await {
        // The wait reported is the whole call's, the time in line included.
        Err(Error::Timeout { key, .. }) => Err(Error::Timeout {
            key,
            waited: start.elapsed(),
        }),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> LockKey {
        LockKey::new(s).unwrap()
    }

    #[tokio::test]
    async fn turns_come_in_arrival_order_and_the_line_is_dropped_when_empty() {
        let w = Arc::new(LocalWaiters::default());
        let k = key("orders/1");
        let first = w.turn(&k, Duration::from_secs(1)).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..3 {
            let (w2, k2, order) = (w.clone(), k.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let _t = w2.turn(&k2, Duration::from_secs(5)).await.unwrap();
                order.lock().unwrap().push(i);
            }));
            // Each in the line before the next arrives.
            while Arc::strong_count(w.lines.lock().unwrap().get(&k).unwrap()) < 3 + i {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(w.waiting_keys(), 1);
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2]);
        assert_eq!(w.waiting_keys(), 0, "no entry is left behind");
    }

    #[tokio::test]
    async fn a_turn_that_does_not_come_in_time_is_a_timeout_naming_the_key() {
        let w = LocalWaiters::default();
        let k = key("orders/2");
        let _held = w.turn(&k, Duration::from_secs(1)).await.unwrap();
        let e = w.turn(&k, Duration::from_millis(20)).await.unwrap_err();
        assert!(
            matches!(&e, Error::Timeout { key, .. } if key == "orders/2"),
            "{e:?}"
        );
        drop(_held);
        assert_eq!(w.waiting_keys(), 0);
    }

    #[tokio::test]
    async fn other_keys_do_not_wait() {
        let w = LocalWaiters::default();
        let _a = w.turn(&key("a"), Duration::from_secs(1)).await.unwrap();
        let _b = w.turn(&key("b"), Duration::from_millis(50)).await.unwrap();
        assert_eq!(w.waiting_keys(), 2);
    }

    #[tokio::test]
    async fn in_turn_passes_what_is_left_of_the_wait() {
        let w = LocalWaiters::default();
        let k = key("c");
        let left = in_turn(&w, &k, Duration::from_secs(10), |left| async move {
            Ok::<_, Error>(left)
        })
        .await
        .unwrap();
        assert!(left <= Duration::from_secs(10) && left > Duration::from_secs(9));
    }
}
