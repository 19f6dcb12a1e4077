//! The fault cases: each ends with the fence's verdict on the superseded holder's write.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    keep, Bytes, Coordinator, Error, Fence, ForceRelease, KeeperOptions, Lease, LeaseOptions,
    LockKey, Token,
};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::time::Instant;

use super::{boxed, Case, CaseResult, Ctx, Failure, Need, Verdict};
use crate::check;
use crate::history::wire::WorkerFeed;
use crate::history::Recorder;
use lease_testkit::fence_server::{FenceServer, RecordingFence, RemoteFence};
use lease_testkit::proxy::FaultProxy;

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new("fault_stale_holder_paused_in_process", &[], 20, |c| {
            boxed(paused_in_process(c))
        }),
        Case::new(
            "fault_stale_holder_process_sigstop",
            &[Need::Processes],
            40,
            |c| boxed(paused_process(c)),
        ),
        Case::new(
            "fault_holder_partitioned_from_coordinator",
            &[Need::Proxy],
            40,
            |c| boxed(partitioned(c)),
        ),
        Case::new("fault_write_delayed_past_handoff", &[], 30, |c| {
            boxed(delayed_write(c))
        }),
        Case::new(
            "fault_coordinator_restart_between_holdings",
            &[Need::Restart, Need::DurableTokens],
            40,
            |c| boxed(restart_between(c)),
        ),
        Case::new(
            "fault_coordinator_restart_during_holding",
            &[Need::Restart, Need::DurableTokens],
            60,
            |c| boxed(restart_during(c)),
        ),
        Case::new(
            "fault_operator_deletes_lock_keys",
            &[Need::Operator],
            30,
            |c| boxed(operator_deletes(c)),
        ),
        Case::new("fault_holder_crashes_in_process", &[], 20, |c| {
            boxed(crashed_in_process(c))
        }),
        Case::new(
            "fault_worker_process_killed_before_and_after_acquire",
            &[Need::Processes],
            40,
            |c| boxed(killed_process(c)),
        ),
        Case::new("fault_force_release_while_worker_active", &[], 30, |c| {
            boxed(force_release_active(c))
        }),
    ]
}

async fn expect_stale(
    fence: &dyn Fence,
    key: &LockKey,
    token: Token,
    what: &str,
) -> Result<Token, Failure> {
    match fence
        .write(
            &res(key),
            token,
            Bytes::from(format!("stale write: {what}")),
        )
        .await
    {
        Err(Error::Stale {
            presented, current, ..
        }) => {
            check!(
                presented == token && current > token,
                "Stale error has presented {presented}, current {current}"
            );
            Ok(current)
        }
        other => Err(Failure(format!(
            "{what}: the superseded holder's write (token {token}) was not rejected: {other:?}"
        ))),
    }
}

fn res(key: &LockKey) -> lease_core::ResourceId {
    lease_core::ResourceId::from(key)
}

/// B acquires (waiting out A's TTL), claims and writes; returns B's lease.
async fn takeover(
    ctx: &Ctx,
    client: &dyn Coordinator,
    key: &LockKey,
    after: Token,
) -> Result<Box<dyn Lease>, Failure> {
    takeover_via(ctx, &**ctx.fence(), client, key, after).await
}

/// [`takeover`] through a given fence (a recording one, so the checker sees the claim).
async fn takeover_via(
    ctx: &Ctx,
    fence: &dyn Fence,
    client: &dyn Coordinator,
    key: &LockKey,
    after: Token,
) -> Result<Box<dyn Lease>, Failure> {
    let lease = client
        .acquire(key, &LeaseOptions::new(ctx.ttl() * 20).wait(ctx.ttl() * 10))
        .await
        .map_err(|e| Failure(format!("takeover acquire failed: {e}")))?;
    claim_as_new_owner(fence, key, after, lease).await
}

/// The new owner's part of a [`takeover`]: its token is above `after`, it claims the resource and
/// writes.
async fn claim_as_new_owner(
    fence: &dyn Fence,
    key: &LockKey,
    after: Token,
    lease: Box<dyn Lease>,
) -> Result<Box<dyn Lease>, Failure> {
    check!(
        lease.token() > after,
        "takeover token {} not above the old holder's {after}",
        lease.token()
    );
    fence.claim(&res(key), lease.token()).await?;
    fence
        .write(
            &res(key),
            lease.token(),
            Bytes::from_static(b"new owner's write"),
        )
        .await?;
    Ok(lease)
}

