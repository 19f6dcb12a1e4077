//! [`RedisFence`]: a fenced store on Redis.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use lease_core::{Accepted, Bytes, Error, Fence, FencedValue, ResourceId, Result, Token};

use crate::client::Connection;
use crate::config::RedisConfig;
use crate::error::{bad_reply, ops, BACKEND};
use crate::keys::fence_key;
use crate::scripts::{self, reply};
use lease_core::adapter::{check_fence_value_len, Op};

/// A fenced store on Redis: each resource is a hash `<prefix>:{<resource>}:fence` holding the
/// newest accepted token, the last value and the token that wrote it.
///
/// `write` and `claim` are one script each: compare the presented token with the newest accepted
/// one and, if it is not older, record it (and the value) in the same atomic step; otherwise
/// return `Stale { presented, current }` and change nothing. `read` is one `HMGET`.
///
/// A write whose reply is not seen (no reply within the request timeout, or the connection
/// dropped after sending) returns `OutcomeUnknown` and is never re-sent by the fence: a blind
/// re-send could apply after a later write with the same token and replace its value. A claim
/// found on a dropped connection is re-sent once (a late claim cannot undo anything). Its
/// connection is ended on the server first (decision 0037); with replicas, the newest token is
/// then written again, unchanged, and waited for, so the message says whether a read now shows
/// what the write did on the replicas too, or only on the primary (then write again under a new
/// token).
///
/// The newest accepted token is as durable as the server: `connect` runs the same durability
/// check as the coordinator (`appendonly yes`, `appendfsync always`, `maxmemory-policy
/// noeviction`) and refuses a server that could forget it, unless the URL says
/// `volatile_tokens=true`. A fence that forgets its newest token accepts a stale holder's write.
/// On a primary with replicas, an accepted write or claim is reported only once `replica_acks`
/// replicas have it (`WAIT` in the same round trip, as a grant); fewer within half the request
/// timeout is `OutcomeUnknown`: applied on the primary, but a failover may still lose it.
///
/// Of a coordinator URL's options, those that only shape leases (`token_floor`, `owner`,
/// `poll_interval_ms`) are read and have no effect on a fence, so one URL can serve both.
///
/// Values are at most [`MAX_FENCE_VALUE_BYTES`]; a longer one is `InvalidInput`, nothing sent.
///
/// Cloning is cheap and shares the connection.
#[derive(Clone)]
pub struct RedisFence {
    conn: Arc<Connection>,
    config: Arc<RedisConfig>,
}

/// The longest value a [`RedisFence`] writes: Redis's default `proto-max-bulk-len` (512 MiB), the
/// most one argument of a command may hold. A longer one is refused with `InvalidInput` before
/// anything is sent: the server would answer it with a protocol error and close the connection,
/// leaving every other request in flight on it in doubt.
pub const MAX_FENCE_VALUE_BYTES: usize = 512 * 1024 * 1024;

impl fmt::Debug for RedisFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisFence")
            .field("url", self.config.url())
            .field("key_prefix", &self.config.key_prefix())
            .finish_non_exhaustive()
    }
}

impl RedisFence {
    /// Connects and checks durability (unless `volatile_tokens`). Errors as for
    /// [`crate::RedisCoordinator::connect`].
    pub async fn connect(config: RedisConfig) -> Result<Self> {
        let conn = Connection::open(&config).await?;
        Ok(Self::start(config, conn))
    }

    /// A fence that opens its connection with a redis-rs client the application already has
    /// (its own address, TLS and credentials); `config` gives the key prefix and timeouts.
    /// Connects and checks durability as [`RedisFence::connect`] does.
    pub async fn from_client(client: redis::Client, config: RedisConfig) -> Result<Self> {
        let conn = Connection::open_with(&config, client).await?;
        Ok(Self::start(config, conn))
    }

    fn start(config: RedisConfig, conn: Connection) -> Self {
        RedisFence {
            conn: Arc::new(conn),
            config: Arc::new(config),
        }
    }

