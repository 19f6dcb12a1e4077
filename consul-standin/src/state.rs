//! The stand-in's data model: a Raft index, the KV store with tombstones, sessions and lock-delays,
//! with the semantics of Consul's state store (`agent/consul/state/kvs.go`, `session.go`,
//! `txn.go`). Pure and synchronous: the HTTP layer ([`super::http`]) parses requests, takes the
//! lock on a [`Store`], calls one method, and renders the answer.
//!
//! Every write that Consul would put through Raft gets the next index; reads never change it.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// The only registered health check: the node's Serf check, which Consul attaches to sessions by
/// default.
pub(crate) const SERF_HEALTH: &str = "serfHealth";
/// The stand-in's node name (sessions belong to it).
pub(crate) const NODE_NAME: &str = "consul-standin";
/// Consul's `MaxLockDelay`: larger lock-delays are clamped to it.
pub(crate) const MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// Consul's `SessionTTLMax`.
pub(crate) const SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// Consul's default `kv_max_value_size` (512 KiB).
pub(crate) const KV_MAX_VALUE_SIZE: usize = 512 * 1024;
/// Consul's limit on operations in one transaction (`maxTxnOps`).
pub(crate) const MAX_TXN_OPS: usize = 64;

/// An error answered with an HTTP status and a plain-text body, as Consul's HTTP layer does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub(crate) status: u16,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }
}

/// A KV entry (`structs.DirEntry`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) key: String,
    pub(crate) create_index: u64,
    pub(crate) modify_index: u64,
    pub(crate) lock_index: u64,
    pub(crate) flags: u64,
    pub(crate) value: Vec<u8>,
    pub(crate) session: Option<String>,
}

impl Entry {
    /// `DirEntry.Equal`: the fields a write compares to decide whether anything changed (indexes
    /// excluded).
    fn same_content(&self, other: &Entry) -> bool {
        self.lock_index == other.lock_index
            && self.key == other.key
            && self.flags == other.flags
            && self.value == other.value
            && self.session == other.session
    }
}

/// What happens to a session's locks when it is invalidated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Behavior {
    /// Locks are released (the keys stay, without a session).
    Release,
    /// The locked keys are deleted.
    Delete,
}

impl Behavior {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Behavior::Release => "release",
            Behavior::Delete => "delete",
        }
    }
}

/// A session (`structs.Session`) plus the leader's TTL timer.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) node: String,
    pub(crate) node_checks: Vec<String>,
    pub(crate) service_checks: Vec<String>,
    pub(crate) lock_delay: Duration,
    pub(crate) behavior: Behavior,
    /// The TTL as given (`"10s"`), empty for none.
    pub(crate) ttl_text: String,
    pub(crate) ttl: Option<Duration>,
    pub(crate) create_index: u64,
    pub(crate) modify_index: u64,
    /// When the leader's timer invalidates the session (TTL × multiplier after the last renewal).
    pub(crate) expires_at: Option<Instant>,
}

/// A session create request after HTTP decoding (defaults already applied).
#[derive(Debug, Clone)]
pub(crate) struct NewSession {
    pub(crate) name: String,
    pub(crate) node: String,
    pub(crate) node_checks: Vec<String>,
    pub(crate) service_checks: Vec<String>,
    pub(crate) lock_delay: Duration,
    pub(crate) behavior: Behavior,
    pub(crate) ttl_text: String,
    pub(crate) ttl: Option<Duration>,
}

/// One KV operation of a transaction (`api.TxnKVOp`), also used for single-key PUT and DELETE.
#[derive(Debug, Clone, Default)]
pub(crate) struct KvOp {
    pub(crate) verb: String,
    pub(crate) key: String,
    pub(crate) value: Vec<u8>,
    pub(crate) flags: u64,
    pub(crate) index: u64,
    pub(crate) session: String,
}

/// The outcome of one KV operation.
enum Outcome {
    /// Applied (or read); the entry to report, if any (value kept only for reads).
    Done(Vec<Entry>),
    /// Not applied for a semantic reason (`!ok && err == nil` in Consul): `false` on the single-key
    /// endpoints, a transaction error in `/v1/txn`.
    Refused(String),
    /// An error (`err != nil` in Consul): HTTP 500 on the single-key endpoints, a transaction
    /// error in `/v1/txn`.
    Failed(String),
}

