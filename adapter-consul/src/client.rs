//! The adapter's HTTP client: a small typed layer over hyper 1 (the `hyper-util` pooled client and
//! `hyper-rustls`, the stack `rs-consul` uses) for exactly the Consul endpoints the adapter needs.
//! See `docs/decisions/0009-consul-http-client.md` for why it does not use `rs-consul`.
//!
//! Every request is bounded ([`crate::ConsulConfig::request_timeout`], plus the wait of a
//! blocking query). The ACL token travels only in the `X-Consul-Token` header, marked sensitive.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::HeaderValue;
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use lease_core::adapter::{resend, Backoff, Op, SendAgain};
use lease_core::{Error, Result};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};

use crate::config::ConsulConfig;
use crate::error::{self, Transport};
use crate::BACKEND;

/// The largest answer body read.
const MAX_ANSWER: usize = 8 * 1024 * 1024;

/// The largest answer of a prefix listing (the lock monitor's `?recurse`): about 250,000 lock
/// keys of this adapter.
const MAX_LIST_ANSWER: usize = 64 * 1024 * 1024;

/// Which connection pool a request uses. Each lane has its own pool, so a request of one lane
/// never waits for (or competes for connections with) another lane's: long polls cannot starve
/// session renewals or ownership checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Acquires, releases, reads and batched ownership checks.
    Ordinary,
    /// Session create, renew and destroy: the session is what every lease stands on.
    Session,
    /// Blocking queries (`?index=&wait=`), which hold a connection for up to their wait.
    LongPoll,
}

/// Characters kept as they are in a KV path (everything else is percent-encoded).
const PATH: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b'/')
    .remove(b',');

/// A KV entry as Consul returns it (`GET /v1/kv/:key`, transaction results).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub(crate) struct KvEntry {
    /// The index of the write that created the key (an outside write does not change it).
    #[serde(default)]
    pub(crate) create_index: u64,
    #[serde(default)]
    pub(crate) modify_index: u64,
    #[serde(default)]
    pub(crate) lock_index: u64,
    pub(crate) key: String,
    #[serde(default)]
    pub(crate) value: Option<String>,
    #[serde(default)]
    pub(crate) session: Option<String>,
}

impl KvEntry {
    /// The decoded value (empty when absent or not base64).
    pub(crate) fn value_bytes(&self) -> Vec<u8> {
        self.value
            .as_deref()
            .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok())
            .unwrap_or_default()
    }

    /// The session holding the lock, if any (Consul omits the field or sends it empty).
    pub(crate) fn holder(&self) -> Option<&str> {
        self.session.as_deref().filter(|s| !s.is_empty())
    }
}

/// One KV operation of a transaction (`{"KV": {...}}` in `PUT /v1/txn`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TxnOp {
    #[serde(rename = "KV")]
    kv: TxnKv,
}

