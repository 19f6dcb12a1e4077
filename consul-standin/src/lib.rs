#![forbid(unsafe_code)]

//! **A test-only stand-in for a Consul server** — not Consul, and not for production.
//!
//! No Consul server package is reachable from this project's machines, so the conformance suite
//! runs the Consul adapter against this in-process HTTP server, which implements the endpoints the
//! adapter uses with the semantics documented in Consul's HTTP API and implemented in Consul's
//! state store. When `CONSUL_HTTP_ADDR` names a real Consul, the suite runs against that instead
//! (see the `conformance-tests` crate's Consul subject).
//!
//! # What it implements
//!
//! | endpoint | Consul API documentation section |
//! |---|---|
//! | `GET/PUT/DELETE /v1/kv/:key` | KV Store: read key (`recurse`, `keys`, `separator`, `raw`), create/update key (`flags`, `cas`, `acquire`, `release`), delete key (`recurse`, `cas`) |
//! | `PUT /v1/txn` | Transaction: the KV verbs `set`, `cas`, `lock`, `unlock`, `get`, `get-tree`, `check-session`, `check-index`, `check-not-exists`, `delete`, `delete-tree`, `delete-cas` |
//! | `PUT /v1/session/create`, `renew/:id`, `destroy/:id`; `GET info/:id`, `list` | Session |
//! | `GET /v1/status/leader` | Status (a readiness probe) |
//!
//! - **Indexes**: one Raft-like index, raised by every write; `CreateIndex`, `ModifyIndex` and
//!   `LockIndex` follow Consul's `kvs.go`: `LockIndex` counts acquisitions of a key and **starts
//!   again at 1 when the key is deleted and recreated**, while `ModifyIndex` keeps rising.
//! - **Blocking queries**: `?index=&wait=` (default 5 min, at most 10 min, plus up to `wait/16`
//!   of jitter), `X-Consul-Index` on every read (a key's `ModifyIndex`, or the KV table index for
//!   a missing key), woken by the next change of the watched key or prefix. As in Consul, whose
//!   memdb watch channels fire per key, a query on one key is woken only by a change of that key
//!   (a write, delete, release or its session's invalidation), not by other keys' commits; a
//!   prefix query (`recurse`, `keys`) is woken by every commit and re-checks its prefix.
//! - **Consistency modes**: `?consistent` and `?stale` are accepted; with one server every read is
//!   consistent.
//! - **Sessions**: `TTL` between `session_ttl_min` and 24 h (or none), `Behavior` `release` or
//!   `delete`, `LockDelay` (default 15 s, clamped to 60 s, Consul's numeric-seconds fixup), and
//!   checks: without `Checks`/`NodeChecks` a session carries `serfHealth`, an empty list means no
//!   checks. [`ConsulStandIn::fail_serf_health`] turns that check critical, which invalidates
//!   every session carrying it regardless of its TTL (what a node failure does in Consul).
//! - **TTL invalidation**: like Consul's leader, which arms each session's timer at
//!   `TTL × SessionTTLMultiplier` (2) after its last renewal, the stand-in invalidates a session
//!   exactly `TTL × ttl_multiplier` (default 2) after its last renewal: never before the TTL, at
//!   most twice the TTL. Invalidation releases (or deletes) the session's keys and starts each
//!   key's lock-delay, during which `acquire` answers `false` and a `lock` verb fails with
//!   "due to lock delay".
//! - **ACL**: with [`StandInOptions::acl_token`] set, a missing token (`X-Consul-Token`, `?token=`
//!   or `Authorization: Bearer`) is answered 403 `Permission denied`, a wrong one 403
//!   `ACL not found`. [`ConsulStandIn::deny_key_writes`] refuses writes under a prefix as a
//!   policy without `key:write` on it does: 403 to a plain `PUT`/`DELETE`, 409 with a
//!   `Permission denied` error to a transaction.
//! - **TLS** ([`StandInOptions::tls`]): the listener speaks HTTPS (TLS 1.2 and 1.3, rustls) with
//!   the given certificate and key, like an agent with `ports.https` and `tls.https`; with
//!   [`StandInTls::client_ca_pem`] it also requires a client certificate signed by that CA (the
//!   agent's `tls.https.verify_incoming`) and ends the handshake of a client without one
//!   (`certificate required`) or with another CA's (`unknown ca`/`bad certificate`) before any
//!   request is read. Certificates are the test's own (e.g. generated with `rcgen`).
//! - **Key rules** of current Consul releases (`validateKVKey`): only `[A-Za-z0-9,-_./]`, no
//!   `../`, no trailing file extension such as `.json` (switch off with
//!   [`StandInOptions::strict_kv_keys`]).
//!
//! # Faults
//!
//! Behind [`ServerControl`]: `kill` stops listening and drops every connection (in-flight requests
//! get no answer; nothing more is applied). Consul keeps KV data and sessions in Raft, so the
//! stand-in **keeps its state across `kill` and `restart`** and its indexes keep rising; `restart`
//! behaves like a newly elected leader: it listens on the same port again, restarts every
//! session's TTL timer at its full length and keeps lock-delays (Consul's servers each set them
//! when they apply a session's invalidation, so a new leader has them). `pause` stops accepting and answering while keeping sockets open (like
//! `SIGSTOP`); session timers do not fire while paused and fire on `resume` if they are due.
//! [`ConsulStandIn::answer_next_commit`] commits the next write transaction but answers it with a
//! given status and body (a lost answer: `rpc error making call: EOF`, a proxy's 502, ...).
//! [`ConsulStandIn::write_before_txns`] writes a key from outside just before each write
//! transaction on it (an outside writer that always gets in first).
//!
//! # What it does not implement
//!
//! Catalog, health, agent and ACL endpoints; Node/Service/Check/Session operations inside
//! `/v1/txn`; namespaces, partitions and more than one datacenter (`dc1`); `?cached`; ACL policies
//! (one token grants everything); tombstone reaping; multiple servers, leader elections and Raft
//! itself (a commit is immediate and durable). Its timing (answers within microseconds) is not
//! Consul's.

