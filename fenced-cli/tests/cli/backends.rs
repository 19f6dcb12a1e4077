//! The backends every command is tested on, and the servers behind them.
//!
//! [`on_every_backend!`] turns each shared test body into one test per backend (named
//! `<body>::<backend>`, so `cargo test -p fenced-cli --test cli zookeeper` runs one backend). The
//! list of backends is written once, in that macro: Redis, etcd and ZooKeeper are servers the
//! conformance harness starts as child processes; Consul is the conformance suite's stand-in
//! (an HTTP server on a loopback port, running in the test process, which the `fenced` binary
//! reaches by URL like an agent).
//!
//! A server that is not installed is a named skip on a developer machine and a failure under
//! `CI=true` (the harness's [`start_or_skip`] policy).

use std::time::Duration;

use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions};
use conformance_tests::harness::{
    start_or_skip, Backend, EtcdServer, RedisServer, ZooKeeperServer,
};

/// ZooKeeper's session timeout in the tests' URLs: the smallest TTL a lease can have there.
const ZK_SESSION_TIMEOUT: Duration = Duration::from_millis(1500);
/// The stand-in's `session_ttl_min` and the URL's `session_ttl_ms`: Consul's smallest TTL here.
const CONSUL_SESSION_TTL: Duration = Duration::from_secs(1);

/// A server one test runs its commands against.
#[allow(dead_code)] // the servers are only held, for their lifetime
enum Server {
    Redis(RedisServer),
    Etcd(EtcdServer),
    ZooKeeper(ZooKeeperServer),
    Consul(ConsulStandIn),
}

/// A backend started for one test: its URL for `--url`, and the server (stopped on drop).
pub(crate) struct Subject {
    /// Which backend.
    pub(crate) backend: Backend,
    /// The URL `fenced --url` takes (with the password or options the server needs).
    pub(crate) url: String,
    /// A Redis server for a fence when the coordinator is not Redis (started on demand).
    fence: std::sync::OnceLock<RedisServer>,
    server: Server,
}

impl Subject {
    /// Starts `backend` for the test `test`; `None` (a named skip) when it is not installed and
    /// `CI` is not `true`.
    pub(crate) fn start(test: &str, backend: Backend) -> Option<Subject> {
        let (server, url) = match backend {
            Backend::Redis => {
                let s = start_or_skip(test, backend, RedisServer::start)?;
                let url = s.url_with_auth();
                (Server::Redis(s), url)
            }
            Backend::Etcd => {
                let s = start_or_skip(test, backend, EtcdServer::start)?;
                let url = s.url();
                (Server::Etcd(s), url)
            }
            Backend::ZooKeeper => {
                let s = start_or_skip(test, backend, ZooKeeperServer::start)?;
                // The server's tickTime is known: without `tick_ms` the adapter assumes half the
                // session timeout, which leaves a 1.5 s session too little validity for a run.
                let url = format!(
                    "zk://{}/fenced-cli?session_timeout_ms={}&tick_ms={}",
                    s.addr(),
                    ZK_SESSION_TIMEOUT.as_millis(),
                    s.config().tick_time.as_millis()
                );
                (Server::ZooKeeper(s), url)
            }
            Backend::Consul => {
                // Always available: the stand-in is part of the test. Lock-delay 0, so a run
                // after a forced release need not wait for it.
                let s = ConsulStandIn::start(
                    StandInOptions::default().session_ttl_min(CONSUL_SESSION_TTL),
                )
                .unwrap_or_else(|e| panic!("{test}: the Consul stand-in did not start: {e}"));
                let url = format!(
                    "consul://{}?session_ttl_ms={}&lock_delay_ms=0",
                    s.addr(),
                    CONSUL_SESSION_TTL.as_millis()
                );
                (Server::Consul(s), url)
            }
            Backend::Postgres => panic!("PostgreSQL is a fence, not a coordinator"),
        };
        Some(Subject {
            backend,
            url,
            fence: std::sync::OnceLock::new(),
            server,
        })
    }

    /// The backend's name as `fenced ... --json` reports it.
    pub(crate) fn name(&self) -> &'static str {
        self.backend.name()
    }

    /// A fence URL for this test: the coordinator's own Redis, else a Redis server started for
    /// the fence alone. Redis is always needed for the fence: under `CI=true` a missing
    /// `redis-server` fails the test.
    pub(crate) fn fence_url(&self, test: &str) -> Option<String> {
        if let Server::Redis(s) = &self.server {
            return Some(s.url_with_auth());
        }
        if self.fence.get().is_none() {
            let s = start_or_skip(test, Backend::Redis, RedisServer::start)?;
            let _ = self.fence.set(s);
        }
        self.fence.get().map(RedisServer::url_with_auth)
    }
}

/// One test per backend named for each shared body `fn(&Subject, &str)`: `<body>::<backend>`
/// for each `backend => Variant` of [`Backend`](conformance_tests::harness::Backend) given.
macro_rules! on_backends {
    ($body:ident: $($backend:ident => $variant:ident),+ $(,)?) => {
        mod $body {
            use conformance_tests::harness::Backend;

            fn on(backend: Backend) {
                let test = format!("{}::{}", stringify!($body), backend.name());
                if let Some(subject) = crate::backends::Subject::start(&test, backend) {
                    super::$body(&subject, &test);
                }
            }

            $(
                #[test]
                fn $backend() {
                    on(Backend::$variant)
                }
            )+
        }
    };
}
pub(crate) use on_backends;

/// One test per backend for each shared body `fn(&Subject, &str)`: `<body>::redis`, `::etcd`,
/// `::zookeeper`, `::consul`. The backend list lives here, once.
macro_rules! on_every_backend {
    ($($body:ident),+ $(,)?) => {$(
        crate::backends::on_backends!(
            $body: redis => Redis, etcd => Etcd, zookeeper => ZooKeeper, consul => Consul
        );
    )+};
}
pub(crate) use on_every_backend;