/// Uncommitted changes of one transaction over the committed KV map.
struct Overlay<'a> {
    base: &'a BTreeMap<String, Entry>,
    changes: BTreeMap<String, Option<Entry>>,
}

impl Overlay<'_> {
    fn get(&self, key: &str) -> Option<Entry> {
        match self.changes.get(key) {
            Some(v) => v.clone(),
            None => self.base.get(key).cloned(),
        }
    }

    fn put(&mut self, entry: Entry) {
        self.changes.insert(entry.key.clone(), Some(entry));
    }

    fn delete(&mut self, key: &str) {
        self.changes.insert(key.to_owned(), None);
    }

    fn list(&self, prefix: &str) -> Vec<Entry> {
        let mut merged: BTreeMap<String, Entry> = self
            .base
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, e)| (k.clone(), e.clone()))
            .collect();
        for (k, v) in self
            .changes
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
        {
            match v {
                Some(e) => merged.insert(k.clone(), e.clone()),
                None => merged.remove(k),
            };
        }
        merged.into_values().collect()
    }
}

/// The whole replicated state of the stand-in, plus the session TTL timers, which only the leader
/// runs and a restart resets the way a newly elected Consul leader does. Lock-delays are kept:
/// Consul sets them while applying a session's invalidation, on every server
/// (`deleteSessionTxn`), so a new leader has them too.
#[derive(Debug)]
pub(crate) struct Store {
    index: u64,
    kv: BTreeMap<String, Entry>,
    tombstones: BTreeMap<String, u64>,
    /// The index of the last change to the `kvs` or `tombstones` tables.
    kv_table_index: u64,
    sessions: BTreeMap<String, Session>,
    lock_delays: HashMap<String, Instant>,
    session_ttl_min: Duration,
    ttl_multiplier: u32,
    serf_healthy: bool,
    /// False while the stand-in is "killed": nothing is applied.
    pub(crate) serving: bool,
    /// Keys written, deleted, released or unlocked since the HTTP layer last took them
    /// ([`Store::take_changed`]): what wakes single-key blocking queries, like the watch channels
    /// of Consul's memdb, which fire for the changed key only.
    changed: Vec<String>,
}

impl Store {
    /// An empty store. The index starts above zero like a fresh Consul's, whose first user write
    /// lands well after the bootstrap entries.
    pub(crate) fn new(session_ttl_min: Duration, ttl_multiplier: u32) -> Self {
        Store {
            index: 10,
            kv: BTreeMap::new(),
            tombstones: BTreeMap::new(),
            kv_table_index: 0,
            sessions: BTreeMap::new(),
            lock_delays: HashMap::new(),
            session_ttl_min,
            ttl_multiplier: ttl_multiplier.max(1),
            serf_healthy: true,
            serving: true,
            changed: Vec::new(),
        }
    }

