//! The locks measured: ours (through `fenced::connect`, as users build it), the raw client doing
//! the same round trips by hand, and the peer libraries, all behind one small trait so every
//! scenario runs the same code for each.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fenced::{Coordinator, LeaseOptions, LockKey};

/// Any error of a measured client, as text for the report.
pub(crate) type BenchError = Box<dyn std::error::Error + Send + Sync>;
/// The result of one measured operation.
pub(crate) type BenchResult<T> = Result<T, BenchError>;

/// What a lock is in the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// This project.
    Ours,
    /// The backend's raw client doing the same round trips by hand.
    Raw,
    /// The backend's raw client sending exactly our requests (our scripts, our transactions):
    /// what is left between it and ours is our client's cost; between it and the hand-written
    /// lock, the server's cost of those requests.
    SameRequests,
    /// A peer library.
    Peer,
}

/// How a lock waits for a held key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// Woken by the server (watch, pub/sub, blocking query).
    Event,
    /// Polls at the given interval (a hand-written lock's usual answer).
    Poll(Duration),
    /// Does not wait: measured uncontended only.
    No,
}

/// A held lock of any of the measured kinds.
pub(crate) struct Held(Box<dyn Any + Send + Sync>);

/// One lock implementation under measurement.
#[async_trait]
pub(crate) trait BenchLock: Send + Sync {
    /// Its name in the report.
    fn name(&self) -> &str;
    /// Ours, raw or peer.
    fn kind(&self) -> Kind;
    /// How it waits for a held key.
    fn waiting(&self) -> Waiting;
    /// Takes `key`, which is free (uncontended); an error when it is not.
    async fn acquire(&self, key: &str) -> BenchResult<Held>;
    /// Takes `key`, waiting as long as it is held (bounded by the lock's own limits).
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held>;
    /// Releases a lock this value took.
    async fn release(&self, held: Held) -> BenchResult<()>;
    /// Extends a lock this value holds with its own renewal call, once; `None` when the lock has
    /// no such call (a session's keepalive keeps it: etcd's Lock RPC, the ZooKeeper locks).
    async fn renew(&self, _held: &Held) -> Option<BenchResult<()>> {
        None
    }
    /// The same lock on a second, independent client (as a second process would have), for the
    /// hand-off waiter.
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>>;
    /// Ours: the coordinator behind it (for the heap scenario, which keeps leases).
    fn coordinator(&self) -> Option<Arc<dyn Coordinator>> {
        None
    }
}

fn held<T: Send + Sync + 'static>(t: T) -> Held {
    Held(Box::new(t))
}

fn peek<T: 'static>(h: &Held) -> BenchResult<&T> {
    h.0.downcast_ref::<T>()
        .ok_or_else(|| "renewed a lock another implementation took".into())
}

fn unwrap<T: 'static>(h: Held) -> BenchResult<T> {
    h.0.downcast::<T>()
        .map(|b| *b)
        .map_err(|_| "released a lock another implementation took".into())
}

/// A process-unique owner value for the raw locks.
fn owner() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The time a blocking acquire of ours may wait in the benchmark.
const WAIT_LIMIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Ours

/// This project's lock, built from a URL with `fenced::connect` (instrumented, as users get it).
pub(crate) struct Ours {
    url: String,
    coordinator: Arc<dyn Coordinator>,
    ttl: Duration,
}

impl Ours {
    /// Connects to `url`.
    pub(crate) async fn connect(url: &str, ttl: Duration) -> BenchResult<Self> {
        Ok(Self {
            url: url.to_owned(),
            coordinator: fenced::connect(url).await?,
            ttl,
        })
    }
}

