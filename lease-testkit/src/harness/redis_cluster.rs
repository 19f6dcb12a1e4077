//! A Redis primary with two replicas and three Sentinels the harness runs (see
//! [`super::cluster`]).
//!
//! Every data node is a [`RedisServer`] with the durable configuration (AOF `appendfsync
//! always`, `noeviction`), on its own port and data directory; member 0 starts as the primary
//! and members 1 and 2 replicate it. Three Sentinels (`redis-server <conf> --sentinel`, the
//! same binary Debian's `redis-sentinel` package links to) watch the primary under the name
//! [`PRIMARY_NAME`] with quorum 2, `down-after-milliseconds 3000` and `failover-timeout 30000`,
//! each asking every member for `INFO` once a second (`SENTINEL DEBUG info-period 1000`).
//!
//! Clients use [`RedisCluster::url`], a `redis+sentinel://` URL naming the three Sentinels.
//! [`ClusterControl::member_url`] names one member through its client-side fault proxy.
//!
//! Faults:
//! - a replica's replication link can be routed through a fault proxy (`REPLICAOF` the proxy;
//!   the replica resumes with a partial resync) and then blackholed: [`ClusterControl::lag_replica`]
//!   and [`ClusterControl::isolate_from_peers`] do that (for the primary: every replica's link).
//!   Sentinels keep reaching every member: a member "cut from its peers" is cut from the
//!   replication stream, not from the Sentinels;
//! - [`ClusterControl::isolate_from_clients`] blackholes the member's client proxy (clients of
//!   [`ClusterControl::member_url`]; clients that follow the Sentinels connect directly);
//! - a restarted member that is not the primary is pointed at the current primary at once
//!   (`REPLICAOF`), as its configuration management would, instead of waiting for the Sentinels
//!   to convert it.
//!
//! A Sentinel corrects a replica replicating from an address other than the primary's after
//! `failover-timeout` (30 s), so a proxied link lasts that long at least; `lag_replica` sets one up
//! anew each time.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;

use super::cluster::{tail_of, ClusterControl, ClusterError, ClusterResult, Cuts};
use super::resp::{self, FromReply};
use super::server::{tcp_exchange, Launcher, Probe, ServerProcess};
use super::{HarnessError, RedisConfig, RedisServer};
use crate::proxy::FaultProxy;

/// The name the Sentinels know the primary by.
pub const PRIMARY_NAME: &str = "fenced";
/// How many data nodes the cluster has.
pub const MEMBERS: usize = 3;
/// How many Sentinels watch them.
pub const SENTINELS: usize = 3;
/// `sentinel down-after-milliseconds`. Not 1 s: a member just promoted, serving the resyncs of
/// the replicas pointed at it on a loaded 2-core machine, was seen to miss the Sentinels' pings
/// for about a second, and the Sentinels then failed it over too, in the middle of the next case.
const DOWN_AFTER_MS: u64 = 3000;
/// `sentinel failover-timeout`.
const FAILOVER_TIMEOUT_MS: u64 = 30_000;
/// How long one Redis command of the harness may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the cluster may take to settle after a start or a change of topology.
const SETTLE: Duration = Duration::from_secs(30);
/// How long a restarted member may take to be back in the cluster: longer than the
/// failover-timeout, since a Sentinel's failover still under way (reconfiguring the replicas)
/// ends only when every replica is reconfigured or that timeout passes.
const RESTART_SETTLE: Duration = Duration::from_millis(FAILOVER_TIMEOUT_MS + 15_000);

struct SentinelLauncher {
    binary: PathBuf,
    primary_port: u16,
}

