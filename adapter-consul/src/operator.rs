//! Operator actions on Consul: inspect a key, force-release it (audited; a compare-and-delete
//! when a token is expected), read the audit trail. The [`Coordinator`](lease_core::Coordinator)
//! methods of the same names delegate here.

use lease_core::adapter::{HolderRecord, Op, StoredAudit};
use lease_core::{AuditRecord, ForceRelease, HolderInfo, LockKey, Result};

use crate::client::{KvEntry, TxnOp, TxnOutcome};
use crate::coordinator::*;
use crate::BACKEND;

impl ConsulCoordinator {
    /// [`Coordinator::inspect`](lease_core::Coordinator::inspect):
    ///
    /// One `?consistent` read of the key.
    pub(crate) async fn inspect_key(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let kv_key = self.inner.config.kv_key(key);
        let (_, entry) = self
            .inner
            .http
            .kv_get(&kv_key, true, None, "inspect")
            .await?;
        match entry.filter(|e| e.holder().is_some()) {
            Some(e) => Ok(Some(self.holder_info(key, &e)?)),
            None => Ok(None),
        }
    }

    /// [`Coordinator::force_release`](lease_core::Coordinator::force_release):
    ///
    /// A `?consistent` read, then one transaction: `check-index` (what was read), `delete`, and
    /// `set` of the audit record (actor, reason, removed holder) at `<prefix>/forced/<key>`; a
    /// free key gets the record alone.
    /// With an expected token, a holder whose `CreateIndex` differs (or a free key) is refused
    /// with `HolderChanged` before the transaction, which then removes that holder or nothing.
    pub(crate) async fn force_release_key(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let inner = &self.inner;
        let kv_key = inner.config.kv_key(key);
        for _ in 0..ForceRelease::ATTEMPTS {
            let (_, entry) = inner
                .http
                .kv_get(&kv_key, true, None, "force_release")
                .await?;
            let entry = entry.filter(|e| e.holder().is_some());
            let info = entry
                .as_ref()
                .map(|e| self.holder_info(key, e))
                .transpose()?;
            // A different holder is refused here; the expected one is deleted by the
            // transaction below only if its `ModifyIndex` is still the one read, so the server
            // removes that holder or nothing (and then this loop looks again).
            request.check_expected(BACKEND, key, info.as_ref().map(|h| h.token))?;
            let audit_key = inner.config.audit_key(key);
            let (_, audit_entry) = inner
                .http
                .kv_get(&audit_key, true, None, "force_release")
                .await?;
            let trail = match &audit_entry {
                Some(e) => StoredAudit::parse_trail(&e.value_bytes())
                    .ok_or_else(|| StoredAudit::unreadable(BACKEND, &audit_key))?,
                None => Vec::new(),
            };
            let trail = StoredAudit::new(request, info.as_ref()).appended_to(trail);
            // The audit key is compared too, so that concurrent releases never drop a record; a
            // free key gets its record alone (nothing removed).
            let mut ops = vec![match &audit_entry {
                Some(e) => TxnOp::check_index(&audit_key, e.modify_index),
                None => TxnOp::check_not_exists(&audit_key),
            }];
            if let Some(entry) = &entry {
                ops.push(TxnOp::check_index(&kv_key, entry.modify_index));
                ops.push(TxnOp::delete(&kv_key));
            }
            ops.push(TxnOp::set(&audit_key, &trail));
            match inner
                .http
                .txn(&ops, Op::write("force_release", false))
                .await?
            {
                TxnOutcome::Committed(_) => {
                    // A lease of this very client learns of it at once (the key was locked by
                    // its session): the one with the removed token, never a later lease of
                    // the same key granted while this answer was on its way.
                    if let Some(lease) = inner
                        .sessions
                        .peek()
                        .filter(|s| entry.as_ref().and_then(KvEntry::holder) == Some(s.id.as_str()))
                        .zip(info.as_ref())
                        .and_then(|(s, removed)| s.lease_on(&kv_key, removed.token))
                    {
                        lease.revoked();
                    }
                    return Ok(info);
                }
                // The key or its audit record changed between the reads and the delete: read
                // again.
                TxnOutcome::RolledBack(_) => continue,
            }
        }
        Err(request.kept_changing(BACKEND, key))
    }

    /// [`Coordinator::audit_trail`](lease_core::Coordinator::audit_trail):
    ///
    /// Reads the audit key (`<key_prefix>/forced/<key>`, one `?consistent` get) and returns its
    /// newest records first.
    pub(crate) async fn audit_trail_of(
        &self,
        key: &LockKey,
        limit: usize,
    ) -> Result<Vec<AuditRecord>> {
        let limit = AuditRecord::check_limit(limit)?;
        let inner = &self.inner;
        let (_, entry) = inner
            .http
            .kv_get(&inner.config.audit_key(key), true, None, "audit_trail")
            .await?;
        let trail = match entry {
            Some(e) => StoredAudit::parse_trail(&e.value_bytes())
                .ok_or_else(|| StoredAudit::unreadable(BACKEND, &inner.config.audit_key(key)))?,
            None => Vec::new(),
        };
        Ok(StoredAudit::newest_first(&trail, key, limit))
    }
}

impl ConsulCoordinator {
    /// What `inspect` shows of the key's holder.
    ///
    /// The token is the key's `CreateIndex`: every lease this adapter hands out locked a key it
    /// created (a key found existing is deleted and locked again), so that index is the
    /// holder's token, and a plain write by another tool (which raises `ModifyIndex`) does not
    /// change it. When that write replaced the holder record, the owner is shown as the session.
    pub(crate) fn holder_info(&self, key: &LockKey, entry: &KvEntry) -> Result<HolderInfo> {
        let token = self.inner.tokens.convert(key, entry.create_index)?;
        Ok(HolderRecord::holder_info(
            &entry.value_bytes(),
            key,
            token,
            || match entry.holder() {
                Some(s) => format!("unknown (consul session {s})"),
                None => "unknown".into(),
            },
        ))
    }
}
