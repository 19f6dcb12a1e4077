//! Lock benchmarks, ours side by side with the raw clients and the peer libraries, against the
//! same servers in one run, with ratios.
//!
//! ```text
//! cargo run --release -p lease-bench -- [--start redis,etcd,zookeeper] [--out docs/bench]
//! cargo run --release -p lease-bench -- --coordinator redis://127.0.0.1:6379 [--coordinator ...]
//! cargo run --release -p lease-bench -- --smoke        # a few seconds: proves it still works
//! ```
//!
//! `--start` (the default when no `--coordinator` is given) has the harness start each server
//! (Debian's packages; Redis with AOF and `appendfsync always`) on a free loopback port for the
//! run and stops it afterwards. Per backend it measures ours (built by `fenced::connect`), the
//! raw client doing the same round trips (Redis: a 1+1 Lua lock that mints a token; etcd: txn +
//! delete; ZooKeeper: create + delete, and create + getChildren + delete), the raw client sending
//! exactly our requests (Redis: our acquire and release scripts; etcd: our two transactions), so
//! that each gap splits into our client's part and the server's, and the peers (rslock, etcd's
//! Lock RPC, zookeeper-client's lock recipe):
//! 1. uncontended acquire+release, sequential, one client: p50 / p99, and the release alone;
//! 2. renewal: one held lock renewed a tenth of `--iterations` times, each alone (25 ms apart,
//!    as a keeper's renewals are), p50 / p99, with the
//!    server's request counters around it (ours, the raw Redis and etcd locks, rslock; the
//!    ZooKeeper locks and etcd's Lock RPC have no renewal call: their session keeps them);
//! 3. hand-off: a waiter on a second client blocked in acquire, from the START of the holder's
//!    release to the waiter holding (the peers' definition);
//! 4. throughput: `--tasks` tasks on one client, each on its own key, and on `--shared-keys` keys;
//! 5. the server's own request counters around 1 and 4, per pair and per contended grant;
//! 6. heap per kept lease (ours only, once per backend): `--heap-leases` leases held and kept,
//!    the live heap counted by the global allocator after their first renewal, at its peak, and
//!    after their release.
//!
//! Every scenario runs each lock in a seeded random order within each of `--rounds` rounds, each
//! after a warm-up. `--out DIR` writes `side-by-side.md` and `side-by-side.svg` there. Timing
//! uses the monotonic clock only. This is a benchmark, not a test: it asserts nothing.

#[cfg(feature = "count-allocations")]
mod heap;
#[cfg(not(feature = "count-allocations"))]
mod heap_off;
#[cfg(not(feature = "count-allocations"))]
use heap_off as heap;
mod locks;
mod measure;
mod report;
mod servers;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use locks::{BenchLock, BenchResult};
use measure::{Figures, Sizes};
use servers::{Backend, Server};

/// Lock benchmarks: ours, the raw clients and the peer libraries, side by side.
#[derive(Parser, Debug)]
#[command(name = "lease-bench", version)]
struct Args {
    /// Servers to start for the run, comma-separated: redis, etcd, zookeeper, consul-standin.
    /// The default when no --coordinator is given: redis,etcd,zookeeper.
    #[arg(long, value_delimiter = ',')]
    start: Vec<String>,
    /// A running server, as our coordinator URL (repeatable); raw clients and peers are derived
    /// from it for redis://, etcd:// and zk://. memory:// measures ours alone.
    #[arg(long = "coordinator", alias = "backend")]
    coordinators: Vec<String>,
    /// Rounds; each lock runs every scenario once per round, in a seeded random order.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Measured uncontended acquire+release pairs per lock per round.
    #[arg(long, default_value_t = 1000)]
    iterations: usize,
    /// Hand-offs per lock per round.
    #[arg(long, default_value_t = 30)]
    handoffs: usize,
    /// Tasks in the throughput scenarios.
    #[arg(long, default_value_t = 64)]
    tasks: usize,
    /// Keys the tasks of the contended scenario share.
    #[arg(long, default_value_t = 4)]
    shared_keys: usize,
    /// Length of each throughput measurement, in seconds.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Lease TTL (and session timeout) in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    ttl_ms: u64,
    /// How long the hand-off waiter waits before the holder starts its release, in ms.
    #[arg(long, default_value_t = 20)]
    head_start_ms: u64,
    /// Seed of the interleaving order (printed; random when not given).
    #[arg(long)]
    seed: Option<u64>,
    /// Writes side-by-side.md and side-by-side.svg into this directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Tiny sizes (one round, a few operations each): proves the benchmark still works.
    #[arg(long)]
    smoke: bool,
    /// Only the locks whose names start with one of these (comma-separated, e.g. `ours,rslock`);
    /// all when not given. For profiling one lock.
    #[arg(long, value_delimiter = ',')]
    locks: Vec<String>,
    /// Only these scenarios (comma-separated: pairs, renewals, hand-offs, throughput, heap);
    /// all when not given.
    #[arg(long, value_delimiter = ',')]
    scenarios: Vec<String>,
    /// Kept leases held at once in the heap scenario (ours only, once per backend).
    #[arg(long, default_value_t = 5000)]
    heap_leases: usize,
}

