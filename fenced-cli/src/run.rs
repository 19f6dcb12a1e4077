//! `fenced run KEY -- CMD ARGS...`: a command under a kept lease, stopped when the lease goes.

use std::io::{IsTerminal, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use fenced::{
    bounded_with, keep, Capabilities, Coordinator, Error, KeeperOptions, Kept, LeaseOptions,
    LeaseStatus, LockKey, SectionOptions,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::process::Child;
use tokio::signal::unix::{signal, Signal as UnixSignal, SignalKind};

use crate::cli::RunArgs;
use crate::commands::{connect, lock_key};
use crate::exit::{self, Failure};

pub(crate) async fn run(url: Option<String>, args: RunArgs) -> Result<u8, Failure> {
    let key = lock_key(&args.key)?;
    let mut options = LeaseOptions::new(args.ttl).wait(args.wait);
    if let Some(operation) = &args.operation {
        options = options.operation(operation.clone());
    }
    // Checked before connecting, against every backend's limits (only a backend's own minimum
    // TTL waits for `acquire`): a bad value is refused with nothing sent.
    let any_backend = Capabilities::new("any backend").min_ttl(Duration::from_nanos(1));
    options.validate(&any_backend)?;
    let Some((program, rest)) = args.command.split_first() else {
        return Err(Failure::usage("run needs a command after `--`"));
    };
    if let Some(addr) = args.metrics_addr {
        serve_metrics(addr)?;
    }
    let coord = connect(url).await?;
    // Installed before the wait, so that a signal then gives the wait up cleanly, and before the
    // child starts, so that a SIGTERM meant for it is never lost. The child starts with the
    // default dispositions (exec resets caught signals), except for those fenced was started
    // with ignored (`nohup` ignores SIGHUP, a shell SIGINT for a background job): those are not
    // caught, so the child inherits them ignored.
    let Ok(mut signals) = Signals::install() else {
        return Err(Failure::new(
            exit::SOFTWARE,
            "cannot install signal handlers",
        ));
    };
    let outcome = run_on(&*coord, &key, &options, &args, program, rest, &mut signals).await;
    // What the run gave up in the background (its place in the queue after a signal, a lock
    // taken just then, a release to send again) is cleaned up before fenced exits: the runtime's
    // shutdown would drop it, and it would stay until its TTL or session ends.
    settle(&*coord, &key, &mut signals).await;
    outcome
}

/// How long fenced waits, before it exits, for the clean-ups its coordinator began.
const SETTLE_BOUND: Duration = Duration::from_secs(5);

/// Waits for `coord`'s clean-ups, for at most [`SETTLE_BOUND`] or until a signal.
async fn settle(coord: &dyn Coordinator, key: &LockKey, signals: &mut Signals) {
    let unfinished = tokio::select! {
        // First: nothing pending is no warning, even with a signal waiting.
        biased;
        () = coord.settle() => return,
        _ = tokio::time::sleep(SETTLE_BOUND) => {
            format!("within {}", humantime::format_duration(SETTLE_BOUND))
        }
        sig = signals.recv() => format!("before {sig}"),
    };
    let _ = writeln!(
        std::io::stderr().lock(),
        "fenced: warning: the clean-up of what was left on {key} did not finish {unfinished}; \
         it ends with its TTL or session"
    );
}

/// `run` once connected: the wait, the command under the kept lease, the release.
async fn run_on(
    coord: &dyn Coordinator,
    key: &LockKey,
    options: &LeaseOptions,
    args: &RunArgs,
    program: &std::ffi::OsString,
    rest: &[std::ffi::OsString],
    signals: &mut Signals,
) -> Result<u8, Failure> {
    let key = key.clone();
    let spinner = Spinner::start(&key, args.wait);
    let acquired = tokio::select! {
        acquired = coord.acquire(&key, options) => Ok(acquired),
        sig = signals.recv() => Err(sig),
    };
    spinner.stop().await;
    let acquired = match acquired {
        Ok(acquired) => acquired,
        // Given up (the acquire dropped): nothing holds the key for us; what the wait left on
        // the server is cleaned up before fenced exits.
        Err(sig) => {
            return Err(Failure::new(
                signal_status(sig),
                format!("{sig} while waiting for {key}: gave up; the command was not started"),
            ))
        }
    };
    let lease = match acquired {
        Ok(lease) => lease,
        Err(e @ (Error::Timeout { .. } | Error::Held { .. })) => {
            let holder = match coord.inspect(&key).await {
                Ok(Some(h)) => format!(" (held by {} with token {})", h.owner, h.token),
                _ => String::new(),
            };
            return Err(Failure::new(exit::NOT_ACQUIRED, format!("{e}{holder}")));
        }
        Err(e) => return Err(e.into()),
    };
    let kept = keep(lease, KeeperOptions::new())?;
    // The section's margin, as bounded_with would pick it: a tenth of the granted TTL.
    let margin = (kept.lease().ttl() / 10).max(Duration::from_millis(1));
    let left = kept.lease().remaining();
    let not_started = |why: String| format!("lease on {key} (token {}) {why}", kept.token());
    match kept.lease().status() {
        LeaseStatus::Held if left > margin => {}
        LeaseStatus::Lost(reason) => {
            let message = not_started(format!(
                "was lost ({reason}) before the command could start; it was not started"
            ));
            let _ = kept.release().await;
            return Err(Failure::new(exit::LOST, message));
        }
        LeaseStatus::InDoubt if left > margin => {
            let message = not_started(
                "was in doubt when granted (the backend could not confirm it yet): the command \
                 was not started; try again"
                    .to_owned(),
            );
            release(kept, &key).await;
            return Err(Failure::new(exit::UNAVAILABLE, message));
        }
        LeaseStatus::Held | LeaseStatus::InDoubt => {
            // The section would end at once: the command would be started only to be stopped.
            let message = not_started(format!(
                "had {} of validity when granted, not more than run's margin of {} (a tenth of \
                 the TTL): the command was not started; the backend caps validity below the TTL \
                 (on ZooKeeper, give tick_ms, or a session_timeout_ms well above the margin)",
                humantime::format_duration(round_ms(left)),
                humantime::format_duration(round_ms(margin)),
            ));
            let _ = kept.release().await;
            return Err(Failure::new(exit::LOST, message));
        }
    }

    let mut command = tokio::process::Command::new(program);
    command
        .args(rest)
        .env("FENCED_TOKEN", kept.token().to_string())
        .env("FENCED_KEY", key.as_str());
    // The child runs as a bounded section of the kept lease: it is started only once the
    // section's check passed, and the section ends as soon as the lease is lost or its validity
    // (less a tenth of the TTL) runs out unrenewed.
    let mut slot: Option<Child> = None;
    let (started, command) = (&mut slot, &mut command);
    let outcome = bounded_with(
        kept.lease(),
        SectionOptions::new().margin(margin),
        |_guard| async move {
            // A signal that came after the grant, while the command was being prepared: the
            // command is not started (a SIGINT from a terminal would otherwise be taken for one
            // the command got too, and be lost).
            let early = tokio::select! {
                biased;
                sig = signals.recv() => Some(sig),
                () = std::future::ready(()) => None,
            };
            if let Some(sig) = early {
                return Ok(Ended::Interrupted(sig));
            }
            let child = match command.spawn() {
                Ok(child) => started.insert(child),
                Err(e) => return Ok(Ended::NotStarted(e)),
            };
            loop {
                tokio::select! {
                    status = child.wait() => return Ok(match status {
                        Ok(status) => Ended::Exited(status),
                        Err(e) => Ended::WaitFailed(e),
                    }),
                    sig = signals.recv() => match sig {
                        // From a terminal the child got the same SIGINT: keep waiting for it.
                        Signal::SIGINT => {}
                        sig => forward(child, sig),
                    },
                }
            }
        },
    )
    .await;

    match (outcome, slot) {
        (Ok(Ended::Exited(status)), _) => match release(kept, &key).await {
            None => Ok(exit_status(status)),
            // Lost before the command finished, noticed only by the release (a force-release or
            // an expiry the lease had not heard of yet): the command may have ended without
            // the lock, and its caller must know it as for a loss seen while it ran.
            Some(lost) => Err(Failure::new(
                exit::LOST,
                format!(
                    "{lost}: the lease was lost before the command finished (its release found \
                     it so); the command {}",
                    describe(status)
                ),
            )),
        },
        (Ok(Ended::Interrupted(sig)), _) => {
            release(kept, &key).await;
            Err(Failure::new(
                signal_status(sig),
                format!("{sig} after {key} was granted: the command was not started"),
            ))
        }
        (Ok(Ended::NotStarted(e)), _) => {
            release(kept, &key).await;
            let status = if e.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_EXECUTE
            };
            Err(Failure::new(
                status,
                format!("cannot run {:?}: {e}", program.to_string_lossy()),
            ))
        }
        (Ok(Ended::WaitFailed(e)), child) => {
            let how = match child {
                Some(mut child) => stop(&mut child, args.grace).await,
                None => "not started".to_owned(),
            };
            release(kept, &key).await;
            Err(Failure::new(
                exit::SOFTWARE,
                format!("waiting for the command failed: {e}; the command was {how}"),
            ))
        }
        (Err(e), Some(mut child)) => {
            let how = stop(&mut child, args.grace).await;
            // Compare-and-delete: removes nothing that is not ours any more.
            let _ = kept.release().await;
            Err(Failure::new(
                exit::status_of(&e),
                format!("{e}; the command was {how}"),
            ))
        }
        // The section did not start (the lease lost, or in doubt, at its check): neither did
        // the command.
        (Err(e), None) => {
            let _ = kept.release().await;
            Err(Failure::new(
                exit::status_of(&e),
                format!("{e}; the command was not started"),
            ))
        }
    }
}

/// How the command's section ended, when the lease lasted.
enum Ended {
    /// The command exited (or was killed) with this status.
    Exited(ExitStatus),
    /// It could not be started.
    NotStarted(std::io::Error),
    /// Waiting for it failed; it may still run.
    WaitFailed(std::io::Error),
    /// A signal came after the grant, before the command started: it was not started.
    Interrupted(Signal),
}

/// SIGTERM, SIGHUP and SIGINT as `run` receives them from before its wait until it exits: each
/// caught unless fenced was started with it ignored (`nohup` ignores SIGHUP, a shell ignores
/// SIGINT for a background job). Exec resets a caught signal to its default in the command, so catching an
/// ignored one would let it kill a command meant to be immune.
struct Signals {
    term: Option<UnixSignal>,
    hup: Option<UnixSignal>,
    int: Option<UnixSignal>,
}

impl Signals {
    fn install() -> std::io::Result<Signals> {
        let ignored = ignored_signals();
        let catch = |sig: Signal, kind: SignalKind| -> std::io::Result<Option<UnixSignal>> {
            if ignored & (1 << (sig as i32 - 1)) != 0 {
                Ok(None)
            } else {
                signal(kind).map(Some)
            }
        };
        Ok(Signals {
            term: catch(Signal::SIGTERM, SignalKind::terminate())?,
            hup: catch(Signal::SIGHUP, SignalKind::hangup())?,
            int: catch(Signal::SIGINT, SignalKind::interrupt())?,
        })
    }

    /// The next signal received (never, if none is caught).
    async fn recv(&mut self) -> Signal {
        /// Resolves when `stream` receives its signal; never for one not caught.
        async fn next(stream: &mut Option<UnixSignal>) {
            if let Some(stream) = stream {
                if stream.recv().await.is_some() {
                    return;
                }
            }
            std::future::pending().await
        }
        tokio::select! {
            () = next(&mut self.term) => Signal::SIGTERM,
            () = next(&mut self.hup) => Signal::SIGHUP,
            () = next(&mut self.int) => Signal::SIGINT,
        }
    }
}

/// The signals this process ignores: `SigIgn` of `/proc/self/status` (bit N-1 for signal N);
/// none if it cannot be read.
fn ignored_signals() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("SigIgn:"))
                .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Buckets (seconds) of the `_seconds` histograms, as docs/metrics.md suggests.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Installs the Prometheus exporter as the metrics recorder, listening on `addr` (bound here,
/// so a bad address fails before anything is sent; served by this runtime until fenced exits).
fn serve_metrics(addr: std::net::SocketAddr) -> Result<(), Failure> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let bad = |e: &dyn std::fmt::Display| Failure::usage(format!("--metrics-addr {addr}: {e}"));
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .map_err(|e| bad(&e))?
        .install()
        .map_err(|e| bad(&e))?;
    fenced::metrics::describe();
    Ok(())
}

