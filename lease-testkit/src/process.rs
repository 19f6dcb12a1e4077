//! Signals to a single process, addressed by PID (or to it and the processes it forked:
//! [`pause_tree`], [`resume_tree`]), and the machine's monotonic clock as a value it can share
//! with the processes it starts ([`monotonic_now`]).
//!
//! These helpers are the fault injectors for "the server froze" (`pause`), "the server thawed"
//! (`resume`), "the server crashed" (`kill`) and "the server was asked to shut down"
//! (`terminate`). They only ever address **one positive PID**: a PID of 0 or one that does not fit
//! a `pid_t` is refused, because `kill(2)` would read 0 and negative values as *process groups*.
//! Nothing here looks processes up by name.
//!
//! Signals are asynchronous, so [`pause`] and [`resume`] wait for their effect: `pause` returns
//! only once every thread of the process shows the stopped state (`T`) in
//! `/proc/<pid>/task/*/stat`, and `resume` only once none does, each bounded by
//! [`SETTLE_TIMEOUT`] ([`SignalError::NotStopped`] / [`SignalError::StillStopped`] otherwise).
//! [`kill`] and [`terminate`] return once the kernel accepted the signal: callers that need the
//! exit must observe it (for a child, `wait` for it; see [`crate::harness`]).

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

/// How long [`pause`] waits for every thread to stop, and [`resume`] for every thread to run.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a signal could not be delivered.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    /// The PID is 0 or larger than `i32::MAX`, which `kill(2)` would not read as one process.
    #[error("refusing to signal pid {pid}: not a single positive process id")]
    InvalidPid {
        /// The refused PID.
        pid: u32,
    },
    /// No process (or zombie) has this PID (`ESRCH`).
    #[error("cannot send {signal} to pid {pid}: no such process")]
    NoSuchProcess {
        /// The PID addressed.
        pid: u32,
        /// The signal that was to be sent.
        signal: Signal,
    },
    /// The caller may not signal this process (`EPERM`).
    #[error("cannot send {signal} to pid {pid}: permission denied")]
    PermissionDenied {
        /// The PID addressed.
        pid: u32,
        /// The signal that was to be sent.
        signal: Signal,
    },
    /// Any other failure of `kill(2)`.
    #[error("cannot send {signal} to pid {pid}: {errno}")]
    Other {
        /// The PID addressed.
        pid: u32,
        /// The signal that was to be sent.
        signal: Signal,
        /// The error number `kill(2)` returned.
        errno: Errno,
    },
    /// `SIGSTOP` was sent but not every thread showed the stopped state within the bound.
    #[error(
        "pid {pid} was sent SIGSTOP but not every thread stopped within {waited:?}: {threads}"
    )]
    NotStopped {
        /// The PID addressed.
        pid: u32,
        /// How long [`pause`] waited.
        waited: Duration,
        /// The threads and their states at the last look (`tid:state`, or why none was read).
        threads: String,
    },
    /// `SIGCONT` was sent but some thread still showed the stopped state after the bound.
    #[error(
        "pid {pid} was sent SIGCONT but some thread was still stopped after {waited:?}: {threads}"
    )]
    StillStopped {
        /// The PID addressed.
        pid: u32,
        /// How long [`resume`] waited.
        waited: Duration,
        /// The threads and their states at the last look (`tid:state`).
        threads: String,
    },
}

/// This machine's monotonic clock (`CLOCK_MONOTONIC`, the clock [`Instant`] reads on Linux)
/// as a plain value, which every process of the machine reads alike: a harness hands it to a
/// process it starts, so that both count from the same instant. Never compare it across
/// machines (or time namespaces).
pub fn monotonic_now() -> Duration {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always readable");
    Duration::new(ts.tv_sec().unsigned_abs(), ts.tv_nsec() as u32)
}

/// The [`Instant`] at which [`monotonic_now`] read `at` (in this process's terms; at or just
/// after it), or `None` when `at` is later than now or too far back for an `Instant`.
pub fn instant_at(at: Duration) -> Option<Instant> {
    // The monotonic clock first: the `Instant` read after it can only make the answer later
    // than `at`, never earlier (an instant counted from it then reads earlier, not later).
    let mono = monotonic_now();
    let now = Instant::now();
    now.checked_sub(mono.checked_sub(at)?)
}

/// Sends `signal` to the single process `pid`.
///
/// Refuses PID 0 and PIDs above `i32::MAX` (they would address process groups) with
/// [`SignalError::InvalidPid`]. Returns once the kernel accepted the signal.
pub fn send(pid: u32, signal: Signal) -> Result<(), SignalError> {
    let raw = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(SignalError::InvalidPid { pid })?;
    signal::kill(Pid::from_raw(raw), signal).map_err(|errno| match errno {
        Errno::ESRCH => SignalError::NoSuchProcess { pid, signal },
        Errno::EPERM => SignalError::PermissionDenied { pid, signal },
        errno => SignalError::Other { pid, signal, errno },
    })
}

