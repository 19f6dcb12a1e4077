//! The interference cases: outside writes to a held key, lost replies, holders invalidated
//! behind their backs. Each pins a way a lock can be left locked, or a lease left `Held` that
//! the server no longer holds.

use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    keep, Bytes, Coordinator, Error, ForceRelease, KeeperOptions, Lease, LeaseOptions, LeaseStatus,
    LockKey, LostReason, Token,
};
use tokio::time::Instant;

use super::{
    boxed, unless_stalled, Case, CaseResult, Ctx, Failure, Need, Operator, Scoped, StallWatch,
    Verdict,
};
use crate::check;
use lease_testkit::proxy::FaultProxy;

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new("outside_write_to_held_key", &[Need::Operator], 40, |c| {
            boxed(outside_write(c))
        }),
        Case::new("release_reply_lost", &[Need::Proxy], 40, |c| {
            boxed(release_reply_lost(c))
        }),
        Case::new(
            "release_connection_reset_after_applied",
            &[Need::Proxy],
            40,
            |c| boxed(release_connection_reset(c)),
        ),
        Case::new(
            "release_sent_again_after_a_force_release",
            &[Need::Proxy],
            40,
            |c| boxed(release_after_force_release(c)),
        ),
        Case::new("release_dropped_before_it_ends", &[Need::Proxy], 40, |c| {
            boxed(release_dropped(c))
        }),
        Case::new(
            "try_acquire_connection_reset_after_applied",
            &[Need::Proxy],
            40,
            |c| boxed(try_acquire_connection_reset(c)),
        ),
        Case::new("acquire_reply_lost_while_held", &[Need::Proxy], 40, |c| {
            boxed(acquire_reply_lost_while_held(c))
        }),
        Case::new(
            "holder_invalidated_out_of_band",
            &[Need::Operator],
            40,
            |c| boxed(holder_invalidated(c)),
        ),
        Case::new(
            "force_release_expecting_a_token_spares_the_next_holder",
            &[Need::Proxy],
            40,
            |c| boxed(force_release_expecting_spares_next(c)),
        ),
        Case::new(
            "fence_write_unknown_outcome",
            &[Need::FenceProxy],
            20,
            |c| boxed(fence_write_unknown_outcome(c)),
        ),
    ]
}

fn operator(ctx: &Ctx) -> Result<Arc<dyn Operator>, Failure> {
    ctx.subject
        .operator
        .clone()
        .ok_or_else(|| Failure("no operator".into()))
}

fn res(key: &LockKey) -> lease_core::ResourceId {
    lease_core::ResourceId::from(key)
}

/// `inspect` shows nobody, or a holder with exactly `expected` (never a token no holder got).
async fn inspect_shows(
    client: &dyn Coordinator,
    key: &LockKey,
    expected: Token,
    when: &str,
) -> Result<(), Failure> {
    if let Some(h) = client.inspect(key).await? {
        let shown = Some(h.token);
        check!(
            shown.is_none_or(|t| t == expected),
            "{when}: inspect reported token {shown:?}, but the holder's token is {expected}"
        );
    }
    Ok(())
}

/// A fault proxy in front of the subject's server, and a client connected through it.
async fn client_behind_proxy(ctx: &Ctx) -> Result<(FaultProxy, Arc<dyn Coordinator>), Failure> {
    let (upstream, connect_via) = ctx
        .subject
        .proxy
        .clone()
        .ok_or_else(|| Failure("no proxy".into()))?;
    let proxy = FaultProxy::start(upstream).await?;
    let client = connect_via(proxy.addr()).await?;
    Ok((proxy, client))
}

