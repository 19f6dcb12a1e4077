//! The scenarios, each run the same way for every lock: uncontended acquire+release (and the
//! release call alone), one held lock's renewal (locks with a renewal call), hand-off from the START of the holder's release to the waiter holding,
//! throughput on own keys and on a few shared keys, with the server's request counters read
//! around each. Monotonic clock only.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::locks::{BenchLock, BenchResult, Waiting};
use crate::servers::{Counters, Reading};

/// Sizes of one run.
#[derive(Clone, Debug)]
pub(crate) struct Sizes {
    /// Measured acquire+release pairs per lock per round (a tenth more as warm-up).
    pub(crate) iterations: usize,
    /// Hand-offs per lock per round.
    pub(crate) handoffs: usize,
    /// Tasks in the throughput scenarios.
    pub(crate) tasks: usize,
    /// Keys the contended scenario's tasks share.
    pub(crate) shared_keys: usize,
    /// Length of each throughput measurement.
    pub(crate) seconds: Duration,
    /// How long the hand-off waiter has been waiting when the holder starts its release.
    pub(crate) waiter_head_start: Duration,
}

/// Latency samples.
#[derive(Clone, Debug, Default)]
pub(crate) struct Samples(pub Vec<Duration>);

impl Samples {
    /// The `q` quantile (0..=1), nearest rank; zero when empty.
    pub(crate) fn quantile(&self, q: f64) -> Duration {
        let mut v = self.0.clone();
        v.sort();
        match v.len() {
            0 => Duration::ZERO,
            n => v[((n - 1) as f64 * q).round() as usize],
        }
    }
    /// The median.
    pub(crate) fn p50(&self) -> Duration {
        self.quantile(0.5)
    }
    /// The 99th percentile.
    pub(crate) fn p99(&self) -> Duration {
        self.quantile(0.99)
    }
}

/// Everything measured for one lock, accumulated over the rounds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Figures {
    /// acquire+release, sequential, uncontended.
    pub(crate) pair: Samples,
    /// The p50 of each round's pairs, in round order (the rounds interleave the locks, so two
    /// locks' figures of one round were measured in the same minutes).
    pub(crate) pair_rounds: Vec<Duration>,
    /// The release call alone (from the same pairs).
    pub(crate) release: Samples,
    /// Server requests per uncontended pair (total over the rounds, and the pairs counted).
    pub(crate) pair_requests: Option<(Reading, u64)>,
    /// Round trips per uncontended pair where the requests above count more than round trips
    /// (Redis counts the commands a script invokes): counted by `MONITOR` over a few more pairs.
    pub(crate) pair_round_trips: Option<(Reading, u64)>,
    /// Hand-off: the holder's release starting to the waiter holding.
    pub(crate) handoff: Samples,
    /// One renewal of a held lock, sequential (locks with a renewal call of their own).
    pub(crate) renew: Samples,
    /// Server requests per renewal (total, renewals counted).
    pub(crate) renew_requests: Option<(Reading, u64)>,
    /// Round trips per renewal where requests count more (Redis), as `pair_round_trips`.
    pub(crate) renew_round_trips: Option<(Reading, u64)>,
    /// Pairs per second with tasks on their own keys, one figure per round.
    pub(crate) own_keys: Vec<f64>,
    /// What the server counted during the own-keys runs (and this process's and the server's
    /// CPU time), and the pairs they made.
    pub(crate) own_keys_counted: Option<(Reading, u64)>,
    /// Grants per second with the tasks on a few shared keys, one figure per round.
    pub(crate) contended: Vec<f64>,
    /// Server requests per contended grant (total, grants).
    pub(crate) contended_requests: Option<(Reading, u64)>,
    /// Round trips per contended grant, as `pair_round_trips` (a short monitored run).
    pub(crate) contended_round_trips: Option<(Reading, u64)>,
    /// The first error, if a scenario failed (the rest still run).
    pub(crate) errors: Vec<String>,
}

