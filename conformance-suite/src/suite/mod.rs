//! The conformance suite: cases every [`Coordinator`] and [`Fence`] must pass.
//!
//! A backend is described once as a [`Subject`] (how to make clients, which fence protects the
//! resource, what the harness can do to the server) and the whole suite runs against it with one
//! call, [`run_suite`]. Each case is an async function over the traits plus a [`Ctx`]; a case
//! whose [`Need`]s the subject cannot meet is reported as **skipped, by name, with the reason**,
//! never counted as passed.
//!
//! Every case runs under a fresh random key prefix, so runs never collide, and under a time bound
//! so a hang is a failure, not a stuck CI job.
//!
//! # Timing from the environment
//!
//! A slow or remote backend (a container on a shared CI runner, a server across a network) can
//! be given more time without changing code. [`run_suite`] (and so [`main_for`] and the
//! `conformance` runner) reads, once per run ([`Timing::from_env`]):
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `CONFORMANCE_TTL_MS` | the lease TTL (milliseconds, `1..=3600000`) for **external** servers: subjects whose [`ServerControl`] is not controllable (`FENCED_*_URL`, `CONSUL_HTTP_ADDR`). It replaces [`Subject::ttl`] for backends with per-lease TTLs (Redis, etcd); it is raised to the backend's [`Capabilities::min_ttl`](lease_core::Capabilities) if below it, with a note. Backends whose TTL is their session's (ZooKeeper, Consul) keep the subject's TTL, since only the subject configures the session: their subjects read [`ttl_override`] themselves. In-process and harness-started servers are never affected. | the subject's TTL |
//! | `CONFORMANCE_TIME_SCALE` | a multiplier (a decimal number, `> 0` and `<= 100`) of every case's time bound, `(ttl * ttl_budget + 10 s) * scale`, for every subject | `1` |
//! | `CONFORMANCE_SEED` | the base seed of the run | random |
//! | `CONFORMANCE_CHAOS_SECS` | how long the chaos run lasts | 12 |
//! | `CONFORMANCE_SCALE_LEASES` | how many leases the `many_leases_kept` case acquires (on as many keys, 64 in flight, one client) and keeps; `0..=1000000`, `0` skips the case by name | 2000 |
//! | `CONFORMANCE_SCALE_HOLD_SECS` | how long `many_leases_kept` holds them (whole seconds, `1..=3600`); its time bound does not grow with the size, so a long run also raises `CONFORMANCE_TIME_SCALE` (the case says by how much when the hold does not fit) | 20 |
//! | `CONFORMANCE_SCALE_TTL_MS` | the TTL of `many_leases_kept`'s leases (milliseconds, `1..=3600000`), raised to the backend's [`Capabilities::min_ttl`](lease_core::Capabilities) | 10000 |
//! | `CONFORMANCE_CLUSTER_FULL` | `1` makes a cluster test binary ([`main_for_cluster`]) run every case, not only the cluster cases and [`CLUSTER_CORE_CASES`] | unset |
//! | `CONFORMANCE_CLUSTER_LOGS` | set: a failed cluster case prints the cluster members' log tails (always under `CI=true`) | unset |
//! | `CONFORMANCE_REDIS_CLUSTER_OPTIONS` | URL options added to the `redis-sentinel` subject's URL (e.g. `clock_tokens=false&unguarded_replicas=true` reproduces what decision 0016 fixed) | none |
//!
//! An unset or empty variable takes the default; a malformed one fails the run with a single
//! failed `environment` case naming the variable, never silently ignored.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use lease_core::{Coordinator, Fence, LockKey, ResourceId};
use rand::{Rng, SeedableRng};
use tokio::sync::Mutex;

use lease_testkit::harness::{ClusterControl, ServerControl};

mod basic;
mod chaos;
mod cluster;
mod faults;
mod interference;
mod report;
mod scale;

pub use report::{junit, CaseReport, Report, Verdict};

/// A failed check inside a case: the message says what was expected and what was seen.
#[derive(Debug)]
pub struct Failure(pub String);

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure(format!("unexpected error: {e}"))
    }
}

/// What a case returns: `Ok(Verdict::Passed)`, `Ok(Verdict::Skipped(why))`, or a failure.
pub type CaseResult = Result<Verdict, Failure>;

/// Fails the case with a message unless the condition holds.
#[macro_export]
macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::suite::Failure(format!($($fmt)+)));
        }
    };
}

/// What a case needs from a subject; a missing need makes the case a named skip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// The coordinator is reachable from other OS processes (worker processes can be paused and
    /// killed), and a worker URL is configured.
    Processes,
    /// The harness can kill and restart the server on the same data directory.
    Restart,
    /// Tokens are declared durable across a server restart.
    DurableTokens,
    /// A client can be connected through a fault proxy.
    Proxy,
    /// The subject can delete a lock's backing keys the way an operator would.
    Operator,
    /// A fence of the subject's kind can be connected through a fault proxy.
    FenceProxy,
    /// The coordinator is a replicated cluster the harness controls member by member.
    Cluster,
}

impl Need {
    fn missing_reason(self) -> &'static str {
        match self {
            Need::Processes => {
                "no worker process: the subject names no worker (with_workers), or the \
                 coordinator is not shared across OS processes"
            }
            Need::Restart => "the harness cannot restart this server (in-process or external)",
            Need::DurableTokens => "the backend does not declare durable tokens",
            Need::Proxy => "no fault proxy can be placed between client and server",
            Need::Operator => "the subject has no operator hook to delete a lock's keys",
            Need::FenceProxy => "no fault proxy can be placed between the fence and its storage",
            Need::Cluster => {
                "the coordinator is a single server, not a cluster the harness controls"
            }
        }
    }
}

/// Makes a new client of the backend.
pub type ConnectFn =
    Arc<dyn Fn() -> BoxFuture<'static, lease_core::Result<Arc<dyn Coordinator>>> + Send + Sync>;
/// Makes a new client of the backend that talks to the server at the given address (a proxy).
pub type ConnectViaFn = Arc<
    dyn Fn(SocketAddr) -> BoxFuture<'static, lease_core::Result<Arc<dyn Coordinator>>>
        + Send
        + Sync,
