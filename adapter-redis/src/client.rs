//! The command connection: one multiplexed connection every request shares, and two more for
//! writes followed by `WAIT`. Each is reopened after it breaks and checked for durability and
//! replication every time it is opened. With `redis+sentinel://`, every open asks the Sentinels
//! for the primary first and checks that it answers `ROLE master`.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lease_core::{Error, Result};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisResult};
use tokio::time::Instant;

use crate::config::{RedisConfig, ReplicaAcks, SentinelConfig};
use crate::error::{self, ops, BACKEND};
use crate::scripts::reply;
use lease_core::adapter::{Op, SharedOpening};

/// A write that cannot be sent twice (a fence write, a force-release) first checks, with a
/// `PING`, a connection that has not answered for this long.
///
/// redis-rs notices a connection the server closed (a restart, `CLIENT KILL`, a Sentinel
/// reconfiguring the server) only when a request fails on it, and a request that fails that way
/// may or may not have been sent. An idempotent request is then sent again on a new connection,
/// but such a write can only report `OutcomeUnknown`, although nothing left the process. The
/// check costs a round trip, paid only by these writes, and only after a pause (a fence write
/// that waits for replicas goes on a connection of its own, usually idle, so it mostly pays it).
/// A close less than this before the write (while requests still answered), or between the
/// `PING` and the write, still leaves that write's outcome unknown.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// How often `replica_acks=auto`, while it has seen no streaming replica, counts the primary's
/// replicas again before a write ([`Connection::acks_for`]): a replica that was still in its
/// first full sync at the connect, or was added later, is waited for from the write whose count
/// finds it on. At most one `INFO replication` per interval, and none once a replica was seen
/// (the count is never lowered).
const REPLICA_RECHECK: Duration = Duration::from_secs(1);

/// How many connections of their own writes followed by `WAIT` get ([`Connection::eval_and_wait`]).
///
/// Redis reads nothing more from a client blocked in `WAIT`: on the connection every other
/// request shares, one grant waiting for a slow replica held up releases, reads and renewals
/// behind it for up to half the request timeout (long enough for a request queued behind two
/// of them to time out, which marks every lease in doubt). Writes that wait go on these instead,
/// one at a time on each; the shared connection never waits. A write that finds none free within
/// the request timeout (earlier ones all still waiting for a slow replica) is `Unavailable`,
/// sent nowhere.
pub(crate) const WAITING_CONNECTIONS: usize = 2;

/// The command connection: the one every request shares, and [`WAITING_CONNECTIONS`] more for
/// writes followed by `WAIT`, each opened on first use.
///
/// Every request goes through [`Connection::run`] (or the `eval` methods), which maps errors in
/// one place ([`crate::error`]) and drops a connection that redis-rs reports as unusable (or
/// that timed out: a half-open TCP connection never recovers by itself).
pub(crate) struct Connection {
    /// The connection every request but those of [`Self::eval_and_wait`] goes on (its
    /// [`Lane::shared`] is what every connection shares).
    main: Lane,
    /// The connections [`Self::eval_and_wait`] runs on, each with the lock held while a write
    /// waits on it (one at a time: Redis reads nothing more from a client blocked in `WAIT`).
    waiting: Vec<(Lane, tokio::sync::Mutex<()>)>,
    /// Which of `waiting` is tried first next.
    next_waiting: AtomicUsize,
    /// One permit per connection of `waiting` not in use.
    free_waiting: tokio::sync::Semaphore,
}

/// What every connection of a [`Connection`] shares.
struct Shared {
    config: RedisConfig,
    /// The client of the primary the last successful open found (without Sentinel: the one
    /// server). Each connection asks the Sentinels itself (one that only followed another's
    /// primary stayed on a dead primary for as long as no request of the other failed); the
    /// pub/sub and tracking connections follow whichever found it last.
    client: Mutex<redis::Client>,
    /// The most replicas a primary reported streaming (`state=online`) at any open or
    /// [`Connection::recheck_replicas`] so far.
    replicas: AtomicUsize,
    /// When the replicas were last counted (an open's count answered, or a recount started), in
    /// nanoseconds since `created`.
    replicas_counted: AtomicU64,
    /// Set once `INFO` was refused at a recheck: there is nothing to look at again.
    recheck_refused: AtomicBool,
    created: Instant,
    /// The Sentinel that answered last (asked first next time).
    sentinel_first: AtomicUsize,
    async_config: AsyncConnectionConfig,
    verify_durability: bool,
    /// Called when a request finds a connection broken (no reply in time, or dropped): the
    /// coordinator marks its leases in doubt.
    on_break: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Whether [`Shared::warn_unsettled`] has logged.
    warned_unsettled: AtomicBool,
    /// Numbers the connections opened ([`Open::generation`]).
    opens: AtomicU64,
    /// Whether a server said it runs as a Redis Cluster node (`redis_mode:cluster` in `INFO
    /// server`, read as each connection opens): keys of different locks are then in different
    /// hash slots, which one script cannot touch.
    cluster: AtomicBool,
    /// The server refused this user `WAIT` (`NOPERM`, answered to the `WAIT 0 0` sent as each
    /// connection opens): a write that must wait for replicas is refused before it is sent.
    wait_refused: AtomicBool,
}

/// One multiplexed connection, opened lazily again after it broke.
struct Lane {
    /// What every connection of the [`Connection`] shares.
    shared: Arc<Shared>,
    /// The open connection, or its opening under way, which every request asking meanwhile
    /// awaits (one attempt; its failure reaches them all at once, rather than each waiting a
    /// whole connect timeout in turn).
    current: SharedOpening<Open>,
    /// When the connection last answered, in nanoseconds since the lane was created (`opened`;
    /// see [`IDLE_CHECK`]).
    answered: AtomicU64,
    opened: Instant,
    /// The last connection [`Lane::end`] ended: the writes that were in flight on it when it
    /// stopped answering share one `CLIENT KILL`.
    ended: tokio::sync::Mutex<Option<u64>>,
}

/// An open connection of a [`Lane`].
#[derive(Clone)]
struct Open {
    /// Which open this is, unique among the connection's lanes (see [`Lane::discard`]).
    generation: u64,
    conn: MultiplexedConnection,
    /// Who the connection is on its server, when the server said.
    side: Option<Arc<ServerSide>>,
    /// When it opened: its open counts as an answer ([`Lane::idle`]).
    opened: Instant,
}

