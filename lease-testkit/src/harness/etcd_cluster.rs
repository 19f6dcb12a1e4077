//! A three-member etcd cluster the harness runs (see [`super::cluster`]).
//!
//! Every member is a real `etcd` child process in its own network namespace
//! ([`super::netns::NetLab`]), listening on `<member ip>:2379` (clients) and `<member ip>:2380` (Raft),
//! with its own data directory (kept across restarts, removed on drop):
//!
//! ```text
//! ip netns exec <ns i> etcd --name m<i> --data-dir <tmp i>/data
//!      --listen-client-urls http://<ip i>:2379 --advertise-client-urls http://<ip i>:2379
//!      --listen-peer-urls http://<ip i>:2380 --initial-advertise-peer-urls http://<ip i>:2380
//!      --initial-cluster m0=http://<ip 0>:2380,m1=…,m2=… --initial-cluster-state new
//!      --initial-cluster-token fenced-<tag> --heartbeat-interval H --election-timeout E
//!      --pre-vote --logger zap --log-outputs stderr
//! ```
//!
//! **Clients** reach member `i` through a [`FaultProxy`] on `127.0.0.1:<proxy port i>` (the
//! root namespace): [`EtcdCluster::url`] names the three proxies, [`EtcdCluster::member_url`] one.
//! [`ClusterControl::isolate_from_clients`] blackholes that proxy.
//!
//! **Peers**: etcd needs one peer URL per member that every member agrees on, so per-pair proxies
//! cannot carry Raft traffic; instead [`ClusterControl::isolate_from_peers`] installs blackhole
//! routes between the member's namespace and the others' (see [`super::netns`]), both directions, while
//! the root namespace (its clients' proxy) still reaches it.
//!
//! **Leader**: [`ClusterControl::leader`] asks every member `POST /v3/maintenance/status` (the
//! JSON gateway, straight to the member, not through its proxy) and answers the member that
//! reports itself leader and that a majority of members report as leader, polling (bounded by
//! [`EtcdCluster::failover_bound`]) while there is none.
//!
//! **Timing**: heartbeat 50 ms, election timeout 500 ms by default (20/200 as the single server
//! uses gives spurious elections on a loaded 2-core machine with three members). `--pre-vote`
//! keeps a member that rejoins after a cut from deposing a healthy leader.
//!
//! Without root or `ip`, or without `etcd`, [`EtcdCluster::availability`] says why; the subject
//! then applies [`super::server_unavailable`].

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use super::cluster::{ClusterControl, ClusterError, ClusterResult};
use super::netns::NetLab;
use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{Backend, EtcdServer, HarnessError, ServerControl};
use crate::proxy::FaultProxy;

/// The client port inside every member's namespace.
pub const CLIENT_PORT: u16 = 2379;
/// The peer (Raft) port inside every member's namespace.
pub const PEER_PORT: u16 = 2380;

/// How to run the cluster. `Default`: 3 members, heartbeat 50 ms, election timeout 500 ms,
/// 30 s startup bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdClusterConfig {
    /// How many members (odd, 1 to 7).
    pub members: usize,
    /// `--heartbeat-interval` in milliseconds.
    pub heartbeat_interval_ms: u32,
    /// `--election-timeout` in milliseconds.
    pub election_timeout_ms: u32,
    /// Bound on one member's start or restart (spawn to healthy).
    pub startup_timeout: Duration,
}

impl Default for EtcdClusterConfig {
    fn default() -> Self {
        Self {
            members: 3,
            heartbeat_interval_ms: 50,
            election_timeout_ms: 500,
            startup_timeout: Duration::from_secs(30),
        }
    }
}

struct MemberLauncher {
    binary: PathBuf,
    lab: Arc<NetLab>,
    index: usize,
    tag: String,
    config: EtcdClusterConfig,
}

impl MemberLauncher {
    fn client_addr(&self) -> SocketAddr {
        SocketAddr::from((self.lab.member_ip(self.index), CLIENT_PORT))
    }
}

