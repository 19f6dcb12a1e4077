//! A real single-member `etcd` as a child process.
//!
//! Command line (client port `P`, peer port `Q`, both kept across restarts because the member's
//! peer URL is stored in the data directory):
//!
//! ```text
//! etcd --name fenced --data-dir <tmp>/data
//!      --listen-client-urls http://127.0.0.1:P --advertise-client-urls http://127.0.0.1:P
//!      --listen-peer-urls http://127.0.0.1:Q --initial-advertise-peer-urls http://127.0.0.1:Q
//!      --initial-cluster fenced=http://127.0.0.1:Q --initial-cluster-state new
//!      --heartbeat-interval 20 --election-timeout 200 --logger zap --log-outputs stderr
//!      [extra args…]
//! ```
//!
//! The flags are those of etcd 3.4 (Debian 12) and 3.5. On amd64/arm64 no
//! `ETCD_UNSUPPORTED_ARCH` is needed; on other architectures set it in the environment of the
//! test process (the child inherits it). Readiness: `GET /health` over raw HTTP/1.0 answers
//! `"health":"true"` (there is a leader and a read went through Raft).

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{find_in_path, managed_server, Backend, HarnessError};

/// How to run `etcd`. `Default`: heartbeat 20 ms, election timeout 200 ms (fast leader election
/// on loopback), 20 s startup bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `--heartbeat-interval` in milliseconds.
    pub heartbeat_interval_ms: u32,
    /// `--election-timeout` in milliseconds (etcd requires at least 5 × heartbeat).
    pub election_timeout_ms: u32,
    /// Further arguments appended verbatim (e.g. `["--auto-compaction-retention", "1"]`).
    pub extra_args: Vec<String>,
    /// Bound on one start (spawn to healthy).
    pub startup_timeout: Duration,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval_ms: 20,
            election_timeout_ms: 200,
            extra_args: Vec::new(),
            startup_timeout: Duration::from_secs(20),
        }
    }
}

struct EtcdLauncher {
    binary: PathBuf,
    config: EtcdConfig,
}

const MEMBER_NAME: &str = "fenced";

impl Launcher for EtcdLauncher {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn ports_needed(&self) -> usize {
        2
    }

    fn command(&self, _root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        let client = format!("http://127.0.0.1:{}", ports[0]);
        let peer = format!("http://127.0.0.1:{}", ports[1]);
        let mut cmd = Command::new(&self.binary);
        cmd.args(["--name", MEMBER_NAME])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("{MEMBER_NAME}={peer}")])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--heartbeat-interval",
                &self.config.heartbeat_interval_ms.to_string(),
            ])
            .args([
                "--election-timeout",
                &self.config.election_timeout_ms.to_string(),
            ])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .args(&self.config.extra_args);
        Ok(cmd)
    }

    fn probe(&self, client: SocketAddr) -> Probe {
        let request = format!("GET /health HTTP/1.0\r\nHost: {client}\r\n\r\n");
        match tcp_exchange(
            client,
            request.as_bytes(),
            Duration::from_millis(500),
            |_| false,
        ) {
            Ok(reply) => {
                let text = String::from_utf8_lossy(&reply);
                if text.contains("\"health\":\"true\"") {
                    Probe::Ready
                } else {
                    Probe::NotReady(text.lines().last().unwrap_or_default().to_owned())
                }
            }
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        self.config.startup_timeout
    }
}

/// A single-member `etcd` child process on free loopback ports with a temporary data directory.
///
/// Killed and cleaned up on drop. See the [module docs](self) for the command line.
#[derive(Debug)]
pub struct EtcdServer {
    inner: ServerProcess,
    config: EtcdConfig,
}

impl EtcdServer {
    /// Where `etcd` is (`PATH` search), or why it cannot be used.
    pub fn binary() -> Result<PathBuf, String> {
        find_in_path("etcd")
            .ok_or_else(|| "etcd not found in PATH (Debian: apt-get install etcd-server)".into())
    }

    /// Starts with [`EtcdConfig::default`] and waits until `/health` is true.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(EtcdConfig::default())
    }

    /// Starts with `config` and waits (bounded by `config.startup_timeout`) until healthy.
    pub fn start_with(config: EtcdConfig) -> Result<Self, HarnessError> {
        let binary = Self::binary().map_err(|reason| HarnessError::Startup {
            server: "etcd",
            exited: false,
            reason,
            log_tail: String::new(),
        })?;
        let inner = ServerProcess::start(Box::new(EtcdLauncher {
            binary,
            config: config.clone(),
        }))?;
        Ok(Self { inner, config })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// The client endpoint as etcd clients want it: `http://127.0.0.1:<port>`.
    pub fn http_endpoint(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// The peer port (Raft traffic), kept across restarts.
    pub fn peer_port(&self) -> u16 {
        self.inner.ports()[1]
    }
}

managed_server!(EtcdServer, Backend::Etcd, "etcd");
