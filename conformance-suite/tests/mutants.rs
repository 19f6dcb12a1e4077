//! The suite against deliberately broken adapters: each mutant below is the in-memory backend
//! with one defect a real adapter could have, and the suite must fail the cases that pin the
//! property it breaks. A suite that passed a mutant would pass that defect in a real adapter.
//!
//! `cargo test -p conformance-suite --test mutants`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use conformance_suite::suite::{run_suite, Report, RunOptions, Subject, Verdict};
use lease_core::adapter::LeaseTracker;
use lease_core::memory::{MemoryCoordinator, MemoryFence};
use lease_core::{
    Capabilities, Coordinator, Error, ForceRelease, HolderInfo, Lease, LeaseOptions, LeaseState,
    LockKey, Result, Token,
};
use tokio::time::Instant;

/// The defect a mutant has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Defect {
    /// None: the wrappers alone, which must pass (so a mutant's failures are its defect's).
    None,
    /// Every lease reports token 1: tokens never increase.
    SameToken,
    /// A held key is granted again (with a new, larger token): no mutual exclusion.
    DoubleGrant,
    /// A release reports success but leaves the key locked until its TTL.
    ReleaseKeepsKey,
    /// A lease reports `Held`, and its renewals succeed, whatever the server holds: it never
    /// learns of an expiry or a revocation.
    NeverLost,
    /// A renewal reports (and the lease shows) validity half a TTL past what the server keeps.
    RenewOverstates,
    /// `try_acquire` waits for a held key, up to the options' wait bound (then answers `Held`).
    TryWaits,
    /// A grant reports (and the lease shows) validity half a TTL past what the server keeps.
    GrantOverstates,
}

/// The in-memory backend with `defect`.
#[derive(Debug)]
struct Mutant {
    inner: MemoryCoordinator,
    defect: Defect,
    /// Tokens for [`Defect::DoubleGrant`]'s extra grants, above any the inner backend issues.
    extra_tokens: AtomicU64,
    /// The leases [`Defect::ReleaseKeepsKey`] "released": kept, so the key stays locked.
    kept: Mutex<Vec<Box<dyn Lease>>>,
}

impl Mutant {
    fn new(defect: Defect) -> Self {
        Mutant {
            inner: MemoryCoordinator::new(),
            defect,
            extra_tokens: AtomicU64::new(1_000_000),
            kept: Mutex::new(Vec::new()),
        }
    }

    fn wrap(self: &Arc<Self>, lease: Box<dyn Lease>, ttl: Duration) -> Box<dyn Lease> {
        let token = match self.defect {
            Defect::SameToken => Token::new(1).expect("in range"),
            _ => lease.token(),
        };
        // The state a never-lost lease shows: held for an hour, never signalled.
        let immortal = LeaseTracker::new(
            "mutant",
            lease.key().clone(),
            token,
            Duration::from_secs(3600),
            Duration::ZERO,
            Instant::now(),
        );
        // The state an overstating lease shows: granted as the server says (a little short of
        // it), renewed past it; or, with `GrantOverstates`, granted past it too.
        let granted = match self.defect {
            Defect::GrantOverstates => ttl + ttl / 2,
            _ => ttl,
        };
        let overstated = LeaseTracker::new(
            "mutant",
            lease.key().clone(),
            token,
            granted,
            ttl / 10,
            Instant::now(),
        );
        Box::new(MutantLease {
            inner: Some(lease),
            owner: self.clone(),
            token,
            ttl,
            immortal,
            overstated,
        })
    }

    /// [`Defect::DoubleGrant`]: a lease on a key the inner backend holds for someone else.
    fn second_grant(self: &Arc<Self>, key: &LockKey, options: &LeaseOptions) -> Box<dyn Lease> {
        let token = Token::new(self.extra_tokens.fetch_add(1, Ordering::SeqCst)).expect("in range");
        let tracker = LeaseTracker::new(
            "mutant",
            key.clone(),
            token,
            options.ttl_value(),
            Duration::ZERO,
            Instant::now(),
        );
        Box::new(FreeLease { tracker })
    }
}

/// A mutant as a coordinator (`Arc`, so its leases can reach it).
#[derive(Debug, Clone)]
struct MutantCoordinator(Arc<Mutant>);

