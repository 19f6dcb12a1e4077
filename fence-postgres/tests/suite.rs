//! The conformance suite with the in-memory coordinator and this PostgreSQL fence as the
//! protected resource: every case's fenced writes go through PostgreSQL, over TLS
//! (`sslmode=verify-full` against a server that accepts TCP only over TLS, with a certificate
//! made here).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use conformance_tests::harness::postgres::PostgresConfig;
use conformance_tests::harness::{server_unavailable, Backend, PostgresServer};
use conformance_tests::pki::{write_pem, TestCa};
use conformance_tests::suite::{main_for, FenceViaFn, Subject};

fn main() -> std::process::ExitCode {
    // The server lives in `main`'s frame and is dropped (killed, its directory removed) when the
    // suite has run; a `static` would never be dropped and would leak the server.
    let server: Arc<Mutex<Option<PostgresServer>>> = Arc::new(Mutex::new(None));
    let holder = server.clone();
    let code = main_for(|| async move {
        if let Err(reason) = Backend::Postgres.local_availability() {
            server_unavailable("fence-postgres suite", reason)
                .map_err(|e| e.to_string())?
                .report();
            return Ok(None);
        }
        let pki = TestCa::new("fence-postgres suite CA");
        let config = PostgresConfig {
            // A certificate for `localhost` only: the URLs below name `localhost`.
            tls: Some(pki.server(&["localhost"]).into()),
            tls_only: true,
            ..PostgresConfig::default()
        };
        let pg = tokio::task::spawn_blocking(move || PostgresServer::start_with(config))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let ca = write_pem(pg.root_dir(), "ca.pem", &pki.pem());
        let tls = format!("sslmode=verify-full&sslrootcert={}", ca.display());
        let url = format!("postgres://postgres@localhost:{}/postgres?{tls}", pg.port());
        let upstream = pg.addr();
        *holder.lock().expect("server slot") = Some(pg);
        let fence = fence_postgres::PgFence::connect(&url)
            .await
            .map_err(|e| e.to_string())?;
        let mut subject = Subject::memory();
        subject.name = "memory+postgres-fence".into();
        subject.fence = Arc::new(lease_core::Instrumented::new(fence));
        // The same database and fence table through another address (a fault proxy), with a
        // one-second bound so a lost reply is noticed quickly.
        let fence_via: FenceViaFn = Arc::new(move |addr: SocketAddr| {
            let tls = tls.clone();
            Box::pin(async move {
                // The proxy listens on loopback; the certificate names `localhost`.
                let url = format!(
                    "postgres://postgres@localhost:{}/postgres?timeout_ms=1000&{tls}",
                    addr.port()
                );
                let fence = fence_postgres::PgFence::connect(&url).await?;
                Ok(Arc::new(lease_core::Instrumented::new(fence)) as Arc<dyn lease_core::Fence>)
            })
        });
        Ok(Some(subject.with_fence_proxy(upstream, fence_via)))
    });
    drop(server.lock().expect("server slot").take());
    code
}
