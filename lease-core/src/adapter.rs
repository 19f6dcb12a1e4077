//! What only adapter authors need: URL option parsing ([`UrlOptions`]), grant and renewal
//! bookkeeping ([`LeaseTracker`]), token admission against the floor and the process watermark
//! ([`TokenAdmission`], [`Watermarks`]), the one rule for a failed request's error ([`Op`]), the
//! retry backoff ([`Backoff`]), the guardian that cleans up after an ended lease
//! ([`spawn_guardian`], [`retry_until_settled`]), the count of clean-ups under way that
//! `Coordinator::settle` waits for ([`Cleanups`]), the queue that starts a lease's task only if
//! the lease outlives its first moment ([`DelayedStarts`]), a connection or session opened once
//! for every caller asking meanwhile ([`SharedOpening`]), the leases that live on one session
//! ([`Dependents`]), the stored holder and audit records ([`HolderRecord`], [`StoredAudit`]),
//! credentials that never show in `Debug` ([`Secret`]), the TLS options and the PEM files they
//! name ([`TlsFiles`], [`read_pem`]), the round scheduler ([`batch`]), clock helpers
//! ([`clock`]), the registry's factory types, the macro that writes an adapter's `Coordinator`
//! impl ([`coordinator_from_primitives!`](crate::coordinator_from_primitives)) and the one that
//! writes its config's common builder methods ([`common_config!`](crate::common_config)).
//!
//! Code that uses leases needs none of this; it lives at the crate root. An adapter crate
//! imports from here (`use lease_core::adapter::{UrlOptions, OptionSpec, ...}`), so a reader can
//! tell at the `use` line which parts of the core an adapter builds on.
//!
//! # An adapter crate's files
//!
//! Every adapter of this workspace has the same files for the same roles, so that a reader who
//! knows one finds their way in another:
//!
//! | file | holds |
//! |---|---|
//! | `lib.rs` | the public re-exports, `SCHEME` and `register(&mut Registry)` |
//! | `config.rs` | the config type, its builder (the common options' methods written by [`common_config!`](crate::common_config)) and `from_url` / `from_backend_url` (through [`UrlOptions`]) |
//! | `client.rs` | connection plumbing: the backend's own client from the config |
//! | `keys.rs` | the key layout on the server and its escaping |
//! | `core.rs` | the state the coordinator shares with its leases and tasks (imported from here, never from `coordinator.rs`) |
//! | `coordinator.rs` | construction (`connect(config)`, `connect_url(&str)`, `from_client(client, config)` on the application's own client of the backend) and the primitives [`coordinator_from_primitives!`](crate::coordinator_from_primitives) turns into the trait impl |
//! | `acquire.rs` | the acquire recipe and the grant |
//! | `lease.rs` | the lease type: renew, release, loss |
//! | `operator.rs` | inspect, force-release and the audit trail |
//! | `error.rs` | the classification of the client's errors into [`Op`]'s outcomes |
//! | `fence.rs` | the fence, where the backend has one |
//!
//! What is the backend's own has a file named for its role: `session.rs` (etcd, ZooKeeper,
//! Consul), `watch.rs`, `wakeups.rs`, `monitor.rs`, `coalesce.rs` (requests sent together under
//! load, through [`batch::Coalesce`]) and the like.

pub use crate::backoff::Backoff;
pub use crate::cleanups::{Cleanups, PendingCleanup};
#[path = "batch.rs"]
pub mod batch;
#[path = "clock.rs"]
pub mod clock;
pub use crate::connect::{
    percent_decode, percent_encode, redact_url_text, BackendUrl, CoordinatorFactory, FenceFactory,
    HostPort,
};
pub use crate::delayed::DelayedStarts;
pub use crate::dependents::{ended_during_acquire, fresh_id, Dependents};
pub use crate::fence::check_fence_value_len;
pub use crate::guardian::{retry_until_settled, spawn_guardian, CleanupFailures};
pub use crate::lease::LeaseTracker;
pub use crate::local_waiters::{in_turn, LocalWaiters, Turn};
pub use crate::opening::SharedOpening;
pub use crate::options::{duration_in_range, parse_millis};
pub use crate::outcome::{resend, Delivery, Op, SendAgain};
pub use crate::records::{forced_release_of, HolderRecord, StoredAudit, FORCED_LOOKBACK};
pub use crate::secret::Secret;
pub use crate::tls::{read_pem, server_name, PemKind, TlsFiles, TlsRefusal};
pub use crate::tokens::{NativeToken, TokenAdmission};
pub use crate::url_options::{
    parse_flag, timeout_in_range, CommonOptions, OptionSpec, UrlOptions, COMMON_OPTIONS,
    MAX_URL_TIMEOUT,
};
pub use crate::watermark::Watermarks;