/// Who a connection is on its server, read when it opens (`CLIENT INFO` and `INFO server`):
/// enough to end it from another connection to the same server process.
#[derive(Debug)]
struct ServerSide {
    /// The server process (`run_id`: a restarted server, or another one, has another).
    run_id: String,
    /// The connection's `id` as the server numbers it.
    id: u64,
    /// The connection's peer address as the server sees it (`addr`).
    addr: String,
}

impl Connection {
    /// Opens the first connection (and checks durability unless the config opts out).
    pub(crate) async fn open(config: &RedisConfig) -> Result<Self> {
        Self::open_with(config, config.client()?).await
    }

    /// Like [`Connection::open`], through `client` (an application's own redis-rs client; with
    /// Sentinel, only until the first reconnect asks the Sentinels).
    pub(crate) async fn open_with(config: &RedisConfig, client: redis::Client) -> Result<Self> {
        let shared = Arc::new(Shared {
            config: config.clone(),
            client: Mutex::new(client),
            replicas: AtomicUsize::new(0),
            replicas_counted: AtomicU64::new(0),
            recheck_refused: AtomicBool::new(false),
            created: Instant::now(),
            sentinel_first: AtomicUsize::new(0),
            async_config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(config.connect_timeout()))
                .set_response_timeout(Some(config.request_timeout())),
            verify_durability: !config.volatile_tokens(),
            on_break: std::sync::OnceLock::new(),
            warned_unsettled: AtomicBool::new(false),
            opens: AtomicU64::new(0),
            cluster: AtomicBool::new(false),
            wait_refused: AtomicBool::new(false),
        });
        let conn = Connection {
            main: Lane::new(&shared),
            waiting: (0..WAITING_CONNECTIONS)
                .map(|_| (Lane::new(&shared), tokio::sync::Mutex::new(())))
                .collect(),
            next_waiting: AtomicUsize::new(0),
            free_waiting: tokio::sync::Semaphore::new(WAITING_CONNECTIONS),
        };
        conn.main.get().await?;
        Ok(conn)
    }

    /// The redis-rs client of the server a connection last opened to (for the pub/sub and
    /// tracking connections: with Sentinel, the current primary as last found).
    pub(crate) fn client(&self) -> redis::Client {
        self.main.shared.client()
    }

    /// The most replicas a primary reported streaming (`state=online`) when a connection was
    /// opened or at a recheck (never lowered).
    pub(crate) fn replicas(&self) -> usize {
        self.main.shared.replicas.load(Ordering::Relaxed)
    }

    /// How many replica acknowledgements a write waits for under `asked` (`replica_acks`;
    /// `auto` is one once a primary reported a streaming replica), as known now.
    pub(crate) fn acks_known(&self, asked: ReplicaAcks) -> usize {
        match asked {
            ReplicaAcks::Auto => self.replicas().min(1),
            ReplicaAcks::Exactly(n) => usize::from(n),
        }
    }

    /// Whether the server is a Redis Cluster node (as far as it said: a server that refused
    /// `CLIENT INFO` or `INFO` is taken for a standalone one), where one script can touch the
    /// keys of one lock only.
    pub(crate) fn cluster_mode(&self) -> bool {
        self.main.shared.cluster.load(Ordering::Relaxed)
    }

    /// [`Self::acks_known`], for a write about to be sent: under `auto`, while no replica was
    /// seen, the replicas are counted again first when the last count is [`REPLICA_RECHECK`]
    /// old (one caller at a time; the others use the count they find).
    ///
    /// `Misconfigured`, before anything is sent, when the write must wait for replicas and the
    /// user may not run `WAIT`: the write would apply on the primary alone, and be given back.
    pub(crate) async fn acks_for(&self, asked: ReplicaAcks) -> Result<usize> {
        if asked == ReplicaAcks::Auto && self.replicas() == 0 && self.main.shared.recheck_due() {
            self.recheck_replicas().await?;
        }
        let acks = self.acks_known(asked);
        if acks > 0 && self.main.shared.wait_refused.load(Ordering::Relaxed) {
            return Err(Error::misconfigured(
                BACKEND,
                format!(
                    "the Redis user may not run WAIT, which replica_acks needs to have {acks} \
                     replica(s) acknowledge each write: grant it WAIT, or set replica_acks=0 \
                     (a failover may then lose grants and fence writes); nothing was sent"
                ),
            ));
        }
        Ok(acks)
    }

    /// Counts the streaming replicas again (`INFO replication`, one round trip on the shared
    /// connection, as any request: a broken connection is replaced and reported).
    ///
    /// - A primary found with replicas while `clock_tokens` is off is refused as at a connect:
    ///   every connection is discarded, so that every later request's open refuses it too.
    /// - `INFO` refused for good (no permission, or renamed) ends the recounts.
    /// - Any other failure keeps the count (the write that follows meets the same trouble and
    ///   reports it).
    async fn recheck_replicas(&self) -> Result<()> {
        let shared = &self.main.shared;
        let answer = self
            .run(ops::RECOUNT, |mut c| async move {
                match redis::cmd("INFO")
                    .arg("replication")
                    .query_async::<String>(&mut c)
                    .await
                {
                    Ok(info) => Ok(Ok(info)),
                    // The server's refusal, kept apart from transport failures.
                    Err(e) if e.code().is_some() => Ok(Err(e)),
                    Err(e) => Err(e),
                }
            })
            .await;
        match answer {
            Ok(Ok(info)) => {
                let online = online_replicas(&info);
                shared.replicas.fetch_max(online, Ordering::Relaxed);
                if let Err(e) = refuse_unguarded_replicas(connected_replicas(&info), &shared.config)
                {
                    self.main.discard(None);
                    for (lane, _) in &self.waiting {
                        lane.discard(None);
                    }
                    return Err(e);
                }
                if online > 0 {
                    tracing::info!(backend = BACKEND, replicas = online, "the primary has a streaming replica now: writes wait for one (replica_acks=auto)");
                }
            }
            Ok(Err(e))
                if e.code() == Some("NOPERM") || e.to_string().contains("unknown command") =>
            {
                shared.recheck_refused.store(true, Ordering::Relaxed);
                tracing::debug!(backend = BACKEND, error = %e, "INFO replication refused; replicas are not counted again");
            }
            Ok(Err(e)) => {
                tracing::debug!(backend = BACKEND, error = %e, "counting replicas again was refused");
            }
            Err(e) => {
                tracing::debug!(backend = BACKEND, error = %e, "counting replicas again failed");
            }
        }
        Ok(())
    }

    /// Sets what to do when a request finds a connection broken (once; later calls are
    /// ignored).
    pub(crate) fn set_on_break(&self, f: Box<dyn Fn() + Send + Sync>) {
        let _ = self.main.shared.on_break.set(f);
    }

    /// The current shared connection and its generation (for [`Self::discard`]), opening one
    /// if needed.
    pub(crate) async fn raw(&self) -> Result<(u64, MultiplexedConnection)> {
        self.main.get().await.map(|o| (o.generation, o.conn))
    }

    /// The connect timeout.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.main.shared.config.connect_timeout()
    }

    /// Forgets the shared connection of `generation` (or any, for `None`) so the next request
    /// opens a new one. Requests in flight on it finish or fail by themselves.
    pub(crate) fn discard(&self, generation: Option<u64>) {
        self.main.discard(generation);
    }

    /// Runs one request on the shared connection and maps its error.
    ///
    /// A connection found dropped (the server closed it, for example on a restart, before or
    /// while the request was sent) is replaced, and an idempotent request is sent once more on the
    /// new connection. A non-idempotent write, or a retry that cannot connect, reports the first
    /// failure (`OutcomeUnknown` for a write).
    pub(crate) async fn run<T, F, Fut>(&self, op: Op, f: F) -> Result<T>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.main.run_noting_resend(op, f, None).await.0
    }

    /// Runs `script` (`EVALSHA`, loading it on `NOSCRIPT`) with `keys` and `args`.
    pub(crate) async fn eval(
        &self,
        op: Op,
        script: &redis::Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<redis::Value> {
        self.eval_noting_resend(op, script, keys, args).await.0
    }

    /// [`Self::eval`], also saying whether the reply is that of a write sent again after its
    /// first send's connection dropped (the first send may have applied: an answer of "not
    /// ours" may be its own doing).
    pub(crate) async fn eval_noting_resend(
        &self,
        op: Op,
        script: &redis::Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> (Result<redis::Value>, bool) {
        let cmd = &evalsha(script, keys, args);
        self.main
            .run_noting_resend(
                op,
                |c| {
                    loading(
                        script,
                        c,
                        |mut c| async move { cmd.query_async(&mut c).await },
                    )
                },
                None,
            )
            .await
    }

    /// Like [`Self::eval`], then `WAIT replicas wait_ms` in the same pipeline (one round trip,
    /// the same connection, so the `WAIT` covers the script's writes): the script's reply and how
    /// many replicas acknowledged. Runs on one of the connections kept for this
    /// ([`WAITING_CONNECTIONS`]), never on the one every other request shares.
    ///
    /// `settle`: the arguments of a run of the same script, on the same keys, that writes again,
    /// unchanged, what this one may have written. When the write gets no answer and its
    /// connection is ended on the server, that run and a `WAIT` for the same replicas follow on
    /// a new connection ([`Lane::settle`]): the connection that was ended may have applied the
    /// write without its `WAIT` reaching the replicas, and a read would then show, on the
    /// primary alone, a write that a failover loses. The error then says whether the replicas
    /// have everything the write did. Without `settle` (a grant or a renewal, whose callers
    /// never take a lost reply's outcome from a read), the error says only whether the
    /// connection was ended.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn eval_and_wait(
        &self,
        op: Op,
        script: &redis::Script,
        keys: &[&str],
        args: &[&[u8]],
        replicas: usize,
        wait: Duration,
        settle: Option<&[&[u8]]>,
    ) -> Result<(redis::Value, i64)> {
        let bound = self.main.shared.config.request_timeout();
        let Ok(Ok(_free)) = tokio::time::timeout(bound, self.free_waiting.acquire()).await else {
            return Err(Error::unavailable(
                BACKEND,
                format!(
                    "{}: no connection free for a write that waits for replicas within \
                     {bound:?} (the earlier ones are all still waiting for a replica's \
                     acknowledgement); nothing was sent",
                    op.name
                ),
            ));
        };
        // A permit means one of them is free.
        let n = self.waiting.len();
        let first = self.next_waiting.fetch_add(1, Ordering::Relaxed);
        let (lane, _busy) = (0..n)
            .map(|i| &self.waiting[(first + i) % n])
            .find_map(|(lane, busy)| busy.try_lock().ok().map(|g| (lane, g)))
            .expect("a free connection for each permit");
        let pipe = &waited(evalsha(script, keys, args), replicas, wait);
        let settle = settle.map(|args| Settle {
            script,
            pipe: waited(evalsha(script, keys, args), replicas, wait),
            replicas,
            wait,
        });
        lane.run_noting_resend(
            op,
            |c| loading(script, c, |c| script_then_wait(pipe, c)),
            settle.as_ref(),
        )
        .await
        .0
    }
}

