//! Lock benchmarks against any backend URL: the numbers that performance targets are stated in
//! (see shared BACKEND-FACTS: one round trip is the physical limit; peers' hand-off latencies).
//!
//! ```text
//! cargo run --release -p lease-bench -- --coordinator redis://127.0.0.1:6379 [--iterations 2000]
//!     [--tasks 64] [--seconds 5] [--ttl-ms 10000]
//! cargo run --release -p lease-bench -- --start redis|etcd|zookeeper|consul-standin
//! ```
//!
//! `--start` has the conformance harness start the server (Debian's packages; Redis with AOF and
//! `appendfsync always`) on a free loopback port for the run, and stops it afterwards.
//!
//! Measures, after a warm-up (the first request after an idle gap is slower on these machines):
//! 1. `acquire + release` of an uncontended key, sequential, one client: p50 / p99 / max;
//! 2. hand-off: a waiter blocked in `acquire`, time from the holder's `release` returning to the
//!    waiter holding the key: p50 / p99 / max;
//! 3. throughput: `--tasks` tasks, each on its own key, acquire+release pairs per second.
//!
//! Timing uses the monotonic clock only. This is a benchmark, not a test: it asserts nothing.

use std::sync::Arc;
use std::time::Duration;

use fenced::{Coordinator, LeaseOptions, LockKey};
use tokio::time::Instant;

struct Args {
    coordinator: String,
    start: Option<String>,
    iterations: usize,
    tasks: usize,
    seconds: u64,
    ttl: Duration,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        coordinator: "memory://".into(),
        start: None,
        iterations: 2000,
        tasks: 64,
        seconds: 5,
        ttl: Duration::from_secs(10),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} {v:?} is not a number"))
        };
        match flag.as_str() {
            "--coordinator" | "--backend" => a.coordinator = v.clone(),
            "--start" => a.start = Some(v.clone()),
            "--iterations" => a.iterations = num()?.max(10) as usize,
            "--tasks" => a.tasks = num()?.max(1) as usize,
            "--seconds" => a.seconds = num()?.max(1),
            "--ttl-ms" => a.ttl = Duration::from_millis(num()?),
            _ => return Err(format!("unknown flag {flag:?}")),
        }
    }
    Ok(a)
}

fn percentiles(mut v: Vec<Duration>) -> String {
    v.sort();
    let p = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    format!(
        "p50 {:>9.1?}  p99 {:>9.1?}  max {:>9.1?}  (n={})",
        p(0.5),
        p(0.99),
        v[v.len() - 1],
        v.len()
    )
}

fn key(run: u32, name: &str) -> Result<LockKey, fenced::Error> {
    Ok(LockKey::new(format!("bench/{run:08x}/{name}"))?)
}

async fn acquire_release(c: &dyn Coordinator, run: u32, a: &Args) -> Result<String, fenced::Error> {
    let k = key(run, "pair")?;
    let o = LeaseOptions::new(a.ttl);
    for _ in 0..a.iterations / 10 {
        c.acquire(&k, &o).await?.release().await?;
    }
    let mut samples = Vec::with_capacity(a.iterations);
    for _ in 0..a.iterations {
        let t = Instant::now();
        c.acquire(&k, &o).await?.release().await?;
        samples.push(t.elapsed());
    }
    Ok(percentiles(samples))
}

async fn hand_off(
    c: Arc<dyn Coordinator>,
    waiter: Arc<dyn Coordinator>,
    run: u32,
    a: &Args,
) -> Result<String, fenced::Error> {
    let k = key(run, "handoff")?;
    let rounds = (a.iterations / 10).clamp(20, 500);
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let held = c.acquire(&k, &LeaseOptions::new(a.ttl)).await?;
        let w = {
            let (waiter, k) = (waiter.clone(), k.clone());
            let o = LeaseOptions::new(a.ttl).wait(a.ttl);
            tokio::spawn(async move {
                let l = waiter.acquire(&k, &o).await?;
                let got = Instant::now();
                l.release().await?;
                Ok::<_, fenced::Error>(got)
            })
        };
        // Let the waiter queue up and start waiting (not a measured interval).
        tokio::time::sleep(Duration::from_millis(5)).await;
        held.release().await?;
        let released = Instant::now();
        let got = w.await.map_err(|e| fenced::Error::Unavailable {
            backend: "bench",
            message: e.to_string(),
            source: None,
        })??;
        samples.push(got.saturating_duration_since(released));
    }
    Ok(percentiles(samples))
}