async fn final_value_is(ctx: &Ctx, key: &LockKey, token: Token) -> CaseResult {
    let state = ctx.fence().read(&res(key)).await?;
    let written_by = state
        .as_ref()
        .and_then(|s| s.value.as_ref())
        .map(|(t, _)| *t);
    check!(
        written_by == Some(token),
        "final value written by {written_by:?}, expected the new owner's {token}"
    );
    Ok(Verdict::Passed)
}

async fn paused_in_process(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("paused");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?;
    ctx.fence().claim(&res(&key), lease.token()).await?;
    ctx.fence()
        .write(
            &res(&key),
            lease.token(),
            Bytes::from_static(b"before pause"),
        )
        .await?;
    // A stalls (a stop-the-world pause: nothing of A runs) beyond its TTL.
    tokio::time::sleep(ctx.ttl() * 2).await;
    let new = takeover(&ctx, &*b, &key, lease.token()).await?;
    expect_stale(
        &**ctx.fence(),
        &key,
        lease.token(),
        "paused holder after resume",
    )
    .await?;
    check!(
        lease.lost().is_lost(),
        "the paused holder's lease still reports {:?}",
        lease.status()
    );
    final_value_is(&ctx, &key, new.token()).await?;
    new.release().await?;
    Ok(Verdict::Passed)
}

/// A worker process and its stdout.
pub(super) struct Worker {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    pid: u32,
    seen: Vec<String>,
    /// Records the worker's grants and releases into a history, when given one.
    feed: Option<WorkerFeed>,
    /// What the feed could not read, if anything: the history misses an operation.
    unreadable: Option<String>,
}

impl Worker {
    async fn spawn(
        ctx: &Ctx,
        key: &LockKey,
        fence: std::net::SocketAddr,
        writes: u64,
        interval: Duration,
        recorder: Option<Recorder>,
    ) -> Result<Worker, Failure> {
        let exe = ctx
            .subject
            .worker_exe
            .as_ref()
            .ok_or_else(|| Failure("no worker executable".into()))?;
        let url = ctx
            .subject
            .worker_url
            .as_ref()
            .ok_or_else(|| Failure("no worker URL".into()))?;
        // Before the spawn: its creation instant is the floor of every instant it records.
        let feed = recorder.map(|r| WorkerFeed::new(r, key.as_str()));
        let mut child = Command::new(exe)
            .args([
                "--coordinator",
                url,
                "--fence",
                &fence.to_string(),
                "--key",
                key.as_str(),
            ])
            .args(["--ttl-ms", &ctx.ttl().as_millis().to_string()])
            // The feed's creation, from which the worker's reported instants then count.
            .args(feed.iter().flat_map(|f| {
                [
                    "--clock-zero-ns".to_owned(),
                    f.clock_zero().as_nanos().to_string(),
                ]
            }))
            .args(["--wait-ms", &(ctx.ttl() * 20).as_millis().to_string()])
            .args([
                "--writes",
                &writes.to_string(),
                "--interval-ms",
                &interval.as_millis().to_string(),
            ])
            .stdout(Stdio::piped())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Failure(format!("could not start the worker {}: {e}", exe.display())))?;
        let pid = child
            .id()
            .ok_or_else(|| Failure("worker exited at once".into()))?;
        let stdout = child.stdout.take().expect("piped");
        Ok(Worker {
            child,
            lines: BufReader::new(stdout).lines(),
            pid,
            seen: Vec::new(),
            feed,
            unreadable: None,
        })
    }

    /// `Err` if the history feed met a line it could not read: the history misses an operation.
    pub(super) fn readable(&self) -> Result<(), Failure> {
        match &self.unreadable {
            Some(e) => Err(Failure(e.clone())),
            None => Ok(()),
        }
    }

    /// Keeps a line read from the worker, and records it into the history if it is fed one; a
    /// line the feed cannot read is an error that stays (see [`Worker::wait_for_acquired`]).
    fn saw(&mut self, line: String) -> Result<(), Failure> {
        self.seen.push(line);
        if let Some(feed) = &mut self.feed {
            let line = self.seen.last().expect("just pushed");
            if let Err(e) = feed.feed_legacy(line) {
                self.unreadable = Some(format!("worker {}: {e}", self.pid));
            }
        }
        self.readable()
    }

    /// Reads lines until one starts with `prefix`; fails on `ERROR`, EOF or timeout.
    async fn expect(&mut self, prefix: &str, within: Duration) -> Result<String, Failure> {
        let deadline = Instant::now() + within;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.next_line())
                .await
                .map_err(|_| {
                    Failure(format!(
                        "worker: no {prefix:?} line within {within:?}; saw {:?}",
                        self.seen
                    ))
                })?
                .map_err(|e| Failure(format!("worker stdout: {e}")))?
                .ok_or_else(|| {
                    Failure(format!(
                        "worker exited before {prefix:?}; saw {:?}",
                        self.seen
                    ))
                })?;
            self.saw(line.clone())?;
            if line.starts_with("ERROR") {
                return Err(Failure(format!("worker failed: {line}")));
            }
            if line.starts_with(prefix) {
                return Ok(line);
            }
        }
    }

    fn token(line: &str) -> Result<Token, Failure> {
        line.split(' ')
            .nth(1)
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| Failure(format!("bad worker line {line:?}")))
    }
}

