//! How a worker *process* reports its operations to the harness, which timestamps them.
//!
//! A worker prints one line per completed operation on its stdout; the harness reads the lines
//! as they arrive and hands each to a [`WorkerFeed`], which records it with the harness clock.
//! The grammar ([`encode`] / [`decode`]), strings hex-encoded so that any key, resource or value
//! fits on one line:
//!
//! ```text
//! HIST acquire <key-hex> granted <token> [valid-us <micros>] | failed <text-hex> | unknown <text-hex>
//! HIST force-release <key-hex> [expecting <token>] removed <token> | none | failed <text-hex> | unknown <text-hex>
//! HIST renew   <key-hex> <token> ok | failed <text-hex> | unknown <text-hex>
//! HIST release <key-hex> <token> ok | failed <text-hex> | unknown <text-hex>
//! HIST lost    <key-hex> <token>
//! HIST valid   <key-hex> <token> <micros>
//! HIST claim   <resource-hex> <token> accepted | rejected <current> | failed <text-hex> | unknown <text-hex>
//! HIST write   <resource-hex> <token> <value-hex> accepted | rejected <current> | failed <text-hex> | unknown <text-hex>
//! ```
//!
//! A process has no harness clock, so on a line a validity (an acquisition's `valid_until`, a
//! [`OpKind::Valid`]'s) is the validity the lease had *left* when the line was printed, in
//! microseconds rounded down: [`encode`] writes and [`decode`] returns the field as that, and
//! only [`WorkerFeed::feed`] adds its floor (see below), which is no later than the print, so
//! the recorded end is no later than the true one. [`encode`] writes no validity for an
//! acquisition that was not granted.
//!
//! # Timestamps
//!
//! The completion instant is the line's receipt, which is after the worker printed it, so after
//! the operation completed: a sound (late) completion. The invocation instant must be a sound
//! (early) bound too, and the receipt of an earlier line is *not* one (the worker may have started
//! the next call before the harness read the previous line). So the feed uses a **floor**: the
//! instant the worker was spawned ([`WorkerFeed::new`]) or, for a worker that waits for a
//! go-ahead on its stdin before each call, the instant the harness sent it
//! ([`WorkerFeed::permit`]). Without a go-ahead every call of the worker is recorded as invoked
//! at spawn: weaker ordering (fewer pairs are ordered), never a false violation.
//!
//! The suite's worker process ([`crate::worker`]) does not print these lines;
//! [`WorkerFeed::feed_legacy`] reads its protocol (`ACQUIRED <token> <valid-ms> <at-ms>`,
//! `RELEASING <at-ms>`, `RELEASE OK|LOST|ERR ...`) into acquisitions and releases, leaving its
//! claims and writes to a [`super::HistoryFence`] at the fence server.

use std::time::Duration;

use lease_core::Bytes;

use super::{Done, FenceOutcome, Forced, Grant, OpKind, Recorder};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 {
        return Err(format!("odd hex length in {s:?}"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            s.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad hex {s:?}"))
        })
        .collect()
}

fn text(s: &str) -> Result<String, String> {
    String::from_utf8(unhex(s)?).map_err(|e| e.to_string())
}

