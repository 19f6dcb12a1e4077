//! This adapter's worker binary speaks the suite's worker protocol for its own URL scheme: it
//! connects through the adapter's registry (`conformance_suite::worker::main_with`), acquires,
//! writes through the test's fence served over TCP, and releases.

use std::sync::Arc;
use std::time::Duration;

use conformance_suite::lease_testkit::fence_server::FenceServer;
use lease_core::memory::MemoryFence;
use lease_core::{Fence, LockKey, ResourceId};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const WORKER: &str = env!("CARGO_BIN_EXE_thirdparty-worker");

/// Runs the worker to its end (bounded) and returns its stdout lines and whether it succeeded.
async fn run_worker(coordinator: &str, fence: std::net::SocketAddr) -> (Vec<String>, bool) {
    let mut child = Command::new(WORKER)
        .args(["--coordinator", coordinator, "--fence", &fence.to_string()])
        .args(["--key", "orders/42", "--ttl-ms", "2000", "--writes", "3"])
        .args(["--interval-ms", "1"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start the worker");
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut seen = Vec::new();
    let read_all = async {
        while let Some(line) = lines.next_line().await.expect("worker stdout") {
            seen.push(line);
        }
        child.wait().await.expect("worker exit")
    };
    let status = tokio::time::timeout(Duration::from_secs(30), read_all)
        .await
        .expect("the worker ends within 30 s");
    (seen, status.success())
}

#[tokio::test]
async fn worker_runs_on_the_adapters_own_scheme() {
    let fence = Arc::new(MemoryFence::new());
    let server = FenceServer::start(fence.clone()).await.unwrap();
    let (lines, ok) = run_worker("thirdparty-memory://", server.addr()).await;
    assert!(ok, "worker failed: {lines:?}");
    let fields: Vec<&str> = lines[0]
        .strip_prefix("ACQUIRED ")
        .unwrap_or_else(|| panic!("first line {:?}", lines[0]))
        .split(' ')
        .collect();
    let [token, valid_ms, at_ms] = fields[..] else {
        panic!("first line {:?}", lines[0]);
    };
    let ms = |v: &str| -> u64 { v.parse().expect("milliseconds") };
    assert!(
        (1..=2000).contains(&ms(valid_ms)),
        "validity left {valid_ms} ms of a 2000 ms TTL"
    );
    let releasing = lines[4]
        .strip_prefix("RELEASING ")
        .unwrap_or_else(|| panic!("fifth line {:?}", lines[4]));
    assert!(ms(releasing) >= ms(at_ms), "{lines:?}");
    assert_eq!(
        [&lines[1..4], &lines[5..]].concat(),
        ["WRITE 0 OK", "WRITE 1 OK", "WRITE 2 OK", "RELEASE OK"],
        "after {:?}",
        lines[0]
    );
    // The writes went through the test's fence, under the worker's token.
    let key: LockKey = "orders/42".parse().unwrap();
    let state = fence.read(&ResourceId::from(&key)).await.unwrap().unwrap();
    let (written_by, value) = state.value.expect("a value was written");
    assert_eq!(written_by.to_string(), token);
    assert!(
        String::from_utf8_lossy(&value).ends_with("write 2"),
        "{value:?}"
    );
}

#[tokio::test]
async fn worker_names_the_registered_schemes_for_an_unknown_one() {
    let fence = Arc::new(MemoryFence::new());
    let server = FenceServer::start(fence).await.unwrap();
    let (lines, ok) = run_worker("nosuch://", server.addr()).await;
    assert!(!ok, "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("ERROR") && lines[0].contains("thirdparty-memory"),
        "{lines:?}"
    );
}