impl Launcher for SentinelLauncher {
    fn name(&self) -> &'static str {
        "redis-sentinel"
    }

    fn ports_needed(&self) -> usize {
        1
    }

    fn command(&self, _root: &Path, data_dir: &Path, ports: &[u16]) -> io::Result<Command> {
        std::fs::create_dir_all(data_dir)?;
        let conf = data_dir.join("sentinel.conf");
        // Written once: a Sentinel rewrites its file with what it learned (the current primary,
        // replicas, other Sentinels, the epoch), which a restart must keep.
        if !conf.exists() {
            std::fs::write(
                &conf,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {PRIMARY_NAME} 127.0.0.1 {primary} 2\n\
                     sentinel down-after-milliseconds {PRIMARY_NAME} {DOWN_AFTER_MS}\n\
                     sentinel failover-timeout {PRIMARY_NAME} {FAILOVER_TIMEOUT_MS}\n\
                     sentinel parallel-syncs {PRIMARY_NAME} 1\n",
                    port = ports[0],
                    dir = data_dir.display(),
                    primary = self.primary_port,
                ),
            )?;
        }
        let mut cmd = Command::new(&self.binary);
        cmd.arg(&conf).arg("--sentinel");
        Ok(cmd)
    }

    fn probe(&self, client: SocketAddr) -> Probe {
        match tcp_exchange(client, b"PING\r\n", Duration::from_millis(250), |b| {
            b.ends_with(b"\r\n")
        }) {
            Ok(reply) if reply.starts_with(b"+PONG") => Probe::Ready,
            Ok(reply) => Probe::NotReady(String::from_utf8_lossy(&reply).trim().to_owned()),
            Err(e) => Probe::NotReady(e.to_string()),
        }
    }

    fn startup_timeout(&self) -> Duration {
        Duration::from_secs(15)
    }
}

/// A Redis primary, two replicas and three Sentinels (see the [module docs](self)).
pub struct RedisCluster {
    members: Vec<Arc<Mutex<RedisServer>>>,
    ports: Vec<u16>,
    sentinels: Vec<Arc<Mutex<ServerProcess>>>,
    sentinel_ports: Vec<u16>,
    client_proxies: Vec<FaultProxy>,
    /// Replication links routed through a proxy, by replica.
    links: tokio::sync::Mutex<HashMap<usize, FaultProxy>>,
    /// Which members are cut from their peers ([`ClusterControl::isolate_from_peers`],
    /// [`ClusterControl::lag_replica`]): a link is blackholed while either end is.
    cut: Cuts,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("ports", &self.ports)
            .field("sentinel_ports", &self.sentinel_ports)
            .finish()
    }
}

fn err(context: impl std::fmt::Display, e: impl std::fmt::Display) -> ClusterError {
    ClusterError(format!("{context}: {e}"))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, HarnessError> + Send + 'static,
) -> ClusterResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ClusterError(format!("harness task failed: {e}")))?
        .map_err(ClusterError::from)
}

/// One command to `127.0.0.1:port`, bounded.
async fn query<T: FromReply>(port: u16, args: &[&str]) -> ClusterResult<T> {
    match tokio::time::timeout(COMMAND_TIMEOUT, resp::command(port, args)).await {
        Ok(Ok(reply)) => T::from_reply(reply).map_err(|e| err(format!("127.0.0.1:{port}"), e)),
        Ok(Err(e)) => Err(err(format!("127.0.0.1:{port}"), e)),
        Err(_) => Err(ClusterError(format!("127.0.0.1:{port}: no answer in time"))),
    }
}

/// `INFO replication` of the node at `port`, as `field -> value`.
async fn replication(port: u16) -> ClusterResult<HashMap<String, String>> {
    let info: String = query(port, &["INFO", "replication"]).await?;
    Ok(info
        .lines()
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect())
}

