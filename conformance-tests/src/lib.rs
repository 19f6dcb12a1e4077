//! The shared conformance suite, fault injectors and real-server harness.
#![forbid(unsafe_code)]

pub mod fence_server;
pub mod harness;
pub mod process;
pub mod proxy;
pub mod subjects;
pub mod suite;
