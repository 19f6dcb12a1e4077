//! Cases for replicated coordinators: a member crashed, frozen or cut off while leases are held,
//! and a failover to a replica that missed writes. They run only against subjects with a
//! [`ClusterControl`](lease_testkit::harness::ClusterControl) and are skipped by name on single servers.
//!
//! Every case leaves the cluster whole: members it killed are restarted and cuts are healed,
//! also when a check fails (see [`Restore`]).

use std::sync::Arc;
use std::time::Duration;

use lease_core::{
    keep, Bytes, Error, Fence, KeeperOptions, LeaseOptions, LeaseStatus, ResourceId, Token,
};
use rand::{Rng, SeedableRng};
use tokio::time::Instant;

use super::{boxed, Case, CaseResult, Ctx, Failure, Need, Verdict};
use crate::check;
use crate::history::{Done, History, HistoryFence, OpKind};
use lease_testkit::harness::ClusterControl;

pub(super) fn cases() -> Vec<Case> {
    vec![
        Case::new("leader_killed_during_hold", &[Need::Cluster], 20, |c| {
            boxed(with_logs(c, leader_killed_during_hold))
        }),
        Case::new("failover_to_lagging_replica", &[Need::Cluster], 20, |c| {
            boxed(with_logs(c, failover_to_lagging_replica))
        }),
        Case::new(
            "minority_partition_of_holders_member",
            &[Need::Cluster],
            20,
            |c| boxed(with_logs(c, minority_partition_of_holders_member)),
        ),
        Case::new("follower_cut_after_sync", &[Need::Cluster], 20, |c| {
            boxed(with_logs(c, follower_cut_after_sync))
        }),
        Case::new("rolling_restart", &[Need::Cluster], 40, |c| {
            boxed(with_logs(c, rolling_restart))
        }),
    ]
}

/// Runs a cluster case; when it fails under `CI=true` or with `CONFORMANCE_CLUSTER_LOGS` set,
/// prints the members' log tails (what the Sentinels, the quorum or the leader election did), so
/// that a failure seen once in CI can be told apart afterwards. A case stopped at its budget or
/// panicking fails too: the tails are printed when the case's future is dropped unfinished.
async fn with_logs<F, Fut>(ctx: Arc<Ctx>, case: F) -> CaseResult
where
    F: FnOnce(Arc<Ctx>) -> Fut,
    Fut: std::future::Future<Output = CaseResult>,
{
    /// Prints the tails on drop unless the case passed.
    struct Tails {
        subject: super::Subject,
        passed: bool,
    }
    impl Drop for Tails {
        fn drop(&mut self) {
            let wanted = std::env::var_os("CONFORMANCE_CLUSTER_LOGS")
                .is_some_and(|v| !v.is_empty())
                || lease_testkit::harness::ci_requires_servers();
            if !self.passed && wanted {
                let tails = log_tails(&self.subject);
                if !tails.is_empty() {
                    eprintln!("{tails}");
                }
            }
        }
    }
    let mut tails = Tails {
        subject: ctx.subject.clone(),
        passed: false,
    };
    let r = case(ctx).await;
    tails.passed = r.is_ok();
    r
}

/// What the cluster's members logged last, with the subject's secret (a password in its URL)
/// redacted; empty without a cluster.
fn log_tails(subject: &super::Subject) -> String {
    let Some(cluster) = &subject.cluster else {
        return String::new();
    };
    let tails = cluster.log_tails();
    match subject.secret.as_deref() {
        Some(secret) if !secret.is_empty() => tails.replace(secret, "<redacted>"),
        _ => tails,
    }
}

fn cluster(ctx: &Ctx) -> Result<Arc<dyn ClusterControl>, Failure> {
    ctx.subject
        .cluster
        .clone()
        .ok_or_else(|| Failure("the subject has no cluster control".into()))
}

/// What a case must undo before it returns: members to restart, members to heal.
///
/// [`Restore::finish`] runs it and reports its own failure; dropping it unfinished (a check
/// failed) still restores, on a spawned task the runner waits for before the next case, so
/// that case starts with a whole cluster.
struct Restore {
    subject: super::Subject,
    cluster: Arc<dyn ClusterControl>,
    killed: Vec<usize>,
    paused: Vec<usize>,
    cut: Vec<usize>,
}