async fn paused_process(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("sigstop");
    let rec = Arc::new(RecordingFence::new(ctx.fence().clone()));
    let log = rec.log();
    let server = FenceServer::start(rec.clone()).await?;
    let mut worker = Worker::spawn(&ctx, &key, server.addr(), 10_000, ctx.ttl() / 10, None).await?;
    let token_a = Worker::token(&worker.expect("ACQUIRED", ctx.ttl() * 20).await?)?;
    worker.expect("WRITE 0 OK", ctx.ttl() * 5).await?;
    lease_testkit::process::pause(worker.pid).map_err(|e| Failure(e.to_string()))?;
    tokio::time::sleep(ctx.ttl() * 2).await;
    let b = ctx.client().await?;
    let new = takeover_via(&ctx, &*rec, &*b, &key, token_a).await;
    lease_testkit::process::resume(worker.pid).map_err(|e| Failure(e.to_string()))?;
    let new = new?;
    let line = worker.expect("WRITE", ctx.ttl() * 10).await?;
    let stale_line = if line.contains("STALE") {
        line
    } else {
        worker.expect_stale_line(ctx.ttl() * 10).await?
    };
    check!(
        stale_line.contains(&format!("STALE {}", new.token())),
        "resumed worker saw {stale_line:?}"
    );
    let release = worker.expect("RELEASE ", ctx.ttl() * 10).await?;
    check!(
        release == "RELEASE LOST",
        "resumed worker's release: {release:?} (must not delete the new lock)"
    );
    check!(
        b.inspect(&key).await?.map(|h| h.token) == Some(new.token()),
        "new owner lost the key after the stale release"
    );
    verify_log(&log, &key, token_a, new.token())?;
    final_value_is(&ctx, &key, new.token()).await?;
    new.release().await?;
    let _ = worker.child.wait().await;
    Ok(Verdict::Passed)
}

impl Worker {
    async fn expect_stale_line(&mut self, within: Duration) -> Result<String, Failure> {
        loop {
            let line = self.expect("WRITE", within).await?;
            if line.contains("STALE") {
                return Ok(line);
            }
        }
    }
}

/// No write or claim with `old` was accepted after the new owner's claim with `new`.
fn verify_log(
    log: &lease_testkit::fence_server::FenceLog,
    key: &LockKey,
    old: Token,
    new: Token,
) -> Result<(), Failure> {
    log.check_monotonic().map_err(Failure)?;
    let resource = res(key);
    let records = log.records();
    let claim = records
        .iter()
        .position(|r| r.resource == resource && r.token == new && r.accepted)
        .ok_or_else(|| Failure("the new owner's claim is not in the fence log".into()))?;
    let late = records[claim..]
        .iter()
        .filter(|r| r.resource == resource && r.token == old && r.accepted)
        .count();
    check!(
        late == 0,
        "{late} operations with the superseded token {old} were accepted after the claim of {new}"
    );
    let rejected = records[claim..]
        .iter()
        .filter(|r| r.resource == resource && r.token == old && !r.accepted)
        .count();
    check!(
        rejected > 0,
        "the superseded holder never tried to write after the hand-off"
    );
    Ok(())
}

