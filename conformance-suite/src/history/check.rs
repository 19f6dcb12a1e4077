//! The checker: [`check`] and what it reports.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use super::{FenceOutcome, Forced, Grant, History, Op, OpKind};

/// A safety property of a history. Throughout, "A precedes B" means A *completed* strictly
/// before B was *invoked* on the harness clock ([`Op::precedes`]); operations that overlap in
/// time are concurrent and ordered by nothing. "Accepted" means the fence answered
/// [`FenceOutcome::Accepted`]; unknown and failed calls are never accepted. All fence properties
/// are per resource, all lock properties per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Property {
    /// (a) No two acquisitions of one key were granted the same token, whatever their timing.
    UniqueTokens,
    /// (a) If a grant of token `t` precedes a grant of token `u` on the same key, `t < u`.
    TokenOrder,
    /// (b) If an accepted write with token `t` precedes an accepted write or claim with token
    /// `s` on the same resource, `t <= s`: the fence accepts in non-decreasing token order.
    FenceOrder,
    /// (c) If an accepted claim with token `t` precedes an accepted write or claim with token
    /// `s` on the same resource, `t <= s`: once a newer holder has claimed, no older holder's
    /// write is accepted.
    StaleAfterClaim,
    /// (d) If the fence rejected a call on a resource reporting `current = c` as its newest token,
    /// and that rejection precedes an accepted write or claim with token `s`, then `c <= s`.
    ///
    /// The rejection proves that a holder with token `c` had claimed or written the resource by
    /// the rejection's completion, even when that holder's own call is unknown or was never
    /// recorded (a worker process, a call whose reply was lost). Accepting an older holder after
    /// it means two holders' accepted-write intervals overlap after a claim: the older one kept
    /// writing into the newer one's tenure. (When the newer holder's claim or write is itself
    /// recorded as accepted, the same overlap is reported as (c) or (b).)
    OverlapAfterClaim,
    /// (e) If the holder of token `t` on a key saw its lease valid until `V` (the grant's
    /// `valid_until`, or a later [`OpKind::Valid`] observation: the latest counts), a grant of a
    /// larger token on that key completed before `V` only if `t`'s holder had invoked a release
    /// of `t`, or an operator had invoked a forced release of the key that removed `t` (or whose
    /// outcome is unknown), before that grant completed: no two holders believe they hold one
    /// key at once, unless a holder let go or was removed.
    ///
    /// Time limits how long others wait; this is the property that says the limit was kept. It
    /// is the promise of [`lease_core::Lease::valid_until`] to everyone else; a backend that
    /// does not keep it across a failover (Redis with Sentinel, whose replication is
    /// asynchronous) is checked without it there ([`check_except`]). A release or forced
    /// release is counted from its invocation whatever its outcome (it may have applied at
    /// once), so the property never blames a grant that a release might explain; a forced
    /// release whose outcome is unknown (or that never answered) excuses every holder of its key
    /// from then on, also those granted after its answer: a request that timed out may still be
    /// applied later, to whoever holds the key then. One that named the token it expected
    /// ([`lease_core::ForceRelease::expect_token`]) excuses that token's holder only: it
    /// removes that holder or nothing, whenever it applies.
    ExclusiveTenure,
}

impl Property {
    /// The property's short name, as printed: `(a) unique-tokens`, ...
    pub fn name(self) -> &'static str {
        match self {
            Property::UniqueTokens => "(a) unique-tokens",
            Property::TokenOrder => "(a) token-order",
            Property::FenceOrder => "(b) fence-order",
            Property::StaleAfterClaim => "(c) stale-after-claim",
            Property::OverlapAfterClaim => "(d) overlap-after-claim",
            Property::ExclusiveTenure => "(e) exclusive-tenure",
        }
    }
}

