//! The servers measured against: started for the run by the harness (Debian's packages, on free
//! loopback ports) or given as endpoints, and their own request counters, read before and after
//! each measurement so round trips are counted by the server, not assumed.

use std::any::Any;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::locks::BenchResult;

/// The backends the comparison covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Backend {
    /// Redis (with AOF `appendfsync always`, as our adapter requires by default).
    Redis,
    /// etcd.
    Etcd,
    /// ZooKeeper.
    ZooKeeper,
    /// Consul (ours only: no peer library is measured).
    Consul,
    /// Any other URL of ours (memory, a third-party adapter): ours only.
    Other,
}

impl Backend {
    /// Its name in the report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Redis => "Redis",
            Backend::Etcd => "etcd",
            Backend::ZooKeeper => "ZooKeeper",
            Backend::Consul => "Consul",
            Backend::Other => "other",
        }
    }
}

/// One server and how every client measured reaches it.
pub(crate) struct Server {
    /// Which backend.
    pub(crate) backend: Backend,
    /// Our coordinator URL.
    pub(crate) url: String,
    /// The raw clients' and peers' endpoint: a Redis URL, etcd `http://host:port`, ZooKeeper
    /// `host:port`.
    pub(crate) endpoint: String,
    /// Where its request counters are read.
    pub(crate) counters: Counters,
    /// Held only to stop the server when the benchmark ends.
    _started: Option<Box<dyn Any + Send>>,
}

/// A server's own request counters, and its process for its CPU time.
#[derive(Clone, Debug)]
pub(crate) struct Counters {
    /// Where the request counters are read.
    pub(crate) source: Source,
    /// The server's PID when it runs on this machine (started by the harness).
    pub(crate) pid: Option<u32>,
}

impl Counters {
    /// Nothing read.
    pub(crate) fn none() -> Self {
        Counters {
            source: Source::None,
            pid: None,
        }
    }
}

/// Where a server's request counters are read.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    /// `INFO` of the Redis server at this URL.
    Redis(String),
    /// The `/metrics` of etcd's plain-HTTP client port.
    Etcd(SocketAddr),
    /// ZooKeeper's `mntr` four-letter word.
    ZooKeeper(SocketAddr),
    /// Not read.
    None,
}

/// Counts read off a server at one moment.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reading {
    /// Requests the server received from clients (Redis: commands processed, script-invoked
    /// commands not included; etcd: gRPC messages received; ZooKeeper: packets received).
    pub(crate) requests: u64,
    /// By command or method, where the server breaks them down (Redis counts the commands a
    /// script invokes here too).
    pub(crate) by_name: BTreeMap<String, u64>,
    /// CPU time (user + system) of this process.
    pub(crate) client_cpu: Duration,
    /// CPU time of the server's process, when it runs here.
    pub(crate) server_cpu: Option<Duration>,
}

/// CPU time (user + system) of process `pid` (`self` for this one), from `/proc`.
pub(crate) fn cpu_time(pid: &str) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces), in clock ticks of 1/100 s on
    // Linux: utime is the 14th field, stime the 15th.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

impl Reading {
    /// What happened between `self` (before) and `after`.
    pub(crate) fn delta(&self, after: &Reading) -> Reading {
        let by_name = after
            .by_name
            .iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(*self.by_name.get(k).unwrap_or(&0));
                (d > 0).then(|| (k.clone(), d))
            })
            .collect();
        Reading {
            requests: after.requests.saturating_sub(self.requests),
            by_name,
            client_cpu: after.client_cpu.saturating_sub(self.client_cpu),
            server_cpu: match (self.server_cpu, after.server_cpu) {
                (Some(b), Some(a)) => Some(a.saturating_sub(b)),
                _ => None,
            },
        }
    }
}

fn addr_of(hostport: &str) -> BenchResult<SocketAddr> {
    Ok(hostport.parse()?)
}

async fn exchange(addr: SocketAddr, request: Vec<u8>) -> BenchResult<String> {
    let bytes = tokio::task::spawn_blocking(move || {
        lease_testkit::harness::tcp_exchange(addr, &request, Duration::from_secs(5), |_| false)
    })
    .await??;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

async fn http_get(addr: SocketAddr, path: &str) -> BenchResult<String> {
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let answer = exchange(addr, request.into_bytes()).await?;
    match answer.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => {
            Ok(body.to_owned())
        }
        _ => Err(format!(
            "GET {path} from {addr}: {}",
            answer.lines().next().unwrap_or("")
        )
        .into()),
    }
}

async fn redis_info(url: &str, section: &str) -> BenchResult<String> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    Ok(redis::cmd("INFO")
        .arg(section)
        .query_async(&mut conn)
        .await?)
}

