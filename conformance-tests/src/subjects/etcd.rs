//! The etcd subject.

use std::path::PathBuf;

use crate::suite::Subject;

/// The etcd subject: a harness-started `etcd` (or `FENCED_ETCD_URL`), clients and workers that
/// connect by URL through `fenced::connect`, the etcd fence, a proxy hook, an operator that
/// deletes a lock's key range, and the backend's minimum TTL (2 s).
pub(crate) async fn etcd_subject(worker_exe: Option<PathBuf>) -> Result<Option<Subject>, String> {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::harness::{
        server_unavailable, Backend, EtcdServer, ExternalEndpoints, ServerControl,
    };
    use crate::suite::{ConnectViaFn, Operator};

    struct EtcdOperator {
        client: adapter_etcd::etcd_client::Client,
        key_prefix: String,
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
    }

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
    let operator = adapter_etcd::EtcdCoordinator::from_url(&url)
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
                let c = adapter_etcd::EtcdCoordinator::from_url(&url).await?;
                Ok(Arc::new(lease_core::Instrumented::new(c)) as Arc<dyn lease_core::Coordinator>)
            })
        });
        subject = subject.with_proxy(upstream, connect_via);
    }
    if let Some(exe) = worker_exe {
        subject = subject.with_workers(url, exe);
    }
    Ok(Some(subject))
}
