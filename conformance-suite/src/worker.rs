//! The worker *process* of the suite's process cases, for any backend: [`main_with`] acquires a
//! lease from a coordinator URL (through a [`Registry`] that maps URL schemes to constructors)
//! and writes through a remote fence, reporting each step on stdout so the test can pause it
//! (SIGSTOP), resume it (SIGCONT) or kill it (SIGKILL) at a known point.
//!
//! An adapter's worker binary is one line over its own registry, and its subject names that
//! binary with [`Subject::with_workers`](crate::suite::Subject::with_workers):
//!
//! ```no_run
//! fn main() -> std::process::ExitCode {
//!     let mut registry = lease_core::Registry::new();
//!     // registry.register_coordinator("myscheme", my_adapter::factory());
//!     # let _ = &mut registry;
//!     conformance_suite::worker::main_with(registry)
//! }
//! ```
//!
//! # Command line and output
//!
//! ```text
//! <worker> --coordinator URL --fence ADDR --key KEY --ttl-ms N
//!          [--wait-ms N] [--writes N] [--interval-ms N] [--clock-zero-ns N]
//! ```
//!
//! `--clock-zero-ns` is the instant the worker's reported instants count from, on the machine's
//! monotonic clock ([`lease_testkit::process::monotonic_now`], which every process of the
//! machine reads alike): the harness passes its feed's
//! [`clock_zero`](crate::history::wire::WorkerFeed::clock_zero), taken before the spawn.
//! Without it the worker counts from its own start.
//!
//! Output lines: `WAITING` (the key was held at the first try; the worker now waits for it),
//! `ACQUIRED <token> <valid-ms> <at-ms>` (the validity the lease had left at `at-ms`, counted
//! from the clock zero, both rounded down; for a lease already run out, `at-ms` is its end
//! and `valid-ms` 0; the history's [`WorkerFeed`](crate::history::wire::WorkerFeed) reads
//! them), `WRITE <i> OK`,
//! `WRITE <i> STALE <current>`, `WRITE <i> ERR <message>`, `RELEASING <at-ms>` (about to
//! release), `RELEASE OK|LOST|ERR <message>`, `ERROR <message>`. Exit status 2 for bad
//! arguments, 1 for an error before or while acquiring (an `ERROR` line says which).

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use lease_core::{Bytes, Error, Fence, LeaseOptions, LockKey, Registry, ResourceId};
use lease_testkit::fence_server::RemoteFence;

fn say(line: String) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[derive(Default)]
struct Args {
    coordinator: String,
    fence: String,
    key: String,
    ttl_ms: u64,
    wait_ms: u64,
    writes: u64,
    interval_ms: u64,
    clock_zero: Option<Duration>,
}

fn parse(args: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut a = Args {
        wait_ms: 30_000,
        writes: 100,
        interval_ms: 20,
        ..Default::default()
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} {v:?} is not a number"))
        };
        match flag.as_str() {
            "--coordinator" => a.coordinator = v.clone(),
            "--fence" => a.fence = v.clone(),
            "--key" => a.key = v.clone(),
            "--ttl-ms" => a.ttl_ms = num()?,
            "--wait-ms" => a.wait_ms = num()?,
            "--writes" => a.writes = num()?,
            "--interval-ms" => a.interval_ms = num()?,
            "--clock-zero-ns" => a.clock_zero = Some(Duration::from_nanos(num()?)),
            _ => return Err(format!("unknown flag {flag:?}")),
        }
    }
    if a.coordinator.is_empty() || a.fence.is_empty() || a.key.is_empty() || a.ttl_ms == 0 {
        return Err("--coordinator, --fence, --key and --ttl-ms are required".into());
    }
    Ok(a)
}

