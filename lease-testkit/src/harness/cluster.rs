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

    /// Undoes [`Self::isolate_from_peers`] and [`Self::isolate_from_clients`] for `member`.
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
}
