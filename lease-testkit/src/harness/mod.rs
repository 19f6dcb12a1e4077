//! Real servers for the conformance suite: start, crash, freeze, restart.
//!
//! The harness runs Redis, etcd and ZooKeeper as **child processes of the test** on free
//! loopback ports with temporary data directories (see [`RedisServer`], [`EtcdServer`],
//! [`ZooKeeperServer`]). Each start waits, bounded, until the server answers a protocol-level
//! probe. Every managed server offers the same controls:
//!
//! | method | effect |
//! |---|---|
//! | `addr()` / `port()` / `url()` | where clients connect; fixed for the server's lifetime |
//! | `pid()` | the running child's PID (`None` after `kill`/`stop`) |
//! | `kill()` | `SIGKILL` and reap: a crash, no flush |
//! | `stop()` | `SIGTERM`, bounded wait, `SIGKILL` fallback: a clean shutdown |
//! | `restart()` | start again on the same ports and data directory, wait ready (kills first if running) |
//! | `pause()` / `resume()` | `SIGSTOP` / `SIGCONT`: the server freezes with its sockets open |
//! | `log_path()` | the server's stdout+stderr, appended across restarts |
//!
//! Dropping a server kills it and removes its temporary directory, also during a panic.
//! All calls are **blocking** (they sleep and poll); from async code call them through
//! `tokio::task::spawn_blocking` or accept a short stall of one worker thread.
//!
//! Servers run elsewhere (for example in CI containers) come in through
//! [`ExternalEndpoints::from_env`]; the harness cannot crash or freeze them, which
//! [`ServerControl::controllable`] reports as `false`.
//!
//! When a server is not installed, [`server_unavailable`] applies the policy: a named skip on a
//! developer machine, an error when `CI=true`.

use std::fmt;
use std::io;
use std::path::PathBuf;

pub mod cluster;
pub mod etcd;
pub mod etcd_cluster;
pub mod netns;
pub mod postgres;
pub mod redis;
pub mod redis_cluster;
mod resp;
mod server;
pub mod zookeeper;
pub mod zookeeper_ensemble;

pub use cluster::{ClusterControl, ClusterError, ClusterResult};
pub use etcd::{EtcdConfig, EtcdServer};
pub use postgres::PostgresServer;
pub use redis::{AppendFsync, RedisConfig, RedisServer};
pub use server::{free_ports, tcp_exchange};
pub use zookeeper::{ZooKeeperConfig, ZooKeeperInstall, ZooKeeperServer};

use crate::process::SignalError;

/// Everything that can go wrong while starting or controlling a server.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A file-system or socket operation of the harness failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The server did not become ready.
    #[error("{server} failed to start: {reason}\n--- log tail ---\n{log_tail}")]
    Startup {
        /// Server name.
        server: &'static str,
        /// `true` when the process exited by itself before it was ready (a lost port race is
        /// one cause; the first start then retries on fresh ports).
        exited: bool,
        /// What happened.
        reason: String,
        /// The end of the server's log file.
        log_tail: String,
    },
    /// A signal could not be delivered.
    #[error(transparent)]
    Signal(#[from] SignalError),
    /// `pause`/`resume` on a server that is not running.
    #[error("{server} is not running")]
    NotRunning {
        /// Server name.
        server: &'static str,
    },
    /// A control operation on an endpoint the harness did not start.
    #[error("{backend} at {url} is external: the harness cannot {operation} it")]
    NotControllable {
        /// The backend.
        backend: Backend,
        /// The external URL.
        url: String,
        /// The refused operation.
        operation: &'static str,
    },
    /// A server is missing while `CI=true` (see [`server_unavailable`]).
    #[error("{name}: required server unavailable under CI=true: {reason}")]
    Unavailable {
        /// Test or backend name.
        name: String,
        /// Why the server is unavailable.
        reason: String,
    },
}

impl HarnessError {
    /// An [`HarnessError::Io`] with its context (what was being done), for servers and stand-ins
    /// built outside this crate (such as the `consul-standin` crate's).
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// The coordination services the project supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Redis (`redis://`).
    Redis,
    /// etcd v3 (`etcd://`).
    Etcd,
    /// ZooKeeper (`zk://`).
    ZooKeeper,
    /// Consul (`http://`); the harness has no local Consul server, only external endpoints.
    Consul,
    /// PostgreSQL (`postgres://`), a protected resource (fence), not a coordinator.
    Postgres,
}

impl Backend {
    /// All backends, in a stable order.
    pub const ALL: [Backend; 5] = [
        Backend::Redis,
        Backend::Etcd,
        Backend::ZooKeeper,
        Backend::Consul,
        Backend::Postgres,
    ];

