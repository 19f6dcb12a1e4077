//! Heap per kept lease: the process's live heap, counted by the global allocator, while `n`
//! leases on distinct keys are held and each kept by [`fenced::keep`] (the scale case's shape:
//! 64 acquires in flight, renewal every third of the TTL), and again after they are released.
//!
//! RSS (what the suite's `many_leases_kept` case reports) also holds what the allocator keeps
//! for reuse; the live heap is what the library itself holds, so changes to it show here first.
//! Bytes are the sizes asked of the allocator; blocks are the live allocations (glibc adds about
//! 16 bytes of its own to each). Counted by `stats_alloc` around the system allocator.

use std::alloc::System;
use std::sync::Arc;
use std::time::Duration;

use fenced::{keep, Coordinator, KeeperOptions, Kept, LeaseOptions, LockKey};
use futures::stream::{self, StreamExt, TryStreamExt};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tokio::time::Instant;

use crate::locks::BenchResult;

/// The global allocator: the system's, counting (`stats_alloc`).
#[global_allocator]
static ALLOCATOR: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Whether this build counts allocations (the heap scenario needs it).
pub(crate) const COUNTING: bool = true;

/// The live heap change since `region` began: (bytes, blocks). (`stats_alloc` already counts a
/// realloc's growth in `bytes_allocated` and its shrinking in `bytes_deallocated`;
/// `bytes_reallocated` is the same change once more.)
fn live(region: &Region<'_, System>) -> (isize, isize) {
    let c = region.change();
    (
        c.bytes_allocated as isize - c.bytes_deallocated as isize,
        c.allocations as isize - c.deallocations as isize,
    )
}

/// What one measurement found.
#[derive(Debug, Clone)]
pub(crate) struct HeapFigures {
    /// Leases held at once.
    pub(crate) leases: usize,
    /// Time to acquire and keep all of them.
    pub(crate) acquire: Duration,
    /// Live heap bytes per held, kept lease.
    pub(crate) bytes_per_lease: f64,
    /// The most live heap bytes per lease seen while they were held (renewals under way
    /// included): what the process's RSS has to hold at least.
    pub(crate) peak_bytes_per_lease: f64,
    /// Live allocations per held, kept lease.
    pub(crate) blocks_per_lease: f64,
    /// Live heap bytes per lease still held a renewal interval after every lease was released
    /// (0 when all of it went back; buffers and maps grown by the burst stay).
    pub(crate) bytes_left_per_lease: f64,
}

/// Measures `n` kept leases on `coordinator` (keys under `prefix`, TTL `ttl`). `quick` (the
/// smoke run) holds them a moment instead of through a renewal.
pub(crate) async fn per_kept_lease(
    coordinator: Arc<dyn Coordinator>,
    prefix: &str,
    n: usize,
    ttl: Duration,
    quick: bool,
) -> BenchResult<HeapFigures> {
    let interval = if quick {
        Duration::ZERO
    } else {
        ttl / 3 + Duration::from_millis(500)
    };
    let keys: Vec<LockKey> = (0..n)
        .map(|i| LockKey::new(format!("{prefix}/{i}")))
        .collect::<Result<_, _>>()?;
    let options = LeaseOptions::new(ttl);
    // Warm up: connections, sessions and the backend's per-coordinator state exist before the
    // first count, so only what each lease holds is counted.
    let warm: Vec<Kept> = acquire_all(&coordinator, &keys[..n.min(64)], &options).await?;
    release_all(warm).await?;
    settle().await;
    let region = Region::new(ALLOCATOR);
    let (bytes0, blocks0) = live(&region);
    let began = Instant::now();
    let kept = acquire_all(&coordinator, &keys, &options).await?;
    let acquire = began.elapsed();
    // Held through the first renewal of every lease (each a third of the TTL after its grant),
    // sampling the live heap: the steady figure is read after it, the peak is the most seen.
    let hold_until = Instant::now() + interval + acquire;
    let mut peak = live(&region).0;
    while Instant::now() < hold_until {
        tokio::time::sleep(Duration::from_millis(10)).await;
        peak = peak.max(live(&region).0);
    }
    let (bytes1, blocks1) = live(&region);
    release_all(kept).await?;
    // The timer's wake-ups of released leases (each holds its record weakly) are due within a
    // renewal interval.
    tokio::time::sleep(interval).await;
    let (bytes2, _) = live(&region);
    let per = |d: isize| d as f64 / n as f64;
    Ok(HeapFigures {
        leases: n,
        acquire,
        bytes_per_lease: per(bytes1 - bytes0),
        peak_bytes_per_lease: per(peak - bytes0),
        blocks_per_lease: per(blocks1 - blocks0),
        bytes_left_per_lease: per(bytes2 - bytes0),
    })
}

async fn acquire_all(
    coordinator: &Arc<dyn Coordinator>,
    keys: &[LockKey],
    options: &LeaseOptions,
) -> BenchResult<Vec<Kept>> {
    stream::iter(keys)
        .map(|key| async move {
            let lease = coordinator.try_acquire(key, options).await?;
            Ok::<_, crate::locks::BenchError>(keep(lease, KeeperOptions::new())?)
        })
        .buffer_unordered(64)
        .try_collect()
        .await
}

async fn release_all(kept: Vec<Kept>) -> BenchResult<()> {
    stream::iter(kept)
        .map(|k| async move { k.release().await })
        .buffer_unordered(64)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Lets background work after a burst finish (a benchmark's pause, not a test's wait).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// The markdown section for `rows` (backend name, figures).
pub(crate) fn markdown(rows: &[(String, HeapFigures)]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "\n## Heap per kept lease\n\n\
         The live heap (counted by the global allocator) while the leases are held, each kept \
         by `keep(lease, KeeperOptions::new())`, over the live heap before, divided by the \
         leases: after every lease's first renewal, and the most seen during the hold (renewals \
         under way included); and what is still live a renewal interval after every lease was \
         released (maps and buffers grown by the burst stay). Ours only (the peers have no \
         keeper).\n\n\
         | backend | leases | acquire + keep, all | heap bytes / lease | peak | allocations / \
         lease | bytes / lease left after release |\n|---|---|---|---|---|---|---|\n",
    );
    for (backend, f) in rows {
        let _ = writeln!(
            out,
            "| {backend} | {} | {:.2} s | {:.0} | {:.0} | {:.1} | {:.0} |",
            f.leases,
            f.acquire.as_secs_f64(),
            f.bytes_per_lease,
            f.peak_bytes_per_lease,
            f.blocks_per_lease,
            f.bytes_left_per_lease
        );
    }
    out
}
