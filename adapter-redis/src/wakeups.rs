//! Waking waiters: one pub/sub connection per coordinator, subscribed to the release channel of
//! every key some local `acquire` waits on.
//!
//! A background task owns the connection. Waiters register through [`Wakeups::subscribe`], which
//! returns once the server confirmed the subscription (or failed to: then the waiter relies on
//! its bounded polling fallback alone). Each channel has a counter in a `watch` channel that the
//! task bumps on every message; a waiter sees every bump that happens after it subscribed, even
//! one that arrives while it runs a script (no lost wake-up between "held" and "sleep").
//!
//! If the pub/sub connection breaks (for example the server restarts), the task bumps every
//! channel (messages may have been lost: waiters re-run the acquire script), tells the command
//! connection to reconnect, and reconnects and resubscribes with a capped backoff.
//! Dropping the coordinator and every subscription ends the task.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use futures::StreamExt;
use lease_core::adapter::Backoff;
use redis::aio::{PubSubSink, PubSubStream};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::client::Connection;
use crate::error::{self, BACKEND};

struct Channel {
    tx: watch::Sender<u64>,
    refs: usize,
}

#[derive(Default)]
struct Registry {
    channels: HashMap<String, Channel>,
}

type Shared = Arc<Mutex<Registry>>;

fn lock(s: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

enum Cmd {
    /// Subscribe if not yet subscribed; answer whether the channel is now subscribed.
    Subscribe(String, oneshot::Sender<bool>),
    /// Unsubscribe if nobody waits on the channel any more.
    Unsubscribe(String),
}

/// The coordinator's handle on the wake-up task.
pub(crate) struct Wakeups {
    shared: Shared,
    cmd: mpsc::UnboundedSender<Cmd>,
    request_timeout: Duration,
}

impl Wakeups {
    /// Opens the pub/sub connection (bounded by the connect timeout) and starts the task.
    pub(crate) async fn start(
        conn: &Arc<Connection>,
        request_timeout: Duration,
    ) -> lease_core::Result<Self> {
        let pubsub = open(conn).await?;
        let shared: Shared = Arc::default();
        let (cmd, rx) = mpsc::unbounded_channel();
        let (sink, stream) = pubsub.split();
        tokio::spawn(run(
            Arc::downgrade(&shared),
            rx,
            Arc::downgrade(conn),
            Some((sink, stream)),
            request_timeout,
        ));
        Ok(Wakeups {
            shared,
            cmd,
            request_timeout,
        })
    }

    /// Registers interest in `channel` and waits until the server confirmed the subscription,
    /// twice the request timeout at most and never past `until` (the waiter's wait bound). Never
    /// fails: without a confirmed subscription the returned handle still works, only fewer
    /// wake-ups arrive, and the waiter's polling covers the rest.
    pub(crate) async fn subscribe(&self, channel: &str, until: Instant) -> Subscription {
        let rx = {
            let mut reg = lock(&self.shared);
            let entry = reg
                .channels
                .entry(channel.to_owned())
                .or_insert_with(|| Channel {
                    tx: watch::channel(0).0,
                    refs: 0,
                });
            entry.refs += 1;
            entry.tx.subscribe()
        };
        // From here on, dropping `sub` (also by cancelling the caller) deregisters it.
        let sub = Subscription {
            shared: self.shared.clone(),
            cmd: self.cmd.clone(),
            channel: channel.to_owned(),
            rx,
        };
        let (ack, answer) = oneshot::channel();
        let mut confirmed = false;
        if self
            .cmd
            .send(Cmd::Subscribe(channel.to_owned(), ack))
            .is_ok()
        {
            // Bounded twice the request timeout: the task may be finishing another request.
            let bound = until.min(Instant::now() + self.request_timeout * 2);
            confirmed = tokio::time::timeout_at(bound, answer)
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or(false);
        }
        if !confirmed {
            tracing::debug!(
                backend = BACKEND,
                channel,
                "release notifications unavailable; waiting by polling"
            );
        }
        sub
    }
}

/// One waiter's interest in one release channel. Dropping it (also by dropping the `acquire`
/// future) deregisters it without blocking.
pub(crate) struct Subscription {
    shared: Shared,
    cmd: mpsc::UnboundedSender<Cmd>,
    channel: String,
    rx: watch::Receiver<u64>,
}

impl Subscription {
    /// Resolves at the next notification after the last one seen; never resolves if the
    /// notifier is gone (the caller always races it with a timer).
    pub(crate) async fn notified(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut reg = lock(&self.shared);
        let last = match reg.channels.get_mut(&self.channel) {
            Some(c) => {
                c.refs -= 1;
                c.refs == 0
            }
            None => false,
        };
        if last {
            reg.channels.remove(&self.channel);
            drop(reg);
            let _ = self.cmd.send(Cmd::Unsubscribe(self.channel.clone()));
        }
    }
}

async fn open(conn: &Connection) -> lease_core::Result<redis::aio::PubSub> {
    tokio::time::timeout(conn.connect_timeout(), conn.client().get_async_pubsub())
        .await
        .map_err(|_| error::connect_timed_out(conn.connect_timeout()))?
        .map_err(error::connect_failed)
}

fn bump_all(shared: &Shared) {
    for c in lock(shared).channels.values() {
        c.tx.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Waits `delay` while disconnected, answering requests meanwhile (not subscribed). `false`
/// when the coordinator is gone.
async fn pause(cmds: &mut mpsc::UnboundedReceiver<Cmd>, delay: Duration) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => return true,
            cmd = cmds.recv() => match cmd {
                None => return false,
                Some(Cmd::Subscribe(_, ack)) => { let _ = ack.send(false); }
                Some(Cmd::Unsubscribe(_)) => {}
            },
        }
    }
}