#[async_trait]
impl BenchLock for Ours {
    fn name(&self) -> &str {
        "ours"
    }
    fn kind(&self) -> Kind {
        Kind::Ours
    }
    fn waiting(&self) -> Waiting {
        Waiting::Event
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        let key = LockKey::new(key)?;
        Ok(held(
            self.coordinator
                .acquire(&key, &LeaseOptions::new(self.ttl))
                .await?,
        ))
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        let key = LockKey::new(key)?;
        let options = LeaseOptions::new(self.ttl).wait(WAIT_LIMIT);
        Ok(held(self.coordinator.acquire(&key, &options).await?))
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        unwrap::<Box<dyn fenced::Lease>>(h)?.release().await?;
        Ok(())
    }
    async fn renew(&self, h: &Held) -> Option<BenchResult<()>> {
        Some(match peek::<Box<dyn fenced::Lease>>(h) {
            Ok(lease) => lease.renew().await.map(|_| ()).map_err(Into::into),
            Err(e) => Err(e),
        })
    }
    fn coordinator(&self) -> Option<Arc<dyn Coordinator>> {
        Some(self.coordinator.clone())
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        if self.url.starts_with("memory") {
            // One process's memory backend: a second client would be a second, separate store.
            return Ok(Arc::new(Self {
                url: self.url.clone(),
                coordinator: self.coordinator.clone(),
                ttl: self.ttl,
            }));
        }
        Ok(Arc::new(Self::connect(&self.url, self.ttl).await?))
    }
}

// ---------------------------------------------------------------------------------------------
// Redis

/// Takes the key and mints a token in one script (a failed attempt writes nothing); 1 round trip.
const RAW_ACQUIRE: &str = "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then \
    return redis.call('INCR', KEYS[2]) end return false";
/// Deletes the key if it is still ours; 1 round trip.
const RAW_RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
    return redis.call('DEL', KEYS[1]) end return 0";

/// Extends the key's TTL if it is still ours; 1 round trip.
const RAW_RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
    return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0";

/// The raw Redis client over one multiplexed connection, sending either the hand-written lock's
/// scripts (one to take the key and mint a token, one to release, one to renew; waiting polls
/// every millisecond) or exactly ours ([`adapter_redis::script_source`], with the arguments ours
/// sends; it does not wait).
pub(crate) struct RawRedis {
    client: redis::Client,
    conn: redis::aio::MultiplexedConnection,
    acquire: redis::Script,
    release: redis::Script,
    renew: redis::Script,
    ours: bool,
    ttl: Duration,
}

/// A lock the raw Redis client took: its keys' common part, the value's part it compares with
/// (the owner, or our value's head), and the token.
type RawRedisHeld = (String, String, u64);

impl RawRedis {
    /// Connects one multiplexed connection to `url`; `ours`: send our scripts.
    pub(crate) async fn connect(url: &str, ttl: Duration, ours: bool) -> BenchResult<Self> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        let script = |op: &str, hand_written: &str| {
            if !ours {
                return Ok::<_, BenchError>(redis::Script::new(hand_written));
            }
            let source = adapter_redis::script_source(op)
                .ok_or_else(|| format!("adapter-redis has no {op} script"))?;
            Ok(redis::Script::new(source))
        };
        Ok(Self {
            client,
            conn,
            acquire: script("acquire", RAW_ACQUIRE)?,
            release: script("release", RAW_RELEASE)?,
            renew: script("renew", RAW_RENEW)?,
            ours,
            ttl,
        })
    }

    async fn try_take(&self, key: &str) -> BenchResult<Option<RawRedisHeld>> {
        if !self.ours {
            let (k, owner) = (format!("raw:{key}"), owner());
            let token: Option<u64> = self
                .acquire
                .key(&k)
                .key(format!("raw-token:{key}"))
                .arg(&owner)
                .arg(self.ttl.as_millis() as u64)
                .invoke_async(&mut self.conn.clone())
                .await?;
            return Ok(token.map(|t| (k, owner, t)));
        }
        // The lock value as ours writes it: `v1|<nonce>|<token>|<acquired ms>|<owner>|`.
        let base = format!("same:{{{key}}}");
        let head = format!("v1|{:032x}|", rand::random::<u128>());
        let acquired_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let reply: Vec<redis::Value> = self
            .acquire
            .key(format!("{base}:lock"))
            .key(format!("{base}:counter"))
            .arg(&head)
            .arg(format!("|{acquired_ms}|{}|", owner()))
            .arg(self.ttl.as_millis() as u64)
            .arg("")
            .arg("1")
            .invoke_async(&mut self.conn.clone())
            .await?;
        match reply.as_slice() {
            [redis::Value::Int(1), token] => {
                let token = redis::from_redis_value::<String>(token.clone())?.parse()?;
                Ok(Some((base, head, token)))
            }
            _ => Ok(None),
        }
    }
}