/// `cmd`, then `WAIT replicas wait` (in milliseconds, at least one), as one pipeline: the `WAIT`
/// covers `cmd`'s writes and everything before them. Each answered on its own
/// ([`script_then_wait`]).
fn waited(cmd: redis::Cmd, replicas: usize, wait: Duration) -> redis::Pipeline {
    let mut pipe = redis::pipe();
    pipe.add_command(cmd)
        .cmd("WAIT")
        .arg(replicas)
        .arg(wait.as_millis().max(1) as u64)
        .ignore_errors();
    pipe
}

/// Runs `pipe` (a script, then its `WAIT`, [`waited`]): the script's answer and how many
/// replicas the `WAIT` counted. A script that failed is the error, as if it had been sent alone
/// (its writes are ordered so that a failure leaves nothing behind). A `WAIT` that failed after
/// the script answered (refused to a user without it, or `UNBLOCKED` when a failover demotes
/// the server under it) counted no replica: the script's writes stand, on no replica known, which
/// every caller handles as too few acknowledgements, never as nothing applied.
async fn script_then_wait(
    pipe: &redis::Pipeline,
    mut c: MultiplexedConnection,
) -> RedisResult<(redis::Value, i64)> {
    let (answer, waited): (RedisResult<redis::Value>, RedisResult<i64>) =
        pipe.query_async(&mut c).await.map_err(error::unpipelined)?;
    let answer = answer?;
    match waited {
        Ok(acked) => Ok((answer, acked)),
        Err(e) => {
            tracing::warn!(backend = BACKEND, error = %e, "WAIT failed after the script ran: no replica is known to have its writes");
            Ok((answer, 0))
        }
    }
}

