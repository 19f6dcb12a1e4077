//! Fenced writes per second against the same plain `UPDATE` without the guard, side by side, on
//! one PostgreSQL server started by the test harness (fsync=on, synchronous_commit=on).
//!
//! ```text
//! cargo run --release -p fence-postgres --example throughput
//! ```
//!
//! 16 concurrent writers, on one resource and on 1,000 resources, each measurement
//! `THROUGHPUT_SECS` seconds (default 5, at most 60). Three ways to write:
//! - `PgFence::write`: the fence table, one pipelined transaction (BEGIN, ensure row, lock,
//!   guarded UPDATE, COMMIT) per write;
//! - `FencedTable::update`: the single statement on the caller's table,
//!   `UPDATE items SET payload = $v, fence = $token WHERE id = $k AND fence <= $token`;
//! - plain `UPDATE items SET payload = $v WHERE id = $k`: the same write without the guard.
//!
//! All writers of one run present the same token (one lease holder, many writes), so every
//! fenced write is accepted and the numbers compare equal work.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use conformance_tests::harness::PostgresServer;
use fence_postgres::{FencedTable, PgFence};
use lease_core::{Bytes, Fence, ResourceId, Token};

const WRITERS: usize = 16;

#[derive(Clone, Copy, Debug)]
enum Method {
    PgFenceWrite,
    FencedUpdate,
    PlainUpdate,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::PgFenceWrite => "PgFence::write (fence table, one pipelined transaction)",
            Method::FencedUpdate => "FencedTable::update (UPDATE ... AND fence <= $token)",
            Method::PlainUpdate => "plain UPDATE, no guard",
        }
    }
}

/// Runs `WRITERS` tasks for `secs`; returns (successful writes, failed writes, elapsed).
async fn measure(
    fence: Arc<PgFence>,
    table: Arc<FencedTable>,
    method: Method,
    resources: usize,
    token: Token,
    secs: Duration,
) -> (u64, u64, Duration) {
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let began = Instant::now();
    let deadline = began + secs;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let (fence, table, ok, failed) = (fence.clone(), table.clone(), ok.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while Instant::now() < deadline {
                let key = (i % resources) as i32;
                i += WRITERS;
                let payload = i as i32;
                let done = match method {
                    Method::PgFenceWrite => {
                        let r = ResourceId::new(format!("item/{key}")).unwrap();
                        fence
                            .write(&r, token, Bytes::from(payload.to_be_bytes().to_vec()))
                            .await
                            .is_ok()
                    }
                    Method::FencedUpdate => {
                        let c = fence.pool().get().await.unwrap();
                        table
                            .update(&**c, &key, token, &[("payload", &payload)])
                            .await
                            .is_ok()
                    }
                    Method::PlainUpdate => {
                        let c = fence.pool().get().await.unwrap();
                        c.execute(
                            "UPDATE items SET payload = $1 WHERE id = $2",
                            &[&payload, &key],
                        )
                        .await
                        .is_ok_and(|n| n == 1)
                    }
                };
                if done { &ok } else { &failed }.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        began.elapsed(),
    )
}

fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown date".into())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let secs = std::env::var("THROUGHPUT_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(5)
        .clamp(1, 60);
    let secs = Duration::from_secs(secs);
    let pg = tokio::task::spawn_blocking(PostgresServer::start)
        .await
        .unwrap()
        .expect("start PostgreSQL (Debian: apt-get install postgresql)");
    let url = format!("{}?pool_size={WRITERS}", pg.connection_url());
    let fence = Arc::new(PgFence::connect(&url).await.expect("connect"));
    let version: String = {
        let c = fence.pool().get().await.unwrap();
        c.batch_execute(
            "CREATE TABLE items (id INT PRIMARY KEY, payload INT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0);
             INSERT INTO items (id) SELECT generate_series(0, 999);",
        )
        .await
        .unwrap();
        c.query_one("SHOW server_version", &[])
            .await
            .unwrap()
            .get(0)
    };
    let table = {
        let c = fence.pool().get().await.unwrap();
        Arc::new(
            FencedTable::open(&**c, "items", "id", "fence")
                .await
                .unwrap(),
        )
    };
    println!(
        "fence-postgres throughput: {} cores, {}, PostgreSQL {version} (harness: fsync=on), \
         {WRITERS} concurrent writers, pool_size={WRITERS}, {:?} per measurement, release={}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        today(),
        secs,
        !cfg!(debug_assertions),
    );
    println!();
    println!("| resources | method | writes/s | writes | failed |");
    println!("| ---: | --- | ---: | ---: | ---: |");
    let mut token = 0;
    for resources in [1usize, 1000] {
        for method in [
            Method::PgFenceWrite,
            Method::FencedUpdate,
            Method::PlainUpdate,
        ] {
            token += 1;
            let (ok, failed, elapsed) = measure(
                fence.clone(),
                table.clone(),
                method,
                resources,
                Token::new(token).unwrap(),
                secs,
            )
            .await;
            println!(
                "| {resources} | {} | {:.0} | {ok} | {failed} |",
                method.name(),
                ok as f64 / elapsed.as_secs_f64(),
            );
        }
    }
    drop(fence);
    drop(pg);
}