#[async_trait]
impl BenchLock for RawRedis {
    fn name(&self) -> &str {
        if self.ours {
            "raw client, our scripts"
        } else {
            "raw Lua 1+1"
        }
    }
    fn kind(&self) -> Kind {
        if self.ours {
            Kind::SameRequests
        } else {
            Kind::Raw
        }
    }
    fn waiting(&self) -> Waiting {
        if self.ours {
            Waiting::No
        } else {
            Waiting::Poll(Duration::from_millis(1))
        }
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        match self.try_take(key).await? {
            Some(t) => Ok(held(t)),
            None => Err(format!("{key} is held").into()),
        }
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        if self.ours {
            return Err(format!("the raw client with our scripts does not wait ({key})").into());
        }
        loop {
            if let Some(t) = self.try_take(key).await? {
                return Ok(held(t));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        let (k, mine, _token) = unwrap::<RawRedisHeld>(h)?;
        let mut call = self.release.prepare_invoke();
        if self.ours {
            call.key(format!("{k}:lock"))
                .key(format!("{k}:revoked"))
                .arg(mine)
                .arg(format!("{k}:released"));
        } else {
            call.key(k).arg(mine);
        }
        let released: i64 = call.invoke_async(&mut self.conn.clone()).await?;
        // The hand-written release answers 0 or 1 (the keys deleted), ours 1 or a reason.
        if self.ours && released != 1 {
            return Err(format!("released a lock no longer held ({released})").into());
        }
        Ok(())
    }
    async fn renew(&self, h: &Held) -> Option<BenchResult<()>> {
        let (k, mine, _token) = match peek::<RawRedisHeld>(h) {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        let mut call = self.renew.prepare_invoke();
        if self.ours {
            call.key(format!("{k}:lock")).key(format!("{k}:revoked"));
        } else {
            call.key(k);
        }
        let renewed: Result<i64, _> = call
            .arg(mine)
            .arg(self.ttl.as_millis() as u64)
            .invoke_async(&mut self.conn.clone())
            .await;
        Some(match renewed {
            Ok(1) => Ok(()),
            Ok(_) => Err(format!("{k} is no longer held").into()),
            Err(e) => Err(e.into()),
        })
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        let conn = self.client.get_multiplexed_async_connection().await?;
        Ok(Arc::new(Self {
            client: self.client.clone(),
            conn,
            acquire: self.acquire.clone(),
            release: self.release.clone(),
            renew: self.renew.clone(),
            ours: self.ours,
            ttl: self.ttl,
        }))
    }
}

/// rslock 0.10 with its defaults (3 tries, random 0–200 ms apart; no token).
pub(crate) struct Rslock {
    url: String,
    manager: rslock::LockManager,
    ttl: Duration,
}

impl Rslock {
    /// A lock manager over the one server at `url`.
    pub(crate) fn new(url: &str, ttl: Duration) -> Self {
        Self {
            url: url.to_owned(),
            manager: rslock::LockManager::new(vec![url.to_owned()]),
            ttl,
        }
    }
}

fn rslock_error(e: rslock::LockError) -> BenchError {
    format!("rslock: {e:?}").into()
}

#[async_trait]
impl BenchLock for Rslock {
    fn name(&self) -> &str {
        "rslock 0.10"
    }
    fn kind(&self) -> Kind {
        Kind::Peer
    }
    fn waiting(&self) -> Waiting {
        Waiting::Poll(Duration::from_millis(100))
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        let lock = self
            .manager
            .lock(format!("rslock:{key}").as_str(), self.ttl)
            .await
            .map_err(rslock_error)?;
        Ok(held(lock))
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        let lock = self
            .manager
            .acquire_no_guard(format!("rslock:{key}").as_str(), self.ttl)
            .await
            .map_err(rslock_error)?;
        Ok(held(lock))
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        self.manager.unlock(&unwrap::<rslock::Lock>(h)?).await;
        Ok(())
    }
    async fn renew(&self, h: &Held) -> Option<BenchResult<()>> {
        Some(match peek::<rslock::Lock>(h) {
            Ok(lock) => self
                .manager
                .extend(lock, self.ttl)
                .await
                .map(|_| ())
                .map_err(rslock_error),
            Err(e) => Err(e),
        })
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        Ok(Arc::new(Self::new(&self.url, self.ttl)))
    }
}

// ---------------------------------------------------------------------------------------------
// etcd

/// One etcd client with one lease kept alive (a session), shared by the raw lock and the Lock RPC.
#[derive(Clone)]
pub(crate) struct EtcdSession {
    endpoint: String,
    client: etcd_client::Client,
    lease: i64,
}

impl EtcdSession {
    /// Connects to `endpoint` (`host:port` or `http://host:port`), grants a lease of `ttl` and
    /// keeps it alive for as long as the process runs.
    pub(crate) async fn connect(endpoint: &str, ttl: Duration) -> BenchResult<Self> {
        let mut client = etcd_client::Client::connect([endpoint], None).await?;
        let lease = client.lease_grant(ttl.as_secs() as i64, None).await?.id();
        let (mut keeper, mut answers) = client.lease_keep_alive(lease).await?;
        let every = ttl / 3;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if keeper.keep_alive().await.is_err() || answers.message().await.is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            endpoint: endpoint.to_owned(),
            client,
            lease,
        })
    }
}

/// The raw etcd client over its own session, sending either the hand-written lock's requests
/// (one txn creating the key if absent, with the session's lease; the token is its create
/// revision; a plain delete; renewed by one keepalive of the session's lease on a stream kept
/// open) or exactly ours (adapter-etcd's transactions, with its key layout and holder record:
/// the acquire creates the holder's key only if the lock's range is empty and the attempt's
/// marker, a key outside the range, is absent, else reads the key; the release deletes the key
/// only if its create revision is the one granted). Does not wait.
pub(crate) struct RawEtcd {
    session: EtcdSession,
    keepalive: tokio::sync::Mutex<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)>,
    /// Sending ours: the attempts numbered so far (for the markers) and the holder record's
    /// owner.
    ours: Option<(AtomicU64, fenced::OwnerId)>,
    ttl: Duration,
}

