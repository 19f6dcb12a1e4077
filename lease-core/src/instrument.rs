//! [`Instrumented`]: tracing spans and metrics around any coordinator or fence, written once.

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::audit::AuditRecord;
use crate::coordinator::{Coordinator, HolderInfo};
use crate::error::Result;
use crate::fence::{Accepted, Fence, FencedValue};
use crate::key::{LockKey, ResourceId};
use crate::lease::{Lease, LeaseState};
use crate::metrics;
use crate::options::{Capabilities, ForceRelease, LeaseOptions};
use crate::token::Token;

/// Wraps a [`Coordinator`] or a [`Fence`] with tracing spans and the metrics listed in
/// [`crate::metrics`]. Behaviour is otherwise unchanged; leases it returns are wrapped too, so
/// renewals and releases are measured wherever they are called from (including the keeper).
///
/// [`crate::Registry::connect`] always returns instrumented handles. A coordinator or fence built
/// directly from an adapter crate (for example `RedisCoordinator::connect(config)`) emits only the
/// lease-level signals (held leases, losses, validity left at renewal, bounded sections); wrap it
/// to get the request-level ones too:
///
/// ```
/// use lease_core::memory::MemoryCoordinator;
/// use lease_core::{Coordinator, Instrumented};
///
/// let coordinator = Instrumented::new(MemoryCoordinator::new());
/// assert_eq!(coordinator.capabilities().backend, "memory");
/// ```
///
/// Wrap once: a handle wrapped twice counts every request twice.
#[derive(Debug, Clone)]
pub struct Instrumented<T> {
    inner: T,
}

impl<T> Instrumented<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Instrumented { inner }
    }

    /// The wrapped value.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

impl<C: Coordinator> Instrumented<C> {
    async fn acquire_with(
        &self,
        mode: &'static str,
        key: &LockKey,
        options: &LeaseOptions,
    ) -> Result<Box<dyn Lease>> {
        let backend = self.inner.capabilities().backend;
        let span = tracing::info_span!(
            "lease.acquire",
            backend,
            mode,
            key = %key,
            ttl_ms = options.ttl_value().as_millis() as u64,
            wait_ms = options.wait_value().as_millis() as u64,
            token = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let start = Instant::now();
        let result = async {
            if mode == "try" {
                self.inner.try_acquire(key, options).await
            } else {
                self.inner.acquire(key, options).await
            }
        }
        .instrument(span.clone())
        .await;
        let outcome = metrics::outcome(&result, "acquired");
        span.record("outcome", outcome);
        metrics::acquire(backend, mode, outcome, start.elapsed());
        match result {
            Ok(lease) => {
                span.record("token", lease.token().get());
                Ok(Box::new(InstrumentedLease { inner: lease }))
            }
            Err(e) => {
                tracing::debug!(parent: &span, error = %e, "acquire failed");
                Err(e)
            }
        }
    }
}

#[async_trait]
impl<C: Coordinator> Coordinator for Instrumented<C> {
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }

    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        self.acquire_with("wait", key, options).await
    }

    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        self.acquire_with("try", key, options).await
    }

    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let backend = self.inner.capabilities().backend;
        self.inner
            .inspect(key)
            .instrument(tracing::debug_span!("lease.inspect", backend, key = %key))
            .await
    }

    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let backend = self.inner.capabilities().backend;
        let result = self
            .inner
            .force_release(key, request)
            .instrument(tracing::info_span!("lease.force_release", backend, key = %key))
            .await;
        if let Ok(None) = &result {
            // The key was free: an operator's action all the same (one warning, as for every
            // force-release), but nothing was removed, so the counter does not move.
            tracing::warn!(
                backend,
                key = %key,
                actor = request.actor(),
                reason = request.reason(),
                "force-release found the key free; nothing removed"
            );
        }
        if let Ok(Some(removed)) = &result {
            metrics::forced_release(backend);
            tracing::warn!(
                backend,
                key = %key,
                actor = request.actor(),
                reason = request.reason(),
                removed_owner = removed.owner.as_str(),
                removed_token = removed.token.get(),
                "lock force-released by operator"
            );
        }
        // A refusal (`HolderChanged`) was logged once by the backend
        // (`ForceRelease::refused`).
        result
    }

    async fn audit_trail(&self, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
        let backend = self.inner.capabilities().backend;
        self.inner
            .audit_trail(key, limit)
            .instrument(tracing::debug_span!("lease.audit_trail", backend, key = %key, limit))
            .await
    }

    async fn settle(&self) {
        let backend = self.inner.capabilities().backend;
        self.inner
            .settle()
            .instrument(tracing::debug_span!("lease.settle", backend))
            .await
    }
}

/// A lease returned by an [`Instrumented`] coordinator.
#[derive(Debug)]
struct InstrumentedLease {
    inner: Box<dyn Lease>,
}

#[async_trait]
impl Lease for InstrumentedLease {
    fn state(&self) -> &LeaseState {
        self.inner.state()
    }

    async fn renew(&self) -> Result<Instant> {
        let backend = self.state().backend();
        let start = Instant::now();
        let result = self
            .inner
            .renew()
            .instrument(tracing::debug_span!(
                "lease.renew",
                backend,
                key = %self.key(),
                token = self.token().get()
            ))
            .await;
        metrics::renew(
            backend,
            metrics::outcome(&result, "renewed"),
            start.elapsed(),
        );
        result
    }

    async fn release(&self) -> Result<()> {
        let backend = self.state().backend();
        let result = self
            .inner
            .release()
            .instrument(tracing::debug_span!(
                "lease.release",
                backend,
                key = %self.key(),
                token = self.token().get()
            ))
            .await;
        metrics::release(backend, metrics::outcome(&result, "released"));
        result
    }
}

impl<F: Fence> Instrumented<F> {
    fn record_fence(
        &self,
        op: &'static str,
        resource: &ResourceId,
        token: Token,
        r: &Result<Accepted>,
    ) {
        let backend = self.inner.backend();
        let outcome = metrics::outcome(r, "accepted");
        metrics::fence_op(backend, op, outcome);
        if let Err(e) = r {
            if outcome == "stale" {
                tracing::warn!(backend, op, resource = %resource, presented = token.get(), error = %e, "fence rejected a stale token");
            } else {
                tracing::debug!(backend, op, resource = %resource, error = %e, "fence operation failed");
            }
        }
    }
}

#[async_trait]
impl<F: Fence> Fence for Instrumented<F> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        let r = self.inner.write(resource, token, value).await;
        self.record_fence("write", resource, token, &r);
        r
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        let r = self.inner.claim(resource, token).await;
        self.record_fence("claim", resource, token, &r);
        r
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        self.inner.read(resource).await
    }
}

impl<T: fmt::Display> fmt::Display for Instrumented<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}
