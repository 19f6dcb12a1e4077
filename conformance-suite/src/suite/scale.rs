//! The scale case: many leases on distinct keys, each kept by a keeper, on one client.
//!
//! `many_leases_kept` acquires `CONFORMANCE_SCALE_LEASES` leases on as many distinct keys under
//! the case's prefix, at most [`IN_FLIGHT`] acquires at a time, all on ONE client, wraps each in
//! `keep(lease, KeeperOptions::new())`, holds them `CONFORMANCE_SCALE_HOLD_SECS`, then releases
//! them all. It fails unless every acquire succeeded, no lease was lost while held, every release
//! was `Ok`, and a fresh second client can `try_acquire` every key right afterwards (nothing left
//! behind). Whatever the verdict, one line labelled `scale: <backend>:` reports the acquire wall
//! time, the client's RSS growth per held lease, the client's CPU over the hold and the counts of
//! failed and lost leases; a failure message repeats it.
//!
//! The figures are the test process's: for the in-process backends (memory, the Consul
//! stand-in) they include the server's own work.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, StreamExt};
use lease_core::{
    keep, Coordinator, Error, KeeperOptions, Kept, LeaseOptions, LeaseStatus, LockKey,
};
use tokio::time::Instant;

use super::{boxed, Case, CaseResult, Ctx, Failure, Verdict};

/// How many leases, from the environment (default [`DEFAULT_LEASES`]); `0` skips the case.
pub(super) const LEASES_ENV: &str = "CONFORMANCE_SCALE_LEASES";
/// How long the leases are held, in whole seconds (default [`DEFAULT_HOLD_SECS`]).
pub(super) const HOLD_ENV: &str = "CONFORMANCE_SCALE_HOLD_SECS";
/// The leases' TTL in milliseconds (default [`DEFAULT_TTL_MS`]; raised to the backend's minimum).
pub(super) const TTL_ENV: &str = "CONFORMANCE_SCALE_TTL_MS";

const DEFAULT_LEASES: usize = 2_000;
const DEFAULT_HOLD_SECS: u64 = 20;
const DEFAULT_TTL_MS: u64 = 10_000;
const MAX_LEASES: usize = 1_000_000;
const MAX_HOLD_SECS: u64 = 3_600;
const MAX_TTL_MS: u64 = 3_600_000;

/// How many of the keys held after the hold another client tries to take (and must be refused).
const HELD_SAMPLE: usize = 64;

/// Acquires (and releases, and checks) in flight at once.
const IN_FLIGHT: usize = 64;

/// The case's time bound in multiples of the subject's TTL, plus 10 s (see `Timing::case_budget`).
/// The bound does not grow with the size asked for: 120 gives 46 s on memory (TTL 300 ms), 58 s on
/// Redis (400 ms), 130 s on the Consul stand-in (1 s), 190 s on ZooKeeper (1.5 s) and 250 s on
/// etcd (2 s), which fits the default 2,000 leases held 20 s everywhere. Larger runs raise
/// `CONFORMANCE_TIME_SCALE`; the case says by how much when its hold alone does not fit.
const TTL_BUDGET: u32 = 120;

/// Time kept back from the bound for the report and the tear-down.
const SAFETY: Duration = Duration::from_secs(3);

/// How many distinct error messages a failure quotes.
const SAMPLES: usize = 3;

pub(super) fn cases() -> Vec<Case> {
    vec![Case::new("many_leases_kept", &[], TTL_BUDGET, |c| {
        boxed(many_leases_kept(c))
    })]
}

/// The case's size, from [`LEASES_ENV`], [`HOLD_ENV`] and [`TTL_ENV`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sizing {
    leases: usize,
    hold: Duration,
    ttl: Duration,
}

