//! Operator actions on Redis: inspect a key, force-release it (audited; a compare-and-delete
//! when a token is expected), read the audit trail. The [`Coordinator`](lease_core::Coordinator)
//! methods of the same names delegate here.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lease_core::{
    AuditRecord, Error, ForceRelease, HolderInfo, LockKey, LostReason, OwnerId, Result, Token,
};

use crate::coordinator::*;
use crate::core::*;
use crate::error::{bad_reply, ops, BACKEND};
use crate::keys::{LockKeys, LockValue};
use crate::scripts::{self, reply};

impl RedisCoordinator {
    /// [`Coordinator::inspect`](lease_core::Coordinator::inspect).
    pub(crate) async fn inspect_key(&self, key: &LockKey) -> Result<Option<HolderInfo>> {
        let keys = LockKeys::new(self.inner.config.key_prefix(), key);
        let Some((value, pttl)) = self.read_lock(&keys, ops::INSPECT).await? else {
            return Ok(None);
        };
        match LockValue::parse(&value) {
            Some(v) => Ok(Some(v.holder_info(key, pttl))),
            None => self.foreign_holder(key, &keys, pttl).await.map(Some),
        }
    }

    /// [`Coordinator::force_release`](lease_core::Coordinator::force_release).
    pub(crate) async fn force_release_key(
        &self,
        key: &LockKey,
        request: &ForceRelease,
    ) -> Result<Option<HolderInfo>> {
        let keys = LockKeys::new(self.inner.config.key_prefix(), key);
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
            .to_string();
        let maxlen = scripts::AUDIT_MAXLEN.to_string();
        let marker = MARKER_WITHOUT_TTL_MS.to_string();
        let expected = request
            .expected_token()
            .map_or_else(String::new, |t| t.to_string());
        let script_keys = [keys.lock(), keys.revoked(), keys.audit(), keys.counter()];
        let script_args: [&[u8]; 7] = [
            keys.channel().as_bytes(),
            request.actor().as_bytes(),
            request.reason().as_bytes(),
            at_ms.as_bytes(),
            maxlen.as_bytes(),
            marker.as_bytes(),
            expected.as_bytes(),
        ];
        // With replicas, as a grant: the removal, its revoked marker and its audit entry count
        // only once `replica_acks` of them have them, or a failover could bring the holder back
        // (renewing on) with no record of the removal. Never sent again (the audit entry is not
        // idempotent): a lost reply is `OutcomeUnknown`.
        let acks = self.inner.replica_acks().await?;
        let wait = self.inner.config.request_timeout() / 2;
        let conn = &self.inner.conn;
        let (v, acked) = if acks == 0 {
            let v = conn
                .eval(
                    ops::FORCE_RELEASE,
                    &scripts::FORCE_RELEASE,
                    &script_keys,
                    &script_args,
                )
                .await?;
            (v, 0)
        } else {
            conn.eval_and_wait(
                ops::FORCE_RELEASE,
                &scripts::FORCE_RELEASE,
                &script_keys,
                &script_args,
                acks,
                wait,
                None,
            )
            .await?
        };
        let items = reply::array(v).ok_or_else(|| bad_reply(ops::FORCE_RELEASE, "not an array"))?;
        // Removed on the primary, but not on as many replicas as asked: the local lease is
        // revoked all the same (below); the caller learns that a failover may undo it.
        let unreplicated = |removed: String| {
            ((acked as usize) < acks).then(|| Error::OutcomeUnknown {
                backend: BACKEND,
                operation: ops::FORCE_RELEASE.name,
                message: format!(
                    "key {key}: removed {removed} on the primary, but {acked} of the {acks} \
                     replica(s) replica_acks asks for had the removal within {wait:?}: a \
                     failover may still bring the holder back; inspect the key again"
                ),
                source: None,
            })
        };
        // The token the script found: the holder's, or for a value of another writer the newest
        // issued (`None` when none ever was).
        let found = |t: Option<&redis::Value>| -> Result<Option<Token>> {
            match t.map(|t| reply::text(t).unwrap_or_default()) {
                None => Ok(None),
                Some(t) if t.is_empty() => Ok(None),
                Some(t) => t
                    .parse::<Token>()
                    .map(Some)
                    .map_err(|_| bad_reply(ops::FORCE_RELEASE, "not a token")),
            }
        };
        if let [first, kind] = items.as_slice() {
            if reply::text(first).as_deref() == Some("audit_not_a_stream") {
                return Err(Error::misconfigured(
                    BACKEND,
                    format!(
                        "key {key}: its audit key {} holds a {} where a stream belongs, so a \
                         force-release could not be recorded; nothing was removed. Something \
                         else writes under the key prefix {:?}",
                        keys.audit(),
                        reply::text(kind).unwrap_or_default(),
                        self.inner.config.key_prefix()
                    ),
                ));
            }
        }
        if let (Some(expected), Some(first)) = (request.expected_token(), items.first()) {
            if reply::text(first).as_deref() == Some("refused") {
                return Err(request.refused(BACKEND, key, expected, found(items.get(1))?));
            }
        }
        let (value, pttl, token) = match items.as_slice() {
            [] => return Ok(None),
            [value, pttl, token] => (
                // Removed and audited already: a value that is not UTF-8 is another writer's,
                // not an unknown outcome.
                reply::bytes(value.clone())
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .ok_or_else(|| bad_reply(ops::FORCE_RELEASE, "not a string"))?,
                reply::int(pttl).unwrap_or(-1),
                found(Some(token))?,
            ),
            _ => return Err(bad_reply(ops::FORCE_RELEASE, "unexpected shape")),
        };
        let Some(v) = LockValue::parse(&value) else {
            // A value of another writer was removed (and audited): reported as `inspect` shows
            // it, without its content.
            let Some(token) = token else {
                // Removed for certain (and audited), but there is no holder to report: no token
                // was ever issued for this key.
                return Err(request.removed_without_holder(
                    BACKEND,
                    key,
                    format!(
                        "key {key}: removed a value another writer put there (not a lease of \
                         this library; no token was ever issued for the key), so the key is free \
                         now; find what else writes under this key prefix"
                    ),
                ));
            };
            if let Some(e) = unreplicated("a value another writer put there".to_owned()) {
                return Err(e);
            }
            return Ok(Some(foreign_holder_info(key, token, pttl)));
        };
        if let Some(live) = lock(&self.inner.live).by_nonce.get(&v.nonce) {
            live.tracker.mark_lost(LostReason::Revoked);
        }
        if let Some(e) = unreplicated(format!("the holder with token {}", v.token)) {
            return Err(e);
        }
        Ok(Some(v.holder_info(key, pttl)))
    }

