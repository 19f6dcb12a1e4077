#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod history;
pub mod suite;
pub mod worker;

/// The test kit the suite is built on (harness, fault proxy, process control, fence server, PKI),
/// re-exported so an adapter's tests need one dependency for both.
pub use lease_testkit;