/// The state letter of every thread of process `pid`, from `/proc/<pid>/task/<tid>/stat`
/// (`R` running, `S` sleeping, `D` disk wait, `T` stopped, `t` traced, `Z` zombie, ...), as
/// `(tid, state)` pairs in no particular order.
///
/// A thread that exits while the directory is read is left out. Fails when the process does not
/// exist (or `/proc` is not mounted).
pub fn task_states(pid: u32) -> std::io::Result<Vec<(u32, char)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let entry = entry?;
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        // "tid (comm) S ...": comm may hold spaces and parentheses, so split at the last ')'.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(state) = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].trim_start().chars().next())
        {
            out.push((tid, state));
        }
    }
    Ok(out)
}

fn render(states: &[(u32, char)]) -> String {
    let parts: Vec<String> = states.iter().map(|(t, s)| format!("{t}:{s}")).collect();
    parts.join(" ")
}

/// Polls [`task_states`] until `done` holds or [`SETTLE_TIMEOUT`] passes; returns the last
/// states read (or the read error) on timeout.
fn settle(
    pid: u32,
    done: impl Fn(&std::io::Result<Vec<(u32, char)>>) -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    let mut pause_for = Duration::from_micros(100);
    loop {
        let states = task_states(pid);
        if done(&states) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(match states {
                Ok(s) => render(&s),
                Err(e) => format!("cannot read /proc/{pid}/task: {e}"),
            });
        }
        // A poll interval, not a stand-in for the condition (checked above).
        std::thread::sleep(pause_for);
        pause_for = (pause_for * 2).min(Duration::from_millis(10));
    }
}

/// Freezes process `pid` with `SIGSTOP` (cannot be caught or ignored) and returns once every
/// thread of it shows the stopped state `T` in `/proc/<pid>/task/*/stat`.
///
/// The process keeps its sockets open: the kernel still completes TCP handshakes into its listen
/// backlog and buffers incoming bytes, but nothing is answered until [`resume`]. Threads that
/// are already dead (`Z`, `X`, a group leader that exited before its threads) count as stopped.
/// [`SignalError::NotStopped`] when that state is not reached within [`SETTLE_TIMEOUT`] (for
/// example a process that exited: a zombie has no thread to stop).
pub fn pause(pid: u32) -> Result<(), SignalError> {
    freeze(pid, false)
}

/// `SIGSTOP` to `pid`, then waits until no thread of it runs: every one stopped or dead, and
/// (unless `exited_counts`) at least one stopped. With `exited_counts` a process that is gone,
/// or whose every thread is dead, counts as frozen.
fn freeze(pid: u32, exited_counts: bool) -> Result<(), SignalError> {
    match send(pid, Signal::SIGSTOP) {
        Err(SignalError::NoSuchProcess { .. }) if exited_counts => {}
        sent => sent?,
    }
    settle(pid, |states| match states {
        Ok(s) => {
            (exited_counts || s.iter().any(|&(_, st)| st == 'T' || st == 't'))
                && s.iter()
                    .all(|&(_, st)| matches!(st, 'T' | 't' | 'Z' | 'X' | 'x'))
        }
        Err(_) => exited_counts && !exists(pid),
    })
    .map_err(|threads| SignalError::NotStopped {
        pid,
        waited: SETTLE_TIMEOUT,
        threads,
    })
}

/// Freezes process `pid` as [`pause`] does, then each of its children (a server that forks a
/// process per connection, as PostgreSQL does, is frozen whole): the parent first, so that it
/// forks no new child meanwhile. A child that exits first (gone, or a zombie: its stopped parent
/// does not reap it) counts as frozen.
pub fn pause_tree(pid: u32) -> Result<(), SignalError> {
    pause(pid)?;
    for child in children(pid) {
        freeze(child, true)?;
    }
    Ok(())
}

/// Thaws what [`pause_tree`] froze: the children of `pid`, then `pid`, as [`resume`] does. Every
/// one is thawed even when another fails; the first failure is returned.
pub fn resume_tree(pid: u32) -> Result<(), SignalError> {
    let mut first = None;
    for child in children(pid) {
        match resume(child) {
            // Exited since it was listed (a running server's child).
            Ok(()) | Err(SignalError::NoSuchProcess { .. }) => {}
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    if let Err(e) = resume(pid) {
        first.get_or_insert(e);
    }
    first.map_or(Ok(()), Err)
}

/// Sends `SIGCONT` to each of `pids`, without waiting for it to take effect: processes a
/// [`pause_tree`] froze whose parent is killed or stopped go on (and see their parent gone).
pub fn thaw(pids: &[u32]) {
    for &p in pids {
        let _ = send(p, Signal::SIGCONT);
    }
}

/// The processes whose parent is `pid` now (from `/proc/<p>/stat`); empty when `/proc` cannot
/// be read.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| {
                    // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// Thaws a process frozen by [`pause`] with `SIGCONT` and returns once no thread of it shows
/// the stopped state `T` (or the process is gone). Harmless on a running process.
///
/// [`SignalError::StillStopped`] when some thread is still stopped after [`SETTLE_TIMEOUT`].
pub fn resume(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGCONT)?;
    settle(pid, |states| match states {
        Ok(s) => s.iter().all(|&(_, st)| st != 'T'),
        // The process is gone (exited and reaped after the signal): nothing is stopped.
        Err(_) => !exists(pid),
    })
    .map_err(|threads| SignalError::StillStopped {
        pid,
        waited: SETTLE_TIMEOUT,
        threads,
    })
}

/// Kills process `pid` with `SIGKILL`: no cleanup, no flush, works on a stopped process too.
///
/// A killed *child* stays a zombie until its parent waits for it.
pub fn kill(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGKILL)
}