impl Restore {
    fn new(ctx: &Ctx, cluster: Arc<dyn ClusterControl>) -> Self {
        Restore {
            subject: ctx.subject.clone(),
            cluster,
            killed: Vec::new(),
            paused: Vec::new(),
            cut: Vec::new(),
        }
    }

    async fn kill(&mut self, member: usize) -> Result<(), Failure> {
        self.killed.push(member);
        self.cluster
            .kill(member)
            .await
            .map_err(|e| Failure(format!("killing member {member}: {e}")))
    }

    async fn finish(mut self) -> Result<(), Failure> {
        let (cluster, killed, paused, cut) = (
            self.cluster.clone(),
            std::mem::take(&mut self.killed),
            std::mem::take(&mut self.paused),
            std::mem::take(&mut self.cut),
        );
        restore(cluster, killed, paused, cut).await
    }
}

async fn restore(
    cluster: Arc<dyn ClusterControl>,
    killed: Vec<usize>,
    paused: Vec<usize>,
    cut: Vec<usize>,
) -> Result<(), Failure> {
    let mut problems = Vec::new();
    for m in paused {
        if let Err(e) = cluster.resume(m).await {
            problems.push(format!("resuming member {m}: {e}"));
        }
    }
    for m in cut {
        if let Err(e) = cluster.heal(m).await {
            problems.push(format!("healing member {m}: {e}"));
        }
    }
    for m in killed {
        if let Err(e) = cluster.restart(m).await {
            problems.push(format!("restarting member {m}: {e}"));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Failure(format!(
            "could not restore the cluster: {}",
            problems.join("; ")
        )))
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if self.killed.is_empty() && self.paused.is_empty() && self.cut.is_empty() {
            return;
        }
        let (cluster, killed, paused, cut) = (
            self.cluster.clone(),
            std::mem::take(&mut self.killed),
            std::mem::take(&mut self.paused),
            std::mem::take(&mut self.cut),
        );
        self.subject.clean_up_later(async move {
            if let Err(e) = restore(cluster, killed, paused, cut).await {
                eprintln!("{e}");
            }
        });
    }
}

/// The holder's lease through a leader crash: it either survives (its validity confirmed by the
/// new leader, so nobody else gets the key until it is released) or is reported lost before
/// another client holds the key; the next token is greater than every earlier one, and the fence
/// rejects the old holder once the new one has claimed.
async fn leader_killed_during_hold(ctx: Arc<Ctx>) -> CaseResult {
    let cluster = cluster(&ctx)?;
    let key = ctx.key("leader-killed");
    let resource = ctx.resource(&key);
    let ttl = ctx.ttl();
    let holder_client = ctx.client().await?;
    let held = holder_client
        .acquire(&key, &LeaseOptions::new(ttl).wait(ttl * 4))
        .await?;
    let first = held.token();
    ctx.fence()
        .write(&resource, first, Bytes::from_static(b"before"))
        .await?;
    let kept = keep(held, KeeperOptions::new())?;

    let leader = cluster
        .leader()
        .await
        .map_err(|e| Failure(format!("finding the leader: {e}")))?;
    // Another client, connected before the crash, asks for the key while the cluster fails
    // over. It may only get it once the holder's lease no longer reports Held.
    let other = ctx.client().await?;
    let mut restore = Restore::new(&ctx, cluster.clone());
    let killed_at = Instant::now();
    restore.kill(leader).await?;
    let wait = cluster.failover_bound() + ttl * 3;
    let survived = match acquire_through_failover(&*other, &key, ttl, wait).await {
        Ok(second) => {
            let holder_status = kept.lease().status();
            check!(
                !matches!(holder_status, LeaseStatus::Held),
                "another client holds the key (token {}) {:?} after the leader crashed, while \
                 the first holder (token {first}) still reports Held",
                second.token(),
                killed_at.elapsed()
            );
            check_next(&ctx, &resource, first, second.token()).await?;
            second.release().await?;
            false
        }
        Err(Error::Timeout { .. }) | Err(Error::Held { .. }) => {
            // The lease survived the failover: it must still be Held (or at worst in doubt
            // while the keeper catches up), never silently gone with the key still locked.
            let status = kept.lease().status();
            check!(
                !matches!(status, LeaseStatus::Lost(_)),
                "nobody could take the key for {wait:?} after the leader crashed, yet the \
                 holder reports {status:?}: the key was left locked"
            );
            true
        }
        Err(e) => return Err(Failure(format!("acquiring after the leader crash: {e}"))),
    };
    if survived {
        // The holder renews on the new leader, then releases; the next grant is above it.
        let until = Instant::now() + ttl * 2;
        while Instant::now() < until {
            if let LeaseStatus::Lost(r) = kept.lease().status() {
                return Err(Failure(format!(
                    "the lease survived the failover but was lost afterwards ({r:?})"
                )));
            }
            tokio::time::sleep(ttl / 10).await;
        }
        kept.release().await?;
        let third = other
            .acquire(&key, &LeaseOptions::new(ttl).wait(ttl * 2))
            .await?;
        check_next(&ctx, &resource, first, third.token()).await?;
        third.release().await?;
    } else {
        let _ = kept.release().await;
    }
    restore.finish().await?;
    Ok(Verdict::Passed)
}

