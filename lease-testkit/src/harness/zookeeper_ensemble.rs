//! A three-server ZooKeeper ensemble the harness runs (see [`super::cluster`]).
//!
//! Each server is a `QuorumPeerMain` JVM (Debian's jars, as [`super::ZooKeeperServer`] runs
//! one) with its own data directory (`myid` written before every start) and its own `zoo.cfg`:
//!
//! ```text
//! tickTime=<tick>  initLimit=10  syncLimit=5        (tick 200 ms: a follower cut off gives up
//!                                                    after 1 s, a new leader syncs within 2 s)
//! minSessionTimeout=<2 x tick>  maxSessionTimeout=60000
//! clientPort=<real client port>  clientPortAddress=127.0.0.1
//! reconfigEnabled=false  standaloneEnabled=false  admin.enableServer=false
//! 4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump
//! server.<i>=127.0.0.1:<i's real quorum port>:<i's real election port>      (its own line)
//! server.<j>=127.0.0.1:<proxy i->j quorum>:<proxy i->j election>            (every peer j)
//! ```
//!
//! A server binds to its own line, and dials every peer at the address its own file gives: so
//! every ordered pair `(i -> j)` has two [`FaultProxy`]s of its own (quorum and election) that
//! forward to `j`'s real ports. ZooKeeper 3.8 with `reconfigEnabled=false` accepts files that
//! differ this way (the quorum verifiers all have version 0, so no server adopts another's
//! addresses). Clients reach server `i` through its own client-side proxy.
//!
//! - [`ClusterControl::isolate_from_peers`] blackholes every proxy `(i -> j)` and `(j -> i)`.
//!   That cuts all quorum traffic (followers dial the leader's quorum port through their own
//!   file; proposals, pings and session touches go over that connection) and every election
//!   connection a server dials from its file. One leak is known: when a lower-numbered server's
//!   election connection reaches a higher-numbered one, the higher one drops it and dials back at
//!   the address the lower one announced (its own line, the real port), not through a proxy.
//!   Such a connection opened before the cut survives it, so election notifications may still
//!   flow; they cannot make the cut server serve (it can neither lead a majority nor reach a
//!   leader's quorum port), which is what the cases rely on.
//! - [`ClusterControl::isolate_from_clients`] blackholes the member's client-side proxy.
//! - [`ClusterControl::leader`] asks every server with `mntr` on its real client port and
//!   answers the single one that reports `leader` with a majority of synced followers.
//!
//! The JVMs are kept cheap for a 2-core machine: `-Xmx128m -Xss512k -XX:+UseSerialGC
//! -XX:TieredStopAtLevel=1 -XX:CICompilerCount=1 -XX:-UsePerfData -XX:ActiveProcessorCount=1`.
//!
//! The process plumbing is the harness's `ServerProcess`: the launcher asks it for one
//! (unused) port and uses the ports the ensemble chose before starting, because every server's
//! file must name its peers' proxies, which need the peers' real ports first; the readiness probe
//! waits only for the JVM to answer `srvr` at all (a server without a quorum answers "not
//! currently serving"), the ensemble then waits for the quorum itself.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use super::cluster::{tail_of, ClusterControl, ClusterError, ClusterResult, Cuts};
use super::server::{free_ports, tcp_exchange, Launcher, Probe, ServerProcess};
use super::{Backend, HarnessError, ServerControl, ZooKeeperInstall, ZooKeeperServer};
use crate::proxy::FaultProxy;

/// The quorum main class.
const MAIN_CLASS: &str = "org.apache.zookeeper.server.quorum.QuorumPeerMain";

/// How often the waits poll the servers.
const POLL: Duration = Duration::from_millis(50);

