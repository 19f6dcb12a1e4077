#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod adapter;
mod audit;
mod backoff;
pub mod batch;
mod cancel;
pub mod clock;
mod connect;
mod coordinator;
mod error;
mod fence;
mod helpers;
mod instrument;
mod keeper;
mod key;
mod lease;
pub mod memory;
pub mod metrics;
mod multi;
mod options;
mod section;
mod token;
mod tokens;
mod url_options;
mod watermark;

pub use audit::AuditRecord;
pub use cancel::{lost_token, signal_token, LostTokenExt};
pub use connect::{percent_decode, BackendUrl, CoordinatorFactory, FenceFactory, Registry};
pub use coordinator::{Coordinator, HolderInfo};
pub use error::{BoxError, Error, InvalidInput, LostReason, Result};
pub use fence::{Accepted, Fence, FencedValue};
pub use helpers::{with_lease, IntoLockKey, LeaseScope};
pub use instrument::Instrumented;
pub use keeper::{keep, KeeperOptions, KeeperStop, Kept, Progress};
pub use key::{LockKey, ResourceId, MAX_NAME_BYTES};
pub use lease::{Lease, LeaseStatus, LeaseTracker, LostSignal};
pub use multi::{acquire_many, MultiLease};
pub use options::{
    duration_in_range, parse_millis, Capabilities, ForceRelease, LeaseOptions, OwnerId,
    MAX_LABEL_BYTES,
};
pub use section::{bounded, bounded_with, SectionGuard, SectionOptions};
pub use token::{FencingToken, Token};
pub use watermark::Watermarks;

/// Re-exported so callers name the same `Bytes` type the [`Fence`] trait uses.
pub use bytes::Bytes;
/// Re-exported so callers name the same `CancellationToken` type [`lost_token`] returns.
pub use tokio_util::sync::CancellationToken;