/// What follows a write that waits for replicas when it gets no answer and its connection is
/// ended ([`Connection::eval_and_wait`], [`Lane::settle`]).
struct Settle<'a> {
    /// The script of the write and of `pipe`, loaded on `NOSCRIPT`.
    script: &'a redis::Script,
    /// The script's run that writes again, unchanged, what the write may have written, then the
    /// `WAIT`.
    pipe: redis::Pipeline,
    /// How many replicas the write waited for.
    replicas: usize,
    /// The `WAIT`'s bound.
    wait: Duration,
}

/// `EVALSHA` of `script` with `keys` and `args`, built in place: redis-rs's `ScriptInvocation`
/// copies every key and argument into a vector of its own, then again into the command
/// (measured with lease-bench under `perf`: the largest allocation site of an acquire+release).
fn evalsha(script: &redis::Script, keys: &[&str], args: &[&[u8]]) -> redis::Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args);
    cmd
}

/// Runs `query` (an `EVALSHA` of `script`, alone or in a pipeline) on `c`; when the server does
/// not know the script (`NOSCRIPT`: restarted, failed over, `SCRIPT FLUSH`), loads it on the
/// same connection and runs `query` once more.
async fn loading<T, Fut>(
    script: &redis::Script,
    c: MultiplexedConnection,
    query: impl Fn(MultiplexedConnection) -> Fut,
) -> RedisResult<T>
where
    Fut: Future<Output = RedisResult<T>>,
{
    match query(c.clone()).await {
        Err(e) if e.code() == Some("NOSCRIPT") => {
            script.load_async(&mut c.clone()).await?;
            query(c).await
        }
        other => other,
    }
}