/// The server refused to subscribe to `channel` (`NOPERM`: an ACL user without the channel, as
/// Redis 7's default `acl-pubsub-default resetchannels` gives): said at `warn` the first time
/// (an ACL refuses every channel of the prefix alike; remembering each would grow with the keys).
fn refused(channel: &str, e: &redis::RedisError, warned: &mut bool) {
    if !std::mem::replace(warned, true) {
        tracing::warn!(
            backend = BACKEND,
            channel,
            error = %e,
            "subscribing to release notifications refused; waiters poll (allow the channel in \
             the ACL, e.g. &fenced:*)"
        );
    }
}

async fn run(
    shared: Weak<Mutex<Registry>>,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    conn: Weak<Connection>,
    mut first: Option<(PubSubSink, PubSubStream)>,
    request_timeout: Duration,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    // Whether a refused subscription was logged.
    let mut warned = false;
    loop {
        // Connect (the first connection comes from `start`).
        let (mut sink, mut stream) = match first.take() {
            Some(pair) => pair,
            None => {
                let Some(c) = conn.upgrade() else { return };
                let opened = open(&c).await;
                drop(c);
                match opened {
                    Ok(p) => p.split(),
                    Err(e) => {
                        tracing::debug!(backend = BACKEND, error = %e, "pub/sub reconnect failed");
                        if !pause(&mut cmds, backoff.next_delay()).await {
                            return;
                        }
                        continue;
                    }
                }
            }
        };
        // Resubscribe everything somebody waits on, then wake them all: messages may have been
        // missed while disconnected.
        let mut subscribed: HashSet<String> = HashSet::new();
        let wanted: Vec<String> = match shared.upgrade() {
            Some(s) => lock(&s).channels.keys().cloned().collect(),
            None => return,
        };
        let mut healthy = true;
        for ch in wanted {
            match tokio::time::timeout(request_timeout, sink.subscribe(&ch)).await {
                Ok(Ok(())) => {
                    subscribed.insert(ch);
                }
                // Refused by the server (an ACL without the channel): its waiters poll.
                Ok(Err(e)) if e.code().is_some() => refused(&ch, &e, &mut warned),
                _ => {
                    healthy = false;
                    break;
                }
            }
        }
        if let Some(s) = shared.upgrade() {
            bump_all(&s);
        }
        if !healthy {
            // Back off as after a failed connect: a server that fails every subscription at
            // once would otherwise be reconnected to in a loop, each round waking every waiter.
            if !pause(&mut cmds, backoff.next_delay()).await {
                return;
            }
            continue;
        }
        backoff.reset();

        // Serve requests and dispatch messages until the connection breaks.
        loop {
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None => return,
                    Some(Cmd::Subscribe(ch, ack)) => {
                        if subscribed.contains(&ch) {
                            let _ = ack.send(true);
                            continue;
                        }
                        match tokio::time::timeout(request_timeout, sink.subscribe(&ch)).await {
                            Ok(Ok(())) => {
                                subscribed.insert(ch);
                                let _ = ack.send(true);
                            }
                            // Refused: the connection is fine; this channel's waiters poll.
                            Ok(Err(e)) if e.code().is_some() => {
                                refused(&ch, &e, &mut warned);
                                let _ = ack.send(false);
                            }
                            _ => {
                                let _ = ack.send(false);
                                break;
                            }
                        }
                    }
                    Some(Cmd::Unsubscribe(ch)) => {
                        let still_wanted = match shared.upgrade() {
                            Some(s) => lock(&s).channels.contains_key(&ch),
                            None => return,
                        };
                        if !still_wanted && subscribed.remove(&ch) {
                            let r = tokio::time::timeout(request_timeout, sink.unsubscribe(&ch)).await;
                            if !matches!(r, Ok(Ok(()))) {
                                break;
                            }
                        }
                    }
                },
                msg = stream.next() => match msg {
                    Some(msg) => {
                        let Some(s) = shared.upgrade() else { return };
                        let reg = lock(&s);
                        if let Some(c) = reg.channels.get(msg.get_channel_name()) {
                            c.tx.send_modify(|n| *n = n.wrapping_add(1));
                        }
                    }
                    None => {
                        // The server went away: the command connection is probably broken too.
                        // Drop it now so that the next request reconnects (and reports
                        // `Unavailable` if the server is down) instead of finding out by failing.
                        tracing::debug!(backend = BACKEND, "pub/sub connection closed");
                        if let Some(c) = conn.upgrade() {
                            c.discard(None);
                        }
                        break;
                    }
                },
            }
        }
        if let Some(s) = shared.upgrade() {
            bump_all(&s);
        }
    }
}
