//! A real `redis-server` as a child process.
//!
//! Command line (everything on the command line, no config file):
//!
//! ```text
//! redis-server --port P --bind 127.0.0.1 --dir <tmp>/data --save "" --appendonly yes|no
//!              --appendfsync always|everysec|no --maxmemory-policy <policy>
//!              --daemonize no --logfile "" [--requirepass <pw>] [extra args…]
//! ```
//!
//! `--save ""` disables RDB snapshots, so what survives a `SIGKILL` is exactly what the AOF holds:
//! with `appendonly yes` + `appendfsync always` every acknowledged write survives; with
//! `appendonly no` everything is lost. Readiness: `PING` answered by `+PONG` (or `-NOAUTH` when a
//! password is set; `-LOADING` while the AOF is replayed is *not* ready). Redis renames its
//! process title; the harness tracks it by PID only.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{find_in_path, managed_server, Backend, HarnessError};

/// Redis `appendfsync` policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AppendFsync {
    /// fsync after every write command: acknowledged writes survive `kill -9` and power loss.
    Always,
    /// fsync once a second (Redis' default).
    EverySec,
    /// Leave flushing to the OS.
    No,
}

impl AppendFsync {
    /// The value as written on Redis' command line.
    pub fn as_str(self) -> &'static str {
        match self {
            AppendFsync::Always => "always",
            AppendFsync::EverySec => "everysec",
            AppendFsync::No => "no",
        }
    }
}

/// How to run `redis-server`. `Default` is the durable configuration the project recommends:
/// `appendonly yes`, `appendfsync always`, `maxmemory-policy noeviction`, no password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `--appendonly yes|no`.
    pub appendonly: bool,
    /// `--appendfsync` (only matters with `appendonly`).
    pub appendfsync: AppendFsync,
    /// `--maxmemory-policy`, e.g. `noeviction` or `allkeys-lru`.
    pub maxmemory_policy: String,
    /// `--requirepass` when set.
    pub requirepass: Option<String>,
    /// Further arguments appended verbatim (e.g. `["--maxmemory", "10mb"]`).
    pub extra_args: Vec<String>,
    /// Bound on one start (spawn to `PONG`).
    pub startup_timeout: Duration,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            appendonly: true,
            appendfsync: AppendFsync::Always,
            maxmemory_policy: "noeviction".into(),
            requirepass: None,
            extra_args: Vec::new(),
            startup_timeout: Duration::from_secs(20),
        }
    }
}

struct RedisLauncher {
    binary: PathBuf,
    config: RedisConfig,
}

impl Launcher for RedisLauncher {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn ports_needed(&self) -> usize {
        1
    }

    fn command(&self, _root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        let c = &self.config;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--port")
            .arg(ports[0].to_string())
            .args(["--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(data_dir)
            .args(["--save", ""])
            .args(["--appendonly", if c.appendonly { "yes" } else { "no" }])
            .args(["--appendfsync", c.appendfsync.as_str()])
            .args(["--maxmemory-policy", &c.maxmemory_policy])
            .args(["--daemonize", "no"])
            .args(["--logfile", ""]);
        if let Some(pw) = &c.requirepass {
            cmd.args(["--requirepass", pw]);
        }
        cmd.args(&c.extra_args);
        Ok(cmd)
    }

    fn probe(&self, client: SocketAddr) -> Probe {
        match tcp_exchange(client, b"PING\r\n", Duration::from_millis(250), |b| {
            b.ends_with(b"\r\n")
        }) {
            Ok(reply) if reply.starts_with(b"+PONG") || reply.starts_with(b"-NOAUTH") => {
                Probe::Ready
            }
            Ok(reply) => Probe::NotReady(String::from_utf8_lossy(&reply).trim().to_owned()),
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        self.config.startup_timeout
    }
}

/// A `redis-server` child process on a free loopback port with a temporary data directory.
///
/// Killed and cleaned up on drop. See the [module docs](self) for the command line.
#[derive(Debug)]
pub struct RedisServer {
    inner: ServerProcess,
    config: RedisConfig,
}

impl RedisServer {
    /// Where `redis-server` is (`PATH` search), or why it cannot be used.
    pub fn binary() -> Result<PathBuf, String> {
        find_in_path("redis-server").ok_or_else(|| {
            "redis-server not found in PATH (Debian: apt-get install redis-server)".into()
        })
    }

    /// Starts with [`RedisConfig::default`] and waits until it answers `PING`.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(RedisConfig::default())
    }

    /// Starts with `config` and waits (bounded by `config.startup_timeout`) until it answers.
    pub fn start_with(config: RedisConfig) -> Result<Self, HarnessError> {
        let binary = Self::binary().map_err(|reason| HarnessError::Startup {
            server: "redis",
            exited: false,
            reason,
            log_tail: String::new(),
        })?;
        let inner = ServerProcess::start(Box::new(RedisLauncher {
            binary,
            config: config.clone(),
        }))?;
        Ok(Self { inner, config })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// The URL including the password when one is set: `redis://:<pw>@127.0.0.1:<port>`
    /// (the password is not percent-encoded; keep test passwords URL-safe).
    pub fn url_with_auth(&self) -> String {
        match &self.config.requirepass {
            Some(pw) => format!("redis://:{pw}@{}", self.addr()),
            None => self.url(),
        }
    }
}

managed_server!(RedisServer, Backend::Redis, "redis");