async fn throughput(c: Arc<dyn Coordinator>, run: u32, a: &Args) -> Result<String, fenced::Error> {
    let until = Instant::now() + Duration::from_secs(a.seconds);
    let mut tasks = Vec::new();
    for i in 0..a.tasks {
        let c = c.clone();
        let k = key(run, &format!("own/{i}"))?;
        let o = LeaseOptions::new(a.ttl);
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < until {
                c.acquire(&k, &o).await?.release().await?;
                n += 1;
            }
            Ok::<_, fenced::Error>(n)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.map_err(|e| fenced::Error::Unavailable {
            backend: "bench",
            message: e.to_string(),
            source: None,
        })??;
    }
    Ok(format!(
        "{:.0} pairs/s ({} tasks, own keys, {} s)",
        total as f64 / a.seconds as f64,
        a.tasks,
        a.seconds
    ))
}

/// A server started for the run, held only to be dropped (stopped) when the benchmark ends.
type Started = Box<dyn std::any::Any + Send>;

fn start(what: &str, ttl: Duration) -> Result<(Started, String), String> {
    use conformance_tests::harness::{EtcdServer, RedisServer, ZooKeeperServer};
    let e = |e: conformance_tests::harness::HarnessError| e.to_string();
    Ok(match what {
        "redis" => {
            let s = RedisServer::start().map_err(e)?;
            let url = s.url();
            (Box::new(s) as Started, url)
        }
        "etcd" => {
            let s = EtcdServer::start().map_err(e)?;
            let url = s.url();
            (Box::new(s) as Started, url)
        }
        "zookeeper" => {
            let s = ZooKeeperServer::start().map_err(e)?;
            let url = format!(
                "{}/bench?session_timeout_ms={}",
                s.url(),
                ttl.as_millis().min(60_000)
            );
            (Box::new(s) as Started, url)
        }
        "consul-standin" => {
            let s = conformance_tests::consul_standin::ConsulStandIn::start(Default::default())
                .map_err(|e| e.to_string())?;
            let url = format!("consul://{}", s.addr());
            (Box::new(s) as Started, url)
        }
        other => {
            return Err(format!(
                "--start {other:?}: expected redis, etcd, zookeeper or consul-standin"
            ))
        }
    })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\nusage: lease-bench [--coordinator URL] [--iterations N] [--tasks N] [--seconds N] [--ttl-ms N]");
            return std::process::ExitCode::from(2);
        }
    };
    let _server = match a.start.clone() {
        Some(what) => {
            match tokio::task::spawn_blocking(move || start(&what, Duration::from_secs(10))).await {
                Ok(Ok((server, url))) => {
                    a.coordinator = url;
                    Some(server)
                }
                Ok(Err(e)) => {
                    eprintln!("could not start the server: {e}");
                    return std::process::ExitCode::FAILURE;
                }
                Err(e) => {
                    eprintln!("could not start the server: {e}");
                    return std::process::ExitCode::FAILURE;
                }
            }
        }
        None => None,
    };
    let run: u32 = std::process::id() ^ (Instant::now().elapsed().subsec_nanos());
    let result = async {
        let c = fenced::connect(&a.coordinator).await?;
        // The hand-off waiter uses its own client, as a second process would.
        let waiter = if a.coordinator.starts_with("memory") {
            c.clone()
        } else {
            fenced::connect(&a.coordinator).await?
        };
        println!(
            "lease-bench on {}",
            fenced::adapter::BackendUrl::parse(&a.coordinator)?
        );
        println!(
            "  acquire+release   {}",
            acquire_release(&*c, run, &a).await?
        );
        println!(
            "  hand-off          {}",
            hand_off(c.clone(), waiter, run, &a).await?
        );
        println!("  throughput        {}", throughput(c, run, &a).await?);
        Ok::<_, fenced::Error>(())
    }
    .await;
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("benchmark failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