mod http;
mod state;

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;

use self::http::{Control, Shared};
use self::state::Store;
use lease_testkit::harness::{Backend, HarnessError, ServerControl};

/// HTTPS for the stand-in (see [`StandInOptions::tls`]). The key is never shown by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct StandInTls {
    /// The server certificate chain, PEM (leaf first).
    pub cert_pem: String,
    /// The server certificate's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: String,
    /// When set, the CA certificate(s), PEM, that must have signed every client's certificate:
    /// clients without one are refused in the handshake (mTLS, `verify_incoming`).
    pub client_ca_pem: Option<String>,
}

impl std::fmt::Debug for StandInTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StandInTls")
            .field("cert_pem", &format_args!("<{} bytes>", self.cert_pem.len()))
            .field("key_pem", &"***")
            .field("requires_client_cert", &self.client_ca_pem.is_some())
            .finish()
    }
}

impl StandInTls {
    /// HTTPS with this certificate chain and key, client certificates not asked for.
    pub fn new(cert_pem: impl Into<String>, key_pem: impl Into<String>) -> Self {
        StandInTls {
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
            client_ca_pem: None,
        }
    }

    /// Requires a client certificate signed by `ca_pem` (mTLS).
    pub fn require_client_cert(mut self, ca_pem: impl Into<String>) -> Self {
        self.client_ca_pem = Some(ca_pem.into());
        self
    }

    /// The rustls acceptor for these settings.
    fn acceptor(&self) -> io::Result<tokio_rustls::TlsAcceptor> {
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject as _;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let bad = |what: &str, e: &dyn std::fmt::Display| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("stand-in TLS: {what}: {e}"),
            )
        };
        let chain = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad("cert_pem", &e))?;
        // The key's contents never reach a message.
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|_| bad("key_pem", &"no readable PEM private key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("protocol versions", &e))?;
        let builder = match &self.client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
                    roots
                        .add(cert.map_err(|e| bad("client_ca_pem", &e))?)
                        .map_err(|e| bad("client_ca_pem", &e))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| bad("client_ca_pem", &e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| bad("cert_pem/key_pem", &e))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// How the stand-in behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandInOptions {
    /// The smallest session TTL accepted (Consul's `session_ttl_min`, 10 s by default). Tests
    /// lower it so that expiry cases take about a second instead of tens of seconds.
    pub session_ttl_min: Duration,
    /// Sessions are invalidated this many TTLs after their last renewal (Consul's
    /// `SessionTTLMultiplier`, 2).
    pub ttl_multiplier: u32,
    /// When set, every KV, transaction and session request must carry this ACL token.
    pub acl_token: Option<String>,
    /// Enforce current Consul's KV key rules on `/v1/kv` (default true).
    pub strict_kv_keys: bool,
    /// Add Consul's random extra wait (up to `wait / 16`) to blocking queries (default true).
    pub blocking_jitter: bool,
    /// Serve HTTPS instead of HTTP (default: HTTP).
    pub tls: Option<StandInTls>,
}