impl Launcher for MemberLauncher {
    fn name(&self) -> &'static str {
        "etcd cluster member"
    }

    fn ports_needed(&self) -> usize {
        // The member listens in its own namespace on fixed ports; this loopback port is unused.
        1
    }

    fn command(&self, _root: &Path, data_dir: &Path, _ports: &[u16]) -> io::Result<Command> {
        let ip = self.lab.member_ip(self.index);
        let client = format!("http://{ip}:{CLIENT_PORT}");
        let peer = format!("http://{ip}:{PEER_PORT}");
        let initial: Vec<String> = (0..self.lab.len())
            .map(|j| format!("m{j}=http://{}:{PEER_PORT}", self.lab.member_ip(j)))
            .collect();
        let mut cmd = self.lab.command(self.index, &self.binary);
        cmd.args(["--name", &format!("m{}", self.index)])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &format!("fenced-{}", self.tag)])
            .args([
                "--heartbeat-interval",
                &self.config.heartbeat_interval_ms.to_string(),
            ])
            .args([
                "--election-timeout",
                &self.config.election_timeout_ms.to_string(),
            ])
            .arg("--pre-vote")
            .args(["--logger", "zap", "--log-outputs", "stderr"]);
        Ok(cmd)
    }

    fn probe(&self, _loopback: SocketAddr) -> Probe {
        // `/health` is true once the member knows a leader and a read went through Raft: a
        // restarted member has rejoined.
        let addr = self.client_addr();
        let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
        match tcp_exchange(addr, request.as_bytes(), Duration::from_millis(500), |_| {
            false
        }) {
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

/// What a member reports about itself (`/v3/maintenance/status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberStatus {
    /// The member's own id.
    pub member_id: u64,
    /// The leader it knows (0: none).
    pub leader: u64,
    /// Its Raft term.
    pub raft_term: u64,
    /// Its applied Raft index.
    pub raft_index: u64,
}

/// Shared by the cluster and the blocking tasks it spawns. Field order: members drop (are
/// killed) before the namespaces go.
struct Inner {
    members: Vec<Mutex<ServerProcess>>,
    ips: Vec<Ipv4Addr>,
    lab: Arc<NetLab>,
}

impl Inner {
    fn member(&self, m: usize) -> ClusterResult<std::sync::MutexGuard<'_, ServerProcess>> {
        self.members
            .get(m)
            .ok_or_else(|| ClusterError(format!("there is no member {m}")))
            .map(|g| g.lock().expect("member lock"))
    }

    /// One bounded status request to member `m`.
    fn status(&self, m: usize) -> Result<MemberStatus, String> {
        let addr = SocketAddr::from((self.ips[m], CLIENT_PORT));
        let request = format!(
            "POST /v3/maintenance/status HTTP/1.0\r\nHost: {addr}\r\nContent-Type: \
             application/json\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        let reply = tcp_exchange(addr, request.as_bytes(), Duration::from_millis(400), |_| {
            false
        })
        .map_err(|e| format!("member {m}: {e}"))?;
        let text = String::from_utf8_lossy(&reply);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b)
            .ok_or_else(|| format!("member {m}: no HTTP body in {text:?}"))?;
        let json: serde_json::Value =
            serde_json::from_str(body).map_err(|e| format!("member {m}: {e} in {body:?}"))?;
        let num = |v: &serde_json::Value| -> u64 {
            v.as_str()
                .and_then(|s| s.parse().ok())
                .or_else(|| v.as_u64())
                .unwrap_or(0)
        };
        Ok(MemberStatus {
            member_id: num(&json["header"]["member_id"]),
            leader: num(&json["leader"]),
            raft_term: num(&json["raftTerm"]),
            raft_index: num(&json["raftIndex"]),
        })
    }

    /// Every member's status, asked in parallel (a frozen member costs one timeout).
    fn statuses(&self) -> Vec<Result<MemberStatus, String>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..self.members.len())
                .map(|m| s.spawn(move || self.status(m)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("status panicked".into())))
                .collect()
        })
    }

    /// The member that says it leads and that a majority names as leader, if any.
    fn leader_once(&self) -> Result<usize, String> {
        let statuses = self.statuses();
        let majority = self.members.len() / 2 + 1;
        for (m, s) in statuses.iter().enumerate() {
            let Ok(s) = s else { continue };
            if s.leader == 0 || s.leader != s.member_id {
                continue;
            }
            let votes = statuses
                .iter()
                .filter(|o| o.as_ref().is_ok_and(|o| o.leader == s.member_id))
                .count();
            if votes >= majority {
                return Ok(m);
            }
        }
        Err(statuses
            .iter()
            .enumerate()
            .map(|(m, s)| match s {
                Ok(s) => format!(
                    "member {m}: id {:x} leader {:x} term {}",
                    s.member_id, s.leader, s.raft_term
                ),
                Err(e) => e.clone(),
            })
            .collect::<Vec<_>>()
            .join("; "))
    }

    /// Starts (or restarts) every member at once: a member is healthy only with a quorum.
    fn restart_all(&self) -> Result<(), HarnessError> {
        std::thread::scope(|s| {
            let handles: Vec<_> = self
                .members
                .iter()
                .map(|m| s.spawn(move || m.lock().expect("member lock").restart()))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("restart panicked"))
                .collect::<Result<Vec<()>, _>>()
                .map(|_| ())
        })
    }
}

