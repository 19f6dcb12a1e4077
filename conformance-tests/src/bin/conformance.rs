//! The CI runner: runs the conformance suite against one or more backends, prints a report per
//! backend (case, result, duration), optionally writes JUnit XML, and exits non-zero on any
//! failure.
//!
//! ```text
//! conformance [--backend memory[,redis,...]] [--filter TEXT] [--seed N] [--junit FILE]
//! ```
//!
//! Backends other than `memory` are started by the harness from Debian's packages, or taken from
//! `FENCED_<BACKEND>_URL` when set (server-control cases are then skipped by name). With
//! `CI=true`, a backend whose server cannot be started fails the run.

use std::process::ExitCode;

use conformance_tests::suite::{self, RunOptions};

fn main() -> ExitCode {
    let mut backends = vec!["memory".to_string()];
    let mut options = RunOptions::default();
    let mut junit_path = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let r: Result<(), String> = (|| {
            match flag.as_str() {
                "--backend" => backends = value()?.split(',').map(str::to_owned).collect(),
                "--filter" => options.filter = Some(value()?),
                "--seed" => options.seed = Some(value()?.parse().map_err(|_| "--seed needs a number".to_string())?),
                "--junit" => junit_path = Some(value()?),
                "-h" | "--help" => return Err("usage: conformance [--backend memory[,redis,...]] [--filter TEXT] [--seed N] [--junit FILE]".into()),
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
            println!("note: conformance-worker is not built; the process cases will be skipped");
        }
        let mut reports = Vec::new();
        let mut setup_failed = false;
        for b in &backends {
            match conformance_tests::subjects::subject_for(b, worker.clone()).await {
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