#[async_trait]
impl Coordinator for MutantCoordinator {
    fn capabilities(&self) -> &Capabilities {
        self.0.inner.capabilities()
    }

    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        if self.0.defect == Defect::DoubleGrant {
            return self.try_acquire(key, options).await;
        }
        let lease = self.0.inner.acquire(key, options).await?;
        Ok(self.0.wrap(lease, options.ttl_value()))
    }

    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        let tried = match self.0.defect {
            // Waits up to the options' bound, and reports a wait that ran out as `Held`.
            Defect::TryWaits => match self.0.inner.acquire(key, options).await {
                Err(Error::Timeout { key, .. }) => Err(Error::Held { key }),
                other => other,
            },
            _ => self.0.inner.try_acquire(key, options).await,
        };
        match tried {
            Ok(lease) => Ok(self.0.wrap(lease, options.ttl_value())),
            Err(Error::Held { .. }) if self.0.defect == Defect::DoubleGrant => {
                Ok(self.0.second_grant(key, options))
            }
            Err(e) => Err(e),
        }
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.0.inner.inspect(key).await
    }

    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        self.0.inner.force_release(key, request).await
    }
}

/// A lease of the inner backend, with the mutant's defect.
#[derive(Debug)]
struct MutantLease {
    inner: Option<Box<dyn Lease>>,
    owner: Arc<Mutant>,
    token: Token,
    ttl: Duration,
    immortal: LeaseTracker,
    overstated: LeaseTracker,
}

impl MutantLease {
    fn inner(&self) -> &dyn Lease {
        self.inner.as_deref().expect("kept until dropped")
    }
}

#[async_trait]
impl Lease for MutantLease {
    fn state(&self) -> &LeaseState {
        match self.owner.defect {
            Defect::NeverLost => &self.immortal,
            Defect::RenewOverstates | Defect::GrantOverstates => &self.overstated,
            _ => self.inner().state(),
        }
    }

    fn token(&self) -> Token {
        self.token
    }

    async fn renew(&self) -> Result<Instant> {
        match self.owner.defect {
            Defect::NeverLost => {
                let _ = self.inner().renew().await;
                self.immortal.renewed_from(Instant::now())
            }
            Defect::RenewOverstates | Defect::GrantOverstates => {
                self.inner().renew().await?;
                self.overstated
                    .renewed(Instant::now() + self.ttl + self.ttl / 2);
                Ok(self.overstated.valid_until())
            }
            _ => self.inner().renew().await,
        }
    }

    async fn release(&self) -> Result<()> {
        match self.owner.defect {
            Defect::ReleaseKeepsKey => Ok(()),
            _ => self.inner().release().await,
        }
    }
}

impl Drop for MutantLease {
    fn drop(&mut self) {
        if self.owner.defect == Defect::ReleaseKeepsKey {
            // Never given back: the key stays locked until its TTL.
            if let Some(lease) = self.inner.take() {
                self.owner
                    .kept
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(lease);
            }
        }
    }
}

/// [`Defect::DoubleGrant`]'s extra lease: nothing on the server behind it.
#[derive(Debug)]
struct FreeLease {
    tracker: LeaseTracker,
}

#[async_trait]
impl Lease for FreeLease {
    fn state(&self) -> &LeaseState {
        &self.tracker
    }

    async fn renew(&self) -> Result<Instant> {
        self.tracker.renewed_from(Instant::now())
    }

    async fn release(&self) -> Result<()> {
        self.tracker.release_with(async { Ok(()) }, || {}).await?;
        self.tracker.mark_lost(lease_core::LostReason::Released);
        Ok(())
    }
}

/// The basic cases: fast on the in-memory backend, and between them they pin every property a
/// mutant breaks.
const CASES: &[&str] = &[
    "mutual_exclusion_16_contenders",
    "tokens_increase_across_handoffs",
    "try_acquire_and_wait_bound",
    "renew_extends_validity",
    "stale_release_and_renew_are_no_ops",
    "lost_fires_on_expiry",
    "lost_fires_on_revocation",
    "keys_are_independent",
    "inspect_and_force_release",
];

async fn run(defect: Defect, cases: &[&'static str]) -> Report {
    let mutant = MutantCoordinator(Arc::new(Mutant::new(defect)));
    let coordinator: Arc<dyn Coordinator> = Arc::new(mutant);
    let subject = Subject::shared(
        format!("mutant-{defect:?}"),
        coordinator,
        Arc::new(MemoryFence::new()),
        Duration::from_millis(300),
    );
    let options = RunOptions {
        only: Some(cases.to_vec()),
        seed: Some(7),
        ..RunOptions::default()
    };
    run_suite(subject, &options).await
}

/// The cases `report` failed.
fn failed(report: &Report) -> Vec<&'static str> {
    report
        .cases
        .iter()
        .filter(|c| matches!(c.verdict, Verdict::Failed(_)))
        .map(|c| c.name)
        .collect()
}

