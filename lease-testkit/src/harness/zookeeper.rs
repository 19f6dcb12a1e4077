//! A real standalone ZooKeeper as a child JVM.
//!
//! The JVM is started directly (no wrapper script, so the PID is the server's):
//!
//! ```text
//! java -Xmx256m -XX:+UseSerialGC -Dzookeeper.admin.enableServer=false
//!      -cp /usr/share/java/zookeeper.jar:/usr/share/java/slf4j-simple.jar
//!      org.apache.zookeeper.server.ZooKeeperServerMain <tmp>/zoo.cfg
//! ```
//!
//! On Debian 12 `zookeeper.jar` (package `libzookeeper-java`) carries a manifest `Class-Path`
//! naming all its dependencies in `/usr/share/java`, so only an SLF4J binding must be added:
//! `slf4j-simple` writes the server log to stderr, which the harness captures (without a binding
//! SLF4J 1.7 silently drops every log line). The classpath can be replaced through the
//! environment variable `FENCED_ZK_CLASSPATH`; the JVM is `$JAVA_HOME/bin/java` when `JAVA_HOME`
//! is set, else `java` from `PATH`.
//!
//! The generated `zoo.cfg`:
//!
//! ```text
//! tickTime=<tick ms>            (default 200: sessions may be 400 ms .. max_session_timeout)
//! minSessionTimeout=<2 × tick>
//! maxSessionTimeout=<max_session_timeout ms>   (default 60000)
//! dataDir=<tmp>/data
//! clientPort=P
//! clientPortAddress=127.0.0.1
//! admin.enableServer=false      (else Jetty takes port 8080)
//! 4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump,wchp
//! maxClientCnxns=0
//! ```
//!
//! `forceSync` keeps its default (`yes`): acknowledged writes are fsynced and survive `kill -9`.
//! Readiness: the `srvr` four-letter word answers `Zookeeper version` (a server that is not yet
//! serving answers "not currently serving requests").

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{find_in_path, managed_server, Backend, HarnessError};

/// The server main class (standalone mode).
const MAIN_CLASS: &str = "org.apache.zookeeper.server.ZooKeeperServerMain";
/// Debian's ZooKeeper jar, whose manifest names its dependencies.
const DEBIAN_ZK_JAR: &str = "/usr/share/java/zookeeper.jar";
/// Debian's SLF4J binding that logs to stderr (package `libslf4j-java`).
const DEBIAN_SLF4J_SIMPLE: &str = "/usr/share/java/slf4j-simple.jar";

/// Where the JVM and the ZooKeeper classes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZooKeeperInstall {
    /// The `java` executable.
    pub java: PathBuf,
    /// The `-cp` value.
    pub classpath: String,
}

/// How to run ZooKeeper. `Default`: `tickTime` 200 ms, sessions 400 ms to 60 s, heap 256 MiB,
/// 30 s startup bound (a JVM start on a loaded 2-core machine takes seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZooKeeperConfig {
    /// `tickTime`; the smallest session timeout the server grants is twice this.
    pub tick_time: Duration,
    /// `maxSessionTimeout`.
    pub max_session_timeout: Duration,
    /// `-Xmx<heap_mb>m`.
    pub heap_mb: u32,
    /// Extra `key=value` lines appended to `zoo.cfg`.
    pub extra_config: Vec<String>,
    /// Bound on one start (spawn to `srvr` answer).
    pub startup_timeout: Duration,
}

impl Default for ZooKeeperConfig {
    fn default() -> Self {
        Self {
            tick_time: Duration::from_millis(200),
            max_session_timeout: Duration::from_secs(60),
            heap_mb: 256,
            extra_config: Vec::new(),
            startup_timeout: Duration::from_secs(30),
        }
    }
}

struct ZooKeeperLauncher {
    install: ZooKeeperInstall,
    config: ZooKeeperConfig,
}

