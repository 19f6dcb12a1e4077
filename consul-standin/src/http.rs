//! The stand-in's HTTP API: routing, ACL, request decoding, blocking queries and JSON rendering,
//! following Consul's HTTP API documentation (`developer.hashicorp.com/consul/api-docs`), section
//! by section. Semantics live in [`super::state`].

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use super::state::{
    parse_go_duration, ApiError, Behavior, Entry, KvOp, NewSession, Session, Store,
    KV_MAX_VALUE_SIZE, MAX_TXN_OPS, NODE_NAME, SERF_HEALTH,
};

/// Consul's default and maximum blocking-query wait (`wait` parameter).
const DEFAULT_WAIT: Duration = Duration::from_secs(300);
const MAX_WAIT: Duration = Duration::from_secs(600);
/// Consul's `JitterFraction`: up to `wait / 16` is added to a blocking query's wait.
const JITTER_FRACTION: u32 = 16;
/// The largest request body read (a transaction of 64 maximal values would not fit; the stand-in
/// answers 413 like Consul's `txn_max_req_len`).
const MAX_BODY: usize = KV_MAX_VALUE_SIZE + 64 * 1024;

/// Server lifecycle flags shared by the accept loop, connections and request handlers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Control {
    /// Bumped by every kill: connections and handlers of an older generation stop.
    pub(crate) generation: u64,
    /// While true nothing is accepted or answered (sockets stay open), like `SIGSTOP`.
    pub(crate) paused: bool,
}

/// State shared by every task of one stand-in.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) store: Mutex<Store>,
    /// Bumped after every commit; the session timer waits on it.
    pub(crate) changes: watch::Sender<u64>,
    /// One sender per key that a single-key blocking query waits on, fired only when that key
    /// changes (Consul's memdb watch channels), dropped when its last waiter is gone.
    pub(crate) key_watches: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// One sender per prefix that a prefix (`recurse`, `keys`) blocking query waits on, fired
    /// only when a key under it changes (Consul's radix-tree watches on the prefix).
    pub(crate) prefix_watches: Mutex<HashMap<String, watch::Sender<u64>>>,
    pub(crate) control: watch::Sender<Control>,
    pub(crate) acl_token: Option<String>,
    pub(crate) strict_kv_keys: bool,
    pub(crate) jitter: bool,
    /// Requests received (answered or not).
    pub(crate) requests: std::sync::atomic::AtomicU64,
    /// Store reads made by blocking queries (`index` above 0): the first, and one per wake-up.
    pub(crate) blocking_reads: std::sync::atomic::AtomicU64,
    /// Blocking queries (`index` above 0) waiting or being answered right now.
    pub(crate) blocking_now: std::sync::atomic::AtomicU64,
    /// Status and body that replace the answer of the next committed write transaction (once).
    pub(crate) commit_answer: Mutex<Option<(u16, String)>>,
    /// A KV key written (a plain `set`) just before each of the next write transactions that
    /// touch it, and how many more times.
    pub(crate) write_before_txns: Mutex<Option<(String, u32)>>,
    /// A KV key prefix the ACL token may no longer write (`deny_key_writes`).
    pub(crate) denied_writes: Mutex<Option<String>>,
    /// Session renewals answered 500 `No cluster leader` without renewing (`fail_renewals`).
    pub(crate) failing_renewals: std::sync::atomic::AtomicBool,
}

/// The accessor ID named in ACL denials.
const STANDIN_ACCESSOR: &str = "00000000-0000-4000-8000-00000000acce";

impl Shared {
    /// Consul's ACL denial of a write of `key`, when writes under the denied prefix are refused.
    fn write_denied(&self, key: &str) -> Option<String> {
        let denied = self.denied_writes.lock().unwrap_or_else(|p| p.into_inner());
        denied
            .as_deref()
            .filter(|prefix| key.starts_with(prefix))
            .map(|_| {
                format!(
                    "Permission denied: token with AccessorID '{STANDIN_ACCESSOR}' lacks \
                     permission 'key:write' on \"{key}\""
                )
            })
    }

    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_commit_answer(&self) -> Option<(u16, String)> {
        self.commit_answer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Wakes blocking queries after a commit: those on a key that changed or on a prefix of
    /// one, and the session timer.
    pub(crate) fn notify(&self, index: u64) {
        let keys = self.store().take_changed();
        if !keys.is_empty() {
            let watches = self.key_watches.lock().unwrap_or_else(|p| p.into_inner());
            for k in &keys {
                if let Some(tx) = watches.get(k) {
                    tx.send_replace(index);
                }
            }
            drop(watches);
            let prefixes = self
                .prefix_watches
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (prefix, tx) in prefixes.iter() {
                if keys.iter().any(|k| k.starts_with(prefix.as_str())) {
                    tx.send_replace(index);
                }
            }
        }
        self.changes.send_replace(index);
    }

    /// A subscription to changes of `key` alone (`prefix` false) or of any key under it.
    fn watch_key(self: &Arc<Self>, key: &str, prefix: bool) -> KeyWatch {
        let map = if prefix {
            &self.prefix_watches
        } else {
            &self.key_watches
        };
        let rx = map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.to_owned())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        KeyWatch {
            shared: self.clone(),
            key: key.to_owned(),
            prefix,
            rx: Some(rx),
        }
    }