/// The line (without newline) for one completed operation.
pub fn encode(kind: &OpKind) -> String {
    let done = |d: &Done| match d {
        Done::Ok => "ok".to_owned(),
        Done::Failed(e) => format!("failed {}", hex(e.as_bytes())),
        Done::Unknown(e) => format!("unknown {}", hex(e.as_bytes())),
    };
    let fence = |o: &FenceOutcome| match o {
        FenceOutcome::Accepted => "accepted".to_owned(),
        FenceOutcome::Rejected { current } => format!("rejected {current}"),
        FenceOutcome::Failed(e) => format!("failed {}", hex(e.as_bytes())),
        FenceOutcome::Unknown(e) => format!("unknown {}", hex(e.as_bytes())),
    };
    match kind {
        OpKind::Acquire {
            key,
            outcome,
            valid_until,
        } => {
            let o = match (outcome, valid_until) {
                (Grant::Granted(t), Some(left)) => {
                    format!("granted {t} valid-us {}", left.as_micros())
                }
                (Grant::Granted(t), None) => format!("granted {t}"),
                (Grant::Failed(e), _) => format!("failed {}", hex(e.as_bytes())),
                (Grant::Unknown(e), _) => format!("unknown {}", hex(e.as_bytes())),
            };
            format!("HIST acquire {} {o}", hex(key.as_bytes()))
        }
        OpKind::ForceRelease {
            key,
            expected,
            outcome,
        } => {
            let expecting = expected.map_or_else(String::new, |t| format!(" expecting {t}"));
            let o = match outcome {
                Forced::Removed(t) => format!("removed {t}"),
                Forced::NoneHeld => "none".to_owned(),
                Forced::Failed(e) => format!("failed {}", hex(e.as_bytes())),
                Forced::Unknown(e) => format!("unknown {}", hex(e.as_bytes())),
            };
            format!("HIST force-release {}{expecting} {o}", hex(key.as_bytes()))
        }
        OpKind::Renew {
            key,
            token,
            outcome,
        } => format!(
            "HIST renew {} {token} {}",
            hex(key.as_bytes()),
            done(outcome)
        ),
        OpKind::Release {
            key,
            token,
            outcome,
        } => format!(
            "HIST release {} {token} {}",
            hex(key.as_bytes()),
            done(outcome)
        ),
        OpKind::Lost { key, token } => format!("HIST lost {} {token}", hex(key.as_bytes())),
        OpKind::Valid {
            key,
            token,
            valid_until,
        } => format!(
            "HIST valid {} {token} {}",
            hex(key.as_bytes()),
            valid_until.as_micros()
        ),
        OpKind::Claim {
            resource,
            token,
            outcome,
        } => format!(
            "HIST claim {} {token} {}",
            hex(resource.as_bytes()),
            fence(outcome)
        ),
        OpKind::Write {
            resource,
            token,
            value,
            outcome,
        } => format!(
            "HIST write {} {token} {} {}",
            hex(resource.as_bytes()),
            hex(value),
            fence(outcome)
        ),
    }
}

/// Parses a line made by [`encode`]. `Ok(None)` for a line that is not a history line (does not
/// start with `HIST `), so that history lines can share stdout with other output.
pub fn decode(line: &str) -> Result<Option<OpKind>, String> {
    let Some(rest) = line.trim_end().strip_prefix("HIST ") else {
        return Ok(None);
    };
    let p: Vec<&str> = rest.split(' ').collect();
    let at = |i: usize| p.get(i).copied().ok_or(format!("short line {line:?}"));
    let token = |i: usize| -> Result<u64, String> {
        at(i)?.parse().map_err(|_| format!("bad token in {line:?}"))
    };
    let tail = |i: usize| -> Result<(&str, Option<&str>), String> {
        if p.len() > i + 2 {
            return Err(format!("trailing fields in {line:?}"));
        }
        Ok((at(i)?, p.get(i + 1).copied()))
    };
    let done = |i: usize| -> Result<Done, String> {
        Ok(match tail(i)? {
            ("ok", None) => Done::Ok,
            ("failed", Some(e)) => Done::Failed(text(e)?),
            ("unknown", Some(e)) => Done::Unknown(text(e)?),
            _ => return Err(format!("bad outcome in {line:?}")),
        })
    };
    let fence = |i: usize| -> Result<FenceOutcome, String> {
        Ok(match tail(i)? {
            ("accepted", None) => FenceOutcome::Accepted,
            ("rejected", Some(c)) => FenceOutcome::Rejected {
                current: c.parse().map_err(|_| format!("bad token in {line:?}"))?,
            },
            ("failed", Some(e)) => FenceOutcome::Failed(text(e)?),
            ("unknown", Some(e)) => FenceOutcome::Unknown(text(e)?),
            _ => return Err(format!("bad outcome in {line:?}")),
        })
    };
    let kind = match at(0)? {
        "acquire" if at(2)? == "granted" && p.len() > 4 => match (p.len(), at(4)?) {
            (6, "valid-us") => OpKind::Acquire {
                key: text(at(1)?)?,
                outcome: Grant::Granted(token(3)?),
                valid_until: Some(Duration::from_micros(
                    at(5)?
                        .parse()
                        .map_err(|_| format!("bad validity in {line:?}"))?,
                )),
            },
            _ => return Err(format!("bad grant in {line:?}")),
        },
        "acquire" => OpKind::Acquire {
            key: text(at(1)?)?,
            outcome: match tail(2)? {
                ("granted", Some(t)) => {
                    Grant::Granted(t.parse().map_err(|_| format!("bad token in {line:?}"))?)
                }
                ("failed", Some(e)) => Grant::Failed(text(e)?),
                ("unknown", Some(e)) => Grant::Unknown(text(e)?),
                _ => return Err(format!("bad outcome in {line:?}")),
            },
            valid_until: None,
        },
        "force-release" => {
            let (expected, o) = match at(2)? {
                "expecting" => (Some(token(3)?), 4),
                _ => (None, 2),
            };
            OpKind::ForceRelease {
                key: text(at(1)?)?,
                expected,
                outcome: match tail(o)? {
                    ("removed", Some(t)) => {
                        Forced::Removed(t.parse().map_err(|_| format!("bad token in {line:?}"))?)
                    }
                    ("none", None) => Forced::NoneHeld,
                    ("failed", Some(e)) => Forced::Failed(text(e)?),
                    ("unknown", Some(e)) => Forced::Unknown(text(e)?),
                    _ => return Err(format!("bad outcome in {line:?}")),
                },
            }
        }
        "renew" => OpKind::Renew {
            key: text(at(1)?)?,
            token: token(2)?,
            outcome: done(3)?,
        },
        "release" => OpKind::Release {
            key: text(at(1)?)?,
            token: token(2)?,
            outcome: done(3)?,
        },
        "valid" if p.len() == 4 => OpKind::Valid {
            key: text(at(1)?)?,
            token: token(2)?,
            valid_until: Duration::from_micros(
                at(3)?
                    .parse()
                    .map_err(|_| format!("bad validity in {line:?}"))?,
            ),
        },
        "lost" if p.len() == 3 => OpKind::Lost {
            key: text(at(1)?)?,
            token: token(2)?,
        },
        "claim" => OpKind::Claim {
            resource: text(at(1)?)?,
            token: token(2)?,
            outcome: fence(3)?,
        },
        "write" => OpKind::Write {
            resource: text(at(1)?)?,
            token: token(2)?,
            value: Bytes::from(unhex(at(3)?)?),
            outcome: fence(4)?,
        },
        _ => return Err(format!("unknown history line {line:?}")),
    };
    Ok(Some(kind))
}