/// A running etcd cluster (see the [module docs](self)); killed and cleaned up on drop.
pub struct EtcdCluster {
    /// Dropped first: no client connection outlives the members.
    proxies: Vec<FaultProxy>,
    inner: Arc<Inner>,
    config: EtcdClusterConfig,
}

impl std::fmt::Debug for EtcdCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCluster")
            .field("url", &self.url())
            .field("namespaces", &self.inner.lab.tag())
            .field("config", &self.config)
            .finish()
    }
}

impl EtcdCluster {
    /// `Ok(etcd binary)` when a cluster can run here (etcd on `PATH`, root and `ip` for the
    /// namespaces), else why not.
    pub fn availability() -> Result<PathBuf, String> {
        let etcd = EtcdServer::binary()?;
        NetLab::availability()?;
        Ok(etcd)
    }

    /// Starts a cluster with [`EtcdClusterConfig::default`] (see [`Self::start_with`]).
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(EtcdClusterConfig::default()).await
    }

    /// Creates the namespaces, starts every member at once, waits until each is healthy, then
    /// starts one client proxy per member. Must run inside a Tokio runtime (the proxies).
    pub async fn start_with(config: EtcdClusterConfig) -> Result<Self, HarnessError> {
        let binary = Self::availability().map_err(|reason| HarnessError::Startup {
            server: "etcd cluster",
            exited: false,
            reason,
            log_tail: String::new(),
        })?;
        assert!(
            config.members % 2 == 1 && config.members <= 7,
            "an etcd cluster of 1, 3, 5 or 7 members"
        );
        let cfg = config.clone();
        let inner = tokio::task::spawn_blocking(move || -> Result<Inner, HarnessError> {
            let lab = Arc::new(NetLab::create("etcd", cfg.members)?);
            let tag = lab.tag().to_owned();
            let started: Vec<Result<ServerProcess, HarnessError>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..cfg.members)
                    .map(|index| {
                        let launcher = MemberLauncher {
                            binary: binary.clone(),
                            lab: lab.clone(),
                            index,
                            tag: tag.clone(),
                            config: cfg.clone(),
                        };
                        s.spawn(move || ServerProcess::start(Box::new(launcher)))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("member start panicked"))
                    .collect()
            });
            let mut members = Vec::new();
            for (i, r) in started.into_iter().enumerate() {
                match r {
                    Ok(p) => members.push(Mutex::new(p)),
                    Err(e) => {
                        return Err(HarnessError::Startup {
                            server: "etcd cluster",
                            exited: false,
                            reason: format!("member {i}: {e}"),
                            log_tail: String::new(),
                        })
                    }
                }
            }
            let ips = (0..cfg.members).map(|i| lab.member_ip(i)).collect();
            Ok(Inner { members, ips, lab })
        })
        .await
        .map_err(|e| {
            HarnessError::io("start the etcd cluster", io::Error::other(e.to_string()))
        })??;
        let inner = Arc::new(inner);
        let mut proxies = Vec::new();
        for ip in &inner.ips {
            let proxy = FaultProxy::start(SocketAddr::from((*ip, CLIENT_PORT)))
                .await
                .map_err(|e| HarnessError::io("start a member's client proxy", e))?;
            proxies.push(proxy);
        }
        Ok(Self {
            proxies,
            inner,
            config,
        })
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &EtcdClusterConfig {
        &self.config
    }

    /// Member `m`'s client address inside its namespace (no proxy: the harness's own path).
    pub fn direct_addr(&self, m: usize) -> SocketAddr {
        SocketAddr::from((self.inner.ips[m], CLIENT_PORT))
    }

    /// Member `m`'s client proxy (what [`ClusterControl::member_url`] names).
    pub fn proxy(&self, m: usize) -> &FaultProxy {
        &self.proxies[m]
    }

    /// Member `m`'s status, asked directly (bounded by 400 ms).
    pub async fn status(&self, m: usize) -> Result<MemberStatus, String> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || inner.status(m))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Member `m`'s PID while it runs.
    pub fn pid(&self, m: usize) -> Option<u32> {
        self.inner.member(m).ok().and_then(|p| p.pid())
    }

    /// The end of member `m`'s log.
    pub fn log_tail(&self, m: usize) -> String {
        self.inner
            .member(m)
            .map(|p| p.log_tail())
            .unwrap_or_default()
    }

    /// A [`ServerControl`] over the whole cluster, for the suite's single-server restart cases:
    /// `kill` crashes every member, `restart` starts them all again on their data and waits until
    /// each is healthy, `pause`/`resume` freeze and thaw all of them.
    pub fn whole(&self) -> Box<dyn ServerControl> {
        Box::new(WholeCluster {
            inner: self.inner.clone(),
            url: self.url(),
        })
    }

    fn blocking<T: Send + 'static>(
        &self,
        what: String,
        f: impl FnOnce(&Inner) -> ClusterResult<T> + Send + 'static,
    ) -> BoxFuture<'_, ClusterResult<T>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || f(&inner))
                .await
                .map_err(|e| ClusterError(format!("{what}: {e}")))?
        })
    }
}