    /// Resolves when the server is not paused; `false` if it was killed meanwhile.
    async fn unpaused(&self, generation: u64) -> bool {
        let mut rx = self.control.subscribe();
        loop {
            let c = *rx.borrow_and_update();
            if c.generation != generation {
                return false;
            }
            if !c.paused {
                return true;
            }
            if rx.changed().await.is_err() {
                return false;
            }
        }
    }
}

/// A blocking query's subscription to its key or prefix; the sender is dropped with its last one.
struct KeyWatch {
    shared: Arc<Shared>,
    key: String,
    prefix: bool,
    rx: Option<watch::Receiver<u64>>,
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        let map = if self.prefix {
            &self.shared.prefix_watches
        } else {
            &self.shared.key_watches
        };
        let mut watches = map.lock().unwrap_or_else(|p| p.into_inner());
        drop(self.rx.take());
        if watches
            .get(&self.key)
            .is_some_and(|tx| tx.receiver_count() == 0)
        {
            watches.remove(&self.key);
        }
    }
}

/// What a blocking query waits on: changes of its key, or of the keys under its prefix.
struct Wakeup(KeyWatch);

impl Wakeup {
    fn rx(&mut self) -> &mut watch::Receiver<u64> {
        self.0.rx.as_mut().expect("held until dropped")
    }
}

type Resp = Response<Full<Bytes>>;

fn text(status: u16, body: impl Into<String>) -> Resp {
    let mut r = Response::new(Full::new(Bytes::from(body.into())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn json_resp(status: u16, body: &Value) -> Resp {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    r.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

/// Adds the query-metadata headers Consul sets on reads.
fn with_meta(mut r: Resp, index: Option<u64>) -> Resp {
    let h = r.headers_mut();
    if let Some(i) = index {
        h.insert("x-consul-index", i.into());
    }
    h.insert(
        "x-consul-knownleader",
        hyper::header::HeaderValue::from_static("true"),
    );
    h.insert(
        "x-consul-lastcontact",
        hyper::header::HeaderValue::from_static("0"),
    );
    r
}

fn api_error(e: ApiError) -> Resp {
    text(e.status, e.message)
}

/// The query string as Go's `url.Values`: repeated keys keep the first value, a bare `flag`
/// is present with an empty value.
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(q: Option<&str>) -> Self {
        Query(
            url::form_urlencoded::parse(q.unwrap_or("").as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    fn has(&self, k: &str) -> bool {
        self.0.iter().any(|(n, _)| n == k)
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }

    fn u64(&self, k: &str) -> Result<Option<u64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                ApiError::new(
                    400,
                    format!("strconv.ParseUint: parsing {v:?}: invalid syntax"),
                )
            }),
        }
    }
}

/// Serves one request. `generation` is the server generation the connection belongs to.
pub(crate) async fn handle(
    shared: Arc<Shared>,
    generation: u64,
    req: Request<Incoming>,
) -> Result<Resp, Infallible> {
    shared
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if !shared.unpaused(generation).await {
        return Ok(text(503, "server stopped"));
    }
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = Query::parse(req.uri().query());
    let token = req
        .headers()
        .get("x-consul-token")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| {
            req.headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .map(str::to_owned)
        })
        .or_else(|| query.get("token").map(str::to_owned));
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Ok(text(
                413,
                format!("Request body too large, max size: {MAX_BODY} bytes"),
            ))
        }
    };
    let resp = route(&shared, generation, &method, &path, &query, token, body).await;
    // A server paused while the answer was being prepared sends it only once resumed.
    if !shared.unpaused(generation).await {
        return Ok(text(503, "server stopped"));
    }
    Ok(resp)
}