async fn partitioned(ctx: Arc<Ctx>) -> CaseResult {
    let (upstream, connect_via) = ctx
        .subject
        .proxy
        .clone()
        .ok_or_else(|| Failure("no proxy".into()))?;
    let proxy = FaultProxy::start(upstream).await?;
    let a = connect_via(proxy.addr()).await?;
    let key = ctx.key("partition");
    let kept = keep(
        a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?,
        KeeperOptions::new(),
    )?;
    let token_a = kept.token();
    ctx.fence().claim(&res(&key), token_a).await?;
    // Cut the holder off from the coordinator, but not from the storage.
    proxy.blackhole();
    let mut lost = kept.lost();
    // The next holder asks at once, and is granted the key as soon as the coordinator frees it
    // on its own (the holder can tell it nothing). By then the holder must have stopped
    // believing in its lease: its local validity ends no later than the server's expiry.
    let b = ctx.client().await?;
    let next = b
        .acquire(
            &key,
            &LeaseOptions::new(ctx.ttl() * 20).wait(ctx.ttl() * 10),
        )
        .await
        .map_err(|e| Failure(format!("takeover acquire failed: {e}")))?;
    let granted_by = Instant::now();
    let believed_until = kept.lease().valid_until();
    check!(
        believed_until <= granted_by,
        "the partitioned holder's validity ran {:?} past the next holder's grant",
        believed_until - granted_by
    );
    let reason = tokio::time::timeout(ctx.ttl() * 5, lost.wait())
        .await
        .map_err(|_| Failure("a partitioned holder's lost() did not fire".into()))?;
    let new = claim_as_new_owner(&**ctx.fence(), &key, token_a, next).await?;
    expect_stale(
        &**ctx.fence(),
        &key,
        token_a,
        &format!("partitioned holder (lost: {reason})"),
    )
    .await?;
    proxy.heal();
    drop(kept);
    final_value_is(&ctx, &key, new.token()).await?;
    new.release().await?;
    Ok(Verdict::Passed)
}

async fn delayed_write(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("delayed");
    let rec = Arc::new(RecordingFence::new(ctx.fence().clone()));
    let log = rec.log();
    let server = FenceServer::start(rec.clone()).await?;
    let proxy = FaultProxy::start(server.addr()).await?;
    let slow_fence = RemoteFence::new(proxy.addr());
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?;
    let token_a = lease.token();
    slow_fence.claim(&res(&key), token_a).await?;
    // The write leaves A while A still holds the lease, and the network holds it back until
    // the new owner has claimed (a partition healed late: the held bytes arrive then, in order),
    // however long the takeover takes.
    proxy.blackhole();
    let in_flight = {
        let key = key.clone();
        tokio::spawn(async move {
            slow_fence
                .write(&res(&key), token_a, Bytes::from_static(b"delayed write"))
                .await
        })
    };
    let new = takeover_via(&ctx, &*rec, &*b, &key, token_a).await?;
    proxy.heal();
    let delayed = in_flight
        .await
        .map_err(|e| Failure(format!("writer panicked: {e}")))?;
    check!(
        matches!(delayed, Err(Error::Stale { current, .. }) if current >= new.token()),
        "the delayed write arrived after the hand-off and must be Stale, got {delayed:?}"
    );
    verify_log(&log, &key, token_a, new.token())?;
    final_value_is(&ctx, &key, new.token()).await?;
    drop(lease);
    new.release().await?;
    Ok(Verdict::Passed)
}

/// Kills the server with SIGKILL and starts it again on the same data directory.
async fn crash_and_restart(ctx: &Ctx) -> Result<(), Failure> {
    let server = ctx
        .subject
        .server
        .clone()
        .ok_or_else(|| Failure("no server".into()))?;
    let mut guard = server.lock().await;
    tokio::task::block_in_place(|| {
        guard.kill()?;
        guard.restart()
    })
    .map_err(|e| Failure(format!("restart failed: {e}")))
}