#[derive(Debug, Clone, Serialize)]
struct TxnKv {
    #[serde(rename = "Verb")]
    verb: &'static str,
    #[serde(rename = "Key")]
    key: String,
    #[serde(rename = "Value", skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    #[serde(rename = "Index", skip_serializing_if = "is_zero")]
    index: u64,
    #[serde(rename = "Session", skip_serializing_if = "String::is_empty")]
    session: String,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl TxnOp {
    fn new(verb: &'static str, key: &str) -> Self {
        TxnOp {
            kv: TxnKv {
                verb,
                key: key.to_owned(),
                value: None,
                index: 0,
                session: String::new(),
            },
        }
    }

    /// `lock`: take `key` for `session`, writing `value`.
    pub(crate) fn lock(key: &str, session: &str, value: &[u8]) -> Self {
        let mut op = Self::new("lock", key);
        op.kv.session = session.to_owned();
        op.kv.value = Some(base64::engine::general_purpose::STANDARD.encode(value));
        op
    }

    /// `get`: read `key` (fails the transaction if it does not exist).
    pub(crate) fn get(key: &str) -> Self {
        Self::new("get", key)
    }

    /// `set`: write `value` unconditionally.
    pub(crate) fn set(key: &str, value: &[u8]) -> Self {
        let mut op = Self::new("set", key);
        op.kv.value = Some(base64::engine::general_purpose::STANDARD.encode(value));
        op
    }

    /// `check-index`: fail unless `key` exists with this `ModifyIndex`.
    pub(crate) fn check_index(key: &str, index: u64) -> Self {
        let mut op = Self::new("check-index", key);
        op.kv.index = index;
        op
    }

    /// `check-session`: fail unless `key` is locked by `session`.
    pub(crate) fn check_session(key: &str, session: &str) -> Self {
        let mut op = Self::new("check-session", key);
        op.kv.session = session.to_owned();
        op
    }

    /// `check-not-exists`: fail if `key` exists.
    pub(crate) fn check_not_exists(key: &str) -> Self {
        Self::new("check-not-exists", key)
    }

    /// `delete`: remove `key` (no-op if absent).
    pub(crate) fn delete(key: &str) -> Self {
        Self::new("delete", key)
    }
}

/// What a transaction did.
#[derive(Debug)]
pub(crate) enum TxnOutcome {
    /// Applied; the KV results in operation order (only operations that return an entry).
    Committed(Vec<KvEntry>),
    /// Rolled back (HTTP 409): nothing applied; Consul's reasons, one per failed operation.
    RolledBack(Vec<String>),
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct TxnAnswer {
    #[serde(default)]
    results: Option<Vec<TxnResult>>,
    #[serde(default)]
    errors: Option<Vec<TxnErrorAnswer>>,
}

#[derive(Deserialize)]
struct TxnResult {
    #[serde(rename = "KV", default)]
    kv: Option<KvEntry>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct TxnErrorAnswer {
    #[serde(default)]
    op_index: Option<usize>,
    #[serde(default)]
    what: String,
}

/// What a read-only transaction found.
#[derive(Debug)]
pub(crate) enum TxnRead {
    /// Every operation passed (HTTP 200).
    Passed,
    /// At least one operation failed (HTTP 409); Consul's errors: the failed operation's index
    /// (`OpIndex`, when given) and reason.
    Failed(Vec<(Option<usize>, String)>),
}

/// An HTTP answer.
struct Answer {
    status: u16,
    index: Option<u64>,
    body: Bytes,
}

/// One pooled HTTP client, whatever its connector: the adapter's own (hyper-rustls over
/// hyper-util's TCP connector) or the application's ([`crate::ConsulCoordinator::from_client`]).
trait Pool: Send + Sync {
    fn request(&self, req: Request<Full<Bytes>>) -> ResponseFuture;
}

impl<C: Connect + Clone + Send + Sync + 'static> Pool for Client<C, Full<Bytes>> {
    fn request(&self, req: Request<Full<Bytes>>) -> ResponseFuture {
        Client::request(self, req)
    }
}

/// The pooled HTTP(S) client of one coordinator.
pub(crate) struct Http {
    /// The pool of each [`Lane`], in its order (one pool for all three when the application's
    /// client is used).
    clients: [Arc<dyn Pool>; 3],
    base: String,
    token: Option<HeaderValue>,
    datacenter: Option<String>,
    request_timeout: Duration,
}

impl fmt::Debug for Http {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Http")
            .field("base", &self.base)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .finish_non_exhaustive()
    }
}

/// Adds every PEM certificate in `pem` (read from `what`) to `roots`; how many were added.
fn add_pem_certs(roots: &mut rustls::RootCertStore, pem: &[u8], what: &str) -> Result<usize> {
    use rustls::pki_types::pem::PemObject as _;
    let mut added = 0;
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
        added += 1;
    }
    Ok(added)
}