/// How to run the ensemble. `Default`: three servers, `tickTime` 200 ms, `initLimit` 10,
/// `syncLimit` 5, sessions 400 ms to 60 s, heap 128 MiB each, 60 s bound for the first start of
/// the whole ensemble (three JVMs on two cores) and 30 s for a member's restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZooKeeperEnsembleConfig {
    /// Number of servers (3 unless a test needs otherwise).
    pub servers: usize,
    /// `tickTime`.
    pub tick_time: Duration,
    /// `initLimit` (ticks a follower may take to sync with a new leader).
    pub init_limit: u32,
    /// `syncLimit` (ticks a follower may fall silent before the leader drops it, and the reverse).
    pub sync_limit: u32,
    /// `maxSessionTimeout`.
    pub max_session_timeout: Duration,
    /// `-Xmx<heap_mb>m`.
    pub heap_mb: u32,
    /// Bound on the first start, until the quorum serves.
    pub startup_timeout: Duration,
    /// Bound on one member's restart, until it has joined the quorum.
    pub restart_timeout: Duration,
}

impl Default for ZooKeeperEnsembleConfig {
    fn default() -> Self {
        Self {
            servers: 3,
            tick_time: Duration::from_millis(200),
            init_limit: 10,
            sync_limit: 5,
            max_session_timeout: Duration::from_secs(60),
            heap_mb: 128,
            startup_timeout: Duration::from_secs(60),
            restart_timeout: Duration::from_secs(30),
        }
    }
}

/// A server's real ports.
#[derive(Debug, Clone, Copy)]
struct Ports {
    client: u16,
    quorum: u16,
    election: u16,
}

struct MemberLauncher {
    install: ZooKeeperInstall,
    config: ZooKeeperEnsembleConfig,
    id: usize,
    client: SocketAddr,
    /// Every `server.N=...` line of this server's file.
    server_lines: Vec<String>,
}

impl Launcher for MemberLauncher {
    fn name(&self) -> &'static str {
        "zookeeper-ensemble"
    }

    fn ports_needed(&self) -> usize {
        // The ports were chosen by the ensemble (see the module docs); this one goes unused.
        1
    }

    fn command(&self, root: &Path, data_dir: &Path, _ports: &[u16]) -> io::Result<Command> {
        let c = &self.config;
        let tick = c.tick_time.as_millis().max(1);
        std::fs::write(data_dir.join("myid"), format!("{}\n", self.id))?;
        let mut cfg = format!(
            "tickTime={tick}\n\
             initLimit={init}\n\
             syncLimit={sync}\n\
             minSessionTimeout={min}\n\
             maxSessionTimeout={max}\n\
             dataDir={data}\n\
             clientPort={port}\n\
             clientPortAddress=127.0.0.1\n\
             admin.enableServer=false\n\
             reconfigEnabled=false\n\
             standaloneEnabled=false\n\
             4lw.commands.whitelist=srvr,ruok,stat,mntr,cons,dump\n\
             maxClientCnxns=0\n",
            init = c.init_limit,
            sync = c.sync_limit,
            min = 2 * tick,
            max = c.max_session_timeout.as_millis().max(2 * tick),
            data = data_dir.display(),
            port = self.client.port(),
        );
        for line in &self.server_lines {
            cfg.push_str(line);
            cfg.push('\n');
        }
        let cfg_path = root.join("zoo.cfg");
        std::fs::write(&cfg_path, cfg)?;
        let mut cmd = Command::new(&self.install.java);
        cmd.arg(format!("-Xmx{}m", c.heap_mb))
            .arg("-Xms32m")
            .arg("-Xss512k")
            .arg("-XX:+UseSerialGC")
            .arg("-XX:TieredStopAtLevel=1")
            .arg("-XX:CICompilerCount=1")
            .arg("-XX:-UsePerfData")
            .arg("-XX:ActiveProcessorCount=1")
            .arg("-Dzookeeper.admin.enableServer=false")
            .arg("-cp")
            .arg(&self.install.classpath)
            .arg(MAIN_CLASS)
            .arg(&cfg_path);
        Ok(cmd)
    }

    fn probe(&self, _dummy: SocketAddr) -> Probe {
        // Up as a process: any answer to `srvr`, serving or not (the quorum is waited for apart).
        match tcp_exchange(self.client, b"srvr", Duration::from_millis(500), |_| false) {
            Ok(reply) if !reply.is_empty() => Probe::Ready,
            Ok(_) => Probe::NotReady("empty answer to srvr".into()),
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    /// One member's start (first start or restart) is bounded by the restart bound; the
    /// ensemble bounds the quorum with `startup_timeout` apart.
    #[allow(clippy::misnamed_getters)]
    fn startup_timeout(&self) -> Duration {
        self.config.restart_timeout
    }
}

/// What one server says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemberState {
    /// No answer (down, frozen, starting).
    Down(String),
    /// Up but not serving (looking for a leader, or syncing).
    NotServing,
    /// A follower (or observer) that serves.
    Follower,
    /// The leader, with how many followers it counts as synced.
    Leader {
        /// `zk_synced_followers`.
        synced_followers: usize,
    },
}