/// Acquires, retrying while the backend reports itself unavailable just after a restart.
async fn acquire_after_restart(
    ctx: &Ctx,
    client: &dyn Coordinator,
    key: &LockKey,
    o: &LeaseOptions,
) -> Result<Box<dyn Lease>, Failure> {
    let deadline = Instant::now() + Duration::from_secs(15) + ctx.ttl() * 10;
    loop {
        match client.acquire(key, o).await {
            Ok(l) => return Ok(l),
            Err(e @ (Error::Unavailable { .. } | Error::OutcomeUnknown { .. }))
                if Instant::now() < deadline =>
            {
                tracing::debug!(error = %e, "retrying after restart");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(Failure(format!("acquire after restart: {e}"))),
        }
    }
}

async fn restart_between(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("restart-between");
    let a = ctx.client().await?;
    let first = a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?;
    let t1 = first.token();
    first.release().await?;
    crash_and_restart(&ctx).await?;
    let b = ctx.client().await?;
    let o = LeaseOptions::new(ctx.ttl()).wait(ctx.ttl() * 10);
    let second = acquire_after_restart(&ctx, &*b, &key, &o).await?;
    check!(
        second.token() > t1,
        "token after restart {} not above {t1}",
        second.token()
    );
    let t2 = second.token();
    second.release().await?;
    // The client that existed before the crash reconnects and keeps the order too.
    let third = acquire_after_restart(&ctx, &*a, &key, &o).await?;
    check!(
        third.token() > t2,
        "old client's token after restart {} not above {t2}",
        third.token()
    );
    third.release().await?;
    Ok(Verdict::Passed)
}

async fn restart_during(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("restart-during");
    let a = ctx.client().await?;
    // Long enough to outlast the restart where a lease has its own TTL (Redis, etcd), so that a
    // restart losing the lock shows. Where a session's bound caps it (ZooKeeper, Consul), the
    // validity promised before the crash is about one session timeout, and the check below
    // proves less.
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl() * 3)).await?;
    let token_a = lease.token();
    ctx.fence().claim(&res(&key), token_a).await?;
    ctx.fence()
        .write(&res(&key), token_a, Bytes::from_static(b"before crash"))
        .await?;
    // What the holder was promised before the crash: no one else holds the key until then.
    let promised = lease.valid_until();
    crash_and_restart(&ctx).await?;
    let b = ctx.client().await?;
    let o = LeaseOptions::new(ctx.ttl() * 20).wait(ctx.ttl() * 10);
    let new = acquire_after_restart(&ctx, &*b, &key, &o).await?;
    let now = Instant::now();
    check!(
        now >= promised,
        "the key was granted again {:?} before the validity the holder had before the restart \
         ended: two holders",
        promised - now
    );
    check!(
        new.token() > token_a,
        "token after a crash during a holding {} not above {token_a}",
        new.token()
    );
    ctx.fence().claim(&res(&key), new.token()).await?;
    ctx.fence()
        .write(&res(&key), new.token(), Bytes::from_static(b"after crash"))
        .await?;
    expect_stale(
        &**ctx.fence(),
        &key,
        token_a,
        "holder from before the crash",
    )
    .await?;
    // The old holder's renewal must end in `Lost`. While its client reconnects it may be told
    // `Unavailable` (or not hear the answer): asked again, within a bound, but any other answer
    // (above all `Ok`) fails.
    let asked_until = Instant::now() + ctx.ttl() * 3 + Duration::from_secs(5);
    loop {
        match lease.renew().await {
            Err(Error::Lost { .. }) => break,
            Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. })
                if Instant::now() < asked_until =>
            {
                tokio::time::sleep(ctx.ttl() / 10).await;
            }
            Ok(_) => {
                return Err(Failure(
                    "the old holder renewed a lock the new owner holds".into(),
                ))
            }
            Err(e) => {
                return Err(Failure(format!(
                    "the old holder's renewal after the restart ended in {e}, not Lost"
                )))
            }
        }
    }
    check!(
        b.inspect(&key).await?.map(|h| h.token) == Some(new.token()),
        "new owner not shown by inspect"
    );
    new.release().await?;
    Ok(Verdict::Passed)
}