/// The trust anchors: the CA file, else every PEM file in the CA directory, else the system's.
fn root_store(config: &ConsulConfig) -> Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    if let Some(path) = config.tls_ca_file() {
        let what = format!("tls_ca_file {}", path.display());
        let pem = std::fs::read(path)
            .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
        if add_pem_certs(&mut roots, &pem, &what)? == 0 {
            return Err(Error::misconfigured(
                BACKEND,
                format!("{what}: no PEM certificate in it"),
            ));
        }
    } else if let Some(dir) = config.tls_ca_path() {
        let what = format!("tls_ca_path {}", dir.display());
        let entries = std::fs::read_dir(dir)
            .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
        let mut files: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for file in files {
            let what = format!("tls_ca_path file {}", file.display());
            let pem = std::fs::read(&file)
                .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
            add_pem_certs(&mut roots, &pem, &what)?;
        }
        if roots.is_empty() {
            return Err(Error::misconfigured(
                BACKEND,
                format!("{what}: no PEM certificate in it"),
            ));
        }
    } else {
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        if roots.is_empty() {
            return Err(Error::misconfigured(
                BACKEND,
                "no CA certificate to check the Consul server against (set tls_ca_file or \
                 CONSUL_CACERT)",
            ));
        }
    }
    Ok(roots)
}

/// The client certificate chain and key for mTLS. Errors name the files, never the key's bytes.
fn client_identity(
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
) -> Result<(
    Vec<rustls::pki_types::CertificateDer<'static>>,
    rustls::pki_types::PrivateKeyDer<'static>,
)> {
    use rustls::pki_types::pem::PemObject as _;
    let what = format!("tls_cert_file {}", cert_file.display());
    let pem = std::fs::read(cert_file)
        .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
    if chain.is_empty() {
        return Err(Error::misconfigured(
            BACKEND,
            format!("{what}: no PEM certificate in it"),
        ));
    }
    let what = format!("tls_key_file {}", key_file.display());
    // Only the I/O error kind is shown: the key's contents never reach a message.
    let pem = std::fs::read(key_file)
        .map_err(|e| Error::misconfigured(BACKEND, format!("{what}: {e}")))?;
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(&pem).map_err(|_| {
        Error::misconfigured(
            BACKEND,
            format!("{what}: no readable PEM private key (PKCS#8, PKCS#1 or SEC1) in it"),
        )
    })?;
    Ok((chain, key))
}

fn tls_config(config: &ConsulConfig) -> Result<rustls::ClientConfig> {
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::misconfigured(BACKEND, format!("TLS: {e}")))?;
    if !config.tls() {
        return Ok(builder
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth());
    }
    let builder = builder.with_root_certificates(root_store(config)?);
    match (config.tls_cert_file(), config.tls_key_file()) {
        (Some(cert), Some(key)) => {
            let (chain, key) = client_identity(cert, key)?;
            // rustls's message says what is wrong (e.g. the key does not match), not the key.
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                Error::misconfigured(
                    BACKEND,
                    format!(
                        "tls_cert_file {} / tls_key_file: {e}",
                        config.tls_cert_file().unwrap_or(cert).display()
                    ),
                )
            })
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// The name the server certificate is checked against, when it is not the host.
fn server_name(config: &ConsulConfig) -> Result<Option<rustls::pki_types::ServerName<'static>>> {
    match config.tls_server_name() {
        Some(name) if config.tls() => rustls::pki_types::ServerName::try_from(name.to_owned())
            .map(Some)
            .map_err(|e| Error::misconfigured(BACKEND, format!("tls_server_name {name:?}: {e}"))),
        _ => Ok(None),
    }
}

/// The URL path of a KV key.
fn kv_path(key: &str) -> String {
    format!("/v1/kv/{}", utf8_percent_encode(key, PATH))
}

