//! The CI runner: runs the conformance suite against one or more backends, prints a report per
//! backend (case, result, duration), optionally writes JUnit XML, and exits non-zero on any
//! failure.
//!
//! ```text
//! conformance [--backend memory[,redis,etcd,zookeeper,consul,postgres]] [--filter TEXT] [--seed N] [--junit FILE]
//! ```
//!
//! Backends other than `memory` are started by the harness from Debian's packages, or taken from
//! `FENCED_REDIS_URL`, `FENCED_ETCD_URL`, `FENCED_ZK_URL`, `CONSUL_HTTP_ADDR` and
//! `FENCED_POSTGRES_URL` when set (server-control cases are then skipped by name). `postgres` is
//! the in-memory coordinator with the PostgreSQL fence as the protected resource. With `CI=true`,
//! a backend whose server cannot be started fails the run.
//!
//! `--junit` defaults to `CONFORMANCE_JUNIT` when that is set. The timing variables
//! (`CONFORMANCE_TTL_MS`, `CONFORMANCE_TIME_SCALE`) are those of
//! [`conformance_tests::suite`].

use std::process::ExitCode;
use std::sync::Arc;

use conformance_tests::harness::{server_unavailable, Backend, ExternalEndpoints, PostgresServer};
use conformance_tests::suite::{self, FenceViaFn, RunOptions, Subject};

const USAGE: &str = "usage: conformance [--backend memory[,redis,etcd,zookeeper,consul,postgres]] \
                     [--filter TEXT] [--seed N] [--junit FILE]";

/// The `postgres` subject: the in-memory coordinator with the PostgreSQL fence, against
/// `FENCED_POSTGRES_URL` or a harness-started server (kept alive in the returned slot).
async fn postgres_subject(keep: &mut Option<PostgresServer>) -> Result<Option<Subject>, String> {
    let mut subject = Subject::memory();
    if let Some(external) = ExternalEndpoints::from_env().get(Backend::Postgres) {
        let fence = fenced::connect_fence(&external.url)
            .await
            .map_err(|e| format!("postgres fence: {e}"))?;
        subject.name = "memory+postgres-fence (external)".into();
        subject.fence = fence;
        if let Some(pw) = url::Url::parse(&external.url)
            .ok()
            .and_then(|u| u.password().map(str::to_owned))
            .filter(|pw| !pw.is_empty())
        {
            subject = subject.with_secret(pw);
        }
        return Ok(Some(subject));
    }
    if let Err(reason) = Backend::Postgres.local_availability() {
        server_unavailable("postgres", reason)
            .map_err(|e| e.to_string())?
            .report();
        return Ok(None);
    }
    let pg = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .map_err(|e| format!("starting postgres panicked: {e}"))?
        .map_err(|e| e.to_string())?;
    let (url, upstream) = (pg.connection_url(), pg.addr());
    *keep = Some(pg);
    subject.name = "memory+postgres-fence".into();
    subject.fence = fenced::connect_fence(&url)
        .await
        .map_err(|e| format!("postgres fence: {e}"))?;
    // The same database and fence table through a fault proxy, with a one-second bound so a lost
    // reply is noticed quickly.
    let fence_via: FenceViaFn = Arc::new(|addr| {
        Box::pin(async move {
            fenced::connect_fence(&format!(
                "postgres://postgres@{addr}/postgres?timeout_ms=1000"
            ))
            .await
        })
    });
    Ok(Some(subject.with_fence_proxy(upstream, fence_via)))
}

fn main() -> ExitCode {
    let mut backends = vec!["memory".to_string()];
    let mut options = RunOptions::default();
    let mut junit_path = std::env::var("CONFORMANCE_JUNIT")
        .ok()
        .filter(|p| !p.trim().is_empty());
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let r: Result<(), String> = (|| {
            match flag.as_str() {
                "--backend" => backends = value()?.split(',').map(str::to_owned).collect(),
                "--filter" => options.filter = Some(value()?),
                "--seed" => {
                    options.seed = Some(
                        value()?
                            .parse()
                            .map_err(|_| "--seed needs a number".to_string())?,
                    )
                }
                "--junit" => junit_path = Some(value()?),
                "-h" | "--help" => return Err(USAGE.into()),
                other => return Err(format!("unknown argument {other:?}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        // The worker binary sits beside this one when built (`cargo build -p conformance-tests
        // --bins`); without it the process cases are skipped by name.
        let worker = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("conformance-worker")))
            .filter(|w| w.is_file());
        if worker.is_none() {
            // Under CI=true a case that cannot run is a failure, never a silent skip.
            if conformance_tests::harness::ci_requires_servers() {
                eprintln!(
                    "conformance-worker is not built (cargo build -p conformance-tests --bins): \
                     the process cases cannot run, and CI=true does not skip them"
                );
                return ExitCode::from(2);
            }
            println!("note: conformance-worker is not built; the process cases will be skipped");
        }
        let mut reports = Vec::new();
        let mut setup_failed = false;
        if let Err(e) = suite::Timing::from_env() {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
        let mut postgres_server = None;
        for b in &backends {
            let subject = if b == "postgres" {
                postgres_subject(&mut postgres_server).await
            } else {
                conformance_tests::subjects::subject_for(b, worker.clone()).await
            };
            match subject {
                Ok(Some(subject)) => {
                    let report = suite::run_suite(subject, &options).await;
                    report.print();
                    reports.push(report);
                }
                Ok(None) => println!("{b}: SKIPPED (server not available; see above)"),
                Err(e) => {
                    eprintln!("{b}: could not set up: {e}");
                    setup_failed = true;
                }
            }
        }
        if let Some(path) = junit_path {
            if let Err(e) = std::fs::write(&path, suite::junit(&reports)) {
                eprintln!("could not write {path}: {e}");
                return ExitCode::FAILURE;
            }
        }
        let failed: usize = reports.iter().map(|r| r.failed()).sum();
        if failed > 0 || setup_failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    })
}