impl Default for StandInOptions {
    fn default() -> Self {
        StandInOptions {
            session_ttl_min: Duration::from_secs(10),
            ttl_multiplier: 2,
            acl_token: None,
            strict_kv_keys: true,
            blocking_jitter: true,
            tls: None,
        }
    }
}

impl StandInOptions {
    /// Sets the smallest accepted session TTL.
    pub fn session_ttl_min(mut self, d: Duration) -> Self {
        self.session_ttl_min = d;
        self
    }

    /// Requires `token` on every API request.
    pub fn acl_token(mut self, token: impl Into<String>) -> Self {
        self.acl_token = Some(token.into());
        self
    }

    /// Serves HTTPS with `tls` (see [`StandInTls`]).
    pub fn tls(mut self, tls: StandInTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Sets the TTL multiplier (at least 1).
    pub fn ttl_multiplier(mut self, m: u32) -> Self {
        self.ttl_multiplier = m.max(1);
        self
    }
}

/// A running Consul stand-in on a loopback port (see the [module docs](self)).
///
/// It runs on its own small Tokio runtime, so it can be used from synchronous and asynchronous
/// tests alike and is not slowed by the test's own tasks. Dropping it stops it.
pub struct ConsulStandIn {
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
    addr: SocketAddr,
    /// The TLS acceptor when serving HTTPS.
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// Signalled by the accept loop when it has closed the listening socket.
    accept_closed: Mutex<Option<mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for ConsulStandIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsulStandIn")
            .field("addr", &self.addr)
            .field("tls", &self.tls.is_some())
            .field("serving", &self.is_serving())
            .finish_non_exhaustive()
    }
}

