#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

pub mod contend;
pub mod fence_server;
pub mod harness;
pub mod logs;
pub mod pki;
pub mod process;
pub mod proxy;
pub mod status;
