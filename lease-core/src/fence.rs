//! The [`Fence`] trait: the protected resource's side of the protocol.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::Result;
use crate::key::ResourceId;
use crate::token::Token;

/// What a fence returns when it accepts a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Accepted {
    /// The newest token the resource had accepted before this call (`None` for a fresh resource).
    pub previous: Option<Token>,
}

impl Accepted {
    /// An acceptance after `previous`.
    pub fn new(previous: Option<Token>) -> Self {
        Accepted { previous }
    }
}

/// The state of a fenced resource.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FencedValue {
    /// The newest token accepted (by a write or a claim).
    pub newest: Token,
    /// The last value written, and the token that wrote it (`None` if only claims happened).
    pub value: Option<(Token, Bytes)>,
}

impl FencedValue {
    /// A resource state.
    pub fn new(newest: Token, value: Option<(Token, Bytes)>) -> Self {
        FencedValue { newest, value }
    }
}

/// The resource side of fencing: accept a token only if it is not older than the newest accepted.
///
/// # Contract
///
/// - `write(resource, t, v)` commits `v` **and** records `t` as the newest accepted token in one
///   atomic step, if and only if `t >= newest` (an equal token is accepted: one holder writes many
///   times). Otherwise nothing changes and the call returns
///   `Err(Stale { presented: t, current: newest })`.
/// - `claim(resource, t)` advances the newest accepted token to `t` without writing (same rule), so
///   that a new owner cuts off the old one before reading.
/// - The newest accepted token is as durable as the resource's data (the in-memory fence is not).
/// - A token is scoped to one resource; unrelated resources do not affect each other.
///
/// # Cancel safety
///
/// `write` and `claim` are atomic on the resource's store, but a dropped future may have been
/// applied or not: see each method. `read` is cancel-safe.
#[async_trait]
pub trait Fence: Send + Sync + fmt::Debug {
    /// A short, stable backend name.
    fn backend(&self) -> &'static str;

    /// Writes `value` under `token` if `token >= newest accepted`, atomically.
    ///
    /// # Behaviour
    /// - `Ok(Accepted)`: written; the newest accepted token is now `token`.
    /// - `Err(Stale)`: a newer holder has written or claimed; stop, nothing was written.
    /// - `Err(Unavailable)`: nothing was written; retry. `Err(OutcomeUnknown)`: re-read first.
    ///
    /// # Cancel safety
    ///
    /// A dropped future may have committed the value with its token, or changed nothing; never
    /// half of it. It may also commit *later*: a request already on its way can still reach the
    /// store and be applied after the caller gave up. The fences that stop an unanswered write
    /// (ending its connection or session, or retiring it) do so for a write whose outcome they
    /// report; for a dropped future only where their docs say so. So, unless the fence's docs
    /// say a dropped write is stopped, a [`read`](Fence::read) showing your value and token
    /// proves it was written, but one that does not show it proves nothing yet: writing again
    /// under the same token could be replaced by the late copy. Write again under a newer token
    /// (a new acquisition), which the late copy can never overwrite.
    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted>;

    /// Advances the newest accepted token to `token` without writing, if `token >= newest`.
    /// Errors as for [`write`](Fence::write).
    ///
    /// # Cancel safety
    ///
    /// A dropped future may have advanced the newest accepted token to `token`, or not; claiming
    /// again with the same token is harmless (idempotent).
    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted>;

    /// The resource's current state, or `None` if nothing was ever accepted.
    ///
    /// # Cancel safety
    ///
    /// Cancel-safe: read-only, a dropped future changed nothing; call again.
    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>>;
}

/// Checks a fence value's length against `max`, the most the fence's store takes in one write:
/// a longer value is [`InvalidInput::TooLong`](crate::InvalidInput::TooLong), before anything is
/// sent (a store refusing it halfway, or closing the connection, would leave the outcome of
/// this and other requests in doubt).
pub fn check_fence_value_len(len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(crate::InvalidInput::TooLong {
            what: "fence value",
            value: format!("<{len} bytes>"),
            len,
            max,
        }
        .into());
    }
    Ok(())
}

macro_rules! forward_fence {
    ($ty:ty) => {
        #[async_trait]
        impl<F: Fence + ?Sized> Fence for $ty {
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
            async fn write(
                &self,
                resource: &ResourceId,
                token: Token,
                value: Bytes,
            ) -> Result<Accepted> {
                (**self).write(resource, token, value).await
            }
            async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
                (**self).claim(resource, token).await
            }
            async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
                (**self).read(resource).await
            }
        }
    };
}

forward_fence!(Arc<F>);
forward_fence!(Box<F>);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Error, InvalidInput};

    #[test]
    fn a_value_longer_than_the_store_takes_is_invalid_input_naming_its_length() {
        assert!(check_fence_value_len(10, 10).is_ok());
        match check_fence_value_len(11, 10) {
            Err(Error::InvalidInput(InvalidInput::TooLong {
                len, max, value, ..
            })) => {
                assert_eq!((len, max), (11, 10));
                assert_eq!(value, "<11 bytes>");
            }
            other => panic!("expected TooLong, got {other:?}"),
        }
    }
}