impl ConsulStandIn {
    /// Starts a stand-in on a free `127.0.0.1` port.
    ///
    /// # Errors
    /// The runtime or the listening socket could not be created, or the TLS certificate or key
    /// could not be read (`InvalidInput`).
    pub fn start(options: StandInOptions) -> io::Result<Self> {
        let tls = options.tls.as_ref().map(StandInTls::acceptor).transpose()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("consul-standin")
            .enable_all()
            .build()?;
        let listener = StdListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (changes, _) = watch::channel(0u64);
        let (control, _) = watch::channel(Control {
            generation: 0,
            paused: false,
        });
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(options.session_ttl_min, options.ttl_multiplier)),
            changes,
            key_watches: Mutex::new(std::collections::HashMap::new()),
            prefix_watches: Mutex::new(std::collections::HashMap::new()),
            control,
            acl_token: options.acl_token.clone(),
            strict_kv_keys: options.strict_kv_keys,
            jitter: options.blocking_jitter,
            requests: std::sync::atomic::AtomicU64::new(0),
            blocking_reads: std::sync::atomic::AtomicU64::new(0),
            blocking_now: std::sync::atomic::AtomicU64::new(0),
            commit_answer: Mutex::new(None),
            write_before_txns: Mutex::new(None),
            denied_writes: Mutex::new(None),
            failing_renewals: std::sync::atomic::AtomicBool::new(false),
        });
        runtime.spawn(session_timers(shared.clone()));
        let this = ConsulStandIn {
            runtime: Some(runtime),
            shared,
            addr,
            tls,
            accept_closed: Mutex::new(None),
        };
        this.serve(listener, 0);
        Ok(this)
    }

    fn serve(&self, listener: StdListener, generation: u64) {
        let (tx, rx) = mpsc::channel();
        *self.accept_closed.lock().unwrap_or_else(|p| p.into_inner()) = Some(rx);
        if let Some(rt) = &self.runtime {
            rt.spawn(accept_loop(
                listener,
                self.shared.clone(),
                self.tls.clone(),
                generation,
                tx,
            ));
        }
    }

    /// The address clients connect to; the same across restarts.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>` (`https://` when serving TLS), the form of `CONSUL_HTTP_ADDR`.
    pub fn http_addr(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Whether it serves HTTPS ([`StandInOptions::tls`]).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether it is accepting requests (not killed).
    pub fn is_serving(&self) -> bool {
        self.shared.store().serving
    }

    /// How many HTTP requests it has received so far (to check that clients do not poll).
    pub fn requests(&self) -> u64 {
        self.shared
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many times blocking queries (`?index=` above 0) have read the store so far: once when
    /// they arrive and once per wake-up (to check that a query is woken only by changes of what
    /// it watches).
    pub fn blocking_reads(&self) -> u64 {
        self.shared
            .blocking_reads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many blocking queries (`?index=` above 0) are waiting or being answered right now
    /// (each holds one client connection: to check that a client's long polls stay bounded).
    pub fn blocking_in_progress(&self) -> u64 {
        self.shared
            .blocking_now
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The current Raft-like index.
    pub fn index(&self) -> u64 {
        self.shared.store().index()
    }

    /// Crash: stop listening, drop every connection, apply nothing more. State is kept (Consul
    /// persists it in Raft). `Ok` if it was not running.
    ///
    /// # Errors
    /// The listener did not close within 5 s.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        self.shared.store().serving = false;
        self.shared.control.send_modify(|c| {
            c.generation += 1;
            c.paused = false;
        });
        let rx = self
            .accept_closed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(rx) = rx {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(HarnessError::io(
                        "consul stand-in: listener did not close",
                        io::Error::from(io::ErrorKind::TimedOut),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Start serving again on the same port with the same data, as a newly elected leader: every
    /// session's TTL timer restarts, lock-delays are forgotten. Kills first if still running.
    ///
    /// # Errors
    /// The port could not be bound again within 5 s.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        if self.is_serving() {
            self.kill()?;
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match StdListener::bind(self.addr) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!(error = %e, "consul stand-in: rebinding");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(HarnessError::io("consul stand-in: rebind", e)),
            }
        };
        listener
            .set_nonblocking(true)
            .map_err(|e| HarnessError::io("consul stand-in: nonblocking", e))?;
        let index = {
            let mut st = self.shared.store();
            st.serving = true;
            st.new_leader(Instant::now());
            st.index()
        };
        let generation = self.shared.control.borrow().generation;
        self.serve(listener, generation);
        self.shared.notify(index);
        Ok(())
    }

    /// Freeze: nothing is accepted or answered, sockets stay open, session timers stop firing.
    pub fn pause(&self) {
        self.shared.control.send_modify(|c| c.paused = true);
    }

    /// Thaw after [`ConsulStandIn::pause`]; due session timers fire.
    pub fn resume(&self) {
        self.shared.control.send_modify(|c| c.paused = false);
    }

    /// The node's `serfHealth` check turns critical: every session carrying it is invalidated at
    /// once, whatever its TTL, and new sessions with it are refused.
    pub fn fail_serf_health(&self) {
        let index = {
            let mut st = self.shared.store();
            st.fail_serf_health(Instant::now());
            st.index()
        };
        self.shared.notify(index);
    }

    /// The `serfHealth` check passes again.
    pub fn restore_serf_health(&self) {
        self.shared.store().restore_serf_health();
    }

    /// The next `/v1/txn` that writes and commits is applied as usual, but answered `status` with
    /// `body` instead of its results (once): what a client sees when the leader committed the
    /// write and the answer was lost on the way, e.g. Consul's agent answering 500
    /// `rpc error making call: EOF`, a proxy's 502, or a 200 whose body was cut.
    pub fn answer_next_commit(&self, status: u16, body: impl Into<String>) {
        *self
            .shared
            .commit_answer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((status, body.into()));
    }

    /// Before each of the next `times` write transactions (`/v1/txn`) that touch the KV key
    /// `key`, the key is written with a plain `PUT` (a new value each time): another writer's write
    /// that lands just before each of them, as a tight loop of outside writes could. `0` stops.
    /// A plain `PUT` keeps a lock and raises the key's `ModifyIndex`, as in Consul.
    pub fn write_before_txns(&self, key: impl Into<String>, times: u32) {
        *self
            .shared
            .write_before_txns
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((key.into(), times));
    }

    /// Refuses every write of a KV key under `prefix` (`None`: none), as Consul does when the
    /// ACL token's policy loses `key:write` on it: a plain `PUT` or `DELETE` is answered 403, a
    /// transaction with such a write 409 with a `Permission denied` error for each (Consul's
    /// `preCheck`), and nothing of it is applied.
    pub fn deny_key_writes(&self, prefix: Option<String>) {
        *self
            .shared
            .denied_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = prefix;
    }

    /// While `fail` is set, every session renewal is answered 500 `No cluster leader` (what a
    /// Consul agent answers while the servers have no leader) and renews nothing; sessions keep
    /// their timers, so one not renewed for its TTL (times the multiplier) is invalidated as
    /// usual. Everything else is answered as usual.
    pub fn fail_renewals(&self, fail: bool) {
        self.shared
            .failing_renewals
            .store(fail, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many of the outside writes asked for with [`ConsulStandIn::write_before_txns`] are
    /// still to come (`0` when none were asked for): a test sees from it that transactions on
    /// the key were sent (each one sent meanwhile used one).
    pub fn outside_writes_left(&self) -> u32 {
        self.shared
            .write_before_txns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or(0, |(_, left)| *left)
    }
}

impl Drop for ConsulStandIn {
    fn drop(&mut self) {
        self.shared.store().serving = false;
        self.shared.control.send_modify(|c| c.generation += 1);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl ServerControl for ConsulStandIn {
    fn backend(&self) -> Backend {
        Backend::Consul
    }
    fn url(&self) -> String {
        self.http_addr()
    }
    fn controllable(&self) -> bool {
        true
    }
    /// `None`: the stand-in runs inside the test process, which must never be signalled.
    fn pid(&self) -> Option<u32> {
        None
    }
    fn kill(&mut self) -> Result<(), HarnessError> {
        ConsulStandIn::kill(self)
    }
    fn stop(&mut self) -> Result<(), HarnessError> {
        ConsulStandIn::kill(self)
    }
    fn restart(&mut self) -> Result<(), HarnessError> {
        ConsulStandIn::restart(self)
    }
    fn pause(&self) -> Result<(), HarnessError> {
        if !self.is_serving() {
            return Err(HarnessError::NotRunning { server: "consul" });
        }
        ConsulStandIn::pause(self);
        Ok(())
    }
    fn resume(&self) -> Result<(), HarnessError> {
        ConsulStandIn::resume(self);
        Ok(())
    }
}

async fn accept_loop(
    listener: StdListener,
    shared: Arc<Shared>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    generation: u64,
    closed: mpsc::Sender<()>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "consul stand-in: listener");
            let _ = closed.send(());
            return;
        }
    };
    let mut control = shared.control.subscribe();
    loop {
        let c = *control.borrow_and_update();
        if c.generation != generation {
            break;
        }
        if c.paused {
            // Leave new connections in the kernel's backlog, like a stopped process.
            if control.changed().await.is_err() {
                break;
            }
            continue;
        }
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    match &tls {
                        None => {
                            tokio::spawn(serve_connection(stream, shared.clone(), generation));
                        }
                        Some(acceptor) => {
                            tokio::spawn(serve_tls_connection(
                                acceptor.clone(),
                                stream,
                                shared.clone(),
                                generation,
                            ));
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "consul stand-in: accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            changed = control.changed() => if changed.is_err() { break },
        }
    }
    drop(listener);
    let _ = closed.send(());
}

/// The TLS handshake (bounded, and cut by a kill), then HTTP over it. A refused handshake (no or
/// a wrongly signed client certificate) closes the connection after rustls's alert.
async fn serve_tls_connection(
    acceptor: tokio_rustls::TlsAcceptor,
    stream: tokio::net::TcpStream,
    shared: Arc<Shared>,
    generation: u64,
) {
    let mut control = shared.control.subscribe();
    let handshake = tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream));
    let stream = tokio::select! {
        r = handshake => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "consul stand-in: TLS handshake refused");
                return;
            }
            Err(_) => return,
        },
        _ = control.wait_for(|c| c.generation != generation) => return,
    };
    serve_connection(stream, shared, generation).await;
}