/// `d` to whole milliseconds, for messages.
fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn forward(child: &Child, sig: Signal) {
    if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

/// SIGTERM and SIGCONT, then SIGKILL once `grace` has passed; says how the command ended.
///
/// SIGCONT follows SIGTERM (as systemd does) so that a command that is stopped (SIGSTOP, a
/// terminal's ^Z, a debugger) acts on the SIGTERM within the grace period like a running one,
/// instead of sitting out the grace stopped and being killed. Whatever it writes on its way out
/// carries the lost lease's token, which a fence rejects once a newer holder has written or
/// claimed. On a running command SIGCONT does nothing.
async fn stop(child: &mut Child, grace: Duration) -> String {
    if let Ok(Some(_)) = child.try_wait() {
        return "already finished".to_owned();
    }
    forward(child, Signal::SIGTERM);
    forward(child, Signal::SIGCONT);
    match tokio::time::timeout(grace, child.wait()).await {
        Ok(_) => "stopped with SIGTERM".to_owned(),
        Err(_) => {
            let _ = child.kill().await;
            format!(
                "killed with SIGKILL ({} after SIGTERM)",
                humantime::format_duration(grace)
            )
        }
    }
}

/// Releases after the command finished under the lease; returns the `Lost` error when the
/// release found the lease already lost. Any other failure is worth a warning (the lock then
/// stays until its TTL), but the command's status stands.
async fn release(kept: Kept, key: &LockKey) -> Option<Error> {
    match kept.release().await {
        Ok(()) => None,
        Err(lost @ Error::Lost { .. }) => Some(lost),
        Err(e) => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "fenced: warning: releasing {key} failed ({}); the lock expires at its TTL",
                crate::exit::one_line(&e.to_string())
            );
            None
        }
    }
}