>;

/// Makes a new client of a cluster subject pinned to one member (by index), with the subject's
/// own options (key prefix, timeouts).
pub type ConnectMemberFn = Arc<
    dyn Fn(usize) -> BoxFuture<'static, lease_core::Result<Arc<dyn Coordinator>>> + Send + Sync,
>;

/// Makes a new fence of the subject's kind that talks to its server at the given address (a proxy).
pub type FenceViaFn =
    Arc<dyn Fn(SocketAddr) -> BoxFuture<'static, lease_core::Result<Arc<dyn Fence>>> + Send + Sync>;

/// Operator actions on a backend's storage (what an operator with a CLI could do).
pub trait Operator: Send + Sync {
    /// Deletes everything stored for `key` (the lock itself, and any per-key counter), as an
    /// operator cleaning up would.
    fn delete_key<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<(), String>>;
    /// Deletes the parent node/prefix holding `key`'s lock entries, where the backend has one.
    /// Returns `Ok(false)` when there is no such thing on this backend.
    fn delete_parent<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>>;

    /// Overwrites the value of `key`'s held lock with a raw client of the backend, the way
    /// another tool writing the key would (no lock semantics: Consul `PUT` without `?acquire`,
    /// Redis `SET ... KEEPTTL`, etcd `put` keeping the key's lease, ZooKeeper `setData`).
    /// Returns `Ok(false)` when the backend has no such write.
    fn overwrite_value<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        let _ = key;
        Box::pin(async { Ok(false) })
    }

    /// Destroys the session, lease or node behind `key`'s held lock by an operator action
    /// (Consul `session destroy`, etcd `lease revoke`, ZooKeeper closing the holder's session
    /// from another client with the same credentials, Redis `DEL`). Returns `Ok(false)` when the
    /// backend has no such action.
    fn invalidate_holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        let _ = key;
        Box::pin(async { Ok(false) })
    }
}

/// A backend under test.
#[derive(Clone)]
pub struct Subject {
    /// The backend's name, used in reports (`memory`, `redis`, ...).
    pub name: String,
    /// Makes a new client. Cases use one client per simulated process.
    pub connect: ConnectFn,
    /// The fence the cases write through.
    pub fence: Arc<dyn Fence>,
    /// The TTL cases use for leases they expect to expire; at least the backend's minimum.
    pub ttl: Duration,
    /// The server, if the harness controls it.
    pub server: Option<Arc<Mutex<Box<dyn ServerControl>>>>,
    /// For proxy cases: the server's address and a client factory that dials another address.
    pub proxy: Option<(SocketAddr, ConnectViaFn)>,
    /// For fence fault cases: the fence server's address and a factory for a fence of the same
    /// kind that dials another address (a proxy). Its request timeout should be short (about a
    /// second) so a lost reply is noticed quickly.
    pub fence_proxy: Option<(SocketAddr, FenceViaFn)>,
    /// For operator cases.
    pub operator: Option<Arc<dyn Operator>>,
    /// For process cases: the coordinator URL a worker process connects to.
    pub worker_url: Option<String>,
    /// The worker executable (see the `conformance-worker` binary).
    pub worker_exe: Option<std::path::PathBuf>,
    /// A secret (a password in the URL) that must never show in any Debug/Display output.
    pub secret: Option<String>,
    /// For cluster cases: control over each member of a replicated coordinator.
    pub cluster: Option<Arc<dyn ClusterControl>>,
    /// For cluster cases: a client pinned to one member.
    pub connect_member: Option<ConnectMemberFn>,
    /// Whether a holder's reported validity keeps others out across a failover (true unless
    /// set with [`Subject::without_exclusion_across_failover`]): the history checker's
    /// property (e) in the runs that may fail a member over (the chaos run, `rolling_restart`).
    pub exclusive_across_failover: bool,
    /// Clean-ups a case left running when it ended early (a failed check dropping what it had
    /// to undo): the runner waits for them before the next case starts.
    cleanups: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl fmt::Debug for Subject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subject")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .field("server", &self.server.is_some())
            .field("proxy", &self.proxy.is_some())
            .field("operator", &self.operator.is_some())
            .field("worker_url", &self.worker_url.is_some())
            .field("cluster", &self.cluster.as_ref().map(|c| c.kind()))
            .finish()
    }
}

impl Subject {
    /// A subject with only the essentials; add capabilities with the setters.
    pub fn new(
        name: impl Into<String>,
        connect: ConnectFn,
        fence: Arc<dyn Fence>,
        ttl: Duration,
    ) -> Self {
        Subject {
            name: name.into(),
            connect,
            fence,
            ttl,
            server: None,
            proxy: None,
            fence_proxy: None,
            operator: None,
            worker_url: None,
            worker_exe: None,
            secret: None,
            cluster: None,
            connect_member: None,
            exclusive_across_failover: true,
            cleanups: Arc::default(),
        }
    }

