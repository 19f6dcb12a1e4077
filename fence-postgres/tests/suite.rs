//! The conformance suite with the in-memory coordinator and this PostgreSQL fence as the
//! protected resource: every case's fenced writes go through PostgreSQL.

use std::sync::Arc;

use conformance_tests::harness::{server_unavailable, Backend, PostgresServer};
use conformance_tests::suite::{main_for, Subject};

fn main() -> std::process::ExitCode {
    // Kept alive until the process exits (the suite runs inside `main_for`).
    static SERVER: std::sync::OnceLock<PostgresServer> = std::sync::OnceLock::new();
    main_for(|| async {
        if let Err(reason) = Backend::Postgres.local_availability() {
            server_unavailable("fence-postgres suite", reason)
                .map_err(|e| e.to_string())?
                .report();
            return Ok(None);
        }
        let pg = tokio::task::spawn_blocking(PostgresServer::start)
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let url = pg.connection_url();
        let _ = SERVER.set(pg);
        let fence = fence_postgres::PgFence::connect(&url)
            .await
            .map_err(|e| e.to_string())?;
        let mut subject = Subject::memory();
        subject.name = "memory+postgres-fence".into();
        subject.fence = Arc::new(lease_core::Instrumented::new(fence));
        Ok(Some(subject))
    })
}
