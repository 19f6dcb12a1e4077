//! [`Op`] and [`Delivery`]: one classification of a failed request, turned into an [`Error`] by
//! one function ([`Op::failed`]).
//!
//! Each adapter's `error.rs` only says what its client library's error means for delivery (never
//! sent, refused by the server, or sent without an answer); whether that is `Unavailable` (retry
//! later) or `OutcomeUnknown` (re-read before acting) is decided here, the same way everywhere.
//!
//! [`resend`] is the one loop that sends a request again after a failure that allows it: one
//! that certainly did not apply, or (for a request safe to apply twice whose answer says what an
//! earlier send did) one whose connection was closed after it was written.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::error::{BoxError, Error};

/// One kind of request an adapter sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    /// The operation, as errors and logs name it (`acquire`, `renew`, `release`, `write`, ...).
    pub name: &'static str,
    /// Whether the request could change state on the server.
    pub writes: bool,
    /// Whether sending it twice has the effect of sending it once (reads; an acquire keyed by its
    /// attempt; a renewal; a fence claim, which only raises the newest token). Only such a request
    /// may be sent again after its first delivery is in doubt.
    pub idempotent: bool,
}

/// What became of a request that did not succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// It certainly never reached the server (no connection, refused before sending).
    NotSent,
    /// The server answered that it did not apply it (no leader, overloaded, read-only).
    Refused,
    /// It was sent and no complete answer came (a timeout, a connection lost after sending).
    Unanswered,
}

impl Op {
    /// A request that may change state; `idempotent`: sending it twice is the same as once.
    pub const fn write(name: &'static str, idempotent: bool) -> Op {
        Op {
            name,
            writes: true,
            idempotent,
        }
    }

    /// A request that changes nothing.
    pub const fn read(name: &'static str) -> Op {
        Op {
            name,
            writes: false,
            idempotent: true,
        }
    }

    /// The error for this request failing as `delivery` says: `OutcomeUnknown` when it writes
    /// and was sent without an answer (it may have been applied: re-read before acting),
    /// `Unavailable` otherwise (nothing was applied, or nothing can have changed). `message`
    /// says what happened; an `Unavailable` message is prefixed with the operation's name.
    pub fn failed(
        self,
        backend: &'static str,
        delivery: Delivery,
        message: impl Into<String>,
        source: Option<BoxError>,
    ) -> Error {
        let message = message.into();
        match delivery {
            Delivery::Unanswered if self.writes => Error::OutcomeUnknown {
                backend,
                operation: self.name,
                message,
                source,
            },
            _ => Error::Unavailable {
                backend,
                message: format!("{}: {message}", self.name),
                source,
            },
        }
    }
}

impl Op {
    /// The error for an answer to this request that arrived but cannot be understood: a shape
    /// the adapter never asks for (another version of its scripts, a value another writer put in
    /// its keys, something other than the backend answering on its port). `what` says what was
    /// wrong with it.
    ///
    /// A write was delivered and what it did is unknown: `OutcomeUnknown` (re-read before
    /// acting; an adapter that may hold a key because of it cleans it up as for a lost reply).
    /// A read changed nothing: `Misconfigured`, since the keys or the endpoint are not what the
    /// adapter's settings say they are.
    pub fn unreadable_answer(self, backend: &'static str, what: impl std::fmt::Display) -> Error {
        let message = format!("unexpected answer to {}: {what}", self.name);
        if self.writes {
            Error::OutcomeUnknown {
                backend,
                operation: self.name,
                message: format!("{message} (it may have been applied)"),
                source: None,
            }
        } else {
            Error::Misconfigured {
                backend,
                problems: vec![message],
            }
        }
    }
}

impl Op {
    /// `error`, the last failure of a request of which an earlier send is in doubt
    /// ([`resend`]): for a write, what reads "nothing applied" (`Unavailable`: the resend was
    /// refused, or never reached the server) is `OutcomeUnknown`, since the earlier send may
    /// have applied. Any other error is returned as it is.
    pub fn after_doubt(self, error: Error) -> Error {
        match error {
            Error::Unavailable {
                backend,
                message,
                source,
            } if self.writes => Error::OutcomeUnknown {
                backend,
                operation: self.name,
                message: format!(
                    "{message} (sent again after an earlier send's connection failed, which \
                     may have applied)"
                ),
                source,
            },
            e => e,
        }
    }
}

/// Why a failed send may be sent again ([`resend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendAgain {
    /// It certainly did not apply: it never reached the server, or the server refused it before
    /// applying it. Safe for any request.
    Unapplied,
    /// It may have applied: the connection was closed or reset after it was written (a server
    /// going down, a proxy or load balancer in front of one). Only for a request that is safe to
    /// apply twice and whose answer tells what an earlier send did: a delete keyed on the
    /// lease's own value, a create whose failure branch reads our own key.
    InDoubt,
}

