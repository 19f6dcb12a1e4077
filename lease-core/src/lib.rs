#![doc = include_str!("../README.md")]
//!
//! # Cancel safety
//!
//! Every async method of this API may be cancelled by dropping its future (a `select!` branch
//! that lost, a `timeout`, an aborted task). None leaves a lock held past its TTL or a waiter that
//! blocks others (the conformance suite's `cancelled_acquire` case checks every backend), but a
//! request already sent may still have been applied by the server. The table says what a dropped
//! future may have done there, and what to do next.
//!
//! | dropped future | what may have happened on the server | what to do |
//! |---|---|---|
//! | [`Coordinator::acquire`], [`Coordinator::try_acquire`] | the lock may have been granted (and a token used up) just before the drop. Nobody in this process holds that lease: the adapter deletes such a lock in the background (compare-and-delete), and in any case it expires at its TTL (on ZooKeeper, at the latest when the session ends). A queued waiter's entry is removed the same way. | nothing; a new `acquire` may wait for the orphaned grant to be cleaned up, so give it a wait of at least one TTL. Tokens are only ever higher afterwards. |
//! | [`Lease::renew`] | the renewal may have been applied (the server-side expiry moved), or not. The local deadline ([`Lease::valid_until`]) moves only on a confirmed renewal, so it stays where it was: the safe side. | renew again before [`Lease::valid_until`] (the keeper does this by itself). |
//! | [`Lease::release`] | the lock may or may not have been deleted. Once the future was polled, the lease is `Lost(Released)` at once and never `Held` again, and the adapter deletes the lock in the background if it is still this lease's (compare-and-delete: never another holder's lock); at the latest it expires at its TTL. | nothing: a later `release` returns `Err(Lost)` and sends nothing. |
//! | [`Coordinator::inspect`], [`Coordinator::audit_trail`], [`Fence::read`] | nothing: read-only. | call again. |
//! | [`Coordinator::force_release`] | the holder may or may not have been removed, and the audit record may or may not have been written. | [`inspect`](Coordinator::inspect) and [`audit_trail`](Coordinator::audit_trail) to see what happened; to retry, pass [`ForceRelease::expect_token`] with the token you meant to remove, so that a holder that arrived since is never removed. |
//! | [`Fence::write`] | the value may have been committed together with its token, or nothing changed (it is one atomic step either way, never half of it). | [`Fence::read`]: if the value and token are yours it was written. If not, that proves nothing yet: the dropped request may still arrive and be applied later, so write again under a newer token (a new acquisition), which it can never overwrite (see [`Fence::write`]). |
//! | [`Fence::claim`] | the newest accepted token may have advanced to yours, or not. | claim again with the same token (idempotent). |
//! | [`acquire_many`] | any of the above for the key being acquired; the leases already taken are dropped, so each is released best-effort and expires at its TTL. | as for `acquire`. |
//! | [`MultiLease::renew`], [`MultiLease::release`] | as for each lease's `renew` / `release`, for the leases reached before the drop. | as for `renew` / `release`. |
//! | [`with_lease`] | the body is dropped mid-way (what it sent is its own business: fence its writes) and the lease is dropped, so released best-effort; at the latest it expires at its TTL. | nothing for the lease; check the body's side effects (read the fence). |
//! | [`bounded`], [`bounded_with`] | nothing on the lock: only the work future is dropped. The lease stays held and is still yours to release. | release or keep using the lease. |
//! | [`Kept::release`] | the keeper is already stopped; the release is as for [`Lease::release`]. | as for `release`. |
//! | [`LostSignal::wait`], [`LostSignal::uncertain`], [`MultiLease::lost`] | nothing: local. | call again. |
//!
//! Dropping a [`Lease`] itself (not a future) stops its renewal and releases it best-effort,
//! without blocking (decision 0003).
//!
//! Those clean-ups run in the background, on the application's tokio runtime. A process about
//! to exit calls [`Coordinator::settle`] first, after dropping what it gives up: it waits until
//! they are done, where a runtime shutting down would drop them and leave what they would have
//! deleted until its TTL or session ends (decision 0052).
//!
//! # Not reentrant
//!
//! A lease is not reentrant and carries no hold count. A second acquisition of a key that this
//! process already holds, even through the same [`Coordinator`] handle and from the same task, is a
//! contender like any other: [`Coordinator::try_acquire`] returns `Err(Held)`, and
//! [`Coordinator::acquire`] waits until the key is free or its wait bound passes
//! (`Err(Timeout)`). So code that acquires a key while holding it waits for itself until its wait
//! runs out; pass the [`Lease`] (or its [`Token`]) down instead of acquiring again.
#![forbid(unsafe_code)]

pub mod adapter;
mod audit;
mod backoff;
mod cancel;
mod cleanups;
mod connect;
mod coordinator;
mod delayed;
mod dependents;
mod error;
mod fence;
mod guardian;
mod helpers;
mod instrument;
mod keeper;
mod key;
mod lease;
mod local_waiters;
pub mod memory;
pub mod metrics;
mod multi;
mod opening;
mod options;
mod outcome;
mod records;
mod secret;
mod section;
mod tls;
mod token;
mod tokens;
mod url_options;
mod watermark;

pub use audit::AuditRecord;
pub use cancel::{lost_token, signal_token, LostTokenExt};
pub use connect::Registry;
pub use coordinator::{Coordinator, HolderInfo};
pub use error::{BoxError, Error, InvalidInput, LostReason, Result};
pub use fence::{Accepted, Fence, FencedValue};
pub use helpers::{with_lease, IntoLockKey, LeaseScope};
pub use instrument::Instrumented;
pub use keeper::{keep, KeeperOptions, KeeperStop, Kept, Progress};
pub use key::{LockKey, ResourceId, MAX_NAME_BYTES};
pub use lease::{Lease, LeaseState, LeaseStatus, LostSignal};
pub use multi::{acquire_many, MultiLease};
pub use options::{Capabilities, ForceRelease, LeaseOptions, OwnerId, MAX_LABEL_BYTES};
pub use section::{bounded, bounded_with, SectionGuard, SectionOptions};
pub use token::{FencingToken, Token};

/// Re-exported so callers name the same `Bytes` type the [`Fence`] trait uses.
pub use bytes::Bytes;
/// Re-exported so callers name the same `CancellationToken` type [`lost_token`] returns.
pub use tokio_util::sync::CancellationToken;