    /// Runs `cleanup` on a task of its own, and has the runner wait for it before the next case
    /// (for a `Drop` that must undo a fault, such as a member left killed, without blocking).
    pub(crate) fn clean_up_later(&self, cleanup: impl Future<Output = ()> + Send + 'static) {
        let task = tokio::spawn(cleanup);
        self.cleanups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task);
    }

    /// Waits for the clean-ups of [`Subject::clean_up_later`] (each up to two minutes; one that
    /// takes longer is said on stderr and left running).
    async fn settle(&self) {
        let tasks = std::mem::take(&mut *self.cleanups.lock().unwrap_or_else(|p| p.into_inner()));
        for task in tasks {
            match tokio::time::timeout(Duration::from_secs(120), task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("{}: a clean-up panicked: {e}", self.name),
                Err(_) => eprintln!("{}: a clean-up took over 120 s; going on", self.name),
            }
        }
    }

    /// A subject whose every client is `coordinator` itself: for a backend that lives in the
    /// process, so that the cases' clients contend through the one instance.
    pub fn shared(
        name: impl Into<String>,
        coordinator: Arc<dyn Coordinator>,
        fence: Arc<dyn Fence>,
        ttl: Duration,
    ) -> Self {
        Subject::new(
            name,
            Arc::new(move || {
                let c = coordinator.clone();
                Box::pin(async move { Ok(c) })
            }),
            fence,
            ttl,
        )
    }

    /// The in-memory backend: one shared coordinator, one in-memory fence, 300 ms TTL.
    pub fn memory() -> Self {
        let coord: Arc<dyn Coordinator> = Arc::new(lease_core::Instrumented::new(
            lease_core::memory::MemoryCoordinator::new(),
        ));
        Subject::shared(
            "memory",
            coord,
            Arc::new(lease_core::memory::MemoryFence::new()),
            Duration::from_millis(300),
        )
    }

    /// Sets the server control.
    pub fn with_server(mut self, server: Box<dyn ServerControl>) -> Self {
        self.server = Some(Arc::new(Mutex::new(server)));
        self
    }

    /// Sets the proxy hook.
    pub fn with_proxy(mut self, upstream: SocketAddr, connect_via: ConnectViaFn) -> Self {
        self.proxy = Some((upstream, connect_via));
        self
    }

    /// Sets the fence proxy hook: `upstream` is the fence's server, `fence_via` connects a fence
    /// of the same kind (same storage, same tables or key prefix) through another address.
    pub fn with_fence_proxy(mut self, upstream: SocketAddr, fence_via: FenceViaFn) -> Self {
        self.fence_proxy = Some((upstream, fence_via));
        self
    }

    /// Sets the operator hook.
    pub fn with_operator(mut self, op: Arc<dyn Operator>) -> Self {
        self.operator = Some(op);
        self
    }

    /// Sets the worker URL and executable for process cases.
    pub fn with_workers(
        mut self,
        url: impl Into<String>,
        exe: impl Into<std::path::PathBuf>,
    ) -> Self {
        self.worker_url = Some(url.into());
        self.worker_exe = Some(exe.into());
        self
    }

    /// Sets the cluster control for cluster cases.
    pub fn with_cluster(mut self, cluster: Arc<dyn ClusterControl>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// For a backend whose documented semantics do not keep a second holder out across a
    /// failover (asynchronous replication, such as Redis with Sentinel): the runs that may fail
    /// a member over (the chaos run, `rolling_restart`) check every property of the history
    /// except (e), exclusive tenure.
    pub fn without_exclusion_across_failover(mut self) -> Self {
        self.exclusive_across_failover = false;
        self
    }

    /// The history properties this subject does not promise in runs that may fail a member
    /// over (for [`crate::history::check_except`]).
    pub(crate) fn unpromised(&self) -> &'static [crate::history::Property] {
        if self.exclusive_across_failover {
            &[]
        } else {
            &[crate::history::Property::ExclusiveTenure]
        }
    }

    /// Sets how to connect a client pinned to one member of the cluster.
    pub fn with_member_connect(mut self, connect: ConnectMemberFn) -> Self {
        self.connect_member = Some(connect);
        self
    }

    /// Sets a secret that must never appear in output.
    pub fn with_secret(mut self, secret: impl Into<String>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// The first of `needs` this subject lacks. `Err` when it cannot tell: a connection that
    /// fails (or hangs) while the capabilities are read is the case's failure, not a skip.
    ///
    /// Under `CI=true`, a backend that declares itself shared across processes
    /// ([`Capabilities::shared_across_processes`](lease_core::Capabilities)) on a subject with no
    /// worker is an `Err` too: the process cases could run, and CI must not pass by skipping
    /// them.
    async fn missing(&self, needs: &[Need]) -> Result<Option<Need>, String> {
        self.missing_under(needs, lease_testkit::harness::ci_requires_servers())
            .await
    }

    /// [`Subject::missing`], with `ci` for whether `CI=true`.
    async fn missing_under(&self, needs: &[Need], ci: bool) -> Result<Option<Need>, String> {
        for &need in needs {
            let ok = match need {
                Need::Processes if self.worker_url.is_some() && self.worker_exe.is_some() => true,
                Need::Processes => {
                    if ci && self.capabilities().await?.shared_across_processes {
                        return Err(format!(
                            "{} declares that it is shared across OS processes, but the subject \
                             names no worker (Subject::with_workers): under CI=true the process \
                             cases fail rather than skip",
                            self.name
                        ));
                    }
                    false
                }
                Need::Restart => match &self.server {
                    Some(s) => s.lock().await.controllable(),
                    None => false,
                },
                Need::DurableTokens => self.capabilities().await?.durable_tokens,
                Need::Proxy => self.proxy.is_some(),
                Need::Operator => self.operator.is_some(),
                Need::FenceProxy => self.fence_proxy.is_some(),
                Need::Cluster => self.cluster.is_some(),
            };
            if !ok {
                return Ok(Some(need));
            }
        }
        Ok(None)
    }

    /// The backend's capabilities, from a new client; `Err` if connecting fails or hangs.
    async fn capabilities(&self) -> Result<lease_core::Capabilities, String> {
        match tokio::time::timeout(Duration::from_secs(30), (self.connect)()).await {
            Ok(Ok(c)) => Ok(c.capabilities().clone()),
            Ok(Err(e)) => Err(format!("connecting to read the capabilities: {e}")),
            Err(_) => Err("connecting to read the capabilities took over 30 s".into()),
        }
    }
}

/// The per-case context: the subject, a unique key prefix and a seeded random source.
pub struct Ctx {
    /// The subject under test.
    pub subject: Subject,
    prefix: String,
    /// The case's seed (printed on failure).
    pub seed: u64,
    rng: std::sync::Mutex<rand::rngs::StdRng>,
    time_scale: f64,
}

impl fmt::Debug for Ctx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ctx")
            .field("subject", &self.subject.name)
            .field("prefix", &self.prefix)
            .field("seed", &self.seed)
            .finish()
    }
}

impl Ctx {
    /// A key under this case's unique prefix.
    pub fn key(&self, name: &str) -> LockKey {
        LockKey::new(format!("{}/{name}", self.prefix)).expect("case keys are valid")
    }

    /// The resource protected by `key`.
    pub fn resource(&self, key: &LockKey) -> ResourceId {
        ResourceId::from(key)
    }