async fn route(
    shared: &Arc<Shared>,
    generation: u64,
    method: &Method,
    path: &str,
    query: &Query,
    token: Option<String>,
    body: Bytes,
) -> Resp {
    if path == "/v1/status/leader" {
        return json_resp(200, &json!("127.0.0.1:8300"));
    }
    if let Some(dc) = query.get("dc") {
        if !dc.is_empty() && dc != "dc1" {
            return text(500, "No path to datacenter");
        }
    }
    let api = path.starts_with("/v1/kv/")
        || path == "/v1/kv"
        || path == "/v1/txn"
        || path.starts_with("/v1/session/");
    if !api {
        return text(404, "404 page not found");
    }
    if let Some(expected) = &shared.acl_token {
        match token.as_deref() {
            None | Some("") => return text(403, "Permission denied"),
            Some(t) if t != expected => return text(403, "ACL not found"),
            Some(_) => {}
        }
    }
    if let Some(raw) = path.strip_prefix("/v1/kv/") {
        let key = match percent_encoding::percent_decode_str(raw).decode_utf8() {
            Ok(k) => k.into_owned(),
            Err(_) => return text(400, "invalid key encoding"),
        };
        return kv_endpoint(shared, generation, method, raw, &key, query, body).await;
    }
    if path == "/v1/txn" {
        return if method == Method::PUT {
            txn(shared, &body)
        } else {
            method_not_allowed(method, &["PUT"])
        };
    }
    let session_route = |prefix: &str| path.strip_prefix(prefix).map(str::to_owned);
    if path == "/v1/session/create" {
        return if method == Method::PUT {
            session_create(shared, &body)
        } else {
            method_not_allowed(method, &["PUT"])
        };
    }
    if let Some(id) = session_route("/v1/session/renew/") {
        return if method == Method::PUT {
            session_renew(shared, &id)
        } else {
            method_not_allowed(method, &["PUT"])
        };
    }
    if let Some(id) = session_route("/v1/session/destroy/") {
        return if method == Method::PUT {
            session_destroy(shared, &id)
        } else {
            method_not_allowed(method, &["PUT"])
        };
    }
    if let Some(id) = session_route("/v1/session/info/") {
        return if method == Method::GET {
            session_info(shared, &id)
        } else {
            method_not_allowed(method, &["GET"])
        };
    }
    if path == "/v1/session/list" {
        return if method == Method::GET {
            session_list(shared)
        } else {
            method_not_allowed(method, &["GET"])
        };
    }
    text(404, "404 page not found")
}

fn method_not_allowed(method: &Method, allowed: &[&str]) -> Resp {
    let mut r = text(405, format!("method {method} not allowed"));
    if let Ok(v) = allowed.join(",").parse() {
        r.headers_mut().insert("allow", v);
    }
    r
}

// -------------------------------------------------------------------------------- KV

/// The key rules of current Consul releases (`validateKVKey` in `agent/kvs_endpoint.go`): only
/// `[A-Za-z0-9,-_./]`, no leading `/`, no `../`, and no file extension that a cache could act on.
fn validate_kv_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("key cannot be empty".into());
    }
    if key.starts_with('/') {
        return Err("key must not begin with a '/'".into());
    }
    if let Some((i, c)) = key
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_alphanumeric() || ",-_./".contains(*c)))
    {
        return Err(format!(
            "key contains invalid character '{c}' at position {i}. Only alphanumeric characters and ,-_./ are allowed"
        ));
    }
    if key.contains("../") {
        return Err("key contains path traversal sequence".into());
    }
    const SUSPICIOUS: &[&str] = &[
        ".js", ".css", ".html", ".htm", ".xml", ".json", ".txt", ".log", ".php", ".asp", ".jsp",
        ".cgi", ".pl", ".py", ".rb", ".sh", ".exe", ".dll", ".bat", ".cmd", ".com", ".scr", ".vbs",
        ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".zip", ".rar", ".tar", ".gz",
        ".7z", ".bz2", ".jpg", ".jpeg", ".png", ".gif", ".svg", ".ico", ".bmp", ".mp3", ".mp4",
        ".avi", ".mov", ".wmv", ".flv", ".swf", ".woff", ".woff2", ".ttf", ".eot", ".otf",
    ];
    let lower = key.to_ascii_lowercase();
    if let Some(ext) = SUSPICIOUS.iter().find(|e| lower.ends_with(*e)) {
        return Err(format!(
            "key contains suspicious file extension '{ext}' that may be cached by proxies"
        ));
    }
    Ok(())
}

