//! Watching a lease's status from a task, to check a transition it must never make (for
//! example: back to `Held` after its key was deleted while it was in doubt).

use std::time::Duration;

use lease_core::{LeaseStatus, LostReason, LostSignal};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What [`sample_until_lost`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    /// Whether any sample showed the lease `Held`.
    pub held: bool,
    /// Why the lease was lost, or `None` if it was not within the bound.
    pub lost: Option<LostReason>,
}

/// Spawns a task that reads `signal`'s status every millisecond until the lease is lost or
/// `within` passes. Sampling can miss a `Held` shorter than its period but never reports one
/// that did not happen, so a check that the lease was never `Held` fails only when it was.
pub fn sample_until_lost(signal: LostSignal, within: Duration) -> JoinHandle<Sampled> {
    tokio::spawn(async move {
        let deadline = Instant::now() + within;
        let mut held = false;
        while Instant::now() < deadline {
            match signal.status() {
                LeaseStatus::Held => held = true,
                LeaseStatus::Lost(reason) => {
                    return Sampled {
                        held,
                        lost: Some(reason),
                    }
                }
                LeaseStatus::InDoubt => {}
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Sampled { held, lost: None }
    })
}