impl Http {
    /// A client for `config`'s agent. Sends nothing.
    pub(crate) fn new(config: &ConsulConfig) -> Result<Self> {
        let tls = tls_config(config)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(config.connect_timeout()));
        http.set_nodelay(true);
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let builder = match server_name(config)? {
            Some(name) => {
                builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
            }
            None => builder,
        };
        let https = builder.enable_http1().wrap_connector(http);
        let client = || -> Arc<dyn Pool> {
            Arc::new(
                Client::builder(TokioExecutor::new())
                    .pool_timer(TokioTimer::new())
                    .pool_idle_timeout(Duration::from_secs(30))
                    .build(https.clone()),
            )
        };
        Self::with_pools([client(), client(), client()], config)
    }

    /// A client that sends every request with the application's `client` (one pool for every
    /// lane) to `config`'s agent. Sends nothing; the config's TLS files are not read (the
    /// client's connector decides how to connect).
    pub(crate) fn with_client<C>(
        client: Client<C, Full<Bytes>>,
        config: &ConsulConfig,
    ) -> Result<Self>
    where
        C: Connect + Clone + Send + Sync + 'static,
    {
        let pool: Arc<dyn Pool> = Arc::new(client);
        Self::with_pools([pool.clone(), pool.clone(), pool], config)
    }

    fn with_pools(clients: [Arc<dyn Pool>; 3], config: &ConsulConfig) -> Result<Self> {
        let token = match config.token() {
            Some(t) => {
                let mut v =
                    HeaderValue::from_str(t).map_err(|_| lease_core::InvalidInput::OutOfRange {
                        field: "token",
                        value: "***".into(),
                        expected: "a token of visible ASCII characters",
                    })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        Ok(Http {
            clients,
            base: config.base_url(),
            token,
            datacenter: config.datacenter().map(str::to_owned),
            request_timeout: config.request_timeout(),
        })
    }

    /// The bound on one ordinary request.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        lane: Lane,
        method: Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Vec<u8>>,
        timeout: Duration,
        limit: usize,
    ) -> std::result::Result<Answer, Transport> {
        let mut uri = format!("{}{path}", self.base);
        let q = {
            let mut q = url::form_urlencoded::Serializer::new(String::new());
            for (k, v) in query {
                q.append_pair(k, v);
            }
            if let Some(dc) = &self.datacenter {
                q.append_pair("dc", dc);
            }
            q.finish()
        };
        if !q.is_empty() {
            uri.push('?');
            uri.push_str(&q);
        }
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(t) = &self.token {
            req = req.header("x-consul-token", t.clone());
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Transport::NotSent(Box::new(e)))?;
        let exchange = async {
            let resp = self.clients[lane as usize]
                .request(req)
                .await
                .map_err(Transport::from_client)?;
            let status = resp.status().as_u16();
            let index = resp
                .headers()
                .get("x-consul-index")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            let body = Limited::new(resp.into_body(), limit)
                .collect()
                .await
                .map_err(Transport::Failed)?
                .to_bytes();
            Ok(Answer {
                status,
                index,
                body,
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(Transport::TimedOut(timeout)),
        }
    }

    /// A blocking query's parameters (`?index=&wait=`, when `block` is given), its pool, and its
    /// bound: the request timeout plus the wait and the up to `wait / 16` of jitter Consul adds.
    fn blocking(
        &self,
        query: &mut Vec<(&'static str, String)>,
        block: Option<(u64, Duration)>,
    ) -> (Lane, Duration) {
        let Some((index, wait)) = block else {
            return (Lane::Ordinary, self.request_timeout);
        };
        let wait = wait.max(Duration::from_millis(1));
        query.push(("index", index.to_string()));
        query.push(("wait", format!("{}ms", wait.as_millis())));
        (Lane::LongPoll, self.request_timeout + wait + wait / 16)
    }

    /// `GET /v1/kv/:key`, optionally `?consistent`, optionally blocking (`?index=&wait=`).
    /// Returns the `X-Consul-Index` and the entry (`None` for 404).
    pub(crate) async fn kv_get(
        &self,
        key: &str,
        consistent: bool,
        block: Option<(u64, Duration)>,
        operation: &'static str,
    ) -> Result<(u64, Option<KvEntry>)> {
        let mut query = Vec::new();
        if consistent {
            query.push(("consistent", String::new()));
        }
        let (index, entries) = self
            .kv_read(key, query, block, MAX_ANSWER, operation)
            .await?;
        Ok((index, entries.into_iter().find(|e| e.key == key)))
    }

    /// `GET /v1/kv/<prefix>?recurse&consistent`, blocking from `index` for up to `wait` when
    /// `index` is above 0 (on the [`Lane::LongPoll`] pool). Returns the `X-Consul-Index` and every
    /// entry under the prefix (none for 404). Read-only: never `OutcomeUnknown`.
    pub(crate) async fn kv_list(
        &self,
        prefix: &str,
        index: u64,
        wait: Duration,
        operation: &'static str,
    ) -> Result<(u64, Vec<KvEntry>)> {
        let query = vec![("recurse", String::new()), ("consistent", String::new())];
        let block = (index > 0).then_some((index, wait));
        self.kv_read(prefix, query, block, MAX_LIST_ANSWER, operation)
            .await
    }

    /// One KV read of `path` with `query` (blocking when `block` is given): the
    /// `X-Consul-Index` and the entries answered (none for 404).
    async fn kv_read(
        &self,
        path: &str,
        mut query: Vec<(&'static str, String)>,
        block: Option<(u64, Duration)>,
        max_answer: usize,
        operation: &'static str,
    ) -> Result<(u64, Vec<KvEntry>)> {
        let (lane, timeout) = self.blocking(&mut query, block);
        let a = self
            .send(
                lane,
                Method::GET,
                &kv_path(path),
                &query,
                None,
                timeout,
                max_answer,
            )
            .await
            .map_err(|t| error::transport(Op::read(operation), t))?;
        let index = a.index.unwrap_or(0);
        match a.status {
            200 => {
                let entries: Vec<KvEntry> = serde_json::from_slice(&a.body)
                    .map_err(|e| error::unreadable(Op::read(operation), e))?;
                Ok((index, entries))
            }
            404 => Ok((index, Vec::new())),
            code => Err(error::status(Op::read(operation), code, &a.body)),
        }
    }

    /// `PUT /v1/txn` of `op` (a write: an answer lost after sending is `OutcomeUnknown`).
    pub(crate) async fn txn(&self, ops: &[TxnOp], op: Op) -> Result<TxnOutcome> {
        let body = txn_body(ops, op)?;
        let a = self
            .send_txn(body, self.request_timeout)
            .await
            .map_err(|t| error::transport(op, t))?;
        txn_answer(a, op)
    }

    /// [`Self::txn`] for a write that is safe to apply twice and whose answer tells what an
    /// earlier send did (a compare-and-delete on our own session; a lock by our own session):
    /// sent again, within the request timeout, after it certainly was not sent or after its
    /// connection failed once it was sent (`lease_core::adapter::resend`). A resend after a
    /// send in doubt also carries `on_resend` (the acquire's marker, so that a delayed copy of
    /// the first send cannot lock the key later). Also says whether an earlier send is in doubt;
    /// a failure after one is `OutcomeUnknown` ([`Op::after_doubt`]).
    pub(crate) async fn txn_resending(
        &self,
        ops: &[TxnOp],
        on_resend: &[TxnOp],
        op: Op,
    ) -> (Result<TxnOutcome>, bool) {
        let body = match txn_body(ops, op) {
            Ok(b) => b,
            Err(e) => return (Err(e), false),
        };
        let again = |t: &Transport| match t {
            _ if t.is_tls_problem() => None,
            Transport::NotSent(_) => Some(SendAgain::Unapplied),
            Transport::Failed(_) => Some(SendAgain::InDoubt),
            Transport::TimedOut(_) => None,
        };
        let pause = Backoff::new(Duration::from_millis(10), Duration::from_millis(80));
        let (a, in_doubt) = resend(self.request_timeout, pause, again, |left, in_doubt| {
            let body = if in_doubt && !on_resend.is_empty() {
                let all: Vec<&TxnOp> = ops.iter().chain(on_resend).collect();
                serde_json::to_vec(&all).unwrap_or_else(|_| body.clone())
            } else {
                body.clone()
            };
            self.send_txn(body, left)
        })
        .await;
        let outcome = match a {
            Ok(a) => txn_answer(a, op),
            Err(Transport::TimedOut(_)) => Err(error::transport(
                op,
                Transport::TimedOut(self.request_timeout),
            )),
            Err(t) => Err(error::transport(op, t)),
        };
        let outcome = match outcome {
            Err(e) if in_doubt => Err(op.after_doubt(e)),
            o => o,
        };
        (outcome, in_doubt)
    }

    /// One `PUT /v1/txn` of `body`, bounded by `timeout`.
    async fn send_txn(
        &self,
        body: Vec<u8>,
        timeout: Duration,
    ) -> std::result::Result<Answer, Transport> {
        self.send(
            Lane::Ordinary,
            Method::PUT,
            "/v1/txn",
            &[],
            Some(body),
            timeout,
            MAX_ANSWER,
        )
        .await
    }

    /// `PUT /v1/txn?consistent` of read operations only (`get`, `check-session`, ...), which
    /// Consul serves with `Txn.Read`, honouring the consistency mode. Never `OutcomeUnknown`:
    /// nothing it sends writes.
    pub(crate) async fn txn_read(&self, ops: &[TxnOp], operation: &'static str) -> Result<TxnRead> {
        let body =
            serde_json::to_vec(ops).map_err(|e| error::unencodable(operation, e.to_string()))?;
        let a = self
            .send(
                Lane::Ordinary,
                Method::PUT,
                "/v1/txn",
                &[("consistent", String::new())],
                Some(body),
                self.request_timeout,
                MAX_ANSWER,
            )
            .await
            .map_err(|t| error::transport(Op::read(operation), t))?;
        match a.status {
            200 | 409 => {
                let ans: TxnAnswer = serde_json::from_slice(&a.body)
                    .map_err(|e| error::unreadable(Op::read(operation), e))?;
                if a.status == 200 {
                    return Ok(TxnRead::Passed);
                }
                let errors: Vec<(Option<usize>, String)> = ans
                    .errors
                    .unwrap_or_default()
                    .into_iter()
                    .map(|e| (e.op_index, e.what))
                    .collect();
                // A check the ACL token may not read (`key:read`) is refused like a write it
                // may not make: `Misconfigured`, not a check that failed ("not ours").
                if let Some((_, denied)) = errors.iter().find(|(_, e)| acl_denial(e)) {
                    return Err(error::status(Op::read(operation), 403, denied.as_bytes()));
                }
                Ok(TxnRead::Failed(errors))
            }
            code => Err(error::status(Op::read(operation), code, &a.body)),
        }
    }

    /// `PUT /v1/session/create` with `body`; returns the session ID.
    pub(crate) async fn session_create(&self, body: &serde_json::Value) -> Result<String> {
        const OP: &str = "session create";
        let a = self
            .send(
                Lane::Session,
                Method::PUT,
                "/v1/session/create",
                &[],
                Some(body.to_string().into_bytes()),
                self.request_timeout,
                MAX_ANSWER,
            )
            .await
            // A session nobody knows of expires by itself: safe to treat as not created.
            .map_err(|t| error::transport(Op::read(OP), t))?;
        match a.status {
            200 => {
                #[derive(Deserialize)]
                struct Created {
                    #[serde(rename = "ID")]
                    id: String,
                }
                let c: Created = serde_json::from_slice(&a.body)
                    .map_err(|e| error::unreadable(Op::read(OP), e))?;
                Ok(c.id)
            }
            500 if String::from_utf8_lossy(&a.body).contains("Session TTL") => {
                Err(Error::misconfigured(
                    BACKEND,
                    format!(
                        "Consul refused the session TTL ({}); raise session_ttl_ms to at least the \
                         server's session_ttl_min (10 s by default)",
                        String::from_utf8_lossy(&a.body).trim()
                    ),
                ))
            }
            code => Err(error::status(Op::read(OP), code, &a.body)),
        }
    }

    /// `PUT /v1/session/renew/:id`: `Ok(true)` renewed, `Ok(false)` the session is gone (404).
    pub(crate) async fn session_renew(&self, id: &str, timeout: Duration) -> Result<bool> {
        const OP: &str = "session renew";
        let a = self
            .send(
                Lane::Session,
                Method::PUT,
                &format!("/v1/session/renew/{}", utf8_percent_encode(id, PATH)),
                &[],
                None,
                timeout,
                MAX_ANSWER,
            )
            .await
            .map_err(|t| error::transport(Op::read(OP), t))?;
        match a.status {
            200 => Ok(true),
            404 => Ok(false),
            code => Err(error::status(Op::read(OP), code, &a.body)),
        }
    }

    /// `PUT /v1/session/destroy/:id`.
    pub(crate) async fn session_destroy(&self, id: &str) -> Result<()> {
        const OP: &str = "session destroy";
        let a = self
            .send(
                Lane::Session,
                Method::PUT,
                &format!("/v1/session/destroy/{}", utf8_percent_encode(id, PATH)),
                &[],
                None,
                self.request_timeout,
                MAX_ANSWER,
            )
            .await
            .map_err(|t| error::transport(Op::read(OP), t))?;
        match a.status {
            200 => Ok(()),
            code => Err(error::status(Op::read(OP), code, &a.body)),
        }
    }
}

/// The JSON body of a transaction of `op`.
fn txn_body(ops: &[TxnOp], op: Op) -> Result<Vec<u8>> {
    serde_json::to_vec(ops).map_err(|e| error::unencodable(op.name, e.to_string()))
}

/// Whether a transaction error is Consul's ACL denial (`Permission denied`, with or without
/// the accessor and permission after it; `ACL not found` for an unknown token).
fn acl_denial(what: &str) -> bool {
    what.starts_with("Permission denied") || what.starts_with("ACL not found")
}

/// Decodes the answer to a transaction of `op`: committed (with the keys it returned) or rolled
/// back (with Consul's reasons); a refusal by the ACL is `Misconfigured`.
fn txn_answer(a: Answer, op: Op) -> Result<TxnOutcome> {
    match a.status {
        200 | 409 => {
            // 200: committed, so an unreadable answer to a write leaves its outcome unknown
            // (the caller resolves it); 409: rolled back, nothing was applied.
            let answered = if a.status == 200 {
                op
            } else {
                Op::read(op.name)
            };
            let ans: TxnAnswer =
                serde_json::from_slice(&a.body).map_err(|e| error::unreadable(answered, e))?;
            if a.status == 200 {
                Ok(TxnOutcome::Committed(
                    ans.results
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|r| r.kv)
                        .collect(),
                ))
            } else {
                let errors: Vec<String> = ans
                    .errors
                    .unwrap_or_default()
                    .into_iter()
                    .map(|e| e.what)
                    .collect();
                // Consul answers an operation the ACL token may not make in the transaction's
                // errors (409), not with a 403: a refusal of the token, not a compare that
                // failed, so it must not read as "not ours" (a release would stop there).
                if let Some(denied) = errors.iter().find(|e| acl_denial(e)) {
                    return Err(error::status(answered, 403, denied.as_bytes()));
                }
                Ok(TxnOutcome::RolledBack(errors))
            }
        }
        code => Err(error::status(op, code, &a.body)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_needs_a_readable_ca() {
        let c =
            ConsulConfig::from_url("consuls://127.0.0.1?tls_ca_file=/nonexistent/ca.pem").unwrap();
        assert!(matches!(Http::new(&c), Err(Error::Misconfigured { .. })));
        let dir = std::env::temp_dir().join(format!("consul-ca-{}", std::process::id()));
        std::fs::write(&dir, b"not a certificate").unwrap();
        let c =
            ConsulConfig::from_url(&format!("consuls://h?tls_ca_file={}", dir.display())).unwrap();
        let e = Http::new(&c).unwrap_err();
        let _ = std::fs::remove_file(&dir);
        assert!(matches!(e, Error::Misconfigured { .. }), "{e}");
    }

    #[test]
    fn kv_paths_are_percent_encoded() {
        assert_eq!(kv_path("fenced/locks/a,20b"), "/v1/kv/fenced/locks/a,20b");
        assert_eq!(kv_path("x y?z#"), "/v1/kv/x%20y%3Fz%23");
    }
}
