//! Fenced leases on etcd.
//!
//! This crate is a placeholder in the workspace: the adapter is built by its own issue. It depends
//! on `lease-core` so that the workspace layout (one crate per backend) is fixed from the start.