async fn serve_connection<S>(stream: S, shared: Arc<Shared>, generation: u64)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut control = shared.control.subscribe();
    let svc_shared = shared.clone();
    let service = service_fn(move |req| http::handle(svc_shared.clone(), generation, req));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        _ = conn => {}
        // Killed: dropping the connection closes the socket mid-request, like a crash.
        _ = control.wait_for(|c| c.generation != generation) => {}
    }
}

/// The leader's session timers: invalidates sessions whose TTL × multiplier has passed since
/// their last renewal, unless the server is paused or killed.
async fn session_timers(shared: Arc<Shared>) {
    let mut changes = shared.changes.subscribe();
    let mut control = shared.control.subscribe();
    loop {
        let next = shared.store().next_expiry();
        let now = Instant::now();
        let wake = next.map_or(now + Duration::from_secs(1), |n| {
            n.min(now + Duration::from_secs(1))
        });
        tokio::select! {
            _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
            r = changes.changed() => if r.is_err() { return },
            r = control.changed() => if r.is_err() { return },
        }
        if control.borrow().paused {
            continue;
        }
        let expired = {
            let mut st = shared.store();
            if !st.serving {
                continue;
            }
            st.expire_sessions(Instant::now()).then(|| st.index())
        };
        if let Some(index) = expired {
            shared.notify(index);
        }
    }
}
