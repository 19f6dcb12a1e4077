//! Child-process plumbing shared by every real server the harness starts.
//!
//! A [`ServerProcess`] owns:
//!
//! - a temporary directory (removed on drop) holding the server's data directory
//!   ([`ServerProcess::data_dir`], `<tmp>/data`) and its log file ([`ServerProcess::log_path`],
//!   `<tmp>/server.log`, stdout and stderr appended, with one `=== harness: ...` line before each
//!   start);
//! - the loopback ports it listens on, chosen once at the first start and kept for every restart;
//! - the child process while one runs.
//!
//! Starting means: spawn, then probe the client port until the server answers or a bounded
//! timeout passes. If the child exits before it is ready during the *first* start (typically
//! because another process took the port between our probe-bind and the server's bind), the
//! harness wipes the data directory, picks fresh ports and tries again, up to
//! [`FIRST_START_ATTEMPTS`] times. A restart keeps the ports and the data, and retries the same
//! ports a few times for a short while only.
//!
//! Dropping a `ServerProcess` sends `SIGKILL`, reaps the child and removes the temporary
//! directory, also while a test is unwinding from a panic. Nothing can clean up if the test
//! process itself is killed with `SIGKILL` or aborts: the server is then orphaned.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use super::HarnessError;
use crate::process;

/// How many times the first start tries fresh ports before giving up.
pub(crate) const FIRST_START_ATTEMPTS: usize = 3;

/// How many times a restart tries the (fixed) ports before giving up.
const RESTART_ATTEMPTS: usize = 3;

/// How long a graceful [`ServerProcess::stop`] waits before falling back to `SIGKILL`.
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a restart retry waits for its ports to become bindable.
const PORT_FREE_WAIT: Duration = Duration::from_secs(1);

/// Bytes of log shown in startup-failure errors.
const LOG_TAIL_BYTES: u64 = 4096;

/// The answer of one readiness probe.
pub(crate) enum Probe {
    /// The server answers requests.
    Ready,
    /// Not yet; the string says what the probe saw (kept for the timeout error).
    NotReady(String),
}