impl Shared {
    fn client(&self) -> redis::Client {
        self.client
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn broke(&self, e: &redis::RedisError) {
        if unanswered(e) {
            if let Some(f) = self.on_break.get() {
                f();
            }
        }
    }

    /// Opens a connection to the primary (with Sentinel: asking the Sentinels where it is, and
    /// when the server one named cannot be opened as the primary, asking the next while the
    /// connect timeout lasts) and checks it, raising the replica count to what it reports.
    async fn connect(&self) -> Result<(MultiplexedConnection, Option<ServerSide>)> {
        let Some(s) = self.config.sentinel() else {
            return self.open_primary(self.client()).await;
        };
        // Another Sentinel is asked while the connect timeout lasts, each at most once.
        let deadline = Instant::now() + self.config.connect_timeout();
        let mut tries = 0;
        loop {
            let (client, asked) = self.ask_sentinels(s).await?;
            tries += 1;
            let opened = self.open_primary(client).await;
            if opened.is_ok() {
                return opened;
            }
            // The server that Sentinel named cannot be reached, or is no primary: that Sentinel
            // may be cut off from the others, which have failed over since. Ask it last (unless
            // another caller already moved on), or every reconnect would go back to the same
            // stale answer.
            let _ = self.sentinel_first.compare_exchange(
                asked,
                (asked + 1) % s.sentinels.len(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            if tries >= s.sentinels.len() || Instant::now() >= deadline {
                return opened;
            }
        }
    }

    /// Opens a connection to `client`'s server and checks that it is a primary fit for locks.
    async fn open_primary(
        &self,
        client: redis::Client,
    ) -> Result<(MultiplexedConnection, Option<ServerSide>)> {
        let connect_timeout = self.config.connect_timeout();
        let mut conn = tokio::time::timeout(
            connect_timeout,
            client.get_multiplexed_async_connection_with_config(&self.async_config),
        )
        .await
        .map_err(|_| error::connect_timed_out(connect_timeout))?
        .map_err(error::connect_failed)?;
        if self.verify_durability {
            check_durability(&mut conn).await?;
        }
        let replicas = check_replication(&mut conn, &self.config).await?;
        // Never lowered: a primary cut off from its replicas still has them as far as a
        // failover is concerned (Sentinel may promote one), so `auto` keeps waiting for one.
        self.replicas.fetch_max(replicas, Ordering::Relaxed);
        self.replicas_counted
            .fetch_max(self.since_created(), Ordering::Relaxed);
        let side = server_side(&mut conn, self).await?;
        *self.client.lock().unwrap_or_else(|p| p.into_inner()) = client;
        tracing::debug!(backend = BACKEND, replicas, "command connection opened");
        Ok((conn, side))
    }

    fn since_created(&self) -> u64 {
        self.created.elapsed().as_nanos() as u64
    }

    /// Whether the replicas should be counted again ([`REPLICA_RECHECK`] since the last count,
    /// and `INFO` not refused); true for one caller only, which must count them.
    fn recheck_due(&self) -> bool {
        if self.recheck_refused.load(Ordering::Relaxed) {
            return false;
        }
        let (last, now) = (
            self.replicas_counted.load(Ordering::Relaxed),
            self.since_created(),
        );
        now.saturating_sub(last) >= REPLICA_RECHECK.as_nanos() as u64
            && self
                .replicas_counted
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Logs, once per coordinator, that a write whose answer is lost cannot have its connection
    /// ended on the server (`e`: `CLIENT INFO`, `INFO` or `CLIENT KILL` refused).
    fn warn_unsettled(&self, e: &redis::RedisError) {
        if !self.warned_unsettled.swap(true, Ordering::Relaxed) {
            tracing::warn!(backend = BACKEND, error = %e, "CLIENT INFO, INFO or CLIENT KILL refused or unsupported (Redis 6.2 or later, and +client|info +info +client|kill for an ACL user, are needed): a write whose answer is lost cannot be kept from applying late");
        }
    }

    /// Asks the Sentinels, in order starting with the one that answered last, where the primary
    /// is; the whole round is bounded by the connect timeout, each Sentinel by a share of what is
    /// left (equal among those not asked yet, but at least half), and one that fails is asked
    /// after the others next time. A Sentinel that
    /// does not know the primary's name is a configuration error only when none knows it.
    /// Returns a client for the primary named and which Sentinel named it.
    async fn ask_sentinels(&self, s: &SentinelConfig) -> Result<(redis::Client, usize)> {
        let n = s.sentinels.len();
        let first = self.sentinel_first.load(Ordering::Relaxed) % n;
        let deadline = Instant::now() + self.config.connect_timeout();
        let mut problems = Vec::new();
        let mut unknown = 0;
        for (asked, i) in (0..n).map(|i| (i, (first + i) % n)) {
            let (host, port) = &s.sentinels[i];
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                problems.push(format!("{host}:{port}: not asked (connect timeout spent)"));
                continue;
            }
            // An equal share of what is left for each Sentinel not asked yet, so that one that
            // drops packets does not spend the whole connect timeout before the others are
            // asked; but never less than half of what is left, or a short timeout over many
            // Sentinels would leave each too little to answer at all.
            let share = (left / (n - asked) as u32).max(left / 2);
            let answer = tokio::time::timeout(share, primary_of(host, *port, &s.primary)).await;
            if !matches!(answer, Ok(Ok(Some(_)))) {
                // Ask it last next time (unless another caller already moved on).
                let _ = self.sentinel_first.compare_exchange(
                    i,
                    (i + 1) % n,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            match answer {
                Ok(Ok(Some((h, p)))) => {
                    self.sentinel_first.store(i, Ordering::Relaxed);
                    return Ok((self.config.client_for(&h, p)?, i));
                }
                Ok(Ok(None)) => {
                    unknown += 1;
                    problems.push(format!("{host}:{port}: does not monitor {:?}", s.primary));
                }
                Ok(Err(e)) => problems.push(format!("{host}:{port}: {e}")),
                Err(_) => problems.push(format!("{host}:{port}: no answer in time")),
            }
        }
        if unknown == n {
            return Err(Error::misconfigured(
                BACKEND,
                format!(
                    "no Sentinel monitors a primary named {:?} ({})",
                    s.primary,
                    problems.join("; ")
                ),
            ));
        }
        Err(Error::unavailable(
            BACKEND,
            format!(
                "no Sentinel named the primary {:?}: {}",
                s.primary,
                problems.join("; ")
            ),
        ))
    }
}

impl Lane {
    fn new(shared: &Arc<Shared>) -> Self {
        Lane {
            shared: shared.clone(),
            current: SharedOpening::new(BACKEND),
            answered: AtomicU64::new(0),
            opened: Instant::now(),
            ended: tokio::sync::Mutex::new(None),
        }
    }

    /// Records that the connection answered now.
    fn note_answer(&self) {
        let since = self.opened.elapsed().as_nanos() as u64;
        self.answered.fetch_max(since, Ordering::Relaxed);
    }

    /// How long since `open` last answered (or was opened).
    fn idle(&self, open: &Open) -> Duration {
        let answered = Duration::from_nanos(self.answered.load(Ordering::Relaxed));
        let since_answer = self.opened.elapsed().saturating_sub(answered);
        since_answer.min(open.opened.elapsed())
    }

    /// The current connection, opening (and checking) a new one if there is none. Requests
    /// asking while one is being opened await that opening.
    async fn get(&self) -> Result<Open> {
        self.current
            .get(
                |_| true,
                || {
                    let shared = self.shared.clone();
                    async move {
                        let (conn, side) = shared.connect().await?;
                        Ok(Open {
                            generation: shared.opens.fetch_add(1, Ordering::Relaxed) + 1,
                            conn,
                            side: side.map(Arc::new),
                            opened: Instant::now(),
                        })
                    }
                },
            )
            .await
    }

    /// Forgets the connection of `generation` (or any, for `None`).
    fn discard(&self, generation: Option<u64>) {
        self.current
            .discard(|o| generation.is_none_or(|want| o.generation == want));
    }

    /// Ends the connection of `generation` (discarded already; `side` on its server) on its
    /// server, from a new connection, so that nothing sent on it and not yet run (held in a
    /// stalled network path, say) runs later: `CLIENT KILL` of its `id` and `addr`, on a
    /// connection to the same server process. Redis runs nothing more from a client it kills,
    /// and bytes that reach a closed socket are refused. Bounded by the connect timeout plus the
    /// request timeout (the new connection's open and checks, then the kill); once ended, the
    /// other writes that were in flight on it need no kill of their own. `Err` says why the
    /// connection could not be ended.
    async fn end(&self, generation: u64, side: Option<&ServerSide>) -> Result<(), String> {
        let Some(side) = side else {
            return Err(
                "the server did not say who the connection was at its open (CLIENT \
                 INFO and INFO server)"
                    .into(),
            );
        };
        let bound = self.shared.config.connect_timeout() + self.shared.config.request_timeout();
        let ended = async {
            let mut last = self.ended.lock().await;
            if *last == Some(generation) {
                return Ok(());
            }
            let r = self.kill(generation, side).await;
            if r.is_ok() {
                *last = Some(generation);
            }
            r
        };
        match tokio::time::timeout(bound, ended).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {bound:?}")),
        }
    }

    /// [`Self::end`]'s `CLIENT KILL`, from the lane's connection (a new one).
    async fn kill(&self, generation: u64, side: &ServerSide) -> Result<(), String> {
        let now = self.get().await.map_err(|e| e.to_string())?;
        if now.generation == generation {
            return Err("no other connection to end it from".to_owned());
        }
        match &now.side {
            Some(s) if s.run_id == side.run_id => {}
            // After a restart the old connection went with the old process; after a failover
            // the old primary may still hold it (and refuses writes once it is a replica).
            Some(_) => {
                return Err(
                    "a new connection reached another server process (a restart or a \
                     failover)"
                        .into(),
                )
            }
            None => return Err("the new connection's server did not say who it is".into()),
        }
        let mut conn = now.conn.clone();
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(side.id)
            .arg("ADDR")
            .arg(&side.addr)
            .arg("SKIPME")
            .arg("yes")
            .query_async::<i64>(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| {
                if e.code() == Some("NOPERM") {
                    self.shared.warn_unsettled(&e);
                }
                format!("CLIENT KILL failed: {e}")
            })
    }

    /// After a write that waits for replicas got no answer and its connection (on the server
    /// process `run_id`) was ended: runs `settle`'s write and `WAIT` on this lane's connection
    /// (the new one that ended it), within the request timeout. That write comes after
    /// everything the ended connection's write did in the replication stream, so once the
    /// replicas acknowledge it they have that too. A write that finds nothing to write again
    /// (the fence has no token: the lost write did not apply) has nothing to wait for.
    async fn settle(&self, settle: &Settle<'_>, run_id: &str) -> Ending {
        let bound = self.shared.config.request_timeout();
        let pipe = &settle.pipe;
        let mut used = None;
        let answer = tokio::time::timeout(bound, async {
            let open = self.get().await.map_err(|e| e.to_string())?;
            used = Some(open.generation);
            if open.side.as_ref().is_none_or(|s| s.run_id != run_id) {
                return Err("the connection to wait from reached another server process".into());
            }
            let answer: RedisResult<(redis::Value, i64)> =
                loading(settle.script, open.conn, |c| script_then_wait(pipe, c)).await;
            match answer {
                Ok(answer) => {
                    self.note_answer();
                    Ok(answer)
                }
                Err(e) => {
                    self.shared.broke(&e);
                    if unanswered(&e) || e.is_unrecoverable_error() || demoted(&e) {
                        self.discard(Some(open.generation));
                    }
                    Err(e.to_string())
                }
            }
        })
        .await
        .unwrap_or_else(|_| {
            // A half-open connection never recovers by itself.
            if let Some(generation) = used {
                self.discard(Some(generation));
            }
            Err(format!("no answer within {bound:?}"))
        });
        let wrote = |v: &redis::Value| {
            reply::array(v.clone())
                .and_then(|items| items.get(1).and_then(reply::text))
                .is_none_or(|newest| !newest.is_empty())
        };
        match answer {
            Ok((v, _)) if !wrote(&v) => Ending::Ended,
            Ok((_, n)) if usize::try_from(n).is_ok_and(|n| n >= settle.replicas) => {
                Ending::Replicated(settle.replicas)
            }
            Ok((_, n)) => Ending::Unreplicated(format!(
                "{n} of the {} replica(s) replica_acks asks for acknowledged a write made after \
                 it within {:?}",
                settle.replicas, settle.wait
            )),
            Err(why) => Ending::Unreplicated(format!(
                "the write made after it to wait for the replicas failed ({why})"
            )),
        }
    }

    /// `ending` once the replicas were waited for ([`Self::settle`]), when it says that the
    /// connection of `side` was ended and the write has a `settle`.
    async fn settled(
        &self,
        ending: Option<Ending>,
        settle: Option<&Settle<'_>>,
        side: Option<&ServerSide>,
    ) -> Option<Ending> {
        match (ending, settle, side) {
            (Some(Ending::Ended), Some(settle), Some(side)) => {
                Some(self.settle(settle, &side.run_id).await)
            }
            (ending, ..) => ending,
        }
    }

    /// [`Connection::run`] on this connection, also saying whether the outcome is that of a
    /// write sent again after its first send's connection dropped.
    ///
    /// A write whose request got no answer (a timeout, or its connection dropped) has its
    /// connection ended on the server ([`Self::end`]) before anything else is sent about it: a
    /// resend, or the caller's re-read after `OutcomeUnknown`, then sees everything that request
    /// will ever do. With `settle` ([`Connection::eval_and_wait`]), the replicas are then waited
    /// for ([`Self::settle`]). The error says whether it could be ended, and replicated.
    async fn run_noting_resend<T, F, Fut>(
        &self,
        op: Op,
        f: F,
        settle: Option<&Settle<'_>>,
    ) -> (Result<T>, bool)
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let mut open = match self.get().await {
            Ok(c) => c,
            Err(e) => return (Err(e), false),
        };
        if op.writes && !op.idempotent && self.idle(&open) >= IDLE_CHECK {
            let mut conn = open.conn.clone();
            match redis::cmd("PING").query_async::<()>(&mut conn).await {
                Ok(()) => self.note_answer(),
                Err(e) if unanswered(&e) => {
                    tracing::debug!(backend = BACKEND, error = %e, "idle command connection found closed; opening a new one");
                    self.shared.broke(&e);
                    self.discard(Some(open.generation));
                    open = match self.get().await {
                        Ok(c) => c,
                        Err(e) => return (Err(e), false),
                    };
                }
                // Refused (an ACL without `PING`, say): the connection works.
                Err(_) => {}
            }
        }
        let Open {
            generation,
            conn,
            side,
            ..
        } = open;
        let first = match f(conn).await {
            Ok(v) => {
                self.note_answer();
                return (Ok(v), false);
            }
            Err(e) => e,
        };
        let dropped = first.is_connection_dropped() && !first.is_timeout();
        let first_side = side.clone();
        let (first, ended) = self.failed(op, generation, side, first).await;
        if !(dropped && op.idempotent) {
            let ended = self.settled(ended, settle, first_side.as_deref()).await;
            return (Err(noted(first, ended, None)), false);
        }
        let open = match self.get().await {
            Ok(c) => c,
            // Cannot reconnect: for a write the first request's fate stays unknown.
            Err(_) if op.writes => {
                let ended = self.settled(ended, settle, first_side.as_deref()).await;
                return (Err(noted(first, ended, None)), false);
            }
            Err(e) => return (Err(e), false),
        };
        let Open {
            generation,
            conn,
            side,
            ..
        } = open;
        match f(conn).await {
            Ok(v) => {
                self.note_answer();
                (Ok(v), op.writes)
            }
            Err(e) => {
                let again_side = side.clone();
                let (e, ended_again) = self.failed(op, generation, side, e).await;
                if !op.writes {
                    return (Err(e), false);
                }
                // The retry failing (for example `LOADING` just after a restart) says nothing
                // about the first request: a write's outcome stays unknown, so the caller keeps
                // its cleanup armed. A retry that got no answer either is one more request that
                // may apply: the error then speaks for both. Waiting for the replicas after the
                // last connection was ended covers both sends.
                let first = match (ended, ended_again) {
                    (Some(Ending::Ended), Some(again)) => {
                        let again = self.settled(Some(again), settle, again_side.as_deref());
                        noted(first, again.await, Some(&e))
                    }
                    (ended, Some(_)) => noted(first, ended, Some(&e)),
                    (ended, None) => {
                        let ended = self.settled(ended, settle, first_side.as_deref()).await;
                        noted(first, ended, None)
                    }
                };
                (Err(first), false)
            }
        }
    }

    /// After `e` failed a request on the connection of `generation` (`side` on its server):
    /// marks the leases in doubt if the connection broke, drops a connection that is unusable
    /// (or timed out: a half-open TCP connection never recovers by itself), and ends it on the
    /// server when a write got no answer ([`Self::end`]). Returns the mapped error and, for such
    /// a write, whether its connection was ended (for [`noted`]).
    async fn failed(
        &self,
        op: Op,
        generation: u64,
        side: Option<Arc<ServerSide>>,
        e: redis::RedisError,
    ) -> (Error, Option<Ending>) {
        self.shared.broke(&e);
        let unsettled = op.writes && (unanswered(&e) || e.is_unrecoverable_error());
        if unsettled || e.is_unrecoverable_error() || e.is_timeout() || demoted(&e) {
            self.discard(Some(generation));
        }
        let ended = if unsettled {
            Some(match self.end(generation, side.as_deref()).await {
                Ok(()) => Ending::Ended,
                Err(why) => Ending::NotEnded(why),
            })
        } else {
            None
        };
        (error::from_redis(op, e), ended)
    }
}

/// What became of the connection of a write that got no answer ([`Lane::end`]) and, for one
/// that waits for replicas with a way to settle, of the replicas ([`Lane::settle`]).
enum Ending {
    /// Ended on the server: a read now shows everything the write did.
    Ended,
    /// Ended, and then this many replicas acknowledged a write made after it: a read shows
    /// everything the write did, and they have it too.
    Replicated(usize),
    /// Ended, but the replicas were not found to have what it did (why): a read shows it on the
    /// primary, where a failover may lose it.
    Unreplicated(String),
    /// Not ended on the server (why): it may still apply later.
    NotEnded(String),
}

/// `e` with, for an unknown outcome, the failure of a second send (`again`) and whether the
/// connection of each send was ended on the server, and the replicas waited for (`ended`, from
/// [`Lane::failed`] and [`Lane::settled`]).
fn noted(e: Error, ended: Option<Ending>, again: Option<&Error>) -> Error {
    match (e, ended) {
        (
            Error::OutcomeUnknown {
                backend,
                operation,
                mut message,
                source,
            },
            Some(ended),
        ) => {
            if let Some(again) = again {
                message += &format!("; sent again: {again}");
            }
            message += &match ended {
                Ending::Ended => "; its connection was ended on the server, so a read now shows \
                                  everything it did"
                    .to_owned(),
                Ending::Replicated(n) => format!(
                    "; its connection was ended on the server, and {n} replica(s) then \
                     acknowledged a write made after it, so a read now shows everything it did, \
                     and the replicas have it too"
                ),
                Ending::Unreplicated(why) => format!(
                    "; its connection was ended on the server, but {why}: a read shows what it \
                     did on the primary, and a failover may still lose that; write again under \
                     a new token rather than re-read"
                ),
                Ending::NotEnded(why) => format!(
                    "; its connection could not be ended on the server ({why}), so it may still \
                     apply later"
                ),
            };
            Error::OutcomeUnknown {
                backend,
                operation,
                message,
                source,
            }
        }
        (e, _) => e,
    }
}

/// The request got no answer: it timed out, or its connection dropped or failed.
fn unanswered(e: &redis::RedisError) -> bool {
    e.is_timeout() || e.is_io_error() || e.is_connection_dropped()
}

/// The server is no longer the primary (a failover demoted it): open a new connection, which
/// asks the Sentinels again.
fn demoted(e: &redis::RedisError) -> bool {
    matches!(e.code(), Some("READONLY" | "MASTERDOWN"))
}

/// Who `conn` is on its server ([`ServerSide`]), or `None` when the server does not say (a
/// server older than 6.2 has no `CLIENT INFO`; an ACL may refuse it or `INFO`): a write on it
/// whose answer is lost then cannot be ended on the server, and says so. No answer fails the
/// open, as the other checks' do.
async fn server_side(
    conn: &mut MultiplexedConnection,
    shared: &Shared,
) -> Result<Option<ServerSide>> {
    let mut pipe = redis::pipe();
    // Each answered on its own: whether the server is a cluster node (which decides whether
    // renewals of several locks may share a script) must not depend on `CLIENT INFO`.
    pipe.cmd("CLIENT")
        .arg("INFO")
        .cmd("INFO")
        .arg("server")
        // Returns at once; refused to a user without it.
        .cmd("WAIT")
        .arg(0)
        .arg(0)
        .ignore_errors();
    let answers: (RedisResult<String>, RedisResult<String>, RedisResult<i64>) =
        match pipe.query_async(conn).await {
            Ok(v) => v,
            Err(e) if unanswered(&e) => return Err(error::from_redis(ops::CHECK, e)),
            Err(e) => {
                shared.warn_unsettled(&e);
                return Ok(None);
            }
        };
    let refused = matches!(&answers.2, Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm));
    shared.wait_refused.store(refused, Ordering::Relaxed);
    let server = match answers.1 {
        Ok(server) => server,
        Err(e) => {
            shared.warn_unsettled(&e);
            return Ok(None);
        }
    };
    let cluster = server.lines().any(|l| l.trim() == "redis_mode:cluster");
    shared.cluster.store(cluster, Ordering::Relaxed);
    let client = match answers.0 {
        Ok(client) => client,
        Err(e) => {
            shared.warn_unsettled(&e);
            return Ok(None);
        }
    };
    let field = |name: &str| {
        client
            .split_whitespace()
            .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
    };
    let side = (|| {
        Some(ServerSide {
            run_id: server
                .lines()
                .find_map(|l| l.trim().strip_prefix("run_id:"))?
                .to_owned(),
            id: field("id")?.parse().ok()?,
            addr: field("addr")?.to_owned(),
        })
    })();
    Ok(side)
}

/// `SENTINEL get-master-addr-by-name` of one Sentinel: `Some((host, port))`, or `None` when it
/// does not monitor `name`.
async fn primary_of(host: &str, port: u16, name: &str) -> RedisResult<Option<(String, u16)>> {
    let client = redis::Client::open(redis::ConnectionAddr::Tcp(host.to_owned(), port))?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
        .arg("get-master-addr-by-name")
        .arg(name)
        .query_async(&mut conn)
        .await?;
    Ok(addr)
}

/// Checks what the connected server is to the others: with Sentinel it must answer
/// `ROLE master` (a Sentinel's answer can be stale during a failover); and a primary with
/// replicas is refused while `clock_tokens` is off (a failover to a replica that missed the last
/// grants would issue their tokens again), unless the operator opted in. Returns the number of
/// replicas streaming from it (`state=online`).
async fn check_replication(
    conn: &mut MultiplexedConnection,
    config: &RedisConfig,
) -> Result<usize> {
    let info: String = match redis::cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await
    {
        Ok(info) => info,
        // INFO refused (renamed or not permitted, as on some managed services): the topology
        // cannot be checked. Fine while the clock guard is on; refused otherwise.
        Err(e) if e.code().is_some() => {
            if config.clock_tokens() || config.unguarded_replicas() {
                tracing::warn!(backend = BACKEND, error = %e, "INFO replication refused; assuming no replicas (replica_acks=auto waits for none)");
                return Ok(0);
            }
            return Err(Error::misconfigured(
                BACKEND,
                format!(
                    "cannot tell whether the primary has replicas (INFO replication failed: {}) \
                     while clock_tokens=false; use clock_tokens=true (the default), or accept \
                     repeated tokens after a failover with unguarded_replicas=true",
                    e.detail().unwrap_or(e.code().unwrap_or("error"))
                ),
            ));
        }
        Err(e) => return Err(error::from_redis(ops::CHECK, e)),
    };
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.trim().strip_prefix(name)?.strip_prefix(':'))
            .map(str::to_owned)
    };
    let role = field("role").unwrap_or_default();
    let replicas = connected_replicas(&info);
    if role != "master" {
        return Err(match config.sentinel() {
            // A Sentinel's answer can be stale for a moment during a failover: try again.
            Some(s) => Error::unavailable(
                BACKEND,
                format!(
                    "the server Sentinel named as the primary {:?} answers role {role:?} (a \
                     failover is under way)",
                    s.primary
                ),
            ),
            None => Error::misconfigured(
                BACKEND,
                format!(
                    "the server is not a primary (role {role:?}): locks need the primary; use \
                     redis+sentinel:// to follow failovers"
                ),
            ),
        });
    }
    refuse_unguarded_replicas(replicas, config)?;
    Ok(online_replicas(&info))
}

