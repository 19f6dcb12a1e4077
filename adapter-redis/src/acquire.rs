//! The acquire recipe on Redis: one script run per attempt (grant, or the holder and its TTL),
//! wake-ups on the key's release channel while waiting, the resolution of a reply not seen, and
//! the grant.

use std::sync::Arc;
use std::time::Duration;

use lease_core::adapter::{Backoff, LeaseTracker};
use lease_core::{Error, Lease, LeaseOptions, LockKey, Result, Token};
use tokio::time::Instant;

use crate::coordinator::RedisCoordinator;
use crate::core::*;
use crate::error::{bad_reply, ops, BACKEND};
use crate::keys::{LockKeys, LockValue, ValueParts};
use crate::lease::RedisLease;
use crate::scripts::{self, reply};
use crate::wakeups::Subscription;

/// The first pause of a waiting acquire after an `Unavailable` attempt; doubled (with jitter) up
/// to [`UNAVAILABLE_MAX_PAUSE`].
const UNAVAILABLE_FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause of a waiting acquire between attempts the server could not answer.
const UNAVAILABLE_MAX_PAUSE: Duration = Duration::from_millis(800);

/// Lives for one acquire call. If the call ends without a lease (an error, or the future is
/// dropped) while a request of ours may still apply, it starts an `UntilExpiry` cleanup.
struct CallGuard {
    inner: Arc<Inner>,
    keys: Arc<LockKeys>,
    head: String,
    ttl: Duration,
    /// A request may have applied without our seeing it (or is in flight right now).
    pending: bool,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.pending {
            spawn_cleanup(
                self.inner.clone(),
                self.keys.clone(),
                Arc::from(std::mem::take(&mut self.head)),
                self.ttl,
                Cleanup::UntilExpiry,
            );
        }
    }
}

/// The result of one run of the acquire script.
enum Attempt {
    Granted(RedisLease),
    /// Held by someone else; the holder's remaining TTL when known.
    Held(Option<Duration>),
    /// The reply was lost and the outcome is not settled: a re-read found the key free (the
    /// request did not apply yet; it may still be pending at the server), or ours while replicas
    /// must acknowledge it (the re-read proves no replica has it). The acquire script is
    /// idempotent per nonce, so running it again is safe, and it answers for the grant then.
    /// Also a grant of ours whose validity ended before it was seen, given back: the key is free.
    Again(Error),
    /// The reply was lost and the re-read failed too.
    Unknown(Error),
}

