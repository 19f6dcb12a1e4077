//! The lock cases: exclusion, token order, waiting, ownership checks, keys, input, operators.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    acquire_many, keep, Bytes, Coordinator, Error, ForceRelease, InvalidInput, KeeperOptions,
    LeaseOptions, LeaseStatus, LockKey, LostReason, OwnerId, Token,
};
use tokio::time::Instant;

use super::{boxed, unless_stalled, Case, CaseResult, Ctx, Failure, StallWatch, Verdict};
use crate::check;

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new("mutual_exclusion_16_contenders", &[], 60, |c| {
            boxed(mutual_exclusion(c))
        }),
        Case::new("tokens_increase_across_handoffs", &[], 20, |c| {
            boxed(tokens_increase(c))
        }),
        Case::new("try_acquire_and_wait_bound", &[], 20, |c| {
            boxed(try_and_wait(c))
        }),
        Case::new("stale_release_and_renew_are_no_ops", &[], 20, |c| {
            boxed(stale_release_and_renew(c))
        }),
        Case::new("renew_extends_validity", &[], 20, |c| {
            boxed(renew_extends(c))
        }),
        Case::new("lost_fires_on_expiry", &[], 20, |c| {
            boxed(lost_on_expiry(c))
        }),
        Case::new("lost_fires_on_revocation", &[], 20, |c| {
            boxed(lost_on_revocation(c))
        }),
        Case::new(
            "keeper_holds_past_ttl_and_stops_when_dropped",
            &[],
            30,
            |c| boxed(keeper(c)),
        ),
        Case::new("cancelled_acquire_leaves_nothing", &[], 40, |c| {
            boxed(cancelled_acquire(c))
        }),
        Case::new("settle_leaves_nothing_of_what_was_given_up", &[], 60, |c| {
            boxed(settle_after_giving_up(c))
        }),
        Case::new("keys_are_independent", &[], 20, |c| {
            boxed(key_independence(c))
        }),
        Case::new("bad_input_is_rejected_before_sending", &[], 10, |c| {
            boxed(bad_input(c))
        }),
        Case::new("inspect_and_force_release", &[], 20, |c| {
            boxed(inspect_and_force(c))
        }),
        Case::new(
            "force_release_with_a_stale_expected_token_removes_nothing",
            &[],
            20,
            |c| boxed(force_with_expected_token(c)),
        ),
        Case::new(
            "audit_trail_lists_forced_releases_newest_first",
            &[],
            20,
            |c| boxed(audit_trail_newest_first(c)),
        ),
        Case::new("multi_lock_opposite_orders_no_deadlock", &[], 60, |c| {
            boxed(multi_lock(c))
        }),
        Case::new("fence_semantics", &[], 10, |c| boxed(fence_semantics(c))),
    ]
}

fn opts(ctx: &Ctx) -> LeaseOptions {
    LeaseOptions::new(ctx.ttl())
}

/// A long TTL for leases that must not expire during a case step.
fn long(ctx: &Ctx) -> LeaseOptions {
    LeaseOptions::new(ctx.ttl() * 20)
}