/// The harness's reader of one worker process's lines: timestamps each on receipt.
#[derive(Debug, Clone)]
pub struct WorkerFeed {
    recorder: Recorder,
    /// The feed's creation, which the worker's reported instants count from.
    spawned: Duration,
    /// The same instant on the machine's monotonic clock, for the worker
    /// ([`WorkerFeed::clock_zero`]).
    clock_zero: Duration,
    floor: Duration,
    key: String,
    token: Option<u64>,
    /// When the worker said it was about to release (`RELEASING`), until it said how it went.
    releasing: Option<Duration>,
}

impl WorkerFeed {
    /// A feed for a worker spawned now, recording with `recorder` (label it with the PID).
    /// `key` is the lock key the worker was given, for [`WorkerFeed::feed_legacy`].
    /// Create it *before* spawning: its creation instant is the invocation floor.
    pub fn new(recorder: Recorder, key: impl Into<String>) -> WorkerFeed {
        let floor = recorder.history().now();
        let clock_zero = lease_testkit::process::monotonic_now();
        WorkerFeed {
            recorder,
            spawned: floor,
            clock_zero,
            floor,
            key: key.into(),
            token: None,
            releasing: None,
        }
    }

    /// The feed's creation on the machine's monotonic clock
    /// ([`lease_testkit::process::monotonic_now`]): give it to the worker
    /// (`--clock-zero-ns`, [`crate::worker`]) so that the instants it reports count from the
    /// feed's creation, not from its own later start.
    pub fn clock_zero(&self) -> Duration {
        self.clock_zero
    }

    /// Raises the invocation floor to now: call it just before sending the worker a go-ahead
    /// for its next operation (the worker must not start that operation before reading it).
    pub fn permit(&mut self) {
        self.floor = self.recorder.history().now();
    }