impl ClusterControl for EtcdCluster {
    fn kind(&self) -> &'static str {
        "etcd-cluster"
    }

    fn members(&self) -> usize {
        self.inner.members.len()
    }

    fn leader(&self) -> BoxFuture<'_, ClusterResult<usize>> {
        let bound = self.failover_bound();
        Box::pin(async move {
            let deadline = Instant::now() + bound;
            loop {
                let inner = self.inner.clone();
                let found = tokio::task::spawn_blocking(move || inner.leader_once())
                    .await
                    .map_err(|e| ClusterError(format!("asking for the leader: {e}")))?;
                match found {
                    Ok(m) => return Ok(m),
                    Err(why) if Instant::now() >= deadline => {
                        return Err(ClusterError(format!(
                            "no etcd leader within {bound:?}: {why}"
                        )))
                    }
                    // A poll interval; the condition is checked above.
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        })
    }

    fn kill(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        self.blocking(format!("killing member {member}"), move |i| {
            Ok(i.member(member)?.kill()?)
        })
    }

    fn restart(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        self.blocking(format!("restarting member {member}"), move |i| {
            i.member(member)?
                .restart()
                .map_err(|e| ClusterError(format!("restarting etcd member {member}: {e}")))
        })
    }

    fn pause(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        self.blocking(format!("pausing member {member}"), move |i| {
            Ok(i.member(member)?.pause()?)
        })
    }

    fn resume(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        self.blocking(format!("resuming member {member}"), move |i| {
            Ok(i.member(member)?.resume()?)
        })
    }

    fn isolate_from_peers(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        self.blocking(
            format!("cutting member {member} from its peers"),
            move |i| {
                drop(i.member(member)?);
                Ok(i.lab.isolate(member)?)
            },
        )
    }

    fn isolate_from_clients(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.proxies
                .get(member)
                .ok_or_else(|| ClusterError(format!("there is no member {member}")))?
                .blackhole();
            Ok(())
        })
    }

    fn heal(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.proxies
                .get(member)
                .ok_or_else(|| ClusterError(format!("there is no member {member}")))?
                .heal();
            self.blocking(format!("healing member {member}"), move |i| {
                Ok(i.lab.heal(member)?)
            })
            .await
        })
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self.proxies.iter().map(|p| p.addr().to_string()).collect();
        format!("etcd://{}", hosts.join(","))
    }

    fn member_url(&self, member: usize) -> String {
        format!("etcd://{}", self.proxies[member].addr())
    }

    /// A crashed leader is noticed after one (randomised, up to twice the) election timeout;
    /// pre-vote and a vote round follow, and on a loaded 2-core machine a split vote or a slow
    /// member can cost another round or two. Measured here: about 1 to 2 s with the default
    /// 500 ms election timeout; the bound is 10 election timeouts plus 2 s.
    fn failover_bound(&self) -> Duration {
        Duration::from_millis(u64::from(self.config.election_timeout_ms) * 10)
            + Duration::from_secs(2)
    }
}

/// The whole cluster as one [`ServerControl`] (see [`EtcdCluster::whole`]).
struct WholeCluster {
    inner: Arc<Inner>,
    url: String,
}

impl ServerControl for WholeCluster {
    fn backend(&self) -> Backend {
        Backend::Etcd
    }
    fn url(&self) -> String {
        self.url.clone()
    }
    fn controllable(&self) -> bool {
        true
    }
    fn pid(&self) -> Option<u32> {
        self.inner.members[0].lock().expect("member lock").pid()
    }
    fn kill(&mut self) -> Result<(), HarnessError> {
        for m in &self.inner.members {
            m.lock().expect("member lock").kill()?;
        }
        Ok(())
    }
    fn stop(&mut self) -> Result<(), HarnessError> {
        for m in &self.inner.members {
            m.lock().expect("member lock").stop()?;
        }
        Ok(())
    }
    fn restart(&mut self) -> Result<(), HarnessError> {
        self.inner.restart_all()
    }
    fn pause(&self) -> Result<(), HarnessError> {
        for m in &self.inner.members {
            m.lock().expect("member lock").pause()?;
        }
        Ok(())
    }
    fn resume(&self) -> Result<(), HarnessError> {
        for m in &self.inner.members {
            m.lock().expect("member lock").resume()?;
        }
        Ok(())
    }
}