impl fmt::Display for Property {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed property, with the minimal excerpt of the history that shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which property failed.
    pub property: Property,
    /// One sentence: what the excerpt shows.
    pub explanation: String,
    /// Only the operations that form the violation (two, or three when (d) can also show the
    /// call that established the reported token), in id order.
    pub ops: Vec<Op>,
    /// The history's seed, if it had one.
    pub seed: Option<u64>,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "history violates {}: {}",
            self.property, self.explanation
        )?;
        match self.seed {
            Some(s) => write!(f, " (seed {s})")?,
            None => write!(f, " (no seed)")?,
        }
        for op in &self.ops {
            write!(f, "\n  {op}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Violation {}

/// What a passing history contained.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckSummary {
    /// Operations in the history.
    pub ops: usize,
    /// Acquisitions granted a token.
    pub grants: usize,
    /// Of those, the grants whose validity is known, so that (e) checks their tenure.
    pub tenures: usize,
    /// Claims the fence accepted.
    pub accepted_claims: usize,
    /// Writes the fence accepted.
    pub accepted_writes: usize,
    /// Claims and writes the fence rejected as stale.
    pub rejected: usize,
    /// Operations whose outcome is unknown (including those never completed).
    pub unknown: usize,
}

/// Checks every [`Property`] on `history`, in the order they are declared, and returns the first
/// violation found (with a minimal excerpt), or a summary if there is none.
///
/// Sound with respect to unknown outcomes: an unknown or failed call is never used as an
/// acceptance or a grant, so it cannot cause a violation, and a rejection's reported newest
/// token is used as evidence even when the call that set it is unknown ([`Property::OverlapAfterClaim`]).
/// Complete for the accepted calls: if no (b) or (c) violation is reported, the accepted claims
/// and writes of each resource can be ordered consistently with real time in non-decreasing
/// token order. Runs in `O(n log n)` for `n` operations.
pub fn check(history: &History) -> Result<CheckSummary, Violation> {
    check_except(history, &[])
}

/// [`check`], except the properties in `unpromised`: for a subject that does not promise them
/// in the run that made `history` (see [`Property::ExclusiveTenure`]).
pub fn check_except(history: &History, unpromised: &[Property]) -> Result<CheckSummary, Violation> {
    let ops = history.ops();
    let seed = history.seed();
    let violation = |property, explanation: String, mut excerpt: Vec<&Op>| {
        excerpt.sort_by_key(|o| o.id);
        excerpt.dedup_by_key(|o| o.id);
        Violation {
            property,
            explanation,
            ops: excerpt.into_iter().cloned().collect(),
            seed,
        }
    };
    let mut summary = CheckSummary {
        ops: ops.len(),
        ..CheckSummary::default()
    };
    // The facts the properties read, as (group, token, op).
    let mut grants = Vec::new();
    let mut accepted_writes = Vec::new();
    let mut accepted_claims = Vec::new();
    let mut rejections = Vec::new();
    // For (e), per (key, token): the latest validity its holder saw (at the grant or later,
    // while held), and the earliest instant something may have ended its tenure (a release's
    // or a forced release's invocation); per key, the earliest forced release that may have
    // removed whichever holder it found.
    let mut tenure: HashMap<(&str, u64), (Duration, &Op)> = HashMap::new();
    let mut excused: HashMap<(&str, u64), Duration> = HashMap::new();
    let mut any_removed: HashMap<&str, Duration> = HashMap::new();
    for op in &ops {
        match &op.kind {
            OpKind::Acquire {
                key,
                outcome,
                valid_until,
            } => match outcome {
                Grant::Granted(t) if op.completed.is_some() => {
                    grants.push((key, *t, op));
                    if let Some(v) = valid_until {
                        seen_valid(&mut tenure, key, *t, *v, op);
                    }
                }
                Grant::Granted(_) | Grant::Unknown(_) => summary.unknown += 1,
                Grant::Failed(_) => {}
            },
            OpKind::Valid {
                key,
                token,
                valid_until,
            } => seen_valid(&mut tenure, key, *token, *valid_until, op),
            OpKind::Renew { outcome, .. } => {
                if matches!(outcome, super::Done::Unknown(_)) || op.completed.is_none() {
                    summary.unknown += 1;
                }
            }
            OpKind::Release {
                key,
                token,
                outcome,
            } => {
                if matches!(outcome, super::Done::Unknown(_)) || op.completed.is_none() {
                    summary.unknown += 1;
                }
                earliest(&mut excused, (key, *token), op.invoked);
            }
            OpKind::ForceRelease {
                key,
                expected,
                outcome,
            } => {
                if matches!(outcome, Forced::Unknown(_)) || op.completed.is_none() {
                    summary.unknown += 1;
                }
                match (op.completed.is_some(), outcome, expected) {
                    (true, Forced::Removed(t), _) => earliest(&mut excused, (key, *t), op.invoked),
                    (true, Forced::NoneHeld | Forced::Failed(_), _) => {}
                    // Never answered, or answered without a word of what it removed, but it
                    // named its holder: that holder, or nobody, whenever it applies.
                    (false, _, Some(t)) | (true, Forced::Unknown(_), Some(t)) => {
                        earliest(&mut excused, (key, *t), op.invoked)
                    }
                    // Nor named one: any holder, also one granted after that answer (a request
                    // that timed out may still be applied later, to whoever holds the key then).
                    (false, _, None) | (true, Forced::Unknown(_), None) => {
                        earliest(&mut any_removed, key, op.invoked)
                    }
                }
            }
            OpKind::Lost { .. } => {}
            OpKind::Claim {
                resource,
                token,
                outcome,
            }
            | OpKind::Write {
                resource,
                token,
                outcome,
                ..
            } => {
                let is_claim = matches!(op.kind, OpKind::Claim { .. });
                match outcome {
                    // A call with no completion has no observed answer, whatever was recorded.
                    _ if op.completed.is_none() => summary.unknown += 1,
                    FenceOutcome::Accepted if is_claim => {
                        accepted_claims.push((resource, *token, op))
                    }
                    FenceOutcome::Accepted => accepted_writes.push((resource, *token, op)),
                    FenceOutcome::Rejected { current } => rejections.push((resource, *current, op)),
                    FenceOutcome::Unknown(_) => summary.unknown += 1,
                    FenceOutcome::Failed(_) => {}
                }
            }
        }
    }
    summary.grants = grants.len();
    summary.tenures = grants
        .iter()
        .filter(|(key, token, _)| tenure.contains_key(&(key.as_str(), *token)))
        .count();
    summary.accepted_claims = accepted_claims.len();
    summary.accepted_writes = accepted_writes.len();
    summary.rejected = rejections.len();

    // (a) unique tokens, whatever the timing.
    let mut seen: HashMap<(&String, u64), &Op> = HashMap::new();
    for &(key, token, op) in &grants {
        if unpromised.contains(&Property::UniqueTokens) {
            break;
        }
        if let Some(first) = seen.insert((key, token), op) {
            return Err(violation(
                Property::UniqueTokens,
                format!("token {token} on key {key} was granted twice"),
                vec![first, op],
            ));
        }
    }
    // (a) real-time order of grants: an earlier grant's token must be below a later one's.
    let promised = |p| !unpromised.contains(&p);
    let inversion = |p, earlier, later, bad: fn(u64, u64) -> bool| {
        if promised(p) {
            first_inversion(earlier, later, bad)
        } else {
            None
        }
    };
    if let Some((earlier, later)) = inversion(Property::TokenOrder, &grants, &grants, |e, l| e >= l)
    {
        return Err(violation(
            Property::TokenOrder,
            format!(
                "on key {}, token {} was granted after token {} had been granted",
                group_of(later),
                token_of(later),
                token_of(earlier)
            ),
            vec![earlier, later],
        ));
    }
    let accepted: Vec<_> = accepted_writes
        .iter()
        .chain(&accepted_claims)
        .copied()
        .collect();
    // (b) after an accepted write, nothing older is accepted.
    if let Some((earlier, later)) =
        inversion(Property::FenceOrder, &accepted_writes, &accepted, |e, l| {
            e > l
        })
    {
        return Err(violation(
            Property::FenceOrder,
            format!(
                "on resource {}, token {} was accepted after an accepted write with token {}",
                group_of(later),
                token_of(later),
                token_of(earlier)
            ),
            vec![earlier, later],
        ));
    }
    // (c) after an accepted claim, nothing older is accepted.
    if let Some((earlier, later)) = inversion(
        Property::StaleAfterClaim,
        &accepted_claims,
        &accepted,
        |e, l| e > l,
    ) {
        return Err(violation(
            Property::StaleAfterClaim,
            format!(
                "on resource {}, token {} was accepted after a claim with token {} had been accepted",
                group_of(later),
                token_of(later),
                token_of(earlier)
            ),
            vec![earlier, later],
        ));
    }
    // (d) after the fence reported `current = c`, nothing older than c is accepted.
    if let Some((rejection, later)) = inversion(
        Property::OverlapAfterClaim,
        &rejections,
        &accepted,
        |c, l| c > l,
    ) {
        let resource = group_of(later);
        let current = reported_current(rejection);
        // The call that set `current`, if recorded: any claim or write of that token invoked
        // before the rejection completed (accepted or unknown).
        let cause = ops.iter().find(|o| {
            fence_call(o).is_some_and(|(r, t)| r == resource && t == current)
                && rejection.completed.is_some_and(|c| o.invoked < c)
                && o.id != rejection.id
        });
        let mut excerpt = vec![rejection, later];
        excerpt.extend(cause);
        return Err(violation(
            Property::OverlapAfterClaim,
            format!(
                "on resource {resource}, token {} was accepted after the fence had reported token {current} as its newest",
                token_of(later),
            ),
            excerpt,
        ));
    }
    if !promised(Property::ExclusiveTenure) {
        return Ok(summary);
    }
    // (e) no grant while an earlier holder's validity lasts, unless it let go or was removed.
    // Per key, grants by token descending: the earliest completion among the larger tokens is
    // the only one each tenure needs to be compared with (if it is excused or after the
    // validity, every later one is too).
    let mut by_key: HashMap<&str, Vec<(u64, &Op)>> = HashMap::new();
    for &(key, token, op) in &grants {
        by_key.entry(key).or_default().push((token, op));
    }
    let mut keys: Vec<_> = by_key.into_iter().collect();
    keys.sort_by_key(|(key, _)| *key);
    for (key, mut held) in keys {
        held.sort_by_key(|&(token, op)| (std::cmp::Reverse(token), op.id));
        // The first completed grant among the larger tokens seen so far.
        let mut first_later: Option<(Duration, u64, &Op)> = None;
        let mut i = 0;
        while i < held.len() {
            // Grants of one token (possible only when (a) is left out) are compared with the
            // larger tokens only.
            let token = held[i].0;
            let same = held[i..].iter().take_while(|(t, _)| *t == token).count();
            if let (Some((granted, later_token, later)), Some(&(until, seen))) =
                (first_later, tenure.get(&(key, token)))
            {
                let excuse = [
                    excused.get(&(key, token)).copied(),
                    any_removed.get(key).copied(),
                ]
                .into_iter()
                .flatten()
                .min();
                if granted < until && excuse.is_none_or(|at| at >= granted) {
                    return Err(violation(
                        Property::ExclusiveTenure,
                        format!(
                            "on key {key}, token {later_token} was granted at {} while the \
                             holder of token {token} was still valid (until {}), and no release \
                             of token {token} nor a forced release that may have removed it had \
                             been invoked",
                            super::secs(granted),
                            super::secs(until),
                        ),
                        vec![held[i].1, seen, later],
                    ));
                }
            }
            for &(t, op) in &held[i..i + same] {
                if let Some(c) = op.completed {
                    if first_later.is_none_or(|(f, _, _)| c < f) {
                        first_later = Some((c, t, op));
                    }
                }
            }
            i += same;
        }
    }
    Ok(summary)
}

/// Records that the holder of `token` on `key` saw its lease valid until `until` (at `op`): a
/// tenure lasts at least until the latest such instant.
fn seen_valid<'a>(
    tenure: &mut HashMap<(&'a str, u64), (Duration, &'a Op)>,
    key: &'a str,
    token: u64,
    until: Duration,
    op: &'a Op,
) {
    let entry = tenure.entry((key, token)).or_insert((until, op));
    if until > entry.0 {
        *entry = (until, op);
    }
}