    /// A new client.
    pub async fn client(&self) -> Result<Arc<dyn Coordinator>, Failure> {
        (self.subject.connect)()
            .await
            .map_err(|e| Failure(format!("connecting a client failed: {e}")))
    }

    /// The fence.
    pub fn fence(&self) -> &Arc<dyn Fence> {
        &self.subject.fence
    }

    /// The TTL for short leases.
    pub fn ttl(&self) -> Duration {
        self.subject.ttl
    }

    /// `d` multiplied by the run's `CONFORMANCE_TIME_SCALE` (see [`Timing`]): for a fixed wait
    /// inside a case that should grow with a slow backend.
    pub fn scaled(&self, d: Duration) -> Duration {
        d.mul_f64(self.time_scale)
    }

    /// A random number in `range` from the case's seeded source.
    pub fn random(&self, range: std::ops::Range<u64>) -> u64 {
        self.rng.lock().expect("rng").gen_range(range)
    }

    /// A child seed for a task.
    pub fn fork_seed(&self) -> u64 {
        self.rng.lock().expect("rng").gen()
    }
}

type CaseFn = fn(Arc<Ctx>) -> BoxFuture<'static, CaseResult>;

/// One named case.
#[derive(Clone, Copy)]
pub struct Case {
    /// The case's name, stable across releases (reports and filters use it).
    pub name: &'static str,
    /// What it needs.
    pub needs: &'static [Need],
    /// The time bound, in multiples of the subject's TTL plus 10 s.
    pub ttl_budget: u32,
    run: CaseFn,
}

impl fmt::Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("needs", &self.needs)
            .finish()
    }
}

impl Case {
    /// A case.
    pub const fn new(
        name: &'static str,
        needs: &'static [Need],
        ttl_budget: u32,
        run: CaseFn,
    ) -> Self {
        Case {
            name,
            needs,
            ttl_budget,
            run,
        }
    }
}

/// A task a case spawns, aborted when this handle is dropped: a case that returns early (a
/// failure, a `?`) or is stopped at its budget leaves none of its workers (or its chaos monkey)
/// running into the next case. Awaiting it gives the task's output, as a `JoinHandle` does.
pub(crate) struct Scoped<T>(tokio::task::JoinHandle<T>);

impl<T: Send + 'static> Scoped<T> {
    /// Spawns `task` on the current runtime.
    pub(crate) fn spawn(task: impl std::future::Future<Output = T> + Send + 'static) -> Self {
        Scoped(tokio::spawn(task))
    }

    /// Whether the task has ended.
    pub(crate) fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

impl<T> std::future::Future for Scoped<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for Scoped<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Watches, while a case runs, for stalls a correct adapter cannot ride out: a starved or
/// stopped process (a 10 ms sleep that wakes late) or a stalled server (an `inspect` answered
/// late, as every request is while a Redis fsync or an etcd apply is stuck). A step still under
/// way counts for as long as it has taken, so a stall that has just ended is seen before the
/// probe gets to run again. A case whose short lease was lost to one proves nothing about the
/// adapter and may start again; see [`unless_stalled`].
pub(crate) struct StallWatch {
    state: Arc<std::sync::Mutex<Probe>>,
    _probe: Scoped<()>,
}

/// What [`StallWatch`]'s probe has seen, and the step it is in.
struct Probe {
    worst: Duration,
    step_started: tokio::time::Instant,
}

impl StallWatch {
    /// How long a probe step (one `inspect`, or one sleep) takes on a machine that is not
    /// stalled, at most: only the time beyond it counts.
    const PERIOD: Duration = Duration::from_millis(10);

    /// Starts probing through a client of its own.
    pub(crate) async fn start(ctx: &Ctx) -> Result<Self, Failure> {
        let probe = ctx.client().await?;
        let key = ctx.key("stall-probe");
        let state = Arc::new(std::sync::Mutex::new(Probe {
            worst: Duration::ZERO,
            step_started: tokio::time::Instant::now(),
        }));
        let shared = state.clone();
        let step = move || {
            let now = tokio::time::Instant::now();
            let mut p = shared.lock().unwrap_or_else(|e| e.into_inner());
            let over = now.saturating_duration_since(p.step_started);
            p.worst = p.worst.max(over.saturating_sub(Self::PERIOD));
            p.step_started = now;
        };
        let task = Scoped::spawn(async move {
            loop {
                // Errors count only by the time they took.
                let _ = probe.inspect(&key).await;
                step();
                tokio::time::sleep(Self::PERIOD).await;
                step();
            }
        });
        Ok(StallWatch {
            state,
            _probe: task,
        })
    }

    /// The longest stall seen so far, the step under way included.
    pub(crate) fn worst(&self) -> Duration {
        let p = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let current = p.step_started.elapsed().saturating_sub(Self::PERIOD);
        p.worst.max(current)
    }

    /// A description of the longest stall when it reached `at_least`.
    pub(crate) fn stalled(&self, at_least: Duration) -> Option<String> {
        let worst = self.worst();
        (worst >= at_least).then(|| format!("the machine or the server stalled for {worst:?}"))
    }
}

/// Runs a case's `attempt` (given its number, from 1) up to three times while it returns
/// `Ok(Some(why))`: an attempt whose outcome a stall of the machine or the server decided (a
/// short lease lost, a hand-off late; see [`StallWatch`]), which proves nothing either way.
/// `Ok(None)` passes; an error fails at once. Each restart is printed with its reason; three
/// cut short fail the case, naming every reason (an adapter that fails every time, a stall or
/// not, fails here too).
pub(crate) async fn unless_stalled<F, Fut>(ctx: &Ctx, case: &str, mut attempt: F) -> CaseResult
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<Option<String>, Failure>>,
{
    const ATTEMPTS: u32 = 3;
    let mut reasons = Vec::new();
    for n in 1..=ATTEMPTS {
        match attempt(n).await? {
            None => return Ok(Verdict::Passed),
            Some(why) => {
                println!("note: {case}: attempt {n} of {ATTEMPTS} cut short: {why}");
                reasons.push(why);
            }
        }
    }
    Err(Failure(format!(
        "each of {ATTEMPTS} attempts was cut short ({}): either the machine or the server is too \
         slow for this TTL ({:?}), or the adapter fails this case every time",
        reasons.join("; "),
        ctx.ttl()
    )))
}