impl Sizing {
    fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// As `Timing::from_lookup`: unset or empty takes the default, a malformed or out-of-range
    /// value is an error naming the variable and the value.
    fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let get = |name: &str| {
            lookup(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let leases = match get(LEASES_ENV) {
            None => DEFAULT_LEASES,
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n <= MAX_LEASES => n,
                _ => {
                    return Err(format!(
                        "{LEASES_ENV}={v:?}: expected a whole number of leases in 0..={MAX_LEASES} \
                         (0 skips the case)"
                    ))
                }
            },
        };
        let hold = match get(HOLD_ENV) {
            None => Duration::from_secs(DEFAULT_HOLD_SECS),
            Some(v) => match v.parse::<u64>() {
                Ok(s) if (1..=MAX_HOLD_SECS).contains(&s) => Duration::from_secs(s),
                _ => {
                    return Err(format!(
                        "{HOLD_ENV}={v:?}: expected whole seconds in 1..={MAX_HOLD_SECS}"
                    ))
                }
            },
        };
        let ttl = match get(TTL_ENV) {
            None => Duration::from_millis(DEFAULT_TTL_MS),
            Some(v) => match v.parse::<u64>() {
                Ok(ms) if (1..=MAX_TTL_MS).contains(&ms) => Duration::from_millis(ms),
                _ => {
                    return Err(format!(
                        "{TTL_ENV}={v:?}: expected whole milliseconds in 1..={MAX_TTL_MS}"
                    ))
                }
            },
        };
        Ok(Sizing { leases, hold, ttl })
    }
}

/// The process's resident set size in bytes (`VmRSS` of `/proc/self/status`), where there is one.
fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The process's CPU time so far (`utime + stime` of `/proc/self/stat`), where there is one.
fn cpu_time() -> Option<Duration> {
    // The kernel reports these in USER_HZ, which is 100 on every mainstream Linux architecture
    // (reading `sysconf(_SC_CLK_TCK)` would need `unsafe`, which this crate forbids).
    const USER_HZ: u64 = 100;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces: the first
    // is field 3 (state), so utime (field 14) and stime (field 15) are at 11 and 12.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 1000 / USER_HZ))
}

/// Error messages grouped with the key's name taken out, so that one kind of failure on many keys
/// counts as one message.
#[derive(Debug, Default)]
struct Tally {
    total: usize,
    by_message: BTreeMap<String, usize>,
}

impl Tally {
    fn add(&mut self, key: &LockKey, message: &str) {
        self.total += 1;
        let general = message.replace(key.as_str(), "<key>");
        *self.by_message.entry(general).or_default() += 1;
    }

    /// `""` when empty, else `; <what>: N (<count> x <message>, ...)`.
    fn describe(&self, what: &str) -> String {
        if self.total == 0 {
            return String::new();
        }
        let mut top: Vec<(&String, &usize)> = self.by_message.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1));
        let quoted: Vec<String> = top
            .iter()
            .take(SAMPLES)
            .map(|(m, n)| format!("{n} x {m}"))
            .collect();
        let more = top.len().saturating_sub(SAMPLES);
        let more = if more > 0 {
            format!(", and {more} other messages")
        } else {
            String::new()
        };
        format!("; {what}: {} ({}{more})", self.total, quoted.join(", "))
    }
}

/// The figures of one run, printed on one line.
#[derive(Debug, Default)]
struct Figures {
    leases: usize,
    ttl: Duration,
    granted_ttl: Option<Duration>,
    hold: Duration,
    acquired: usize,
    acquire_time: Duration,
    rss_before: Option<u64>,
    rss_holding: Option<u64>,
    /// After every lease was released and the check client was done with the keys.
    rss_released: Option<u64>,
    cpu_hold: Option<Duration>,
    hold_time: Duration,
    first_loss_after: Option<Duration>,
    lost: BTreeMap<String, usize>,
    in_doubt: usize,
    release_time: Duration,
    checked: usize,
}

impl Figures {
    fn lost_total(&self) -> usize {
        self.lost.values().sum()
    }

