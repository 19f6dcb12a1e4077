//! Signals to a single process, addressed by PID.
//!
//! These helpers are the fault injectors for "the server froze" (`pause`), "the server thawed"
//! (`resume`), "the server crashed" (`kill`) and "the server was asked to shut down"
//! (`terminate`). They only ever address **one positive PID**: a PID of 0 or one that does not fit
//! a `pid_t` is refused, because `kill(2)` would read 0 and negative values as *process groups*.
//! Nothing here looks processes up by name.
//!
//! Signals are asynchronous: `Ok(())` means the kernel accepted the signal, not that the target
//! has stopped, continued or exited yet. Callers that need the effect to be complete must observe
//! it (for a child, `wait` for it; see [`crate::harness`]).

use nix::errno::Errno;
use nix::sys::signal::{self, Signal};
use nix::unistd::Pid;

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

/// Freezes process `pid` with `SIGSTOP` (cannot be caught or ignored).
///
/// The process keeps its sockets open: the kernel still completes TCP handshakes into its listen
/// backlog and buffers incoming bytes, but nothing is answered until [`resume`].
pub fn pause(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGSTOP)
}

/// Thaws a process frozen by [`pause`] with `SIGCONT`. Harmless on a running process.
pub fn resume(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGCONT)
}

/// Kills process `pid` with `SIGKILL`: no cleanup, no flush, works on a stopped process too.
///
/// A killed *child* stays a zombie until its parent waits for it.
pub fn kill(pid: u32) -> Result<(), SignalError> {
    send(pid, Signal::SIGKILL)
}

/// Asks process `pid` to shut down with `SIGTERM`.
///
/// A process frozen by [`pause`] only acts on it once resumed; send [`resume`] afterwards if the
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
    use std::time::{Duration, Instant};

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
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        assert!(exists(pid));
        pause(pid).unwrap();
        resume(pid).unwrap();
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
}