impl Launcher for ZooKeeperLauncher {
    fn name(&self) -> &'static str {
        "zookeeper"
    }

    fn ports_needed(&self) -> usize {
        1
    }

    fn command(&self, root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        let c = &self.config;
        let tick = c.tick_time.as_millis().max(1);
        let mut cfg = format!(
            "tickTime={tick}\n\
             minSessionTimeout={min}\n\
             maxSessionTimeout={max}\n\
             dataDir={data}\n\
             clientPort={port}\n\
             clientPortAddress=127.0.0.1\n\
             admin.enableServer=false\n\
             4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump,wchp\n\
             maxClientCnxns=0\n",
            min = 2 * tick,
            max = c.max_session_timeout.as_millis().max(2 * tick),
            data = data_dir.display(),
            port = ports[0],
        );
        for line in &c.extra_config {
            cfg.push_str(line);
            cfg.push('\n');
        }
        let cfg_path = root.join("zoo.cfg");
        std::fs::write(&cfg_path, cfg)?;
        let mut cmd = Command::new(&self.install.java);
        cmd.arg(format!("-Xmx{}m", c.heap_mb))
            .arg("-XX:+UseSerialGC")
            .arg("-Dzookeeper.admin.enableServer=false")
            .arg("-cp")
            .arg(&self.install.classpath)
            .arg(MAIN_CLASS)
            .arg(&cfg_path);
        Ok(cmd)
    }

    fn probe(&self, client: SocketAddr) -> Probe {
        match tcp_exchange(client, b"srvr", Duration::from_millis(500), |_| false) {
            Ok(reply) => {
                let text = String::from_utf8_lossy(&reply);
                if text.contains("Zookeeper version") {
                    Probe::Ready
                } else {
                    Probe::NotReady(text.trim().to_owned())
                }
            }
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        self.config.startup_timeout
    }
}

/// A standalone ZooKeeper JVM on a free loopback port with a temporary data directory.
///
/// Killed and cleaned up on drop. See the [module docs](self) for the command line and config.
#[derive(Debug)]
pub struct ZooKeeperServer {
    inner: ServerProcess,
    config: ZooKeeperConfig,
}

impl ZooKeeperServer {
    /// Finds the JVM and the classpath, or says what is missing.
    pub fn install() -> Result<ZooKeeperInstall, String> {
        let java = match std::env::var_os("JAVA_HOME") {
            Some(home) if !home.is_empty() => {
                let java = PathBuf::from(home).join("bin/java");
                if !java.is_file() {
                    return Err(format!(
                        "JAVA_HOME is set but {} is missing",
                        java.display()
                    ));
                }
                java
            }
            _ => find_in_path("java").ok_or_else(|| {
                "java not found in PATH (Debian: apt-get install default-jre-headless)".to_owned()
            })?,
        };
        let classpath = match std::env::var("FENCED_ZK_CLASSPATH") {
            Ok(cp) if !cp.trim().is_empty() => cp,
            _ => {
                if !Path::new(DEBIAN_ZK_JAR).is_file() {
                    return Err(format!(
                        "{DEBIAN_ZK_JAR} not found (Debian: apt-get install libzookeeper-java, \
                         or set FENCED_ZK_CLASSPATH)"
                    ));
                }
                if Path::new(DEBIAN_SLF4J_SIMPLE).is_file() {
                    format!("{DEBIAN_ZK_JAR}:{DEBIAN_SLF4J_SIMPLE}")
                } else {
                    DEBIAN_ZK_JAR.to_owned()
                }
            }
        };
        Ok(ZooKeeperInstall { java, classpath })
    }

    /// Starts with [`ZooKeeperConfig::default`] and waits until `srvr` answers.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(ZooKeeperConfig::default())
    }

    /// Starts with `config` and waits (bounded by `config.startup_timeout`) until it serves.
    pub fn start_with(config: ZooKeeperConfig) -> Result<Self, HarnessError> {
        let install = Self::install().map_err(|reason| HarnessError::Startup {
            server: "zookeeper",
            exited: false,
            reason,
            log_tail: String::new(),
        })?;
        let inner = ServerProcess::start(Box::new(ZooKeeperLauncher {
            install,
            config: config.clone(),
        }))?;
        Ok(Self { inner, config })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ZooKeeperConfig {
        &self.config
    }

    /// The connect string ZooKeeper clients want: `127.0.0.1:<port>`.
    pub fn connect_string(&self) -> String {
        self.addr().to_string()
    }

    /// The generated `zoo.cfg`.
    pub fn config_path(&self) -> PathBuf {
        self.inner.root_dir().join("zoo.cfg")
    }
}

managed_server!(ZooKeeperServer, Backend::ZooKeeper, "zk");