impl RawEtcd {
    /// Over its own session; `ours`: send our transactions.
    pub(crate) async fn connect(endpoint: &str, ttl: Duration, ours: bool) -> BenchResult<Self> {
        let session = EtcdSession::connect(endpoint, ttl).await?;
        let keepalive = session
            .client
            .clone()
            .lease_keep_alive(session.lease)
            .await?;
        Ok(Self {
            session,
            keepalive: tokio::sync::Mutex::new(keepalive),
            ours: ours.then(|| (AtomicU64::new(0), fenced::OwnerId::for_this_process())),
            ttl,
        })
    }

    /// The acquire's key and transaction.
    fn acquire_txn(&self, key: &str) -> BenchResult<(String, etcd_client::Txn)> {
        use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
        let lease = self.session.lease;
        let attached = || Some(PutOptions::new().with_lease(lease));
        let Some((attempts, owner)) = &self.ours else {
            let k = format!("raw/{key}");
            let txn = Txn::new()
                .when([Compare::create_revision(k.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(k.clone(), self::owner(), attached())]);
            return Ok((k, txn));
        };
        let prefix = adapter_etcd::keys::lock_prefix("same", &LockKey::new(key)?);
        let own = format!("{prefix}{:016x}-0", lease as u64);
        let marker = format!(
            "same/abandoned/{}/{:016x}-{:x}",
            adapter_etcd::keys::encode_name(key),
            lease as u64,
            attempts.fetch_add(1, Ordering::Relaxed)
        );
        let record = fenced::adapter::HolderRecord::new(&LeaseOptions::new(self.ttl), owner);
        let txn = Txn::new()
            .when([
                Compare::version(prefix, CompareOp::Equal, 0).with_prefix(),
                Compare::create_revision(marker, CompareOp::Equal, 0),
            ])
            .and_then([TxnOp::put(own.as_str(), record.to_json(), attached())])
            .or_else([TxnOp::get(own.as_str(), None)]);
        Ok((own, txn))
    }
}

#[async_trait]
impl BenchLock for RawEtcd {
    fn name(&self) -> &str {
        match self.ours {
            Some(_) => "raw client, our transactions",
            None => "raw txn + delete",
        }
    }
    fn kind(&self) -> Kind {
        match self.ours {
            Some(_) => Kind::SameRequests,
            None => Kind::Raw,
        }
    }
    fn waiting(&self) -> Waiting {
        Waiting::No
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        let (k, txn) = self.acquire_txn(key)?;
        let answer = self.session.client.kv_client().txn(txn).await?;
        if !answer.succeeded() {
            return Err(format!("{key} is held").into());
        }
        let token = answer.header().map(|h| h.revision()).unwrap_or_default();
        Ok(held((k, token)))
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        Err(format!("the raw etcd lock does not wait ({key})").into())
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        use etcd_client::{Compare, CompareOp, Txn, TxnOp};
        let (k, token) = unwrap::<(String, i64)>(h)?;
        let mut kv = self.session.client.kv_client();
        if self.ours.is_none() {
            kv.delete(k, None).await?;
            return Ok(());
        }
        let txn = Txn::new()
            .when([Compare::create_revision(
                k.as_str(),
                CompareOp::Equal,
                token,
            )])
            .and_then([TxnOp::delete(k.as_str(), None)]);
        if !kv.txn(txn).await?.succeeded() {
            return Err(format!("{k} was not ours at release").into());
        }
        Ok(())
    }
    async fn renew(&self, _h: &Held) -> Option<BenchResult<()>> {
        // Ours renews with a read of its key, which the raw client does not imitate.
        if self.ours.is_some() {
            return None;
        }
        let mut stream = self.keepalive.lock().await;
        let (keeper, answers) = &mut *stream;
        let renewed = async {
            keeper.keep_alive().await?;
            match answers.message().await? {
                Some(answer) if answer.ttl() > 0 => Ok(()),
                _ => Err("the session's lease is gone".into()),
            }
        };
        Some(renewed.await)
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        Ok(Arc::new(
            Self::connect(&self.session.endpoint, self.ttl, self.ours.is_some()).await?,
        ))
    }
}

/// etcd's own Lock RPC (the server-side recipe of `concurrency.Mutex`), with the session's lease.
pub(crate) struct EtcdLock {
    session: EtcdSession,
    ttl: Duration,
}

impl EtcdLock {
    /// Over its own session.
    pub(crate) async fn connect(endpoint: &str, ttl: Duration) -> BenchResult<Self> {
        Ok(Self {
            session: EtcdSession::connect(endpoint, ttl).await?,
            ttl,
        })
    }
}

#[async_trait]
impl BenchLock for EtcdLock {
    fn name(&self) -> &str {
        "etcd Lock RPC"
    }
    fn kind(&self) -> Kind {
        Kind::Peer
    }
    fn waiting(&self) -> Waiting {
        Waiting::Event
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        self.acquire_waiting(key).await
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        let options = etcd_client::LockOptions::new().with_lease(self.session.lease);
        let answer = self
            .session
            .client
            .lock_client()
            .lock(format!("rpc/{key}"), Some(options))
            .await?;
        Ok(held(answer.key().to_vec()))
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        let key = unwrap::<Vec<u8>>(h)?;
        self.session.client.lock_client().unlock(key).await?;
        Ok(())
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        Ok(Arc::new(
            Self::connect(&self.session.endpoint, self.ttl).await?,
        ))
    }
}

// ---------------------------------------------------------------------------------------------
// ZooKeeper

/// Connects a zookeeper-client session to `addr` (`host:port`).
async fn zk_connect(addr: &str, ttl: Duration) -> BenchResult<zookeeper_client::Client> {
    Ok(zookeeper_client::Client::connector()
        .with_session_timeout(ttl)
        .connect(addr)
        .await?)
}

/// Creates `path` (persistent) unless it exists.
async fn zk_ensure(client: &zookeeper_client::Client, path: &str) -> BenchResult<()> {
    use zookeeper_client::{Acls, CreateMode};
    let options = CreateMode::Persistent.with_acls(Acls::anyone_all());
    match client.create(path, &[], &options).await {
        Ok(_) | Err(zookeeper_client::Error::NodeExists) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The hand-written ZooKeeper lock: create an ephemeral sequential node under the key's
/// directory (its czxid is the token), optionally list the directory to see who is first (the
/// round trip a waiting lock needs), delete the node. Does not wait.
pub(crate) struct RawZk {
    addr: String,
    client: zookeeper_client::Client,
    list: bool,
    ttl: Duration,
}

impl RawZk {
    /// Over its own session; `list` adds the getChildren of a lock that can wait.
    pub(crate) async fn connect(addr: &str, ttl: Duration, list: bool) -> BenchResult<Self> {
        let client = zk_connect(addr, ttl).await?;
        zk_ensure(&client, "/bench-raw").await?;
        Ok(Self {
            addr: addr.to_owned(),
            client,
            list,
            ttl,
        })
    }
}

#[async_trait]
impl BenchLock for RawZk {
    fn name(&self) -> &str {
        if self.list {
            "raw create + getChildren + delete"
        } else {
            "raw create + delete"
        }
    }
    fn kind(&self) -> Kind {
        Kind::Raw
    }
    fn waiting(&self) -> Waiting {
        Waiting::No
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        use zookeeper_client::{Acls, CreateMode};
        let dir = format!("/bench-raw/{}", key.replace('/', "_"));
        let options = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let (stat, seq) = match self
            .client
            .create(&format!("{dir}/n-"), &[], &options)
            .await
        {
            Ok(created) => created,
            Err(zookeeper_client::Error::NoNode) => {
                zk_ensure(&self.client, &dir).await?;
                self.client
                    .create(&format!("{dir}/n-"), &[], &options)
                    .await?
            }
            Err(e) => return Err(e.into()),
        };
        let path = format!("{dir}/n-{seq}");
        if self.list {
            let children = self.client.list_children(&dir).await?;
            if children.len() != 1 {
                self.client.delete(&path, None).await?;
                return Err(format!("{key} is held").into());
            }
        }
        Ok(held((path, stat.czxid)))
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        Err(format!("the raw ZooKeeper lock does not wait ({key})").into())
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        let (path, _czxid) = unwrap::<(String, i64)>(h)?;
        self.client.delete(&path, None).await?;
        Ok(())
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        Ok(Arc::new(
            Self::connect(&self.addr, self.ttl, self.list).await?,
        ))
    }
}

/// zookeeper-client's lock recipe (`Client::lock` with Curator's node names), released by
/// deleting its node in the foreground (the recipe's own drop deletes it in the background).
pub(crate) struct ZkRecipe {
    addr: String,
    client: zookeeper_client::Client,
    ttl: Duration,
}

impl ZkRecipe {
    /// Over its own session.
    pub(crate) async fn connect(addr: &str, ttl: Duration) -> BenchResult<Self> {
        let client = zk_connect(addr, ttl).await?;
        zk_ensure(&client, "/bench-recipe").await?;
        Ok(Self {
            addr: addr.to_owned(),
            client,
            ttl,
        })
    }
}

#[async_trait]
impl BenchLock for ZkRecipe {
    fn name(&self) -> &str {
        "zookeeper-client recipe"
    }
    fn kind(&self) -> Kind {
        Kind::Peer
    }
    fn waiting(&self) -> Waiting {
        Waiting::Event
    }
    async fn acquire(&self, key: &str) -> BenchResult<Held> {
        self.acquire_waiting(key).await
    }
    async fn acquire_waiting(&self, key: &str) -> BenchResult<Held> {
        use zookeeper_client::{Acls, CreateMode, LockOptions, LockPrefix};
        let dir = format!("/bench-recipe/{}", key.replace('/', "_"));
        let options = LockOptions::new(Acls::anyone_all())
            .with_ancestor_options(CreateMode::Persistent.with_acls(Acls::anyone_all()))?;
        let lock = self
            .client
            .lock(LockPrefix::new_curator(&dir, "lock-")?, b"", options)
            .await?;
        let path = lock.lock_path().to_owned();
        // The recipe's guard deletes its node in a background task when dropped; release below
        // deletes it in the foreground instead, so the measured release is the real one.
        std::mem::forget(lock);
        Ok(held(path))
    }
    async fn release(&self, h: Held) -> BenchResult<()> {
        let path = unwrap::<String>(h)?;
        self.client.delete(&path, None).await?;
        Ok(())
    }
    async fn another(&self) -> BenchResult<Arc<dyn BenchLock>> {
        Ok(Arc::new(Self::connect(&self.addr, self.ttl).await?))
    }
}