/// Asks `client` with `mntr` (blocking, bounded by `timeout`).
pub fn member_state(client: SocketAddr, timeout: Duration) -> MemberState {
    let reply = match tcp_exchange(client, b"mntr", timeout, |_| false) {
        Ok(r) => String::from_utf8_lossy(&r).into_owned(),
        Err(e) => return MemberState::Down(e.to_string()),
    };
    if reply.is_empty() {
        return MemberState::Down("empty answer to mntr".into());
    }
    let field = |name: &str| {
        reply.lines().find_map(|l| {
            let (k, v) = l.split_once('\t')?;
            (k.trim() == name).then(|| v.trim().to_owned())
        })
    };
    match field("zk_server_state").as_deref() {
        Some("leader") => MemberState::Leader {
            synced_followers: field("zk_synced_followers")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        },
        Some("follower") | Some("observer") => MemberState::Follower,
        _ => MemberState::NotServing,
    }
}

/// The two proxies of one ordered pair of servers.
struct PeerLink {
    from: usize,
    to: usize,
    quorum: FaultProxy,
    election: FaultProxy,
}

/// A three-server ZooKeeper ensemble on loopback, every hop through a fault proxy; see the
/// [module docs](self). Killed and cleaned up on drop.
pub struct ZooKeeperEnsemble {
    config: ZooKeeperEnsembleConfig,
    members: Vec<Arc<Mutex<ServerProcess>>>,
    clients: Vec<SocketAddr>,
    client_proxies: Vec<FaultProxy>,
    links: Vec<PeerLink>,
    /// Which members are cut from their peers: a link is blackholed while either end is.
    cut: Cuts,
}

impl std::fmt::Debug for ZooKeeperEnsemble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperEnsemble")
            .field("clients", &self.clients)
            .field(
                "client_proxies",
                &self
                    .client_proxies
                    .iter()
                    .map(|p| p.addr())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

fn lock(m: &Mutex<ServerProcess>) -> MutexGuard<'_, ServerProcess> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> ClusterResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ClusterError(format!("a blocking harness task panicked: {e}")))
}

impl ZooKeeperEnsemble {
    /// Finds the JVM and the jars (as [`ZooKeeperServer::install`]).
    pub fn install() -> Result<ZooKeeperInstall, String> {
        ZooKeeperServer::install()
    }

    /// Starts with [`ZooKeeperEnsembleConfig::default`].
    pub async fn start() -> Result<Self, HarnessError> {
        Self::start_with(ZooKeeperEnsembleConfig::default()).await
    }