pub(crate) fn entry_json(e: &Entry) -> Value {
    let mut m = Map::new();
    m.insert("LockIndex".into(), e.lock_index.into());
    m.insert("Key".into(), e.key.clone().into());
    m.insert("Flags".into(), e.flags.into());
    m.insert(
        "Value".into(),
        if e.value.is_empty() {
            Value::Null
        } else {
            base64::engine::general_purpose::STANDARD
                .encode(&e.value)
                .into()
        },
    );
    if let Some(s) = &e.session {
        m.insert("Session".into(), s.clone().into());
    }
    m.insert("CreateIndex".into(), e.create_index.into());
    m.insert("ModifyIndex".into(), e.modify_index.into());
    Value::Object(m)
}

/// `/v1/kv/:key` — "KV Store HTTP API": read key (`GET`, with `recurse`, `keys`, `separator`,
/// `raw`, blocking `index`/`wait`, `consistent`/`stale`), create/update key (`PUT`, with `flags`,
/// `cas`, `acquire`, `release`), delete key (`DELETE`, with `recurse`, `cas`).
async fn kv_endpoint(
    shared: &Arc<Shared>,
    generation: u64,
    method: &Method,
    raw_path: &str,
    key: &str,
    query: &Query,
    body: Bytes,
) -> Resp {
    if raw_path.contains("../") || raw_path.to_ascii_lowercase().contains("%2e%2e%2f") {
        return text(400, "URL path contains invalid traversal sequence");
    }
    if shared.strict_kv_keys && !key.is_empty() {
        if let Err(e) = validate_kv_key(key) {
            return text(400, e);
        }
    }
    match *method {
        Method::GET => kv_get(shared, generation, key, query).await,
        Method::PUT => kv_put(shared, key, query, body),
        Method::DELETE => kv_delete(shared, key, query),
        _ => method_not_allowed(method, &["GET", "PUT", "DELETE"]),
    }
}

/// The blocking-query parameters: `index` (0: answer at once) and `wait` (default 5 min, at most
/// 10 min, plus up to `wait / 16` of jitter).
fn blocking(shared: &Shared, query: &Query) -> Result<(u64, Instant), ApiError> {
    let index = query.u64("index")?.unwrap_or(0);
    let mut wait = match query.get("wait") {
        None => DEFAULT_WAIT,
        Some(w) => parse_go_duration(w)
            .ok_or_else(|| ApiError::new(400, format!("Invalid wait time {w:?}")))?,
    };
    if wait.is_zero() {
        wait = DEFAULT_WAIT;
    }
    wait = wait.min(MAX_WAIT);
    if shared.jitter {
        let max_jitter = (wait / JITTER_FRACTION).as_millis() as u64;
        if max_jitter > 0 {
            wait += Duration::from_millis(rand::random::<u64>() % max_jitter);
        }
    }
    Ok((index, Instant::now() + wait))
}

enum KvRead {
    One(Option<Entry>),
    List(Vec<Entry>),
    Keys(Vec<String>),
}

async fn kv_get(shared: &Arc<Shared>, generation: u64, key: &str, query: &Query) -> Resp {
    let recurse = query.has("recurse");
    let keys = query.has("keys");
    if key.is_empty() && !recurse && !keys {
        return text(400, "Missing key name");
    }
    let (min_index, deadline) = match blocking(shared, query) {
        Ok(b) => b,
        Err(e) => return api_error(e),
    };
    let separator = query
        .get("separator")
        .or_else(|| query.get("seperator"))
        .unwrap_or("")
        .to_owned();
    // Subscribed before the first read: a change committed after it wakes the query.
    let mut wakeup = Wakeup(shared.watch_key(key, keys || recurse));
    let mut control = shared.control.subscribe();
    let _in_progress = (min_index > 0).then(|| InProgress::new(shared));
    let mut watched: Option<u64> = None;
    loop {
        wakeup.rx().borrow_and_update();
        if min_index > 0 {
            shared
                .blocking_reads
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // The watched version first: the (possibly large) answer is built only when it is sent.
        let (read, expired) = {
            let mut st = shared.store();
            let expired = st.expire_sessions(Instant::now()).then(|| st.index());
            let (index, version) = if keys || recurse {
                (st.kv_list_index(key), st.prefix_version(key))
            } else {
                (st.kv_get(key).0, st.key_version(key))
            };
            let done = match watched {
                None => min_index == 0 || index > min_index,
                Some(v) => v != version,
            };
            watched.get_or_insert(version);
            let read = (done || Instant::now() >= deadline).then(|| {
                if keys {
                    let (i, k) = st.kv_keys(key, &separator);
                    (i, KvRead::Keys(k))
                } else if recurse {
                    let (i, l) = st.kv_list(key);
                    (i, KvRead::List(l))
                } else {
                    let (i, e) = st.kv_get(key);
                    (i, KvRead::One(e))
                }
            });
            (read, expired)
        };
        if let Some(i) = expired {
            shared.notify(i);
        }
        if let Some((index, read)) = read {
            return render_read(index, read, query);
        }
        tokio::select! {
            _ = wakeup.rx().changed() => {}
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)) => {}
            _ = control.wait_for(|c| c.generation != generation) => {
                return text(503, "server stopped");
            }
        }
    }
}