/// Polls `check` until it returns `Some`, at most `bound`; the last reason on timeout.
async fn wait_for<T, F, Fut>(what: &str, bound: Duration, mut check: F) -> ClusterResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, String>>,
{
    let deadline = Instant::now() + bound;
    loop {
        let why = match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "not yet".to_owned(),
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(ClusterError(format!("{what} within {bound:?}: {why}")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl RedisCluster {
    /// Starts the three data nodes and the three Sentinels and waits until every Sentinel knows
    /// both replicas and the two other Sentinels.
    pub async fn start() -> Result<Self, ClusterError> {
        let binary = RedisServer::binary().map_err(ClusterError)?;
        let mut members = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..MEMBERS {
            let config = RedisConfig {
                extra_args: vec![
                    "--repl-diskless-sync".into(),
                    "yes".into(),
                    "--repl-diskless-sync-delay".into(),
                    "0".into(),
                ],
                ..RedisConfig::default()
            };
            let server = blocking(move || RedisServer::start_with(config)).await?;
            ports.push(server.port());
            members.push(Arc::new(Mutex::new(server)));
        }
        let mut client_proxies = Vec::new();
        for &p in &ports {
            client_proxies.push(
                FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], p)))
                    .await
                    .map_err(|e| err("starting a client proxy", e))?,
            );
        }
        for &p in &ports[1..] {
            let _: () = query(p, &["REPLICAOF", "127.0.0.1", &ports[0].to_string()]).await?;
        }
        let mut sentinels = Vec::new();
        let mut sentinel_ports = Vec::new();
        for _ in 0..SENTINELS {
            let launcher = SentinelLauncher {
                binary: binary.clone(),
                primary_port: ports[0],
            };
            let s = blocking(move || ServerProcess::start(Box::new(launcher))).await?;
            // `INFO` of each member every second instead of every 10 s: a Sentinel learns a
            // replica's priority, role or link state that a case changed (or that a restart
            // reset) within a second or two, instead of up to 10 s plus a reconnect, so the
            // harness's waits on its view settle well within their bound on a loaded machine.
            // Best effort: a Redis without `SENTINEL DEBUG` (before 7.0) keeps its 10 s.
            let _: Result<(), _> = query(
                s.addr().port(),
                &["SENTINEL", "DEBUG", "info-period", "1000"],
            )
            .await;
            sentinel_ports.push(s.addr().port());
            sentinels.push(Arc::new(Mutex::new(s)));
        }
        let cluster = RedisCluster {
            members,
            ports,
            sentinels,
            sentinel_ports,
            client_proxies,
            links: tokio::sync::Mutex::new(HashMap::new()),
            cut: Cuts::new(MEMBERS),
        };
        for r in 1..MEMBERS {
            cluster.wait_synced(r, 0).await?;
        }
        cluster.wait_sentinels_settled(0).await?;
        Ok(cluster)
    }

    /// The Sentinels' addresses.
    pub fn sentinel_addrs(&self) -> Vec<SocketAddr> {
        self.sentinel_ports
            .iter()
            .map(|p| SocketAddr::from(([127, 0, 0, 1], *p)))
            .collect()
    }

    /// The real (not proxied) address of `member`.
    pub fn member_addr(&self, member: usize) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.ports[member]))
    }

    fn check_member(&self, member: usize) -> ClusterResult<()> {
        if member < MEMBERS {
            Ok(())
        } else {
            Err(ClusterError(format!(
                "member {member} does not exist (the cluster has {MEMBERS})"
            )))
        }
    }

    /// The member a Sentinel names as the primary and that answers `role:master`: the first
    /// Sentinel's whose named primary does (one that has not learned of a failover yet names a
    /// member that is down or a replica now; the others are asked too). `Err` with the last
    /// reason when none does.
    async fn named_primary(&self) -> Result<usize, String> {
        let mut last = String::from("no Sentinel answered");
        for &s in &self.sentinel_ports {
            let addr: Option<(String, u16)> =
                match query(s, &["SENTINEL", "get-master-addr-by-name", PRIMARY_NAME]).await {
                    Ok(a) => a,
                    Err(e) => {
                        last = e.0;
                        continue;
                    }
                };
            let Some((_, port)) = addr else {
                last = format!("Sentinel {s} does not know {PRIMARY_NAME}");
                continue;
            };
            let Some(member) = self.ports.iter().position(|p| *p == port) else {
                last = format!("Sentinel {s} names an unknown primary port {port}");
                continue;
            };
            match replication(port).await {
                Ok(info) if info.get("role").map(String::as_str) == Some("master") => {
                    return Ok(member)
                }
                Ok(info) => {
                    last = format!(
                        "member {member} (named by Sentinel {s}) answers role {:?}",
                        info.get("role")
                    )
                }
                Err(e) => last = format!("member {member} (named by Sentinel {s}): {}", e.0),
            }
        }
        Err(last)
    }

    /// Waits until replica `r` replicates `primary` with its link up and has caught up with it.
    async fn wait_synced(&self, r: usize, primary: usize) -> ClusterResult<()> {
        let (rp, pp) = (self.ports[r], self.ports[primary]);
        wait_for(
            &format!("member {r} in sync with member {primary}"),
            SETTLE,
            || async move {
                let p = replication(pp).await.map_err(|e| e.0)?;
                let target: u64 = p
                    .get("master_repl_offset")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(u64::MAX);
                let info = replication(rp).await.map_err(|e| e.0)?;
                let up = info.get("master_link_status").map(String::as_str) == Some("up");
                let offset: u64 = info
                    .get("slave_repl_offset")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                Ok((up && offset >= target).then_some(()))
            },
        )
        .await
    }

    /// Waits until every Sentinel names `primary`, knows the other members as replicas and the
    /// other Sentinels.
    async fn wait_sentinels_settled(&self, primary: usize) -> ClusterResult<()> {
        for &s in &self.sentinel_ports {
            wait_for(
                &format!("Sentinel {s} settled on member {primary}"),
                SETTLE,
                || async move { Ok(self.sentinel_settled(s, primary).await?.then_some(())) },
            )
            .await?;
        }
        Ok(())
    }

    /// Whether Sentinel `s` names `primary`, sees it up, is not failing it over, and knows the
    /// other members as replicas and the other Sentinels.
    ///
    /// A failover, once a Sentinel has started it, goes on even if the primary it found down is
    /// back (a member restarted within a few seconds): without the last check, a restart could
    /// count as settled on the old primary and the failover then complete during the next case,
    /// which found the primary changed under it.
    async fn sentinel_settled(&self, s: u16, primary: usize) -> Result<bool, String> {
        let master = sentinel_master(s).await?;
        let field = |name: &str| master.get(name).map(String::as_str);
        let flags = field("flags").unwrap_or_default();
        Ok(field("port") == Some(&self.ports[primary].to_string())
            && field("num-slaves") == Some(&(MEMBERS - 1).to_string())
            && field("num-other-sentinels") == Some(&(SENTINELS - 1).to_string())
            && !flags.contains("down")
            && !flags.contains("failover_in_progress"))
    }

    /// Marks `member` cut from its peers or not and sets every proxied replication link to
    /// match, under the links' lock: blackholed while its replica or the member it replicates
    /// is cut. Returns whether `member` was cut before, and whether any member is cut now.
    async fn mark_cut(&self, member: usize, cut: bool) -> (bool, bool) {
        let links = self.links.lock().await;
        self.cut.set(member, cut, |before, marks| {
            for (&r, p) in links.iter() {
                let upstream = self
                    .ports
                    .iter()
                    .position(|&port| port == p.upstream().port());
                if upstream.map_or(marks.is_cut(r), |u| marks.severs(r, u)) {
                    p.blackhole();
                } else {
                    p.pass_through();
                }
            }
            (before.is_cut(member), marks.any())
        })
    }

    /// Every member that is up back to the default replica priority (100), which
    /// [`ClusterControl::lag_replica`] lowered. A member that is down is restarted by whoever
    /// killed it, with the default.
    async fn reset_priorities(&self) -> ClusterResult<()> {
        for m in 0..MEMBERS {
            if replication(self.ports[m]).await.is_ok() {
                self.set_priority(m, 100).await?;
            }
        }
        Ok(())
    }

    /// `Some(())` when every Sentinel names the same primary, that member answers
    /// `role:master`, and no Sentinel has a failover under way.
    async fn sentinels_agree(&self) -> Result<Option<()>, String> {
        let mut named = None;
        for &s in &self.sentinel_ports {
            let mut master = sentinel_master(s).await?;
            if master
                .get("flags")
                .is_some_and(|f| f.contains("failover_in_progress"))
            {
                return Ok(None);
            }
            let port = master.remove("port");
            if named.is_some() && named != port {
                return Ok(None);
            }
            named = port;
        }
        let Some(port) = named.and_then(|p| p.parse::<u16>().ok()) else {
            return Ok(None);
        };
        let info = replication(port).await.map_err(|e| e.0)?;
        Ok((info.get("role").map(String::as_str) == Some("master")).then_some(()))
    }

    /// Whether `member` replicates `primary` (directly or through a proxy) with its link up.
    async fn replicates(&self, member: usize, primary: usize) -> Result<bool, String> {
        let info = replication(self.ports[member]).await.map_err(|e| e.0)?;
        let port = info.get("master_port").cloned().unwrap_or_default();
        let via_proxy = match self.links.lock().await.get(&member) {
            Some(p) => {
                p.upstream().port() == self.ports[primary] && port == p.addr().port().to_string()
            }
            None => false,
        };
        Ok(info.get("role").map(String::as_str) == Some("slave")
            && (port == self.ports[primary].to_string() || via_proxy)
            && info.get("master_link_status").map(String::as_str) == Some("up"))
    }

    /// Routes replica `r`'s replication link through a new fault proxy to the current primary
    /// and waits until it is in sync over it. Returns the primary.
    async fn link_through_proxy(&self, r: usize) -> ClusterResult<usize> {
        let primary = self.leader().await?;
        if primary == r {
            return Err(ClusterError(format!(
                "member {r} is the primary, not a replica"
            )));
        }
        let proxy = FaultProxy::start(self.member_addr(primary))
            .await
            .map_err(|e| err("starting a replication proxy", e))?;
        let _: () = query(
            self.ports[r],
            &["REPLICAOF", "127.0.0.1", &proxy.addr().port().to_string()],
        )
        .await?;
        self.links.lock().await.insert(r, proxy);
        self.wait_synced(r, primary).await?;
        Ok(primary)
    }

    async fn set_priority(&self, member: usize, priority: u32) -> ClusterResult<()> {
        let _: () = query(
            self.ports[member],
            &["CONFIG", "SET", "replica-priority", &priority.to_string()],
        )
        .await?;
        Ok(())
    }

    /// What each member says of its replication (for a failure message): its port, role, the
    /// port it replicates and that link's state, or the replicas connected to it.
    async fn replication_view(&self) -> String {
        let mut out = Vec::new();
        for (m, &port) in self.ports.iter().enumerate() {
            let line = match replication(port).await {
                Ok(info) => {
                    let get = |k: &str| info.get(k).cloned().unwrap_or_else(|| "-".into());
                    let mut replicas: Vec<String> = info
                        .iter()
                        .filter(|(k, _)| k.starts_with("slave") && k[5..].parse::<u32>().is_ok())
                        .map(|(_, v)| v.clone())
                        .collect();
                    replicas.sort();
                    if get("role") == "master" {
                        format!("member {m} on {port}: master of {replicas:?}")
                    } else {
                        format!(
                            "member {m} on {port}: replica of {} (link {})",
                            get("master_port"),
                            get("master_link_status")
                        )
                    }
                }
                Err(e) => format!("member {m} on {port}: {}", e.0),
            };
            out.push(line);
        }
        out.join("; ")
    }

    /// Waits until every Sentinel reports `member`'s replica priority as `priority`.
    async fn wait_sentinels_see_priority(&self, member: usize, priority: u32) -> ClusterResult<()> {
        let port = self.ports[member].to_string();
        for &s in &self.sentinel_ports {
            let port = port.clone();
            let seen = wait_for(
                &format!("Sentinel {s} seeing member {member} with priority {priority}"),
                SETTLE,
                || {
                    let port = port.clone();
                    async move {
                        let replicas: Vec<Vec<String>> =
                            query(s, &["SENTINEL", "REPLICAS", PRIMARY_NAME])
                                .await
                                .map_err(|e| e.0)?;
                        let seen = replicas.iter().any(|r| {
                            let field = |name: &str| {
                                r.chunks(2)
                                    .find(|kv| kv.len() == 2 && kv[0] == name)
                                    .map(|kv| kv[1].clone())
                            };
                            field("port").as_deref() == Some(port.as_str())
                                && field("slave-priority") == Some(priority.to_string())
                        });
                        Ok(seen.then_some(()))
                    }
                },
            )
            .await;
            if let Err(e) = seen {
                let view = sentinel_view(s, &port).await;
                let members = self.replication_view().await;
                return Err(ClusterError(format!("{} ({view}; {members})", e.0)));
            }
        }
        Ok(())
    }
}

