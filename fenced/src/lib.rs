#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use std::sync::Arc;

pub use lease_core::*;

/// A registry with every backend of this workspace registered.
pub fn registry() -> Registry {
    let mut r = Registry::new();
    adapter_redis::register(&mut r);
    adapter_etcd::register(&mut r);
    adapter_zookeeper::register(&mut r);
    adapter_consul::register(&mut r);
    for scheme in ["postgres", "postgresql"] {
        r.register_fence(
            scheme,
            Arc::new(|url: BackendUrl| {
                Box::pin(async move {
                    Ok(
                        Arc::new(fence_postgres::PgFence::connect(url.expose().as_str()).await?)
                            as Arc<dyn Fence>,
                    )
                })
            }),
        );
    }
    r
}

/// Connects to the coordinator named by `url` (see the table above), instrumented.
pub async fn connect(url: &str) -> Result<Arc<dyn Coordinator>> {
    registry().connect(url).await
}

/// Connects to the fence named by `url`, instrumented.
pub async fn connect_fence(url: &str) -> Result<Arc<dyn Fence>> {
    registry().connect_fence(url).await
}