/// Counts a blocking query in [`Shared::blocking_now`] while it lives.
struct InProgress(Arc<Shared>);

impl InProgress {
    fn new(shared: &Arc<Shared>) -> Self {
        shared
            .blocking_now
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InProgress(shared.clone())
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0
            .blocking_now
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn render_read(index: u64, read: KvRead, query: &Query) -> Resp {
    match read {
        KvRead::One(None) => with_meta(text(404, ""), Some(index)),
        KvRead::List(l) if l.is_empty() => with_meta(text(404, ""), Some(index)),
        KvRead::Keys(k) if k.is_empty() => with_meta(text(404, ""), Some(index)),
        KvRead::One(Some(e)) if query.has("raw") => {
            let mut r = Response::new(Full::new(Bytes::from(e.value)));
            r.headers_mut().insert(
                "content-type",
                hyper::header::HeaderValue::from_static("text/plain"),
            );
            with_meta(r, Some(index))
        }
        KvRead::One(Some(e)) => with_meta(json_resp(200, &json!([entry_json(&e)])), Some(index)),
        KvRead::List(l) => with_meta(
            json_resp(200, &Value::Array(l.iter().map(entry_json).collect())),
            Some(index),
        ),
        KvRead::Keys(k) => with_meta(json_resp(200, &json!(k)), Some(index)),
    }
}

fn conflicting(query: &Query, flags: &[&str]) -> bool {
    flags.iter().filter(|f| query.has(f)).count() > 1
}

fn kv_put(shared: &Shared, key: &str, query: &Query, body: Bytes) -> Resp {
    if key.is_empty() {
        return text(400, "Missing key name");
    }
    if let Some(denied) = shared.write_denied(key) {
        return text(403, denied);
    }
    if conflicting(query, &["cas", "acquire", "release"]) {
        return text(400, "Conflicting flags");
    }
    if body.len() > KV_MAX_VALUE_SIZE {
        return text(
            413,
            format!(
                "Request body({} bytes) too large, max size: {KV_MAX_VALUE_SIZE} bytes",
                body.len()
            ),
        );
    }
    let mut op = KvOp {
        verb: "set".into(),
        key: key.to_owned(),
        value: body.to_vec(),
        ..KvOp::default()
    };
    match (query.u64("flags"), query.u64("cas")) {
        (Ok(f), Ok(c)) => {
            op.flags = f.unwrap_or(0);
            if let Some(c) = c {
                op.verb = "cas".into();
                op.index = c;
            }
        }
        (Err(e), _) | (_, Err(e)) => return api_error(e),
    }
    if let Some(s) = query.get("acquire") {
        op.verb = "lock".into();
        op.session = s.to_owned();
    }
    if let Some(s) = query.get("release") {
        op.verb = "unlock".into();
        op.session = s.to_owned();
    }
    let plain_set = op.verb == "set";
    let result = {
        let mut st = shared.store();
        let now = Instant::now();
        let expired = st.expire_sessions(now);
        let r = st.kv_apply(op, now);
        (r, st.index(), expired)
    };
    match result {
        (Ok(ok), index, _) => {
            shared.notify(index);
            json_resp(200, &json!(plain_set || ok))
        }
        (Err(e), index, expired) => {
            if expired {
                shared.notify(index);
            }
            api_error(e)
        }
    }
}

fn kv_delete(shared: &Shared, key: &str, query: &Query) -> Resp {
    if conflicting(query, &["recurse", "cas"]) {
        return text(400, "Conflicting flags");
    }
    if let Some(denied) = shared.write_denied(key) {
        return text(403, denied);
    }
    let mut op = KvOp {
        verb: "delete".into(),
        key: key.to_owned(),
        ..KvOp::default()
    };
    if query.has("recurse") {
        op.verb = "delete-tree".into();
    } else if key.is_empty() {
        return text(400, "Missing key name");
    }
    match query.u64("cas") {
        Ok(Some(c)) => {
            op.verb = "delete-cas".into();
            op.index = c;
        }
        Ok(None) => {}
        Err(e) => return api_error(e),
    }
    let cas = op.verb == "delete-cas";
    let result = {
        let mut st = shared.store();
        let now = Instant::now();
        let expired = st.expire_sessions(now);
        let r = st.kv_apply(op, now);
        (r, st.index(), expired)
    };
    match result {
        (Ok(ok), index, _) => {
            shared.notify(index);
            json_resp(200, &json!(!cas || ok))
        }
        (Err(e), index, expired) => {
            if expired {
                shared.notify(index);
            }
            api_error(e)
        }
    }
}

// -------------------------------------------------------------------------------- txn

/// A JSON object member looked up case-insensitively, as Go's decoder does.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

fn decode_kv_op(v: &Value) -> Result<KvOp, String> {
    let obj = v.as_object().ok_or("operation is not an object")?;
    let kv = match field(obj, "KV") {
        Some(Value::Object(kv)) => kv,
        _ => {
            return Err(
                "the Consul stand-in implements KV operations only (no Node, Service, Check or Session operations)"
                    .into(),
            )
        }
    };
    let s = |name: &str| -> Result<String, String> {
        match field(kv, name) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(format!("{name}: expected a string, got {other}")),
        }
    };
    let n = |name: &str| -> Result<u64, String> {
        match field(kv, name) {
            None | Some(Value::Null) => Ok(0),
            Some(v) => v
                .as_u64()
                .ok_or_else(|| format!("{name}: expected an unsigned integer, got {v}")),
        }
    };
    let value = match field(kv, "Value") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(b64)) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("failed to decode value: {e}"))?,
        Some(other) => return Err(format!("unexpected value type: {other}")),
    };
    Ok(KvOp {
        verb: s("Verb")?,
        key: s("Key")?,
        value,
        flags: n("Flags")?,
        index: n("Index")?,
        session: s("Session")?,
    })
}