/// Runs the cases against `defect`'s mutant and checks that each case in `must_fail` failed
/// with a message naming the property broken (the second string, a part of that message).
async fn caught(defect: Defect, must_fail: &[(&str, &str)]) {
    // A key that is never given back makes the 16 contenders wait out their whole bound (15 s):
    // the other cases catch that defect sooner.
    let cases: Vec<&'static str> = CASES
        .iter()
        .copied()
        .filter(|c| defect != Defect::ReleaseKeepsKey || *c != "mutual_exclusion_16_contenders")
        .collect();
    let report = run(defect, &cases).await;
    for c in &report.cases {
        if let Verdict::Failed(why) = &c.verdict {
            println!("{defect:?}: {} failed: {why}", c.name);
        }
    }
    for (case, says) in must_fail {
        let verdict = report
            .cases
            .iter()
            .find(|c| c.name == *case)
            .map(|c| &c.verdict);
        match verdict {
            Some(Verdict::Failed(why)) => {
                assert!(
                    why.contains(says),
                    "{defect:?}: {case} failed, but with {why:?}"
                );
            }
            other => panic!("{defect:?}: the suite did not fail {case}: {other:?}"),
        }
    }
}

/// The wrappers without a defect pass every case: the mutants' failures are their defects',
/// not the wrappers'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrappers_without_a_defect_pass_these_cases() {
    let report = run(Defect::None, CASES).await;
    assert!(failed(&report).is_empty(), "{:?}", failed(&report));
    assert_eq!(report.passed(), CASES.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_that_do_not_increase_are_caught() {
    caught(
        Defect::SameToken,
        &[
            ("mutual_exclusion_16_contenders", "tokens not increasing"),
            ("tokens_increase_across_handoffs", "token 1 after 1"),
            ("try_acquire_and_wait_bound", "not above"),
            ("stale_release_and_renew_are_no_ops", "not above"),
            ("inspect_and_force_release", "not above"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_granted_twice_is_caught() {
    caught(
        Defect::DoubleGrant,
        &[
            (
                "mutual_exclusion_16_contenders",
                "two holders inside at once",
            ),
            ("try_acquire_and_wait_bound", "expected Held"),
            ("stale_release_and_renew_are_no_ops", "expected Lost"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_keeps_the_key_is_caught() {
    caught(
        Defect::ReleaseKeepsKey,
        &[
            ("try_acquire_and_wait_bound", "not woken after release"),
            (
                "stale_release_and_renew_are_no_ops",
                "stale release: expected Lost",
            ),
            ("inspect_and_force_release", "release must be Lost"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_never_learns_it_is_lost_is_caught() {
    caught(
        Defect::NeverLost,
        &[
            ("stale_release_and_renew_are_no_ops", "expected Lost"),
            ("lost_fires_on_expiry", "did not fire after the TTL"),
            ("lost_fires_on_revocation", "expected Lost"),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_overstates_validity_is_caught() {
    caught(
        Defect::RenewOverstates,
        &[(
            "renew_extends_validity",
            "before the renewed holder's validity ended",
        )],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_acquire_that_waits_is_caught() {
    caught(
        Defect::TryWaits,
        &[(
            "try_acquire_and_wait_bound",
            "try_acquire with a wait bound of",
        )],
    )
    .await;
}

/// The scale case asks another client for a sample of the keys it holds: a backend that grants
/// them again fails it, although every lease's own state says `Held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scale_case_catches_keys_granted_while_held() {
    // Read by the scale case only, which no other test of this binary runs.
    std::env::set_var("CONFORMANCE_SCALE_LEASES", "128");
    std::env::set_var("CONFORMANCE_SCALE_HOLD_SECS", "1");
    let report = run(Defect::DoubleGrant, &["many_leases_kept"]).await;
    match &report.cases[0].verdict {
        Verdict::Failed(why) => assert!(
            why.contains(
                "keys another client was granted while their leases showed Held: 64 of 64"
            ),
            "{why}"
        ),
        other => panic!("the scale case passed a backend that grants held keys: {other:?}"),
    }
}

/// The chaos run's history checker, property (e): a backend whose grants report validity past
/// what the server keeps is caught when a crashed holder's key is granted again at its true
/// expiry, before the validity the crashed holder was told. The wrappers without the defect
/// pass the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chaos_run_catches_a_grant_that_overstates_validity() {
    // Read by the chaos case only, which no other test of this binary runs.
    std::env::set_var("CONFORMANCE_CHAOS_SECS", "4");
    let report = run(Defect::None, &["chaos_workers_pauses_kills_restarts"]).await;
    assert!(failed(&report).is_empty(), "{:?}", report.cases[0].verdict);
    let report = run(
        Defect::GrantOverstates,
        &["chaos_workers_pauses_kills_restarts"],
    )
    .await;
    match &report.cases[0].verdict {
        Verdict::Failed(why) => assert!(why.contains("(e) exclusive-tenure"), "{why}"),
        other => panic!("the chaos run passed grants that overstate validity: {other:?}"),
    }
}