    /// Chooses ports, starts the proxies (on the calling Tokio runtime, which must outlive the
    /// ensemble) and the servers, and waits until a leader serves with every follower synced.
    pub async fn start_with(config: ZooKeeperEnsembleConfig) -> Result<Self, HarnessError> {
        let install = Self::install().map_err(|reason| HarnessError::Startup {
            server: "zookeeper-ensemble",
            exited: false,
            reason,
            log_tail: String::new(),
        })?;
        let n = config.servers;
        let raw = free_ports(3 * n).map_err(|e| HarnessError::io("pick ensemble ports", e))?;
        let ports: Vec<Ports> = (0..n)
            .map(|i| Ports {
                client: raw[3 * i],
                quorum: raw[3 * i + 1],
                election: raw[3 * i + 2],
            })
            .collect();
        let clients: Vec<SocketAddr> = ports.iter().map(|p| loopback(p.client)).collect();
        let mut client_proxies = Vec::new();
        for c in &clients {
            client_proxies.push(
                FaultProxy::start(*c)
                    .await
                    .map_err(|e| HarnessError::io("start a client proxy", e))?,
            );
        }
        let mut links = Vec::new();
        for from in 0..n {
            for to in (0..n).filter(|t| *t != from) {
                let quorum = FaultProxy::start(loopback(ports[to].quorum))
                    .await
                    .map_err(|e| HarnessError::io("start a quorum proxy", e))?;
                let election = FaultProxy::start(loopback(ports[to].election))
                    .await
                    .map_err(|e| HarnessError::io("start an election proxy", e))?;
                links.push(PeerLink {
                    from,
                    to,
                    quorum,
                    election,
                });
            }
        }
        let mut launchers = Vec::new();
        for (i, own) in ports.iter().enumerate() {
            let mut lines = Vec::new();
            for j in 0..n {
                if j == i {
                    lines.push(format!(
                        "server.{i}=127.0.0.1:{}:{}",
                        own.quorum, own.election
                    ));
                } else {
                    let link = links
                        .iter()
                        .find(|l| l.from == i && l.to == j)
                        .expect("a link per ordered pair");
                    lines.push(format!(
                        "server.{j}=127.0.0.1:{}:{}",
                        link.quorum.addr().port(),
                        link.election.addr().port()
                    ));
                }
            }
            launchers.push(MemberLauncher {
                install: install.clone(),
                config: config.clone(),
                id: i,
                client: clients[i],
                server_lines: lines,
            });
        }
        let starts: Vec<_> = launchers
            .into_iter()
            .map(|l| tokio::task::spawn_blocking(move || ServerProcess::start(Box::new(l))))
            .collect();
        let mut members = Vec::new();
        let mut failure = None;
        for s in starts {
            match s.await {
                Ok(Ok(p)) => members.push(Arc::new(Mutex::new(p))),
                Ok(Err(e)) => failure = failure.or(Some(e)),
                Err(e) => {
                    failure = failure.or(Some(HarnessError::io(
                        "start an ensemble member",
                        io::Error::other(e.to_string()),
                    )))
                }
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        let ensemble = Self {
            cut: Cuts::new(members.len()),
            config,
            members,
            clients,
            client_proxies,
            links,
        };
        let (clients, timeout) = (ensemble.clients.clone(), ensemble.config.startup_timeout);
        let whole = tokio::task::spawn_blocking(move || wait_whole(&clients, timeout))
            .await
            .map_err(|e| {
                HarnessError::io("wait for the quorum", io::Error::other(e.to_string()))
            })?;
        if let Err(why) = whole {
            return Err(HarnessError::Startup {
                server: "zookeeper-ensemble",
                exited: false,
                reason: why,
                log_tail: ensemble.log_tails(),
            });
        }
        Ok(ensemble)
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ZooKeeperEnsembleConfig {
        &self.config
    }

    /// The connect string naming every server through its client-side proxy.
    pub fn connect_string(&self) -> String {
        self.client_proxies
            .iter()
            .map(|p| p.addr().to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Server `member`'s client address through its proxy.
    pub fn client_proxy_addr(&self, member: usize) -> SocketAddr {
        self.client_proxies[member].addr()
    }

    /// Server `member`'s real client address (no proxy: for the harness's own probes).
    pub fn client_addr(&self, member: usize) -> SocketAddr {
        self.clients[member]
    }

    /// What server `member` says about itself now (bounded, blocking: call from a blocking
    /// context or `spawn_blocking`).
    pub fn state(&self, member: usize) -> MemberState {
        member_state(self.clients[member], Duration::from_millis(500))
    }

    /// Server `member`'s PID while it runs.
    pub fn pid(&self, member: usize) -> Option<u32> {
        lock(&self.members[member]).pid()
    }

    /// The end of every server's log, for errors.
    pub fn log_tails(&self) -> String {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                format!(
                    "--- server {i} ---\n{}",
                    tail_of(m, ServerProcess::log_tail)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn check(&self, member: usize) -> ClusterResult<()> {
        if member < self.members.len() {
            Ok(())
        } else {
            Err(ClusterError(format!(
                "member {member} does not exist (the ensemble has {})",
                self.members.len()
            )))
        }
    }

    /// Marks `member` cut from its peers or not, and sets its links to match: blackholed while
    /// either end is cut (healing one member keeps the links another cut still needs).
    fn set_peer_links(&self, member: usize, cut: bool) {
        self.cut.set(member, cut, |_, marks| {
            for l in self
                .links
                .iter()
                .filter(|l| l.from == member || l.to == member)
            {
                for p in [&l.quorum, &l.election] {
                    if marks.severs(l.from, l.to) {
                        p.blackhole();
                    } else {
                        p.heal();
                    }
                }
            }
        })
    }

    /// Waits (bounded) until `member` serves as leader or follower.
    async fn wait_serving(&self, member: usize, timeout: Duration) -> ClusterResult<()> {
        let client = self.clients[member];
        let deadline = Instant::now() + timeout;
        loop {
            let state = blocking(move || member_state(client, Duration::from_millis(500))).await?;
            if matches!(state, MemberState::Follower | MemberState::Leader { .. }) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(ClusterError(format!(
                    "zookeeper server {member} did not join the quorum within {timeout:?} \
                     (last: {state:?})"
                )));
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// Every member's state, blocking.
fn states(clients: &[SocketAddr]) -> Vec<MemberState> {
    clients
        .iter()
        .map(|c| member_state(*c, Duration::from_millis(500)))
        .collect()
}

/// The single leader with a majority (itself and synced followers), if there is exactly one.
fn sole_leader(states: &[MemberState]) -> Option<usize> {
    let majority = states.len() / 2 + 1;
    let leaders: Vec<usize> = states
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            MemberState::Leader { synced_followers } if synced_followers + 1 >= majority => Some(i),
            _ => None,
        })
        .collect();
    match leaders.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// Waits (blocking, bounded) until one leader serves and every member follows it.
fn wait_whole(clients: &[SocketAddr], timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        let s = states(clients);
        let all_in = s
            .iter()
            .all(|m| matches!(m, MemberState::Follower | MemberState::Leader { .. }));
        if all_in && sole_leader(&s).is_some() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the ensemble did not form within {timeout:?}: {s:?}"
            ));
        }
        std::thread::sleep(POLL);
    }
}

impl ClusterControl for ZooKeeperEnsemble {
    fn kind(&self) -> &'static str {
        "zookeeper-ensemble"
    }

    fn members(&self) -> usize {
        self.members.len()
    }

    fn leader(&self) -> BoxFuture<'_, ClusterResult<usize>> {
        Box::pin(async move {
            let bound = self.failover_bound();
            let deadline = Instant::now() + bound;
            loop {
                let clients = self.clients.clone();
                let s = blocking(move || states(&clients)).await?;
                if let Some(l) = sole_leader(&s) {
                    return Ok(l);
                }
                if Instant::now() >= deadline {
                    return Err(ClusterError(format!(
                        "no single zookeeper leader with a majority within {bound:?}: {s:?}"
                    )));
                }
                tokio::time::sleep(POLL).await;
            }
        })
    }

    fn kill(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            let m = self.members[member].clone();
            blocking(move || lock(&m).kill())
                .await?
                .map_err(|e| ClusterError(format!("killing zookeeper server {member}: {e}")))
        })
    }

    fn restart(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            let m = self.members[member].clone();
            blocking(move || lock(&m).restart())
                .await?
                .map_err(|e| ClusterError(format!("restarting zookeeper server {member}: {e}")))?;
            self.wait_serving(member, self.config.restart_timeout).await
        })
    }

    fn pause(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            let m = self.members[member].clone();
            blocking(move || lock(&m).pause())
                .await?
                .map_err(|e| ClusterError(format!("pausing zookeeper server {member}: {e}")))
        })
    }

    fn resume(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            let m = self.members[member].clone();
            blocking(move || lock(&m).resume())
                .await?
                .map_err(|e| ClusterError(format!("resuming zookeeper server {member}: {e}")))
        })
    }

    fn isolate_from_peers(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            self.set_peer_links(member, true);
            Ok(())
        })
    }

    fn isolate_from_clients(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            self.client_proxies[member].blackhole();
            Ok(())
        })
    }

    fn heal(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check(member)?;
            self.set_peer_links(member, false);
            self.client_proxies[member].heal();
            Ok(())
        })
    }

    fn url(&self) -> String {
        format!("zk://{}", self.connect_string())
    }

    fn member_url(&self, member: usize) -> String {
        format!("zk://{}", self.client_proxies[member].addr())
    }

    /// A crashed leader's followers notice at once (the socket closes) or after `syncLimit`
    /// ticks (a frozen or cut leader); the election takes a few ticks plus the notification
    /// timeouts, and the new leader then has `initLimit` ticks to sync a majority. With the
    /// default 200 ms tick: 1 s + 2 s + the election, which on a loaded 2-core machine (three
    /// JVMs) was measured to take up to about 2 s; the bound is twice the sum of the limits plus
    /// 4 s.
    fn failover_bound(&self) -> Duration {
        let ticks = self.config.sync_limit + self.config.init_limit;
        self.config.tick_time * ticks * 2 + Duration::from_secs(4)
    }

    fn log_tails(&self) -> String {
        ZooKeeperEnsemble::log_tails(self)
    }
}