/// Whether a transaction operation only reads (Consul's `isWrite`: a transaction of these
/// alone is served as a read).
fn is_read(op: &KvOp) -> bool {
    needs_read_only(op) || op.verb == "check-not-exists"
}

/// Whether the ACL token needs only `key:read` for a transaction operation (Consul's
/// `kvsPreApply`): every other verb, `check-not-exists` included, needs `key:write`.
fn needs_read_only(op: &KvOp) -> bool {
    matches!(
        op.verb.as_str(),
        "get" | "get-tree" | "check-session" | "check-index"
    )
}

/// `/v1/txn` — "Transaction HTTP API", create transaction: the KV verbs `set`, `cas`, `lock`,
/// `unlock`, `get`, `get-tree`, `check-session`, `check-index`, `check-not-exists`, `delete`,
/// `delete-tree`, `delete-cas`. 200 with `Results`, or 409 with `Errors` (`OpIndex`, `What`) and
/// nothing applied.
fn txn(shared: &Shared, body: &[u8]) -> Resp {
    let parsed: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => return text(400, format!("Failed to parse body: {e}")),
    };
    let Some(list) = parsed.as_array() else {
        return text(400, "Failed to parse body: expected an array of operations");
    };
    if list.len() > MAX_TXN_OPS {
        return text(
            413,
            format!(
                "Transaction contains too many operations ({} > {MAX_TXN_OPS})",
                list.len()
            ),
        );
    }
    let mut ops = Vec::with_capacity(list.len());
    for v in list {
        match decode_kv_op(v) {
            Ok(op) if op.value.len() > KV_MAX_VALUE_SIZE => {
                return text(413, format!("Value for key {:?} is too large", op.key))
            }
            Ok(op) => ops.push(op),
            Err(e) => return text(400, format!("Failed to parse body: {e}")),
        }
    }
    let read_only = ops.iter().all(is_read);
    // A write the ACL token may not make: Consul's `preCheck` puts each denial in the
    // transaction's errors, answered 409 like any rolled-back transaction (not 403).
    let denied: Vec<Value> = ops
        .iter()
        .enumerate()
        .filter(|(_, op)| !needs_read_only(op))
        .filter_map(|(i, op)| shared.write_denied(&op.key).map(|what| (i, what)))
        .map(|(i, what)| json!({ "OpIndex": i, "What": what }))
        .collect();
    if !denied.is_empty() {
        return json_resp(409, &json!({ "Results": null, "Errors": denied }));
    }
    let (result, index, changed) = {
        let mut st = shared.store();
        let now = Instant::now();
        // Whether something was committed even if the transaction is refused: expired
        // sessions, an outside write.
        let mut changed = st.expire_sessions(now);
        if !read_only {
            // An outside write that lands just before this transaction (`write_before_txns`).
            let mut writes = shared
                .write_before_txns
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some((key, left)) = writes.as_mut() {
                if *left > 0 && ops.iter().any(|op| op.key == *key) {
                    *left -= 1;
                    let outside = KvOp {
                        verb: "set".into(),
                        key: key.clone(),
                        // A new value each time: a write of the same content changes nothing.
                        value: format!("outside {left}").into_bytes(),
                        ..KvOp::default()
                    };
                    changed |= matches!(st.kv_apply(outside, now), Ok(true));
                }
            }
        }
        let r = st.txn(&ops, now);
        (r, st.index(), changed)
    };
    if changed && (read_only || result.is_err()) {
        shared.notify(index);
    }
    if result.is_ok() && !read_only {
        if let Some((status, body)) = shared.take_commit_answer() {
            // Committed, but the client hears something else (see `answer_next_commit`).
            shared.notify(index);
            return text(status, body);
        }
    }
    let resp = match result {
        Ok(entries) => {
            if !read_only {
                shared.notify(index);
            }
            let results: Vec<Value> = entries
                .iter()
                .map(|e| json!({ "KV": entry_json(e) }))
                .collect();
            json_resp(200, &json!({ "Results": results, "Errors": null }))
        }
        Err(errors) => {
            let errors: Vec<Value> = errors
                .into_iter()
                .map(|(i, what)| json!({ "OpIndex": i, "What": what }))
                .collect();
            json_resp(409, &json!({ "Results": null, "Errors": errors }))
        }
    };
    if read_only {
        with_meta(resp, None)
    } else {
        resp
    }
}

