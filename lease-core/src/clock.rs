//! Local validity from the monotonic clock.
//!
//! A lease's validity is computed by the client from [`tokio::time::Instant`] (the monotonic
//! clock; it also follows tokio's paused test time), read **before** the acquire or renew request
//! is sent, plus the TTL the backend granted, minus a drift margin. Whatever the server does with
//! its own clock, the server cannot expire the lock before the client's estimate ends, as long as
//! the two clocks' *rates* differ by less than the margin. Wall clocks are never compared across
//! machines.

use std::time::Duration;

use tokio::time::Instant;

/// The default margin for a lease of `ttl`: 1% of the TTL plus 2 ms (the Redlock paper's rule),
/// and never more than half the TTL.
pub fn default_drift_margin(ttl: Duration) -> Duration {
    (ttl / 100 + Duration::from_millis(2)).min(ttl / 2)
}

/// The local deadline of a lease granted `granted_ttl`, for a request sent at `sent_at`.
///
/// Saturates instead of overflowing (a TTL is at most 24 hours, so this only matters for
/// hand-built values).
pub fn valid_until(sent_at: Instant, granted_ttl: Duration, margin: Duration) -> Instant {
    let usable = granted_ttl.saturating_sub(margin);
    sent_at.checked_add(usable).unwrap_or(sent_at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margin_is_small_and_bounded() {
        assert_eq!(
            default_drift_margin(Duration::from_secs(10)),
            Duration::from_millis(102)
        );
        assert_eq!(
            default_drift_margin(Duration::from_millis(2)),
            Duration::from_millis(1)
        );
    }

    #[test]
    fn validity_is_measured_from_send_time() {
        let t0 = Instant::now();
        let v = valid_until(t0, Duration::from_secs(10), Duration::from_millis(102));
        assert_eq!(v - t0, Duration::from_millis(9898));
        assert_eq!(
            valid_until(t0, Duration::from_millis(1), Duration::from_secs(1)),
            t0
        );
    }
}
