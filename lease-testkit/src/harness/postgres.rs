//! A real PostgreSQL server as a child process (a protected resource for the fence tests).
//!
//! PostgreSQL refuses to run as root, so the harness runs it as the `postgres` system user (from
//! Debian's `postgresql-common`) with `setpriv`, which changes user and then *execs*: the PID the
//! harness holds is the postmaster itself, so `SIGKILL`, `SIGSTOP` and restart act on the server.
//!
//! ```text
//! setpriv --reuid postgres --regid postgres --init-groups -- initdb -D <tmp>/data -A trust -U postgres --no-sync
//! setpriv --reuid postgres --regid postgres --init-groups -- postgres -D <tmp>/data -p P -k <tmp>
//!         -c listen_addresses=127.0.0.1 -c fsync=on
//! ```
//!
//! The temporary directory is handed to the `postgres` user. A harness that does not run as root
//! (a developer's own account) runs both directly, as itself: it is unprivileged already, and
//! could neither hand files to another user nor switch to one. Readiness: a startup packet for user
//! `postgres` answered by an authentication message (`R`), not by "the database system is
//! starting up" (or, on a server that accepts TCP only over TLS, by its `pg_hba.conf` refusal of
//! the plain probe, which is only sent once the server takes connections).
//!
//! TLS ([`PostgresConfig::tls`]): the certificate and key (PEM, made by the test) are written into
//! the data directory, owned by `postgres`, the key with mode 0600, and the server starts with
//! `-c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key`.
//! [`PostgresConfig::tls_only`] replaces `pg_hba.conf` so TCP connections are accepted only over
//! TLS (`hostssl`; the Unix socket stays `trust`).
//!
//! Client certificates ([`PostgresConfig::client_ca_pem`]): the CA (PEM, made by the test) is
//! written as `root.crt` and the server starts with `-c ssl_ca_file=root.crt`, so it asks every
//! TLS client for a certificate; `pg_hba.conf` becomes `hostssl all all 127.0.0.1/32 cert` (and
//! `::1/128`): a TCP connection must be over TLS with a certificate signed by that CA whose
//! common name (CN) is the user name (`postgres`). The Unix socket stays `trust`.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{managed_server, Backend, HarnessError};

/// Where Debian installs the server binaries (the newest version wins).
fn bin_dir() -> Result<PathBuf, String> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|_| {
            "PostgreSQL server not installed (Debian: apt-get install postgresql)".to_string()
        })?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("postgres").exists() && p.join("initdb").exists())
        .collect();
    dirs.sort();
    dirs.pop().ok_or_else(|| {
        "no /usr/lib/postgresql/*/bin/postgres (Debian: apt-get install postgresql)".into()
    })
}

/// Whom the server runs as: as root, the `postgres` system user (`Some` of its uid and gid;
/// PostgreSQL refuses to run as root); as anyone else, that user itself (`None`: the harness's
/// user is already unprivileged, and could neither hand files to another user nor switch to it).
fn server_ids() -> Result<Option<(u32, u32)>, String> {
    use std::os::unix::fs::MetadataExt;
    // `/proc/self` belongs to the effective user.
    let root = std::fs::metadata("/proc/self").map_or(true, |m| m.uid() == 0);
    if root {
        postgres_ids().map(Some)
    } else {
        Ok(None)
    }
}

fn postgres_ids() -> Result<(u32, u32), String> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(|e| format!("/etc/passwd: {e}"))?;
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.first() == Some(&"postgres") && f.len() > 3)
                .then(|| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
                .flatten()
        })
        .ok_or_else(|| "no `postgres` system user (Debian: apt-get install postgresql)".into())
}

/// `program` run as the server's user: through `setpriv` when the harness runs as root.
fn as_postgres(program: &Path, ids: Option<(u32, u32)>) -> Command {
    if ids.is_none() {
        return Command::new(program);
    }
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid",
        "postgres",
        "--regid",
        "postgres",
        "--init-groups",
        "--",
    ])
    .arg(program);
    cmd
}