/// Boxes an async case function into the future a case runs.
pub fn boxed<F>(f: F) -> BoxFuture<'static, CaseResult>
where
    F: Future<Output = CaseResult> + Send + 'static,
{
    Box::pin(f)
}

/// Every case of the suite, in report order.
pub fn cases() -> Vec<Case> {
    let mut all = basic::cases();
    all.extend(faults::cases());
    all.extend(interference::cases());
    all.extend(chaos::cases());
    all.extend(cluster::cases());
    all.extend(scale::cases());
    all
}

/// Options for a run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Only cases whose name contains this.
    pub filter: Option<String>,
    /// Only the cases with these names (all when `None`); the others are not reported.
    pub only: Option<Vec<&'static str>>,
    /// The base seed (default: from `CONFORMANCE_SEED` or random).
    pub seed: Option<u64>,
    /// Leave out the cases whose name contains any of these (as libtest's `--skip`).
    pub skip: Vec<String>,
}

/// The environment variable fixing the run's base seed.
pub const SEED_ENV: &str = "CONFORMANCE_SEED";
/// The environment variable overriding the lease TTL for external servers (see [`Timing`]).
pub const TTL_ENV: &str = "CONFORMANCE_TTL_MS";
/// The environment variable scaling every case's time bound (see [`Timing`]).
pub const TIME_SCALE_ENV: &str = "CONFORMANCE_TIME_SCALE";

/// The largest accepted `CONFORMANCE_TTL_MS`: one hour.
const MAX_TTL_MS: u64 = 3_600_000;
/// The largest accepted `CONFORMANCE_TIME_SCALE`.
const MAX_TIME_SCALE: f64 = 100.0;

/// The run's timing settings from the environment (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// `CONFORMANCE_TTL_MS`: the lease TTL for external servers, if set.
    pub ttl_override: Option<Duration>,
    /// `CONFORMANCE_TIME_SCALE`: the multiplier of every case's time bound (default 1).
    pub time_scale: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            ttl_override: None,
            time_scale: 1.0,
        }
    }
}

impl Timing {
    /// Reads `CONFORMANCE_TTL_MS` and `CONFORMANCE_TIME_SCALE` from the process environment.
    ///
    /// # Errors
    /// A message naming the variable when a value is set but malformed or out of range.
    pub fn from_env() -> Result<Self, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`Self::from_env`] with a custom variable lookup (for tests).
    ///
    /// # Errors
    /// As [`Self::from_env`].
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let get = |name: &str| {
            lookup(name)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let ttl_override = match get(TTL_ENV) {
            None => None,
            Some(v) => match v.parse::<u64>() {
                Ok(ms) if (1..=MAX_TTL_MS).contains(&ms) => Some(Duration::from_millis(ms)),
                _ => {
                    return Err(format!(
                        "{TTL_ENV}={v:?}: expected whole milliseconds in 1..={MAX_TTL_MS}"
                    ))
                }
            },
        };
        let time_scale = match get(TIME_SCALE_ENV) {
            None => 1.0,
            Some(v) => match v.parse::<f64>() {
                Ok(x) if x.is_finite() && x > 0.0 && x <= MAX_TIME_SCALE => x,
                _ => {
                    return Err(format!(
                        "{TIME_SCALE_ENV}={v:?}: expected a number > 0 and <= {MAX_TIME_SCALE}"
                    ))
                }
            },
        };
        Ok(Timing {
            ttl_override,
            time_scale,
        })
    }

    /// A case's time bound: `(ttl * ttl_budget + 10 s) * time_scale`.
    pub fn case_budget(&self, ttl: Duration, ttl_budget: u32) -> Duration {
        (ttl * ttl_budget + Duration::from_secs(10)).mul_f64(self.time_scale)
    }
}

/// `CONFORMANCE_TTL_MS` as a duration, for subjects of external servers that configure a session
/// TTL themselves (a real Consul's `session_ttl_ms`, a ZooKeeper session timeout) and should set
/// [`Subject::ttl`] to the same value. `None` when unset or malformed (a malformed value also
/// fails the run in [`run_suite`]).
pub fn ttl_override() -> Option<Duration> {
    Timing::from_env().ok().and_then(|t| t.ttl_override)
}

/// `CONFORMANCE_TIME_SCALE` (1 when unset or malformed).
pub fn time_scale() -> f64 {
    Timing::from_env().map_or(1.0, |t| t.time_scale)
}

/// Applies `CONFORMANCE_TTL_MS` to an external server's subject (see the [module docs](self)):
/// returns the TTL to run with and a note for the report when it differs from the request.
async fn effective_ttl(subject: &Subject, requested: Duration) -> (Duration, Option<String>) {
    let external = match &subject.server {
        Some(s) => !s.lock().await.controllable(),
        None => false,
    };
    if !external || requested == subject.ttl {
        return (subject.ttl, None);
    }
    let caps = match (subject.connect)().await {
        Ok(c) => c.capabilities().clone(),
        // The cases will report the connection failure themselves.
        Err(_) => return (requested, None),
    };
    if !caps.per_lease_ttl {
        let note = format!(
            "{TTL_ENV}={} not applied: a {} lease lives as long as its session, whose TTL the \
             subject sets ({:?}); the subject must read conformance_suite::suite::ttl_override()",
            requested.as_millis(),
            subject.name,
            subject.ttl
        );
        return (subject.ttl, Some(note));
    }
    if requested < caps.min_ttl {
        let note = format!(
            "{TTL_ENV}={} is below {}'s minimum TTL; running with {:?}",
            requested.as_millis(),
            subject.name,
            caps.min_ttl
        );
        return (caps.min_ttl, Some(note));
    }
    (requested, None)
}