impl ClusterControl for RedisCluster {
    fn kind(&self) -> &'static str {
        "redis-sentinel"
    }

    fn members(&self) -> usize {
        MEMBERS
    }

    fn leader(&self) -> BoxFuture<'_, ClusterResult<usize>> {
        Box::pin(async move {
            wait_for("a primary", self.failover_bound(), || async {
                self.named_primary().await.map(Some)
            })
            .await
        })
    }

    fn kill(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            let m = self.members[member].clone();
            blocking(move || m.lock().expect("member").kill()).await
        })
    }

    fn restart(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            let m = self.members[member].clone();
            blocking(move || m.lock().expect("member").restart()).await?;
            // It replicates directly from now on (or is the primary): no longer cut, and once
            // nothing is, the priorities are reset as a heal resets them.
            self.links.lock().await.remove(&member);
            if let (true, false) = self.mark_cut(member, false).await {
                self.reset_priorities().await?;
            }
            // Converge whatever the Sentinels do meanwhile (a failover may be under way): the
            // member replicates the primary they name, and they all agree on it again.
            let back = wait_for(
                &format!("member {member} back in the cluster"),
                RESTART_SETTLE,
                || async move {
                    let primary = self.named_primary().await?;
                    if primary != member && !self.replicates(member, primary).await? {
                        let _: () = query(
                            self.ports[member],
                            &["REPLICAOF", "127.0.0.1", &self.ports[primary].to_string()],
                        )
                        .await
                        .map_err(|e| e.0)?;
                        return Ok(None);
                    }
                    for &s in &self.sentinel_ports {
                        if !self.sentinel_settled(s, primary).await? {
                            return Ok(None);
                        }
                    }
                    Ok(Some(()))
                },
            )
            .await;
            if let Err(e) = back {
                // What each Sentinel and member says, so a failure can be told apart.
                let mut sentinels = Vec::new();
                for &s in &self.sentinel_ports {
                    sentinels.push(sentinel_master_view(s).await);
                }
                let members = self.replication_view().await;
                return Err(ClusterError(format!(
                    "{} ({}; {members})",
                    e.0,
                    sentinels.join("; ")
                )));
            }
            Ok(())
        })
    }

    fn pause(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            let m = self.members[member].clone();
            blocking(move || m.lock().expect("member").pause()).await
        })
    }

    fn resume(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            let m = self.members[member].clone();
            blocking(move || m.lock().expect("member").resume()).await
        })
    }

    fn isolate_from_peers(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            let primary = self.leader().await?;
            let replicas: Vec<usize> = if primary == member {
                (0..MEMBERS).filter(|r| *r != member).collect()
            } else {
                vec![member]
            };
            for r in replicas {
                self.link_through_proxy(r).await?;
            }
            self.mark_cut(member, true).await;
            Ok(())
        })
    }

    fn isolate_from_clients(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            self.client_proxies[member].blackhole();
            Ok(())
        })
    }

    fn heal(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>> {
        Box::pin(async move {
            self.check_member(member)?;
            self.client_proxies[member].pass_through();
            let (_, still_cut) = self.mark_cut(member, false).await;
            if still_cut {
                // Another member is still cut (a lagging replica keeps the priorities its
                // promotion needs).
                return Ok(());
            }
            self.reset_priorities().await
        })
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinel_ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{PRIMARY_NAME}", hosts.join(","))
    }

    fn member_url(&self, member: usize) -> String {
        format!("redis://{}", self.client_proxies[member].addr())
    }

    fn failover_bound(&self) -> Duration {
        // Down after 3 s, a vote (Sentinels wait up to a second or so before asking), the
        // promotion and the replicas' reconfiguration; generous for a loaded 2-core machine.
        Duration::from_secs(15)
    }

    fn holder_member(&self, leader: usize) -> usize {
        leader
    }

    fn log_tails(&self) -> String {
        let mut out = String::new();
        for (i, m) in self.members.iter().enumerate() {
            let tail = tail_of(m, RedisServer::log_tail);
            out.push_str(&format!("--- member {i} ---\n{tail}\n"));
        }
        for (i, s) in self.sentinels.iter().enumerate() {
            let tail = tail_of(s, ServerProcess::log_tail);
            out.push_str(&format!("--- sentinel {i} ---\n{tail}\n"));
        }
        out
    }

    fn lag_replica(&self, member: usize) -> BoxFuture<'_, ClusterResult<bool>> {
        Box::pin(async move {
            self.check_member(member)?;
            let primary = self.link_through_proxy(member).await?;
            self.mark_cut(member, true).await;
            for other in (0..MEMBERS).filter(|m| *m != member && *m != primary) {
                self.set_priority(other, 0).await?;
                self.wait_sentinels_see_priority(other, 0).await?;
            }
            self.wait_sentinels_see_priority(member, 100).await?;
            Ok(true)
        })
    }

    /// `SENTINEL FAILOVER` on each Sentinel in turn until one starts it. A Sentinel with an
    /// attempt of its own under way answers `INPROG` (that attempt may be an election that
    /// fails), one with no replica it may promote `NOGOODSLAVE`: the next one is asked, and
    /// when none started one, every answer is in the error (ask again a moment later).
    ///
    /// Once one started, it returns when every Sentinel names the same primary with no
    /// failover under way: another Sentinel's own failover may have run at the same time, and
    /// each promotion ends with `CLIENT KILL TYPE normal` on the promoted member, which would
    /// cut the connections of whoever uses it next.
    fn force_failover(&self) -> BoxFuture<'_, ClusterResult<bool>> {
        Box::pin(async move {
            let mut refusals = Vec::new();
            for &s in &self.sentinel_ports {
                match query::<()>(s, &["SENTINEL", "FAILOVER", PRIMARY_NAME]).await {
                    Ok(()) => {
                        wait_for(
                            "the Sentinels agreeing after a forced failover",
                            SETTLE,
                            || self.sentinels_agree(),
                        )
                        .await?;
                        return Ok(true);
                    }
                    Err(e) => refusals.push(e.0),
                }
            }
            Err(ClusterError(format!(
                "no Sentinel started a failover: {}",
                refusals.join("; ")
            )))
        })
    }
}

