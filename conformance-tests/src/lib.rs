#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod subjects;

/// Many tasks contending on a few shared keys (from [`lease_testkit`]).
pub use lease_testkit::contend;
/// The fence server and remote fence (from [`lease_testkit`]).
pub use lease_testkit::fence_server;
/// The real-server harness (from [`lease_testkit`]).
pub use lease_testkit::harness;
pub use lease_testkit::logs;
/// The test PKI (from [`lease_testkit`]).
pub use lease_testkit::pki;
/// Signals to one process (from [`lease_testkit`]).
pub use lease_testkit::process;
/// The TCP fault proxy (from [`lease_testkit`]).
pub use lease_testkit::proxy;
/// Sampling a lease's status from a task (from [`lease_testkit`]).
pub use lease_testkit::status;

/// The Consul stand-in (the [`consul_standin`] crate).
pub use ::consul_standin;

/// The suite's `check!` macro (from [`conformance_suite`]).
pub use conformance_suite::check;
/// The history checker (from [`conformance_suite`]).
pub use conformance_suite::history;
/// The conformance suite (from [`conformance_suite`]).
pub use conformance_suite::suite;