/// Sends the request `send` makes, and sends it again while it fails in a way `again` allows
/// ([`SendAgain`]) and `timeout` (from the first send) leaves time for the next pause of
/// `pause` and another send (at least a tenth of `timeout`: a send given next to no time would
/// only turn a failure known to be harmless into one of unknown outcome). `send` is given the time left for this send and whether an
/// earlier send is in doubt (so that a resend can differ, for example to also write what the
/// first send would have written). Returns the last outcome, and whether an earlier send is in
/// doubt: then an answer of "not there" or "not ours" may be the earlier send's own doing, and
/// the caller judges it (for a release, [`LeaseTracker::released_by_earlier_send`]).
///
/// `send` bounds each send itself (with the time it is given); a send that gets no answer in
/// time is returned as it failed, never sent again. When an earlier send is in doubt, a failure
/// the caller maps to "nothing applied" is not that: see [`Op::after_doubt`].
///
/// [`LeaseTracker::released_by_earlier_send`]: crate::adapter::LeaseTracker::released_by_earlier_send
pub async fn resend<T, E, M, F>(
    timeout: Duration,
    mut pause: Backoff,
    again: impl Fn(&E) -> Option<SendAgain>,
    mut send: M,
) -> (Result<T, E>, bool)
where
    E: std::fmt::Debug,
    M: FnMut(Duration, bool) -> F,
    F: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + timeout;
    let mut in_doubt = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let e = match send(left, in_doubt).await {
            Ok(v) => return (Ok(v), in_doubt),
            Err(e) => e,
        };
        let Some(why) = again(&e) else {
            return (Err(e), in_doubt);
        };
        if Instant::now() + pause.ceiling() + timeout / 10 >= deadline {
            return (Err(e), in_doubt);
        }
        if why == SendAgain::InDoubt {
            in_doubt = true;
        }
        tracing::debug!(?why, error = ?e, "request failed; sending it again");
        pause.sleep().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_answer_to_a_write_is_of_unknown_outcome() {
        let e = Op::write("acquire", true).unreadable_answer("x", "not an array");
        assert!(
            matches!(
                e,
                Error::OutcomeUnknown {
                    operation: "acquire",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("not an array"), "{e}");
        let e = Op::read("inspect").unreadable_answer("x", "not an array");
        assert!(matches!(e, Error::Misconfigured { .. }), "{e}");
        assert!(e.to_string().contains("inspect: not an array"), "{e}");
    }

    #[test]
    fn after_doubt_nothing_applied_is_unknown_for_a_write() {
        let refused =
            || Op::write("release", true).failed("x", Delivery::Refused, "no leader", None);
        let e = Op::write("release", true).after_doubt(refused());
        assert!(
            matches!(
                e,
                Error::OutcomeUnknown {
                    operation: "release",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("no leader"), "{e}");
        let e = Op::read("inspect").after_doubt(refused());
        assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn resend_sends_again_while_allowed_and_remembers_doubt() {
        let ms = Duration::from_millis;
        // Fails unapplied, then in doubt, then succeeds: three sends, the last told of the doubt.
        let mut script = vec![Err(SendAgain::Unapplied), Err(SendAgain::InDoubt), Ok(7)];
        script.reverse();
        let mut told = Vec::new();
        let (r, in_doubt) = resend(
            ms(1000),
            Backoff::new(ms(10), ms(80)),
            |e: &SendAgain| Some(*e),
            |left, doubt| {
                told.push((left <= ms(1000), doubt));
                let next = script.pop().unwrap();
                async move { next }
            },
        )
        .await;
        assert_eq!(r, Ok(7));
        assert!(in_doubt);
        assert_eq!(told, [(true, false), (true, false), (true, true)]);

        // A failure `again` does not allow is returned at once.
        let mut sends = 0;
        let (r, in_doubt) = resend(
            ms(1000),
            Backoff::new(ms(10), ms(80)),
            |_: &&str| None,
            |_, _| {
                sends += 1;
                async { Err::<(), _>("refused") }
            },
        )
        .await;
        assert_eq!((r, in_doubt, sends), (Err("refused"), false, 1));

        // Allowed failures stop once the timeout leaves no room for another pause.
        let started = Instant::now();
        let mut given = Vec::new();
        let (r, _) = resend(
            ms(100),
            Backoff::new(ms(10), ms(20)),
            |_: &&str| Some(SendAgain::Unapplied),
            |left, _| {
                given.push(left);
                async { Err::<(), _>("down") }
            },
        )
        .await;
        assert_eq!(r, Err("down"));
        assert!(started.elapsed() <= ms(100), "{:?}", started.elapsed());
        let sends = given.len();
        assert!(sends >= 4, "{sends} sends within 100 ms of 10-20 ms pauses");
        // Every send is given at least a tenth of the timeout.
        assert!(given.iter().all(|&left| left >= ms(10)), "{given:?}");
    }

    #[test]
    fn only_an_unanswered_write_has_an_unknown_outcome() {
        let write = Op::write("acquire", true);
        let read = Op::read("inspect");
        for (op, delivery, unknown) in [
            (write, Delivery::Unanswered, true),
            (write, Delivery::NotSent, false),
            (write, Delivery::Refused, false),
            (read, Delivery::Unanswered, false),
            (read, Delivery::NotSent, false),
        ] {
            let e = op.failed("x", delivery, "no answer within 1s", None);
            assert_eq!(
                matches!(e, Error::OutcomeUnknown { .. }),
                unknown,
                "{op:?} {delivery:?}: {e}"
            );
            assert_eq!(e.is_retryable(), !unknown, "{e}");
            assert!(e.to_string().contains("no answer within 1s"), "{e}");
            if !unknown {
                assert!(e.to_string().contains(op.name), "{e}");
            }
        }
    }
}
