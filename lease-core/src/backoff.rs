//! [`Backoff`]: the one retry schedule of every adapter's background loop (exponential, capped,
//! with jitter).

use std::time::Duration;

use rand::Rng;

/// An exponential backoff with "equal jitter": each delay is drawn from `[c / 2, c]`, where the
/// ceiling `c` starts at `min` and doubles after every delay up to `max`.
///
/// The delay never exceeds `max`, so a cap chosen as a timing bound (a fraction of a TTL or of a
/// session timeout) stays one; the jitter keeps many clients (or many leases of one client) that
/// failed together from retrying in lockstep. [`reset`](Backoff::reset) after a success.
///
/// (Decision 0021: written here rather than taken from `backon`, whose jitter adds up to a whole
/// delay on top of the capped one.)
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Backoff {
    /// A schedule from `min` up to `max` (`max` below `min` is taken as `min`; a `min` below
    /// 1 ms as 1 ms, so that a retry loop never spins).
    pub fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(1));
        Backoff {
            min,
            max: max.max(min),
            ceiling: min,
        }
    }

    /// The next delay, in `[ceiling / 2, ceiling]`; the ceiling then doubles, up to `max`.
    pub fn next_delay(&mut self) -> Duration {
        let c = self.ceiling;
        self.ceiling = c.saturating_mul(2).min(self.max);
        let half = c / 2;
        let spread = (c - half).as_nanos() as u64;
        half + Duration::from_nanos(rand::thread_rng().gen_range(0..=spread))
    }

    /// The most the next delay can be (to check it against a deadline before sleeping).
    pub fn ceiling(&self) -> Duration {
        self.ceiling
    }

    /// Starts over from `min` (after a success).
    pub fn reset(&mut self) {
        self.ceiling = self.min;
    }

    /// Sleeps for the next delay.
    pub async fn sleep(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_with_jitter_below_each_ceiling() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(20), ms(500));
        let mut ceilings = Vec::new();
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..200 {
            let c = b.ceiling();
            let d = b.next_delay();
            assert!(d >= c / 2 && d <= c, "{d:?} outside [{:?}, {c:?}]", c / 2);
            assert!(d <= ms(500));
            ceilings.push(c);
            distinct.insert(d);
        }
        assert_eq!(
            &ceilings[..6],
            &[ms(20), ms(40), ms(80), ms(160), ms(320), ms(500)]
        );
        assert!(
            distinct.len() > 100,
            "no jitter: {} distinct delays",
            distinct.len()
        );
        b.reset();
        assert_eq!(b.ceiling(), ms(20));
        assert_eq!(Backoff::new(ms(50), ms(10)).ceiling(), ms(50));
    }
}