impl Counters {
    /// Reads the counters now.
    pub(crate) async fn read(&self) -> BenchResult<Reading> {
        let mut reading = Reading {
            client_cpu: cpu_time("self").unwrap_or_default(),
            server_cpu: self.pid.and_then(|p| cpu_time(&p.to_string())),
            ..Reading::default()
        };
        match &self.source {
            Source::Redis(url) => {
                // One INFO for both sections, so the reading itself is one command.
                let info = redis_info(url, "everything").await?;
                for line in info.lines() {
                    if let Some(n) = line.strip_prefix("total_commands_processed:") {
                        reading.requests = n.trim().parse()?;
                    } else if let Some(rest) = line.strip_prefix("cmdstat_") {
                        let (name, stats) = rest.split_once(':').ok_or("malformed commandstats")?;
                        let calls = stats
                            .split(',')
                            .find_map(|s| s.strip_prefix("calls="))
                            .ok_or("commandstats without calls")?;
                        if name != "info" {
                            reading.by_name.insert(name.to_uppercase(), calls.parse()?);
                        }
                    }
                }
                // The reading's own INFO (counted by the time it answers).
                reading.requests = reading.requests.saturating_sub(1);
            }
            Source::Etcd(addr) => {
                let metrics = http_get(*addr, "/metrics").await?;
                for line in metrics.lines() {
                    let Some(rest) = line.strip_prefix("grpc_server_msg_received_total{") else {
                        continue;
                    };
                    let (labels, value) = rest.split_once("} ").ok_or("malformed metric")?;
                    let method = labels
                        .split(',')
                        .find_map(|l| l.strip_prefix("grpc_method=\""))
                        .map(|m| m.trim_end_matches('"'))
                        .ok_or("metric without grpc_method")?;
                    let n = value.trim().parse::<f64>()? as u64;
                    reading.requests += n;
                    *reading.by_name.entry(method.to_owned()).or_default() += n;
                }
            }
            Source::ZooKeeper(addr) => {
                let mntr = exchange(*addr, b"mntr".to_vec()).await?;
                let received = mntr
                    .lines()
                    .find_map(|l| l.strip_prefix("zk_packets_received"))
                    .ok_or("mntr without zk_packets_received")?;
                reading.requests = received.trim().parse()?;
                // The mntr request itself is not a packet of the client protocol.
            }
            Source::None => {}
        }
        Ok(reading)
    }

    /// The server's version, for the report.
    pub(crate) async fn version(&self) -> String {
        let found = match &self.source {
            Source::Redis(url) => redis_info(url, "server").await.map(|i| {
                i.lines()
                    .find_map(|l| l.strip_prefix("redis_version:"))
                    .map(|v| format!("Redis {}", v.trim()))
                    .unwrap_or_default()
            }),
            Source::Etcd(addr) => http_get(*addr, "/version").await.map(|v| {
                v.split("\"etcdserver\":\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next())
                    .map(|v| format!("etcd {v}"))
                    .unwrap_or_default()
            }),
            Source::ZooKeeper(addr) => exchange(*addr, b"srvr".to_vec()).await.map(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Zookeeper version: "))
                    .map(|v| format!("ZooKeeper {}", v.split(['-', ',']).next().unwrap_or(v)))
                    .unwrap_or_default()
            }),
            Source::None => Ok(String::new()),
        };
        found.unwrap_or_else(|e| format!("(version unknown: {e})"))
    }
}

/// A Redis `MONITOR` over some work: counts the commands clients sent (round trips), not those
/// a script invokes, which `INFO` counts too.
pub(crate) struct Monitor {
    url: String,
    marker: String,
    lines: tokio::task::JoinHandle<Vec<String>>,
}

impl Counters {
    /// Starts counting round trips where only `MONITOR` can tell them from script-invoked
    /// commands (Redis); `None` where [`Counters::read`] already counts round trips.
    pub(crate) async fn monitor(&self) -> BenchResult<Option<Monitor>> {
        use futures::StreamExt;
        let Source::Redis(url) = &self.source else {
            return Ok(None);
        };
        let marker = format!("lease-bench-monitor-end-{}", rand::random::<u64>());
        let stream = redis::Client::open(url.as_str())?
            .get_async_monitor()
            .await?
            .into_on_message::<String>();
        let end = marker.clone();
        let lines = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            let mut lines = Vec::new();
            while let Some(line) = stream.next().await {
                if line.contains(&end) {
                    break;
                }
                lines.push(line);
            }
            lines
        });
        // `get_async_monitor` returns once the server has said OK to MONITOR: from here on
        // every command is seen.
        Ok(Some(Monitor {
            url: url.clone(),
            marker,
            lines,
        }))
    }
}

