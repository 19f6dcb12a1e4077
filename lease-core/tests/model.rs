//! Model-based property test: random operations by several workers over a few keys, run against
//! the in-memory coordinator and fence on paused time, compared step by step with a reference
//! model, with the invariants checked after every step:
//!
//! (a) at most one lease per key reports `Held`, and `inspect` agrees with it (and the model);
//! (b) tokens issued per key strictly increase, starting at 1;
//! (c) the fence's accepted tokens per resource never decrease;
//! (d) a superseded holder's write, once a newer token was claimed or written, is `Stale`.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use lease_core::memory::{FenceEvent, MemoryCoordinator, MemoryFence};
use lease_core::{
    Bytes, Coordinator, Error, Fence, ForceRelease, Lease, LeaseOptions, LeaseStatus, LockKey,
    ResourceId,
};
use proptest::prelude::*;
use tokio::time::Instant;

const KEYS: [&str; 3] = ["k", "k/sub", "ключ"];

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        w: usize,
        k: usize,
        ttl: u64,
        wait: u64,
        margin_pct: Option<u64>,
    },
    TryAcquire {
        w: usize,
        k: usize,
        ttl: u64,
        margin_pct: Option<u64>,
    },
    Renew {
        w: usize,
        k: usize,
    },
    Release {
        w: usize,
        k: usize,
    },
    Drop {
        w: usize,
        k: usize,
    },
    Advance(u64),
    Write {
        w: usize,
        k: usize,
    },
    Claim {
        w: usize,
        k: usize,
    },
    ForceRelease {
        k: usize,
    },
    /// The worker stops acting for a while, then resumes and writes with the token it has.
    Pause {
        w: usize,
        k: usize,
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..4usize;
    let k = 0..3usize;
    let ttl = 1..=200u64;
    let margin = proptest::option::of(0..100u64);
    prop_oneof![
        4 => (w.clone(), k.clone(), ttl.clone(), 0..=200u64, margin.clone()).prop_map(
            |(w, k, ttl, wait, margin_pct)| Op::Acquire { w, k, ttl, wait, margin_pct }
        ),
        4 => (w.clone(), k.clone(), ttl, margin)
            .prop_map(|(w, k, ttl, margin_pct)| Op::TryAcquire { w, k, ttl, margin_pct }),
        3 => (w.clone(), k.clone()).prop_map(|(w, k)| Op::Renew { w, k }),
        2 => (w.clone(), k.clone()).prop_map(|(w, k)| Op::Release { w, k }),
        1 => (w.clone(), k.clone()).prop_map(|(w, k)| Op::Drop { w, k }),
        3 => (0..=150u64).prop_map(Op::Advance),
        5 => (w.clone(), k.clone()).prop_map(|(w, k)| Op::Write { w, k }),
        3 => (w.clone(), k.clone()).prop_map(|(w, k)| Op::Claim { w, k }),
        1 => k.clone().prop_map(|k| Op::ForceRelease { k }),
        2 => (w, k, 20..=300u64).prop_map(|(w, k, ms)| Op::Pause { w, k, ms }),
    ]
}

/// The model of one lease object.
#[derive(Debug, Clone)]
struct MLease {
    key: usize,
    token: u64,
    ttl: Duration,
    margin: Duration,
    /// Local validity deadline, as an offset from the start.
    valid_until: Duration,
    /// Marked lost (released, revoked, refused, dropped).
    marked_lost: bool,
}

#[derive(Debug, Default)]
struct MKey {
    last_token: u64,
    /// The model lease id holding the key, and the server-side expiry (offset from the start).
    holder: Option<(usize, Duration)>,
    issued: Vec<u64>,
}

struct Model {
    now: Duration,
    leases: Vec<MLease>,
    keys: Vec<MKey>,
    fence_newest: Vec<Option<u64>>,
}

impl Model {
    fn new(nkeys: usize) -> Self {
        Model {
            now: Duration::ZERO,
            leases: Vec::new(),
            keys: (0..nkeys).map(|_| MKey::default()).collect(),
            fence_newest: vec![None; nkeys],
        }
    }

    fn expire(&mut self, k: usize) {
        if let Some((_, e)) = self.keys[k].holder {
            if e <= self.now {
                self.keys[k].holder = None;
            }
        }
    }

    fn locally_held(&self, id: usize) -> bool {
        let l = &self.leases[id];
        !l.marked_lost && self.now < l.valid_until
    }

    fn is_holder(&self, id: usize) -> bool {
        let k = self.leases[id].key;
        matches!(self.keys[k].holder, Some((h, e)) if h == id && e > self.now)
    }