/// Asks process `pid` to shut down with `SIGTERM`.
///
/// A process frozen by [`pause`] only acts on it once resumed; call [`resume`] afterwards if the
/// process may be stopped.
pub fn terminate(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGTERM)
}

/// Whether a process (or zombie) with this PID exists and may be signalled (signal 0 probe).
///
/// A zombie child counts as alive until it is reaped.
pub fn exists(pid: u32) -> bool {
    let Some(raw) = i32::try_from(pid).ok().filter(|p| *p > 0) else {
        return false;
    };
    matches!(
        signal::kill(Pid::from_raw(raw), None),
        Ok(()) | Err(Errno::EPERM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    #[test]
    fn the_monotonic_clock_is_the_one_instants_read() {
        let before = Instant::now();
        let read = monotonic_now();
        let after = Instant::now();
        let at = instant_at(read).expect("an instant just past");
        // At or after the read (the two reads inside `instant_at` are not simultaneous, and the
        // thread may be preempted between them): slack after.
        assert!(at >= before && at <= after + Duration::from_millis(100));
        assert!(instant_at(monotonic_now() + Duration::from_secs(1)).is_none());
    }

    #[test]
    fn refuses_group_addressing_pids() {
        assert!(matches!(pause(0), Err(SignalError::InvalidPid { pid: 0 })));
        assert!(matches!(
            kill(u32::MAX),
            Err(SignalError::InvalidPid { pid: u32::MAX })
        ));
        assert!(!exists(0));
    }

    #[test]
    fn stop_continue_kill_a_child() {
        let mut reaped = Reaped(
            Command::new("sleep")
                .arg("30")
                .stdin(Stdio::null())
                .spawn()
                .expect("spawn sleep"),
        );
        let child = &mut reaped.0;
        let pid = child.id();
        assert!(exists(pid));
        pause(pid).unwrap();
        assert_eq!(task_states(pid).unwrap(), vec![(pid, 'T')]);
        resume(pid).unwrap();
        assert_ne!(task_states(pid).unwrap()[0].1, 'T');
        kill(pid).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "child survived SIGKILL");
            std::thread::sleep(Duration::from_millis(5));
        };
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc_sigkill()));
        assert!(matches!(kill(pid), Err(SignalError::NoSuchProcess { .. })));
    }

    fn libc_sigkill() -> i32 {
        Signal::SIGKILL as i32
    }

    /// A child killed and reaped when the test ends, even by a failed assertion (a child left
    /// stopped would never exit; one left spinning would hold the cores).
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A child with several busy threads (python: each thread spins), so that a stop that is
    /// still under way shows some threads running.
    fn busy_threads(n: usize) -> Reaped {
        let script = format!(
            "import threading\n\
             def spin():\n    while True: pass\n\
             for _ in range({n}): threading.Thread(target=spin, daemon=True).start()\n\
             import time\n\
             time.sleep(60)\n"
        );
        Reaped(
            Command::new("python3")
                .args(["-c", &script])
                .stdin(Stdio::null())
                .spawn()
                .expect("spawn python3"),
        )
    }

    #[test]
    fn pause_returns_only_once_every_thread_is_stopped() {
        let child = busy_threads(6);
        let pid = child.0.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while task_states(pid).map(|t| t.len()).unwrap_or(0) < 7 {
            assert!(Instant::now() < deadline, "threads never started");
            std::thread::sleep(Duration::from_millis(10));
        }
        for round in 0..50 {
            pause(pid).unwrap();
            let states = task_states(pid).unwrap();
            assert!(
                states.len() >= 7 && states.iter().all(|&(_, s)| s == 'T'),
                "round {round}: pause returned with threads not stopped: {states:?}"
            );
            resume(pid).unwrap();
            let states = task_states(pid).unwrap();
            assert!(
                states.iter().all(|&(_, s)| s != 'T'),
                "round {round}: resume returned with threads still stopped: {states:?}"
            );
        }
        kill(pid).unwrap();
        drop(child);
    }
}
