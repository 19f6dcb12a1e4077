//! The Consul subject: a real Consul when `CONSUL_HTTP_ADDR` is set (configured by the adapter
//! from the `CONSUL_*` environment, session TTL from `CONFORMANCE_TTL_MS` or [`REAL_TTL`]),
//! otherwise the in-process [stand-in](crate::consul_standin). The subject's name says which one ran: `consul (real:
//! <addr>)` or `consul (stand-in)`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http_body_util::{BodyExt, Full};
use lease_core::LockKey;

use crate::consul_standin::{ConsulStandIn, StandInOptions};
use crate::harness::{Backend, ExternalEndpoints};
use crate::suite::{ConnectViaFn, Operator, Subject};

/// The session TTL (and so the lease TTL) the suite uses against the stand-in, which is started
/// with this `session_ttl_min` instead of Consul's 10 s so that expiry cases take seconds.
pub const STANDIN_TTL: Duration = Duration::from_secs(1);
/// The default TTL against a real Consul: its default `session_ttl_min`. `CONFORMANCE_TTL_MS`
/// replaces it (for an agent started with a lower `session_ttl_min`, as the users' CI kit does).
pub const REAL_TTL: Duration = Duration::from_secs(10);

/// Sends one HTTP/1.1 request to a Consul agent at `addr` (plain HTTP) with an optional body and
/// returns the status, the `X-Consul-Index` header and the body, within 10 s. Used by the operator
/// hook, as an operator's `curl` would, and by the stand-in's own tests.
pub async fn consul_http(
    addr: SocketAddr,
    method: &str,
    path_and_query: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> Result<(u16, Option<u64>, Bytes), String> {
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path_and_query)
            .header("host", addr.to_string());
        if let Some(t) = token {
            req = req.header("x-consul-token", t);
        }
        let req = req
            .body(Full::new(Bytes::copy_from_slice(body.unwrap_or_default())))
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let index = resp
            .headers()
            .get("x-consul-index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, index, body))
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("{method} {addr}: no answer within 10 s"))?
}

/// Deletes a lock's KV key over the HTTP API (`consul kv delete <key>`).
struct ConsulOperator {
    addr: SocketAddr,
    token: Option<String>,
    config: adapter_consul::ConsulConfig,
}

impl Operator for ConsulOperator {
    fn delete_key<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let path = format!("/v1/kv/{}", self.config.kv_key(key));
            match consul_http(self.addr, "DELETE", &path, self.token.as_deref(), None).await? {
                (200, _, _) => Ok(()),
                (status, _, body) => Err(format!(
                    "DELETE {path}: HTTP {status}: {}",
                    String::from_utf8_lossy(&body)
                )),
            }
        })
    }

    fn delete_parent<'a>(&'a self, _key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        // Consul KV keys are independent entries: there is no parent node whose deletion could
        // reset anything (LockIndex restarting after `delete_key` is what this backend risks).
        Box::pin(async { Ok(false) })
    }

    /// `consul kv put <key> outside-write`: a plain `PUT` without `?acquire`, which Consul
    /// applies to a locked key, keeping its session and raising its `ModifyIndex`.
    fn overwrite_value<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let path = format!("/v1/kv/{}", self.config.kv_key(key));
            match consul_http(
                self.addr,
                "PUT",
                &path,
                self.token.as_deref(),
                Some(b"outside-write"),
            )
            .await?
            {
                (200, _, body) if body.as_ref() == b"true" => Ok(true),
                (status, _, body) => Err(format!(
                    "PUT {path}: HTTP {status}: {}",
                    String::from_utf8_lossy(&body)
                )),
            }
        })
    }

    /// `consul session destroy <the session holding the key>`.
    fn invalidate_holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let path = format!("/v1/kv/{}", self.config.kv_key(key));
            let (status, _, body) =
                consul_http(self.addr, "GET", &path, self.token.as_deref(), None).await?;
            if status != 200 {
                return Err(format!("GET {path}: HTTP {status}"));
            }
            let entries: serde_json::Value =
                serde_json::from_slice(&body).map_err(|e| format!("GET {path}: {e}"))?;
            let session = entries[0]["Session"]
                .as_str()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| format!("{path} is not locked by a session"))?
                .to_owned();
            let destroy = format!("/v1/session/destroy/{session}");
            match consul_http(self.addr, "PUT", &destroy, self.token.as_deref(), None).await? {
                (200, _, _) => Ok(true),
                (status, _, body) => Err(format!(
                    "PUT {destroy}: HTTP {status}: {}",
                    String::from_utf8_lossy(&body)
                )),
            }
        })
    }
}