    fn grant(&mut self, k: usize, ttl: Duration, margin: Duration) -> usize {
        let ks = &mut self.keys[k];
        ks.last_token += 1;
        ks.issued.push(ks.last_token);
        let id = self.leases.len();
        ks.holder = Some((id, self.now + ttl));
        self.leases.push(MLease {
            key: k,
            token: ks.last_token,
            ttl,
            margin,
            valid_until: self.now + ttl.saturating_sub(margin),
            marked_lost: false,
        });
        id
    }

    /// Renew or release succeed only while the lease is locally valid and still the holder.
    fn can_act(&self, id: usize) -> bool {
        let ok = self.locally_held(id) && self.is_holder(id);
        // Local validity always ends no later than the server's expiry, so a locally held lease
        // that is not the holder cannot exist.
        assert!(
            !self.locally_held(id) || self.is_holder(id),
            "model: locally held lease {id} is not the holder"
        );
        ok
    }

    /// Dropping (or releasing) a lease removes its entry while the entry is still its own,
    /// also after a local loss (validity ended under a drift margin).
    fn drop_lease(&mut self, id: usize) {
        if self.is_holder(id) {
            self.keys[self.leases[id].key].holder = None;
        }
        self.leases[id].marked_lost = true;
    }

    /// The fence's answer to `token` on resource `k`: `Ok(previous)` or `Err(current)`.
    fn fence(&mut self, k: usize, token: u64) -> Result<Option<u64>, u64> {
        match self.fence_newest[k] {
            Some(cur) if token < cur => Err(cur),
            prev => {
                self.fence_newest[k] = Some(token);
                Ok(prev)
            }
        }
    }
}

struct Harness {
    coord: MemoryCoordinator,
    fence: MemoryFence,
    keys: Vec<LockKey>,
    resources: Vec<ResourceId>,
    /// (worker, key) -> (lease object, model id)
    held: HashMap<(usize, usize), (Box<dyn Lease>, usize)>,
    model: Model,
    t0: Instant,
    step: usize,
}

impl Harness {
    fn options(ttl: u64, margin_pct: Option<u64>) -> (LeaseOptions, Duration, Duration) {
        let ttl = ms(ttl);
        let mut opts = LeaseOptions::new(ttl);
        let margin = match margin_pct {
            Some(p) => {
                let m = ttl * p as u32 / 100;
                opts = opts.drift_margin(m);
                m
            }
            None => lease_core::adapter::clock::default_drift_margin(ttl),
        };
        (opts, ttl, margin)
    }

    fn install(&mut self, w: usize, k: usize, lease: Box<dyn Lease>, id: usize) {
        assert_eq!(lease.token().get(), self.model.leases[id].token);
        assert_eq!(lease.key(), &self.keys[k]);
        // Replacing drops the worker's older lease object for this key.
        if let Some((old, old_id)) = self.held.insert((w, k), (lease, id)) {
            self.model.drop_lease(old_id);
            drop(old);
        }
    }

    async fn fenced(&mut self, w: usize, k: usize, claim: bool) {
        let Some((lease, id)) = self.held.get(&(w, k)) else {
            return;
        };
        let (token, id) = (lease.token(), *id);
        let r = &self.resources[k];
        // (d), from the fence's own history: once a newer token was accepted, this one is stale.
        let newest_seen = self
            .fence
            .history()
            .iter()
            .filter_map(|e| match e {
                FenceEvent::Write {
                    resource, token, ..
                }
                | FenceEvent::Claim { resource, token }
                    if resource == r =>
                {
                    Some(*token)
                }
                _ => None,
            })
            .max();
        let result = if claim {
            self.fence.claim(r, token).await
        } else {
            let v = Bytes::from(format!("w{w}/s{}", self.step));
            self.fence.write(r, token, v).await
        };
        let expected = self.model.fence(k, token.get());
        match (&result, expected) {
            (Ok(a), Ok(prev)) => {
                assert_eq!(a.previous.map(|t| t.get()), prev);
                assert!(newest_seen.is_none_or(|n| token >= n));
            }
            (
                Err(Error::Stale {
                    presented, current, ..
                }),
                Err(cur),
            ) => {
                assert_eq!((*presented, current.get()), (token, cur));
                assert_eq!(Some(*current), newest_seen);
            }
            (r, e) => panic!("fence {claim:?} by lease {id} token {token}: got {r:?}, model {e:?}"),
        }
        if newest_seen.is_some_and(|n| token < n) {
            assert!(
                matches!(result, Err(Error::Stale { .. })),
                "a superseded holder's write must be rejected"
            );
        }
    }