async fn mutual_exclusion(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("contended");
    let resource = ctx.resource(&key);
    let inside = Arc::new(AtomicBool::new(false));
    let entries = Arc::new(AtomicUsize::new(0));
    let tokens = Arc::new(std::sync::Mutex::new(
        Vec::<(Instant, Instant, Token)>::new(),
    ));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let client = ctx.client().await?;
        let (inside, entries, tokens, key, resource, fence) = (
            inside.clone(),
            entries.clone(),
            tokens.clone(),
            key.clone(),
            resource.clone(),
            ctx.fence().clone(),
        );
        let holds: Vec<u64> = (0..4)
            .map(|_| ctx.random(0..(ctx.ttl().as_millis() as u64 / 20).max(2)))
            .collect();
        let options = long(&ctx).wait(ctx.ttl() * 50);
        tasks.push(tokio::spawn(async move {
            for hold in holds {
                let called = Instant::now();
                let lease = client.acquire(&key, &options).await?;
                let got = Instant::now();
                if inside.swap(true, Ordering::SeqCst) {
                    return Err(Failure(format!(
                        "two holders inside at once (token {})",
                        lease.token()
                    )));
                }
                entries.fetch_add(1, Ordering::SeqCst);
                fence.claim(&resource, lease.token()).await?;
                tokio::time::sleep(Duration::from_millis(hold)).await;
                fence
                    .write(
                        &resource,
                        lease.token(),
                        Bytes::from(lease.token().to_string()),
                    )
                    .await?;
                tokens
                    .lock()
                    .expect("lock")
                    .push((called, got, lease.token()));
                inside.store(false, Ordering::SeqCst);
                lease.release().await?;
            }
            Ok::<_, Failure>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Failure(format!("contender panicked: {e}")))??;
    }
    check!(entries.load(Ordering::SeqCst) == 64, "expected 64 holdings");
    let mut seen = tokens.lock().expect("lock").clone();
    seen.sort_by_key(|(_, got, _)| *got);
    for w in seen.windows(2) {
        check!(
            w[0].2 < w[1].2,
            "tokens not increasing in acquisition order: {} then {}",
            w[0].2,
            w[1].2
        );
    }
    Ok(Verdict::Passed)
}

async fn tokens_increase(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("handoff");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let mut last = Token::ZERO;
    for round in 0..3 {
        // Hand-off by release.
        let l = a.acquire(&key, &opts(&ctx).wait(ctx.ttl() * 10)).await?;
        check!(
            l.token() > last,
            "round {round}: token {} after {last} (release hand-off)",
            l.token()
        );
        last = l.token();
        l.release().await?;
        // Hand-off by expiry: the holder never releases.
        let l = a.acquire(&key, &opts(&ctx).wait(ctx.ttl() * 10)).await?;
        check!(
            l.token() > last,
            "round {round}: token {} after {last}",
            l.token()
        );
        last = l.token();
        let stale = l;
        let t = b.acquire(&key, &opts(&ctx).wait(ctx.ttl() * 10)).await?;
        check!(
            t.token() > last,
            "round {round}: token {} after {last} (expiry takeover)",
            t.token()
        );
        last = t.token();
        t.release().await?;
        drop(stale);
    }
    Ok(Verdict::Passed)
}

async fn try_and_wait(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("try");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let held = a.acquire(&key, &long(&ctx)).await?;
    match b.try_acquire(&key, &opts(&ctx)).await {
        Err(Error::Held { .. }) => {}
        other => {
            return Err(Failure(format!(
                "try_acquire on a held key: expected Held, got {other:?}"
            )))
        }
    }
    // `try_acquire` ignores a wait bound: Held at once, not after waiting for the key. (A bound
    // shorter than the holder's TTL, so that a try that waits it out answers `Held` too, and
    // is caught by the time it took.)
    let bound = ctx.ttl() * 10;
    let start = Instant::now();
    let tried = b.try_acquire(&key, &opts(&ctx).wait(bound)).await;
    let took = start.elapsed();
    let prompt = (ctx.ttl() * 2 + ctx.scaled(Duration::from_secs(1))).min(bound / 2);
    check!(
        took < prompt,
        "try_acquire with a wait bound of {bound:?} waited {took:?} on a held key"
    );
    check!(
        matches!(tried, Err(Error::Held { .. })),
        "try_acquire with a wait bound on a held key: expected Held, got {tried:?}"
    );
    let wait = ctx.ttl() / 2;
    let start = Instant::now();
    match b.acquire(&key, &opts(&ctx).wait(wait)).await {
        Err(Error::Timeout { waited, .. }) => {
            let took = start.elapsed();
            check!(
                took >= wait,
                "timed out after {took:?}, before the wait bound {wait:?}"
            );
            let late = wait + ctx.ttl() + ctx.scaled(Duration::from_secs(1));
            check!(
                took <= late,
                "timed out after {took:?}, long past the wait bound {wait:?}"
            );
            check!(
                waited >= wait.mul_f64(0.9),
                "reported waited {waited:?} below the bound {wait:?}"
            );
        }
        other => {
            return Err(Failure(format!(
                "acquire with a wait bound on a held key: expected Timeout, got {other:?}"
            )))
        }
    }
    check!(
        held.status() == LeaseStatus::Held,
        "holder disturbed by the timed-out waiter: {:?}",
        held.status()
    );
    let waiter = {
        let b = b.clone();
        let key = key.clone();
        let o = opts(&ctx).wait(ctx.ttl() * 20);
        tokio::spawn(async move { b.acquire(&key, &o).await })
    };
    tokio::time::sleep(ctx.ttl() / 4).await;
    check!(
        !waiter.is_finished(),
        "waiter acquired while the key was held"
    );
    held.release().await?;
    let got = tokio::time::timeout(ctx.ttl() * 10, waiter)
        .await
        .map_err(|_| Failure("waiter not woken after release".into()))?
        .map_err(|e| Failure(format!("waiter panicked: {e}")))??;
    check!(
        got.token() > held.token(),
        "waiter token {} not above {}",
        got.token(),
        held.token()
    );
    got.release().await?;
    Ok(Verdict::Passed)
}

async fn stale_release_and_renew(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("stale");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let old = a.acquire(&key, &opts(&ctx)).await?;
    let new = b.acquire(&key, &long(&ctx).wait(ctx.ttl() * 10)).await?;
    check!(
        new.token() > old.token(),
        "takeover token {} not above {}",
        new.token(),
        old.token()
    );
    match old.renew().await {
        Err(Error::Lost { .. }) => {}
        other => {
            return Err(Failure(format!(
                "stale renew: expected Lost, got {other:?}"
            )))
        }
    }
    match old.release().await {
        Err(Error::Lost { .. }) => {}
        other => {
            return Err(Failure(format!(
                "stale release: expected Lost, got {other:?}"
            )))
        }
    }
    let holder = b.inspect(&key).await?;
    check!(
        holder.as_ref().map(|h| h.token) == Some(new.token()),
        "after a stale release the new owner must still hold the key, inspect shows {holder:?}"
    );
    match a.try_acquire(&key, &opts(&ctx)).await {
        Err(Error::Held { .. }) => {}
        other => {
            return Err(Failure(format!(
                "key must still be held by the new owner, try_acquire gave {other:?}"
            )))
        }
    }
    new.renew().await?;
    new.release().await?;
    Ok(Verdict::Passed)
}

async fn renew_extends(ctx: Arc<Ctx>) -> CaseResult {
    // A renewal whose reply comes after the lease's validity has ended must report the loss, and
    // on a loaded machine (an fsync stall, a starved scheduler) one can: such an attempt starts
    // again. A loss reported while the reply came in time fails the case at once.
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    unless_stalled(&ctx, "renew_extends_validity", |n| {
        let key = ctx.key(&format!("renew-{n}"));
        let (ctx, a, b) = (ctx.clone(), a.clone(), b.clone());
        async move { renew_past_first_validity(&ctx, &a, &b, &key).await }
    })
    .await
}

/// Holds `key` past the validity of its first grant by renewing halfway through what is left,
/// checking after every renewal that the key is still refused to `b`. `Some(why)` when a renewal
/// was answered only after the validity it was sent in had ended (the lease is then lost, as it
/// must be, and nothing is proven).
async fn renew_past_first_validity(
    ctx: &Ctx,
    a: &Arc<dyn Coordinator>,
    b: &Arc<dyn Coordinator>,
    key: &LockKey,
) -> Result<Option<String>, Failure> {
    let lease = a.acquire(key, &opts(ctx)).await?;
    let first = lease.valid_until();
    for _ in 0..4 {
        let left = lease
            .valid_until()
            .saturating_duration_since(Instant::now());
        tokio::time::sleep(left / 2).await;
        let sent = Instant::now();
        let left = lease.valid_until().saturating_duration_since(sent);
        let until = match lease.renew().await {
            Ok(until) => until,
            Err(Error::Lost {
                reason: LostReason::Expired,
                ..
            }) if sent.elapsed() >= left => {
                return Ok(Some(format!(
                    "the renewal took {:?} with {left:?} of validity left",
                    sent.elapsed()
                )))
            }
            Err(e) => return Err(e.into()),
        };
        check!(
            until > first,
            "renew did not move validity ({until:?} <= {first:?})"
        );
        match b.try_acquire(key, &opts(ctx)).await {
            Err(Error::Held { .. }) => {}
            other => {
                return Err(Failure(format!(
                    "renewed lease lost the key: try_acquire gave {other:?}"
                )))
            }
        }
    }
    check!(
        Instant::now() > first,
        "four renewals did not outlast the first grant's validity"
    );
    check!(
        lease.status() == LeaseStatus::Held,
        "status after renewals: {:?}",
        lease.status()
    );
    // The server keeps the key for as long as the last renewal's validity says: when the
    // holder vanishes (no release, no destructor), the key comes free no earlier than that.
    super::vanish_and_take_over(ctx, lease, &**b, key, "the renewed holder").await?;
    Ok(None)
}

async fn lost_on_expiry(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("expiry");
    let a = ctx.client().await?;
    let lease = a.acquire(&key, &opts(&ctx)).await?;
    let valid_until = lease.valid_until();
    let mut signal = lease.lost();
    let reason = tokio::time::timeout(ctx.ttl() * 4, signal.wait())
        .await
        .map_err(|_| Failure("lost() did not fire after the TTL".into()))?;
    check!(
        Instant::now() >= valid_until,
        "lost() fired before validity ended"
    );
    check!(
        reason == LostReason::Expired,
        "reason {reason:?}, expected Expired"
    );
    // The server forgets the expired holder too: no ghost left for `inspect` to show.
    let gone_by = Instant::now() + ctx.ttl() * 2 + ctx.scaled(Duration::from_secs(2));
    while let Some(holder) = a.inspect(&key).await? {
        check!(
            Instant::now() < gone_by,
            "inspect still shows the expired holder {holder:?}"
        );
        tokio::time::sleep(ctx.ttl() / 20).await;
    }
    match lease.renew().await {
        Err(Error::Lost { .. }) => {}
        other => {
            return Err(Failure(format!(
                "renew after expiry: expected Lost, got {other:?}"
            )))
        }
    }
    Ok(Verdict::Passed)
}

async fn lost_on_revocation(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("revoke");
    let (a, op) = (ctx.client().await?, ctx.client().await?);
    let lease = a.acquire(&key, &long(&ctx)).await?;
    let mut signal = lease.lost();
    let removed = op
        .force_release(&key, &ForceRelease::new("conformance", "revocation case")?)
        .await?;
    check!(
        removed.map(|h| h.token) == Some(lease.token()),
        "force_release did not report the holder"
    );
    // A backend may learn of the revocation only when the holder next talks to it.
    let renew = lease.renew().await;
    check!(
        matches!(renew, Err(Error::Lost { .. })),
        "renew after revocation: expected Lost, got {renew:?}"
    );
    let reason = tokio::time::timeout(ctx.ttl(), signal.wait())
        .await
        .map_err(|_| Failure("lost() did not fire after revocation and a failed renew".into()))?;
    check!(
        matches!(reason, LostReason::Revoked | LostReason::Superseded),
        "reason {reason:?}, expected Revoked or Superseded"
    );
    Ok(Verdict::Passed)
}

async fn keeper(ctx: Arc<Ctx>) -> CaseResult {
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    unless_stalled(&ctx, "keeper_holds_past_ttl_and_stops_when_dropped", |n| {
        let key = ctx.key(&format!("keeper-{n}"));
        let (ctx, a, b) = (ctx.clone(), a.clone(), b.clone());
        async move { keep_past_ttl(&ctx, &a, &b, &key).await }
    })
    .await
}

/// A kept lease holds `key` for three TTLs while `b` is refused, and dropping the keeper frees
/// it. `Some(why)` when the lease expired while a stall at least half a TTL long was seen (the
/// keeper renews a third of the way into each validity, so a stall that long can keep a correct
/// renewal from being answered in time, and a renewal answered after validity ended loses the
/// lease, as it must). Never when `b` was granted the key before that validity ended: two
/// holders at once fail the case, stall or not.
async fn keep_past_ttl(
    ctx: &Ctx,
    a: &Arc<dyn Coordinator>,
    b: &Arc<dyn Coordinator>,
    key: &LockKey,
) -> Result<Option<String>, Failure> {
    let watch = StallWatch::start(ctx).await?;
    let stalled = |lease: &dyn lease_core::Lease| match lease.status() {
        LeaseStatus::Lost(LostReason::Expired) => watch.stalled(ctx.ttl() / 2),
        _ => None,
    };
    let kept = keep(a.acquire(key, &opts(ctx)).await?, KeeperOptions::new())?;
    let token = kept.token();
    let until = Instant::now() + ctx.ttl() * 3;
    while Instant::now() < until {
        let sent = Instant::now();
        match b.try_acquire(key, &opts(ctx)).await {
            Err(Error::Held { .. }) => {}
            other => {
                let overlap = other.is_ok() && sent < kept.lease().valid_until();
                if let (false, Some(why)) = (overlap, stalled(kept.lease())) {
                    if let Ok(taken) = other {
                        taken.release().await?;
                    }
                    return Ok(Some(why));
                }
                return Err(Failure(format!(
                    "kept lease lost the key: {other:?} (longest stall seen: {:?})",
                    watch.worst()
                )));
            }
        }
        tokio::time::sleep(ctx.ttl() / 5).await;
    }
    if let Some(why) = stalled(kept.lease()) {
        return Ok(Some(why));
    }
    // Not lost (in doubt while one renewal try is slow or refused is not a loss).
    check!(
        !matches!(kept.lease().status(), LeaseStatus::Lost(_)),
        "kept lease status {:?} (longest stall seen: {:?})",
        kept.lease().status(),
        watch.worst()
    );
    // Dropping the keeper stops renewal; the key comes free within a TTL (immediately where the
    // backend releases on drop).
    drop(kept);
    let next = b
        .acquire(key, &opts(ctx).wait(ctx.ttl() * 3))
        .await
        .map_err(|e| Failure(format!("key not free after the keeper was dropped: {e}")))?;
    check!(
        next.token() > token,
        "token {} not above {token}",
        next.token()
    );
    next.release().await?;
    Ok(None)
}

async fn cancelled_acquire(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("cancel");
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let ttl_ms = ctx.ttl().as_millis() as u64;
    // Cancel waiting acquires at several points: before the first poll completes, while queued,
    // and after the holder released (the wake-up may be in flight).
    for delay_ms in [0, 1, ctx.random(2..ttl_ms.max(3)), ttl_ms / 2] {
        let holder = a.acquire(&key, &long(&ctx).wait(ctx.ttl() * 10)).await?;
        let cancelled = {
            let b = b.clone();
            let key = key.clone();
            let o = long(&ctx).wait(ctx.ttl() * 20);
            tokio::spawn(async move { b.acquire(&key, &o).await })
        };
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        cancelled.abort();
        if let Ok(Ok(lease)) = cancelled.await {
            return Err(Failure(format!(
                "cancelled waiter got the key ({})",
                lease.token()
            )));
        }
        holder.release().await?;
        // The next contender must get the key within a TTL: the cancelled waiter left no entry
        // and no lock behind (a lock taken just before the abort would expire at its TTL).
        let next = c
            .acquire(&key, &opts(&ctx).wait(ctx.ttl() * 3))
            .await
            .map_err(|e| {
                Failure(format!(
                    "after cancelling at {delay_ms} ms the key stayed blocked: {e}"
                ))
            })?;
        next.release().await?;
    }
    // Cancel an acquire racing a release.
    let holder = a.acquire(&key, &long(&ctx)).await?;
    let race = {
        let b = b.clone();
        let key = key.clone();
        let o = long(&ctx).wait(ctx.ttl() * 20);
        tokio::spawn(async move { b.acquire(&key, &o).await })
    };
    tokio::time::sleep(ctx.ttl() / 10).await;
    holder.release().await?;
    race.abort();
    let _ = race.await;
    let next = c
        .acquire(&key, &opts(&ctx).wait(ctx.ttl() * 3))
        .await
        .map_err(|e| {
            Failure(format!(
                "after cancelling a waiter racing a release the key stayed blocked: {e}"
            ))
        })?;
    next.release().await?;
    Ok(Verdict::Passed)
}

/// `settle` waits for the clean-ups a coordinator began in the background. After an acquire
/// given up while it waited (at several points, a request in flight included) and after a lease
/// dropped without a release, once `settle` returns nothing of them is left on the server:
/// another client's `try_acquire` gets the key at once, with no wait for a cleanup, a TTL or a
/// session to end. A process that exits right after giving up relies on this: its runtime's
/// shutdown drops unfinished clean-ups.
async fn settle_after_giving_up(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("settle");
    let (a, b, c) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    // A clean-up may have to watch for a request in flight until the lock's TTL has passed
    // (Redis: the request may still apply after a first "not ours").
    let bound = ctx.ttl() * 5;
    let settled = |what: String| {
        let b = b.clone();
        async move {
            tokio::time::timeout(bound, b.settle())
                .await
                .map_err(|_| Failure(format!("settle did not return within {bound:?} {what}")))
        }
    };
    let free_at_once = |what: String| {
        let (c, key, o) = (c.clone(), key.clone(), opts(&ctx));
        async move {
            let lease = c.try_acquire(&key, &o).await.map_err(|e| {
                Failure(format!(
                    "{what}, and settle returned, another client could not take the key at \
                     once: {e}"
                ))
            })?;
            lease.release().await?;
            Ok::<(), Failure>(())
        }
    };
    let ttl_ms = ctx.ttl().as_millis() as u64;
    for delay_ms in [0, 1, ctx.random(2..ttl_ms.max(3)), ttl_ms / 2] {
        let holder = a.acquire(&key, &long(&ctx).wait(ctx.ttl() * 10)).await?;
        let waiting = {
            let (b, key) = (b.clone(), key.clone());
            let o = opts(&ctx).wait(ctx.ttl() * 20);
            tokio::spawn(async move { b.acquire(&key, &o).await })
        };
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        waiting.abort();
        if let Ok(Ok(lease)) = waiting.await {
            return Err(Failure(format!(
                "an acquire given up while the key was held got it ({})",
                lease.token()
            )));
        }
        let what = format!("after an acquire was given up at {delay_ms} ms");
        settled(what.clone()).await?;
        holder.release().await?;
        free_at_once(what).await?;
    }
    for round in 0..3 {
        let lease = b.acquire(&key, &opts(&ctx).wait(ctx.ttl() * 3)).await?;
        drop(lease);
        let what = format!("after a lease was dropped unreleased (round {round})");
        settled(what.clone()).await?;
        free_at_once(what).await?;
    }
    Ok(Verdict::Passed)
}

async fn key_independence(ctx: Arc<Ctx>) -> CaseResult {
    let a = ctx.client().await?;
    let names = [
        "p",
        "p/b",
        "pb",
        "p/b/c",
        "ключ/日本語",
        "with space",
        "q.r",
        "a-b_c~d",
    ];
    let mut held = Vec::new();
    for n in names {
        let key = ctx.key(n);
        let lease = a
            .try_acquire(&key, &long(&ctx))
            .await
            .map_err(|e| Failure(format!("key {key:?} blocked by another key: {e}")))?;
        held.push(lease);
    }
    for lease in &held {
        let info = a.inspect(lease.key()).await?;
        check!(
            info.as_ref().map(|h| (&h.key, h.token)) == Some((lease.key(), lease.token())),
            "inspect({:?}) shows {info:?}",
            lease.key()
        );
    }
    // Releasing the prefix key leaves the others held.
    held.remove(0).release().await?;
    for lease in &held {
        check!(
            lease.renew().await.is_ok(),
            "releasing {:?} disturbed {:?}",
            ctx.key("p"),
            lease.key()
        );
    }
    for lease in held {
        lease.release().await?;
    }
    Ok(Verdict::Passed)
}

async fn bad_input(ctx: Arc<Ctx>) -> CaseResult {
    let a = ctx.client().await?;
    let caps = a.capabilities().clone();
    let key = ctx.key("bad-input");
    let mut attempts: Vec<(&str, LeaseOptions)> = vec![
        ("zero TTL", LeaseOptions::new(Duration::ZERO)),
        (
            "TTL above maximum",
            LeaseOptions::new(LeaseOptions::MAX_TTL + Duration::from_secs(1)),
        ),
        ("TTL overflow", LeaseOptions::new(Duration::MAX)),
        ("wait overflow", opts(&ctx).wait(Duration::MAX)),
        ("empty operation", opts(&ctx).operation("")),
        (
            "operation with control character",
            opts(&ctx).operation("a\nb"),
        ),
        (
            "drift margin not below TTL",
            opts(&ctx).drift_margin(ctx.ttl()),
        ),
    ];
    if caps.min_ttl > Duration::from_nanos(1) {
        attempts.push((
            "TTL below the backend minimum",
            LeaseOptions::new(caps.min_ttl - Duration::from_nanos(1)),
        ));
    }
    for (what, o) in &attempts {
        for (mode, r) in [
            ("acquire", a.acquire(&key, o).await),
            ("try_acquire", a.try_acquire(&key, o).await),
        ] {
            match r {
                Err(Error::InvalidInput(_)) => {}
                other => {
                    return Err(Failure(format!(
                        "{mode} with {what}: expected InvalidInput, got {other:?}"
                    )))
                }
            }
        }
    }
    let info = a.inspect(&key).await?;
    check!(
        info.is_none(),
        "rejected calls left something on the backend: {info:?}"
    );
    // The first real acquisition still works, and the key's validation errors are typed.
    let lease = a.try_acquire(&key, &opts(&ctx)).await?;
    lease.release().await?;
    for (bad, expect) in [
        ("", "empty"),
        ("/lead", "starts with"),
        ("trail/", "ends with"),
        ("a//b", "empty segment"),
        ("a/../b", "'..'"),
        ("nul\u{0}", "control"),
    ] {
        let e = LockKey::new(bad)
            .err()
            .ok_or_else(|| Failure(format!("key {bad:?} accepted")))?;
        check!(
            e.to_string().contains(expect),
            "key {bad:?}: error {e} does not say {expect:?}"
        );
    }
    check!(
        matches!(
            LockKey::new("k".repeat(1000)),
            Err(InvalidInput::TooLong { .. })
        ),
        "oversized key accepted"
    );
    Ok(Verdict::Passed)
}

async fn inspect_and_force(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("inspect");
    let (a, op) = (ctx.client().await?, ctx.client().await?);
    check!(
        op.inspect(&key).await?.is_none(),
        "fresh key shows a holder"
    );
    let owner = OwnerId::new("worker-7/pid-42")?;
    let lease = a
        .acquire(
            &key,
            &long(&ctx)
                .owner(owner.clone())
                .operation("nightly-reconcile"),
        )
        .await?;
    let info = op
        .inspect(&key)
        .await?
        .ok_or_else(|| Failure("inspect shows no holder".into()))?;
    check!(
        info.owner == owner,
        "owner {:?}, expected {owner:?}",
        info.owner
    );
    check!(
        info.operation.as_deref() == Some("nightly-reconcile"),
        "operation {:?}",
        info.operation
    );
    check!(
        info.token == lease.token(),
        "token {} vs lease {}",
        info.token,
        lease.token()
    );
    if let Some(e) = info.expires_in {
        check!(
            e <= lease.ttl() + Duration::from_secs(1),
            "expires_in {e:?} above the TTL {:?}",
            lease.ttl()
        );
    }
    let shown = format!("{info:?} {lease:?}");
    if let Some(secret) = &ctx.subject.secret {
        check!(
            !shown.contains(secret.as_str()),
            "inspect or lease Debug output shows the secret"
        );
    }
    let request = ForceRelease::new("oncall-alice", "stuck after deploy 1234")?;
    let removed = op.force_release(&key, &request).await?;
    check!(
        removed.as_ref().map(|h| h.token) == Some(lease.token()),
        "force_release returned {removed:?}"
    );
    check!(
        op.inspect(&key).await?.is_none(),
        "key still held after force_release"
    );
    check!(
        op.force_release(&key, &request).await?.is_none(),
        "second force_release found a holder"
    );
    let next = op.acquire(&key, &opts(&ctx)).await?;
    check!(
        next.token() > lease.token(),
        "token after force_release {} not above {}",
        next.token(),
        lease.token()
    );
    check!(
        matches!(lease.release().await, Err(Error::Lost { .. })),
        "revoked holder's release must be Lost"
    );
    check!(
        op.inspect(&key).await?.map(|h| h.token) == Some(next.token()),
        "revoked holder's release removed the new lock"
    );
    next.release().await?;
    Ok(Verdict::Passed)
}

/// An operator inspected (token t1), then a new holder arrived (t2): a force-release expecting
/// t1 must remove nothing and say what it found; one expecting t2 removes the new holder; on a
/// free key an expected token is refused with `found: None`.
async fn force_with_expected_token(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("expect-token");
    let (a, b, op) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let first = a.acquire(&key, &long(&ctx)).await?;
    let t1 = first.token();
    first.release().await?;
    let second = b.acquire(&key, &long(&ctx)).await?;
    let t2 = second.token();
    check!(t2 > t1, "second token {t2} not above the first {t1}");
    let request = ForceRelease::new("oncall-bob", "stuck after inspect")?;
    match op
        .force_release(&key, &request.clone().expect_token(t1))
        .await
    {
        Err(Error::HolderChanged {
            expected, found, ..
        }) => {
            check!(
                expected == t1,
                "HolderChanged expected {expected}, asked {t1}"
            );
            check!(
                found == Some(t2),
                "HolderChanged found {found:?}, holder is {t2}"
            );
        }
        other => {
            return Err(Failure(format!(
                "force_release expecting the stale token {t1} (holder {t2}) returned {other:?}"
            )))
        }
    }
    check!(
        op.inspect(&key).await?.map(|h| h.token) == Some(t2),
        "the holder with token {t2} is gone after a refused force_release"
    );
    second.renew().await?;
    check!(
        second.status() == LeaseStatus::Held,
        "the holder is not held after a refused force_release: {:?}",
        second.status()
    );
    let removed = op
        .force_release(&key, &request.clone().expect_token(t2))
        .await?;
    check!(
        removed.as_ref().map(|h| h.token) == Some(t2),
        "force_release expecting the holder's token {t2} returned {removed:?}"
    );
    check!(
        op.inspect(&key).await?.is_none(),
        "key still held after force_release with the right token"
    );
    match second.renew().await {
        Err(Error::Lost { reason, .. }) => check!(
            matches!(reason, LostReason::Revoked | LostReason::Superseded),
            "removed holder's renew reported {reason:?}"
        ),
        other => {
            return Err(Failure(format!(
                "removed holder's renew returned {other:?}"
            )))
        }
    }
    match op.force_release(&key, &request.expect_token(t2)).await {
        Err(Error::HolderChanged {
            expected, found, ..
        }) => check!(
            expected == t2 && found.is_none(),
            "free key: HolderChanged expected {expected} found {found:?}"
        ),
        other => {
            return Err(Failure(format!(
                "force_release of a free key with an expected token returned {other:?}"
            )))
        }
    }
    Ok(Verdict::Passed)
}

/// Two forced releases of a held key by different actors, then one of the free key:
/// `audit_trail` lists all three, newest first, with actor, reason, removed token and owner
/// (none for the free key); `limit` bounds the answer (1 gives the newest) and 0 is refused;
/// another key's trail is empty.
async fn audit_trail_newest_first(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("audit");
    let op = ctx.client().await?;
    let mut removed = Vec::new();
    for (actor, reason, owner) in [
        ("oncall-alice", "stuck after deploy 1", "worker-1"),
        ("oncall-bob", "stuck after deploy 2", "worker-2"),
    ] {
        // A client per holder: a removed lease's client may learn of the removal only later.
        let holder = ctx.client().await?;
        let owner = OwnerId::new(owner)?;
        let lease = holder
            .acquire(&key, &long(&ctx).owner(owner.clone()))
            .await?;
        let gone = op
            .force_release(&key, &ForceRelease::new(actor, reason)?)
            .await?;
        check!(
            gone.as_ref().map(|h| h.token) == Some(lease.token()),
            "force_release by {actor} returned {gone:?}"
        );
        removed.push((actor, reason, owner, lease.token()));
        drop(lease);
    }
    let (actor, reason) = ("oncall-carol", "checking a free key");
    let gone = op
        .force_release(&key, &ForceRelease::new(actor, reason)?)
        .await?;
    check!(
        gone.is_none(),
        "force_release of a free key returned {gone:?}"
    );
    let trail = op.audit_trail(&key, 10).await?;
    check!(trail.len() == 3, "audit_trail(10) returned {trail:?}");
    check!(
        trail[0].key == key
            && trail[0].actor == actor
            && trail[0].reason == reason
            && trail[0].removed_token.is_none()
            && trail[0].removed_owner.is_none()
            && trail[0].at.is_some(),
        "newest record {:?}, expected {actor} / {reason} with nothing removed",
        trail[0]
    );
    for (record, (actor, reason, owner, token)) in trail[1..].iter().zip(removed.iter().rev()) {
        check!(
            record.key == key
                && record.actor == *actor
                && record.reason == *reason
                && record.removed_token == Some(*token)
                && record.removed_owner.as_deref() == Some(owner.as_str()),
            "record {record:?}, expected {actor} / {reason} / {owner} / token {token} (newest first)"
        );
        check!(record.at.is_some(), "record without a time: {record:?}");
    }
    let newest = op.audit_trail(&key, 1).await?;
    check!(
        newest.len() == 1 && newest[0] == trail[0],
        "audit_trail(1) returned {newest:?}, the newest is {:?}",
        trail[0]
    );
    match op.audit_trail(&key, 0).await {
        Err(Error::InvalidInput(InvalidInput::OutOfRange { field, .. })) => {
            check!(field == "limit", "limit 0 refused naming {field}")
        }
        other => return Err(Failure(format!("audit_trail(0) returned {other:?}"))),
    }
    let other = op.audit_trail(&ctx.key("audit-untouched"), 10).await?;
    check!(other.is_empty(), "an untouched key's trail: {other:?}");
    Ok(Verdict::Passed)
}

async fn multi_lock(ctx: Arc<Ctx>) -> CaseResult {
    let keys = [ctx.key("m/a"), ctx.key("m/b"), ctx.key("m/c")];
    let busy: Arc<Vec<AtomicBool>> = Arc::new((0..3).map(|_| AtomicBool::new(false)).collect());
    let mut tasks = Vec::new();
    for reverse in [false, true] {
        let client = ctx.client().await?;
        let mut mine = keys.to_vec();
        if reverse {
            mine.reverse();
        }
        let busy = busy.clone();
        let all = keys.clone();
        let o = long(&ctx).wait(ctx.ttl() * 20);
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let multi = acquire_many(&*client, &mine, &o).await?;
                let order: Vec<_> = multi.tokens().into_iter().map(|(k, _)| k).collect();
                if order != all {
                    return Err(Failure(format!(
                        "keys not taken in global order: {order:?}"
                    )));
                }
                for b in busy.iter() {
                    if b.swap(true, Ordering::SeqCst) {
                        return Err(Failure("two multi-lock holders overlap".into()));
                    }
                }
                tokio::task::yield_now().await;
                for b in busy.iter() {
                    b.store(false, Ordering::SeqCst);
                }
                multi.release().await?;
            }
            Ok::<_, Failure>(())
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| Failure(format!("worker panicked: {e}")))??;
    }
    // A key that cannot be had: what was taken is given back, within the total wait.
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let blocker = a.acquire(&keys[2], &long(&ctx)).await?;
    let wait = ctx.ttl() / 2;
    let start = Instant::now();
    match acquire_many(&*b, &keys, &long(&ctx).wait(wait)).await {
        Err(Error::Timeout { .. }) => {}
        other => return Err(Failure(format!("expected Timeout, got {other:?}"))),
    }
    check!(
        start.elapsed() < wait * 3 + Duration::from_secs(1),
        "total wait not bounded: {:?}",
        start.elapsed()
    );
    for k in &keys[..2] {
        check!(
            a.inspect(k).await?.is_none(),
            "{k:?} left held after a failed multi-lock"
        );
    }
    blocker.release().await?;
    Ok(Verdict::Passed)
}

