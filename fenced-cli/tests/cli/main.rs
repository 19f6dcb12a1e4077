//! The `fenced` binary against the real servers the conformance harness starts: every command on
//! every backend (Redis, etcd, ZooKeeper and the Consul stand-in, listed once in
//! [`backends::on_every_backend!`]), fences on Redis, etcd and PostgreSQL, and the usage errors
//! and help without any server.
//!
//! A missing server is a named skip on a developer machine and a failure under `CI=true`.
//! Tests wait for conditions with bounded deadlines; none sleeps to synchronise.

mod backends;
mod commands;
mod run;
#[cfg(target_os = "linux")]
mod signals;
mod support;
mod token_floor;
mod usage;