    async fn apply(&mut self, op: &Op) {
        match *op {
            Op::Acquire {
                w,
                k,
                ttl,
                wait,
                margin_pct,
            } => {
                let (opts, ttl, margin) = Self::options(ttl, margin_pct);
                let wait = ms(wait);
                let r = self.coord.acquire(&self.keys[k], &opts.wait(wait)).await;
                self.model.expire(k);
                let grant_at = match self.model.keys[k].holder {
                    None => Some(self.model.now),
                    Some((_, e)) if e <= self.model.now + wait => Some(e),
                    Some(_) => None,
                };
                match (r, grant_at) {
                    (Ok(lease), Some(at)) => {
                        self.model.now = at;
                        self.model.expire(k);
                        let id = self.model.grant(k, ttl, margin);
                        self.install(w, k, lease, id);
                    }
                    (Err(Error::Timeout { waited, .. }), None) => {
                        assert_eq!(waited, wait);
                        self.model.now += wait;
                    }
                    (r, g) => panic!("acquire: got {r:?}, model grant at {g:?}"),
                }
                assert_eq!(self.coord.waiters(&self.keys[k]), 0);
            }
            Op::TryAcquire {
                w,
                k,
                ttl,
                margin_pct,
            } => {
                let (opts, ttl, margin) = Self::options(ttl, margin_pct);
                let r = self.coord.try_acquire(&self.keys[k], &opts).await;
                self.model.expire(k);
                match (r, self.model.keys[k].holder) {
                    (Ok(lease), None) => {
                        let id = self.model.grant(k, ttl, margin);
                        self.install(w, k, lease, id);
                    }
                    (Err(Error::Held { .. }), Some(_)) => {}
                    (r, h) => panic!("try_acquire: got {r:?}, model holder {h:?}"),
                }
            }
            Op::Renew { w, k } => {
                let Some((lease, id)) = self.held.get(&(w, k)) else {
                    return;
                };
                let id = *id;
                let r = lease.renew().await;
                if self.model.can_act(id) {
                    let until = r.unwrap_or_else(|e| panic!("renew of live lease {id}: {e}"));
                    let l = &mut self.model.leases[id];
                    l.valid_until = self.model.now + l.ttl.saturating_sub(l.margin);
                    assert_eq!(until - self.t0, l.valid_until);
                    let e = self.model.now + l.ttl;
                    self.model.keys[k].holder = Some((id, e));
                } else {
                    assert!(matches!(r, Err(Error::Lost { .. })), "{r:?}");
                    self.model.leases[id].marked_lost = true;
                }
            }
            Op::Release { w, k } => {
                let Some((lease, id)) = self.held.get(&(w, k)) else {
                    return;
                };
                let id = *id;
                let r = lease.release().await;
                if self.model.can_act(id) {
                    r.unwrap();
                } else {
                    assert!(matches!(r, Err(Error::Lost { .. })), "{r:?}");
                }
                self.model.drop_lease(id);
            }
            Op::Drop { w, k } => {
                if let Some((lease, id)) = self.held.remove(&(w, k)) {
                    drop(lease);
                    self.model.drop_lease(id);
                }
            }
            Op::Advance(d) => {
                tokio::time::advance(ms(d)).await;
                self.model.now += ms(d);
            }
            Op::Write { w, k } => self.fenced(w, k, false).await,
            Op::Claim { w, k } => self.fenced(w, k, true).await,
            Op::ForceRelease { k } => {
                let req = ForceRelease::new("model", "property test").unwrap();
                let removed = self.coord.force_release(&self.keys[k], &req).await.unwrap();
                self.model.expire(k);
                let expected = self.model.keys[k].holder.take();
                assert_eq!(
                    removed.as_ref().map(|h| h.token.get()),
                    expected.map(|(id, _)| self.model.leases[id].token)
                );
                if let Some((id, _)) = expected {
                    self.model.leases[id].marked_lost = true;
                }
            }
            Op::Pause { w, k, ms: d } => {
                tokio::time::advance(ms(d)).await;
                self.model.now += ms(d);
                self.fenced(w, k, false).await;
            }
        }
    }