    /// Lower-case name: `redis`, `etcd`, `zookeeper`, `consul`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Redis => "redis",
            Backend::Etcd => "etcd",
            Backend::ZooKeeper => "zookeeper",
            Backend::Consul => "consul",
            Backend::Postgres => "postgres",
        }
    }

    /// The environment variable naming an external endpoint for this backend.
    pub fn env_var(self) -> &'static str {
        match self {
            Backend::Redis => "FENCED_REDIS_URL",
            Backend::Etcd => "FENCED_ETCD_URL",
            Backend::ZooKeeper => "FENCED_ZK_URL",
            Backend::Consul => "CONSUL_HTTP_ADDR",
            Backend::Postgres => "FENCED_POSTGRES_URL",
        }
    }

    /// Whether the harness can start this backend locally: `Ok` with the program it would run,
    /// or `Err` with a human-readable reason (missing binary, missing jars, no local harness).
    pub fn local_availability(self) -> Result<PathBuf, String> {
        match self {
            Backend::Redis => RedisServer::binary(),
            Backend::Etcd => EtcdServer::binary(),
            Backend::ZooKeeper => ZooKeeperServer::install().map(|i| i.java),
            Backend::Consul => Err(
                "the harness does not run Consul locally; set CONSUL_HTTP_ADDR to an agent".into(),
            ),
            Backend::Postgres => PostgresServer::binary(),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Uniform control over a backend endpoint, managed or external.
///
/// For servers the harness started, every operation acts on the child process. For an
/// [`ExternalEndpoint`], `controllable()` is `false`, `pid()` is `None`, and the control
/// operations fail with [`HarnessError::NotControllable`]: fault-injection tests must check
/// `controllable()` and skip otherwise.
pub trait ServerControl: Send {
    /// Which backend this is.
    fn backend(&self) -> Backend;
    /// The URL clients use (`redis://…`, `etcd://…`, `zk://…`, or the external URL verbatim).
    fn url(&self) -> String;
    /// Whether `kill`/`stop`/`restart`/`pause`/`resume` can act on the server.
    fn controllable(&self) -> bool;
    /// The server's PID while the harness runs it.
    fn pid(&self) -> Option<u32>;
    /// Crash the server: `SIGKILL` and reap. `Ok` if it was not running.
    fn kill(&mut self) -> Result<(), HarnessError>;
    /// Shut the server down cleanly (bounded; `SIGKILL` fallback). `Ok` if it was not running.
    fn stop(&mut self) -> Result<(), HarnessError>;
    /// Start again on the same address and data; `SIGKILL` first if it still runs.
    fn restart(&mut self) -> Result<(), HarnessError>;
    /// Freeze the server (`SIGSTOP`).
    fn pause(&self) -> Result<(), HarnessError>;
    /// Thaw the server (`SIGCONT`).
    fn resume(&self) -> Result<(), HarnessError>;
}

/// An endpoint the harness did not start (for example a container in CI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalEndpoint {
    /// Which backend it is.
    pub backend: Backend,
    /// The URL exactly as given in the environment.
    pub url: String,
}

impl ExternalEndpoint {
    fn refuse(&self, operation: &'static str) -> HarnessError {
        HarnessError::NotControllable {
            backend: self.backend,
            url: self.url.clone(),
            operation,
        }
    }
}

impl ServerControl for ExternalEndpoint {
    fn backend(&self) -> Backend {
        self.backend
    }
    fn url(&self) -> String {
        self.url.clone()
    }
    fn controllable(&self) -> bool {
        false
    }
    fn pid(&self) -> Option<u32> {
        None
    }
    fn kill(&mut self) -> Result<(), HarnessError> {
        Err(self.refuse("kill"))
    }
    fn stop(&mut self) -> Result<(), HarnessError> {
        Err(self.refuse("stop"))
    }
    fn restart(&mut self) -> Result<(), HarnessError> {
        Err(self.refuse("restart"))
    }
    fn pause(&self) -> Result<(), HarnessError> {
        Err(self.refuse("pause"))
    }
    fn resume(&self) -> Result<(), HarnessError> {
        Err(self.refuse("resume"))
    }
}

/// Externally run backends named by the environment.
///
/// Reads `FENCED_REDIS_URL`, `FENCED_ETCD_URL`, `FENCED_ZK_URL`, `CONSUL_HTTP_ADDR` and
/// `FENCED_POSTGRES_URL`; an unset
/// or empty (after trimming) variable means "not external". URLs are not validated here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExternalEndpoints {
    /// From `FENCED_REDIS_URL`, e.g. `redis://127.0.0.1:6379`.
    pub redis: Option<String>,
    /// From `FENCED_ETCD_URL`, e.g. `etcd://127.0.0.1:2379`.
    pub etcd: Option<String>,
    /// From `FENCED_ZK_URL`, e.g. `zk://127.0.0.1:2181`.
    pub zookeeper: Option<String>,
    /// From `CONSUL_HTTP_ADDR`, e.g. `http://127.0.0.1:8500`.
    pub consul: Option<String>,
    /// From `FENCED_POSTGRES_URL`, e.g. `postgres://postgres@127.0.0.1:5432/postgres`.
    pub postgres: Option<String>,
}