/// Names the step an error came from, for a failure message.
fn step(what: &str) -> impl FnOnce(Error) -> Failure + '_ {
    move |e| Failure(format!("{what}: {e}"))
}

/// `acquire` with a wait, asked again while the cluster answers `Unavailable` or leaves the
/// outcome unknown (a failover in progress), until `wait` has passed.
async fn acquire_through_failover(
    client: &dyn lease_core::Coordinator,
    key: &lease_core::LockKey,
    ttl: Duration,
    wait: Duration,
) -> lease_core::Result<Box<dyn lease_core::Lease>> {
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match client
            .acquire(key, &LeaseOptions::new(ttl).wait(left))
            .await
        {
            Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. })
                if Instant::now() + Duration::from_millis(100) < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Waits until `member` leads after the leader's crash. The case is about what follows a
/// failover, not about how it came: when the cluster's own did not come within its bound (a
/// Sentinel whose election failed waits twice its failover-timeout before it tries again), it
/// asks for one, as an operator would, every two seconds until one is started, and waits one
/// more bound, printing once what the members logged.
async fn wait_for_promotion(
    ctx: &Ctx,
    cluster: &dyn ClusterControl,
    member: usize,
) -> Result<(), Failure> {
    let bound = cluster.failover_bound();
    let killed_at = Instant::now();
    let mut last = String::from("no primary named yet");
    let (mut refused, mut started) = (None, false);
    let mut forcing = false;
    loop {
        let now = Instant::now();
        if now >= killed_at + bound * 2 {
            return Err(Failure(format!(
                "no failover to member {member} within {:?} of the leader's crash, even after \
                 asking for one: {last}{}",
                killed_at.elapsed(),
                refused
                    .map(|e| format!("; the last request for one: {e}"))
                    .unwrap_or_default()
            )));
        }
        if now >= killed_at + bound && !started {
            match cluster.force_failover().await {
                Ok(true) => (refused, started) = (None, true),
                Ok(false) => {
                    return Err(Failure(format!(
                        "no failover to member {member} within {bound:?}: {last}"
                    )))
                }
                Err(e) => refused = Some(e.to_string()),
            }
            if !forcing {
                forcing = true;
                eprintln!(
                    "note: {}: no failover within {bound:?} of the leader's crash ({last}); \
                     asking for one. What the members logged:\n{}",
                    cluster.kind(),
                    log_tails(&ctx.subject)
                );
            }
        }
        let step = if forcing {
            Duration::from_secs(2)
        } else {
            (killed_at + bound).saturating_duration_since(now)
        };
        match tokio::time::timeout(step, cluster.leader()).await {
            Ok(Ok(m)) if m == member => return Ok(()),
            Ok(Ok(m)) => {
                return Err(Failure(format!(
                    "member {m} was promoted, not the lagging member {member}"
                )))
            }
            Ok(Err(e)) => {
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => last = format!("no leader that answers named within {step:?}"),
        }
    }
}

/// The newer holder's token is above the older one's, its claim is accepted, and a write fenced
/// with the older token is rejected afterwards.
async fn check_next(
    ctx: &Ctx,
    resource: &lease_core::ResourceId,
    older: Token,
    newer: Token,
) -> Result<(), Failure> {
    check!(
        newer > older,
        "the token went from {older} to {newer} across the failover (must strictly increase)"
    );
    ctx.fence().claim(resource, newer).await?;
    match ctx
        .fence()
        .write(resource, older, Bytes::from_static(b"stale"))
        .await
    {
        Err(Error::Stale { .. }) => Ok(()),
        Ok(_) => Err(Failure(format!(
            "a write fenced with the old token {older} was accepted after token {newer} claimed"
        ))),
        Err(e) => Err(Failure(format!("the stale write failed oddly: {e}"))),
    }
}

/// Redis: a replica falls behind (its link cut while tokens are issued), the primary crashes,
/// the lagging replica is promoted (by the cluster's own failover, or, when that does not come
/// within its bound, by one asked for with `force_failover`). The next token is above the last
/// one issued before the failover, and a write fenced with that last token is rejected once the
/// new holder claimed.
async fn failover_to_lagging_replica(ctx: Arc<Ctx>) -> CaseResult {
    let cluster = cluster(&ctx)?;
    let primary = cluster
        .leader()
        .await
        .map_err(|e| Failure(format!("finding the primary: {e}")))?;
    let Some(lagging) = (0..cluster.members()).find(|m| *m != primary) else {
        return Ok(Verdict::Skipped("the cluster has a single member".into()));
    };
    let key = ctx.key("lagging");
    let resource = ctx.resource(&key);
    let ttl = ctx.ttl();
    let client = ctx.client().await?;
    // A first grant every member has seen.
    let lease = client
        .acquire(&key, &LeaseOptions::new(ttl))
        .await
        .map_err(step("the first grant"))?;
    lease
        .release()
        .await
        .map_err(step("releasing the first grant"))?;

    let mut restore = Restore::new(&ctx, cluster.clone());
    restore.cut.push(lagging);
    if !cluster
        .lag_replica(lagging)
        .await
        .map_err(|e| Failure(format!("making member {lagging} lag: {e}")))?
    {
        restore.cut.clear();
        return Ok(Verdict::Skipped(format!(
            "{} has no replica that can be made to lag",
            cluster.kind()
        )));
    }
    // Tokens the lagging replica never sees.
    let mut last = None;
    for i in 0..5 {
        let lease = client
            .acquire(&key, &LeaseOptions::new(ttl))
            .await
            .map_err(step(&format!("grant {i} while member {lagging} lags")))?;
        last = Some(lease.token());
        lease.release().await.map_err(step(&format!(
            "releasing grant {i} while member {lagging} lags"
        )))?;
    }
    let last = last.expect("five grants");
    ctx.fence()
        .write(&resource, last, Bytes::from_static(b"before failover"))
        .await
        .map_err(step("the fenced write before the failover"))?;
    // Connected before the crash: it follows the failover by itself.
    let fresh = ctx.client().await?;
    restore.kill(primary).await?;
    wait_for_promotion(&ctx, &*cluster, lagging).await?;
    let next = acquire_through_failover(&*fresh, &key, ttl, cluster.failover_bound())
        .await
        .map_err(step("the grant after the failover"))?;
    check_next(&ctx, &resource, last, next.token()).await?;
    next.release()
        .await
        .map_err(step("releasing the grant after the failover"))?;
    restore.finish().await?;
    Ok(Verdict::Passed)
}

/// The member the holder talks to is cut from its peers, not from the holder. Whatever that
/// member answers from its stale state, no ownership decision rests on it: once a client of the
/// majority holds the key, the holder does not report Held, then or later; and if the key stays
/// with the holder, the holder is not silently lost with the key left locked. Where the cut
/// member keeps serving and nobody replaces it (a Redis primary cut from its replicas but not
/// from the Sentinels), a coordinator that waits for replicas refuses grants and renewals it
/// cannot replicate: the majority's acquire is `Unavailable` to the end, and by then the
/// holder, whose renewals were refused too, does not report Held.
async fn minority_partition_of_holders_member(ctx: Arc<Ctx>) -> CaseResult {
    let cluster = cluster(&ctx)?;
    let Some(connect_member) = ctx.subject.connect_member.clone() else {
        return Ok(Verdict::Skipped(
            "the subject cannot pin a client to one member".into(),
        ));
    };
    let leader = cluster
        .leader()
        .await
        .map_err(|e| Failure(format!("finding the leader: {e}")))?;
    let member = cluster.holder_member(leader);
    let key = ctx.key("minority");
    let ttl = ctx.ttl();
    let holder = connect_member(member)
        .await
        .map_err(|e| Failure(format!("connecting a client to member {member}: {e}")))?;
    let held = holder
        .acquire(&key, &LeaseOptions::new(ttl).wait(ttl * 4))
        .await?;
    let first = held.token();
    let kept = keep(held, KeeperOptions::new())?;
    let other = ctx.client().await?;

    let mut restore = Restore::new(&ctx, cluster.clone());
    restore.cut.push(member);
    cluster
        .isolate_from_peers(member)
        .await
        .map_err(|e| Failure(format!("cutting member {member} from its peers: {e}")))?;
    let cut_at = Instant::now();

    let wait = cluster.failover_bound() + ttl * 3;
    match acquire_through_failover(&*other, &key, ttl, wait).await {
        Ok(second) => {
            let status = kept.lease().status();
            check!(
                !matches!(status, LeaseStatus::Held),
                "a client of the majority holds the key (token {}) {:?} after member {member} \
                 was cut from its peers, while the holder talking to it still reports Held \
                 (token {first})",
                second.token(),
                cut_at.elapsed()
            );
            check!(
                second.token() > first,
                "the token went from {first} to {} across the partition",
                second.token()
            );
            // Nothing the stale member says may bring the holder back (watched for half the
            // second holder's TTL, so that it still holds when it releases).
            let until = Instant::now() + ttl / 2;
            while Instant::now() < until {
                check!(
                    !matches!(kept.lease().status(), LeaseStatus::Held),
                    "the holder reports Held again while another client holds the key"
                );
                tokio::time::sleep(ttl / 20).await;
            }
            second.release().await?;
        }
        Err(Error::Timeout { .. } | Error::Held { .. }) => {
            let status = kept.lease().status();
            check!(
                !matches!(status, LeaseStatus::Lost(_)),
                "nobody could take the key for {wait:?} after member {member} was cut from \
                 its peers, yet the holder reports {status:?}: the key was left locked"
            );
        }
        Err(Error::Unavailable { .. }) => {
            let status = kept.lease().status();
            check!(
                !matches!(status, LeaseStatus::Held),
                "grants were refused for {wait:?} after member {member} was cut from its \
                 peers, yet the holder talking to it still reports Held"
            );
        }
        Err(e) => return Err(Failure(format!("acquiring from the majority: {e}"))),
    }
    let _ = kept.release().await;
    restore.finish().await?;
    Ok(Verdict::Passed)
}

/// Every member restarted in turn (a crash, then a restart on the same data) while clients
/// acquire, claim, write and release, some pausing past their TTL before a stale write. The
/// history checker ([`crate::history::check`]) then proves: tokens unique and increasing in
/// real-time order per key, no stale write accepted after a newer claim, and, where the subject
/// promises it across a failover, no grant while another holder's reported validity lasts.
async fn rolling_restart(ctx: Arc<Ctx>) -> CaseResult {
    let cluster = cluster(&ctx)?;
    let history = History::new(Some(ctx.seed));
    let keys: Vec<_> = (0..2).map(|i| ctx.key(&format!("rolling/{i}"))).collect();
    let ttl = ctx.ttl();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..3 {
        let client = ctx.client().await?;
        let recorder = history.recorder(format!("w{w}"));
        let fence: Arc<dyn Fence> =
            Arc::new(HistoryFence::new(ctx.fence().clone(), recorder.clone()));
        let (keys, stop) = (keys.clone(), stop.clone());
        let seed = ctx.fork_seed();
        workers.push(super::Scoped::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut grants = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = &keys[rng.gen_range(0..keys.len())];
                let resource = ResourceId::from(key);
                let call = recorder.invoke();
                let acquired = client
                    .acquire(key, &LeaseOptions::new(ttl).wait(ttl * 2))
                    .await;
                call.acquired(key, &acquired);
                let lease = match acquired {
                    Ok(l) => l,
                    Err(e @ Error::TokenRegression { .. }) => {
                        return Err(Failure(format!("worker {w}: {e}")))
                    }
                    Err(_) => {
                        tokio::time::sleep(ttl / 10).await;
                        continue;
                    }
                };
                grants += 1;
                let token = lease.token();
                if fence.claim(&resource, token).await.is_ok() {
                    if rng.gen_range(0..5) == 0 {
                        // A pause past the TTL, then the write: stale if someone claimed since.
                        tokio::time::sleep(ttl + ttl / 2).await;
                    }
                    let _ = fence
                        .write(&resource, token, Bytes::from(format!("w{w} t{token}")))
                        .await;
                }
                let call = recorder.invoke();
                let released = lease.release().await;
                call.complete(OpKind::Release {
                    key: key.as_str().to_owned(),
                    token: token.get(),
                    outcome: Done::from_result(&released),
                });
            }
            Ok(grants)
        }));
    }
    let mut restore = Restore::new(&ctx, cluster.clone());
    for member in 0..cluster.members() {
        restore.kill(member).await?;
        // Let the workers run against the cluster without it for a moment.
        tokio::time::sleep(ttl / 2).await;
        cluster
            .restart(member)
            .await
            .map_err(|e| Failure(format!("restarting member {member}: {e}")))?;
        restore.killed.retain(|m| *m != member);
    }
    // A last stretch on the whole cluster.
    tokio::time::sleep(ttl).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut grants = 0;
    for w in workers {
        grants += w
            .await
            .map_err(|e| Failure(format!("a worker panicked: {e}")))??;
    }
    restore.finish().await?;
    let summary = crate::history::check_except(&history, ctx.subject.unpromised())
        .map_err(|v| Failure(v.to_string()))?;
    check!(
        grants >= 3 && summary.accepted_claims >= 3,
        "too little happened during the rolling restart to mean anything: {grants} grants, \
         {summary:?}"
    );
    Ok(Verdict::Passed)
}

