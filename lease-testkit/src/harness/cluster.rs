//! Replicated coordinators: a cluster of real servers the harness runs, and the one interface
//! the suite's cluster cases drive them through.
//!
//! A cluster is N **members** (Redis: the primary and its replicas, Sentinels aside; etcd:
//! members; ZooKeeper: servers), numbered `0..N`. Every member runs as its own child process on
//! loopback ports with its own data directory, so each can be crashed, restarted on the same
//! data, frozen, and cut off by fault proxies:
//!
//! - **from its peers** ([`ClusterControl::isolate_from_peers`]): replication, Raft or quorum
//!   traffic to and from the member is blackholed while clients still reach it; a member so cut
//!   off is the one whose state goes stale;
//! - **from clients** ([`ClusterControl::isolate_from_clients`]): the clients' path to the member
//!   is blackholed while its peers still reach it.
//!
//! [`ClusterControl::heal`] undoes both. Every method waits for what it promises (a restart
//! returns once the member answers, a pause once every thread of the process is stopped) and is
//! bounded; none sleeps on a guess.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;

/// What a cluster operation failed with: a sentence naming the member and what went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterError(pub String);

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ClusterError {}

impl From<super::HarnessError> for ClusterError {
    fn from(e: super::HarnessError) -> Self {
        ClusterError(e.to_string())
    }
}

/// Result of a cluster operation.
pub type ClusterResult<T> = Result<T, ClusterError>;

/// Control over a replicated coordinator the harness runs (see the [module docs](self)).
///
/// Methods take `&self` (implementations lock internally) so cases can share one control through
/// an `Arc`. All futures are bounded: a member that does not come back in time is an error, not
/// a hang.
pub trait ClusterControl: Send + Sync {
    /// The cluster's kind, for reports: `redis-sentinel`, `etcd-cluster`, `zookeeper-ensemble`.
    fn kind(&self) -> &'static str;

    /// How many members the cluster has.
    fn members(&self) -> usize;

    /// The member that currently leads (the Redis primary, the etcd leader, the ZooKeeper
    /// leader), as the members themselves report it; waits (bounded) while there is none, for
    /// example during an election or a failover.
    fn leader(&self) -> BoxFuture<'_, ClusterResult<usize>>;