impl RedisCoordinator {
    /// `acquire` (`Some(wait)`: up to `wait`) and `try_acquire` (`None`), with `options`
    /// validated.
    pub(crate) async fn acquire_for(
        &self,
        key: &LockKey,
        options: &LeaseOptions,
        wait: Option<Duration>,
    ) -> Result<Box<dyn Lease>> {
        let keys = Arc::new(LockKeys::new(self.inner.config.key_prefix(), key));
        let owner = options
            .owner_value()
            .cloned()
            .unwrap_or_else(|| self.inner.default_owner.clone());
        let parts = ValueParts::new(rand::random(), &owner, options.operation_value());
        let mut guard = CallGuard {
            inner: self.inner.clone(),
            keys: keys.clone(),
            head: parts.head.clone(),
            ttl: options.ttl_value(),
            pending: false,
        };
        let start = Instant::now();
        let deadline = start + wait.unwrap_or_default();
        let mut subscription: Option<Subscription> = None;
        // The send time of the earliest request of this call whose outcome was not seen.
        let mut unseen_since: Option<Instant> = None;
        let mut retries_left = 1u8;
        // Whether an attempt found the key held by someone else: only then is `Timeout` the
        // answer at the wait bound (decision 0036).
        let mut seen_busy = false;
        let mut unavailable_pause = Backoff::new(UNAVAILABLE_FIRST_PAUSE, UNAVAILABLE_MAX_PAUSE);
        loop {
            let attempt = match self
                .attempt(key, &keys, &parts, options, &mut guard, &mut unseen_since)
                .await
            {
                Ok(a) => a,
                // A waiting acquire rides out a server that cannot answer for a moment (a
                // restart, a Sentinel failover) within its wait bound.
                Err(Error::Unavailable { .. })
                    if wait.is_some()
                        && Instant::now() + unavailable_pause.ceiling() < deadline =>
                {
                    unavailable_pause.sleep().await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            // One reading for the whole round: read twice, the bound could pass between the
            // two, and a key never found busy would end in `Timeout` (decision 0036).
            let now = Instant::now();
            let holder_ttl = match attempt {
                Attempt::Granted(lease) => {
                    guard.pending = false;
                    return Ok(Box::new(lease));
                }
                Attempt::Held(ttl) => {
                    seen_busy = true;
                    ttl
                }
                Attempt::Unknown(e) => return Err(e),
                Attempt::Again(e) => {
                    // `try_acquire`, and an `acquire` past its bound that never found the key
                    // held, run the (idempotent) script once more: `Timeout` would report a key
                    // found free as busy. Otherwise `acquire` keeps trying within its wait bound.
                    // Giving up leaves the guard armed.
                    if wait.is_none() || (!seen_busy && now >= deadline) {
                        if retries_left == 0 {
                            return Err(e);
                        }
                        retries_left -= 1;
                        continue;
                    }
                    Some(Duration::ZERO)
                }
            };
            let Some(_) = wait else {
                return Err(Error::Held {
                    key: key.to_string(),
                });
            };
            if now >= deadline {
                return Err(Error::Timeout {
                    key: key.to_string(),
                    waited: now - start,
                });
            }
            let Some(sub) = subscription.as_mut() else {
                // Subscribe, then run the script again at once: a release between the failed
                // attempt and the subscription would otherwise go unnoticed until the next poll.
                subscription = Some(self.inner.wakeups.subscribe(keys.channel(), deadline).await);
                continue;
            };
            let mut nap = self.inner.config.poll_interval();
            if let Some(ttl) = holder_ttl {
                nap = nap.min(ttl + Duration::from_millis(1));
            }
            let until = (now + nap).min(deadline);
            tokio::select! {
                _ = sub.notified() => {}
                _ = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Runs the acquire script once and resolves an unseen outcome by re-reading the lock.
    ///
    /// `unseen_since` is the send time of the earliest request of this call whose outcome was
    /// not seen. A lease's validity counts from that time only when the grant may be one of those
    /// requests' (the script found this call's own nonce, or a re-read did); a grant made by
    /// this very request counts from its own send.
    async fn attempt(
        &self,
        key: &LockKey,
        keys: &Arc<LockKeys>,
        parts: &ValueParts,
        options: &LeaseOptions,
        guard: &mut CallGuard,
        unseen_since: &mut Option<Instant>,
    ) -> Result<Attempt> {
        let ttl_ms = px_millis(options.ttl_value()).to_string();
        let floor = self
            .inner
            .config
            .token_floor()
            .map(|t| t.to_string())
            .unwrap_or_default();
        let clock_tokens: &[u8] = if self.inner.config.clock_tokens() {
            b"1"
        } else {
            b"0"
        };
        // Before anything is sent: a refusal here leaves nothing pending.
        let acks = self.inner.replica_acks().await?;
        let sent_at = Instant::now();
        let was_pending = guard.pending;
        guard.pending = true;
        let script_keys = [keys.lock(), keys.counter()];
        let script_args = [
            parts.head.as_bytes(),
            parts.tail.as_bytes(),
            ttl_ms.as_bytes(),
            floor.as_bytes(),
            clock_tokens,
        ];
        let conn = &self.inner.conn;
        let result = if acks == 0 {
            conn.eval(ops::ACQUIRE, &scripts::ACQUIRE, &script_keys, &script_args)
                .await
                .map(|v| (v, 0))
        } else {
            conn.eval_and_wait(
                ops::ACQUIRE,
                &scripts::ACQUIRE,
                &script_keys,
                &script_args,
                acks,
                self.inner.config.request_timeout() / 2,
                // A lost grant's reply is settled by `resolve` (the script runs again).
                None,
            )
            .await
        };
        let (v, acked) = match result {
            Ok(v) => v,
            Err(original @ Error::OutcomeUnknown { .. }) => {
                // `guard.pending` stays set until a grant: this request may apply later. A grant
                // the re-read finds may be this request's or an earlier unseen one's.
                let validity_from = *unseen_since.get_or_insert(sent_at);
                return self
                    .resolve(key, keys, parts, options, validity_from, original)
                    .await;
            }
            Err(e) => {
                // The server refused or could not be reached: this request did not apply.
                guard.pending = was_pending;
                return Err(e);
            }
        };
        // A reply for this request. An earlier request whose reply was lost may still be
        // pending at the server, so only a grant (which such a request then finds and leaves
        // alone, the script being idempotent per nonce) clears `pending`. Until the reply is
        // read, this request may have written the lock: a reply that cannot be read, or a grant
        // whose token is not one (an outside write to the counter), leaves `pending` set, and the
        // guard removes the lock when the call ends.
        let Some(items) = reply::array(v) else {
            return Err(bad_reply(ops::ACQUIRE, "not an array"));
        };
        match items.as_slice() {
            [flag, token] if matches!(reply::int(flag), Some(1 | 2)) => {
                let native: i64 = reply::text(token)
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| bad_reply(ops::ACQUIRE, "token is not a number"))?;
                let token = self.inner.tokens.convert(key, native)?;
                // 1: this request wrote the lock, so Redis counts its PX from after our send.
                // 2: an earlier request of this call did, at the earliest when the first unseen
                // one was sent.
                let validity_from = if reply::int(flag) == Some(2) {
                    unseen_since.unwrap_or(sent_at).min(sent_at)
                } else {
                    sent_at
                };
                if (acked as usize) < acks {
                    // Not on enough replicas: a failover now could hand the key to someone
                    // else while we hold it. Give it back.
                    let _ = self.inner.release_by_head(keys, &parts.head).await;
                    return Err(Error::unavailable(
                        BACKEND,
                        format!(
                            "the grant of {key} reached {acked} of the {acks} replica(s) \
                             replica_acks asks for within {:?}; released again",
                            self.inner.config.request_timeout() / 2
                        ),
                    ));
                }
                let granted = self
                    .grant(key, keys, parts, token, options, validity_from)
                    .await;
                // Not after a grant found expired (`Again`): its give-back may have failed.
                if matches!(granted, Ok(Attempt::Granted(_))) {
                    guard.pending = was_pending;
                }
                granted
            }
            [flag, counter] if reply::int(flag) == Some(3) => {
                // The counter is not a token (written from outside); the script wrote nothing.
                guard.pending = was_pending;
                Err(Error::TokenOutOfRange {
                    backend: BACKEND,
                    key: key.to_string(),
                    native: format!(
                        "the token counter {:?}",
                        reply::text(counter).unwrap_or_default()
                    ),
                })
            }
            [flag, _holder, pttl] if reply::int(flag) == Some(0) => {
                guard.pending = was_pending;
                let pttl = reply::int(pttl).unwrap_or(-1);
                Ok(Attempt::Held(
                    (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                ))
            }
            _ => Err(bad_reply(ops::ACQUIRE, "unexpected shape")),
        }
    }

    /// The acquire script's reply was not seen: re-read the lock. Ours: we hold it, unless
    /// replicas must acknowledge the grant (then the script runs again, and its `WAIT` covers
    /// the grant). Someone else's: we do not (yet; a pending request of ours is cleaned up if the
    /// call gives up). Free: retry (idempotent). Unreadable: report the original
    /// `OutcomeUnknown`.
    async fn resolve(
        &self,
        key: &LockKey,
        keys: &Arc<LockKeys>,
        parts: &ValueParts,
        options: &LeaseOptions,
        validity_from: Instant,
        original: Error,
    ) -> Result<Attempt> {
        let read_sent = Instant::now();
        match self.read_lock(keys, ops::RESOLVE).await {
            Ok(Some((value, pttl))) => match LockValue::parse(&value) {
                Some(_)
                    if value.starts_with(&parts.head) && self.inner.replica_acks_known() > 0 =>
                {
                    Ok(Attempt::Again(original))
                }
                Some(v) if value.starts_with(&parts.head) => {
                    tracing::debug!(backend = BACKEND, key = %key, "acquire reply lost; re-read shows we hold the lock");
                    // The lock may also be an earlier, answered grant of this call that came
                    // too late to use and whose release failed: it expires before a grant by
                    // the unseen request would. The server read the PTTL after `read_sent`, so
                    // the key lives at least until `read_sent + pttl`; validity counts from no
                    // later than that, less the TTL.
                    let from = match u64::try_from(pttl) {
                        Ok(ms) => (read_sent + Duration::from_millis(ms))
                            .checked_sub(options.ttl_value())
                            .map_or(validity_from, |f| f.min(validity_from)),
                        // No expiry (made persistent from outside): the grant's own bound.
                        Err(_) => validity_from,
                    };
                    self.grant(key, keys, parts, v.token, options, from).await
                }
                _ => Ok(Attempt::Held(
                    (pttl >= 0).then(|| Duration::from_millis(pttl as u64)),
                )),
            },
            Ok(None) => Ok(Attempt::Again(original)),
            Err(e) => {
                tracing::debug!(backend = BACKEND, key = %key, error = %e, "acquire outcome unknown; cleaning up in the background");
                Ok(Attempt::Unknown(original))
            }
        }
    }

    /// Turns a token the script issued into a lease, unless it does not exceed the high-water
    /// mark (then the lock is released again and the call fails closed).
    async fn grant(
        &self,
        key: &LockKey,
        keys: &Arc<LockKeys>,
        parts: &ValueParts,
        token: Token,
        options: &LeaseOptions,
        sent_at: Instant,
    ) -> Result<Attempt> {
        let ttl = options.ttl_value();
        let margin = options.drift_margin_for(ttl);
        let valid_until = lease_core::adapter::clock::valid_until(sent_at, ttl, margin);
        // A grant handed out is admitted (and recorded); one whose validity ended in flight is
        // only checked, so that a token that went backwards is reported either way.
        // One reading: a token admitted (recorded) is never given back as expired, which a
        // retry granting it again would then find behind the watermark.
        let expired = Instant::now() >= valid_until;
        let regression = if expired {
            self.inner.tokens.check(key, token).err()
        } else {
            self.inner.tokens.admit(key, token).err()
        };
        if expired || regression.is_some() {
            // Either the lease expired before we could use it (a very slow reply), or the token
            // went backwards: give the lock back either way.
            let (gave_back, _) = self.inner.release_by_head(keys, &parts.head).await;
            if let Some(e) = regression {
                tracing::error!(
                    backend = BACKEND,
                    key = %key,
                    error = %e,
                    "Redis issued a token not above one this process already granted; refusing \
                     (the server lost its counter: set token_floor above it)"
                );
                return Err(e);
            }
            // Ours, and given back: the key is free, not busy. Another run of the script makes
            // a grant whose validity counts from its own send. (Not given back: the call's
            // guard stays armed and deletes it.)
            let gave_back = match gave_back {
                Ok(_) => "the lock was given back".to_owned(),
                Err(e) => {
                    format!("giving the lock back failed ({e}); it is deleted in the background")
                }
            };
            return Ok(Attempt::Again(Error::unavailable(
                BACKEND,
                format!(
                    "acquire: the grant's validity ({ttl:?} less a {margin:?} drift margin, \
                     counted from the send of the request that may have made it) ended before \
                     the grant was seen; {gave_back}"
                ),
            )));
        }
        let nonce = parts.nonce;
        let tracker = LeaseTracker::new(BACKEND, key.clone(), token, ttl, margin, sent_at);
        let head: Arc<str> = Arc::from(parts.head.as_str());
        lock(&self.inner.live).insert(LiveLease {
            nonce,
            tracker: tracker.clone(),
            keys: keys.clone(),
            head: head.clone(),
        });
        self.inner.monitor.watch(keys);
        Ok(Attempt::Granted(RedisLease::new(
            self.inner.clone(),
            keys.clone(),
            head,
            nonce,
            tracker,
        )))
    }
}
