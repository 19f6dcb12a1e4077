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
//! The temporary directory is handed to the `postgres` user. Readiness: a startup packet for user
//! `postgres` answered by an authentication message (`R`), not by "the database system is
//! starting up".

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

fn as_postgres(program: &Path) -> Command {
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

struct PostgresLauncher {
    bin: PathBuf,
    ids: (u32, u32),
}

impl Launcher for PostgresLauncher {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn ports_needed(&self) -> usize {
        1
    }

    fn command(&self, root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        let (uid, gid) = self.ids;
        std::os::unix::fs::chown(root, Some(uid), Some(gid))?;
        std::fs::create_dir_all(data_dir)?;
        std::os::unix::fs::chown(data_dir, Some(uid), Some(gid))?;
        if !data_dir.join("PG_VERSION").exists() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))?;
            let out = as_postgres(&self.bin.join("initdb"))
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
        let mut cmd = as_postgres(&self.bin.join("postgres"));
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
            Ok(reply) => Probe::NotReady(String::from_utf8_lossy(&reply).into_owned()),
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        Duration::from_secs(60)
    }
}

/// A PostgreSQL server child process on a free loopback port with a temporary data directory,
/// running as the `postgres` user with trust authentication for user `postgres`.
#[derive(Debug)]
pub struct PostgresServer {
    inner: ServerProcess,
}

impl PostgresServer {
    /// The `postgres` binary that would run, or why it cannot.
    pub fn binary() -> Result<PathBuf, String> {
        postgres_ids()?;
        bin_dir().map(|d| d.join("postgres"))
    }

    /// Initialises a cluster and starts it, waiting until it accepts connections.
    pub fn start() -> Result<Self, HarnessError> {
        let startup = |reason: String| HarnessError::Startup {
            server: "postgres",
            exited: false,
            reason,
            log_tail: String::new(),
        };
        let bin = bin_dir().map_err(startup)?;
        let ids = postgres_ids().map_err(startup)?;
        let inner = ServerProcess::start(Box::new(PostgresLauncher { bin, ids }))?;
        Ok(Self { inner })
    }

    /// A connection URL for user `postgres`, database `postgres`.
    pub fn connection_url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.addr())
    }
}

managed_server!(PostgresServer, Backend::Postgres, "postgres");