/// Builds the Consul subject (see the module docs).
pub(crate) async fn consul_subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    let key_prefix = format!("conformance-{:08x}", rand::random::<u32>());
    match ExternalEndpoints::from_env().get(Backend::Consul) {
        Some(external) => real(external.url, key_prefix, worker_exe).await,
        None => standin(key_prefix, worker_exe).await,
    }
}

fn connect_fn(url: String) -> crate::suite::ConnectFn {
    Arc::new(move || {
        let url = url.clone();
        Box::pin(async move { fenced::connect(&url).await })
    })
}

fn connect_via_fn(query: String) -> ConnectViaFn {
    Arc::new(move |addr| {
        let url = format!("consul://{addr}?{query}");
        Box::pin(async move { fenced::connect(&url).await })
    })
}

async fn standin(
    key_prefix: String,
    worker_exe: Option<PathBuf>,
) -> Result<Option<Subject>, String> {
    // An ACL token the stand-in requires and the suite checks never shows in any output.
    let token = format!("acl-{:016x}", rand::random::<u64>());
    let server = ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(STANDIN_TTL)
            .acl_token(token.clone()),
    )
    .map_err(|e| format!("starting the Consul stand-in: {e}"))?;
    let addr = server.addr();
    let query = format!(
        "token={token}&key_prefix={key_prefix}&session_ttl_ms={}",
        STANDIN_TTL.as_millis()
    );
    let url = format!("consul://{addr}?{query}");
    let config = adapter_consul::ConsulConfig::from_url(&url).map_err(|e| e.to_string())?;
    let mut subject = Subject::new(
        "consul (stand-in)",
        connect_fn(url.clone()),
        Arc::new(lease_core::memory::MemoryFence::new()),
        STANDIN_TTL,
    )
    .with_server(Box::new(server))
    .with_proxy(addr, connect_via_fn(query))
    .with_operator(Arc::new(ConsulOperator {
        addr,
        token: Some(token.clone()),
        config,
    }))
    .with_secret(token);
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}

/// The ACL token the environment gives the adapter (`CONSUL_HTTP_TOKEN_FILE`'s contents, else
/// `CONSUL_HTTP_TOKEN`), for the operator's requests and the report's redaction.
fn env_token() -> Option<String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    var("CONSUL_HTTP_TOKEN_FILE")
        .and_then(|f| std::fs::read_to_string(f).ok())
        .or_else(|| var("CONSUL_HTTP_TOKEN"))
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
}

/// The real agent of `CONSUL_HTTP_ADDR`. The URL names no host, so the adapter reads the agent's
/// address, HTTP or HTTPS, ACL token, CA and client certificate from the `CONSUL_*` environment
/// exactly as it would in production. The session TTL (and the subject's TTL) is
/// `CONFORMANCE_TTL_MS` when set ([`crate::suite::ttl_override`]), else [`REAL_TTL`]; a value
/// below the agent's `session_ttl_min` is refused by Consul, and reported as `Misconfigured`.
async fn real(
    addr: String,
    key_prefix: String,
    worker_exe: Option<PathBuf>,
) -> Result<Option<Subject>, String> {
    let ttl = crate::suite::ttl_override().unwrap_or(REAL_TTL);
    let query = format!("key_prefix={key_prefix}&session_ttl_ms={}", ttl.as_millis());
    let url = format!("consul://?{query}");
    let config = adapter_consul::ConsulConfig::from_url(&url).map_err(|e| e.to_string())?;
    let tls = config.tls();
    let host = config.host();
    let hostport = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", config.port())
    } else {
        format!("{host}:{}", config.port())
    };
    let token = env_token();
    let resolved = tokio::net::lookup_host(hostport.as_str())
        .await
        .ok()
        .and_then(|mut a| a.next());
    let mut subject = Subject::new(
        format!("consul (real: {})", config.base_url()),
        connect_fn(url.clone()),
        Arc::new(lease_core::memory::MemoryFence::new()),
        ttl,
    )
    // The harness cannot crash or freeze an external agent: restart cases are skipped by name.
    .with_server(Box::new(crate::harness::ExternalEndpoint {
        backend: Backend::Consul,
        url: addr.clone(),
    }));
    if let (Some(sock), false) = (resolved, tls) {
        // Through the proxy the URL names the proxy's address; the token still comes from the
        // environment.
        subject = subject
            .with_proxy(sock, connect_via_fn(query))
            .with_operator(Arc::new(ConsulOperator {
                addr: sock,
                token: token.clone(),
                config,
            }));
    }
    if let Some(t) = token {
        subject = subject.with_secret(t);
    }
    if let Some(exe) = worker_exe {
        // Workers inherit this process's environment, so they resolve the same agent.
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