fn add(total: &mut Option<(Reading, u64)>, delta: Reading, n: u64) {
    let (sum, count) = total.get_or_insert_with(Default::default);
    sum.requests += delta.requests;
    sum.client_cpu += delta.client_cpu;
    sum.server_cpu = match (sum.server_cpu, delta.server_cpu) {
        (Some(a), Some(b)) => Some(a + b),
        (None, b) if *count == 0 => b,
        _ => None,
    };
    for (k, v) in delta.by_name {
        *sum.by_name.entry(k).or_default() += v;
    }
    *count += n;
}

/// Median of per-round figures.
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (!v.is_empty()).then(|| v[v.len() / 2])
}

/// Uncontended acquire+release, sequential, after a warm-up.
pub(crate) async fn pairs(
    lock: &dyn BenchLock,
    counters: &Counters,
    key: &str,
    sizes: &Sizes,
    into: &mut Figures,
) -> BenchResult<()> {
    for _ in 0..sizes.iterations / 10 + 1 {
        let h = lock.acquire(key).await?;
        lock.release(h).await?;
    }
    let before = counters.read().await?;
    let mut round = Samples(Vec::with_capacity(sizes.iterations));
    for _ in 0..sizes.iterations {
        let start = Instant::now();
        let h = lock.acquire(key).await?;
        let released = Instant::now();
        lock.release(h).await?;
        let end = Instant::now();
        round.0.push(end - start);
        into.release.0.push(end - released);
    }
    into.pair_rounds.push(round.p50());
    into.pair.0.append(&mut round.0);
    let after = counters.read().await?;
    add(
        &mut into.pair_requests,
        before.delta(&after),
        sizes.iterations as u64,
    );
    if let Some(monitor) = counters.monitor().await? {
        let n = (sizes.iterations / 10).clamp(5, 50);
        for _ in 0..n {
            let h = lock.acquire(key).await?;
            lock.release(h).await?;
        }
        add(
            &mut into.pair_round_trips,
            monitor.finish().await?,
            n as u64,
        );
    }
    Ok(())
}

/// How far apart the renewal scenario's renewals are: more than the spacing of ours' renewal
/// rounds (5 ms on Redis, 20 ms on etcd), so that each goes alone, as a keeper's renewal every
/// third of the TTL does. (Renewals closer together than that share a round: under load the
/// server sees one request per round, and a renewal waits for the next round.)
pub(crate) const RENEW_PACE: Duration = Duration::from_millis(25);

/// Renewal: one lock held, renewed `iterations / 10` times (at least 5), [`RENEW_PACE`] apart,
/// after a warm-up, then released. Nothing to do for a lock without a renewal call of its own.
pub(crate) async fn renewals(
    lock: &dyn BenchLock,
    counters: &Counters,
    key: &str,
    sizes: &Sizes,
    into: &mut Figures,
) -> BenchResult<()> {
    let held = lock.acquire(key).await?;
    let outcome = async {
        match lock.renew(&held).await {
            None => return Ok(()),
            Some(first) => first?,
        }
        let n = (sizes.iterations / 10).max(5);
        for _ in 0..3 {
            tokio::time::sleep(RENEW_PACE).await;
            renew(lock, &held).await?;
        }
        let before = counters.read().await?;
        for _ in 0..n {
            tokio::time::sleep(RENEW_PACE).await;
            let start = Instant::now();
            renew(lock, &held).await?;
            into.renew.0.push(start.elapsed());
        }
        // Let what a renewal sets off in the background (a monitor's re-read) reach the server
        // before the counters are read.
        tokio::time::sleep(RENEW_PACE).await;
        let after = counters.read().await?;
        add(&mut into.renew_requests, before.delta(&after), n as u64);
        if let Some(monitor) = counters.monitor().await? {
            let n = n.min(50);
            for _ in 0..n {
                tokio::time::sleep(RENEW_PACE).await;
                renew(lock, &held).await?;
            }
            tokio::time::sleep(RENEW_PACE).await;
            add(
                &mut into.renew_round_trips,
                monitor.finish().await?,
                n as u64,
            );
        }
        Ok(())
    }
    .await;
    lock.release(held).await?;
    outcome
}

async fn renew(lock: &dyn BenchLock, held: &crate::locks::Held) -> BenchResult<()> {
    lock.renew(held)
        .await
        .unwrap_or_else(|| Err(format!("{} has no renewal call", lock.name()).into()))
}

