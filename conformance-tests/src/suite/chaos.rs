//! The chaos run: many workers, random pauses, crashes, force-releases, worker processes paused
//! and killed, coordinator restarts and proxy faults, all writing through one recording fence.
//! A checker then verifies that accepted tokens never decrease per resource and that tokens
//! follow real-time acquisition order.
//!
//! Seedable (`CONFORMANCE_SEED`), and bounded by `CONFORMANCE_CHAOS_SECS` (default 12 s).

use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    keep, Bytes, Error, Fence, ForceRelease, KeeperOptions, LeaseOptions, LockKey, ResourceId,
    Token,
};
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::{boxed, Case, CaseResult, Ctx, Failure, Need, Verdict};
use crate::check;
use crate::fence_server::{FenceServer, RecordingFence};

pub(super) fn cases() -> Vec<Case> {
    vec![Case::new(
        "chaos_workers_pauses_kills_restarts",
        &[],
        400,
        |c| boxed(chaos(c)),
    )]
}

fn chaos_duration() -> Duration {
    let secs = std::env::var("CONFORMANCE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12u64);
    Duration::from_secs(secs.clamp(1, 300))
}

/// One acquisition as a worker saw it: when it asked, when it got it, and the token.
#[derive(Debug, Clone, Copy)]
struct Holding {
    key: usize,
    asked: Instant,
    got: Instant,
    token: Token,
}

fn tolerable(e: &Error) -> bool {
    matches!(
        e,
        Error::Stale { .. }
            | Error::Lost { .. }
            | Error::Timeout { .. }
            | Error::Held { .. }
            | Error::Unavailable { .. }
            | Error::OutcomeUnknown { .. }
    )
}

async fn chaos(ctx: Arc<Ctx>) -> CaseResult {
    let keys: Vec<LockKey> = (0..2).map(|i| ctx.key(&format!("chaos/{i}"))).collect();
    let rec = RecordingFence::new(ctx.fence().clone());
    let log = rec.log();
    let fence: Arc<dyn Fence> = Arc::new(rec);
    let until = Instant::now() + chaos_duration();
    let ttl = ctx.ttl();
    let holdings = Arc::new(std::sync::Mutex::new(Vec::<Holding>::new()));
    let mut tasks = Vec::new();
    for w in 0..4 {
        let client = ctx.client().await?;
        let (keys, fence, holdings) = (keys.clone(), fence.clone(), holdings.clone());
        let seed = ctx.fork_seed();
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut rounds = 0u32;
            while Instant::now() < until {
                rounds += 1;
                let k = rng.gen_range(0..keys.len());
                let (key, resource) = (&keys[k], ResourceId::from(&keys[k]));
                let asked = Instant::now();
                let lease = match client
                    .acquire(key, &LeaseOptions::new(ttl).wait(ttl * 4))
                    .await
                {
                    Ok(l) => l,
                    Err(e) if tolerable(&e) => {
                        tokio::time::sleep(ttl / 10).await;
                        continue;
                    }
                    Err(e) => return Err(Failure(format!("worker {w}: acquire: {e}"))),
                };
                let token = lease.token();
                holdings.lock().expect("h").push(Holding {
                    key: k,
                    asked,
                    got: Instant::now(),
                    token,
                });
                let step = async {
                    fence.claim(&resource, token).await?;
                    match rng.gen_range(0..100) {
                        0..=49 => {
                            for i in 0..rng.gen_range(1..4) {
                                tokio::time::sleep(Duration::from_millis(
                                    rng.gen_range(0..(ttl.as_millis() as u64 / 10).max(1)),
                                ))
                                .await;
                                fence
                                    .write(
                                        &resource,
                                        token,
                                        Bytes::from(format!("w{w} t{token} #{i}")),
                                    )
                                    .await?;
                            }
                            lease.release().await
                        }
                        50..=64 => {
                            // A stop-the-world pause past the TTL, then the stale write.
                            tokio::time::sleep(ttl + ttl / 2).await;
                            fence
                                .write(
                                    &resource,
                                    token,
                                    Bytes::from(format!("w{w} t{token} after pause")),
                                )
                                .await?;
                            lease.release().await
                        }
                        65..=74 => {
                            // A crash: no release, no destructor.
                            std::mem::forget(lease);
                            Ok(())
                        }
                        75..=89 => {
                            let kept = keep(lease, KeeperOptions::new())?;
                            for i in 0..3 {
                                tokio::time::sleep(ttl * 2 / 3).await;
                                fence
                                    .write(
                                        &resource,
                                        token,
                                        Bytes::from(format!("w{w} t{token} kept #{i}")),
                                    )
                                    .await?;
                            }
                            kept.release().await
                        }
                        _ => {
                            drop(lease);
                            Ok(())
                        }
                    }
                };
                if let Err(e) = step.await {
                    if !tolerable(&e) {
                        return Err(Failure(format!("worker {w}: {e}")));
                    }
                }
            }
            Ok::<u32, Failure>(rounds)
        }));
    }
    // The monkey: force-releases, and where the subject allows, restarts, proxy-free worker
    // processes paused and killed.
    let monkey = {
        let ctx = ctx.clone();
        let keys = keys.clone();
        let fence = fence.clone();
        tokio::spawn(async move { monkey(ctx, keys, fence, until).await })
    };
    let mut rounds = 0;
    for t in tasks {
        rounds += t
            .await
            .map_err(|e| Failure(format!("worker panicked: {e}")))??;
    }
    let monkey_report = monkey
        .await
        .map_err(|e| Failure(format!("monkey panicked: {e}")))??;
    let accepted = log
        .check_monotonic()
        .map_err(|e| Failure(format!("fence checker: {e}")))?;
    // Tokens follow real time: a holding that began after another was granted has a larger token.
    let mut hs = holdings.lock().expect("h").clone();
    hs.sort_by_key(|h| h.got);
    for (i, a) in hs.iter().enumerate() {
        for b in &hs[i + 1..] {
            if a.key == b.key && a.got < b.asked {
                check!(
                    b.token > a.token,
                    "token {} granted after {} on key {} is not larger",
                    b.token,
                    a.token,
                    a.key
                );
            }
        }
    }
    let rejected = log.records().iter().filter(|r| !r.accepted).count();
    check!(
        rounds > 10 && accepted > 10,
        "chaos run too small to mean anything: {rounds} rounds, {accepted} accepted"
    );
    tracing::info!(rounds, accepted, rejected, monkey = %monkey_report, "chaos run checked");
    Ok(Verdict::Passed)
}

