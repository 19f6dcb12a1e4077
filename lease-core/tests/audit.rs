//! `Coordinator::audit_trail`: the default is `Unsupported`; `Arc`, `Box` and `Instrumented`
//! forward it (not default it); the in-memory backend answers newest first.

use std::sync::Arc;

use async_trait::async_trait;
use lease_core::memory::MemoryCoordinator;
use lease_core::{
    Capabilities, Coordinator, Error, ForceRelease, HolderInfo, Instrumented, InvalidInput, Lease,
    LeaseOptions, LockKey, Result,
};

/// A coordinator that does not implement `audit_trail`.
#[derive(Debug, Default)]
struct WithoutAudit {
    inner: MemoryCoordinator,
}

#[async_trait]
impl Coordinator for WithoutAudit {
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    async fn acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        self.inner.acquire(key, options).await
    }
    async fn try_acquire(&self, key: &LockKey, options: &LeaseOptions) -> Result<Box<dyn Lease>> {
        self.inner.try_acquire(key, options).await
    }
    async fn inspect(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        self.inner.inspect(key).await
    }
    async fn force_release(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        self.inner.force_release(key, request).await
    }
}

fn key() -> LockKey {
    LockKey::new("jobs/audited").unwrap()
}

#[tokio::test]
async fn the_default_is_unsupported_after_checking_the_limit() {
    let c: Arc<dyn Coordinator> = Arc::new(WithoutAudit::default());
    assert!(matches!(
        c.audit_trail(&key(), 10).await,
        Err(Error::Unsupported {
            backend: "memory",
            ..
        })
    ));
    assert!(matches!(
        c.audit_trail(&key(), 0).await,
        Err(Error::InvalidInput(InvalidInput::OutOfRange {
            field: "limit",
            ..
        }))
    ));
}

#[tokio::test]
async fn wrappers_forward_and_memory_answers_newest_first() {
    let memory = MemoryCoordinator::new();
    let wrapped: Arc<dyn Coordinator> = Arc::new(Box::new(Instrumented::new(memory.clone())));
    let k = key();
    let lease = memory
        .acquire(&k, &LeaseOptions::new(std::time::Duration::from_secs(5)))
        .await
        .unwrap();
    for (actor, reason) in [("alice", "first"), ("bob", "second")] {
        wrapped
            .force_release(&k, &ForceRelease::new(actor, reason).unwrap())
            .await
            .unwrap();
    }
    let trail = wrapped.audit_trail(&k, 10).await.unwrap();
    let actors: Vec<_> = trail.iter().map(|r| r.actor.as_str()).collect();
    assert_eq!(actors, ["bob", "alice"]);
    assert_eq!(trail[1].removed_token, Some(lease.token()));
    assert_eq!(
        trail[0].removed_token, None,
        "the second found the key free"
    );
    assert_eq!(wrapped.audit_trail(&k, 1).await.unwrap(), trail[..1]);
    let other = LockKey::new("jobs/other").unwrap();
    assert!(wrapped.audit_trail(&other, 10).await.unwrap().is_empty());
    assert!(matches!(
        wrapped.audit_trail(&k, 101).await,
        Err(Error::InvalidInput(_))
    ));
}
