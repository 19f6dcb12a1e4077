#!/usr/bin/env bash
# Runs every test of the workspace on a fresh Debian 12 machine:
#   1. installs the servers the harness starts (scripts/setup.sh; root or sudo; nothing is started),
#   2. checks formatting, lints and the API docs (broken links fail),
#   3. runs all tests: unit, property, harness, and the conformance suite against every backend
#      (the harness starts each real server on a free loopback port with a temporary data
#      directory and stops it afterwards), and the cluster cases against a Redis primary with
#      two replicas and three Sentinels, three etcd members (network namespaces; needs root) and
#      a three-server ZooKeeper ensemble (tests/cluster_*.rs in conformance-tests),
#      and the suite's third-party example adapter (conformance-suite/example-adapter),
#   4. builds the facade with no backend feature and PROTOC=/bin/false (what a newcomer's first
#      command needs), runs its tests and the stale-holder demo, which must show the fence
#      rejecting the stale write.
# With CI=true, a server that cannot be started fails the run instead of being skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "installing server packages when missing"
scripts/setup.sh

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo doc (every public item's docs build, links resolve)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

step "the test kit and the suite build without any adapter or backend client (decision 0020)"
# The tree first, as a command of its own: inside `if`, a failing `cargo tree` in a pipeline
# would go unnoticed.
deps="$(cargo tree --locked -e normal --prefix none -p lease-testkit -p consul-standin -p conformance-suite)"
if grep -E '^(adapter-[a-z]+|fenced|fence-postgres|etcd-client|redis|zookeeper[a-z-]*|tokio-postgres) v' <<<"$deps"; then
  echo "lease-testkit, consul-standin or conformance-suite depends on the crates above" >&2
  exit 1
fi
PROTOC=/bin/false cargo build --locked -p lease-testkit -p consul-standin -p conformance-suite

step "cargo test (unit, property, harness, conformance suite per backend)"
cargo test --workspace --locked

step "benchmarks build and run once (criterion test mode; asserts nothing, measures nothing)"
cargo test --workspace --locked --bench hot_paths
# lease-bench's heap scenario needs its counting allocator (a feature, off for the other scenarios).
cargo test --locked -p lease-bench --features count-allocations --test smoke

step "facade without backends (no protoc needed): its tests, then the stale-holder demo"
PROTOC=/bin/false cargo test --locked -p fenced
PROTOC=/bin/false cargo run --quiet --locked --example stale-holder

step "all checks passed"