/// Runs every case (matching the filter) against `subject`, one after another, and reports.
///
/// The TTL and time bounds follow the environment ([`Timing`]); a malformed timing variable
/// yields a report with one failed `environment` case and nothing else run.
pub async fn run_suite(mut subject: Subject, options: &RunOptions) -> Report {
    let env_seed = match std::env::var(SEED_ENV)
        .ok()
        .filter(|s| !s.trim().is_empty())
    {
        None => Ok(None),
        Some(s) => s
            .trim()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("{SEED_ENV}={s:?} is not a whole number (0..=2^64-1)")),
    };
    let base_seed = match (options.seed, &env_seed) {
        (Some(seed), _) => seed,
        (None, Ok(Some(seed))) => *seed,
        _ => rand::random(),
    };
    // Printed first, so that a run that hangs or is killed can still be replayed.
    println!(
        "note: {}: seed {base_seed} ({SEED_ENV}={base_seed} replays it)",
        subject.name
    );
    let run_id: u32 = rand::random();
    let mut report = Report::new(subject.name.clone(), base_seed);
    let timing = match env_seed.and_then(|_| Timing::from_env()) {
        Ok(t) => t,
        Err(e) => {
            report.push(CaseReport::new(
                "environment",
                Verdict::Failed(e),
                Duration::ZERO,
                None,
            ));
            return report;
        }
    };
    if let Some(requested) = timing.ttl_override {
        let (ttl, note) = effective_ttl(&subject, requested).await;
        if let Some(note) = note {
            println!("note: {}: {note}", subject.name);
        }
        if ttl != subject.ttl {
            println!(
                "note: {}: TTL {ttl:?} (from {TTL_ENV}; the subject's own is {:?})",
                subject.name, subject.ttl
            );
            subject.ttl = ttl;
        }
    }
    if timing.time_scale != 1.0 {
        println!(
            "note: {}: case time bounds scaled by {} ({TIME_SCALE_ENV})",
            subject.name, timing.time_scale
        );
    }
    let mut selected = 0;
    for (i, case) in cases().into_iter().enumerate() {
        if let Some(f) = &options.filter {
            if !case.name.contains(f.as_str()) {
                continue;
            }
        }
        if options.skip.iter().any(|s| case.name.contains(s.as_str())) {
            continue;
        }
        if let Some(only) = &options.only {
            if !only.contains(&case.name) {
                continue;
            }
        }
        selected += 1;
        // What an earlier case that ended early left to undo is undone first.
        subject.settle().await;
        let start = std::time::Instant::now();
        match subject.missing(case.needs).await {
            Ok(None) => {}
            Ok(Some(need)) => {
                report.push(CaseReport::new(
                    case.name,
                    Verdict::Skipped(need.missing_reason().into()),
                    start.elapsed(),
                    None,
                ));
                continue;
            }
            Err(e) => {
                report.push(CaseReport::new(
                    case.name,
                    Verdict::Failed(e),
                    start.elapsed(),
                    None,
                ));
                continue;
            }
        }
        let seed = base_seed.wrapping_add(i as u64);
        let ctx = Arc::new(Ctx {
            subject: subject.clone(),
            prefix: format!("conformance/{run_id:08x}/{}", case.name),
            seed,
            rng: std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)),
            time_scale: timing.time_scale,
        });
        let budget = timing.case_budget(subject.ttl, case.ttl_budget);
        let mut handle = tokio::spawn((case.run)(ctx));
        let verdict = match tokio::time::timeout(budget, &mut handle).await {
            Ok(Ok(Ok(v))) => v,
            Ok(Ok(Err(f))) => Verdict::Failed(f.0),
            Ok(Err(join)) => Verdict::Failed(format!("case panicked: {}", panic_message(join))),
            Err(_) => {
                // Stopped, not left running into the next case: its guards restore what they
                // changed as the task's state is dropped, which the await below waits for (and
                // what they leave to a clean-up, the next case's `settle`), bounded in case the
                // task is stuck in a blocking call that no abort reaches.
                handle.abort();
                let _ = tokio::time::timeout(Duration::from_secs(60), handle).await;
                Verdict::Failed(format!("case did not finish within {budget:?}"))
            }
        };
        let verdict = match (&verdict, &subject.secret) {
            (Verdict::Failed(m), Some(s)) if m.contains(s.as_str()) => {
                Verdict::Failed("failure message contained the subject's secret (redacted)".into())
            }
            _ => verdict,
        };
        report.push(CaseReport::new(
            case.name,
            verdict,
            start.elapsed(),
            Some(seed),
        ));
    }
    subject.settle().await;
    if selected == 0 && (options.filter.is_some() || !options.skip.is_empty()) {
        report.push(CaseReport::new(
            "filter",
            Verdict::Failed(format!(
                "no case matches the filter {:?} (skipping {:?}): nothing was run",
                options.filter, options.skip
            )),
            Duration::ZERO,
            None,
        ));
    }
    report
}

/// The name filter and the `--skip` patterns in a test binary's arguments, as libtest reads
/// them: the first free argument is the filter; the values of libtest's options that take one
/// (`--test-threads 1`, `--skip chaos`) are not free arguments.
fn test_args(args: impl IntoIterator<Item = String>) -> (Option<String>, Vec<String>) {
    const TAKES_VALUE: &[&str] = &[
        "--test-threads",
        "--color",
        "--format",
        "--logfile",
        "--shuffle-seed",
        "-Z",
    ];
    let (mut filter, mut skip) = (None, Vec::new());
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        if a == "--skip" {
            skip.extend(args.next());
        } else if let Some(v) = a.strip_prefix("--skip=") {
            skip.push(v.to_owned());
        } else if TAKES_VALUE.contains(&a.as_str()) {
            args.next();
        } else if !a.starts_with('-') && filter.is_none() {
            filter = Some(a);
        }
    }
    (filter, skip)
}

fn panic_message(e: tokio::task::JoinError) -> String {
    match e.try_into_panic() {
        Ok(p) => p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "non-string panic".into()),
        Err(e) => e.to_string(),
    }
}

