//! adapter-redis against real redis-server processes started by the conformance harness.
//!
//! Each test starts its own server on a free port with a temporary directory. Without
//! `redis-server` a test prints `SKIPPED: <name>: <reason>` and passes, except under `CI=true`
//! where it fails.

mod common;
mod coordinator;
mod durability;
mod faults;
mod fence;
mod replication;
mod tls;