impl Monitor {
    /// Stops counting: the round trips by command, the marker commands excluded.
    pub(crate) async fn finish(self) -> BenchResult<Reading> {
        let client = redis::Client::open(self.url.as_str())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let _: String = redis::cmd("ECHO")
            .arg(&self.marker)
            .query_async(&mut conn)
            .await?;
        let lines = tokio::time::timeout(Duration::from_secs(10), self.lines).await??;
        let mut reading = Reading::default();
        for line in lines {
            // `1701459123.456789 [0 127.0.0.1:51234] "EVALSHA" "..."`; `[0 lua]` for a script's.
            if line.contains(" lua] ") || line.contains(&self.marker) {
                continue;
            }
            let Some(name) = line.split('"').nth(1) else {
                continue;
            };
            reading.requests += 1;
            *reading.by_name.entry(name.to_uppercase()).or_default() += 1;
        }
        Ok(reading)
    }
}

impl Server {
    /// Starts `what` (redis, etcd, zookeeper, consul-standin) with the harness, with a session
    /// timeout of `ttl` where the backend has one.
    pub(crate) fn start(what: &str, ttl: Duration) -> BenchResult<Self> {
        use lease_testkit::harness::{EtcdServer, RedisServer, ZooKeeperServer};
        Ok(match what {
            "redis" => {
                let s = RedisServer::start()?;
                let url = s.url();
                Server {
                    backend: Backend::Redis,
                    endpoint: url.clone(),
                    counters: Counters {
                        source: Source::Redis(url.clone()),
                        pid: s.pid(),
                    },
                    url,
                    _started: Some(Box::new(s)),
                }
            }
            "etcd" => {
                let s = EtcdServer::start()?;
                Server {
                    backend: Backend::Etcd,
                    url: s.url(),
                    endpoint: s.http_endpoint(),
                    counters: Counters {
                        source: Source::Etcd(s.addr()),
                        pid: s.pid(),
                    },
                    _started: Some(Box::new(s)),
                }
            }
            "zookeeper" => {
                let s = ZooKeeperServer::start()?;
                Server {
                    backend: Backend::ZooKeeper,
                    url: format!(
                        "{}/bench?session_timeout_ms={}",
                        s.url(),
                        ttl.as_millis().min(60_000)
                    ),
                    endpoint: s.addr().to_string(),
                    counters: Counters {
                        source: Source::ZooKeeper(s.addr()),
                        pid: s.pid(),
                    },
                    _started: Some(Box::new(s)),
                }
            }
            "consul-standin" => {
                let s = consul_standin::ConsulStandIn::start(Default::default())?;
                Server {
                    backend: Backend::Consul,
                    url: format!("consul://{}", s.addr()),
                    endpoint: String::new(),
                    counters: Counters::none(),
                    _started: Some(Box::new(s)),
                }
            }
            other => {
                return Err(
                    format!("{other:?}: expected redis, etcd, zookeeper or consul-standin").into(),
                )
            }
        })
    }

    /// A server already running, reached by our coordinator `url`; the raw clients, the peers
    /// and the counters are derived from it for Redis (`redis://`), etcd (`etcd://`, plain
    /// HTTP) and ZooKeeper (`zk://`, one host).
    pub(crate) fn external(url: &str) -> BenchResult<Self> {
        let parsed = fenced::adapter::BackendUrl::parse(url)?;
        let scheme = url.split("://").next().unwrap_or_default();
        let first_host = || -> BenchResult<String> {
            let host = parsed
                .hosts()
                .first()
                .cloned()
                .ok_or_else(|| format!("{parsed}: no host"))?;
            Ok(host)
        };
        let (backend, endpoint, counters) = match scheme {
            "redis" => (
                Backend::Redis,
                // The raw client and rslock get the same URL without our options.
                url.split('?').next().unwrap_or(url).to_owned(),
                Source::Redis(url.split('?').next().unwrap_or(url).to_owned()),
            ),
            "etcd" => {
                let host = first_host()?;
                (
                    Backend::Etcd,
                    format!("http://{host}"),
                    Source::Etcd(addr_of(&host)?),
                )
            }
            "zk" => {
                let host = first_host()?;
                (
                    Backend::ZooKeeper,
                    host.clone(),
                    Source::ZooKeeper(addr_of(&host)?),
                )
            }
            "consul" | "consuls" => (Backend::Consul, String::new(), Source::None),
            _ => (Backend::Other, String::new(), Source::None),
        };
        Ok(Server {
            backend,
            url: url.to_owned(),
            endpoint,
            counters: Counters {
                source: counters,
                pid: None,
            },
            _started: None,
        })
    }
}

/// The machine the run is on, for the report.
pub(crate) fn machine() -> String {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|m| m.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_owned())
        .unwrap_or_default();
    format!("{cores} cores, {model}, Linux {kernel}")
}