impl ExternalEndpoints {
    /// Reads the variables from the process environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`Self::from_env`] with a custom variable lookup (for tests).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let get = |b: Backend| {
            lookup(b.env_var())
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        Self {
            redis: get(Backend::Redis),
            etcd: get(Backend::Etcd),
            zookeeper: get(Backend::ZooKeeper),
            consul: get(Backend::Consul),
            postgres: get(Backend::Postgres),
        }
    }

    /// The external endpoint for `backend`, if one is configured.
    pub fn get(&self, backend: Backend) -> Option<ExternalEndpoint> {
        let url = match backend {
            Backend::Redis => &self.redis,
            Backend::Etcd => &self.etcd,
            Backend::ZooKeeper => &self.zookeeper,
            Backend::Consul => &self.consul,
            Backend::Postgres => &self.postgres,
        };
        url.clone().map(|url| ExternalEndpoint { backend, url })
    }
}

/// A test that did not run because a server is unavailable; `Display` prints
/// `SKIPPED: <name>: <reason>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    /// The test (or backend) name.
    pub name: String,
    /// Why it was skipped.
    pub reason: String,
}

impl Skip {
    /// Prints the skip line to stdout (shown by `cargo test` with `--nocapture`, or when the
    /// test output is displayed).
    pub fn report(&self) {
        println!("{self}");
    }
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SKIPPED: {}: {}", self.name, self.reason)
    }
}

/// Whether missing servers are errors: the environment variable `CI` is `true` or `1`
/// (case-insensitive), as GitHub Actions and most CI systems set it.
pub fn ci_requires_servers() -> bool {
    std::env::var("CI")
        .map(|v| {
            let v = v.trim();
            v.eq_ignore_ascii_case("true") || v == "1"
        })
        .unwrap_or(false)
}

/// The policy for a missing server: under `CI=true` ([`ci_requires_servers`]) it is an error
/// ([`HarnessError::Unavailable`]), so CI cannot go green by skipping; elsewhere it is a named
/// [`Skip`] for the caller to report and return from.
///
/// Use it only for *absence* (binary not installed, no endpoint configured): a server that is
/// installed but fails to start is always an error.
pub fn server_unavailable(name: &str, reason: impl Into<String>) -> Result<Skip, HarnessError> {
    let reason = reason.into();
    if ci_requires_servers() {
        Err(HarnessError::Unavailable {
            name: name.to_owned(),
            reason,
        })
    } else {
        Ok(Skip {
            name: name.to_owned(),
            reason,
        })
    }
}

/// Starts a server for the test `name` with `start`, applying the missing-server policy first:
/// `None` after printing `SKIPPED: <name>: <reason>` when `backend` is not installed; a panic
/// under `CI=true` ([`server_unavailable`]) or when an installed server fails to start. Blocking:
/// from async code call it through `tokio::task::spawn_blocking` or [`start_or_skip_async`].
pub fn start_or_skip<T>(
    name: &str,
    backend: Backend,
    start: impl FnOnce() -> Result<T, HarnessError>,
) -> Option<T> {
    if let Err(reason) = backend.local_availability() {
        server_unavailable(name, reason)
            .unwrap_or_else(|e| panic!("{e}"))
            .report();
        return None;
    }
    Some(start().unwrap_or_else(|e| panic!("{name}: {backend} did not start: {e}")))
}