/// Records that something may have ended a tenure at `at`: `map` keeps the earliest instant
/// per `key`.
fn earliest<K: std::hash::Hash + Eq>(map: &mut HashMap<K, Duration>, key: K, at: Duration) {
    let entry = map.entry(key).or_insert(at);
    *entry = (*entry).min(at);
}

fn group_of(op: &Op) -> &str {
    match &op.kind {
        OpKind::Acquire { key, .. }
        | OpKind::Renew { key, .. }
        | OpKind::Release { key, .. }
        | OpKind::Lost { key, .. }
        | OpKind::Valid { key, .. }
        | OpKind::ForceRelease { key, .. } => key,
        OpKind::Claim { resource, .. } | OpKind::Write { resource, .. } => resource,
    }
}

fn token_of(op: &Op) -> u64 {
    match &op.kind {
        OpKind::Acquire { outcome, .. } => match outcome {
            Grant::Granted(t) => *t,
            _ => 0,
        },
        OpKind::ForceRelease { .. } => 0,
        OpKind::Renew { token, .. }
        | OpKind::Release { token, .. }
        | OpKind::Lost { token, .. }
        | OpKind::Valid { token, .. }
        | OpKind::Claim { token, .. }
        | OpKind::Write { token, .. } => *token,
    }
}