/// What Sentinel `s` says of the primary (for a failure message): its port, flags and the
/// replicas and other Sentinels it counts.
async fn sentinel_master_view(s: u16) -> String {
    match sentinel_master(s).await {
        Ok(master) => format!(
            "Sentinel {s}: {}",
            shown(
                &master,
                &[
                    "port",
                    "flags",
                    "num-slaves",
                    "num-other-sentinels",
                    "failover-state",
                ]
            )
        ),
        Err(e) => format!("Sentinel {s}: SENTINEL MASTER failed: {e}"),
    }
}

/// What Sentinel `s` says of the primary, field by field (`SENTINEL MASTER`).
async fn sentinel_master(s: u16) -> Result<HashMap<String, String>, String> {
    let reply: Vec<String> = query(s, &["SENTINEL", "MASTER", PRIMARY_NAME])
        .await
        .map_err(|e| e.0)?;
    Ok(fields(&reply))
}

/// The fields of a Sentinel reply (`SENTINEL MASTER`, or one replica of `SENTINEL REPLICAS`),
/// which alternates names and values.
fn fields(reply: &[String]) -> HashMap<String, String> {
    reply
        .chunks_exact(2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

/// `name=value` for each of `names` that `fields` has, in the order of `names`.
fn shown(fields: &HashMap<String, String>, names: &[&str]) -> String {
    names
        .iter()
        .filter_map(|&n| fields.get(n).map(|v| format!("{n}={v}")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What Sentinel `s` reports of the replica on `port` (for a failure message): the fields that
/// say whether and when it last refreshed it.
async fn sentinel_view(s: u16, port: &str) -> String {
    let replicas: Vec<Vec<String>> = match query(s, &["SENTINEL", "REPLICAS", PRIMARY_NAME]).await {
        Ok(r) => r,
        Err(e) => return format!("SENTINEL REPLICAS failed: {}", e.0),
    };
    let all: Vec<HashMap<String, String>> = replicas.iter().map(|r| fields(r)).collect();
    let Some(entry) = all
        .iter()
        .find(|f| f.get("port").map(String::as_str) == Some(port))
    else {
        let known: Vec<&str> = all
            .iter()
            .filter_map(|f| f.get("port").map(String::as_str))
            .collect();
        return format!("Sentinel {s} does not list port {port} among its replicas {known:?}");
    };
    const SHOWN: [&str; 8] = [
        "flags",
        "slave-priority",
        "info-refresh",
        "link-pending-commands",
        "last-ok-ping-reply",
        "role-reported",
        "master-port",
        "master-link-status",
    ];
    format!(
        "Sentinel {s} reports port {port} as {}",
        shown(entry, &SHOWN)
    )
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Sentinels first, so none starts a failover while the data nodes go down.
        for s in &self.sentinels {
            if let Ok(mut s) = s.lock() {
                let _ = s.kill();
            }
        }
    }
}