/// A server certificate and its private key, PEM.
#[derive(Clone)]
pub struct PostgresTls {
    /// The certificate chain (server certificate first), PEM.
    pub cert_pem: String,
    /// The certificate's private key, PEM (PKCS#8 or PKCS#1).
    pub key_pem: String,
}

impl std::fmt::Debug for PostgresTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTls").finish_non_exhaustive()
    }
}

/// How the harness configures a PostgreSQL server. `Default` is the plain server of
/// [`PostgresServer::start`].
#[derive(Debug, Clone, Default)]
pub struct PostgresConfig {
    /// Serve TLS with this certificate (`ssl=on`).
    pub tls: Option<PostgresTls>,
    /// Accept TCP connections only over TLS (`hostssl` lines only in `pg_hba.conf`). Needs `tls`.
    pub tls_only: bool,
    /// Require a client certificate signed by this CA (PEM), with the user name as its common
    /// name: `ssl_ca_file` is this CA and `pg_hba.conf` has only `hostssl ... cert` lines for
    /// TCP. Implies `tls_only`; needs `tls`.
    pub client_ca_pem: Option<String>,
}

/// The `pg_hba.conf` of a server that takes TCP connections only over TLS.
const HBA_TLS_ONLY: &str = "\
# Written by the test harness: TCP only over TLS.
local   all all              trust
hostssl all all 127.0.0.1/32 trust
hostssl all all ::1/128      trust
";

/// The `pg_hba.conf` of a server that takes TCP connections only over TLS with a client
/// certificate whose CN is the user name.
const HBA_CLIENT_CERT: &str = "\
# Written by the test harness: TCP only over TLS, with a client certificate (CN = user).
local   all all              trust
hostssl all all 127.0.0.1/32 cert
hostssl all all ::1/128      cert
";

struct PostgresLauncher {
    bin: PathBuf,
    ids: Option<(u32, u32)>,
    config: PostgresConfig,
}

impl PostgresLauncher {
    /// Writes `contents` to `path`, owned by the server's user, with `mode`.
    fn write_owned(&self, path: &Path, contents: &str, mode: u32) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(path, contents)?;
        self.own(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
    }

    /// Hands `path` to the `postgres` user when the harness runs as root (else it is the
    /// harness's own already).
    fn own(&self, path: &Path) -> io::Result<()> {
        match self.ids {
            Some((uid, gid)) => std::os::unix::fs::chown(path, Some(uid), Some(gid)),
            None => Ok(()),
        }
    }
}

impl Launcher for PostgresLauncher {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn ports_needed(&self) -> usize {
        1
    }

