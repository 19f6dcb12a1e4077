//! The in-memory [`Fence`].

use std::collections::HashMap;
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

#[derive(Default)]
struct State {
    resources: HashMap<ResourceId, FencedValue>,
    history: Vec<FenceEvent>,
}

/// A fenced in-memory store: the check and the write happen under one lock, so they are one
/// atomic step.
///
/// Not durable: it forgets everything with the process. It also records every accepted operation
/// in order ([`MemoryFence::history`]) so tests can check that no accepted write came from a
/// superseded holder. Cloning is cheap and shares the store.
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
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every accepted write and claim, in the order they were accepted.
    pub fn history(&self) -> Vec<FenceEvent> {
        self.lock().history.clone()
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
        st.history.push(event);
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