/// The entry point of a `harness = false` test file: builds the subject, runs the suite, prints
/// the report and a closing `N passed, N failed, N skipped` line, and returns the exit code.
///
/// Arguments: an optional name filter and `--skip PATTERN`s, as libtest reads them; its other
/// flags are ignored (so `cargo test`'s own flags do not break it). A filter that matches no
/// case fails the run. `CONFORMANCE_JUNIT=path` also writes JUnit XML; the timing variables
/// of the [module docs](self) apply.
pub fn main_for<F, Fut>(make_subject: F) -> std::process::ExitCode
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<Subject>, String>>,
{
    main_with_options(make_subject, None)
}

/// The cases a cluster subject runs by default ([`main_for_cluster`]) besides the cluster
/// cases: mutual exclusion, token order, a stale holder in another OS process, and the chaos run.
pub const CLUSTER_CORE_CASES: &[&str] = &[
    "mutual_exclusion_16_contenders",
    "tokens_increase_across_handoffs",
    "fault_stale_holder_process_sigstop",
    "chaos_workers_pauses_kills_restarts",
];

/// The environment variable that makes [`main_for_cluster`] run the whole suite (the long run).
pub const CLUSTER_FULL_ENV: &str = "CONFORMANCE_CLUSTER_FULL";

/// Like [`main_for`] for a cluster subject: the cases that need a cluster plus
/// [`CLUSTER_CORE_CASES`], or every case when `CONFORMANCE_CLUSTER_FULL=1` (with
/// `CONFORMANCE_CHAOS_SECS` for a longer chaos run, this is the soak).
pub fn main_for_cluster<F, Fut>(make_subject: F) -> std::process::ExitCode
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<Subject>, String>>,
{
    let full = std::env::var(CLUSTER_FULL_ENV).is_ok_and(|v| v == "1" || v == "true");
    let only = (!full).then(|| {
        cases()
            .into_iter()
            .filter(|c| c.needs.contains(&Need::Cluster) || CLUSTER_CORE_CASES.contains(&c.name))
            .map(|c| c.name)
            .collect()
    });
    if only.is_some() {
        println!(
            "note: cluster cases and {} core cases only; {CLUSTER_FULL_ENV}=1 runs the whole suite",
            CLUSTER_CORE_CASES.len()
        );
    }
    main_with_options(make_subject, only)
}