    /// Records a [`encode`]d line, invoked at the floor and completed now (a grant's validity
    /// left is added to the floor). `Ok(false)` for a line that is not a history line; `Err` for
    /// a malformed one (nothing recorded).
    pub fn feed(&mut self, line: &str) -> Result<bool, String> {
        match decode(line)? {
            Some(mut kind) => {
                match &mut kind {
                    OpKind::Acquire {
                        valid_until: Some(left),
                        ..
                    }
                    | OpKind::Valid {
                        valid_until: left, ..
                    } => *left += self.floor,
                    _ => {}
                }
                let now = self.recorder.history().now();
                self.recorder.record(self.floor, Some(now), kind);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Records a line of the suite's worker protocol ([`crate::worker`]), whose instants are
    /// milliseconds since the feed's creation, given to the worker as [`WorkerFeed::clock_zero`]
    /// (a worker not given it counts from its own start, which is later, so its instants are
    /// read as earlier than they were; never from a [`WorkerFeed::permit`], which may be later):
    /// `ACQUIRED <token> <valid-ms> <at-ms>` as a grant on the feed's key (invoked at the
    /// floor), valid until the creation plus `at-ms` plus `valid-ms` (the validity left when it
    /// looked); `RELEASING <at-ms>` as the instant it was about to release; `RELEASE OK` /
    /// `RELEASE LOST` / `RELEASE ERR <message>` as a release of the token (ok / failed /
    /// unknown), invoked at that instant (at the creation without one). An `ACQUIRED` line
    /// without `at-ms` counts its validity from the creation, one without `valid-ms` records
    /// none. Other lines (`WRITE ...`, whose fence calls a [`super::HistoryFence`] at the
    /// fence server records with tighter instants) are ignored: `Ok(false)`.
    pub fn feed_legacy(&mut self, line: &str) -> Result<bool, String> {
        let line = line.trim_end();
        let now = self.recorder.history().now();
        let ms = |field: &str| -> Result<Duration, String> {
            field
                .parse()
                .map(Duration::from_millis)
                .map_err(|_| format!("bad milliseconds {field:?} in {line:?}"))
        };
        // An instant the worker reports was before the line came: a later one means the two
        // processes do not share the clock (another time namespace, say), and nothing it
        // reports can be placed.
        let at = |field: &str| -> Result<Duration, String> {
            let at = self.spawned + ms(field)?;
            if at > now {
                return Err(format!(
                    "{line:?} names an instant {:?} after the line was read: the worker's clock \
                     is not the harness's",
                    at - now
                ));
            }
            Ok(at)
        };
        if let Some(grant) = line.strip_prefix("ACQUIRED ") {
            let fields: Vec<&str> = grant.split(' ').collect();
            let t: u64 = fields[0]
                .parse()
                .map_err(|_| format!("bad token in {line:?}"))?;
            let valid_until = match fields[1..] {
                [] => None,
                [left] => Some(self.spawned + ms(left)?),
                [left, when] => Some(at(when)? + ms(left)?),
                _ => return Err(format!("trailing fields in {line:?}")),
            };
            self.token = Some(t);
            self.recorder.record(
                self.floor,
                Some(now),
                OpKind::Acquire {
                    key: self.key.clone(),
                    outcome: Grant::Granted(t),
                    valid_until,
                },
            );
            return Ok(true);
        }
        if let Some(at_ms) = line.strip_prefix("RELEASING ") {
            if self.token.is_none() {
                return Err(format!("{line:?} before ACQUIRED"));
            }
            self.releasing = Some(at(at_ms)?);
            return Ok(false);
        }
        if let Some(r) = line.strip_prefix("RELEASE ") {
            let Some(token) = self.token else {
                return Err(format!("{line:?} before ACQUIRED"));
            };
            let outcome = match r {
                "OK" => Done::Ok,
                "LOST" => Done::Failed("lost".into()),
                e => Done::Unknown(e.trim_start_matches("ERR ").to_owned()),
            };
            let invoked = self.releasing.take().unwrap_or(self.spawned);
            self.recorder.record(
                invoked,
                Some(now),
                OpKind::Release {
                    key: self.key.clone(),
                    token,
                    outcome,
                },
            );
            return Ok(true);
        }
        Ok(false)
    }

    /// The worker is gone and every line it printed was fed: a release it started
    /// (`RELEASING`) but never reported is recorded as never completed (it may have applied).
    pub fn end(mut self) {
        if let (Some(invoked), Some(token)) = (self.releasing.take(), self.token) {
            self.recorder.record(
                invoked,
                None,
                OpKind::Release {
                    key: self.key.clone(),
                    token,
                    outcome: Done::Unknown(
                        "the worker ended before it reported the release".into(),
                    ),
                },
            );
        }
    }
}