// -------------------------------------------------------------------------------- sessions

fn session_json(s: &Session) -> Value {
    let checks = if s.node_checks.is_empty() {
        Value::Null
    } else {
        json!(s.node_checks)
    };
    json!({
        "ID": s.id,
        "Name": s.name,
        "Node": s.node,
        "LockDelay": s.lock_delay.as_nanos() as u64,
        "Behavior": s.behavior.as_str(),
        "TTL": s.ttl_text,
        "NodeChecks": checks,
        "ServiceChecks": if s.service_checks.is_empty() { Value::Null } else { json!(s.service_checks) },
        "CreateIndex": s.create_index,
        "ModifyIndex": s.modify_index,
    })
}

/// Consul's `FixupLockDelay`: a string is a Go duration, a number is nanoseconds; either below
/// 1000 ns is taken as seconds.
fn lock_delay(v: &Value) -> Result<Duration, String> {
    let d = match v {
        Value::String(s) => {
            parse_go_duration(s).ok_or_else(|| format!("time: invalid duration {s:?}"))?
        }
        Value::Number(n) => Duration::from_nanos(n.as_f64().unwrap_or(0.0).max(0.0) as u64),
        Value::Null => return Ok(Duration::from_secs(15)),
        other => return Err(format!("invalid LockDelay {other}")),
    };
    Ok(if d < Duration::from_nanos(1000) {
        Duration::from_secs(d.as_nanos() as u64)
    } else {
        d
    })
}

fn string_list(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| format!("expected a check ID string, got {x}"))
            })
            .collect(),
        other => Err(format!("expected a list of check IDs, got {other}")),
    }
}

