//! What only adapter authors need: URL option parsing, grant and renewal bookkeeping, token
//! watermarks, the round scheduler, clock helpers and the registry's factory types.
//!
//! Code that uses leases needs none of this; it lives at the crate root. An adapter crate
//! imports from here (`use lease_core::adapter::{UrlOptions, OptionSpec, ...}`), so a reader can
//! tell at the `use` line which parts of the core an adapter builds on.

pub use crate::backoff::Backoff;
#[path = "batch.rs"]
pub mod batch;
#[path = "clock.rs"]
pub mod clock;
pub use crate::connect::{percent_decode, BackendUrl, CoordinatorFactory, FenceFactory};
pub use crate::lease::LeaseTracker;
pub use crate::options::{duration_in_range, parse_millis};
pub use crate::outcome::{Delivery, Op};
pub use crate::tokens::{NativeToken, TokenAdmission};
pub use crate::url_options::{
    timeout_in_range, CommonOptions, OptionSpec, UrlOptions, COMMON_OPTIONS, MAX_URL_TIMEOUT,
};
pub use crate::watermark::Watermarks;