async fn fence_semantics(ctx: Arc<Ctx>) -> CaseResult {
    let fence = ctx.fence();
    let r1 = ctx.resource(&ctx.key("fence/one"));
    let r2 = ctx.resource(&ctx.key("fence/two"));
    let t = |n: u64| Token::new(n).expect("small");
    check!(fence.read(&r1).await?.is_none(), "fresh resource has state");
    fence.write(&r1, t(5), Bytes::from_static(b"five")).await?;
    let acc = fence
        .write(&r1, t(5), Bytes::from_static(b"five again"))
        .await?;
    check!(
        acc.previous == Some(t(5)),
        "equal token must be accepted with previous 5, got {acc:?}"
    );
    match fence.write(&r1, t(4), Bytes::from_static(b"four")).await {
        Err(Error::Stale {
            presented, current, ..
        }) => {
            check!(
                presented == t(4) && current == t(5),
                "stale error has presented {presented}, current {current}"
            )
        }
        other => {
            return Err(Failure(format!(
                "older token: expected Stale, got {other:?}"
            )))
        }
    }
    fence.claim(&r1, t(9)).await?;
    let state = fence
        .read(&r1)
        .await?
        .ok_or_else(|| Failure("resource lost its state".into()))?;
    check!(
        state.newest == t(9),
        "claim did not advance newest: {state:?}"
    );
    check!(
        state.value.as_ref().map(|(tok, v)| (*tok, v.as_ref())) == Some((t(5), &b"five again"[..])),
        "claim changed the value: {state:?}"
    );
    check!(
        matches!(
            fence.write(&r1, t(8), Bytes::new()).await,
            Err(Error::Stale { .. })
        ),
        "write below a claim accepted"
    );
    check!(
        matches!(fence.claim(&r1, t(8)).await, Err(Error::Stale { .. })),
        "claim below newest accepted"
    );
    fence.write(&r2, t(1), Bytes::from_static(b"other")).await?;
    check!(
        fence.read(&r1).await?.map(|s| s.newest) == Some(t(9)),
        "resources are not independent"
    );
    Ok(Verdict::Passed)
}