fn decode_session(body: &[u8]) -> Result<NewSession, String> {
    let mut new = NewSession {
        name: String::new(),
        node: NODE_NAME.into(),
        node_checks: vec![SERF_HEALTH.into()],
        service_checks: Vec::new(),
        lock_delay: Duration::from_secs(15),
        behavior: Behavior::Release,
        ttl_text: String::new(),
        ttl: None,
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(new);
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let obj = v.as_object().ok_or("expected a JSON object")?;
    if let Some(Value::String(n)) = field(obj, "Name") {
        new.name = n.clone();
    }
    if let Some(Value::String(n)) = field(obj, "Node") {
        if !n.is_empty() {
            new.node = n.clone();
        }
    }
    // Giving `Checks` or `NodeChecks` (even empty) replaces the default serfHealth check.
    let checks = field(obj, "Checks").map(string_list).transpose()?;
    let node_checks = field(obj, "NodeChecks").map(string_list).transpose()?;
    if checks.is_some() || node_checks.is_some() {
        let mut all = checks.unwrap_or_default();
        for c in node_checks.unwrap_or_default() {
            if !all.contains(&c) {
                all.push(c);
            }
        }
        new.node_checks = all;
    }
    if let Some(v) = field(obj, "ServiceChecks") {
        new.service_checks = match v {
            Value::Null => Vec::new(),
            Value::Array(a) => a
                .iter()
                .map(|x| match x {
                    Value::String(s) => s.clone(),
                    Value::Object(o) => field(o, "ID")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                    other => other.to_string(),
                })
                .collect(),
            other => return Err(format!("expected a list of service checks, got {other}")),
        };
    }
    if let Some(v) = field(obj, "LockDelay") {
        new.lock_delay = lock_delay(v)?;
    }
    if let Some(v) = field(obj, "Behavior") {
        new.behavior = match v.as_str().unwrap_or("") {
            "" | "release" => Behavior::Release,
            "delete" => Behavior::Delete,
            other => return Err(format!("Invalid Behavior setting '{other}'")),
        };
    }
    if let Some(v) = field(obj, "TTL") {
        let t = v.as_str().unwrap_or("").to_owned();
        if !t.is_empty() {
            let d = parse_go_duration(&t)
                .ok_or_else(|| format!("Session TTL '{t}' invalid: time: invalid duration"))?;
            new.ttl = (!d.is_zero()).then_some(d);
        }
        new.ttl_text = t;
    }
    Ok(new)
}

/// `PUT /v1/session/create` — "Session HTTP API", create session: `Name`, `Node`, `Checks`,
/// `NodeChecks`, `ServiceChecks` (an empty list means no checks; absent means `serfHealth`),
/// `LockDelay` (default 15 s, at most 60 s), `Behavior` (`release` or `delete`), `TTL` (between
/// the server's `session_ttl_min` and 24 h, or none). Answers `{"ID": ...}`.
fn session_create(shared: &Shared, body: &[u8]) -> Resp {
    let new = match decode_session(body) {
        Ok(n) => n,
        Err(e) if e.starts_with("Invalid Behavior") || e.starts_with("Session TTL") => {
            return text(500, e)
        }
        Err(e) => return text(400, format!("Request decode failed: {e}")),
    };
    let (r, index) = {
        let mut st = shared.store();
        let r = st.create_session(new, Instant::now());
        (r, st.index())
    };
    match r {
        Ok(id) => {
            shared.notify(index);
            json_resp(200, &json!({ "ID": id }))
        }
        Err(e) => api_error(e),
    }
}

/// `PUT /v1/session/renew/:uuid` — "Session HTTP API", renew session: restarts the TTL timer and
/// answers the session in a list; 404 `Session id '...' not found` once it is invalidated.
fn session_renew(shared: &Shared, id: &str) -> Resp {
    if id.is_empty() {
        return text(400, "Missing session");
    }
    if shared
        .failing_renewals
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        // What a Consul agent answers while the servers have no leader.
        return text(500, "No cluster leader");
    }
    let (renewed, expired, index) = {
        let mut st = shared.store();
        let now = Instant::now();
        let expired = st.expire_sessions(now);
        (st.renew_session(id, now), expired, st.index())
    };
    if expired {
        shared.notify(index);
    }
    match renewed {
        Some(s) => json_resp(200, &json!([session_json(&s)])),
        None => text(404, format!("Session id '{id}' not found")),
    }
}

/// `PUT /v1/session/destroy/:uuid` — "Session HTTP API", delete session: invalidates it (its
/// locks are released or deleted per its behavior, with its lock-delay) and answers `true`.
fn session_destroy(shared: &Shared, id: &str) -> Resp {
    if id.is_empty() {
        return text(400, "Missing session");
    }
    let index = {
        let mut st = shared.store();
        let now = Instant::now();
        st.expire_sessions(now);
        st.destroy_session(id, now);
        st.index()
    };
    shared.notify(index);
    json_resp(200, &json!(true))
}

/// `GET /v1/session/info/:uuid` — "Session HTTP API", read session: a list with the session, or
/// an empty list once it is gone.
fn session_info(shared: &Shared, id: &str) -> Resp {
    if id.is_empty() {
        return text(400, "Missing session");
    }
    let (s, index, expired) = {
        let mut st = shared.store();
        let expired = st.expire_sessions(Instant::now());
        (st.session(id), st.index(), expired)
    };
    if expired {
        shared.notify(index);
    }
    let list: Vec<Value> = s.iter().map(session_json).collect();
    with_meta(json_resp(200, &Value::Array(list)), Some(index))
}

/// `GET /v1/session/list` — "Session HTTP API", list sessions.
fn session_list(shared: &Shared) -> Resp {
    let (all, index, expired) = {
        let mut st = shared.store();
        let expired = st.expire_sessions(Instant::now());
        (st.sessions(), st.index(), expired)
    };
    if expired {
        shared.notify(index);
    }
    let list: Vec<Value> = all.iter().map(session_json).collect();
    with_meta(json_resp(200, &Value::Array(list)), Some(index))
}