    /// Parses `url` ([`RedisConfig::from_url`]) and connects.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(RedisConfig::from_url(url)?).await
    }

    /// The configuration (its `Debug` and `Display` redact the password).
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    async fn accept(
        &self,
        op: Op,
        resource: &ResourceId,
        token: Token,
        value: Option<&[u8]>,
    ) -> Result<Accepted> {
        let key = fence_key(self.config.key_prefix(), resource);
        let token_s = token.to_string();
        let (mode, value): (&[u8], &[u8]) = match value {
            Some(v) => (b"w", v),
            None => (b"c", b""),
        };
        let args = [token_s.as_bytes(), mode, value];
        // With replicas, an accepted write counts only once `replica_acks` of them have it: a
        // failover to one that missed it would take the resource back to an older token.
        let acks = self.conn.acks_for(self.config.replica_acks()).await?;
        let wait = self.config.request_timeout() / 2;
        let (v, acked) = if acks == 0 {
            (
                self.conn.eval(op, &scripts::FENCE, &[&key], &args).await?,
                0,
            )
        } else {
            self.conn
                .eval_and_wait(
                    op,
                    &scripts::FENCE,
                    &[&key],
                    &args,
                    acks,
                    wait,
                    // Writes `newest` again, unchanged (see `scripts::FENCE`).
                    Some(&[b"", b"s", b""]),
                )
                .await?
        };
        let items = reply::array(v).ok_or_else(|| bad_reply(op, "not an array"))?;
        let parse = |v: &redis::Value| -> Result<Option<Token>> {
            let s = reply::text(v).ok_or_else(|| bad_reply(op, "token is not text"))?;
            if s.is_empty() {
                return Ok(None);
            }
            s.parse()
                .map(Some)
                .map_err(|_| bad_reply(op, "stored token is not a number in range"))
        };
        match items.as_slice() {
            [flag, _] if reply::int(flag) == Some(1) && (acked as usize) < acks => {
                Err(Error::OutcomeUnknown {
                    backend: BACKEND,
                    operation: op.name,
                    message: format!(
                        "{resource} took token {token} on the primary, but {acked} of the {acks} \
                         replica(s) replica_acks asks for had it within {wait:?}: a failover \
                         may still lose it; write again under a new token"
                    ),
                    source: None,
                })
            }
            // Committed: whatever the hash held before is only reported. A `newest` written from
            // outside that no token can have is not an error of this write, which took effect.
            [flag, previous] if reply::int(flag) == Some(1) => {
                Ok(Accepted::new(parse(previous).unwrap_or_else(|e| {
                    tracing::warn!(%resource, error = %e, "the fence held no valid token before this write");
                    None
                })))
            }
            [flag, current] if reply::int(flag) == Some(0) => {
                let current = parse(current)?.ok_or_else(|| bad_reply(op, "no current token"))?;
                Err(Error::Stale {
                    resource: resource.to_string(),
                    presented: token,
                    current,
                })
            }
            _ => Err(bad_reply(op, "unexpected shape")),
        }
    }
}

#[async_trait]
impl Fence for RedisFence {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        check_fence_value_len(value.len(), MAX_FENCE_VALUE_BYTES)?;
        self.accept(ops::FENCE_WRITE, resource, token, Some(&value))
            .await
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        self.accept(ops::FENCE_CLAIM, resource, token, None).await
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        let key = fence_key(self.config.key_prefix(), resource);
        let op = ops::FENCE_READ;
        let key = key.as_str();
        let v: redis::Value = self
            .conn
            .run(op, |mut c| async move {
                redis::cmd("HMGET")
                    .arg(key)
                    .arg("newest")
                    .arg("vtoken")
                    .arg("value")
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let mut items = reply::array(v).ok_or_else(|| bad_reply(op, "not an array"))?;
        if items.len() != 3 {
            return Err(bad_reply(op, "unexpected shape"));
        }
        let value = items.pop().and_then(reply::bytes);
        let vtoken = items.pop().and_then(|v| reply::text(&v));
        let newest = items.pop().and_then(|v| reply::text(&v));
        let token = |s: Option<String>| -> Result<Option<Token>> {
            s.map(|s| {
                s.parse()
                    .map_err(|_| bad_reply(op, "stored token is not a number"))
            })
            .transpose()
        };
        let Some(newest) = token(newest)? else {
            return Ok(None);
        };
        let value = match (token(vtoken)?, value) {
            (Some(t), Some(v)) => Some((t, Bytes::from(v))),
            _ => None,
        };
        Ok(Some(FencedValue::new(newest, value)))
    }
}