fn main_with_options<F, Fut>(
    make_subject: F,
    only: Option<Vec<&'static str>>,
) -> std::process::ExitCode
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Result<Option<Subject>, String>>,
{
    let (filter, skip) = test_args(std::env::args().skip(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    rt.block_on(async move {
        let subject = match make_subject().await {
            Ok(Some(s)) => s,
            Ok(None) => {
                println!("0 passed, 0 failed, 1 skipped");
                return std::process::ExitCode::SUCCESS;
            }
            Err(e) => {
                eprintln!("could not set up the subject: {e}");
                println!("0 passed, 1 failed, 0 skipped");
                return std::process::ExitCode::FAILURE;
            }
        };
        let report = run_suite(
            subject,
            &RunOptions {
                filter,
                only,
                seed: None,
                skip,
            },
        )
        .await;
        report.print();
        if let Ok(path) = std::env::var("CONFORMANCE_JUNIT") {
            if let Err(e) = std::fs::write(&path, report.junit()) {
                eprintln!("could not write {path}: {e}");
            }
        }
        if report.failed() > 0 {
            std::process::ExitCode::FAILURE
        } else {
            std::process::ExitCode::SUCCESS
        }
    })
}

/// The holder of `lease` on `key` vanishes: no release, no renewal, no destructor
/// (`mem::forget`), as a crashed process. `client` then waits for the key (up to ten TTLs),
/// which must come free, no earlier than the validity `lease` reported and with a larger token;
/// the new lease is released. `holder` names the vanished holder in a failure ("the crashed
/// holder").
pub(super) async fn vanish_and_take_over(
    ctx: &Ctx,
    lease: Box<dyn lease_core::Lease>,
    client: &dyn Coordinator,
    key: &LockKey,
    holder: &str,
) -> Result<(), Failure> {
    let (token, valid_until) = (lease.token(), lease.valid_until());
    std::mem::forget(lease);
    let next = client
        .acquire(
            key,
            &lease_core::LeaseOptions::new(ctx.ttl()).wait(ctx.ttl() * 10),
        )
        .await
        .map_err(|e| Failure(format!("key stayed blocked after {holder} vanished: {e}")))?;
    check!(
        next.token() > token,
        "token {} not above {holder}'s {token}",
        next.token()
    );
    let now = tokio::time::Instant::now();
    check!(
        now >= valid_until,
        "the key came free {:?} before {holder}'s validity ended",
        valid_until - now
    );
    next.release().await?;
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    fn timing(vars: &[(&str, &str)]) -> Result<Timing, String> {
        Timing::from_lookup(|name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn test_arguments_are_read_as_libtest_reads_them() {
        let args = |a: &[&str]| test_args(a.iter().map(|s| s.to_string()));
        assert_eq!(args(&[]), (None, vec![]));
        assert_eq!(
            args(&["fault", "--nocapture"]),
            (Some("fault".into()), vec![])
        );
        // An option's value is not the filter.
        assert_eq!(args(&["--test-threads", "1"]), (None, vec![]));
        assert_eq!(
            args(&["--skip", "chaos", "--skip=many", "tokens"]),
            (Some("tokens".into()), vec!["chaos".into(), "many".into()])
        );
    }

    #[test]
    fn timing_defaults_when_unset_or_empty() {
        assert_eq!(timing(&[]), Ok(Timing::default()));
        assert_eq!(
            timing(&[(TTL_ENV, " "), (TIME_SCALE_ENV, "")]),
            Ok(Timing::default())
        );
    }

    #[test]
    fn timing_reads_ttl_and_scale() {
        let t = timing(&[(TTL_ENV, "2000"), (TIME_SCALE_ENV, "2.5")]).unwrap();
        assert_eq!(t.ttl_override, Some(Duration::from_secs(2)));
        assert_eq!(t.time_scale, 2.5);
        assert_eq!(
            t.case_budget(Duration::from_secs(2), 3),
            Duration::from_secs(40)
        );
        assert_eq!(
            Timing::default().case_budget(Duration::from_millis(400), 5),
            Duration::from_secs(12)
        );
    }

    #[test]
    fn malformed_timing_names_the_variable() {
        for (var, value) in [
            (TTL_ENV, "2s"),
            (TTL_ENV, "0"),
            (TTL_ENV, "3600001"),
            (TIME_SCALE_ENV, "fast"),
            (TIME_SCALE_ENV, "0"),
            (TIME_SCALE_ENV, "-1"),
            (TIME_SCALE_ENV, "NaN"),
            (TIME_SCALE_ENV, "1000"),
        ] {
            let e = timing(&[(var, value)]).unwrap_err();
            assert!(e.contains(var) && e.contains(value), "{e}");
        }
    }

    /// The in-memory backend, declaring itself shared across processes.
    #[derive(Debug)]
    struct SharedMemory(
        lease_core::memory::MemoryCoordinator,
        lease_core::Capabilities,
    );

    #[async_trait::async_trait]
    impl Coordinator for SharedMemory {
        fn capabilities(&self) -> &lease_core::Capabilities {
            &self.1
        }
        async fn acquire(
            &self,
            key: &LockKey,
            options: &lease_core::LeaseOptions,
        ) -> lease_core::Result<Box<dyn lease_core::Lease>> {
            self.0.acquire(key, options).await
        }
        async fn try_acquire(
            &self,
            key: &LockKey,
            options: &lease_core::LeaseOptions,
        ) -> lease_core::Result<Box<dyn lease_core::Lease>> {
            self.0.try_acquire(key, options).await
        }
        async fn inspect(
            &self,
            key: &LockKey,
        ) -> lease_core::Result<Option<lease_core::HolderInfo>> {
            self.0.inspect(key).await
        }
        async fn force_release(
            &self,
            key: &LockKey,
            request: &lease_core::ForceRelease,
        ) -> lease_core::Result<Option<lease_core::HolderInfo>> {
            self.0.force_release(key, request).await
        }
    }

    /// A backend shared across processes on a subject with no worker: the process cases are a
    /// named skip, except under `CI=true`, where they fail. A backend that is not shared skips
    /// them under CI too.
    #[tokio::test]
    async fn process_cases_without_a_worker_fail_under_ci_when_the_backend_is_shared() {
        let memory = lease_core::memory::MemoryCoordinator::new();
        let caps = memory.capabilities().clone().shared_across_processes(true);
        let shared: Arc<dyn Coordinator> = Arc::new(SharedMemory(memory, caps));
        let subject = Subject::shared(
            "shared-memory",
            shared,
            Arc::new(lease_core::memory::MemoryFence::new()),
            Duration::from_millis(300),
        );
        let needs = [Need::Processes];
        assert_eq!(
            subject.missing_under(&needs, false).await,
            Ok(Some(Need::Processes))
        );
        let under_ci = subject.missing_under(&needs, true).await.unwrap_err();
        assert!(
            under_ci.contains("shared-memory declares that it is shared across OS processes"),
            "{under_ci}"
        );
        let memory = Subject::memory();
        for ci in [false, true] {
            assert_eq!(
                memory.missing_under(&needs, ci).await,
                Ok(Some(Need::Processes))
            );
        }
    }

    /// A clean-up left by a case is waited for before the next case: `settle` returns only once
    /// every one has run, and none is left for the next `settle`.
    #[tokio::test]
    async fn settle_waits_for_every_clean_up_left_by_a_case() {
        let subject = Subject::memory();
        let done = Arc::new(std::sync::atomic::AtomicU32::new(0));
        for ms in [60, 10] {
            let done = done.clone();
            subject.clean_up_later(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
        subject.clone().settle().await;
        assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert!(subject.cleanups.lock().unwrap().is_empty());
    }

    fn memory_ctx() -> Ctx {
        Ctx {
            subject: Subject::memory(),
            prefix: "self-test".into(),
            seed: 1,
            rng: std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(1)),
            time_scale: 1.0,
        }
    }

    /// An attempt cut short by a stall is run again; a pass ends it.
    #[tokio::test]
    async fn unless_stalled_runs_again_after_a_stall_and_stops_at_a_pass() {
        let ctx = memory_ctx();
        let calls = std::sync::atomic::AtomicU32::new(0);
        let verdict = unless_stalled(&ctx, "self-test", |n| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move { Ok((n == 1).then(|| "stalled".to_owned())) }
        })
        .await;
        assert!(matches!(verdict, Ok(Verdict::Passed)), "{verdict:?}");
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    /// A failure ends the case at once, whatever came before; an attempt cut short every time
    /// fails the case too, naming every reason (an adapter failing each attempt is not
    /// excused).
    #[tokio::test]
    async fn unless_stalled_never_turns_a_failure_or_three_stalls_into_a_pass() {
        let ctx = memory_ctx();
        let calls = std::sync::atomic::AtomicU32::new(0);
        let failed = unless_stalled(&ctx, "self-test", |n| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if n == 1 {
                    Ok(Some("stalled".to_owned()))
                } else {
                    Err(Failure("two holders".into()))
                }
            }
        })
        .await;
        assert!(
            matches!(&failed, Err(Failure(m)) if m == "two holders"),
            "{failed:?}"
        );
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2);

        let always = unless_stalled(&ctx, "self-test", |n| async move {
            Ok(Some(format!("stall {n}")))
        })
        .await;
        match always {
            Err(Failure(m)) => assert!(
                m.contains("stall 1; stall 2; stall 3") && m.contains("every time"),
                "{m}"
            ),
            other => panic!("three stalls passed: {other:?}"),
        }
    }

    /// The probe sees a stopped process: here the runtime's one thread blocked for 300 ms.
    /// (Only the positive is checked: how small the worst step is on a quiet machine depends on
    /// the machine.)
    #[tokio::test(flavor = "current_thread")]
    async fn the_stall_watch_sees_a_blocked_runtime() {
        let ctx = memory_ctx();
        let watch = StallWatch::start(&ctx).await.unwrap();
        // Let the probe take its first steps.
        tokio::time::sleep(Duration::from_millis(30)).await;
        std::thread::sleep(Duration::from_millis(300));
        let seen = watch.stalled(Duration::from_millis(250));
        assert!(seen.is_some(), "worst step {:?}", watch.worst());
    }
}