    /// Crashes `member` (`SIGKILL`, no flush). `Ok` if it was not running.
    fn kill(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Starts `member` again on its ports and data directory and waits until it answers.
    fn restart(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Freezes `member` (`SIGSTOP`); returns once every thread shows stopped.
    fn pause(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Thaws `member` (`SIGCONT`).
    fn resume(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Blackholes `member`'s traffic with its peers (both directions), not its clients'.
    fn isolate_from_peers(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Blackholes the clients' traffic to `member`, not its peers'.
    fn isolate_from_clients(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// Undoes [`Self::isolate_from_peers`] and [`Self::isolate_from_clients`] (and
    /// [`Self::lag_replica`]) for `member`; links to a member still cut stay cut (on Redis, the
    /// replica priorities a lagging replica's promotion needs stay too, until no member is cut;
    /// a restart also ends its member's cut there, since it then replicates directly).
    fn heal(&self, member: usize) -> BoxFuture<'_, ClusterResult<()>>;

    /// The client URL that names every member (what users configure), for clients of the case.
    fn url(&self) -> String;

    /// A client URL that names `member` only (through its client-side fault proxy), for a client
    /// pinned to one member.
    fn member_url(&self, member: usize) -> String;

    /// How long the cluster takes at most to replace a crashed leader (a Sentinel failover, an
    /// etcd or ZooKeeper election), for the cases' bounds.
    fn failover_bound(&self) -> Duration;

    /// The member a holder pinned with [`Self::member_url`] should talk to for a minority
    /// partition: the one whose state goes stale when it is cut from its peers. By default a
    /// follower (`leader + 1`); Redis, where only the primary serves locks, names the primary.
    fn holder_member(&self, leader: usize) -> usize {
        (leader + 1) % self.members()
    }

    /// What the members' logs end with (for a failed case's message); empty by default.
    fn log_tails(&self) -> String {
        String::new()
    }

    /// Redis only: makes replica `member` fall behind the primary on purpose (its replication
    /// link is blackholed; writes acknowledged from now on do not reach it) and makes it the only
    /// replica Sentinel may promote. `Ok(false)` on clusters without replicas that can lag.
    fn lag_replica(&self, member: usize) -> BoxFuture<'_, ClusterResult<bool>> {
        let _ = member;
        Box::pin(async { Ok(false) })
    }

    /// Asks the cluster to replace its leader now, as an operator does when an automatic
    /// failover did not come within its bound (Redis: `SENTINEL FAILOVER`; a Sentinel whose
    /// election failed waits twice its `failover-timeout` before it tries again). `Ok(true)`
    /// once a failover was made and the cluster agrees on its new leader, `Ok(false)` on
    /// clusters that elect their leader by themselves and have no such command, `Err` when
    /// every member that could start one refused (one may accept a moment later: ask again).
    fn force_failover(&self) -> BoxFuture<'_, ClusterResult<bool>> {
        Box::pin(async { Ok(false) })
    }
}

/// `tail` of the member behind `m`, without waiting for a start, stop, restart or signal that
/// holds its lock (log tails are read when a case fails, possibly while its future is dropped).
pub(crate) fn tail_of<T>(m: &Mutex<T>, tail: impl FnOnce(&T) -> String) -> String {
    match m.try_lock() {
        Ok(guard) => tail(&guard),
        Err(std::sync::TryLockError::Poisoned(p)) => tail(&p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => {
            "<not read: the harness is starting, stopping or signalling it>".into()
        }
    }
}

/// Which members of a cluster are cut from their peers: the link between two members is cut
/// while either end is, so healing one member keeps the links another cut still needs.
#[derive(Debug)]
pub(crate) struct Cuts(Mutex<Marks>);

impl Cuts {
    /// No member of `members` cut.
    pub(crate) fn new(members: usize) -> Self {
        Cuts(Mutex::new(Marks(vec![false; members])))
    }

    /// Marks `member` cut or not and runs `apply` with the marks before and after, under the
    /// lock, so that concurrent changes are applied in the order they were marked.
    pub(crate) fn set<R>(
        &self,
        member: usize,
        cut: bool,
        apply: impl FnOnce(&Marks, &Marks) -> R,
    ) -> R {
        let mut marks = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let before = marks.clone();
        marks.0[member] = cut;
        apply(&before, &marks)
    }

    /// Whether `member` is cut now.
    pub(crate) fn is_cut(&self, member: usize) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_cut(member)
    }
}

/// The cut members at one instant ([`Cuts::set`]).
#[derive(Debug, Clone)]
pub(crate) struct Marks(Vec<bool>);

impl Marks {
    /// Whether the link between members `a` and `b` is cut.
    pub(crate) fn severs(&self, a: usize, b: usize) -> bool {
        self.0[a] || self.0[b]
    }

    /// Whether `member` is cut.
    pub(crate) fn is_cut(&self, member: usize) -> bool {
        self.0[member]
    }

    /// Whether any member is cut.
    pub(crate) fn any(&self) -> bool {
        self.0.contains(&true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healing_one_member_keeps_the_links_another_cut_needs() {
        let cuts = Cuts::new(3);
        let marks = |member, cut| cuts.set(member, cut, |b, a| (b.clone(), a.clone()));
        marks(1, true);
        let (before, after) = marks(2, true);
        assert!(before.severs(1, 2) && !before.severs(0, 2) && before.severs(0, 1));
        assert!(after.severs(0, 2) && after.any());
        let (_, healed) = marks(1, false);
        assert!(!healed.severs(0, 1), "both ends whole");
        assert!(healed.severs(1, 2) && healed.severs(0, 2), "2 is still cut");
        assert!(healed.is_cut(2) && !healed.is_cut(1));
        let (_, whole) = marks(2, false);
        assert!(!whole.any() && !whole.severs(0, 2) && !whole.severs(1, 2));
    }
}