/// The locks measured against one server.
async fn locks_for(server: &Server, ttl: Duration) -> BenchResult<Vec<Arc<dyn BenchLock>>> {
    use locks::*;
    let ours: Arc<dyn BenchLock> = Arc::new(Ours::connect(&server.url, ttl).await?);
    let e = &server.endpoint;
    Ok(match server.backend {
        Backend::Redis => vec![
            ours,
            Arc::new(RawRedis::connect(e, ttl, false).await?),
            Arc::new(RawRedis::connect(e, ttl, true).await?),
            Arc::new(Rslock::new(e, ttl)),
        ],
        Backend::Etcd => vec![
            ours,
            Arc::new(RawEtcd::connect(e, ttl, false).await?),
            Arc::new(RawEtcd::connect(e, ttl, true).await?),
            Arc::new(EtcdLock::connect(e, ttl).await?),
        ],
        Backend::ZooKeeper => vec![
            ours,
            Arc::new(RawZk::connect(e, ttl, false).await?),
            Arc::new(RawZk::connect(e, ttl, true).await?),
            Arc::new(ZkRecipe::connect(e, ttl).await?),
        ],
        Backend::Consul | Backend::Other => vec![ours],
    })
}

/// Today's date (UTC) for the report's heading: days since the epoch to a civil date.
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

struct Entry {
    server: usize,
    lock: Arc<dyn BenchLock>,
    waiter: Arc<dyn BenchLock>,
    figures: Figures,
}