    fn command(&self, root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        self.own(root)?;
        std::fs::create_dir_all(data_dir)?;
        self.own(data_dir)?;
        if !data_dir.join("PG_VERSION").exists() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))?;
            let out = as_postgres(&self.bin.join("initdb"), self.ids)
                .arg("-D")
                .arg(data_dir)
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
                .output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "initdb failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                )));
            }
        }
        let mut tls_args = Vec::new();
        if let Some(tls) = &self.config.tls {
            let cert = data_dir.join("server.crt");
            let key = data_dir.join("server.key");
            self.write_owned(&cert, &tls.cert_pem, 0o644)?;
            // PostgreSQL refuses a key file that others can read.
            self.write_owned(&key, &tls.key_pem, 0o600)?;
            tls_args = vec![
                "-c".to_string(),
                "ssl=on".to_string(),
                "-c".to_string(),
                format!("ssl_cert_file={}", cert.display()),
                "-c".to_string(),
                format!("ssl_key_file={}", key.display()),
            ];
        }
        if let Some(ca) = &self.config.client_ca_pem {
            if self.config.tls.is_none() {
                return Err(io::Error::other(
                    "client_ca_pem needs a server certificate (tls)",
                ));
            }
            let ca_file = data_dir.join("root.crt");
            self.write_owned(&ca_file, ca, 0o644)?;
            tls_args.extend([
                "-c".to_string(),
                format!("ssl_ca_file={}", ca_file.display()),
            ]);
            self.write_owned(&data_dir.join("pg_hba.conf"), HBA_CLIENT_CERT, 0o600)?;
        } else if self.config.tls_only {
            if self.config.tls.is_none() {
                return Err(io::Error::other("tls_only needs a certificate (tls)"));
            }
            self.write_owned(&data_dir.join("pg_hba.conf"), HBA_TLS_ONLY, 0o600)?;
        }
        let mut cmd = as_postgres(&self.bin.join("postgres"), self.ids);
        cmd.args(&tls_args);
        cmd.arg("-D")
            .arg(data_dir)
            .args(["-p", &ports[0].to_string()])
            .arg("-k")
            .arg(root)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=on",
                "-c",
                "max_connections=200",
            ]);
        Ok(cmd)
    }

    fn probe(&self, client: SocketAddr) -> Probe {
        let mut msg = Vec::new();
        let body: &[u8] = b"user\0postgres\0database\0postgres\0\0";
        msg.extend_from_slice(&((8 + body.len()) as u32).to_be_bytes());
        msg.extend_from_slice(&196608u32.to_be_bytes());
        msg.extend_from_slice(body);
        match tcp_exchange(client, &msg, Duration::from_millis(500), |b| !b.is_empty()) {
            Ok(reply) if reply.first() == Some(&b'R') => Probe::Ready,
            // A TLS-only server refuses the plain probe in its authentication step, which it
            // reaches only once it accepts connections (28000: no pg_hba.conf entry).
            Ok(reply)
                if (self.config.tls_only || self.config.client_ca_pem.is_some())
                    && reply.first() == Some(&b'E')
                    && String::from_utf8_lossy(&reply).contains("pg_hba.conf") =>
            {
                Probe::Ready
            }
            Ok(reply) => Probe::NotReady(String::from_utf8_lossy(&reply).into_owned()),
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        Duration::from_secs(60)
    }
}

/// A PostgreSQL server child process on a free loopback port with a temporary data directory,
/// running as the `postgres` system user (as the harness's own user when that is not root) with
/// trust authentication for user `postgres`.
#[derive(Debug)]
pub struct PostgresServer {
    inner: ServerProcess,
}

impl PostgresServer {
    /// The `postgres` binary that would run, or why it cannot.
    pub fn binary() -> Result<PathBuf, String> {
        server_ids()?;
        bin_dir().map(|d| d.join("postgres"))
    }

    /// Initialises a cluster and starts it, waiting until it accepts connections.
    pub fn start() -> Result<Self, HarnessError> {
        Self::start_with(PostgresConfig::default())
    }

    /// Like [`Self::start`], configured by `config` (for example TLS); restarts keep it.
    pub fn start_with(config: PostgresConfig) -> Result<Self, HarnessError> {
        let startup = |reason: String| HarnessError::Startup {
            server: "postgres",
            exited: false,
            reason,
            log_tail: String::new(),
        };
        let bin = bin_dir().map_err(startup)?;
        let ids = server_ids().map_err(startup)?;
        let inner = ServerProcess::start(Box::new(PostgresLauncher { bin, ids, config }))?;
        Ok(Self { inner })
    }

    /// A whole-server crash, as when the machine dies: `SIGSTOP` the postmaster, `SIGKILL` every
    /// backend it forked, then `SIGKILL` and reap the postmaster. ([`Self::kill`] kills the
    /// postmaster only; its backends then finish what they are doing, answer, and exit.) Data
    /// directory and port are kept for [`Self::restart`]. `Ok` if it was not running.
    pub fn crash(&mut self) -> Result<(), HarnessError> {
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        // The postmaster alone (it forks no more); its backends are killed, stopped or not.
        crate::process::pause(pid)?;
        for child in crate::process::children(pid) {
            let _ = crate::process::kill(child);
        }
        self.kill()
    }

    /// A connection URL for user `postgres`, database `postgres`.
    pub fn connection_url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.addr())
    }
}

/// As a [`Self::crash`]: killing the postmaster alone (what dropping the process does) would
/// leave its backends and helper processes running until they notice it died.
impl Drop for PostgresServer {
    fn drop(&mut self) {
        let _ = self.crash();
    }
}

managed_server!(PostgresServer, Backend::Postgres, "postgres");
