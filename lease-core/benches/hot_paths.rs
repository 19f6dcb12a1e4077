//! Micro-benchmarks of lease-core's in-process hot paths: key validation, token admission and
//! the in-memory coordinator.
//!
//! Every grant on every backend goes through `LockKey::new` and `TokenAdmission::admit`, so a
//! regression there is a regression of every adapter; the memory coordinator's acquire, renew and
//! release show what the core itself costs with no network in the way. These benchmarks assert
//! nothing: they measure.
//!
//! Run with `cargo bench -p lease-core --bench hot_paths` (a full run takes well under a minute);
//! `cargo bench -p lease-core --bench hot_paths -- --test` runs each benchmark once (the smoke step
//! of `scripts/test.sh`).

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use lease_core::adapter::TokenAdmission;
use lease_core::memory::MemoryCoordinator;
use lease_core::{Coordinator, LeaseOptions, LockKey, Token, MAX_NAME_BYTES};
use tokio::runtime::Runtime;

/// Keys the many-keys admission benchmark cycles through.
const MANY_KEYS: usize = 1024;

/// A key of `MAX_NAME_BYTES - 6` bytes in 16-byte segments (the limit is 256 bytes).
fn long_key() -> String {
    let mut key = String::new();
    while key.len() + 16 <= MAX_NAME_BYTES - 6 {
        if !key.is_empty() {
            key.push('/');
        }
        key.push_str("segment-abcdefg");
    }
    while key.len() < MAX_NAME_BYTES - 6 {
        key.push('x');
    }
    key
}

/// A current-thread runtime, as an application with one async task per lock would drive the
/// coordinator.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

/// Key validation: `LockKey::new` on a typical key, on a key just under the 256-byte limit,
/// and on a key it refuses (a `..` segment), including building the error.
fn key_validation(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_validation");
    let long = long_key();
    // Measures: validating and owning a short two-segment key.
    group.bench_function("typical", |b| {
        b.iter(|| LockKey::new(black_box("orders/42")))
    });
    // Measures: validation cost that grows with length (the control-character scan and the
    // segment checks over 250 bytes).
    group.bench_function("long_near_limit", |b| {
        b.iter(|| LockKey::new(black_box(long.as_str())))
    });
    // Measures: the refusal path, up to the typed error that names the value.
    group.bench_function("refused_dotdot", |b| {
        b.iter(|| LockKey::new(black_box("orders/../42")))
    });
    group.finish();
}

/// Token admission: `TokenAdmission::admit` (conversion, floor, the process watermark and the
/// record, in one step) of a rising token on one key, of rising tokens spread over 1024 keys,
/// and the refusal of a token below the watermark.
fn token_admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("token_admission");
    // Each benchmark has its own scope, so their watermarks never meet.
    let key = LockKey::new("orders/42").expect("valid key");

    // Measures: one lock granted again and again, each grant a token above the last.
    let one = TokenAdmission::new("bench", "bench-one-key", None);
    let mut next: u64 = 0;
    group.bench_function("rising_one_key", |b| {
        b.iter(|| {
            next += 1;
            one.admit(black_box(&key), black_box(next))
        })
    });

    // Measures: the same with 1024 locks in the watermark map, visited in turn.
    let many = TokenAdmission::new("bench", "bench-many-keys", None);
    let keys: Vec<LockKey> = (0..MANY_KEYS)
        .map(|i| LockKey::new(format!("tenant-{}/orders/{i}", i % 7)).expect("valid key"))
        .collect();
    let mut round: u64 = 0;
    let mut index = 0;
    group.bench_function("rising_many_keys", |b| {
        b.iter(|| {
            if index == 0 {
                round += 1;
            }
            let result = many.admit(black_box(&keys[index]), black_box(round));
            index = (index + 1) % MANY_KEYS;
            result
        })
    });

    // Measures: the fail-closed path, a grant at or below the highest token seen for the lock,
    // up to the `TokenRegression` error.
    let regressed = TokenAdmission::new("bench", "bench-regressed", None);
    regressed.admit(&key, 1_000u64).expect("first grant");
    group.bench_function("regressed_refused", |b| {
        b.iter(|| regressed.admit(black_box(&key), black_box(999u64)))
    });

    // Measures: the floor check alone refusing a grant (no watermark yet for the lock).
    let floored = TokenAdmission::new(
        "bench",
        "bench-floor",
        Some(Token::new(1_000).expect("in range")),
    );
    group.bench_function("below_floor_refused", |b| {
        b.iter(|| floored.admit(black_box(&key), black_box(10u64)))
    });
    group.finish();
}

/// The in-memory coordinator on a current-thread runtime: an uncontended acquire followed by
/// its release on one key, and a renew of a lease that is held.
fn memory_coordinator(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory_coordinator");
    let rt = runtime();
    let coord = MemoryCoordinator::new();
    let key = LockKey::new("orders/42").expect("valid key");
    let options = LeaseOptions::new(Duration::from_secs(30));

    // Measures: `acquire` of a free key (options check, token minted, lease built) and
    // `release` (compare-and-delete, waking nobody), the pair every user of a lock pays.
    group.bench_function("acquire_release_uncontended", |b| {
        b.to_async(&rt).iter(|| async {
            let lease = coord
                .acquire(black_box(&key), black_box(&options))
                .await
                .expect("the key is free");
            lease.release().await
        })
    });

    // Measures: one keep-alive `renew` of a held lease (ownership check, new expiry, the
    // tracker's validity moved forward).
    let renew_key = LockKey::new("orders/renewed").expect("valid key");
    let lease = rt
        .block_on(coord.acquire(&renew_key, &options))
        .expect("the key is free");
    group.bench_function("renew_held", |b| {
        b.to_async(&rt).iter(|| async { lease.renew().await })
    });
    rt.block_on(lease.release()).expect("still held");
    group.finish();
}

/// Short runs: each benchmark warms up for 0.5 s and measures for 2 s, so a full run of the
/// nine benchmarks stays under a minute.
fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

/// Runs every group with the short configuration, then the command-line options (a filter,
/// `--test`, ...). Written out rather than with `criterion_group!`, whose generated `pub fn`
/// cannot carry the doc the workspace's `missing_docs` lint asks for.
fn main() {
    let mut criterion = config().configure_from_args();
    key_validation(&mut criterion);
    token_admission(&mut criterion);
    memory_coordinator(&mut criterion);
    criterion.final_summary();
}