/// How to launch and probe one kind of server. Implemented by each concrete server.
pub(crate) trait Launcher: Send + Sync {
    /// Short server name for messages, e.g. `"redis"`.
    fn name(&self) -> &'static str;
    /// How many loopback ports the server needs; `ports[0]` is the client port.
    fn ports_needed(&self) -> usize;
    /// Builds the command line; may write config files under `root`. Called before every start.
    fn command(&self, root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command>;
    /// One bounded readiness probe against the client port.
    fn probe(&self, client: SocketAddr) -> Probe;
    /// The bound for one start (spawn to ready).
    fn startup_timeout(&self) -> Duration;
}

/// A real server running as a child process of the test, with its ports and temporary storage.
///
/// Not constructed directly: use [`super::RedisServer`], [`super::EtcdServer`] or
/// [`super::ZooKeeperServer`], which expose the same operations.
pub(crate) struct ServerProcess {
    launcher: Box<dyn Launcher>,
    child: Option<Child>,
    ports: Vec<u16>,
    log_path: PathBuf,
    data_dir: PathBuf,
    /// Dropped last (field order): the directory outlives the child.
    root: TempDir,
    starts: usize,
    last_start: Duration,
}

impl ServerProcess {
    /// Creates the temporary directory, picks ports and starts the server until it is ready.
    pub(crate) fn start(launcher: Box<dyn Launcher>) -> Result<Self, HarnessError> {
        let name = launcher.name();
        let root = tempfile::Builder::new()
            .prefix(&format!("fenced-{name}-"))
            .tempdir()
            .map_err(|e| HarnessError::io(format!("create temp dir for {name}"), e))?;
        let data_dir = root.path().join("data");
        let log_path = root.path().join("server.log");
        let mut server = Self {
            launcher,
            child: None,
            ports: Vec::new(),
            log_path,
            data_dir,
            root,
            starts: 0,
            last_start: Duration::ZERO,
        };
        let mut last_err = None;
        for _ in 0..FIRST_START_ATTEMPTS {
            if server.data_dir.exists() {
                fs::remove_dir_all(&server.data_dir)
                    .map_err(|e| HarnessError::io(format!("wipe {name} data dir"), e))?;
            }
            server.ports = free_ports(server.launcher.ports_needed())
                .map_err(|e| HarnessError::io(format!("pick free ports for {name}"), e))?;
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                Err(e @ HarnessError::Startup { exited: true, .. }) => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// Server name, e.g. `"redis"`.
    pub(crate) fn name(&self) -> &'static str {
        self.launcher.name()
    }

    /// The client address, `127.0.0.1:<port>`; unchanged across restarts.
    pub(crate) fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.ports[0]))
    }

    /// All ports the server listens on (`[0]` is the client port).
    pub(crate) fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The PID of the running child, `None` after [`Self::kill`]/[`Self::stop`].
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The data directory, kept across restarts.
    pub(crate) fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The temporary directory holding data, config and log.
    pub(crate) fn root_dir(&self) -> &Path {
        self.root.path()
    }

    /// The log file (stdout and stderr of every start, appended).
    pub(crate) fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `LOG_TAIL_BYTES` bytes of the log.
    pub(crate) fn log_tail(&self) -> String {
        log_tail(&self.log_path)
    }

    /// How long the last successful start took from spawn to ready.
    pub(crate) fn last_start_duration(&self) -> Duration {
        self.last_start
    }

    /// Whether the child is still running (reaps it if it exited by itself).
    pub(crate) fn is_running(&mut self) -> bool {
        match &mut self.child {
            None => false,
            Some(child) => match child.try_wait() {
                Ok(None) => true,
                Ok(Some(_)) | Err(_) => {
                    self.child = None;
                    false
                }
            },
        }
    }

    /// `SIGKILL` and reap (what it forked is left to end by itself, thawed if paused).
    /// Idempotent: `Ok` when nothing runs.
    pub(crate) fn kill(&mut self) -> Result<(), HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // A paused server's forked processes are thawed first, while they are still its
        // children (their PIDs cannot be reused meanwhile: a stopped parent does not reap).
        process::thaw(&process::children(child.id()));
        // The child may have exited on its own (then it is a zombie and SIGKILL is harmless).
        match process::kill(child.id()) {
            Ok(()) | Err(process::SignalError::NoSuchProcess { .. }) => {}
            Err(e) => {
                self.child = Some(child);
                return Err(e.into());
            }
        }
        child
            .wait()
            .map_err(|e| HarnessError::io(format!("reap {}", self.name()), e))?;
        Ok(())
    }

    /// `SIGTERM` (plus `SIGCONT`, to it and what it forked, in case it is paused), wait up to
    /// [`STOP_TIMEOUT`], then `SIGKILL`. Returns the exit status, `None` if nothing ran. The data
    /// directory is kept.
    pub(crate) fn stop(&mut self) -> Result<Option<ExitStatus>, HarnessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(None);
        };
        let pid = child.id();
        let _ = process::terminate(pid);
        // Paused ([`Self::pause`]): the processes it forked must go on to end.
        process::thaw(&process::children(pid));
        let _ = process::resume(pid);
        match wait_timeout(&mut child, STOP_TIMEOUT) {
            Ok(Some(status)) => Ok(Some(status)),
            Ok(None) => {
                let _ = process::kill(pid);
                let status = child
                    .wait()
                    .map_err(|e| HarnessError::io(format!("reap {}", self.name()), e))?;
                Ok(Some(status))
            }
            Err(e) => {
                self.child = Some(child);
                Err(HarnessError::io(format!("wait for {}", self.name()), e))
            }
        }
    }

    /// Starts again on the same ports and data directory and waits until ready. A running
    /// child is killed with `SIGKILL` first (a crash restart); call [`Self::stop`] first for a
    /// clean one.
    pub(crate) fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill()?;
        let mut last_err = None;
        for attempt in 0..RESTART_ATTEMPTS {
            if attempt > 0 {
                // The usual cause of a failed restart is a port still taken: wait (bounded) until
                // every port can be bound again rather than for a fixed time.
                wait_ports_bindable(&self.ports, PORT_FREE_WAIT);
            }
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(e @ HarnessError::Startup { exited: true, .. }) => last_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last_err.expect("at least one attempt"))
    }

    /// `SIGSTOP` the running child and the processes it forked ([`process::pause_tree`]).
    pub(crate) fn pause(&self) -> Result<(), HarnessError> {
        let pid = self.pid().ok_or(HarnessError::NotRunning {
            server: self.name(),
        })?;
        Ok(process::pause_tree(pid)?)
    }

    /// `SIGCONT` what [`Self::pause`] froze.
    pub(crate) fn resume(&self) -> Result<(), HarnessError> {
        let pid = self.pid().ok_or(HarnessError::NotRunning {
            server: self.name(),
        })?;
        Ok(process::resume_tree(pid)?)
    }

    /// One start on `self.ports`: spawn, then probe until ready, exit or timeout.
    fn spawn_and_wait(&mut self) -> Result<(), HarnessError> {
        let name = self.name();
        fs::create_dir_all(&self.data_dir)
            .map_err(|e| HarnessError::io(format!("create {name} data dir"), e))?;
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(|e| HarnessError::io(format!("open {name} log"), e))?;
        let mut command = self
            .launcher
            .command(self.root.path(), &self.data_dir, &self.ports)
            .map_err(|e| HarnessError::io(format!("prepare {name} command"), e))?;
        self.starts += 1;
        writeln!(
            log,
            "=== harness: start #{} of {name} on ports {:?}: {:?}",
            self.starts, self.ports, command
        )
        .map_err(|e| HarnessError::io(format!("write {name} log"), e))?;
        let stderr = log
            .try_clone()
            .map_err(|e| HarnessError::io(format!("clone {name} log handle"), e))?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr));
        let began = Instant::now();
        let child = command.spawn().map_err(|e| HarnessError::Startup {
            server: name,
            exited: false,
            reason: format!("cannot spawn {command:?}: {e}"),
            log_tail: String::new(),
        })?;
        self.child = Some(child);

        let timeout = self.launcher.startup_timeout();
        let deadline = began + timeout;
        let client = self.addr();
        let mut last_probe: String;
        loop {
            let exited = self
                .child
                .as_mut()
                .expect("child set above")
                .try_wait()
                .map_err(|e| HarnessError::io(format!("poll {name}"), e))?;
            if let Some(status) = exited {
                self.child = None;
                return Err(HarnessError::Startup {
                    server: name,
                    exited: true,
                    reason: format!("exited before ready ({status}) on ports {:?}", self.ports),
                    log_tail: self.log_tail(),
                });
            }
            match self.launcher.probe(client) {
                Probe::Ready => {
                    self.last_start = began.elapsed();
                    tracing::debug!(server = name, elapsed = ?self.last_start, "server ready");
                    return Ok(());
                }
                Probe::NotReady(why) => last_probe = why,
            }
            if Instant::now() >= deadline {
                let _ = self.kill();
                return Err(HarnessError::Startup {
                    server: name,
                    exited: false,
                    reason: format!(
                        "not ready within {timeout:?} on {client} (last probe: {last_probe})"
                    ),
                    log_tail: self.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            process::thaw(&process::children(child.id()));
            let _ = process::kill(child.id());
            let _ = child.wait();
        }
        // `root` (TempDir) is dropped after this, removing data, config and log.
    }
}

impl std::fmt::Debug for ServerProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerProcess")
            .field("name", &self.name())
            .field("ports", &self.ports)
            .field("pid", &self.pid())
            .field("root", &self.root.path())
            .finish()
    }
}

