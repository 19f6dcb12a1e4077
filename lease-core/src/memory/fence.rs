//! The in-memory [`Fence`].

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::{Error, Result};
use crate::fence::{Accepted, Fence, FencedValue};
use crate::key::ResourceId;
use crate::token::Token;

/// One accepted operation, as recorded in [`MemoryFence::history`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum FenceEvent {
    /// A write was accepted.
    Write {
        /// The resource.
        resource: ResourceId,
        /// Its token.
        token: Token,
        /// The value written.
        value: Bytes,
    },
    /// A claim was accepted.
    Claim {
        /// The resource.
        resource: ResourceId,
        /// Its token.
        token: Token,
    },
}

/// How many accepted operations a [`MemoryFence`] remembers by default
/// ([`MemoryFence::history`]).
pub const DEFAULT_HISTORY_LIMIT: usize = 10_000;

struct State {
    resources: HashMap<ResourceId, FencedValue>,
    history: VecDeque<FenceEvent>,
    limit: usize,
    /// Events dropped from the front of `history` to keep it within `limit`.
    forgotten: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            resources: HashMap::new(),
            history: VecDeque::new(),
            limit: DEFAULT_HISTORY_LIMIT,
            forgotten: 0,
        }
    }
}

/// A fenced in-memory store: the check and the write happen under one lock, so they are one
/// atomic step.
///
/// Not durable: it forgets everything with the process. It also records the accepted
/// operations in order ([`MemoryFence::history`]) so tests can check that no accepted write came
/// from a superseded holder: the newest [`DEFAULT_HISTORY_LIMIT`] of them (or the limit given
/// to [`MemoryFence::with_history_limit`]), so that a long-running process does not keep every
/// value it was ever sent. Cloning is cheap and shares the store.
#[derive(Clone, Default)]
pub struct MemoryFence {
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for MemoryFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryFence")
            .field("resources", &self.lock().resources.len())
            .finish()
    }
}

impl MemoryFence {
    /// An empty store that remembers the newest [`DEFAULT_HISTORY_LIMIT`] accepted operations.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store that remembers the newest `limit` accepted operations (`0`: none). The
    /// fenced values themselves are kept whatever the limit.
    pub fn with_history_limit(limit: usize) -> Self {
        let fence = Self::default();
        fence.lock().limit = limit;
        fence
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The newest accepted writes and claims (at most the history limit), in the order they
    /// were accepted. [`MemoryFence::forgotten`] says how many older ones were dropped.
    pub fn history(&self) -> Vec<FenceEvent> {
        self.lock().history.iter().cloned().collect()
    }

    /// How many accepted operations were dropped from the front of the history to keep it
    /// within its limit: `0` means [`MemoryFence::history`] is complete.
    pub fn forgotten(&self) -> u64 {
        self.lock().forgotten
    }

    fn accept(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Option<Bytes>,
    ) -> Result<Accepted> {
        let mut st = self.lock();
        let previous = st.resources.get(resource).map(|v| v.newest);
        if let Some(current) = previous {
            if token < current {
                return Err(Error::Stale {
                    resource: resource.to_string(),
                    presented: token,
                    current,
                });
            }
        }
        let entry = st
            .resources
            .entry(resource.clone())
            .or_insert_with(|| FencedValue::new(token, None));
        entry.newest = token;
        let event = match value {
            Some(v) => {
                entry.value = Some((token, v.clone()));
                FenceEvent::Write {
                    resource: resource.clone(),
                    token,
                    value: v,
                }
            }
            None => FenceEvent::Claim {
                resource: resource.clone(),
                token,
            },
        };
        if st.limit > 0 {
            if st.history.len() == st.limit {
                st.history.pop_front();
                st.forgotten += 1;
            }
            st.history.push_back(event);
        } else {
            st.forgotten += 1;
        }
        Ok(Accepted::new(previous))
    }
}

#[async_trait]
impl Fence for MemoryFence {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        self.accept(resource, token, Some(value))
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        self.accept(resource, token, None)
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        Ok(self.lock().resources.get(resource).cloned())
    }
}