/// [`start_or_skip`] from async code (the start runs on a blocking thread).
pub async fn start_or_skip_async<T, F>(name: &str, backend: Backend, start: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, HarnessError> + Send + 'static,
{
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || start_or_skip(&name, backend, start))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// Searches `PATH` for an executable file called `program`.
pub fn find_in_path(program: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| {
            candidate
                .metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// Generates the common inherent methods and the [`ServerControl`] impl of a managed server
/// type holding a `ServerProcess` in field `inner`.
macro_rules! managed_server {
    ($ty:ident, $backend:expr, $scheme:literal) => {
        impl $ty {
            /// The client address `127.0.0.1:<port>`; the same across restarts.
            pub fn addr(&self) -> std::net::SocketAddr {
                self.inner.addr()
            }

            /// The client port; the same across restarts.
            pub fn port(&self) -> u16 {
                self.inner.addr().port()
            }

            #[doc = concat!("The client URL, `", $scheme, "://127.0.0.1:<port>`.")]
            pub fn url(&self) -> String {
                format!(concat!($scheme, "://{}"), self.inner.addr())
            }

            /// The PID of the running server; `None` after [`Self::kill`] or [`Self::stop`].
            pub fn pid(&self) -> Option<u32> {
                self.inner.pid()
            }

            /// Whether the server process is still alive (reaps it if it exited by itself).
            pub fn is_running(&mut self) -> bool {
                self.inner.is_running()
            }

            /// Crash: `SIGKILL` the server and reap it. Data directory and ports are kept for
            /// [`Self::restart`]. `Ok` if it was not running.
            pub fn kill(&mut self) -> Result<(), $crate::harness::HarnessError> {
                self.inner.kill()
            }

            /// Clean shutdown: `SIGTERM` (and `SIGCONT` in case it is paused), wait up to 10 s,
            /// then `SIGKILL`. Returns the exit status, `None` if it was not running.
            pub fn stop(
                &mut self,
            ) -> Result<Option<std::process::ExitStatus>, $crate::harness::HarnessError> {
                self.inner.stop()
            }

            /// Starts the server again on the same ports and data directory and waits until it
            /// answers. A still-running server is `SIGKILL`ed first (a crash restart); call
            /// [`Self::stop`] before for a clean one.
            pub fn restart(&mut self) -> Result<(), $crate::harness::HarnessError> {
                self.inner.restart()
            }

            /// Freezes the server with `SIGSTOP`, with every process it forked (PostgreSQL's
            /// backends): connections stay open, nothing is answered.
            pub fn pause(&self) -> Result<(), $crate::harness::HarnessError> {
                self.inner.pause()
            }

            /// Thaws a server frozen by [`Self::pause`] with `SIGCONT`.
            pub fn resume(&self) -> Result<(), $crate::harness::HarnessError> {
                self.inner.resume()
            }

            /// The data directory (kept across restarts, removed on drop).
            pub fn data_dir(&self) -> &std::path::Path {
                self.inner.data_dir()
            }

            /// The temporary directory holding data, generated config and log.
            pub fn root_dir(&self) -> &std::path::Path {
                self.inner.root_dir()
            }

            /// The log file: stdout and stderr of every start, appended.
            pub fn log_path(&self) -> &std::path::Path {
                self.inner.log_path()
            }

            /// The last few kilobytes of the log.
            pub fn log_tail(&self) -> String {
                self.inner.log_tail()
            }

            /// How long the last successful start or restart took from spawn to ready.
            pub fn last_start_duration(&self) -> std::time::Duration {
                self.inner.last_start_duration()
            }
        }

        impl $crate::harness::ServerControl for $ty {
            fn backend(&self) -> $crate::harness::Backend {
                $backend
            }
            fn url(&self) -> String {
                $ty::url(self)
            }
            fn controllable(&self) -> bool {
                true
            }
            fn pid(&self) -> Option<u32> {
                $ty::pid(self)
            }
            fn kill(&mut self) -> Result<(), $crate::harness::HarnessError> {
                $ty::kill(self)
            }
            fn stop(&mut self) -> Result<(), $crate::harness::HarnessError> {
                $ty::stop(self).map(|_| ())
            }
            fn restart(&mut self) -> Result<(), $crate::harness::HarnessError> {
                $ty::restart(self)
            }
            fn pause(&self) -> Result<(), $crate::harness::HarnessError> {
                $ty::pause(self)
            }
            fn resume(&self) -> Result<(), $crate::harness::HarnessError> {
                $ty::resume(self)
            }
        }
    };
}
use managed_server;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_endpoints_ignore_empty_values() {
        let env = ExternalEndpoints::from_lookup(|name| match name {
            "FENCED_REDIS_URL" => Some("redis://127.0.0.1:6379".into()),
            "FENCED_ETCD_URL" => Some("  ".into()),
            _ => None,
        });
        let redis = env.get(Backend::Redis).unwrap();
        assert_eq!(redis.url, "redis://127.0.0.1:6379");
        assert!(!redis.controllable());
        assert!(env.get(Backend::Etcd).is_none());
        assert!(env.get(Backend::Consul).is_none());
        let mut redis = redis;
        assert!(matches!(
            redis.kill(),
            Err(HarnessError::NotControllable {
                operation: "kill",
                ..
            })
        ));
    }

    #[test]
    fn skip_line_format() {
        let skip = Skip {
            name: "t".into(),
            reason: "no redis-server".into(),
        };
        assert_eq!(skip.to_string(), "SKIPPED: t: no redis-server");
    }

    #[test]
    fn free_ports_are_distinct() {
        let ports = free_ports(3).unwrap();
        assert_eq!(ports.len(), 3);
        assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2]);
    }
}
