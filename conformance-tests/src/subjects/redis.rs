//! The Redis subject: a harness-started `redis-server` (AOF on with `appendfsync always`,
//! `noeviction`, a password the suite checks never shows), or `FENCED_REDIS_URL`; clients and
//! workers that connect by URL through `fenced::connect`; the Redis fence; a proxy hook for
//! clients and one for fences; and an operator that deletes a lock's keys as `redis-cli DEL`
//! would, overwrites the lock value as another tool would (`SET ... KEEPTTL`), or deletes only
//! the lock key behind its holder's back.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use lease_core::{Coordinator, Instrumented, LockKey};

use crate::harness::{
    server_unavailable, Backend, ExternalEndpoints, RedisConfig as ServerConfig, RedisServer,
    ServerControl,
};
use crate::suite::{ConnectViaFn, FenceViaFn, Operator, Subject};

struct RedisOperator {
    client: redis::Client,
    config: adapter_redis::RedisConfig,
}

impl RedisOperator {
    async fn conn(&self) -> Result<redis::aio::MultiplexedConnection, String> {
        self.client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())
    }

    /// The lock key of `key` (the first of [`adapter_redis::storage_keys`]): not the counter.
    fn lock_key(&self, key: &LockKey) -> Result<String, String> {
        adapter_redis::storage_keys(&self.config, key)
            .into_iter()
            .next()
            .ok_or_else(|| "adapter_redis::storage_keys returned no keys".to_owned())
    }
}

impl Operator for RedisOperator {
    fn delete_key<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let mut conn = self.conn().await?;
            let _: i64 = redis::cmd("DEL")
                .arg(adapter_redis::storage_keys(&self.config, key))
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        })
    }

    fn delete_parent<'a>(&'a self, _key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        // Redis keys have no parent.
        Box::pin(async { Ok(false) })
    }

    fn overwrite_value<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        // Another tool writing the lock key: the value changes, the expiry is kept.
        Box::pin(async move {
            let lock_key = self.lock_key(key)?;
            let mut conn = self.conn().await?;
            let _: () = redis::cmd("SET")
                .arg(&lock_key)
                .arg("outside-write")
                .arg("KEEPTTL")
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(true)
        })
    }

    fn invalidate_holder<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<bool, String>> {
        // `DEL` of the lock key only: the counter stays, so later tokens keep increasing.
        Box::pin(async move {
            let lock_key = self.lock_key(key)?;
            let mut conn = self.conn().await?;
            let _: i64 = redis::cmd("DEL")
                .arg(&lock_key)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(true)
        })
    }
}

/// Builds the Redis subject (see the module docs).
pub(crate) async fn redis_subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    let secret = format!("conformance-{:016x}", rand::random::<u64>());
    let prefix = format!("conformance-{:08x}", rand::random::<u32>());
    let (base_url, server, upstream): (
        String,
        Box<dyn ServerControl>,
        Option<std::net::SocketAddr>,
    ) = match ExternalEndpoints::from_env().get(Backend::Redis) {
        Some(external) => (external.url.clone(), Box::new(external), None),
        None => {
            if let Err(reason) = Backend::Redis.local_availability() {
                server_unavailable("redis", reason)
                    .map_err(|e| e.to_string())?
                    .report();
                return Ok(None);
            }
            let pw = secret.clone();
            let server = tokio::task::spawn_blocking(move || {
                RedisServer::start_with(ServerConfig {
                    requirepass: Some(pw),
                    ..ServerConfig::default()
                })
            })
            .await
            .map_err(|e| format!("starting redis panicked: {e}"))?
            .map_err(|e| e.to_string())?;
            let addr = server.addr();
            (server.url_with_auth(), Box::new(server), Some(addr))
        }
    };
    let sep = if base_url.contains('?') { '&' } else { '?' };
    let url = format!("{base_url}{sep}key_prefix={prefix}");
    let config = adapter_redis::RedisConfig::from_url(&url).map_err(|e| e.to_string())?;
    let fence = fenced::connect_fence(&url)
        .await
        .map_err(|e| format!("redis fence: {e}"))?;
    let connect_url = url.clone();
    let mut subject = Subject::new(
        "redis",
        Arc::new(move || {
            let url = connect_url.clone();
            Box::pin(async move { fenced::connect(&url).await })
        }),
        fence,
        Duration::from_millis(400),
    )
    .with_server(server)
    .with_operator(Arc::new(RedisOperator {
        client: redis::Client::open(base_url.as_str()).map_err(|e| e.to_string())?,
        config,
    }));
    if upstream.is_some() {
        subject = subject.with_secret(secret.clone());
    }
    if let Some(upstream) = upstream {
        let (secret_c, prefix_c) = (secret.clone(), prefix.clone());
        let connect_via: ConnectViaFn = Arc::new(move |via| {
            let url = format!("redis://:{secret_c}@{via}?key_prefix={prefix_c}");
            Box::pin(async move {
                let c = adapter_redis::RedisCoordinator::connect_url(&url).await?;
                Ok(Arc::new(Instrumented::new(c)) as Arc<dyn Coordinator>)
            })
        });
        subject = subject.with_proxy(upstream, connect_via);
        // A fence on the same server and key prefix, through `via`, with a short request
        // timeout so that a lost reply is noticed within about a second.
        let fence_via: FenceViaFn = Arc::new(move |via| {
            let url = format!(
                "redis://:{secret}@{via}?key_prefix={prefix}&request_timeout_ms=1000&connect_timeout_ms=1000"
            );
            Box::pin(async move {
                let f = adapter_redis::RedisFence::connect_url(&url).await?;
                Ok(Arc::new(f) as Arc<dyn lease_core::Fence>)
            })
        });
        subject = subject.with_fence_proxy(upstream, fence_via);
    }
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
