//! The chaos run: many workers, random pauses, crashes, force-releases, worker processes paused
//! and killed, coordinator restarts and proxy faults, all writing through one recording fence.
//! Every acquisition, release, claim and write is recorded into a [`History`] on the harness
//! clock (worker processes' claims and writes at the fence server they write through), and
//! [`crate::history::check`] then proves its properties: unique tokens in real-time order per
//! key, the fence's acceptances in token order, no stale write after a newer claim or after the
//! fence reported a newer token, and no grant while an earlier holder's reported validity lasts
//! unless that holder released or the monkey force-released it (every grant's validity, every
//! release, drop and forced release is recorded, and what a kept lease shows before it ends;
//! worker processes' from what they print). The recording
//! fence's own commit-order log is checked too (accepted tokens never decrease in the order the
//! fence answered).
//!
//! Seedable (`CONFORMANCE_SEED`), and bounded by `CONFORMANCE_CHAOS_SECS` (default 12 s).

use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    keep, Bytes, Error, Fence, ForceRelease, KeeperOptions, Lease, LeaseOptions, LockKey,
    ResourceId,
};
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::{boxed, Case, CaseResult, Ctx, Failure, Need, Verdict};
use crate::check;
use crate::history::{Done, Forced, History, HistoryFence, OpKind, Recorder};
use lease_testkit::fence_server::{FenceServer, RecordingFence};

pub(super) fn cases() -> Vec<Case> {
    vec![Case::new(
        "chaos_workers_pauses_kills_restarts",
        &[],
        400,
        |c| boxed(chaos(c)),
    )]
}

/// How many worker rounds (all workers together) a chaos run needs to mean something.
const ENOUGH_ROUNDS: u32 = 24;

/// Worker processes the monkey keeps at most at once in one run (each paused or killed; one that
/// never acquired is stopped at once and does not count).
const MAX_WORKERS: usize = 12;

/// Worker processes the monkey starts at most in one run, those that never acquired included
/// (a worker that fails at once is not started again and again until the run ends).
const MAX_SPAWNS: u32 = 36;

/// How long after a restart the monkey waits before the next one.
const RESTART_SETTLE: Duration = Duration::from_secs(4);

