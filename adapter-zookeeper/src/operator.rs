//! Operator actions on ZooKeeper: inspect a key, force-release it (audited; a compare-and-delete
//! when a token is expected), read the audit trail. The [`Coordinator`](lease_core::Coordinator)
//! methods of the same names delegate here.

use std::time::{Duration, UNIX_EPOCH};

use lease_core::adapter::{HolderRecord, StoredAudit, TokenAdmission};
use lease_core::{AuditRecord, Error, ForceRelease, HolderInfo, LockKey, Result};
use tokio::time::Instant;
use zookeeper_client::{CreateMode, Error as ZkError, MultiWriteError, Stat};

use crate::coordinator::*;
use crate::error::{disconnected, from_zk, ops, timed_out, BACKEND};
use crate::keys::{audit_prefix, audit_sequence, AUDIT_PREFIX};
use crate::session::Session;

impl ZkCoordinator {
    /// [`Coordinator::inspect`](lease_core::Coordinator::inspect).
    pub(crate) async fn inspect_key(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let s = self.session().await?;
        if !s.is_connected() {
            return Err(disconnected(ops::INSPECT));
        }
        match self.holder(&s, key).await? {
            None => Ok(None),
            Some((_, data, stat)) => holder_info(&self.inner.tokens, key, &data, &stat).map(Some),
        }
    }

    /// [`Coordinator::force_release`](lease_core::Coordinator::force_release).
    pub(crate) async fn force_release_key(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let s = self.session().await?;
        if !s.is_connected() {
            return Err(disconnected(ops::FORCE_RELEASE));
        }
        for _ in 0..ForceRelease::ATTEMPTS {
            let holder = self.holder(&s, key).await?;
            let target = match &holder {
                Some((_, data, stat)) => Some(holder_info(&self.inner.tokens, key, data, stat)?),
                None => None,
            };
            // The delete below names the holder's node (a sequential path is never reused) and
            // its version, so the server removes exactly the node whose czxid was read here, or
            // nothing; a different holder is refused before anything is written.
            request.check_expected(BACKEND, key, target.as_ref().map(|h| h.token))?;
            // The audit node and the delete in one multi, all or nothing: no forced release goes
            // unrecorded, and no record names a removal that did not happen. A free key gets its
            // audit node alone (a force-release of a free key is listed).
            let removing = holder.zip(target);
            let node = removing
                .as_ref()
                .map(|((path, _, stat), info)| (info, path.as_str(), stat.version));
            if self.record_and_remove(&s, key, request, node).await? {
                return Ok(removing.map(|(_, info)| info));
            }
        }
        Err(request.kept_changing(BACKEND, key))
    }

    /// [`Coordinator::audit_trail`](lease_core::Coordinator::audit_trail): see
    /// [`audit_records`].
    pub(crate) async fn audit_trail_of(
        &self,
        key: &LockKey,
        limit: usize,
    ) -> Result<Vec<AuditRecord>> {
        let limit = AuditRecord::check_limit(limit)?;
        audit_records(&*self.session().await?, key, limit).await
    }
}