    /// The keys changed since the last call (see [`Store::changed`](Self)), each once.
    pub(crate) fn take_changed(&mut self) -> Vec<String> {
        let mut keys = std::mem::take(&mut self.changed);
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// The current Raft index.
    pub(crate) fn index(&self) -> u64 {
        self.index
    }

    fn next_index(&mut self) -> u64 {
        self.index += 1;
        self.index
    }

    // ---------------------------------------------------------------- sessions

    /// `Session.Apply` with `SessionCreate`: validates TTL and checks, returns the new ID.
    pub(crate) fn create_session(
        &mut self,
        new: NewSession,
        now: Instant,
    ) -> Result<String, ApiError> {
        if let Some(ttl) = new.ttl {
            if ttl < self.session_ttl_min || ttl > SESSION_TTL_MAX {
                return Err(ApiError::new(
                    500,
                    format!(
                        "Invalid Session TTL '{}', must be between [{}={}]",
                        ttl.as_nanos(),
                        go_duration(self.session_ttl_min),
                        go_duration(SESSION_TTL_MAX)
                    ),
                ));
            }
        }
        if new.node != NODE_NAME {
            return Err(ApiError::new(
                500,
                format!("Missing node registration: {:?}", new.node),
            ));
        }
        for check in &new.node_checks {
            if check != SERF_HEALTH {
                return Err(ApiError::new(
                    500,
                    format!("Missing check '{check}' registration"),
                ));
            }
            if !self.serf_healthy {
                return Err(ApiError::new(
                    500,
                    format!("Check '{check}' is in critical state"),
                ));
            }
        }
        if let Some(check) = new.service_checks.first() {
            return Err(ApiError::new(
                500,
                format!("Missing check '{check}' registration"),
            ));
        }
        let id = new_uuid();
        let idx = self.next_index();
        let expires_at = new.ttl.map(|t| now + t * self.ttl_multiplier);
        self.sessions.insert(
            id.clone(),
            Session {
                id: id.clone(),
                name: new.name,
                node: new.node,
                node_checks: new.node_checks,
                service_checks: new.service_checks,
                lock_delay: new.lock_delay.min(MAX_LOCK_DELAY),
                behavior: new.behavior,
                ttl_text: new.ttl_text,
                ttl: new.ttl,
                create_index: idx,
                modify_index: idx,
                expires_at,
            },
        );
        Ok(id)
    }

    /// `Session.Renew`: resets the TTL timer. `None` if the session does not exist (HTTP 404).
    pub(crate) fn renew_session(&mut self, id: &str, now: Instant) -> Option<Session> {
        let mult = self.ttl_multiplier;
        let s = self.sessions.get_mut(id)?;
        if let Some(ttl) = s.ttl {
            s.expires_at = Some(now + ttl * mult);
        }
        Some(s.clone())
    }

    /// `Session.Get`.
    pub(crate) fn session(&self, id: &str) -> Option<Session> {
        self.sessions.get(id).cloned()
    }

    /// `Session.List`.
    pub(crate) fn sessions(&self) -> Vec<Session> {
        self.sessions.values().cloned().collect()
    }

    /// `Session.Apply` with `SessionDestroy`: invalidates the session if it exists.
    pub(crate) fn destroy_session(&mut self, id: &str, now: Instant) -> bool {
        if self.sessions.contains_key(id) {
            self.invalidate(id, now);
        }
        true
    }

    /// Deletes a session and applies its behaviour and lock-delay to every key it holds
    /// (`deleteSessionTxn`).
    fn invalidate(&mut self, id: &str, now: Instant) {
        let Some(session) = self.sessions.remove(id) else {
            return;
        };
        let idx = self.next_index();
        let held: Vec<String> = self
            .kv
            .values()
            .filter(|e| e.session.as_deref() == Some(id))
            .map(|e| e.key.clone())
            .collect();
        for key in &held {
            match session.behavior {
                Behavior::Release => {
                    if let Some(e) = self.kv.get_mut(key) {
                        e.session = None;
                        e.modify_index = idx;
                    }
                }
                Behavior::Delete => {
                    self.kv.remove(key);
                    self.tombstones.insert(key.clone(), idx);
                }
            }
            if !session.lock_delay.is_zero() {
                self.lock_delays
                    .insert(key.clone(), now + session.lock_delay);
            }
        }
        if !held.is_empty() {
            self.kv_table_index = idx;
        }
        self.changed.extend(held);
    }

    /// Invalidates every session whose TTL timer has fired. Returns whether anything changed.
    pub(crate) fn expire_sessions(&mut self, now: Instant) -> bool {
        let due: Vec<String> = self
            .sessions
            .values()
            .filter(|s| s.expires_at.is_some_and(|t| t <= now))
            .map(|s| s.id.clone())
            .collect();
        for id in &due {
            self.invalidate(id, now);
        }
        !due.is_empty()
    }

    /// When the next session timer fires.
    pub(crate) fn next_expiry(&self) -> Option<Instant> {
        self.sessions.values().filter_map(|s| s.expires_at).min()
    }

    /// What a newly elected leader does: every session timer restarts at its full TTL (times the
    /// multiplier). Lock-delays stay: every server set them when it applied the invalidation.
    pub(crate) fn new_leader(&mut self, now: Instant) {
        let mult = self.ttl_multiplier;
        for s in self.sessions.values_mut() {
            if let Some(ttl) = s.ttl {
                s.expires_at = Some(now + ttl * mult);
            }
        }
    }

    /// The node's Serf check turns critical: every session that carries it is invalidated,
    /// whatever its TTL (and new sessions with it are refused).
    pub(crate) fn fail_serf_health(&mut self, now: Instant) {
        self.serf_healthy = false;
        let ids: Vec<String> = self
            .sessions
            .values()
            .filter(|s| s.node_checks.iter().any(|c| c == SERF_HEALTH))
            .map(|s| s.id.clone())
            .collect();
        for id in ids {
            self.invalidate(&id, now);
        }
    }

    /// The Serf check passes again.
    pub(crate) fn restore_serf_health(&mut self) {
        self.serf_healthy = true;
    }

    // ---------------------------------------------------------------- KV reads

    /// `KVS.Get`: the reply index is the entry's `ModifyIndex`, or the table index for a missing
    /// key (1 at least, so that a blocking query never spins on 0).
    pub(crate) fn kv_get(&self, key: &str) -> (u64, Option<Entry>) {
        match self.kv.get(key) {
            Some(e) => (e.modify_index, Some(e.clone())),
            None => (self.kv_table_index.max(1), None),
        }
    }

    /// `KVS.List`: every entry whose key starts with `prefix`; the reply index is the largest
    /// `ModifyIndex` among them and the tombstones under the prefix, or the table index.
    pub(crate) fn kv_list(&self, prefix: &str) -> (u64, Vec<Entry>) {
        let entries: Vec<Entry> = self
            .kv
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, e)| e.clone())
            .collect();
        let idx = if prefix.is_empty() {
            self.kv_table_index
        } else {
            self.prefix_version(prefix)
        };
        (
            if idx == 0 { self.kv_table_index } else { idx }.max(1),
            entries,
        )
    }

    /// The index [`Store::kv_list`] answers with, without building the list.
    pub(crate) fn kv_list_index(&self, prefix: &str) -> u64 {
        let idx = if prefix.is_empty() {
            self.kv_table_index
        } else {
            self.prefix_version(prefix)
        };
        if idx == 0 { self.kv_table_index } else { idx }.max(1)
    }

    /// `KVS.ListKeys`: keys under `prefix`, cut after the first `separator` past the prefix.
    pub(crate) fn kv_keys(&self, prefix: &str, separator: &str) -> (u64, Vec<String>) {
        let (idx, entries) = self.kv_list(prefix);
        let mut keys: Vec<String> = Vec::new();
        for e in entries {
            let rest = &e.key[prefix.len()..];
            let k = match (separator.is_empty(), rest.find(separator)) {
                (false, Some(pos)) => format!("{prefix}{}", &rest[..pos + separator.len()]),
                _ => e.key.clone(),
            };
            if keys.last() != Some(&k) {
                keys.push(k);
            }
        }
        (idx, keys)
    }

    /// What a blocking query on one key watches: changes whenever the key is written or deleted.
    pub(crate) fn key_version(&self, key: &str) -> u64 {
        self.kv
            .get(key)
            .map(|e| e.modify_index)
            .or_else(|| self.tombstones.get(key).copied())
            .unwrap_or(0)
    }

    /// What a blocking query on a prefix watches.
    pub(crate) fn prefix_version(&self, prefix: &str) -> u64 {
        let live = self
            .kv
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, e)| e.modify_index)
            .max()
            .unwrap_or(0);
        let dead = self
            .tombstones
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(_, i)| *i)
            .max()
            .unwrap_or(0);
        live.max(dead)
    }

    // ---------------------------------------------------------------- KV writes

    /// `kvsPreApply`'s lock-delay rule: a `lock` within a key's lock-delay is refused.
    fn lock_delayed(&self, key: &str, now: Instant) -> bool {
        self.lock_delays.get(key).is_some_and(|until| *until > now)
    }

    /// A single-key `PUT` or `DELETE` (`KVS.Apply`): `Ok(true|false)` as Consul answers it, or an
    /// error for HTTP 500.
    pub(crate) fn kv_apply(&mut self, op: KvOp, now: Instant) -> Result<bool, ApiError> {
        if op.verb == "lock" && self.lock_delayed(&op.key, now) {
            return Ok(false);
        }
        let idx = self.index + 1;
        let mut overlay = Overlay {
            base: &self.kv,
            changes: BTreeMap::new(),
        };
        let outcome = apply_op(&mut overlay, &self.sessions, idx, &op);
        let changes = overlay.changes;
        match outcome {
            Outcome::Done(_) => {
                self.commit(changes);
                Ok(true)
            }
            Outcome::Refused(_) => Ok(false),
            Outcome::Failed(message) => Err(ApiError::new(500, message)),
        }
    }

    /// `Txn.Apply` (or `Txn.Read` when every operation is a read): all operations or none.
    /// `Ok(results)` for HTTP 200, `Err(errors)` (operation index and message) for HTTP 409.
    pub(crate) fn txn(
        &mut self,
        ops: &[KvOp],
        now: Instant,
    ) -> Result<Vec<Entry>, Vec<(usize, String)>> {
        // Pre-checks (`Txn.preCheck`): lock-delays.
        let mut errors: Vec<(usize, String)> = ops
            .iter()
            .enumerate()
            .filter(|(_, op)| op.verb == "lock" && self.lock_delayed(&op.key, now))
            .map(|(i, op)| {
                (
                    i,
                    format!("failed to lock key {:?} due to lock delay", op.key),
                )
            })
            .collect();
        if !errors.is_empty() {
            return Err(errors);
        }
        let idx = self.index + 1;
        let mut overlay = Overlay {
            base: &self.kv,
            changes: BTreeMap::new(),
        };
        let mut results = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            match apply_op(&mut overlay, &self.sessions, idx, op) {
                Outcome::Done(mut entries) => results.append(&mut entries),
                Outcome::Refused(m) | Outcome::Failed(m) => errors.push((i, m)),
            }
        }
        let changes = overlay.changes;
        if !errors.is_empty() {
            return Err(errors);
        }
        self.commit(changes);
        Ok(results)
    }

    /// Applies a transaction's changes at the next index (if it changed anything).
    fn commit(&mut self, changes: BTreeMap<String, Option<Entry>>) {
        let really: Vec<(String, Option<Entry>)> = changes
            .into_iter()
            .filter(|(k, v)| match (v, self.kv.get(k)) {
                (Some(new), Some(old)) => new != old,
                (None, None) => false,
                _ => true,
            })
            .collect();
        if really.is_empty() {
            return;
        }
        let idx = self.next_index();
        for (k, v) in really {
            self.changed.push(k.clone());
            match v {
                Some(e) => {
                    self.tombstones.remove(&k);
                    self.kv.insert(k, e);
                }
                None => {
                    self.kv.remove(&k);
                    self.tombstones.insert(k, idx);
                }
            }
        }
        self.kv_table_index = idx;
    }
}

