//! [`Op`] and [`Delivery`]: one classification of a failed request, turned into an [`Error`] by
//! one function ([`Op::failed`]).
//!
//! Each adapter's `error.rs` only says what its client library's error means for delivery (never
//! sent, refused by the server, or sent without an answer); whether that is `Unavailable` (retry
//! later) or `OutcomeUnknown` (re-read before acting) is decided here, the same way everywhere.

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

#[cfg(test)]
mod tests {
    use super::*;

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
