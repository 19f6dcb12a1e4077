#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod consul_standin;
pub mod fence_server;
pub mod harness;
pub mod history;
pub mod pki;
pub mod process;
pub mod proxy;
pub mod subjects;
pub mod suite;