/// Hand-off: a holder on one client, a waiter blocked in acquire on another; from the holder's
/// release starting to the waiter holding.
pub(crate) async fn handoffs(
    holder: &dyn BenchLock,
    waiter: Arc<dyn BenchLock>,
    key: &str,
    sizes: &Sizes,
    into: &mut Figures,
) -> BenchResult<()> {
    if holder.waiting() == Waiting::No {
        return Ok(());
    }
    for _ in 0..sizes.handoffs {
        let h = holder.acquire(key).await?;
        let w = {
            let (waiter, key) = (waiter.clone(), key.to_owned());
            tokio::spawn(async move {
                let l = waiter.acquire_waiting(&key).await?;
                let got = Instant::now();
                waiter.release(l).await?;
                Ok::<_, crate::locks::BenchError>(got)
            })
        };
        // The waiter's head start: long enough for it to be waiting (watch set, poll loop
        // entered), as in a real hand-off; not a measured interval.
        tokio::time::sleep(sizes.waiter_head_start).await;
        let start = Instant::now();
        holder.release(h).await?;
        let got = w.await??;
        into.handoff.0.push(got.saturating_duration_since(start));
    }
    Ok(())
}

/// Throughput: `sizes.tasks` tasks on one client for `sizes.seconds`, task `i` on key
/// `keys[i % keys.len()]`, acquire (waiting when keys are shared) + release. Returns the grants
/// per second and the server's requests per grant.
pub(crate) async fn throughput(
    lock: Arc<dyn BenchLock>,
    counters: &Counters,
    keys: &[String],
    sizes: &Sizes,
) -> BenchResult<(f64, Reading, u64)> {
    let contended = keys.len() < sizes.tasks;
    let before = counters.read().await?;
    let start = Instant::now();
    let until = start + sizes.seconds;
    let mut tasks = Vec::new();
    for i in 0..sizes.tasks {
        let (lock, key) = (lock.clone(), keys[i % keys.len()].clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                let h = if contended {
                    lock.acquire_waiting(&key).await?
                } else {
                    lock.acquire(&key).await?
                };
                lock.release(h).await?;
                n += 1;
            }
            Ok::<_, crate::locks::BenchError>(n)
        }));
    }
    let mut total = 0;
    let mut first_error = None;
    for t in tasks {
        match t.await? {
            Ok(n) => total += n,
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    let elapsed = start.elapsed();
    if let Some(e) = first_error {
        return Err(e);
    }
    let after = counters.read().await?;
    Ok((
        total as f64 / elapsed.as_secs_f64(),
        before.delta(&after),
        total,
    ))
}

/// Runs the own-keys and contended throughput scenarios for `lock` into `into`.
pub(crate) async fn throughputs(
    lock: Arc<dyn BenchLock>,
    counters: &Counters,
    prefix: &str,
    sizes: &Sizes,
    into: &mut Figures,
) -> BenchResult<()> {
    let own: Vec<String> = (0..sizes.tasks)
        .map(|i| format!("{prefix}/own/{i}"))
        .collect();
    let (rate, delta, pairs) = throughput(lock.clone(), counters, &own, sizes).await?;
    into.own_keys.push(rate);
    add(&mut into.own_keys_counted, delta, pairs);
    if lock.waiting() != Waiting::No {
        let shared: Vec<String> = (0..sizes.shared_keys.max(1))
            .map(|i| format!("{prefix}/shared/{i}"))
            .collect();
        let (rate, delta, grants) = throughput(lock.clone(), counters, &shared, sizes).await?;
        into.contended.push(rate);
        add(&mut into.contended_requests, delta, grants);
        if let Some(monitor) = counters.monitor().await? {
            // MONITOR slows the server: its own short run, for the counts only.
            let short = Sizes {
                seconds: (sizes.seconds / 4).max(Duration::from_millis(200)),
                ..sizes.clone()
            };
            let (_, _, grants) = throughput(lock, &Counters::none(), &shared, &short).await?;
            add(
                &mut into.contended_round_trips,
                monitor.finish().await?,
                grants,
            );
        }
    }
    Ok(())
}