/// How the command ended, for messages: "exited with status N" or "was killed by signal N".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        (None, None) => "ended".to_owned(),
    }
}

/// The status for a run given up on signal `sig` (128+N, as a shell reports a signal).
fn signal_status(sig: Signal) -> u8 {
    u8::try_from(128 + sig as i32).unwrap_or(exit::SOFTWARE)
}

/// The command's status as a shell reports it: its exit code, or 128+N for signal N.
fn exit_status(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(exit::SOFTWARE),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(255),
        (None, None) => exit::SOFTWARE,
    }
}

/// A one-line spinner on stderr while `run` waits for the key, only when stderr is a terminal
/// (and only after a quarter second, so an immediate acquisition prints nothing).
struct Spinner {
    task: Option<(
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    )>,
}

impl Spinner {
    fn start(key: &LockKey, wait: Duration) -> Spinner {
        if wait.is_zero() || !std::io::stderr().is_terminal() {
            return Spinner { task: None };
        }
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        let key = key.to_string();
        let task = tokio::spawn(async move {
            const FRAMES: [char; 4] = ['|', '/', '-', '\\'];
            let start = tokio::time::Instant::now();
            let mut tick = tokio::time::interval_at(
                start + Duration::from_millis(250),
                Duration::from_millis(100),
            );
            let mut printed = false;
            for frame in FRAMES.iter().cycle() {
                tokio::select! {
                    _ = &mut rx => break,
                    _ = tick.tick() => {
                        printed = true;
                        let _ = write!(
                            std::io::stderr().lock(),
                            "\r{frame} waiting for {key} ({}s)",
                            start.elapsed().as_secs()
                        );
                    }
                }
            }
            if printed {
                let _ = write!(std::io::stderr().lock(), "\r\x1b[2K");
            }
        });
        Spinner {
            task: Some((tx, task)),
        }
    }

    async fn stop(self) {
        if let Some((tx, task)) = self.task {
            let _ = tx.send(());
            let _ = task.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_follow_the_shell() {
        assert_eq!(exit_status(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_status(ExitStatus::from_raw(0)), 0);
        // Killed by SIGTERM (15): 143.
        assert_eq!(exit_status(ExitStatus::from_raw(15)), 143);
    }
}