/// Picks `n` distinct free loopback ports, each bound once to check it is free, all below the
/// kernel's ephemeral range (`ip_local_port_range`) and never handed out twice by this process.
///
/// The ports are free when returned but not reserved. Below the ephemeral range, no outgoing
/// connection and no `bind(0)` (a fault proxy's listener) of any process can take one before
/// the server binds it: a client connection's local port once took a ZooKeeper ensemble
/// member's client port, and every retry of that member reused the port. Where the ephemeral
/// range leaves too little room below it, ports come from `bind(0)` as before.
pub fn free_ports(n: usize) -> io::Result<Vec<u16>> {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static HANDED_OUT: OnceLock<Mutex<HashSet<u16>>> = OnceLock::new();
    let range = below_ephemeral();
    if range.len() < 1000 {
        let listeners = (0..n)
            .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
            .collect::<io::Result<Vec<_>>>()?;
        return listeners
            .iter()
            .map(|l| l.local_addr().map(|a| a.port()))
            .collect();
    }
    let mut handed = HANDED_OUT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let mut held = Vec::with_capacity(n);
    for _ in 0..range.len() {
        if held.len() == n {
            break;
        }
        let port = rand::Rng::gen_range(&mut rand::thread_rng(), range.clone());
        if handed.contains(&port) || held.iter().any(|(p, _)| *p == port) {
            continue;
        }
        if let Ok(l) = TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
            held.push((port, l));
        }
    }
    if held.len() < n {
        return Err(io::Error::new(
            io::ErrorKind::AddrNotAvailable,
            format!("no {n} free loopback ports in {range:?}"),
        ));
    }
    Ok(held
        .into_iter()
        .map(|(port, _)| {
            handed.insert(port);
            port
        })
        .collect())
}

/// The ports from 10000 up to the start of the kernel's ephemeral range (Linux default 32768).
fn below_ephemeral() -> std::ops::Range<u16> {
    let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    10000..low.max(10000)
}

/// Polls until every loopback port in `ports` can be bound (as the server will, with
/// `SO_REUSEADDR`), or `limit` passes. Returns whether they all could.
fn wait_ports_bindable(ports: &[u16], limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if ports
            .iter()
            .all(|p| TcpListener::bind((Ipv4Addr::LOCALHOST, *p)).is_ok())
        {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The last few kilobytes of a log file, or a note saying why it cannot be read.
pub(crate) fn log_tail(path: &Path) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    read().unwrap_or_else(|e| format!("<cannot read {}: {e}>", path.display()))
}

/// Waits for `child` to exit for at most `timeout`; `Ok(None)` if it is still running.
fn wait_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `request` to `addr` and reads the answer, all within `timeout`.
///
/// Reading stops at EOF, once `complete(&bytes_so_far)` is true, or when the deadline passes
/// with some bytes read (then those are returned). With nothing read by the deadline the
/// result is an error of kind `WouldBlock`/`TimedOut`. Shared by the readiness probes; handy in
/// tests that speak a raw protocol.
pub fn tcp_exchange(
    addr: SocketAddr,
    request: &[u8],
    timeout: Duration,
    complete: impl Fn(&[u8]) -> bool,
) -> io::Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout)?;
    stream.set_nodelay(true)?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(request)?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while !complete(&out) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            if out.is_empty() {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time"));
            }
            break;
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if out.is_empty() {
                    return Err(e);
                }
                break;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}
