//! Operator actions on etcd: inspect a key, force-release it (audited; a compare-and-delete
//! when a token is expected), read the audit trail. The [`Coordinator`](lease_core::Coordinator)
//! methods of the same names delegate here.

use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, KeyValue, SortOrder, SortTarget, Txn, TxnOp};
use lease_core::adapter::{Backoff, HolderRecord, Op, StoredAudit};
use lease_core::{AuditRecord, ForceRelease, HolderInfo, LockKey, Result};

use crate::coordinator::*;
use crate::core::Inner;
use crate::error::{retry_unapplied, Failure, BACKEND};
use crate::keys::{self};

impl EtcdCoordinator {
    /// [`Coordinator::inspect`](lease_core::Coordinator::inspect):
    ///
    /// The first key of the lock's queue is the holder. `expires_in` is the remaining TTL of the
    /// holder's session lease (an upper bound: the holder's key is deleted earlier if it stops
    /// renewing).
    pub(crate) async fn inspect_key(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let Some(kv) = self
            .inner
            .first_in_queue(key)
            .await
            .map_err(|f| f.into_error(Op::read("inspect")))?
        else {
            return Ok(None);
        };
        let mut info = self.inner.holder_info(key, &kv)?;
        if kv.lease() != 0 {
            let client = &self.inner.handle.client;
            let lease = kv.lease();
            if let Ok(ttl) = retry_unapplied(self.inner.timeout(), || {
                let mut c = client.clone();
                async move { c.lease_time_to_live(lease, None).await }
            })
            .await
            {
                // Capped as `clear_orphans` does: etcd answers about 2^63 ns for a lease whose
                // expiry a new leader has not set yet.
                let left = ttl.ttl().min(ttl.granted_ttl()).max(0);
                info = info.with_expires_in(Some(Duration::from_secs(left as u64)));
            }
        }
        Ok(Some(info))
    }

    /// [`Coordinator::force_release`](lease_core::Coordinator::force_release):
    ///
    /// Deletes the holder's key (compare-and-delete on its create revision) and records the
    /// actor, reason and removed holder (none for a free key) in the lock's audit key
    /// (`<prefix>/audit/<name>`, the newest 100 forced releases; compared on its mod revision so
    /// that concurrent releases never drop a record) in the same transaction (the `warn` log
    /// event is `lease_core::Instrumented`'s, once for every backend). With an expected token, a
    /// holder whose create revision differs (or a free key) is refused with `HolderChanged`
    /// before the transaction, which then removes that holder or nothing.
    pub(crate) async fn force_release_key(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let prefix = self.config().key_prefix().to_owned();
        for _ in 0..ForceRelease::ATTEMPTS {
            let first = self
                .inner
                .first_in_queue(key)
                .await
                .map_err(|f| f.into_error(Op::read("force_release")))?;
            let info = first
                .as_ref()
                .map(|kv| self.inner.holder_info(key, kv))
                .transpose()?;
            // A different holder is refused here; the expected one is deleted by the
            // transaction below only if its key still has the create revision read (the
            // token), so the server removes that holder or nothing.
            request.check_expected(BACKEND, key, info.as_ref().map(|h| h.token))?;
            // The audit key is compared, so that concurrent releases never drop a record; a
            // free key gets its record alone (nothing removed).
            let audit_key = keys::audit_key(&prefix, key);
            let (audit_rev, trail) = self
                .inner
                .handle
                .read_audit(&audit_key, "force_release")
                .await?;
            let trail = StoredAudit::new(request, info.as_ref()).appended_to(trail);
            let mut when = vec![Compare::mod_revision(
                audit_key.as_str(),
                CompareOp::Equal,
                audit_rev,
            )];
            let mut then = vec![TxnOp::put(audit_key.as_str(), trail, None)];
            if let Some(kv) = &first {
                when.push(Compare::create_revision(
                    kv.key(),
                    CompareOp::Equal,
                    kv.create_revision(),
                ));
                then.push(TxnOp::delete(kv.key(), None));
            }
            let txn = Txn::new().when(when).and_then(then);
            let client = &self.inner.handle.client;
            let resp = retry_unapplied(self.inner.timeout(), || {
                let (mut c, txn) = (client.clone(), txn.clone());
                async move { c.txn(txn).await }
            })
            .await
            .map_err(|f| f.into_error(Op::write("force_release", false)))?;
            if resp.succeeded() {
                return Ok(info);
            }
            // The holder or the audit key changed between the reads and the transaction: look
            // again.
        }
        Err(request.kept_changing(BACKEND, key))
    }

    /// [`Coordinator::audit_trail`](lease_core::Coordinator::audit_trail):
    ///
    /// Reads the lock's audit key (one linearizable get) and returns its newest records first.
    pub(crate) async fn audit_trail_of(
        &self,
        key: &LockKey,
        limit: usize,
    ) -> Result<Vec<AuditRecord>> {
        let limit = AuditRecord::check_limit(limit)?;
        let audit_key = keys::audit_key(self.config().key_prefix(), key);
        let (_, trail) = self
            .inner
            .handle
            .read_audit(&audit_key, "audit_trail")
            .await?;
        Ok(StoredAudit::newest_first(&trail, key, limit))
    }
}

impl Inner {
    /// The first key of `key`'s queue (the holder), with its value.
    pub(crate) async fn first_in_queue(
        &self,
        key: &LockKey,
    ) -> std::result::Result<Option<KeyValue>, Failure> {
        let prefix = keys::lock_prefix(self.handle.config.key_prefix(), key);
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let mut last = None;
        let mut pause = Backoff::new(Duration::from_millis(50), Duration::from_millis(200));
        for attempt in 0..3u32 {
            let client = &self.handle.client;
            match retry_unapplied(self.timeout(), || {
                let (mut kv, prefix, options) = (client.clone(), prefix.clone(), options.clone());
                async move { kv.get(prefix, Some(options)).await }
            })
            .await
            {
                Ok(mut g) => return Ok(g.take_kvs().into_iter().next()),
                Err(f) => {
                    last = Some(f);
                    if attempt < 2 {
                        pause.sleep().await;
                    }
                }
            }
        }
        Err(last.expect("three attempts"))
    }

    pub(crate) fn holder_info(&self, key: &LockKey, kv: &KeyValue) -> Result<HolderInfo> {
        let token = self.tokens.convert(key, kv.create_revision())?;
        Ok(HolderRecord::holder_info(kv.value(), key, token, || {
            "unknown".into()
        }))
    }
}