fn reported_current(op: &Op) -> u64 {
    match &op.kind {
        OpKind::Claim {
            outcome: FenceOutcome::Rejected { current },
            ..
        }
        | OpKind::Write {
            outcome: FenceOutcome::Rejected { current },
            ..
        } => *current,
        _ => token_of(op),
    }
}

fn fence_call(op: &Op) -> Option<(&str, u64)> {
    match &op.kind {
        OpKind::Claim {
            resource,
            token,
            outcome,
        }
        | OpKind::Write {
            resource,
            token,
            outcome,
            ..
        } if matches!(outcome, FenceOutcome::Accepted | FenceOutcome::Unknown(_)) => {
            Some((resource, *token))
        }
        _ => None,
    }
}

/// The first pair (earliest `later` by invocation) with `e` in `earlier`, `l` in `later`, the
/// same group, `e` preceding `l` and `bad(token_e, token_l)`, where `bad` must be monotone in
/// `token_e` (if it holds for some token it holds for every larger one). Sweeps both lists in
/// time order keeping, per group, the largest token among the earlier operations completed so
/// far: `O(n log n)`.
fn first_inversion<'a>(
    earlier: &[(&'a String, u64, &'a Op)],
    later: &[(&'a String, u64, &'a Op)],
    bad: impl Fn(u64, u64) -> bool,
) -> Option<(&'a Op, &'a Op)> {
    let mut done: Vec<(Duration, &String, u64, &Op)> = earlier
        .iter()
        .filter_map(|&(g, t, op)| op.completed.map(|c| (c, g, t, op)))
        .collect();
    done.sort_by_key(|&(c, _, t, op)| (c, t, op.id));
    let mut next: Vec<_> = later.to_vec();
    next.sort_by_key(|&(_, t, op)| (op.invoked, t, op.id));
    let mut max: HashMap<&String, (u64, &Op)> = HashMap::new();
    let mut i = 0;
    for (g, t, op) in next {
        while i < done.len() && done[i].0 < op.invoked {
            let (_, dg, dt, dop) = done[i];
            let entry = max.entry(dg).or_insert((dt, dop));
            if dt > entry.0 {
                *entry = (dt, dop);
            }
            i += 1;
        }
        if let Some(&(mt, mop)) = max.get(g) {
            if mop.id != op.id && bad(mt, t) {
                return Some((mop, op));
            }
        }
    }
    None
}