async fn operator_deletes(ctx: Arc<Ctx>) -> CaseResult {
    let op = ctx
        .subject
        .operator
        .clone()
        .ok_or_else(|| Failure("no operator".into()))?;
    let key = ctx.key("operator");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let o = LeaseOptions::new(ctx.ttl() * 20).wait(ctx.ttl() * 10);
    let first = a.acquire(&key, &o).await?;
    let mut last = first.token();
    first.release().await?;
    op.delete_key(&key)
        .await
        .map_err(|e| Failure(format!("operator delete: {e}")))?;
    let l = b.acquire(&key, &o).await?;
    check!(
        l.token() > last,
        "token after the operator deleted the key: {} not above {last}",
        l.token()
    );
    last = l.token();
    l.release().await?;
    if op
        .delete_parent(&key)
        .await
        .map_err(|e| Failure(format!("operator delete parent: {e}")))?
    {
        let l = b.acquire(&key, &o).await?;
        check!(
            l.token() > last,
            "token after the operator deleted the parent: {} not above {last}",
            l.token()
        );
        last = l.token();
        l.release().await?;
    }
    // Deleted while held: the next holder still gets a larger token, the old one is cut off.
    let held = a.acquire(&key, &o).await?;
    check!(
        held.token() > last,
        "token {} not above {last}",
        held.token()
    );
    ctx.fence().claim(&res(&key), held.token()).await?;
    op.delete_key(&key)
        .await
        .map_err(|e| Failure(format!("operator delete: {e}")))?;
    let new = takeover(&ctx, &*b, &key, held.token()).await?;
    expect_stale(
        &**ctx.fence(),
        &key,
        held.token(),
        "holder whose key the operator deleted",
    )
    .await?;
    check!(
        matches!(held.renew().await, Err(Error::Lost { .. })),
        "holder whose key was deleted renewed"
    );
    new.release().await?;
    Ok(Verdict::Passed)
}

async fn crashed_in_process(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("crash");
    let (a, b) = (ctx.client().await?, ctx.client().await?);
    let lease = a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?;
    // The validity is counted from before the grant was sent, so the server's TTL ends no
    // earlier, however long the grant's reply took.
    super::vanish_and_take_over(&ctx, lease, &*b, &key, "the crashed holder").await?;
    Ok(Verdict::Passed)
}

async fn killed_process(ctx: Arc<Ctx>) -> CaseResult {
    let server = FenceServer::start(ctx.fence().clone()).await?;
    let b = ctx.client().await?;
    // Killed after acquiring: the next holder gets the key after the TTL, with a larger token.
    let key = ctx.key("killed-after");
    let mut worker = Worker::spawn(&ctx, &key, server.addr(), 10_000, ctx.ttl() / 10, None).await?;
    let token = Worker::token(&worker.expect("ACQUIRED", ctx.ttl() * 20).await?)?;
    lease_testkit::process::kill(worker.pid).map_err(|e| Failure(e.to_string()))?;
    let _ = worker.child.wait().await;
    let killed_at = Instant::now();
    let next = b
        .acquire(&key, &LeaseOptions::new(ctx.ttl()).wait(ctx.ttl() * 10))
        .await
        .map_err(|e| {
            Failure(format!(
                "key stayed blocked after the holder was killed: {e}"
            ))
        })?;
    check!(
        next.token() > token,
        "token {} not above the killed holder's {token}",
        next.token()
    );
    tracing::debug!(after = ?killed_at.elapsed(), "key free after kill");
    next.release().await?;
    // Killed while waiting: it leaves no waiter that blocks others.
    let key = ctx.key("killed-before");
    let holder = b.acquire(&key, &LeaseOptions::new(ctx.ttl() * 20)).await?;
    let mut worker = Worker::spawn(&ctx, &key, server.addr(), 1, ctx.ttl() / 10, None).await?;
    // Connected, found the key held, and gone on to wait (it says so before its waiting
    // acquire); a moment more lets that acquire reach the server. The check below holds
    // whether or not it has.
    worker
        .expect("WAITING", ctx.ttl() * 10 + Duration::from_secs(10))
        .await?;
    tokio::time::sleep(ctx.ttl() / 4).await;
    check!(
        worker.child.try_wait()?.is_none(),
        "worker exited while it should be waiting; saw {:?}",
        worker.seen
    );
    lease_testkit::process::kill(worker.pid).map_err(|e| Failure(e.to_string()))?;
    let _ = worker.child.wait().await;
    holder.release().await?;
    let c = ctx.client().await?;
    let next = c
        .acquire(&key, &LeaseOptions::new(ctx.ttl()).wait(ctx.ttl() * 5))
        .await
        .map_err(|e| Failure(format!("a killed waiter blocked the key: {e}")))?;
    check!(
        next.token() > holder.token(),
        "token {} not above {}",
        next.token(),
        holder.token()
    );
    next.release().await?;
    Ok(Verdict::Passed)
}