async fn monkey(
    ctx: Arc<Ctx>,
    keys: Vec<LockKey>,
    fence: Arc<dyn Fence>,
    until: Instant,
) -> Result<String, Failure> {
    let op = ctx.client().await?;
    let ttl = ctx.ttl();
    let mut rng = rand::rngs::StdRng::seed_from_u64(ctx.fork_seed());
    let can_restart = ctx.subject.missing(&[Need::Restart]).await.is_none();
    let can_spawn = ctx.subject.missing(&[Need::Processes]).await.is_none();
    let server = if can_spawn {
        Some(FenceServer::start(fence.clone()).await?)
    } else {
        None
    };
    let (mut forced, mut restarts, mut paused, mut killed) = (0, 0, 0, 0);
    let mut workers = Vec::new();
    let mut last_restart = Instant::now();
    while Instant::now() < until {
        tokio::time::sleep(
            ttl + Duration::from_millis(rng.gen_range(0..(ttl.as_millis() as u64 * 2).max(1))),
        )
        .await;
        let key = &keys[rng.gen_range(0..keys.len())];
        match rng.gen_range(0..10) {
            0..=3 => {
                let request = ForceRelease::new("chaos-monkey", "chaos run")?;
                let released = op.force_release(key, &request).await;
                forced += u32::from(released.is_ok());
            }
            4..=5 if can_restart && last_restart.elapsed() > Duration::from_secs(4) => {
                let server = ctx.subject.server.clone().expect("checked");
                let mut g = server.lock().await;
                tokio::task::block_in_place(|| {
                    g.kill()?;
                    g.restart()
                })
                .map_err(|e| Failure(format!("chaos restart failed: {e}")))?;
                restarts += 1;
                last_restart = Instant::now();
            }
            6..=9 if can_spawn => {
                let server = server.as_ref().expect("spawned");
                let mut w =
                    super::faults::spawn_worker(&ctx, key, server.addr(), 10_000, ttl / 10).await?;
                if w.wait_for_acquired(ttl * 6).await {
                    if rng.gen_bool(0.5) {
                        crate::process::pause(w.pid()).map_err(|e| Failure(e.to_string()))?;
                        tokio::time::sleep(ttl * 2).await;
                        crate::process::resume(w.pid()).map_err(|e| Failure(e.to_string()))?;
                        paused += 1;
                    } else {
                        crate::process::kill(w.pid()).map_err(|e| Failure(e.to_string()))?;
                        killed += 1;
                    }
                }
                workers.push(w);
            }
            _ => {}
        }
    }
    for mut w in workers {
        w.stop().await;
    }
    Ok(format!(
        "{forced} force-releases, {restarts} restarts, {paused} processes paused, {killed} killed"
    ))
}