    fn line(&self, backend: &str, failed: usize, release_errors: usize, left: usize) -> String {
        let secs = self.acquire_time.as_secs_f64();
        let rate = if secs > 0.0 {
            format!("{:.0}/s", self.acquired as f64 / secs)
        } else {
            "-".into()
        };
        let rss = match (self.rss_before, self.rss_holding) {
            (Some(a), Some(b)) if self.acquired > 0 => {
                let grown = b as i64 - a as i64;
                format!(
                    "RSS {:.1} -> {:.1} MiB, {:+.2} KiB/lease",
                    a as f64 / 1048576.0,
                    b as f64 / 1048576.0,
                    grown as f64 / 1024.0 / self.acquired as f64
                )
            }
            _ => "RSS n/a".into(),
        };
        let rss = match self.rss_released {
            Some(r) => format!("{rss}, {:.1} MiB after release", r as f64 / 1048576.0),
            None => rss,
        };
        let cpu = match self.cpu_hold {
            Some(c) if !self.hold_time.is_zero() => format!(
                "CPU {:.1}% of one core over the hold",
                100.0 * c.as_secs_f64() / self.hold_time.as_secs_f64()
            ),
            _ => "CPU n/a".into(),
        };
        let lost = if self.lost.is_empty() {
            "lost 0".to_owned()
        } else {
            let reasons: Vec<String> = self.lost.iter().map(|(r, n)| format!("{n} {r}")).collect();
            let first = self
                .first_loss_after
                .map(|d| format!(", first {:.1} s into the hold", d.as_secs_f64()))
                .unwrap_or_default();
            format!("lost {} ({}{first})", self.lost_total(), reasons.join(", "))
        };
        let granted = match self.granted_ttl {
            Some(g) if g != self.ttl => format!(" (granted {g:?})"),
            _ => String::new(),
        };
        format!(
            "scale: {backend}: many_leases_kept {} leases, TTL {:?}{granted}, hold {:?}, \
             {IN_FLIGHT} in flight: acquire {:.3} s ({rate}), failed {failed}; {rss}; {cpu}; {lost}, in doubt {}; \
             release {:.3} s, errors {release_errors}; left behind {left} of {} checked",
            self.leases,
            self.ttl,
            self.hold,
            secs,
            self.in_doubt,
            self.release_time.as_secs_f64(),
            self.checked,
        )
    }
}