    async fn check(&mut self) {
        assert_eq!(Instant::now() - self.t0, self.model.now, "time");
        for k in 0..self.keys.len() {
            // (a) at most one Held lease per key, and it is the one inspect shows.
            let mut held = Vec::new();
            for (&(_, lk), (lease, id)) in &self.held {
                if lk != k {
                    continue;
                }
                let status = lease.status();
                assert_eq!(
                    status == LeaseStatus::Held,
                    self.model.locally_held(*id),
                    "status of lease {id}: {status:?}"
                );
                if status == LeaseStatus::Held {
                    held.push(lease.token());
                }
            }
            assert!(
                held.len() <= 1,
                "two leases Held on {}: {held:?}",
                self.keys[k]
            );
            self.model.expire(k);
            let info = self.coord.inspect(&self.keys[k]).await.unwrap();
            let want = self.model.keys[k]
                .holder
                .map(|(id, e)| (self.model.leases[id].token, e - self.model.now));
            assert_eq!(
                info.as_ref()
                    .map(|h| (h.token.get(), h.expires_in.unwrap())),
                want,
                "inspect {}",
                self.keys[k]
            );
            if let Some(t) = held.first() {
                assert_eq!(info.as_ref().map(|h| h.token), Some(*t));
            }
            // (b) tokens strictly increase from 1.
            let issued = &self.model.keys[k].issued;
            assert!(issued.first().is_none_or(|t| *t == 1));
            assert!(issued.windows(2).all(|p| p[0] < p[1]));
            assert_eq!(
                self.coord.last_token(&self.keys[k]).map(|t| t.get()),
                issued.last().copied()
            );
            // (c) accepted fence tokens never decrease, and the fence agrees with the model.
            assert_eq!(self.fence.forgotten(), 0, "the fence's history is whole");
            let r = &self.resources[k];
            let accepted: Vec<u64> = self
                .fence
                .history()
                .iter()
                .filter_map(|e| match e {
                    FenceEvent::Write {
                        resource, token, ..
                    }
                    | FenceEvent::Claim { resource, token }
                        if resource == r =>
                    {
                        Some(token.get())
                    }
                    _ => None,
                })
                .collect();
            assert!(
                accepted.windows(2).all(|p| p[0] <= p[1]),
                "fence on {}: {accepted:?}",
                self.keys[k]
            );
            let newest = self.fence.read(r).await.unwrap().map(|v| v.newest.get());
            assert_eq!(newest, self.model.fence_newest[k]);
            assert_eq!(newest, accepted.last().copied());
            assert_eq!(self.coord.waiters(&self.keys[k]), 0);
        }
    }
}

fn run(nkeys: usize, nworkers: usize, ops: &[Op]) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let keys: Vec<LockKey> = KEYS[..nkeys].iter().map(|k| key(k)).collect();
        let mut h = Harness {
            coord: MemoryCoordinator::new(),
            fence: MemoryFence::with_history_limit(usize::MAX),
            resources: keys.iter().map(ResourceId::from).collect(),
            keys,
            held: HashMap::new(),
            model: Model::new(nkeys),
            t0: Instant::now(),
            step: 0,
        };
        for (i, op) in ops.iter().enumerate() {
            let op = remap(op, nkeys, nworkers);
            h.step = i;
            h.apply(&op).await;
            h.check().await;
        }
        // Dropping every lease leaves every key free (or expiring within its TTL).
        let ids: Vec<usize> = h
            .held
            .drain()
            .map(|(_, (l, id))| {
                drop(l);
                id
            })
            .collect();
        for id in ids {
            h.model.drop_lease(id);
        }
        h.check().await;
    });
}

fn remap(op: &Op, nkeys: usize, nworkers: usize) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Acquire { w, k, .. }
        | Op::TryAcquire { w, k, .. }
        | Op::Renew { w, k }
        | Op::Release { w, k }
        | Op::Drop { w, k }
        | Op::Write { w, k }
        | Op::Claim { w, k }
        | Op::Pause { w, k, .. } => {
            *w %= nworkers;
            *k %= nkeys;
        }
        Op::ForceRelease { k } => *k %= nkeys,
        Op::Advance(_) => {}
    }
    op
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn coordinator_and_fence_match_the_model(
        nkeys in 2..=3usize,
        nworkers in 3..=4usize,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        run(nkeys, nworkers, &ops);
    }
}

/// A fixed scenario through the same harness: the classic paused holder.
#[test]
fn paused_holder_scenario() {
    use Op::*;
    run(
        2,
        3,
        &[
            TryAcquire {
                w: 0,
                k: 0,
                ttl: 100,
                margin_pct: None,
            },
            Claim { w: 0, k: 0 },
            Write { w: 0, k: 0 },
            Pause { w: 0, k: 0, ms: 50 },
            // Worker 1 waits for the key and gets it at worker 0's expiry (t = 100).
            Acquire {
                w: 1,
                k: 0,
                ttl: 100,
                wait: 200,
                margin_pct: Some(10),
            },
            Claim { w: 1, k: 0 },
            // Worker 0 resumes and writes with its old token: Stale.
            Pause { w: 0, k: 0, ms: 10 },
            Renew { w: 0, k: 0 },
            Release { w: 0, k: 0 },
            Write { w: 1, k: 0 },
            ForceRelease { k: 0 },
            TryAcquire {
                w: 2,
                k: 0,
                ttl: 50,
                margin_pct: Some(0),
            },
            Write { w: 1, k: 0 },
            Write { w: 2, k: 0 },
            Drop { w: 2, k: 0 },
            Advance(30),
        ],
    );
}