    /// [`Coordinator::audit_trail`](lease_core::Coordinator::audit_trail):
    ///
    /// Reads the lock's capped audit stream newest first (`XREVRANGE ... COUNT limit`); the
    /// stream keeps the 100 newest entries.
    pub(crate) async fn audit_trail_of(
        &self,
        key: &LockKey,
        limit: usize,
    ) -> Result<Vec<AuditRecord>> {
        let keys = LockKeys::new(self.inner.config.key_prefix(), key);
        let limit = AuditRecord::check_limit(limit)?;
        let audit = keys.audit();
        let v: redis::Value = self
            .inner
            .conn
            .run(ops::AUDIT, |mut c| async move {
                redis::cmd("XREVRANGE")
                    .arg(audit)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(limit)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let entries = reply::array(v).ok_or_else(|| bad_reply(ops::AUDIT, "not an array"))?;
        let mut out = Vec::with_capacity(entries.len());
        for entry in entries {
            let mut parts = reply::array(entry)
                .ok_or_else(|| bad_reply(ops::AUDIT, "entry is not an array"))?;
            let fields = parts
                .pop()
                .and_then(reply::array)
                .ok_or_else(|| bad_reply(ops::AUDIT, "entry has no fields"))?;
            let mut map = HashMap::new();
            for pair in fields.chunks(2) {
                if let [k, v] = pair {
                    if let (Some(k), Some(v)) = (reply::text(k), reply::text(v)) {
                        map.insert(k, v);
                    }
                }
            }
            let take = |name: &str| map.get(name).cloned().filter(|s| !s.is_empty());
            out.push(
                AuditRecord::new(
                    key.clone(),
                    take("actor").unwrap_or_default(),
                    take("reason").unwrap_or_default(),
                )
                .with_at(
                    take("at_ms")
                        .and_then(|s| s.parse::<u64>().ok())
                        .and_then(|ms| UNIX_EPOCH.checked_add(Duration::from_millis(ms))),
                )
                .with_removed(
                    take("removed_token").and_then(|s| s.parse().ok()),
                    take("removed_owner").map(|s| s.replace("%7C", "|").replace("%25", "%")),
                ),
            );
        }
        Ok(out)
    }
}

impl RedisCoordinator {
    /// `inspect` of a lock key that holds another writer's value (for example `SET ... KEEPTTL`
    /// by another tool over a held lock): the owner is `unknown (outside write)` and the token is
    /// the newest one issued (the counter), which is the token of the holder whose value was
    /// overwritten (no grant can happen while the key is occupied), never one no holder got.
    pub(crate) async fn foreign_holder(
        &self,
        key: &LockKey,
        keys: &LockKeys,
        pttl: i64,
    ) -> Result<HolderInfo> {
        let counter = keys.counter();
        let newest: Option<String> = self
            .inner
            .conn
            .run(ops::INSPECT, |mut c| async move {
                redis::cmd("GET").arg(counter).query_async(&mut c).await
            })
            .await?;
        let token: Token = newest
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| bad_reply(ops::INSPECT, "the lock holds a value of another writer"))?;
        Ok(foreign_holder_info(key, token, pttl))
    }
}

/// What `inspect` and `force_release` show of a value another writer put on `key`: no owner, the
/// newest token issued for the key, the value's TTL.
fn foreign_holder_info(key: &LockKey, token: Token, pttl: i64) -> HolderInfo {
    let owner = OwnerId::new("unknown (outside write)").expect("a valid owner label");
    HolderInfo::new(key.clone(), owner, token)
        .with_expires_in((pttl >= 0).then(|| Duration::from_millis(pttl as u64)))
}