/// Waits until the proxy has carried more request bytes than `sent` (a request reached the
/// server), polling, for at most `within`.
///
/// Any request counts, the client's background traffic too (a ZooKeeper ping, an etcd
/// keep-alive): a caller that starts its request right after taking `sent` sees its own
/// request unless a background one left in that same instant, and must stay correct (if
/// weaker) when one did.
async fn wait_for_request(proxy: &FaultProxy, sent: u64, within: Duration) -> Result<(), Failure> {
    let deadline = Instant::now() + within;
    while proxy.request_bytes() == sent {
        check!(
            Instant::now() < deadline,
            "no request reached the server through the proxy within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// Acquires `key` with `client` within `within`, retrying the outcomes a careful caller retries
/// (`OutcomeUnknown` after re-reading, `Unavailable`).
async fn acquire_within(
    client: &dyn Coordinator,
    key: &LockKey,
    ttl: Duration,
    within: Duration,
) -> Result<Box<dyn Lease>, Failure> {
    let deadline = Instant::now() + within;
    loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        match client
            .acquire(key, &LeaseOptions::new(ttl).wait(wait))
            .await
        {
            Ok(l) => return Ok(l),
            Err(e @ (Error::OutcomeUnknown { .. } | Error::Unavailable { .. }))
                if Instant::now() < deadline =>
            {
                tracing::debug!(error = %e, "acquire retried by the case");
                // The caller's documented next step after OutcomeUnknown: re-read.
                let _ = client.inspect(key).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                return Err(Failure(format!(
                    "acquire of {key:?} within {within:?} failed: {e}"
                )))
            }
        }
    }
}

/// A raw client overwrites the held lock's value. The holder keeps its token; `inspect` never
/// shows a token no holder got; release leaves the key free (at once when it reports `Ok`, at
/// the latest when the lease's TTL runs out on a backend that cannot tell an outside value from
/// another owner's); the next holder's token is greater.
async fn outside_write(ctx: Arc<Ctx>) -> CaseResult {
    let op = operator(&ctx)?;
    let key = ctx.key("outside-write");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let ttl = ctx.ttl() * 5;
    let lease = a.acquire(&key, &LeaseOptions::new(ttl)).await?;
    let token = lease.token();
    if !op
        .overwrite_value(&key)
        .await
        .map_err(|e| Failure(format!("outside write: {e}")))?
    {
        lease.release().await?;
        return Ok(Verdict::Skipped(
            "the backend has no plain (non-lock) write to a lock key".into(),
        ));
    }
    check!(lease.token() == token, "the holder's token changed");
    inspect_shows(&*b, &key, token, "after the outside write").await?;
    // Renewing either confirms (ownership is not the value) or reports the lease lost (the
    // backend cannot tell the outside value from another owner's): never `Held` on a lie.
    match lease.renew().await {
        Ok(_) => {
            // Still ours, so still locked for everyone else: `inspect` shows the holder (not a
            // free key) and another client is refused. Two holders would otherwise pass.
            let shown = b.inspect(&key).await?.map(|h| h.token);
            check!(
                shown == Some(token),
                "after a renew that kept the lease: inspect shows {shown:?}, not the holder's \
                 token {token}"
            );
            match b.try_acquire(&key, &LeaseOptions::new(ctx.ttl())).await {
                Err(Error::Held { .. }) => {}
                Ok(other) => {
                    let t = other.token();
                    let _ = other.release().await;
                    return Err(Failure(format!(
                        "another client acquired the key (token {t}) while the holder's renew \
                         after the outside write succeeded"
                    )));
                }
                Err(e) => return Err(Failure(format!("try_acquire of the held key: {e}"))),
            }
        }
        Err(Error::Lost { .. }) => {}
        Err(e) => return Err(Failure(format!("renew after an outside write: {e}"))),
    }
    let released = lease.release().await;
    check!(
        matches!(released, Ok(()) | Err(Error::Lost { .. })),
        "release after an outside write: {released:?}"
    );
    check!(
        matches!(lease.status(), LeaseStatus::Lost(_)),
        "a released lease is {:?}",
        lease.status()
    );
    let next = if released.is_ok() {
        // Deleted by the release: free within one round trip.
        b.try_acquire(&key, &LeaseOptions::new(ctx.ttl() * 20))
            .await
            .map_err(|e| Failure(format!("the key released after an outside write: {e}")))?
    } else {
        acquire_within(&*b, &key, ctx.ttl() * 20, ttl + ctx.ttl() * 5).await?
    };
    check!(
        next.token() > token,
        "next holder's token {} not above {token}",
        next.token()
    );
    inspect_shows(&*a, &key, next.token(), "the next holder").await?;
    next.release().await?;
    Ok(Verdict::Passed)
}

/// The release commits, its reply is lost. The lease is never `Held` again (a release that was
/// sent ends the lease whatever its outcome), and another client acquires.
async fn release_reply_lost(ctx: Arc<Ctx>) -> CaseResult {
    let (proxy, a) = client_behind_proxy(&ctx).await?;
    // Warm A up: one whole acquire/release, so the release below is one request (scripts
    // loaded, connections open), as in a long-running client.
    a.acquire(&ctx.key("warm-up"), &LeaseOptions::new(ctx.ttl()))
        .await?
        .release()
        .await?;
    let key = ctx.key("release-reply-lost");
    let lease: Arc<dyn Lease> =
        Arc::from(a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?);
    let token = lease.token();
    lease.renew().await?;
    let observer = ctx.client().await?;
    proxy.drop_replies();
    let releasing = {
        let lease = lease.clone();
        tokio::spawn(async move { lease.release().await })
    };
    // Once the release has applied at the server (seen by another client), its reply is lost
    // with the connection.
    let applied = Instant::now() + ctx.ttl() * 10;
    while observer.inspect(&key).await?.is_some() {
        check!(
            Instant::now() < applied,
            "the release never applied at the server"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    proxy.cut();
    let outcome = tokio::time::timeout(ctx.ttl() * 20, releasing)
        .await
        .map_err(|_| Failure("release with a lost reply did not return".into()))?
        .map_err(|e| Failure(format!("release panicked: {e}")))?;
    proxy.heal();
    check!(
        lease.status() != LeaseStatus::Held,
        "a lease whose release was sent is Held (release returned {outcome:?})"
    );
    // Watch across several renewal periods (background renewals, reconnects): never Held.
    let watch_until = Instant::now() + ctx.ttl() * 3;
    while Instant::now() < watch_until {
        check!(
            lease.status() != LeaseStatus::Held,
            "a lease whose release was sent became Held again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    check!(
        matches!(lease.renew().await, Err(Error::Lost { .. })),
        "renew of a released lease did not report Lost"
    );
    let b = ctx.client().await?;
    let next = acquire_within(&*b, &key, ctx.ttl() * 20, ctx.ttl() * 10).await?;
    check!(
        next.token() > token,
        "next holder's token {} not above {token}",
        next.token()
    );
    next.release().await?;
    drop(lease);
    Ok(Verdict::Passed)
}

/// The release applies at the server, its reply is lost and the connection is reset (a server
/// going down behind a proxy, a load balancer). Every adapter's release deletes only its own
/// lease's lock, so it is sent again on a new connection, and the resend's "not ours" is the
/// first send's doing while the lease was valid: release reports `Ok`, not `OutcomeUnknown`,
/// and the key is free at once.
async fn release_connection_reset(ctx: Arc<Ctx>) -> CaseResult {
    let (proxy, a) = client_behind_proxy(&ctx).await?;
    // Warm A up (connections, scripts, sessions) so the release below is one request.
    a.acquire(&ctx.key("warm-up"), &LeaseOptions::new(ctx.ttl()))
        .await?
        .release()
        .await?;
    let key = ctx.key("release-reset");
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?;
    let token = lease.token();
    let observer = ctx.client().await?;
    proxy.drop_replies();
    let releasing = tokio::spawn(async move { lease.release().await });
    // Once the release has applied (seen by another client), reset the connection under it.
    let applied = Instant::now() + ctx.ttl() * 10;
    while observer.inspect(&key).await?.is_some() {
        check!(
            Instant::now() < applied,
            "the release never applied at the server"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    proxy.cut();
    proxy.heal();
    let outcome = tokio::time::timeout(ctx.ttl() * 20, releasing)
        .await
        .map_err(|_| Failure("release after a connection reset did not return".into()))?
        .map_err(|e| Failure(format!("release panicked: {e}")))?;
    check!(
        outcome.is_ok(),
        "a release that applied, whose connection was then reset, returned {outcome:?} (sent \
         again, it finds the lock gone: released)"
    );
    // Free at once: one try, no wait.
    let next = observer
        .try_acquire(&key, &LeaseOptions::new(ctx.ttl() * 20))
        .await
        .map_err(|e| Failure(format!("the released key: {e}")))?;
    check!(
        next.token() > token,
        "next holder's token {} not above {token}",
        next.token()
    );
    next.release().await?;
    Ok(Verdict::Passed)
}

/// The release's first send is held in the network (the proxy forwards nothing) while an
/// operator force-releases the lock; the held send is then dropped with its connection, and the
/// release, sent again, finds the lock gone. Not its own doing: the lease was revoked, and the
/// release reports `Lost(Revoked)`, as the force-release's record shows, never `Ok` (which
/// `release_connection_reset_after_applied` rightly gets when the first send did delete it).
async fn release_after_force_release(ctx: Arc<Ctx>) -> CaseResult {
    let (proxy, a) = client_behind_proxy(&ctx).await?;
    // Warm A up (connections, scripts, sessions) so the release below is one request.
    a.acquire(&ctx.key("warm-up"), &LeaseOptions::new(ctx.ttl()))
        .await?
        .release()
        .await?;
    let key = ctx.key("release-forced");
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?;
    let token = lease.token();
    let operator = ctx.client().await?;
    proxy.blackhole();
    let releasing = tokio::spawn(async move {
        let outcome = lease.release().await;
        (outcome, lease.status())
    });
    // Until the release's request is held in the proxy: more bytes than a keep-alive's or a
    // ping's. (A background request held first ends this wait early; the release then goes out
    // after the force-release, and must report the same.)
    let held = Instant::now() + ctx.ttl() * 10;
    while proxy.held_request_bytes()? < 40 {
        check!(
            Instant::now() < held,
            "the release's request never reached the proxy"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let removed = operator
        .force_release(
            &key,
            &ForceRelease::new("conformance", "revoked while its holder released")?,
        )
        .await?;
    check!(
        removed.as_ref().map(|h| h.token) == Some(token),
        "the force-release removed {removed:?}, not the holder of token {token}"
    );
    // The held request goes with its connection; the client sends it again on a new one.
    proxy.cut();
    proxy.heal();
    let (outcome, status) = tokio::time::timeout(ctx.ttl() * 20, releasing)
        .await
        .map_err(|_| Failure("release after a connection reset did not return".into()))?
        .map_err(|e| Failure(format!("release panicked: {e}")))?;
    check!(
        matches!(
            outcome,
            Err(Error::Lost {
                reason: LostReason::Revoked,
                ..
            })
        ),
        "a release whose lock an operator force-released before its resend returned \
         {outcome:?}, not Lost(Revoked)"
    );
    check!(
        status == LeaseStatus::Lost(LostReason::Revoked),
        "the lease reports {status:?} after a force-release, not Lost(Revoked)"
    );
    Ok(Verdict::Passed)
}

/// A release's future is dropped while its request is held in the network (a caller's timeout
/// around `release`). The holder asked for the release: the lease is `Lost(Released)` at once
/// and never `Held` again, and once the network is back the lock is deleted in the background
/// (the held request goes with its connection), long before its TTL would free it.
async fn release_dropped(ctx: Arc<Ctx>) -> CaseResult {
    let (proxy, a) = client_behind_proxy(&ctx).await?;
    // Warm A up (connections, scripts, sessions) so the release below is one request.
    a.acquire(&ctx.key("warm-up"), &LeaseOptions::new(ctx.ttl()))
        .await?
        .release()
        .await?;
    let key = ctx.key("release-dropped");
    let ttl = ctx.ttl() * 40;
    let lease: Arc<dyn Lease> = Arc::from(a.acquire(&key, &LeaseOptions::new(ttl)).await?);
    let token = lease.token();
    proxy.blackhole();
    // Polled (so started) first, then dropped once its request is held in the proxy: more
    // bytes than a keep-alive's or a ping's. (A background request held first ends the wait
    // early; the release is then dropped before its request was sent, which must end the lease
    // the same way.)
    let held = async {
        let until = Instant::now() + ctx.ttl() * 10;
        while proxy.held_request_bytes()? < 40 {
            check!(
                Instant::now() < until,
                "the release's request never reached the proxy"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok::<_, Failure>(())
    };
    tokio::select! {
        biased;
        outcome = lease.release() => {
            return Err(Failure(format!(
                "the release returned {outcome:?} while its request was held"
            )));
        }
        held = held => held?,
    }
    let status = lease.status();
    check!(
        status == LeaseStatus::Lost(LostReason::Released),
        "a lease whose release was dropped before it ended reports {status:?}, not \
         Lost(Released)"
    );
    proxy.cut();
    proxy.heal();
    // Freed by the background delete, well within its TTL; never Held again meanwhile.
    let b = ctx.client().await?;
    let next = acquire_within(&*b, &key, ctx.ttl() * 20, ttl / 4).await?;
    check!(
        lease.status() == LeaseStatus::Lost(LostReason::Released),
        "the lease whose release was dropped reports {:?} once its lock was freed",
        lease.status()
    );
    check!(
        next.token() > token,
        "next holder's token {} not above {token}",
        next.token()
    );
    check!(
        matches!(lease.renew().await, Err(Error::Lost { .. })),
        "renew of a lease whose release was dropped did not report Lost"
    );
    next.release().await?;
    Ok(Verdict::Passed)
}

/// A `try_acquire` of a free key applies at the server, its reply is lost and the connection
/// is reset. Sent again, the attempt recognises its own grant: it returns a lease with the token
/// `inspect` shows, not `OutcomeUnknown` nor `Held` by itself; releasing it frees the key.
async fn try_acquire_connection_reset(ctx: Arc<Ctx>) -> CaseResult {
    let (proxy, a) = client_behind_proxy(&ctx).await?;
    let key = ctx.key("try-acquire-reset");
    let ttl = ctx.ttl() * 20;
    // Warm A up on the same key with the same TTL (a backend may keep a session per TTL), so
    // the lost reply is the attempt's.
    let first = a.try_acquire(&key, &LeaseOptions::new(ttl)).await?;
    let before = first.token();
    first.release().await?;
    let observer = ctx.client().await?;
    proxy.drop_replies();
    let acquiring = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.try_acquire(&key, &LeaseOptions::new(ttl)).await })
    };
    let applied = Instant::now() + ctx.ttl() * 10;
    let seen = loop {
        if let Some(h) = observer.inspect(&key).await? {
            break h;
        }
        check!(
            Instant::now() < applied,
            "the try_acquire never applied at the server"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    proxy.cut();
    proxy.heal();
    let outcome = tokio::time::timeout(ctx.ttl() * 20, acquiring)
        .await
        .map_err(|_| Failure("try_acquire after a connection reset did not return".into()))?
        .map_err(|e| Failure(format!("try_acquire panicked: {e}")))?;
    let lease = match outcome {
        Ok(l) => l,
        Err(e) => {
            return Err(Failure(format!(
                "a try_acquire that applied, whose connection was then reset, returned {e} \
                 (sent again, it finds its own grant)"
            )))
        }
    };
    // The token is the grant's, or (a backend whose resend rewrites the lock) a later one of
    // the same holder's; either way the one `inspect` shows now.
    let shown = observer.inspect(&key).await?.map(|h| h.token);
    check!(
        lease.token() >= seen.token && lease.token() > before && shown == Some(lease.token()),
        "the lease's token {} is not the one granted ({} seen, above {before}; inspect shows \
         {shown:?})",
        lease.token(),
        seen.token
    );
    check!(
        lease.status() == LeaseStatus::Held,
        "the lease is {:?}",
        lease.status()
    );
    lease.release().await?;
    let next = observer
        .try_acquire(&key, &LeaseOptions::new(ctx.ttl()))
        .await
        .map_err(|e| Failure(format!("the released key: {e}")))?;
    next.release().await?;
    Ok(Verdict::Passed)
}

/// B's first acquire attempt reaches the server while A holds the key and its reply is lost;
/// A keeps the key for several TTLs, then releases. B acquires promptly, with a lease that is
/// held with (nearly) its full validity, and leaves nothing behind.
async fn acquire_reply_lost_while_held(ctx: Arc<Ctx>) -> CaseResult {
    unless_stalled(&ctx, "acquire_reply_lost_while_held", |n| {
        let ctx = ctx.clone();
        async move { acquire_reply_lost_attempt(&ctx, n).await }
    })
    .await
}

/// One attempt of [`acquire_reply_lost_while_held`]. `Some(why)` when A's short kept lease
/// expired, or B's hand-off ran late, while a stall at least half a TTL long was seen (see
/// `keep_past_ttl` in the basic cases for why half).
async fn acquire_reply_lost_attempt(ctx: &Ctx, n: u32) -> Result<Option<String>, Failure> {
    let (upstream, connect_via) = ctx
        .subject
        .proxy
        .clone()
        .ok_or_else(|| Failure("no proxy".into()))?;
    let key = ctx.key(&format!("acquire-reply-lost-{n}"));
    let watch = StallWatch::start(ctx).await?;
    let a = ctx.client().await?;
    let held = keep(
        a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?,
        KeeperOptions::new(),
    )?;
    let token_a = held.token();
    let proxy = FaultProxy::start(upstream).await?;
    let b = connect_via(proxy.addr()).await?;
    // Warm B up (connections, scripts, subscriptions) so the next request is the attempt.
    check!(
        matches!(
            b.try_acquire(&key, &LeaseOptions::new(ctx.ttl())).await,
            Err(Error::Held { .. })
        ),
        "try_acquire of a held key did not report Held"
    );
    let sent = proxy.request_bytes();
    proxy.drop_replies();
    let ttl_b = ctx.ttl() * 10;
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        let within = ctx.ttl() * 15;
        Scoped::spawn(async move {
            let l = acquire_within(&*b, &key, ttl_b, within).await;
            (l, Instant::now())
        })
    };
    // Once the attempt has reached the server, its reply is lost with the connection. (Any
    // request counts: a background one of B's may come first, and then the attempt itself is
    // what is lost; both are outcomes B must handle.)
    wait_for_request(&proxy, sent, ctx.ttl() * 10).await?;
    proxy.cut();
    proxy.heal();
    // A holds on for several TTLs, renewed by its keeper.
    let hold_until = Instant::now() + ctx.ttl() * 3;
    while Instant::now() < hold_until {
        // Not lost (in doubt while one of its renewal tries is slow is not a loss), unless a
        // stall kept its renewal from being answered in time.
        if held.lease().status() == LeaseStatus::Lost(LostReason::Expired) {
            if let Some(why) = watch.stalled(ctx.ttl() / 2) {
                return Ok(Some(why));
            }
        }
        check!(
            !matches!(held.lease().status(), LeaseStatus::Lost(_)),
            "A's kept lease is {:?} (longest stall seen: {:?})",
            held.lease().status(),
            watch.worst()
        );
        check!(
            !waiter.is_finished(),
            "B's acquire ended while A held the key (it must keep waiting)"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released_at = Instant::now();
    match held.release().await {
        Ok(()) => {}
        Err(Error::Lost {
            reason: LostReason::Expired,
            ..
        }) if watch.stalled(ctx.ttl() / 2).is_some() => {
            return Ok(watch.stalled(ctx.ttl() / 2));
        }
        Err(e) => return Err(e.into()),
    }
    let (got, got_at) = waiter
        .await
        .map_err(|e| Failure(format!("waiter panicked: {e}")))?;
    let took = got_at.saturating_duration_since(released_at);
    if took > ctx.ttl() * 2 {
        if let Some(why) = watch.stalled(ctx.ttl() / 2) {
            if let Ok(lease) = got {
                lease.release().await?;
            }
            return Ok(Some(why));
        }
    }
    let lease = got?;
    check!(
        took <= ctx.ttl() * 2,
        "B acquired {took:?} after A's release (expected promptly; longest stall seen: {:?})",
        watch.worst()
    );
    // Validity counts from the attempt that was granted, not from the lost one. (A backend
    // without per-lease TTLs caps validity at its session's, renewed at half its TTL.)
    let caps = b.capabilities();
    let full = if caps.per_lease_ttl {
        ttl_b
    } else {
        ttl_b.min(caps.min_ttl)
    };
    check!(
        lease.status() == LeaseStatus::Held && lease.remaining() > full / 4,
        "B's lease is {:?} with {:?} left (a fresh grant has about {full:?})",
        lease.status(),
        lease.remaining()
    );
    check!(
        lease.token() > token_a,
        "B's token {} not above A's {token_a}",
        lease.token()
    );
    lease.release().await?;
    // Nothing left behind: a fresh client takes the key at once.
    let c = ctx.client().await?;
    let after = c
        .try_acquire(&key, &LeaseOptions::new(ctx.ttl()))
        .await
        .map_err(|e| Failure(format!("the key after B's release: {e}")))?;
    after.release().await?;
    Ok(None)
}

/// An operator destroys the session, lease or node behind a held lock. The holder's `lost()`
/// fires within a round trip (bounded here by three short TTLs, leaving a loaded machine room
/// and still under half the time to the keeper's first renewal of a lease of 20 short TTLs),
/// and a new holder gets a greater token.
async fn holder_invalidated(ctx: Arc<Ctx>) -> CaseResult {
    let op = operator(&ctx)?;
    let key = ctx.key("invalidated");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let kept = keep(
        a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?,
        KeeperOptions::new(),
    )?;
    let token = kept.token();
    let mut lost = kept.lost();
    let acted = Instant::now();
    if !op
        .invalidate_holder(&key)
        .await
        .map_err(|e| Failure(format!("invalidating the holder: {e}")))?
    {
        kept.release().await?;
        return Ok(Verdict::Skipped(
            "the backend has no operator action that invalidates a holder".into(),
        ));
    }
    // B starts waiting for the key at once.
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        let within = ctx.ttl() * 25;
        let ttl = ctx.ttl() * 20;
        let seen = kept.lost();
        tokio::spawn(async move {
            let got = acquire_within(&*b, &key, ttl, within).await;
            // What A's own view was at the moment B held the key.
            (got, seen.status())
        })
    };
    let bound = ctx.ttl() * 3;
    let reason = tokio::time::timeout(bound, lost.wait())
        .await
        .map_err(|_| {
            Failure(format!(
                "the holder's lost() did not fire within {bound:?} of the operator's action"
            ))
        })?;
    tracing::debug!(%reason, after = ?acted.elapsed(), "holder noticed the invalidation");
    check!(
        kept.lease().ensure_held().is_err(),
        "an invalidated lease still reports Held"
    );
    let (next, a_seen) = waiter
        .await
        .map_err(|e| Failure(format!("waiter panicked: {e}")))?;
    let next = next?;
    if !b.capabilities().lock_delay.is_zero() {
        check!(
            a_seen != LeaseStatus::Held,
            "a new holder acquired while the invalidated holder still reported Held, on a \
             backend with a {:?} lock-delay",
            b.capabilities().lock_delay
        );
    }
    check!(
        next.token() > token,
        "next holder's token {} not above the invalidated holder's {token}",
        next.token()
    );
    next.release().await?;
    Ok(Verdict::Passed)
}

/// A fence write whose reply is lost reports `OutcomeUnknown` (never a success, never a false
/// `Stale`), and a later write with the same token is the value that stands.
async fn fence_write_unknown_outcome(ctx: Arc<Ctx>) -> CaseResult {
    let (upstream, fence_via) = ctx
        .subject
        .fence_proxy
        .clone()
        .ok_or_else(|| Failure("no fence proxy".into()))?;
    let key = ctx.key("fence-unknown");
    let resource = res(&key);
    let a = ctx.client().await?;
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?;
    let token = lease.token();
    ctx.fence().claim(&resource, token).await?;
    let proxy = FaultProxy::start(upstream).await?;
    let slow = fence_via(proxy.addr()).await?;
    slow.write(&resource, token, Bytes::from_static(b"first"))
        .await?;
    // What one write costs on the wire once connected, to tell one copy from a re-send.
    let before = proxy.request_bytes();
    slow.write(&resource, token, Bytes::from_static(b"second"))
        .await?;
    let one_write = proxy.request_bytes() - before;
    let sent = proxy.request_bytes();
    proxy.drop_replies();
    let writing = {
        let (slow, resource) = (slow.clone(), resource.clone());
        tokio::spawn(async move {
            slow.write(&resource, token, Bytes::from_static(b"v1, reply lost"))
                .await
        })
    };
    // Once the write has applied (read through another connection), its reply is lost with the
    // connection.
    let applied = Instant::now() + Duration::from_secs(10);
    loop {
        let state = ctx.fence().read(&resource).await?;
        if state
            .as_ref()
            .and_then(|s| s.value.as_ref())
            .is_some_and(|(_, v)| v.as_ref() == b"v1, reply lost")
        {
            break;
        }
        check!(
            Instant::now() < applied,
            "the write never applied at the fence's storage"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    proxy.cut();
    let lost = tokio::time::timeout(Duration::from_secs(10) + ctx.ttl() * 5, writing)
        .await
        .map_err(|_| Failure("a fence write with a lost reply did not return".into()))?
        .map_err(|e| Failure(format!("fence write panicked: {e}")))?;
    let resent = proxy.request_bytes() - sent;
    proxy.heal();
    // One copy, with slack for keepalive or flow-control frames: a blind re-send would carry
    // the whole write again (at least twice the bytes).
    check!(
        resent <= one_write + one_write / 2 + 64,
        "the fence sent {resent} request bytes for one write of about {one_write}: it re-sent \
         a write whose outcome was unknown"
    );
    check!(
        matches!(lost, Err(Error::OutcomeUnknown { .. })),
        "a fence write whose reply was lost returned {lost:?}, expected OutcomeUnknown"
    );
    ctx.fence()
        .write(&resource, token, Bytes::from_static(b"v2"))
        .await?;
    let state = ctx.fence().read(&resource).await?;
    let value = state.as_ref().and_then(|s| s.value.as_ref());
    check!(
        value.is_some_and(|(t, v)| *t == token && v.as_ref() == b"v2"),
        "after a lost-reply write and a later write of the same token, the fence holds {value:?}"
    );
    lease.release().await?;
    Ok(Verdict::Passed)
}

/// A force-release that expects the holder's token compares and removes as one step. The
/// operator's requests are delayed on their way; once the first one has reached the server, the
/// holder releases and another client acquires, before a second request could arrive. A
/// force-release that read the holder and then removed whatever held the key would remove the
/// new holder; a compare-and-remove removes the expected holder (if it came first) or nothing.
async fn force_release_expecting_spares_next(ctx: Arc<Ctx>) -> CaseResult {
    // Each way; a round trip through the proxy stays well under the suite's request timeouts.
    const DELAY: Duration = Duration::from_millis(150);
    let (upstream, connect_via) = ctx
        .subject
        .proxy
        .clone()
        .ok_or_else(|| Failure("no proxy".into()))?;
    let key = ctx.key("expect-one-step");
    // Long enough not to end by itself while the operator's requests are delayed.
    let ttl = ctx.ttl() * 10;
    let a = ctx.client().await?;
    // Connected now, so that the holder changes within milliseconds once it is time.
    let b = ctx.client().await?;
    let first = a.acquire(&key, &LeaseOptions::new(ttl)).await?;
    let expected = first.token();
    let proxy = FaultProxy::start(upstream).await?;
    let op = connect_via(proxy.addr()).await?;
    // Warm the operator up (connections, scripts), so that its next request is the release.
    op.inspect(&key).await?;
    let sent = proxy.request_bytes();
    proxy.delay(DELAY);
    let forced = {
        let (op, key) = (op.clone(), key.clone());
        let request = ForceRelease::new("conformance", "one-step check")?.expect_token(expected);
        tokio::spawn(async move { op.force_release(&key, &request).await })
    };
    // (A background request of the operator's may arrive first, if it left in the instant
    // between `sent` and the force-release: the holder then changes before the release's first
    // request, which must then remove nothing. Pings come seconds apart, so that is rare; the
    // usual run is the one that tells a one-step compare from a read and a remove: a Redis
    // build that read the holder and then removed unconditionally failed this case 5 of 5.)
    wait_for_request(&proxy, sent, DELAY * 25).await?;
    // Removed by the force-release already, or released now: either is fine.
    let _ = first.release().await;
    let next = b
        .acquire(&key, &LeaseOptions::new(ttl).wait(ctx.ttl() * 4))
        .await?;
    let outcome = forced
        .await
        .map_err(|e| Failure(format!("force_release panicked: {e}")))?;
    proxy.heal();
    match &outcome {
        Ok(Some(removed)) => check!(
            removed.token == expected,
            "force_release expecting token {expected} removed the holder with token {}",
            removed.token
        ),
        Ok(None) | Err(Error::HolderChanged { .. }) => {}
        Err(e) => return Err(Failure(format!("force_release failed: {e}"))),
    }
    let shown = b.inspect(&key).await?.map(|h| h.token);
    check!(
        shown == Some(next.token()),
        "after force_release expecting {expected} answered {outcome:?}, the next holder \
         (token {}) is gone: inspect shows {shown:?}",
        next.token()
    );
    next.release().await?;
    Ok(Verdict::Passed)
}