/// Consul's `kvsSetTxn`: stores `entry` at `idx` unless nothing changed (then the existing
/// `ModifyIndex` stays). With `update_session` false the existing session is kept.
fn set_entry(overlay: &mut Overlay<'_>, idx: u64, mut entry: Entry, update_session: bool) -> Entry {
    let existing = overlay.get(&entry.key);
    entry.create_index = existing.as_ref().map_or(idx, |e| e.create_index);
    if !update_session {
        // Consul keeps the session but not the LockIndex: a plain write resets it to the
        // request's (zero).
        entry.session = existing.as_ref().and_then(|e| e.session.clone());
    }
    if let Some(old) = existing.as_ref().filter(|old| old.same_content(&entry)) {
        entry.modify_index = old.modify_index;
        return entry;
    }
    entry.modify_index = idx;
    overlay.put(entry.clone());
    entry
}

fn blank(mut e: Entry) -> Entry {
    e.value = Vec::new();
    e
}

/// One KV verb, with the semantics and messages of Consul's `txnKVS`.
fn apply_op(
    overlay: &mut Overlay<'_>,
    sessions: &BTreeMap<String, Session>,
    idx: u64,
    op: &KvOp,
) -> Outcome {
    let key = op.key.as_str();
    let new_entry = || Entry {
        key: op.key.clone(),
        create_index: 0,
        modify_index: 0,
        lock_index: 0,
        flags: op.flags,
        value: op.value.clone(),
        session: None,
    };
    match op.verb.as_str() {
        "set" => Outcome::Done(vec![blank(set_entry(overlay, idx, new_entry(), false))]),
        "cas" => {
            let existing = overlay.get(key);
            let ok = match (&existing, op.index) {
                (Some(_), 0) => false,
                (None, 0) => true,
                (None, _) => false,
                (Some(e), i) => e.modify_index == i,
            };
            if !ok {
                return Outcome::Refused(format!("failed to set key {key:?}, index is stale"));
            }
            Outcome::Done(vec![blank(set_entry(overlay, idx, new_entry(), false))])
        }
        "lock" => {
            if op.session.is_empty() {
                return Outcome::Failed("missing session".into());
            }
            if !sessions.contains_key(&op.session) {
                return Outcome::Failed(format!("invalid session {:?}", op.session));
            }
            let mut entry = new_entry();
            entry.session = Some(op.session.clone());
            match overlay.get(key) {
                Some(e) if e.session.as_deref() == Some(op.session.as_str()) => {
                    entry.lock_index = e.lock_index;
                }
                Some(e) if e.session.is_some() => {
                    return Outcome::Refused(format!(
                        "failed to lock key {key:?}, lock is already held"
                    ));
                }
                Some(e) => entry.lock_index = e.lock_index + 1,
                None => entry.lock_index = 1,
            }
            Outcome::Done(vec![blank(set_entry(overlay, idx, entry, true))])
        }
        "unlock" => {
            if op.session.is_empty() {
                return Outcome::Failed("missing session".into());
            }
            match overlay.get(key) {
                Some(e) if e.session.as_deref() == Some(op.session.as_str()) => {
                    let mut entry = new_entry();
                    entry.lock_index = e.lock_index;
                    Outcome::Done(vec![blank(set_entry(overlay, idx, entry, true))])
                }
                _ => Outcome::Refused(format!(
                    "failed to unlock key {key:?}, lock isn't held, or is held by another session"
                )),
            }
        }
        "get" => match overlay.get(key) {
            Some(e) => Outcome::Done(vec![e]),
            None => Outcome::Failed(format!("key {key:?} doesn't exist")),
        },
        "get-tree" => Outcome::Done(overlay.list(key)),
        "check-session" => match overlay.get(key) {
            None => Outcome::Failed(format!(
                "failed to check session, key {key:?} doesn't exist"
            )),
            Some(e) if e.session.as_deref().unwrap_or("") != op.session => {
                Outcome::Failed(format!(
                    "failed session check for key {key:?}, current session {:?} != {:?}",
                    e.session.as_deref().unwrap_or(""),
                    op.session
                ))
            }
            Some(e) => Outcome::Done(vec![blank(e)]),
        },
        "check-index" => match overlay.get(key) {
            None => Outcome::Failed(format!("failed to check index, key {key:?} doesn't exist")),
            Some(e) if e.modify_index != op.index => Outcome::Failed(format!(
                "failed index check for key {key:?}, current modify index {} != {}",
                e.modify_index, op.index
            )),
            Some(e) => Outcome::Done(vec![blank(e)]),
        },
        "check-not-exists" => match overlay.get(key) {
            Some(_) => Outcome::Failed(format!("key {key:?} exists")),
            None => Outcome::Done(Vec::new()),
        },
        "delete" => {
            if overlay.get(key).is_some() {
                overlay.delete(key);
            }
            Outcome::Done(Vec::new())
        }
        "delete-cas" => match overlay.get(key) {
            // Consul's kvsDeleteCASTxn reports success for a key that does not exist.
            None => Outcome::Done(Vec::new()),
            Some(e) if e.modify_index != op.index => {
                Outcome::Refused(format!("failed to delete key {key:?}, index is stale"))
            }
            Some(_) => {
                overlay.delete(key);
                Outcome::Done(Vec::new())
            }
        },
        "delete-tree" => {
            for e in overlay.list(key) {
                overlay.delete(&e.key);
            }
            Outcome::Done(Vec::new())
        }
        other => Outcome::Failed(format!("unknown KV verb {other:?}")),
    }
}