/// The follower a holder talks to is cut from its peers right after confirming the holder's
/// lease (a renewal that went through it). The holder's local validity must end no later than
/// the moment a client of another member sees the key free: validity never outlives the
/// leader's view of the session or lease. Skipped where holders talk to the leader only (Redis).
async fn follower_cut_after_sync(ctx: Arc<Ctx>) -> CaseResult {
    let cluster = cluster(&ctx)?;
    let Some(connect_member) = ctx.subject.connect_member.clone() else {
        return Ok(Verdict::Skipped(
            "the subject cannot pin a client to one member".into(),
        ));
    };
    let leader = cluster
        .leader()
        .await
        .map_err(|e| Failure(format!("finding the leader: {e}")))?;
    let follower = cluster.holder_member(leader);
    if follower == leader {
        return Ok(Verdict::Skipped(format!(
            "holders talk to the leader only on {}: there is no follower to cut",
            cluster.kind()
        )));
    }
    let Some(observer_member) = (0..cluster.members()).find(|m| *m != follower) else {
        return Ok(Verdict::Skipped("the cluster has a single member".into()));
    };
    let key = ctx.key("follower-cut");
    let ttl = ctx.ttl();
    let holder = connect_member(follower)
        .await
        .map_err(|e| Failure(format!("connecting a client to member {follower}: {e}")))?;
    let observer = connect_member(observer_member).await.map_err(|e| {
        Failure(format!(
            "connecting a client to member {observer_member}: {e}"
        ))
    })?;
    let lease = holder
        .acquire(&key, &LeaseOptions::new(ttl).wait(ttl * 4))
        .await?;
    check!(
        observer.inspect(&key).await?.is_some(),
        "the observer on member {observer_member} does not see the fresh holder"
    );
    // Confirmed through the follower, then the follower is cut at once.
    lease.renew().await?;
    let mut restore = Restore::new(&ctx, cluster.clone());
    restore.cut.push(follower);
    cluster
        .isolate_from_peers(follower)
        .await
        .map_err(|e| Failure(format!("cutting member {follower} from its peers: {e}")))?;
    let valid_until = lease.valid_until();

    let deadline = Instant::now() + cluster.failover_bound() + ttl * 4;
    let freed_at = loop {
        match observer.inspect(&key).await {
            Ok(None) => break Instant::now(),
            Ok(Some(_)) | Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => {}
            Err(e) => return Err(Failure(format!("the observer's inspect: {e}"))),
        }
        check!(
            Instant::now() < deadline,
            "the key was never freed on the majority side within {:?} of the cut",
            cluster.failover_bound() + ttl * 4
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    check!(
        valid_until <= freed_at,
        "the holder's validity (until {:?} after the cut) outlived the majority's view: the key \
         was free {:?} before it ended",
        valid_until.saturating_duration_since(freed_at.min(valid_until)),
        valid_until.saturating_duration_since(freed_at)
    );
    check!(
        !matches!(lease.status(), LeaseStatus::Held),
        "the holder reports Held after the majority saw the key free"
    );
    let _ = lease.release().await;
    restore.finish().await?;
    Ok(Verdict::Passed)
}