async fn force_release_active(ctx: Arc<Ctx>) -> CaseResult {
    let key = ctx.key("forced");
    let (a, b, op) = (
        ctx.client().await?,
        ctx.client().await?,
        ctx.client().await?,
    );
    let kept = keep(
        a.acquire(&key, &LeaseOptions::new(ctx.ttl())).await?,
        KeeperOptions::new(),
    )?;
    let token_a = kept.token();
    ctx.fence().claim(&res(&key), token_a).await?;
    ctx.fence()
        .write(&res(&key), token_a, Bytes::from_static(b"active worker"))
        .await?;
    let removed = op
        .force_release(
            &key,
            &ForceRelease::new("conformance", "force-release while active")?,
        )
        .await?;
    check!(
        removed.map(|h| h.token) == Some(token_a),
        "force_release did not remove the active worker"
    );
    let new = takeover(&ctx, &*b, &key, token_a).await?;
    // The worker, still running, writes again: the fence rejects it once the new owner claimed.
    expect_stale(&**ctx.fence(), &key, token_a, "force-released worker").await?;
    // Its keeper learns of the loss by its next renewal at the latest.
    let mut lost = kept.lost();
    tokio::time::timeout(ctx.ttl() * 3, lost.wait())
        .await
        .map_err(|_| Failure("the force-released worker's lease never reported lost".into()))?;
    check!(
        b.inspect(&key).await?.map(|h| h.token) == Some(new.token()),
        "the keeper disturbed the new owner"
    );
    drop(kept);
    new.release().await?;
    Ok(Verdict::Passed)
}

/// Starts a worker process (for the chaos run).
pub(super) async fn spawn_worker(
    ctx: &Ctx,
    key: &LockKey,
    fence: std::net::SocketAddr,
    writes: u64,
    interval: Duration,
    recorder: Option<Recorder>,
) -> Result<Worker, Failure> {
    Worker::spawn(ctx, key, fence, writes, interval, recorder).await
}

impl Worker {
    /// The worker's PID.
    pub(super) fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the worker reported `ACQUIRED` within `within` (`Ok(false)`: not yet); `Err` with
    /// what it said when it failed or exited instead.
    pub(super) async fn wait_for_acquired(&mut self, within: Duration) -> Result<bool, String> {
        match self.expect("ACQUIRED", within).await {
            Ok(_) => Ok(true),
            Err(_)
                if self.child.try_wait().ok().flatten().is_none()
                    && self.unreadable.is_none()
                    && !self.seen.iter().any(|l| l.starts_with("ERROR")) =>
            {
                Ok(false)
            }
            Err(Failure(e)) => Err(e),
        }
    }

    /// Kills the worker and reaps it. A worker fed into a history has the lines it printed
    /// before it died read and recorded (a grant the harness had not read yet, a release).
    pub(super) async fn stop(&mut self) -> Result<(), Failure> {
        let _ = lease_testkit::process::resume(self.pid);
        let _ = self.child.kill().await;
        if self.feed.is_none() {
            return Ok(());
        }
        // The pipe ends with the process; bounded in case something else holds its write end.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match tokio::time::timeout_at(deadline, self.lines.next_line()).await {
                Ok(Ok(Some(line))) => self.saw(line)?,
                Ok(Ok(None)) => {
                    if let Some(feed) = self.feed.take() {
                        feed.end();
                    }
                    return self.readable();
                }
                Ok(Err(e)) => return Err(Failure(format!("worker {} stdout: {e}", self.pid))),
                Err(_) => {
                    return Err(Failure(format!(
                        "worker {}: its stdout did not end within 10 s of its kill",
                        self.pid
                    )))
                }
            }
        }
    }
}