async fn run(mut args: Args) -> BenchResult<String> {
    if args.smoke {
        args.rounds = 1;
        args.iterations = args.iterations.min(30);
        args.handoffs = args.handoffs.min(3);
        args.tasks = args.tasks.min(8);
        args.seconds = args.seconds.min(0.3);
        args.heap_leases = args.heap_leases.min(50);
    }
    if args.start.is_empty() && args.coordinators.is_empty() {
        args.start = vec!["redis".into(), "etcd".into(), "zookeeper".into()];
    }
    let ttl = Duration::from_millis(args.ttl_ms);
    let seed = args.seed.unwrap_or_else(rand::random);
    let sizes = Sizes {
        iterations: args.iterations.max(1),
        handoffs: args.handoffs,
        tasks: args.tasks.max(1),
        shared_keys: args.shared_keys.max(1),
        seconds: Duration::from_secs_f64(args.seconds.max(0.05)),
        waiter_head_start: Duration::from_millis(args.head_start_ms),
    };
    eprintln!("lease-bench: seed {seed}; {sizes:?}");

    let mut servers = Vec::new();
    for what in args.start.clone() {
        eprintln!("starting {what}");
        servers.push(tokio::task::spawn_blocking(move || Server::start(&what, ttl)).await??);
    }
    for url in &args.coordinators {
        servers.push(Server::external(url)?);
    }
    let mut versions = Vec::new();
    let mut entries = Vec::new();
    for (i, server) in servers.iter().enumerate() {
        versions.push(server.counters.version().await);
        for lock in locks_for(server, ttl).await? {
            if !args.locks.is_empty()
                && !args
                    .locks
                    .iter()
                    .any(|l| lock.name().starts_with(l.as_str()))
            {
                continue;
            }
            let waiter = lock.another().await?;
            entries.push(Entry {
                server: i,
                lock,
                waiter,
                figures: Figures::default(),
            });
        }
    }
    let run_id: u32 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for round in 0..args.rounds {
        for phase in ["pairs", "renewals", "hand-offs", "throughput"] {
            if !args.scenarios.is_empty() && !args.scenarios.iter().any(|s| s == phase) {
                continue;
            }
            let mut order: Vec<usize> = (0..entries.len()).collect();
            order.shuffle(&mut rng);
            for i in order {
                let e = &mut entries[i];
                let server = &servers[e.server];
                let prefix = format!("bench/{run_id:08x}/r{round}/l{i}");
                eprintln!(
                    "round {}/{}: {phase:<10} {}: {}",
                    round + 1,
                    args.rounds,
                    server.backend.name(),
                    e.lock.name()
                );
                let done = match phase {
                    "pairs" => {
                        measure::pairs(
                            &*e.lock,
                            &server.counters,
                            &format!("{prefix}/pair"),
                            &sizes,
                            &mut e.figures,
                        )
                        .await
                    }
                    "renewals" => {
                        measure::renewals(
                            &*e.lock,
                            &server.counters,
                            &format!("{prefix}/renew"),
                            &sizes,
                            &mut e.figures,
                        )
                        .await
                    }
                    "hand-offs" => {
                        measure::handoffs(
                            &*e.lock,
                            e.waiter.clone(),
                            &format!("{prefix}/handoff"),
                            &sizes,
                            &mut e.figures,
                        )
                        .await
                    }
                    _ => {
                        measure::throughputs(
                            e.lock.clone(),
                            &server.counters,
                            &prefix,
                            &sizes,
                            &mut e.figures,
                        )
                        .await
                    }
                };
                if let Err(err) = done {
                    eprintln!("  failed: {err}");
                    e.figures.errors.push(format!("{phase}: {err}"));
                }
            }
        }
    }
    let mut heap_rows = Vec::new();
    let heap_asked = args.scenarios.is_empty() || args.scenarios.iter().any(|s| s == "heap");
    if heap_asked && heap::COUNTING {
        for e in entries
            .iter_mut()
            .filter(|e| e.lock.kind() == locks::Kind::Ours)
        {
            let server = &servers[e.server];
            eprintln!(
                "heap: {} kept leases on {}",
                args.heap_leases,
                server.backend.name()
            );
            let Some(coordinator) = e.lock.coordinator() else {
                continue;
            };
            match heap::per_kept_lease(
                coordinator,
                &format!("bench/{run_id:08x}/heap"),
                args.heap_leases.max(1),
                ttl,
                args.smoke,
            )
            .await
            {
                Ok(f) => heap_rows.push((server.backend.name().to_owned(), f)),
                Err(err) => {
                    eprintln!("  failed: {err}");
                    e.figures.errors.push(format!("heap: {err}"));
                }
            }
        }
    }
    let rows: Vec<report::Row> = entries
        .into_iter()
        .map(|e| report::Row {
            backend: servers[e.server].backend,
            version: versions[e.server].clone(),
            name: e.lock.name().to_owned(),
            kind: e.lock.kind(),
            figures: e.figures,
        })
        .collect();
    let info = report::RunInfo {
        date: today(),
        machine: servers::machine(),
        seed,
        command: std::iter::once("lease-bench".to_owned())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
        sizes: format!(
            "{} rounds; {} pairs, {} hand-offs (waiter head start {} ms), {} tasks for {:.1} s \
             (own keys; {} shared keys) per lock per round; TTL {} ms",
            args.rounds,
            sizes.iterations,
            sizes.handoffs,
            args.head_start_ms,
            sizes.tasks,
            sizes.seconds.as_secs_f64(),
            sizes.shared_keys,
            args.ttl_ms
        ),
    };
    let mut md = report::markdown(&info, &rows);
    if heap_asked {
        md.push_str(&heap::markdown(&heap_rows));
    }
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("side-by-side.md"), &md)?;
        report::svg(&dir.join("side-by-side.svg"), &rows)?;
        eprintln!("wrote {}/side-by-side.{{md,svg}}", dir.display());
    }
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.figures.errors.is_empty())
        .map(|r| format!("{} {}", r.backend.name(), r.name))
        .collect();
    if !failed.is_empty() {
        return Err(format!("{md}\nfailed: {}", failed.join(", ")).into());
    }
    Ok(md)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(md) => {
            println!("{md}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("benchmark failed: {e}");
            ExitCode::FAILURE
        }
    }
}