/// A random version-4 UUID, formatted like Consul's session IDs.
pub(crate) fn new_uuid() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Formats a duration the way Go's `time.Duration.String` does for whole units (`10s`, `24h0m0s`,
/// `1.5s`, `250ms`).
pub(crate) fn go_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    if nanos == 0 {
        return "0s".into();
    }
    if nanos < 1_000_000_000 {
        return if nanos % 1_000_000 == 0 {
            format!("{}ms", nanos / 1_000_000)
        } else if nanos % 1_000 == 0 {
            format!("{}µs", nanos / 1_000)
        } else {
            format!("{nanos}ns")
        };
    }
    let total_secs = d.as_secs();
    let (h, m, s) = (total_secs / 3600, (total_secs / 60) % 60, total_secs % 60);
    let frac = d.subsec_nanos();
    let secs = if frac == 0 {
        format!("{s}")
    } else {
        let f = format!("{frac:09}");
        format!("{s}.{}", f.trim_end_matches('0'))
    };
    if h > 0 {
        format!("{h}h{m}m{secs}s")
    } else if m > 0 {
        format!("{m}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

/// Parses a Go duration string (`"10s"`, `"1.5s"`, `"250ms"`, `"1h2m"`, `"0"`), as Consul does
/// for `TTL`, `LockDelay` and `wait`.
pub(crate) fn parse_go_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if s == "0" {
        return Some(Duration::ZERO);
    }
    if s.is_empty() {
        return None;
    }
    let mut total: f64 = 0.0;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return None;
        }
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * unit;
    }
    Duration::try_from_secs_f64(total).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Store {
        Store::new(Duration::from_millis(100), 2)
    }

    fn session(st: &mut Store, ttl_ms: u64, lock_delay_ms: u64, behavior: Behavior) -> String {
        st.create_session(
            NewSession {
                name: "t".into(),
                node: NODE_NAME.into(),
                node_checks: Vec::new(),
                service_checks: Vec::new(),
                lock_delay: Duration::from_millis(lock_delay_ms),
                behavior,
                ttl_text: format!("{ttl_ms}ms"),
                ttl: (ttl_ms > 0).then(|| Duration::from_millis(ttl_ms)),
            },
            Instant::now(),
        )
        .unwrap()
    }

    fn op(verb: &str, key: &str) -> KvOp {
        KvOp {
            verb: verb.into(),
            key: key.into(),
            ..KvOp::default()
        }
    }

    fn lock(key: &str, session: &str) -> KvOp {
        KvOp {
            session: session.into(),
            ..op("lock", key)
        }
    }

    #[test]
    fn lock_index_restarts_after_delete_while_modify_index_rises() {
        let mut st = store();
        let now = Instant::now();
        let s = session(&mut st, 0, 0, Behavior::Release);
        let first = st.txn(&[lock("k", &s), op("get", "k")], now).unwrap();
        assert_eq!(first[1].lock_index, 1);
        let unlock = KvOp {
            session: s.clone(),
            ..op("unlock", "k")
        };
        st.txn(&[unlock], now).unwrap();
        let second = st.txn(&[lock("k", &s), op("get", "k")], now).unwrap();
        assert_eq!(second[1].lock_index, 2);
        assert!(second[1].modify_index > first[1].modify_index);
        assert!(st.kv_apply(op("delete", "k"), now).unwrap());
        let third = st.txn(&[lock("k", &s), op("get", "k")], now).unwrap();
        assert_eq!(third[1].lock_index, 1, "LockIndex restarts at 1");
        assert!(third[1].modify_index > second[1].modify_index);
    }

    #[test]
    fn second_session_is_refused_and_txn_rolls_back() {
        let mut st = store();
        let now = Instant::now();
        let (a, b) = (
            session(&mut st, 0, 0, Behavior::Release),
            session(&mut st, 0, 0, Behavior::Release),
        );
        st.txn(&[lock("k", &a)], now).unwrap();
        let before = st.index();
        let set = KvOp {
            value: b"x".to_vec(),
            ..op("set", "other")
        };
        let errs = st.txn(&[set, lock("k", &b)], now).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].0, 1);
        assert!(errs[0].1.contains("lock is already held"), "{errs:?}");
        assert_eq!(st.index(), before, "nothing committed");
        assert!(st.kv_get("other").1.is_none(), "the set was rolled back");
        assert!(!st.kv_apply(lock("k", &b), now).unwrap());
        let err = st.kv_apply(lock("k", "nope"), now).unwrap_err();
        assert!(err.message.contains("invalid session"), "{err:?}");
    }

    #[test]
    fn ttl_invalidation_releases_or_deletes_and_applies_lock_delay() {
        let mut st = store();
        let t0 = Instant::now();
        let rel = session(&mut st, 100, 50, Behavior::Release);
        let del = session(&mut st, 100, 0, Behavior::Delete);
        st.txn(&[lock("r", &rel), lock("d", &del)], t0).unwrap();
        // The TTL is a lower bound: still alive at TTL, gone at TTL x 2.
        assert!(!st.expire_sessions(t0 + Duration::from_millis(150)));
        assert!(st.expire_sessions(t0 + Duration::from_millis(201)));
        assert!(st.session(&rel).is_none() && st.session(&del).is_none());
        let r = st.kv_get("r").1.unwrap();
        assert_eq!(r.session, None);
        assert!(
            st.kv_get("d").1.is_none(),
            "behavior=delete deletes the key"
        );
        let fresh = session(&mut st, 0, 0, Behavior::Release);
        let at = t0 + Duration::from_millis(220);
        let errs = st.txn(&[lock("r", &fresh)], at).unwrap_err();
        assert!(errs[0].1.contains("lock delay"), "{errs:?}");
        assert!(!st.kv_apply(lock("r", &fresh), at).unwrap());
        st.txn(&[lock("r", &fresh)], t0 + Duration::from_millis(260))
            .unwrap();
    }

    #[test]
    fn renew_resets_the_timer_and_unknown_sessions_are_none() {
        let mut st = store();
        let t0 = Instant::now();
        let s = session(&mut st, 100, 0, Behavior::Release);
        assert!(st
            .renew_session(&s, t0 + Duration::from_millis(150))
            .is_some());
        assert!(!st.expire_sessions(t0 + Duration::from_millis(300)));
        assert!(st.expire_sessions(t0 + Duration::from_millis(351)));
        assert!(st.renew_session(&s, t0).is_none());
    }

    #[test]
    fn check_verbs_and_delete_cas() {
        let mut st = store();
        let now = Instant::now();
        let s = session(&mut st, 0, 0, Behavior::Release);
        let r = st.txn(&[lock("k", &s), op("get", "k")], now).unwrap();
        let idx = r[1].modify_index;
        let check_index = |i| KvOp {
            index: i,
            ..op("check-index", "k")
        };
        let check_session = |s: &str| KvOp {
            session: s.into(),
            ..op("check-session", "k")
        };
        st.txn(&[check_index(idx), check_session(&s)], now).unwrap();
        assert!(st.txn(&[check_index(idx + 1)], now).is_err());
        assert!(st.txn(&[check_session("other")], now).is_err());
        assert!(st.txn(&[op("check-not-exists", "k")], now).is_err());
        st.txn(&[op("check-not-exists", "nope")], now).unwrap();
        let del_cas = |i| KvOp {
            index: i,
            ..op("delete-cas", "k")
        };
        assert!(st.txn(&[del_cas(idx + 1)], now).is_err());
        st.txn(&[check_index(idx), del_cas(idx)], now).unwrap();
        assert!(st.kv_get("k").1.is_none());
        assert!(
            st.key_version("k") > idx,
            "the tombstone moves the key's version"
        );
        st.txn(&[del_cas(5)], now).unwrap();
        assert!(st.txn(&[op("get", "k")], now).is_err());
    }

    #[test]
    fn serf_health_failure_invalidates_sessions_with_the_check_only() {
        let mut st = store();
        let now = Instant::now();
        let plain = session(&mut st, 0, 0, Behavior::Release);
        let with_check = st
            .create_session(
                NewSession {
                    name: "default".into(),
                    node: NODE_NAME.into(),
                    node_checks: vec![SERF_HEALTH.into()],
                    service_checks: Vec::new(),
                    lock_delay: Duration::ZERO,
                    behavior: Behavior::Release,
                    ttl_text: String::new(),
                    ttl: None,
                },
                now,
            )
            .unwrap();
        st.fail_serf_health(now);
        assert!(st.session(&with_check).is_none());
        assert!(st.session(&plain).is_some());
    }

    #[test]
    fn durations_parse_and_print_like_go() {
        assert_eq!(parse_go_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_go_duration("0"), Some(Duration::ZERO));
        assert_eq!(parse_go_duration("10"), None);
        assert_eq!(parse_go_duration("x"), None);
        assert_eq!(go_duration(Duration::from_secs(10)), "10s");
        assert_eq!(go_duration(Duration::from_secs(86400)), "24h0m0s");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_millis(250)), "250ms");
    }
}