/// Re-exported for [`coordinator_from_primitives!`](crate::coordinator_from_primitives).
pub use async_trait::async_trait;

/// Writes an adapter's [`Coordinator`](crate::Coordinator) impl from its primitives, so that the
/// trait impl is the same code on every backend and an adapter only writes what is its own.
///
/// The type provides these inherent methods (each documents what it costs on its backend):
///
/// | method | is |
/// |---|---|
/// | `fn caps(&self) -> &Capabilities` | `capabilities` |
/// | `fn local_waiters(&self) -> Option<&LocalWaiters>` | the turns of this coordinator's waiting acquires ([`LocalWaiters`]); `None` where the backend's own queue already gives each waiter its turn |
/// | `async fn acquire_for(&self, &LockKey, &LeaseOptions, wait: Option<Duration>) -> Result<Box<dyn Lease>>` | `acquire` (`Some(wait)`: up to `wait`, which is `options.wait` or, for a waiting `acquire` that ran in its turn among this coordinator's waiters of the key, what is left of it) and `try_acquire` (`None`: one attempt); `options` are validated against `caps()` already |
/// | `async fn inspect_key(&self, &LockKey) -> Result<Option<HolderInfo>>` | `inspect` |
/// | `async fn force_release_key(&self, &LockKey, &ForceRelease) -> Result<Option<HolderInfo>>` | `force_release` |
/// | `async fn audit_trail_of(&self, &LockKey, usize) -> Result<Vec<AuditRecord>>` | `audit_trail` |
/// | `fn cleanups(&self) -> &Cleanups` | the clean-ups it has begun in the background, which `settle` waits for ([`Cleanups`]) |
#[macro_export]
macro_rules! coordinator_from_primitives {
    ($ty:ty) => {
        #[$crate::adapter::async_trait]
        impl $crate::Coordinator for $ty {
            fn capabilities(&self) -> &$crate::Capabilities {
                self.caps()
            }

            async fn acquire(
                &self,
                key: &$crate::LockKey,
                options: &$crate::LeaseOptions,
            ) -> $crate::Result<Box<dyn $crate::Lease>> {
                // Bad input is refused before any wait.
                options.validate(self.caps())?;
                let wait = options.wait_value();
                let Some(waiters) = self.local_waiters().filter(|_| !wait.is_zero()) else {
                    return self.acquire_for(key, options, Some(wait)).await;
                };
                // One waiter per key at a time asks the server (no herd, no overtaking).
                $crate::adapter::in_turn(waiters, key, wait, |left| {
                    self.acquire_for(key, options, Some(left))
                })
                .await
            }

            async fn try_acquire(
                &self,
                key: &$crate::LockKey,
                options: &$crate::LeaseOptions,
            ) -> $crate::Result<Box<dyn $crate::Lease>> {
                options.validate(self.caps())?;
                self.acquire_for(key, options, None).await
            }

            async fn inspect(
                &self,
                key: &$crate::LockKey,
            ) -> $crate::Result<Option<$crate::HolderInfo>> {
                self.inspect_key(key).await
            }

            async fn force_release(
                &self,
                key: &$crate::LockKey,
                request: &$crate::ForceRelease,
            ) -> $crate::Result<Option<$crate::HolderInfo>> {
                self.force_release_key(key, request).await
            }

            async fn audit_trail(
                &self,
                key: &$crate::LockKey,
                limit: usize,
            ) -> $crate::Result<Vec<$crate::AuditRecord>> {
                self.audit_trail_of(key, limit).await
            }

            async fn settle(&self) {
                self.cleanups().settle().await
            }
        }
    };
}