/// Runs the worker with the process's command-line arguments, connecting through `registry`
/// (which must know the scheme of the `--coordinator` URL the subject hands out), and returns
/// the exit code for `main` to return.
pub fn main_with(registry: Registry) -> ExitCode {
    // The instants it reports are counted from here, or from the clock zero it is given.
    let mut started = std::time::Instant::now();
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            say(format!("ERROR {e}"));
            return ExitCode::from(2);
        }
    };
    if let Some(zero) = args.clock_zero {
        match lease_testkit::process::instant_at(zero) {
            Some(at) => started = at,
            None => {
                say(format!(
                    "ERROR --clock-zero-ns {zero:?} is not a past instant here"
                ));
                return ExitCode::from(2);
            }
        }
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            say(format!("ERROR tokio runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&registry, args, started)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(format!("ERROR {e}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(registry: &Registry, a: Args, started: std::time::Instant) -> Result<(), Error> {
    let coord = registry.connect(&a.coordinator).await?;
    let fence = RemoteFence::new(a.fence.parse().map_err(|_| {
        Error::InvalidInput(lease_core::InvalidInput::OutOfRange {
            field: "--fence",
            value: a.fence.clone(),
            expected: "host:port",
        })
    })?);
    let key: LockKey = a.key.parse()?;
    let resource = ResourceId::from(&key);
    let options =
        LeaseOptions::new(Duration::from_millis(a.ttl_ms)).wait(Duration::from_millis(a.wait_ms));
    // One try first: a key already held is reported (`WAITING`) before the wait, so that a case
    // can act on a worker known to be queued rather than on one that may not have connected.
    let lease = match coord.try_acquire(&key, &options).await {
        Err(Error::Held { .. }) => {
            say("WAITING".to_owned());
            coord.acquire(&key, &options).await?
        }
        tried => tried?,
    };
    let token = lease.token();
    fence.claim(&resource, token).await?;
    // The validity's end on the worker's own clock, split as "left at": their sum, each rounded
    // down, is no later than the true end, also for a lease that has already run out.
    let end = lease
        .valid_until()
        .into_std()
        .saturating_duration_since(started);
    let at = started.elapsed().min(end);
    say(format!(
        "ACQUIRED {token} {} {}",
        (end - at).as_millis(),
        at.as_millis()
    ));
    for i in 0..a.writes {
        tokio::time::sleep(Duration::from_millis(a.interval_ms)).await;
        match fence
            .write(
                &resource,
                token,
                Bytes::from(format!("pid {} write {i}", std::process::id())),
            )
            .await
        {
            Ok(_) => say(format!("WRITE {i} OK")),
            Err(Error::Stale { current, .. }) => {
                say(format!("WRITE {i} STALE {current}"));
                break;
            }
            Err(e) => say(format!("WRITE {i} ERR {e}")),
        }
    }
    say(format!("RELEASING {}", started.elapsed().as_millis()));
    match lease.release().await {
        Ok(()) => say("RELEASE OK".into()),
        Err(Error::Lost { .. }) => say("RELEASE LOST".into()),
        Err(e) => say(format!("RELEASE ERR {e}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn parses_the_required_flags_and_defaults() {
        let a = parse(args(
            "--coordinator memory:// --fence 127.0.0.1:1 --key k --ttl-ms 500",
        ))
        .unwrap();
        assert_eq!(
            (a.coordinator.as_str(), a.ttl_ms, a.wait_ms, a.writes),
            ("memory://", 500, 30_000, 100)
        );
        assert_eq!(a.clock_zero, None);
        let a = parse(args(
            "--coordinator memory:// --fence 127.0.0.1:1 --key k --ttl-ms 500 \
             --clock-zero-ns 1500000000",
        ))
        .unwrap();
        assert_eq!(a.clock_zero, Some(std::time::Duration::from_millis(1500)));
    }

    #[test]
    fn refuses_missing_or_malformed_flags() {
        assert!(parse(args("--coordinator memory://")).is_err());
        assert!(parse(args("--ttl-ms x")).is_err());
        assert!(parse(args("--clock-zero-ns -1")).is_err());
        assert!(parse(args("--bogus 1")).is_err());
    }
}
