//! `fenced run` and the signals it is sent or started with, on the in-process `memory://`
//! backend (the signal handling is the same on every backend).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::support::*;

/// A command run with SIGHUP, SIGINT and SIGTERM at their defaults whatever this test process
/// inherited (a test run under `nohup`, or as a shell's background job, which ignores SIGINT,
/// passes those on, and `fenced` now keeps them): coreutils' `env --default-signal`.
fn with_default_signals(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("env");
    c.arg("--default-signal=HUP,INT,TERM").arg(program);
    c
}

/// The `SigIgn` mask (bit N-1 for signal N) of the process whose `/proc/<pid>/status` text this
/// is.
fn ignored_in(status: &str) -> u64 {
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .expect("a SigIgn line");
    u64::from_str_radix(mask.trim(), 16).unwrap()
}

fn ignores(mask: u64, sig: Signal) -> bool {
    mask & (1 << (sig as i32 - 1)) != 0
}

/// `fenced run KEY -- CMD` started by `sh` with `traps` set first (`trap '' HUP` ignores SIGHUP,
/// as `nohup` does), its command writing its own `/proc/self/status` to `out`.
fn run_under(traps: &str, out: &Path) -> std::process::Output {
    let script = format!(
        "{traps}\nexec \"$FENCED_BIN\" --url memory:// run jobs/signals -- \
         sh -c 'cat /proc/$$/status > \"$OUT\"'"
    );
    with_default_signals("sh")
        .args(["-c", &script])
        .env("FENCED_BIN", fenced_bin())
        .env("OUT", out)
        .env_remove("FENCED_URL")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

/// A signal `fenced` was started with ignored (SIGHUP under `nohup`, SIGINT for a shell's
/// background job) is not caught, so the command inherits it ignored: a hangup that `nohup`
/// was meant to keep from the command does not reach it. Without the traps, the command starts
/// with the default dispositions. (Before, `fenced` caught all three, and exec reset them to
/// their defaults in the command.)
#[test]
fn signals_ignored_at_start_stay_ignored_in_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("status");
    let ran = run_under("trap '' HUP INT", &out);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr_of(&ran));
    let mask = ignored_in(&std::fs::read_to_string(&out).unwrap());
    assert!(
        ignores(mask, Signal::SIGHUP) && ignores(mask, Signal::SIGINT),
        "the command's SigIgn {mask:x} lacks SIGHUP or SIGINT"
    );
    assert!(!ignores(mask, Signal::SIGTERM), "SigIgn {mask:x}");

    let ran = run_under("", &out);
    assert_eq!(ran.status.code(), Some(0), "{}", stderr_of(&ran));
    let mask = ignored_in(&std::fs::read_to_string(&out).unwrap());
    assert!(
        !ignores(mask, Signal::SIGHUP) && !ignores(mask, Signal::SIGINT),
        "SigIgn {mask:x}"
    );
}

/// SIGTERM and SIGHUP sent to `fenced run` reach the command, which they end here; `fenced`
/// exits with its status, 128+N, as a shell reports it. SIGINT is not forwarded, and does not
/// end `fenced` either.
#[test]
fn sigterm_and_sighup_are_forwarded_and_sigint_is_not() {
    for (sig, forwarded) in [
        (Signal::SIGTERM, true),
        (Signal::SIGHUP, true),
        (Signal::SIGINT, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let started = dir.path().join("started");
        // `env` execs fenced: the PID signalled below is fenced's.
        let mut fenced = with_default_signals(fenced_bin())
            .args(["--url", "memory://", "run", "jobs/forward", "--"])
            // The command ends on SIGTERM or SIGHUP (their default) and on its own after 30 s.
            .args(["sh", "-c", r#"echo > "$STARTED"; exec sleep 30"#])
            .env("STARTED", &started)
            .env_remove("FENCED_URL")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        eventually(Duration::from_secs(20), "the command to start", || {
            started.exists().then_some(())
        });
        let pid = Pid::from_raw(fenced.id() as i32);
        kill(pid, sig).unwrap();
        if forwarded {
            let status = fenced.wait().unwrap();
            assert_eq!(status.code(), Some(128 + sig as i32), "after {sig}");
        } else {
            // Then SIGTERM: had the SIGINT ended fenced, it would have died of it (signals are
            // taken in order, SIGINT first); instead the SIGTERM reaches the command.
            kill(pid, Signal::SIGTERM).unwrap();
            let status = fenced.wait().unwrap();
            assert_eq!(
                status.code(),
                Some(128 + Signal::SIGTERM as i32),
                "after {sig}, then SIGTERM: {status:?}"
            );
        }
    }
}
