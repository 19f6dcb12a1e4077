//! Shared helpers: start a real redis-server through the conformance harness, or skip by name.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator, RedisFence};
use conformance_tests::harness::{
    start_or_skip, Backend, RedisConfig as ServerConfig, RedisServer,
};
use lease_core::LockKey;

/// Starts a server with `config`, or reports `SKIPPED: <test>: <reason>` and returns `None`
/// (a panic under `CI=true`).
pub(crate) fn server(test: &str, config: ServerConfig) -> Option<RedisServer> {
    start_or_skip(test, Backend::Redis, || RedisServer::start_with(config))
}

/// The durable configuration (AOF, fsync always, noeviction).
pub(crate) fn durable() -> ServerConfig {
    ServerConfig::default()
}

/// A server without AOF (Redis' default persistence minus RDB).
pub(crate) fn volatile() -> ServerConfig {
    ServerConfig {
        appendonly: false,
        appendfsync: conformance_tests::harness::AppendFsync::EverySec,
        ..ServerConfig::default()
    }
}

/// A URL for `server` with extra query options.
pub(crate) fn url(server: &RedisServer, options: &str) -> String {
    let base = server.url_with_auth();
    if options.is_empty() {
        base
    } else {
        format!("{base}/?{options}")
    }
}

pub(crate) async fn coordinator(server: &RedisServer, options: &str) -> RedisCoordinator {
    RedisCoordinator::connect(RedisConfig::from_url(&url(server, options)).unwrap())
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

pub(crate) async fn fence(server: &RedisServer, options: &str) -> RedisFence {
    RedisFence::connect_url(&url(server, options))
        .await
        .unwrap_or_else(|e| panic!("connect fence: {e}"))
}

/// A key unique within this test binary.
pub(crate) fn key(name: &str) -> LockKey {
    static N: AtomicU64 = AtomicU64::new(0);
    LockKey::new(format!("{name}/{}", N.fetch_add(1, Ordering::Relaxed))).unwrap()
}

/// A plain redis-rs connection for inspecting the server directly.
pub(crate) async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url_with_auth())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// Runs a blocking harness call (kill, restart, pause) off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

/// Polls `f` until it returns `Some` or `limit` passes.
pub(crate) async fn eventually<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
