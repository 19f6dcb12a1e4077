//! The etcd subject.

use std::path::PathBuf;

use crate::suite::{Operator, Subject};

/// The etcd operator: a plain etcd client and the subject's key prefix (also used by the
/// cluster subject).
pub(super) struct EtcdOperator {
    pub(super) client: adapter_etcd::etcd_client::Client,
    pub(super) key_prefix: String,
}

impl Operator for EtcdOperator {
    fn delete_key<'a>(
        &'a self,
        key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let prefix = adapter_etcd::keys::lock_prefix(&self.key_prefix, key);
            let options = adapter_etcd::etcd_client::DeleteOptions::new().with_prefix();
            self.client
                .clone()
                .delete(prefix, Some(options))
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    }

    fn delete_parent<'a>(
        &'a self,
        _key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
        // Lock names are percent-encoded into one flat path segment: a lock has no parent
        // node on etcd, and `delete_key` already removes its whole key range.
        Box::pin(async { Ok(false) })
    }

    /// A raw `put` of a different value on the holder's key that keeps the key's lease
    /// (`ignore_lease`), as another tool writing the key would.
    fn overwrite_value<'a>(
        &'a self,
        key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let holder = self.holder(key).await?;
            let options = adapter_etcd::etcd_client::PutOptions::new().with_ignore_lease();
            self.client
                .clone()
                .put(holder.key(), "overwritten by the operator", Some(options))
                .await
                .map_err(|e| format!("put {}: {e}", String::from_utf8_lossy(holder.key())))?;
            Ok(true)
        })
    }

    /// `lease revoke` of the etcd lease the holder's key is attached to (the holder's
    /// session: every key on it goes).
    fn invalidate_holder<'a>(
        &'a self,
        key: &'a lease_core::LockKey,
    ) -> futures::future::BoxFuture<'a, Result<bool, String>> {
        Box::pin(async move {
            let holder = self.holder(key).await?;
            if holder.lease() == 0 {
                return Err(format!(
                    "the holder key {} has no lease",
                    String::from_utf8_lossy(holder.key())
                ));
            }
            self.client
                .clone()
                .lease_revoke(holder.lease())
                .await
                .map_err(|e| format!("lease revoke {:x}: {e}", holder.lease()))?;
            Ok(true)
        })
    }
}

impl EtcdOperator {
    /// The holder's key of `key`'s lock: the first key of its range by create revision.
    async fn holder(
        &self,
        key: &lease_core::LockKey,
    ) -> Result<adapter_etcd::etcd_client::KeyValue, String> {
        use adapter_etcd::etcd_client::{GetOptions, SortOrder, SortTarget};
        let prefix = adapter_etcd::keys::lock_prefix(&self.key_prefix, key);
        let options = GetOptions::new()
            .with_prefix()
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1);
        let mut resp = self
            .client
            .clone()
            .get(prefix.clone(), Some(options))
            .await
            .map_err(|e| format!("get {prefix}: {e}"))?;
        resp.take_kvs()
            .into_iter()
            .next()
            .ok_or_else(|| format!("no holder under {prefix}"))
    }
}

/// The etcd subject: a harness-started `etcd` (or `FENCED_ETCD_URL`), clients and workers that
/// connect by URL through `fenced::connect`, the etcd fence, proxy hooks for clients and
/// fences, an operator that deletes a lock's key range, overwrites the holder key's value and
/// revokes the holder's lease, and the backend's minimum TTL (2 s).
pub(crate) async fn etcd_subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::harness::{
        server_unavailable, Backend, EtcdServer, ExternalEndpoints, ServerControl,
    };
    use crate::suite::{ConnectViaFn, FenceViaFn};

    let key_prefix = format!("conformance-{:08x}", rand::random::<u32>());
    let (base_url, server, upstream): (
        String,
        Box<dyn ServerControl>,
        Option<std::net::SocketAddr>,
    ) = match ExternalEndpoints::from_env().get(Backend::Etcd) {
        Some(external) => (external.url.clone(), Box::new(external), None),
        None => {
            if let Err(reason) = EtcdServer::binary() {
                let skip = server_unavailable("etcd", reason).map_err(|e| e.to_string())?;
                skip.report();
                return Ok(None);
            }
            let server = tokio::task::spawn_blocking(EtcdServer::start)
                .await
                .map_err(|e| format!("starting etcd panicked: {e}"))?
                .map_err(|e| e.to_string())?;
            let addr = server.addr();
            (server.url(), Box::new(server), Some(addr))
        }
    };
    let sep = if base_url.contains('?') { '&' } else { '?' };
    let url = format!("{base_url}{sep}key_prefix={key_prefix}");
    let fence = fenced::connect_fence(&url)
        .await
        .map_err(|e| format!("etcd fence: {e}"))?;
    let operator = adapter_etcd::EtcdCoordinator::connect_url(&url)
        .await
        .map_err(|e| format!("etcd operator client: {e}"))?;
    let connect_url = url.clone();
    let mut subject = Subject::new(
        "etcd",
        Arc::new(move || {
            let url = connect_url.clone();
            Box::pin(async move { fenced::connect(&url).await })
        }),
        fence,
        adapter_etcd::MIN_TTL.max(Duration::from_secs(2)),
    )
    .with_server(server)
    .with_operator(Arc::new(EtcdOperator {
        client: operator.client(),
        key_prefix: key_prefix.clone(),
    }));
    if let Some(upstream) = upstream {
        let prefix = key_prefix.clone();
        let connect_via: ConnectViaFn = Arc::new(move |addr| {
            let url = format!("etcd://{addr}?key_prefix={prefix}");
            Box::pin(async move {
                let c = adapter_etcd::EtcdCoordinator::connect_url(&url).await?;
                Ok(Arc::new(lease_core::Instrumented::new(c)) as Arc<dyn lease_core::Coordinator>)
            })
        });
        subject = subject.with_proxy(upstream, connect_via);
        let prefix = key_prefix.clone();
        let fence_via: FenceViaFn = Arc::new(move |addr| {
            // A short request timeout, so that a lost reply is noticed within about a second.
            let url = format!("etcd://{addr}?key_prefix={prefix}&request_timeout_ms=1000");
            Box::pin(async move {
                let f = adapter_etcd::EtcdFence::connect_url(&url).await?;
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
