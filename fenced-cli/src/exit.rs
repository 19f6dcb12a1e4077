//! Exit statuses and the one-line error that goes with each.

use std::fmt;

use fenced::Error;

/// Success (inspect: held; fence read: the resource has state).
pub(crate) const OK: u8 = 0;
/// inspect: the key is free; fence read: nothing was ever accepted.
pub(crate) const ABSENT: u8 = 1;
/// force-release --expect-token: the holder has another token, or the key is free; nothing was
/// removed (the same status as `inspect`'s "not what you asked about").
pub(crate) const REFUSED: u8 = 1;
/// A usage or input error: nothing was sent.
pub(crate) const USAGE: u8 = 2;
/// The backend is unavailable (sysexits' `EX_UNAVAILABLE`).
pub(crate) const UNAVAILABLE: u8 = 69;
/// An unknown outcome or an unexpected answer (`EX_SOFTWARE`).
pub(crate) const SOFTWARE: u8 = 70;
/// run: the lock was not acquired within the wait (`EX_TEMPFAIL`: try again later).
pub(crate) const NOT_ACQUIRED: u8 = 75;
/// run: the lease was lost while the command ran.
pub(crate) const LOST: u8 = 76;
/// The command ran, but its output could not be written (`EX_IOERR`: a full disk, an I/O
/// error; not a closed pipe, which keeps the command's own status).
pub(crate) const IOERR: u8 = 74;
/// The backend is misconfigured for fenced leases (`EX_CONFIG`).
pub(crate) const CONFIG: u8 = 78;
/// run: the command could not be executed (as a shell reports it).
pub(crate) const CANNOT_EXECUTE: u8 = 126;
/// run: the command was not found (as a shell reports it).
pub(crate) const NOT_FOUND: u8 = 127;

/// A failure to report: one line on stderr and an exit status.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: u8,
    message: String,
}

impl Failure {
    pub(crate) fn new(status: u8, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: one_line(&message.into()),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// The status for a library error: what the caller of `fenced` does next.
pub(crate) fn status_of(e: &Error) -> u8 {
    match e {
        Error::InvalidInput(_) => USAGE,
        // The facade's own refusal (a scheme whose feature is off) is made before anything is
        // sent. A backend's `Unsupported` may come after the request was sent (an answer it
        // did not expect): not "nothing was sent", so re-read before acting.
        Error::Unsupported { backend, .. } if *backend == fenced::BACKEND => USAGE,
        Error::Unavailable { .. } => UNAVAILABLE,
        Error::Held { .. } | Error::Timeout { .. } => NOT_ACQUIRED,
        Error::Lost { .. } | Error::Stale { .. } => LOST,
        Error::Misconfigured { .. } => CONFIG,
        _ => SOFTWARE,
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::new(status_of(&e), e.to_string())
    }
}

/// Joins the lines of a message into one (errors are one line, so logs and scripts keep them
/// whole).
pub(crate) fn one_line(s: &str) -> String {
    s.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// clap's error as one line: its message without the usage and tip lines that follow it.
pub(crate) fn clap_one_line(rendered: &str) -> String {
    let kept: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.trim_start().starts_with("tip:"))
        .collect();
    one_line(&kept.join("\n"))
}

/// `text` with every URL that may carry a secret cut to its scheme: `'postgres://***'`,
/// `'etcd:***'`. For messages that quote what a user typed (clap's, which quote a value as
/// `'...'`), where a URL may carry a password, or a Consul token in its user part, and no parser
/// has redacted it. A quoted value is judged whole (it may hold spaces); outside quotes, word by
/// word. A value holding `://`, or a `:` before an `@` (`scheme:user:password@host`, which the
/// registry accepts too), is cut.
pub(crate) fn hide_urls(text: &str) -> String {
    let hide = |s: &str| -> String {
        if let Some(at) = s.find("://") {
            return format!("{}://***", &s[..at]);
        }
        match (s.find(':'), s.rfind('@')) {
            (Some(colon), Some(at)) if colon < at => format!("{}:***", &s[..colon]),
            _ => s.to_owned(),
        }
    };
    text.split('\'')
        .enumerate()
        .map(|(i, piece)| {
            if i % 2 == 1 {
                hide(piece)
            } else {
                piece.split(' ').map(hide).collect::<Vec<_>>().join(" ")
            }
        })
        .collect::<Vec<_>>()
        .join("'")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_quoted_input_are_cut_to_their_scheme() {
        assert_eq!(
            hide_urls("error: unexpected argument 'postgres://u:pw@db/app?sslmode=require' found"),
            "error: unexpected argument 'postgres://***' found"
        );
        assert_eq!(
            hide_urls("invalid value 'consul://s3cr3t-token@agent:8500' for '<KEY>'"),
            "invalid value 'consul://***' for '<KEY>'"
        );
        assert_eq!(
            hide_urls("invalid value '10x' for '--ttl <DURATION>'"),
            "invalid value '10x' for '--ttl <DURATION>'"
        );
        assert_eq!(
            hide_urls("unexpected argument 'ETCD:user:s3cret@127.0.0.1:2379' found"),
            "unexpected argument 'ETCD:***' found"
        );
        assert_eq!(
            hide_urls("unexpected argument 'consul://a b@h', and 'x' found"),
            "unexpected argument 'consul://***', and 'x' found"
        );
        assert_eq!(
            hide_urls("error: the argument 'redis://h:1' (valid for --url) at 12:30"),
            "error: the argument 'redis://***' (valid for --url) at 12:30"
        );
    }

    #[test]
    fn clap_errors_become_one_line() {
        let rendered = "error: the following required arguments were not provided:\n  \
                        --reason <TEXT>\n\nUsage: fenced force-release --reason <TEXT> <KEY>\n\n\
                        For more information, try '--help'.\n";
        assert_eq!(
            clap_one_line(rendered),
            "error: the following required arguments were not provided: --reason <TEXT>"
        );
        let rendered = "error: invalid value '10x' for '--ttl <DURATION>': bad\n\n  \
                        tip: something\n\nFor more information, try '--help'.\n";
        assert_eq!(
            clap_one_line(rendered),
            "error: invalid value '10x' for '--ttl <DURATION>': bad"
        );
    }

    #[test]
    fn statuses_name_the_next_step() {
        let e = Error::unavailable("redis", "down");
        assert_eq!(status_of(&e), UNAVAILABLE);
        let e = Error::InvalidInput(fenced::InvalidInput::ZeroTtl);
        assert_eq!(status_of(&e), USAGE);
        let e = Error::Unsupported {
            backend: fenced::BACKEND,
            what: "etcd:// URLs: this build ...".into(),
        };
        assert_eq!(status_of(&e), USAGE);
        let e = Error::Unsupported {
            backend: "consul",
            what: "force_release: HTTP 405: method not allowed".into(),
        };
        assert_eq!(status_of(&e), SOFTWARE);
    }
}