/// `CONFORMANCE_CHAOS_SECS` (whole seconds, `1..=300`; 12 when unset or empty). A malformed value
/// fails the case rather than quietly running the default.
fn chaos_duration() -> Result<Duration, Failure> {
    match std::env::var("CONFORMANCE_CHAOS_SECS")
        .ok()
        .filter(|s| !s.trim().is_empty())
    {
        None => Ok(Duration::from_secs(12)),
        Some(s) => match s.trim().parse::<u64>() {
            Ok(secs) if (1..=300).contains(&secs) => Ok(Duration::from_secs(secs)),
            _ => Err(Failure(format!(
                "CONFORMANCE_CHAOS_SECS={s:?}: expected whole seconds in 1..=300"
            ))),
        },
    }
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
    let recorded: Arc<dyn Fence> = Arc::new(rec);
    let history = History::new(Some(ctx.seed));
    let duration = chaos_duration()?;
    let until = Instant::now() + duration;
    // A run slowed down (a loaded machine, a cluster's whole-cluster restarts) goes on past
    // `until`, calmer (the monkey has stopped), until enough rounds happened to mean something,
    // bounded by twice the duration more.
    let hard_until = until + duration * 2;
    let all_rounds = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let ttl = ctx.ttl();
    let mut tasks = Vec::new();
    for w in 0..4 {
        let client = ctx.client().await?;
        let history = history.recorder(format!("w{w}"));
        let fence: Arc<dyn Fence> = Arc::new(HistoryFence::new(recorded.clone(), history.clone()));
        let keys = keys.clone();
        let seed = ctx.fork_seed();
        let all_rounds = all_rounds.clone();
        tasks.push(super::Scoped::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut rounds = 0u32;
            let go_on = |all: &std::sync::atomic::AtomicU32| {
                let now = Instant::now();
                now < until
                    || (now < hard_until
                        && all.load(std::sync::atomic::Ordering::Relaxed) < ENOUGH_ROUNDS)
            };
            while go_on(&all_rounds) {
                rounds += 1;
                all_rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let k = rng.gen_range(0..keys.len());
                let (key, resource) = (&keys[k], ResourceId::from(&keys[k]));
                let call = history.invoke();
                let acquired = client
                    .acquire(key, &LeaseOptions::new(ttl).wait(ttl * 4))
                    .await;
                call.acquired(key, &acquired);
                let lease = match acquired {
                    Ok(l) => l,
                    Err(e) if tolerable(&e) => {
                        tokio::time::sleep(ttl / 10).await;
                        continue;
                    }
                    Err(e) => return Err(Failure(format!("worker {w}: acquire: {e}"))),
                };
                let token = lease.token();
                let lease = Held::new(lease, &history, key);
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
                            lease.release(|l| async move { l.release().await }).await
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
                            lease.release(|l| async move { l.release().await }).await
                        }
                        65..=74 => {
                            // A crash: no release, no destructor.
                            lease.crash();
                            Ok(())
                        }
                        75..=89 => {
                            let kept =
                                lease.map(|l| keep(l, KeeperOptions::new()), |k| k.lease())?;
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
                            kept.release(|k| k.release()).await
                        }
                        _ => {
                            // Recorded as a release invoked now whose outcome is never known.
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
        // Worker processes' claims and writes, timestamped at the fence server.
        let fence: Arc<dyn Fence> = Arc::new(HistoryFence::new(
            recorded.clone(),
            history.recorder("processes"),
        ));
        let history = history.clone();
        super::Scoped::spawn(
            async move { monkey(ctx, keys, fence, history, until, hard_until).await },
        )
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
    // Replaces the former holdings check (a token granted after another was granted is larger):
    // property (a) is that check, plus uniqueness, plus the fence properties over real time.
    let summary = crate::history::check_except(&history, ctx.subject.unpromised())
        .map_err(|v| Failure(v.to_string()))?;
    let rejected = log.records().iter().filter(|r| !r.accepted).count();
    check!(
        rounds > 10 && accepted > 10,
        "chaos run too small to mean anything: {rounds} rounds, {accepted} accepted"
    );
    check!(
        summary.grants > 10 && summary.tenures > 10 && summary.accepted_writes > 0,
        "history too thin to mean anything: {summary:?} over {rounds} rounds"
    );
    // On stderr, not only as a log event: a passing run's log shows what it exercised (the
    // suite's binaries install no subscriber).
    eprintln!(
        "{}: chaos run checked (case seed {}): {rounds} rounds, {accepted} writes accepted, \
         {rejected} rejected; {summary:?}; monkey: {monkey_report}",
        ctx.subject.name, ctx.seed
    );
    Ok(Verdict::Passed)
}

async fn monkey(
    ctx: Arc<Ctx>,
    keys: Vec<LockKey>,
    fence: Arc<dyn Fence>,
    history: History,
    until: Instant,
    due_until: Instant,
) -> Result<String, Failure> {
    let op = ctx.client().await?;
    let recorder = history.recorder("monkey");
    // Of the holders removed, those a request named.
    let named = std::sync::atomic::AtomicU32::new(0);
    // A forced release, recorded: the history's property (e) counts on knowing every one. With
    // `expect`, as an operator who looked first: the holder `inspect` shows is named
    // (`expect_token`), so the request removes that holder or nothing, and the history excuses
    // that holder only, even when the outcome is unknown (decision 0050). Without, it removes
    // whoever holds the key when it applies.
    let force = |key: &LockKey, request: &ForceRelease, expect: bool| {
        let (op, recorder, key, named) = (&op, &recorder, key.clone(), &named);
        let mut request = request.clone();
        async move {
            if expect {
                if let Ok(Some(holder)) = op.inspect(&key).await {
                    request = request.expect_token(holder.token);
                }
            }
            let call = recorder.invoke();
            let removed = op.force_release(&key, &request).await;
            call.complete(OpKind::ForceRelease {
                key: key.as_str().to_owned(),
                expected: request.expected_token().map(|t| t.get()),
                outcome: Forced::from_result(&removed),
            });
            if request.expected_token().is_some() && matches!(removed, Ok(Some(_))) {
                named.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            removed
        }
    };
    let ttl = ctx.ttl();
    let mut rng = rand::rngs::StdRng::seed_from_u64(ctx.fork_seed());
    let can_restart = matches!(ctx.subject.missing(&[Need::Restart]).await, Ok(None));
    let can_spawn = matches!(ctx.subject.missing(&[Need::Processes]).await, Ok(None));
    let server = if can_spawn {
        Some(FenceServer::start(fence.clone()).await?)
    } else {
        None
    };
    let (mut forced, mut restarts, mut paused, mut killed) = (0, 0, 0, 0);
    // Of `forced`, those of a key the monkey held itself (see below).
    let mut forced_own = 0u32;
    // Worker processes started, and what those that failed said: a worker may fail under chaos
    // (a restart, a long wait), but not every one of two or more (a worker that cannot connect
    // at all, such as one without the subject's URL scheme).
    let (mut spawned, mut worker_errors) = (0u32, Vec::<String>::new());
    let mut workers = Vec::new();
    // As if the last restart were long enough ago: the first one may come at once (a short run
    // must still have one).
    let mut last_restart = Instant::now()
        .checked_sub(RESTART_SETTLE)
        .unwrap_or_else(Instant::now);
    // Each kind of fault the subject allows comes once first, the quick ones first (so that a
    // short run still has every kind; the monkey goes on past `until`, up to `due_until`, for a
    // kind still due), then the monkey picks at random.
    let mut pending: Vec<Fault> = std::iter::once(Fault::ForceRelease)
        .chain(can_spawn.then_some(Fault::Kill))
        .chain(can_restart.then_some(Fault::Restart))
        .chain(can_spawn.then_some(Fault::Pause))
        .collect();
    loop {
        let now = Instant::now();
        if now >= until && (pending.is_empty() || now >= due_until) {
            break;
        }
        // Shorter gaps while kinds are still due, so that a short run on a long TTL gets them.
        let gap = if pending.is_empty() {
            ttl + Duration::from_millis(rng.gen_range(0..(ttl.as_millis() as u64 * 2).max(1)))
        } else {
            ttl / 2
        };
        tokio::time::sleep(gap).await;
        let key = &keys[rng.gen_range(0..keys.len())];
        let restart_ready = can_restart && last_restart.elapsed() >= RESTART_SETTLE;
        let spawn_ready = can_spawn && workers.len() < MAX_WORKERS && spawned < MAX_SPAWNS;
        let next = pending.iter().position(|f| match f {
            Fault::Restart => restart_ready,
            Fault::Pause | Fault::Kill => spawn_ready,
            Fault::ForceRelease => true,
        });
        let fault = match next {
            Some(i) => Some(pending.remove(i)),
            None => match rng.gen_range(0..10) {
                0..=3 => Some(Fault::ForceRelease),
                4..=5 if restart_ready => Some(Fault::Restart),
                6..=9 if spawn_ready => Some(if rng.gen_bool(0.5) {
                    Fault::Pause
                } else {
                    Fault::Kill
                }),
                _ => None,
            },
        };
        match fault {
            Some(Fault::ForceRelease) => {
                let request = ForceRelease::new("chaos-monkey", "chaos run")?;
                // Only a removed holder counts: the picked key first, then the others (a key
                // is often free between two holders). If none was held (or a call failed under
                // chaos) and the kind was never done, it is due again, behind the kinds still
                // due.
                let start = keys.iter().position(|k| k == key).unwrap_or(0);
                let mut removed = false;
                for k in keys.iter().cycle().skip(start).take(keys.len()) {
                    if let Ok(Some(_)) = force(k, &request, rng.gen_bool(0.5)).await {
                        removed = true;
                        break;
                    }
                }
                if !removed && forced == 0 && Instant::now() >= until {
                    // The in-process workers have stopped, and a worker process's key has
                    // likely expired (a paused one sleeps past its TTL, a killed one is not
                    // renewed): so that the kind is still done on a real holder, the monkey
                    // holds a key itself and force-releases that holder.
                    let call = recorder.invoke();
                    let own = op.try_acquire(key, &LeaseOptions::new(ttl)).await;
                    call.acquired(key, &own);
                    if let Ok(own) = own {
                        let own = Held::new(own, &recorder, key);
                        removed = matches!(
                            force(key, &request, rng.gen_bool(0.5)).await,
                            Ok(Some(h)) if h.token.get() == own.token
                        );
                        forced_own += u32::from(removed);
                        let _ = own.release(|l| async move { l.release().await }).await;
                    }
                }
                if removed {
                    forced += 1;
                } else if forced == 0 && !pending.contains(&Fault::ForceRelease) {
                    pending.push(Fault::ForceRelease);
                }
            }
            Some(Fault::Restart) => {
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
            Some(fault @ (Fault::Pause | Fault::Kill)) => {
                let server = server.as_ref().expect("spawned");
                // Its grant and release recorded too, from what it prints.
                let recorder = history.recorder(format!("process #{spawned}"));
                let mut w = super::faults::spawn_worker(
                    &ctx,
                    key,
                    server.addr(),
                    10_000,
                    ttl / 10,
                    Some(recorder),
                )
                .await?;
                spawned += 1;
                let acquired = match w.wait_for_acquired(ttl * 6).await {
                    Ok(acquired) => acquired,
                    Err(e) => {
                        // A line the history could not read fails the run: a grant is missing.
                        w.readable()?;
                        worker_errors.push(e);
                        false
                    }
                };
                let done = if fault == Fault::Pause {
                    paused
                } else {
                    killed
                };
                if !acquired {
                    // Nothing to pause or kill this time: stopped now (so that it does not take
                    // a key later and hold it for the rest of the run), and the kind stays due
                    // if it was never done.
                    w.stop().await?;
                    if done == 0 && !pending.contains(&fault) {
                        pending.push(fault);
                    }
                    continue;
                } else if fault == Fault::Pause {
                    lease_testkit::process::pause(w.pid()).map_err(|e| Failure(e.to_string()))?;
                    tokio::time::sleep(ttl * 2).await;
                    lease_testkit::process::resume(w.pid()).map_err(|e| Failure(e.to_string()))?;
                    paused += 1;
                } else {
                    lease_testkit::process::kill(w.pid()).map_err(|e| Failure(e.to_string()))?;
                    killed += 1;
                }
                workers.push(w);
            }
            None => {}
        }
    }
    for mut w in workers {
        w.stop().await?;
    }
    if spawned >= 2 && worker_errors.len() == spawned as usize {
        return Err(Failure(format!(
            "all {spawned} worker processes failed; the first: {}",
            worker_errors[0]
        )));
    }
    let named = named.into_inner();
    let report = format!(
        "{forced} force-releases ({named} naming the holder, {forced_own} of the monkey's own \
         lease), {restarts} restarts, {paused} processes paused, {killed} killed"
    );
    // The run claims every fault the subject allows: one never done is a failure, not a pass
    // that tested less (for example worker processes that never got a key: the first error
    // they reported says why).
    check!(
        pending.is_empty(),
        "the chaos run never did {pending:?} ({report}; {spawned} worker processes started, \
         errors: {worker_errors:?})"
    );
    Ok(report)
}

/// A lease (plain or kept) of a chaos worker, whose end is recorded in the history however it
/// comes: [`Held::release`] records the release, [`Held::crash`] records nothing (nothing is
/// sent; the key stays locked until the validity already recorded ends), and a drop, on an
/// error or on purpose, records a release invoked at the drop whose outcome is never known (a
/// dropped lease is released in the background). Before a release or a drop, the validity the
/// lease shows while held is recorded too ([`Recorder::valid`]), so that a kept lease's tenure is
/// checked to its renewed end. Property (e) relies on all of it: a holder that let go
/// unrecorded would make the next grant look like an overlap.
struct Held<L> {
    lease: Option<L>,
    /// The lease inside `L`.
    view: fn(&L) -> &dyn Lease,
    recorder: Recorder,
    key: String,
    token: u64,
}

impl Held<Box<dyn Lease>> {
    fn new(lease: Box<dyn Lease>, recorder: &Recorder, key: &LockKey) -> Self {
        Held {
            token: lease.token().get(),
            lease: Some(lease),
            view: |l| &**l,
            recorder: recorder.clone(),
            key: key.as_str().to_owned(),
        }
    }
}

impl<L> Held<L> {
    /// The lease turned into another holding of the same token (a kept lease, whose lease
    /// `view` shows); if that fails, the lease is gone and recorded as dropped.
    fn map<M>(
        mut self,
        f: impl FnOnce(L) -> lease_core::Result<M>,
        view: fn(&M) -> &dyn Lease,
    ) -> lease_core::Result<Held<M>> {
        let lease = self.lease.take().expect("held until released");
        let call = self.recorder.invoke();
        match f(lease) {
            Ok(m) => Ok(Held {
                lease: Some(m),
                view,
                recorder: self.recorder.clone(),
                key: self.key.clone(),
                token: self.token,
            }),
            Err(e) => {
                call.abandon(self.dropped());
                Err(e)
            }
        }
    }

    /// Releases with `release`, recording the validity seen, the call and its outcome.
    async fn release<F>(mut self, release: impl FnOnce(L) -> F) -> lease_core::Result<()>
    where
        F: std::future::Future<Output = lease_core::Result<()>>,
    {
        let lease = self.lease.take().expect("held until released");
        self.recorder.valid((self.view)(&lease));
        let call = self.recorder.invoke();
        let released = release(lease).await;
        call.complete(OpKind::Release {
            key: self.key.clone(),
            token: self.token,
            outcome: Done::from_result(&released),
        });
        released
    }

    /// A crash: no release, no destructor; the key stays locked until its validity ends.
    fn crash(mut self) {
        std::mem::forget(self.lease.take());
    }

    fn dropped(&self) -> OpKind {
        OpKind::Release {
            key: self.key.clone(),
            token: self.token,
            outcome: Done::Unknown("dropped: released in the background".into()),
        }
    }
}

impl<L> Drop for Held<L> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.recorder.valid((self.view)(&lease));
            let call = self.recorder.invoke();
            drop(lease);
            call.abandon(self.dropped());
        }
    }
}

/// One kind of fault the monkey causes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// An operator's force-release of a key.
    ForceRelease,
    /// The server killed and restarted.
    Restart,
    /// A worker process holding a key stopped (`SIGSTOP`) past its TTL, then resumed.
    Pause,
    /// A worker process holding a key killed (`SIGKILL`).
    Kill,
}