/// The whole ensemble as one [`ServerControl`], for the suite's single-server restart cases:
/// `kill` crashes every server, `restart` starts every server again on its data and waits until
/// the quorum serves, `pause`/`resume` freeze and thaw all of them.
pub struct WholeEnsemble(pub Arc<ZooKeeperEnsemble>);

impl ServerControl for WholeEnsemble {
    fn backend(&self) -> Backend {
        Backend::ZooKeeper
    }

    fn url(&self) -> String {
        self.0.url()
    }

    fn controllable(&self) -> bool {
        true
    }

    fn pid(&self) -> Option<u32> {
        self.0.pid(0)
    }

    fn kill(&mut self) -> Result<(), HarnessError> {
        for m in &self.0.members {
            lock(m).kill()?;
        }
        Ok(())
    }

    fn stop(&mut self) -> Result<(), HarnessError> {
        for m in &self.0.members {
            lock(m).stop()?;
        }
        Ok(())
    }

    fn restart(&mut self) -> Result<(), HarnessError> {
        self.kill()?;
        let handles: Vec<_> = self
            .0
            .members
            .iter()
            .map(|m| {
                let m = m.clone();
                std::thread::spawn(move || lock(&m).restart())
            })
            .collect();
        for h in handles {
            h.join().map_err(|_| {
                HarnessError::io(
                    "restart an ensemble member",
                    io::Error::other("the restart thread panicked"),
                )
            })??;
        }
        wait_whole(&self.0.clients, self.0.config.startup_timeout).map_err(|reason| {
            HarnessError::Startup {
                server: "zookeeper-ensemble",
                exited: false,
                reason,
                log_tail: self.0.log_tails(),
            }
        })
    }

    fn pause(&self) -> Result<(), HarnessError> {
        for m in &self.0.members {
            lock(m).pause()?;
        }
        Ok(())
    }

    fn resume(&self) -> Result<(), HarnessError> {
        for m in &self.0.members {
            lock(m).resume()?;
        }
        Ok(())
    }
}