async fn many_leases_kept(ctx: Arc<Ctx>) -> CaseResult {
    let sizing = Sizing::from_env().map_err(Failure)?;
    if sizing.leases == 0 {
        return Ok(Verdict::Skipped(format!(
            "{LEASES_ENV}=0: the scale case is switched off"
        )));
    }
    let started = Instant::now();
    // The same bound `run_suite` puts on this case; every phase gets a share of it, so that a
    // slow backend fails with its figures instead of hitting the outer timeout.
    let bound = ctx.scaled(ctx.ttl() * TTL_BUDGET + Duration::from_secs(10));
    let deadline = started + bound.saturating_sub(SAFETY);
    let reserve = Duration::from_secs(5);
    if sizing.hold + reserve + SAFETY > bound {
        let need = (sizing.hold + reserve + SAFETY).as_secs_f64()
            / (ctx.ttl() * TTL_BUDGET + Duration::from_secs(10)).as_secs_f64();
        return Err(Failure(format!(
            "{HOLD_ENV}={} does not fit the case's time bound of {bound:?} on {}: set \
             CONFORMANCE_TIME_SCALE to at least {:.1} (more for many leases on a slow backend)",
            sizing.hold.as_secs(),
            ctx.subject.name,
            (need * 10.0).ceil() / 10.0
        )));
    }

    let client = ctx.client().await?;
    let caps = client.capabilities().clone();
    let ttl = sizing.ttl.max(caps.min_ttl);
    if ttl > caps.max_ttl {
        return Err(Failure(format!(
            "{TTL_ENV}={}: above {}'s maximum TTL {:?}",
            sizing.ttl.as_millis(),
            ctx.subject.name,
            caps.max_ttl
        )));
    }
    if ttl != sizing.ttl {
        println!(
            "note: {}: scale leases use TTL {ttl:?}, the backend's minimum ({TTL_ENV} asked {:?})",
            ctx.subject.name, sizing.ttl
        );
    }
    let options = LeaseOptions::new(ttl);
    let keys: Vec<LockKey> = (0..sizing.leases)
        .map(|i| ctx.key(&format!("k{i:07}")))
        .collect();
    let mut fig = Figures {
        leases: sizing.leases,
        ttl,
        hold: sizing.hold,
        ..Figures::default()
    };

    // Acquire: a third of what the hold leaves (release and the check get the rest).
    let acquire_share = bound.saturating_sub(sizing.hold + SAFETY) / 3;
    let acquire_until = Instant::now() + acquire_share;
    fig.rss_before = rss_bytes();
    let t0 = Instant::now();
    let outcomes: Vec<(LockKey, Result<Kept, String>)> = stream::iter(keys.iter().cloned())
        .map(|key| {
            let (client, options) = (client.clone(), options.clone());
            async move {
                let r = match tokio::time::timeout_at(acquire_until, client.acquire(&key, &options))
                    .await
                {
                    Ok(Ok(lease)) => keep(lease, KeeperOptions::new()).map_err(|e| e.to_string()),
                    Ok(Err(e)) => Err(e.to_string()),
                    Err(_) => Err(format!(
                        "no outcome within the acquire phase's share of the time bound \
                         ({acquire_share:?})"
                    )),
                };
                (key, r)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    fig.acquire_time = t0.elapsed();
    let mut failed = Tally::default();
    let mut kept: Vec<Kept> = Vec::with_capacity(sizing.leases);
    for (key, r) in outcomes {
        match r {
            Ok(k) => kept.push(k),
            Err(m) => failed.add(&key, &m),
        }
    }
    fig.acquired = kept.len();
    // Session backends grant their session's TTL whatever was asked.
    fig.granted_ttl = kept.first().map(|k| k.lease().ttl());

    // Hold, looking once a second for the first lost lease (losses are sticky: the status check
    // after the hold sees every one of them). Status reads are cheap; a waiter per lease would
    // add its own timers to the CPU figure.
    let hold_start = Instant::now();
    let cpu0 = cpu_time();
    let hold_end = hold_start + sizing.hold;
    let mut first_loss = None;
    while Instant::now() < hold_end {
        tokio::time::sleep_until((Instant::now() + Duration::from_secs(1)).min(hold_end)).await;
        if first_loss.is_none()
            && kept
                .iter()
                .any(|k| matches!(k.lease().status(), LeaseStatus::Lost(_)))
        {
            first_loss = Some(hold_start.elapsed());
        }
    }
    fig.first_loss_after = first_loss;
    fig.rss_holding = rss_bytes();
    fig.cpu_hold = match (cpu0, cpu_time()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    fig.hold_time = hold_start.elapsed();

    // Every lease must still be held. One in doubt right now (a connection being replaced) is
    // given up to a TTL to settle either way.
    let settle = fig.granted_ttl.unwrap_or(ttl);
    let settle_until =
        Instant::now() + settle.min(deadline.saturating_duration_since(Instant::now()) / 4);
    let mut held_now = vec![false; kept.len()];
    loop {
        let mut doubtful = 0;
        for (i, k) in kept.iter().enumerate() {
            match k.lease().status() {
                LeaseStatus::Held => held_now[i] = true,
                LeaseStatus::InDoubt => doubtful += 1,
                LeaseStatus::Lost(_) => held_now[i] = false,
            }
        }
        if doubtful == 0 || Instant::now() >= settle_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut stopped = 0;
    for (i, k) in kept.iter().enumerate() {
        match k.lease().status() {
            LeaseStatus::Held => held_now[i] = true,
            LeaseStatus::InDoubt => fig.in_doubt += 1,
            LeaseStatus::Lost(r) => {
                held_now[i] = false;
                *fig.lost.entry(format!("{r:?}")).or_default() += 1;
            }
        }
        if k.stopped().is_some() {
            stopped += 1;
        }
    }

    // The server holds them too, not only the leases' own state: another client is refused a
    // sample of the keys seen held (all of them would double the case's load).
    let held_keys: Vec<LockKey> = kept
        .iter()
        .zip(&held_now)
        .filter(|(_, held)| **held)
        .map(|(k, _)| k.lease().key().clone())
        .collect();
    let sample: Vec<LockKey> = held_keys
        .iter()
        .step_by((held_keys.len() / HELD_SAMPLE).max(1))
        .take(HELD_SAMPLE)
        .cloned()
        .collect();
    let (mut granted_while_held, mut lost_meanwhile) = (0, 0);
    let mut sample_errors = Tally::default();
    match ctx.client().await {
        Err(f) => sample_errors.add(&keys[0], &f.0),
        Ok(other) => {
            let (_, errors, _, granted) = check_free(&other, &sample, &options, deadline).await;
            sample_errors = errors;
            // A lease lost since its status was read (a keeper failing under load) is a loss,
            // not a key granted twice.
            for key in &granted {
                let lost = kept.iter().any(|k| {
                    k.lease().key() == key && matches!(k.lease().status(), LeaseStatus::Lost(_))
                });
                if lost {
                    lost_meanwhile += 1;
                } else {
                    granted_while_held += 1;
                }
            }
        }
    }

    // Release them all; a release of a lease seen lost is expected to fail and is not counted.
    let release_until = Instant::now() + deadline.saturating_duration_since(Instant::now()) / 2;
    let t1 = Instant::now();
    let released: Vec<(LockKey, bool, Result<(), String>)> =
        stream::iter(kept.into_iter().zip(held_now))
            .map(|(k, was_held)| async move {
                let key = k.lease().key().clone();
                let r = match tokio::time::timeout_at(release_until, k.release()).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(
                        "no outcome within the release phase's share of the time bound".to_owned(),
                    ),
                };
                (key, was_held, r)
            })
            .buffer_unordered(IN_FLIGHT)
            .collect()
            .await;
    fig.release_time = t1.elapsed();
    let mut release_errors = Tally::default();
    for (key, was_held, r) in &released {
        if let (true, Err(m)) = (was_held, r) {
            release_errors.add(key, m);
        }
    }

    // Nothing left behind: a fresh client takes every key at once, then lets it go.
    let mut left = Tally::default();
    let mut check_errors = Tally::default();
    match ctx.client().await {
        Err(f) => check_errors.add(&keys[0], &f.0),
        Ok(checker) => {
            let (l, e, n, _) = check_free(&checker, &keys, &options, deadline).await;
            left = l;
            check_errors = e;
            fig.checked = n;
        }
    }

    drop(released);
    fig.rss_released = rss_bytes();
    if std::env::var(REFILL_ENV).is_ok_and(|v| v == "1") {
        refill(&client, &keys, &options, deadline).await;
    }
    let line = fig.line(
        &ctx.subject.name,
        failed.total,
        release_errors.total,
        left.total,
    );
    println!("{line}");
    let mut problems = String::new();
    problems.push_str(&failed.describe("failed acquires"));
    if fig.lost_total() > 0 || fig.in_doubt > 0 {
        problems.push_str(&format!(
            "; leases not held after the hold: {} lost, {} still in doubt",
            fig.lost_total(),
            fig.in_doubt
        ));
    }
    if stopped > 0 {
        problems.push_str(&format!("; keepers that stopped on their own: {stopped}"));
    }
    if lost_meanwhile > 0 {
        problems.push_str(&format!(
            "; leases lost after the hold, before the other client's try: {lost_meanwhile}"
        ));
    }
    if granted_while_held > 0 {
        problems.push_str(&format!(
            "; keys another client was granted while their leases showed Held: {granted_while_held} of {}",
            sample.len()
        ));
    }
    problems
        .push_str(&sample_errors.describe("errors of the other client's try_acquire while held"));
    problems.push_str(&release_errors.describe("releases of held leases not Ok"));
    problems.push_str(&left.describe("keys still held after release"));
    problems.push_str(&check_errors.describe("check try_acquire/release errors"));
    if problems.is_empty() {
        Ok(Verdict::Passed)
    } else {
        Err(Failure(format!(
            "{}{problems}",
            line.trim_start_matches("scale: ")
        )))
    }
}

/// What the check found for one key.
enum Found {
    /// Taken and let go again.
    Free,
    /// Still held by someone: left behind.
    Held(String),
    /// Any other error (of the try or of the check's own release).
    Error(String),
}

/// With `CONFORMANCE_SCALE_REFILL=1`, the case fills the same client a second time after the
/// release (every key acquired and kept, then released, no hold) and reports the RSS peak and
/// what is left after: if the second fill grows RSS by about as much as the first, memory leaked;
/// if it stays near the first peak, the allocator kept the first fill's memory and reused it.
/// A diagnostic only: it asserts nothing and is off by default.
const REFILL_ENV: &str = "CONFORMANCE_SCALE_REFILL";

async fn refill(
    client: &Arc<dyn lease_core::Coordinator>,
    keys: &[LockKey],
    options: &LeaseOptions,
    deadline: Instant,
) {
    let until = Instant::now() + deadline.saturating_duration_since(Instant::now()) / 2;
    let before = rss_bytes();
    let kept: Vec<Kept> = stream::iter(keys.iter().cloned())
        .map(|key| async move {
            match tokio::time::timeout_at(until, client.acquire(&key, options)).await {
                Ok(Ok(lease)) => keep(lease, KeeperOptions::new()).ok(),
                _ => None,
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter_map(|k| async move { k })
        .collect()
        .await;
    let peak = rss_bytes();
    let n = kept.len();
    stream::iter(kept)
        .for_each_concurrent(IN_FLIGHT, |k| async move {
            let _ = tokio::time::timeout_at(until, k.release()).await;
        })
        .await;
    let after = rss_bytes();
    let mib = |b: Option<u64>| {
        b.map_or("n/a".to_owned(), |b| {
            format!("{:.1} MiB", b as f64 / 1048576.0)
        })
    };
    println!(
        "refill: a second fill of {n} kept leases on the same client: RSS {} before, {} at its \
         peak, {} after its release",
        mib(before),
        mib(peak),
        mib(after)
    );
}

/// `try_acquire`s every key on `checker` ([`IN_FLIGHT`] at a time) and releases what it got.
/// Returns the keys found held, the other errors, how many keys were checked, and the keys it
/// got.
async fn check_free(
    checker: &Arc<dyn Coordinator>,
    keys: &[LockKey],
    options: &LeaseOptions,
    deadline: Instant,
) -> (Tally, Tally, usize, Vec<LockKey>) {
    let outcomes: Vec<(LockKey, Found)> = stream::iter(keys.to_vec())
        .map(|key| {
            let (checker, options) = (checker.clone(), options.clone());
            async move {
                let attempt = async {
                    match checker.try_acquire(&key, &options).await {
                        Ok(lease) => match lease.release().await {
                            Ok(()) => Found::Free,
                            Err(e) => Found::Error(format!("releasing the check's lease: {e}")),
                        },
                        Err(e @ Error::Held { .. }) => Found::Held(e.to_string()),
                        Err(e) => Found::Error(e.to_string()),
                    }
                };
                let found = tokio::time::timeout_at(deadline, attempt)
                    .await
                    .unwrap_or_else(|_| {
                        Found::Error("no outcome within the case's time bound".to_owned())
                    });
                (key, found)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let (mut held, mut errors, mut free) = (Tally::default(), Tally::default(), Vec::new());
    for (key, found) in &outcomes {
        match found {
            Found::Free => free.push(key.clone()),
            Found::Held(m) => held.add(key, m),
            Found::Error(m) => errors.add(key, m),
        }
    }
    (held, errors, outcomes.len(), free)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizing(vars: &[(&str, &str)]) -> Result<Sizing, String> {
        Sizing::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn sizing_defaults_when_unset_or_empty() {
        let want = Sizing {
            leases: DEFAULT_LEASES,
            hold: Duration::from_secs(DEFAULT_HOLD_SECS),
            ttl: Duration::from_millis(DEFAULT_TTL_MS),
        };
        assert_eq!(sizing(&[]), Ok(want));
        assert_eq!(
            sizing(&[(LEASES_ENV, ""), (HOLD_ENV, " "), (TTL_ENV, "")]),
            Ok(want)
        );
    }

    #[test]
    fn sizing_reads_the_variables() {
        let s = sizing(&[(LEASES_ENV, "10000"), (HOLD_ENV, "30"), (TTL_ENV, "2500")]).unwrap();
        assert_eq!(
            s,
            Sizing {
                leases: 10_000,
                hold: Duration::from_secs(30),
                ttl: Duration::from_millis(2500),
            }
        );
        assert_eq!(sizing(&[(LEASES_ENV, "0")]).unwrap().leases, 0);
    }

    #[test]
    fn malformed_sizing_names_the_variable() {
        for (var, value) in [
            (LEASES_ENV, "many"),
            (LEASES_ENV, "-1"),
            (LEASES_ENV, "2e3"),
            (LEASES_ENV, "1000001"),
            (HOLD_ENV, "20s"),
            (HOLD_ENV, "0"),
            (HOLD_ENV, "3601"),
            (TTL_ENV, "10s"),
            (TTL_ENV, "0"),
            (TTL_ENV, "3600001"),
        ] {
            let e = sizing(&[(var, value)]).unwrap_err();
            assert!(e.contains(var) && e.contains(value), "{e}");
        }
    }

    #[test]
    fn tally_groups_messages_without_the_key() {
        let mut t = Tally::default();
        for i in 0..5 {
            let key = LockKey::new(format!("p/k{i}")).unwrap();
            t.add(&key, &format!("lock \"p/k{i}\" is held by another owner"));
        }
        let key = LockKey::new("p/x").unwrap();
        t.add(&key, "etcd is unavailable: connection closed");
        let d = t.describe("failed");
        assert!(
            d.contains("failed: 6") && d.contains("5 x lock \"<key>\" is held by another owner"),
            "{d}"
        );
        assert!(Tally::default().describe("failed").is_empty());
    }

    #[test]
    fn proc_figures_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(rss_bytes().is_some_and(|b| b > 0));
            assert!(cpu_time().is_some());
        }
    }
}
