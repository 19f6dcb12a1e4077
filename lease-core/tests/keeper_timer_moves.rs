//! The keeper's shared timer runs on the multi-thread runtime that needed it first. When that
//! runtime shuts down while another runtime's leases are kept through it, they move to a timer
//! on their own runtime and keep being renewed. (Its own test binary: the timer is per process.)

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
fn leases_kept_through_a_runtime_that_shuts_down_move_to_their_own() {
    let first = runtime();
    let second = runtime();
    // The timer starts on `first`.
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