/// Up to `limit` of `key`'s audit records, newest first: lists the key's own directory
/// (`<base>/audit-trails/<encoded key>`, behind a `sync`: a follower behind the leader would
/// leave out a record just written) and reads its nodes newest sequence first; when that gives
/// fewer than `limit`, earlier versions' records follow from the shared directory
/// (`<base>/audit`, every key's records; skipped when it does not exist).
pub(crate) async fn audit_records(
    s: &Session,
    key: &LockKey,
    limit: usize,
) -> Result<Vec<AuditRecord>> {
    let dir = s.paths().audit_trail(key);
    let sent = Instant::now();
    let names = match s.synced_read(sent, |c| c.list_children(&dir)).await {
        None => return Err(timed_out(ops::AUDIT_READ, s.request_timeout())),
        Some(Ok(n)) => n,
        Some(Err(ZkError::NoNode)) => Vec::new(),
        Some(Err(e)) => return Err(from_zk(ops::AUDIT_READ, e)),
    };
    let mut out = read_records(s, key, &dir, names, AUDIT_PREFIX, limit).await?;
    if out.len() < limit {
        // Read after the sync above, by the same server: at least as new.
        match legacy_records(s, key, limit - out.len()).await {
            Ok(older) => out.extend(older),
            // The key's own records stand without the earlier version's (a shared directory
            // grown past the server's packet limit cannot be listed at all).
            Err(e) if !out.is_empty() => {
                tracing::debug!(backend = BACKEND, key = %key, error = %e, "the earlier version's audit directory could not be read; its records are left out");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Up to `limit` of `key`'s records an earlier version wrote in the shared `<base>/audit`
/// (none when it does not exist).
async fn legacy_records(s: &Session, key: &LockKey, limit: usize) -> Result<Vec<AuditRecord>> {
    let dir = s.paths().audit();
    let names = match s
        .read(ops::AUDIT_READ, s.client().list_children(&dir))
        .await?
    {
        Ok(n) => n,
        Err(ZkError::NoNode) => return Ok(Vec::new()),
        Err(e) => return Err(from_zk(ops::AUDIT_READ, e)),
    };
    read_records(s, key, &dir, names, &audit_prefix(key), limit).await
}

/// Reads up to `limit` of `key`'s records among the audit nodes `names` of `dir` (those named
/// `prefix` and a sequence, or an earlier version's `forced-` and a sequence), newest sequence
/// first.
async fn read_records(
    s: &Session,
    key: &LockKey,
    dir: &str,
    names: Vec<String>,
    prefix: &str,
    limit: usize,
) -> Result<Vec<AuditRecord>> {
    let mut out = Vec::new();
    for n in newest_first(names, prefix) {
        if out.len() == limit {
            break;
        }
        let path = format!("{dir}/{n}");
        match s.read(ops::AUDIT_READ, s.client().get_data(&path)).await? {
            Ok((data, stat)) => {
                if let Some(r) = parse_audit(key, &data, &stat) {
                    out.push(r);
                }
            }
            Err(ZkError::NoNode) => {}
            Err(e) => return Err(from_zk(ops::AUDIT_READ, e)),
        }
    }
    Ok(out)
}

/// The audit node names among `names` that [`audit_sequence`] accepts for `prefix`, newest
/// sequence first.
fn newest_first(names: Vec<String>, prefix: &str) -> impl Iterator<Item = String> {
    let mut names: Vec<(i64, String)> = names
        .into_iter()
        .filter_map(|n| Some((audit_sequence(&n, prefix)?, n)))
        .collect();
    names.sort_by_key(|(sequence, _)| std::cmp::Reverse(*sequence));
    names.into_iter().map(|(_, n)| n)
}

/// Deletes the oldest of the audit nodes in `dir` beyond the newest
/// [`AuditRecord::MAX_LIMIT`], best-effort (a failure leaves them for the next force-release).
async fn trim_audit_trail(s: &Session, dir: &str) {
    let Ok(Ok(names)) = s
        .read(ops::FORCE_RELEASE, s.client().list_children(dir))
        .await
    else {
        return;
    };
    for n in newest_first(names, AUDIT_PREFIX).skip(AuditRecord::MAX_LIMIT) {
        let path = format!("{dir}/{n}");
        let _ = tokio::time::timeout(s.request_timeout(), s.client().delete(&path, None)).await;
    }
}

impl ZkCoordinator {
    /// The current holder's node: `(path, data, stat)`, read behind a `sync` so that it is at
    /// least as new as the leader's state when the call began. A plain read may be answered by
    /// a follower that has not applied a grant or a release yet: `inspect` would say free for
    /// a held key, and `force-release` audit a free key and remove nothing. The reads after the
    /// first see at least what it saw (one session's requests are answered in order by one
    /// server).
    pub(crate) async fn holder(
        &self,
        s: &Session,
        key: &LockKey,
    ) -> Result<Option<(String, Vec<u8>, Stat)>> {
        let dir = s.paths().lock_dir(key);
        for _ in 0..5 {
            let sent = Instant::now();
            let children = match s.synced_read(sent, |c| c.list_children(&dir)).await {
                None => return Err(timed_out(ops::INSPECT, s.request_timeout())),
                Some(Ok(c)) => c,
                Some(Err(ZkError::NoNode)) => return Ok(None),
                Some(Err(e)) => return Err(from_zk(ops::INSPECT, e)),
            };
            let ordered = self.order(s, &dir, children).await?;
            let Some(first) = ordered.first() else {
                return Ok(None);
            };
            let path = format!("{dir}/{}", first.name);
            match s.read(ops::INSPECT, s.client().get_data(&path)).await? {
                Ok((data, stat)) => return Ok(Some((path, data, stat))),
                Err(ZkError::NoNode) => continue,
                Err(e) => return Err(from_zk(ops::INSPECT, e)),
            }
        }
        Err(Error::unavailable(
            BACKEND,
            format!("the holder of {key:?} kept changing while it was read"),
        ))
    }

    /// Writes the audit node of a force-release and, for a held key, removes the holder's node
    /// (`target`, its path and version), in one multi. `false` when the holder changed since it
    /// was read: nothing was written, look again.
    async fn record_and_remove(
        &self,
        s: &Session,
        key: &LockKey,
        request: &ForceRelease,
        node: Option<(&HolderInfo, &str, i32)>,
    ) -> Result<bool> {
        let dir = s.paths().audit_trail(key);
        let data = StoredAudit::new(request, node.map(|(target, ..)| target))
            .for_key(key)
            .to_json();
        let options = CreateMode::PersistentSequential.with_acls(s.acls());
        let audit_path = format!("{dir}/{AUDIT_PREFIX}");
        for _ in 0..2 {
            let mut writer = s.client().new_multi_writer();
            writer
                .add_create(&audit_path, &data, &options)
                .map_err(|e| from_zk(ops::FORCE_RELEASE, e))?;
            if let Some((_, path, version)) = node {
                writer
                    .add_delete(path, Some(version))
                    .map_err(|e| from_zk(ops::FORCE_RELEASE, e))?;
            }
            let sent = Instant::now();
            match tokio::time::timeout(s.request_timeout(), writer.commit()).await {
                Err(_) => return Err(timed_out(ops::FORCE_RELEASE, s.request_timeout())),
                Ok(Ok(_)) => {
                    s.confirm(sent);
                    trim_audit_trail(s, &dir).await;
                    return Ok(true);
                }
                // The audit directory is missing (nothing was applied): create it, send again.
                Ok(Err(MultiWriteError::OperationFailed {
                    index: 0,
                    source: ZkError::NoNode,
                })) => {
                    s.confirm(sent);
                    s.ensure_persistent(&dir).await?;
                }
                // The holder's node left or changed meanwhile: nothing was applied.
                Ok(Err(MultiWriteError::OperationFailed {
                    index: 1,
                    source: ZkError::NoNode | ZkError::BadVersion,
                })) => {
                    s.confirm(sent);
                    return Ok(false);
                }
                Ok(Err(e)) => return Err(from_zk(ops::FORCE_RELEASE, ZkError::from(e))),
            }
        }
        Err(Error::unavailable(
            BACKEND,
            format!("could not create the audit node under {dir}"),
        ))
    }
}

/// What `inspect` shows of a contender node: its record's labels, and the server's creation
/// time of the node.
pub(crate) fn holder_info(
    tokens: &TokenAdmission,
    key: &LockKey,
    data: &[u8],
    stat: &Stat,
) -> Result<HolderInfo> {
    let token = tokens.convert(key, stat.czxid)?;
    Ok(
        HolderRecord::holder_info(data, key, token, || "unknown".into())
            .with_acquired_at(server_ms(stat.ctime)),
    )
}

/// The audit node's record if it is about `key` (every key's nodes share one directory), at
/// the server's creation time of the node.
pub(crate) fn parse_audit(key: &LockKey, data: &[u8], stat: &Stat) -> Option<AuditRecord> {
    StoredAudit::parse(data)
        .filter(|r| r.key.as_deref() == Some(key.as_str()))
        .map(|r| r.to_record(key, server_ms(stat.ctime)))
}

/// A ZooKeeper server time (milliseconds since the epoch) as a wall-clock time, for display.
fn server_ms(ms: i64) -> Option<std::time::SystemTime> {
    u64::try_from(ms)
        .ok()
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
}