/// Refuses a primary with replicas while `clock_tokens` is off (a failover to a replica that
/// missed the last grants would issue their tokens again), unless the operator opted in.
fn refuse_unguarded_replicas(replicas: usize, config: &RedisConfig) -> Result<()> {
    if replicas > 0 && !config.clock_tokens() && !config.unguarded_replicas() {
        return Err(Error::misconfigured(
            BACKEND,
            format!(
                "the primary has {replicas} connected replica(s) and clock_tokens=false: a \
                 failover to a replica that missed the last grants would issue the same tokens \
                 again. Use clock_tokens=true (the default), or accept that with \
                 unguarded_replicas=true"
            ),
        ));
    }
    Ok(())
}

/// The replicas connected to a primary (streaming or still syncing), from its
/// `INFO replication`.
fn connected_replicas(info: &str) -> usize {
    info.lines()
        .find_map(|l| l.trim().strip_prefix("connected_slaves:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The replicas streaming from a primary, from its `INFO replication`: `auto` waits for those,
/// not for one still in its first full sync.
fn online_replicas(info: &str) -> usize {
    info.lines()
        .filter(|l| {
            l.strip_prefix("slave")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
                && l.contains("state=online")
        })
        .count()
}

/// Refuses a server that would lose the token counter (or a fence's newest token) in a crash or
/// under memory pressure, naming each missing setting.
async fn check_durability(conn: &mut MultiplexedConnection) -> Result<()> {
    async fn get(conn: &MultiplexedConnection, name: &str) -> RedisResult<Option<String>> {
        let mut conn = conn.clone();
        let pairs: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(&mut conn)
            .await?;
        Ok(pairs
            .chunks(2)
            .find(|p| p.len() == 2 && p[0].eq_ignore_ascii_case(name))
            .map(|p| p[1].to_ascii_lowercase()))
    }
    let (aof, fsync, policy) = futures::join!(
        get(conn, "appendonly"),
        get(conn, "appendfsync"),
        get(conn, "maxmemory-policy")
    );
    let values = match (aof, fsync, policy) {
        (Ok(a), Ok(f), Ok(p)) => (a, f, p),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            if e.code().is_some() {
                // The server answered with an error: CONFIG is disabled, renamed or not permitted
                // (typical of managed Redis services).
                return Err(Error::misconfigured(
                    BACKEND,
                    format!(
                        "cannot verify that the server keeps tokens across a crash: CONFIG GET \
                         failed ({}). If the service guarantees appendonly yes, appendfsync \
                         always and maxmemory-policy noeviction, or you accept tokens that may \
                         go backwards after a crash or failover, opt in with \
                         volatile_tokens=true (and set token_floor after every restore or \
                         failover)",
                        e.detail().unwrap_or(e.code().unwrap_or("error"))
                    ),
                ));
            }
            return Err(error::from_redis(ops::CHECK, e));
        }
    };
    let mut problems = Vec::new();
    let mut expect = |name: &str, got: Option<String>, want: &str, why: &str| match got {
        Some(v) if v == want => {}
        Some(v) => problems.push(format!("{name} is {v} (must be {want}: {why})")),
        None => problems.push(format!(
            "{name} is not reported by the server (must be {want})"
        )),
    };
    expect(
        "appendonly",
        values.0,
        "yes",
        "without the AOF the token counter is lost on a crash",
    );
    expect(
        "appendfsync",
        values.1,
        "always",
        "otherwise the last second of tokens can be lost on a crash",
    );
    expect(
        "maxmemory-policy",
        values.2,
        "noeviction",
        "any eviction policy may evict the token counter",
    );
    if problems.is_empty() {
        Ok(())
    } else {
        problems.push(
            "fix the server configuration, or opt in with volatile_tokens=true (tokens may then \
             go backwards after a crash; this process fails closed with TokenRegression when it \
             sees that, and token_floor keeps them increasing)"
                .to_owned(),
        );
        Err(Error::Misconfigured {
            backend: BACKEND,
            problems,
        })
    }
}
