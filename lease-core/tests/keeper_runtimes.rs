//! Leases kept on one multi-thread runtime depend on no other: the keeper's timer is a thread of
//! its own and each renewal runs on the lease's runtime, so a runtime that kept leases first and
//! then shut down takes nothing with it. (Its own test binary: the timer is per process.)

mod common;

use common::*;
use lease_core::{keep, KeeperOptions, LeaseStatus};
use std::sync::atomic::Ordering;
use tokio::time::Instant;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn leases_kept_on_a_runtime_outlive_another_runtime_that_kept_leases_first() {
    let first = runtime();
    let second = runtime();
    // The timer starts for `first`'s lease.
    let on_first = first.block_on(async {
        keep(
            Box::new(ScriptedLease::new(secs(3), RenewScript::Ok)),
            KeeperOptions::new(),
        )
        .unwrap()
    });
    let lease = ScriptedLease::new(secs(3), RenewScript::Ok);
    let renews = lease.renews.clone();
    let on_second = second.block_on(async { keep(Box::new(lease), KeeperOptions::new()).unwrap() });
    drop(on_first);
    drop(first);
    second.block_on(async {
        let deadline = Instant::now() + secs(30);
        while renews.load(Ordering::SeqCst) < 3 {
            assert_eq!(
                on_second.lease().status(),
                LeaseStatus::Held,
                "the lease ran out after {} renewals",
                renews.load(Ordering::SeqCst)
            );
            assert!(Instant::now() < deadline, "not renewed within 30 s");
            tokio::time::sleep(ms(20)).await;
        }
    });
    assert_eq!(on_second.lease().status(), LeaseStatus::Held);
}
