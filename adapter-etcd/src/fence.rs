//! [`EtcdFence`]: a fenced resource stored in etcd.
//!
//! Each resource has two keys under `<prefix>/fence/<encoded resource>/`: `newest`, the newest
//! accepted token as 20 decimal digits (so etcd's byte-wise value comparison orders tokens
//! numerically), and `value`, the last written value prefixed by its token. A write or claim is
//! one transaction:
//!
//! ```text
//! if value(newest) > presented          (false when `newest` does not exist yet)
//! then get(newest)                      -> Stale { presented, current }
//! else get(newest), put(newest, presented) [, put(value, presented:bytes)]
//! ```
//!
//! The comparison and the write are one atomic step, and the newest token is as durable as
//! etcd's data.
//!
//! A write's transaction is nested in one that requires the write's own marker
//! ([`keys::retired_write_key`]) to be absent. When the write gets no answer, the fence puts
//! that marker (on a new connection, attached to a lease of [`RETIRED_TTL`]) before it returns
//! `OutcomeUnknown`: once the marker is written, a copy of the write that reaches etcd later
//! (a stalled path delivering it, a proposal applied after the client gave up) writes nothing,
//! so a read then shows everything the write did, and a write made after it is never replaced.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use lease_core::adapter::{check_fence_value_len, Backoff, Op};
use lease_core::{Accepted, Error, Fence, FencedValue, ResourceId, Result, Token};

use crate::config::EtcdConfig;
use crate::error::{retry_unapplied, Failure, BACKEND};
use crate::keys;

/// The longest value an [`EtcdFence`] writes: 1 MiB, leaving room for the rest of the
/// transaction under etcd's default request limit (`--max-request-bytes`, 1.5 MiB). A longer
/// one is refused with `InvalidInput` before anything is sent. (A server configured with a
/// lower limit refuses a large write itself, `etcdserver: request is too large`, before
/// proposing it: `Misconfigured`, nothing applied.)
pub const MAX_FENCE_VALUE_BYTES: usize = 1024 * 1024;

/// A [`Fence`] whose state lives in etcd (see the module docs for the layout and transaction).
///
/// Reads and claims that fail are retried a few times (a claim is idempotent, and one applied
/// late changes nothing): up to four tries of one request timeout each, with pauses of at most
/// 0.7 s in all between them, so such a call can take about four request timeouts.
///
/// A **write** is sent again only when it certainly did not apply (connection refused, or
/// refused by etcd before proposing it: `etcdserver: no leader`), within the same bound. A write
/// whose answer was lost (no answer within the request timeout, a stream broken after sending)
/// is never sent again: a blind retry could apply after a later write with the same token and
/// replay the older value. It is retired instead (see the module docs), which takes up to a
/// connect timeout plus two request timeouts more, and then returns `Error::OutcomeUnknown`,
/// saying whether it was retired: if so, a read shows which value stands and a write made after
/// it is never replaced by the lost one; if not (etcd unreachable), the lost write may still
/// apply later, so write again under a newer token. A write whose future is dropped while a send
/// may be on its way is retired in the background. A write refused as too large (a server whose
/// `--max-request-bytes` is below [`MAX_FENCE_VALUE_BYTES`] plus the transaction) is
/// `Misconfigured`, not sent again.
///
/// Besides `<prefix>/fence/`, the fence's etcd user needs read and write on
/// `<prefix>/fence-retired/`, and to grant leases (as a coordinator's user does).
///
/// Values are at most [`MAX_FENCE_VALUE_BYTES`]; a longer one is `InvalidInput`, nothing sent.
#[derive(Clone)]
pub struct EtcdFence {
    client: Client,
    config: Arc<EtcdConfig>,
    /// This fence's writes: a random id for the fence, and the number of its next write (each
    /// write has its own retirement marker).
    writes: Arc<(u64, AtomicU64)>,
}

/// How long a retired write's marker lives: a copy of the write delivered later than this could
/// still apply. Far beyond the time TCP keeps retransmitting unsent data after a connection is
/// given up (about 15 minutes with Linux's defaults) and etcd's own budget for applying a
/// proposal (seconds).
pub(crate) const RETIRED_TTL: Duration = Duration::from_secs(3600);

impl fmt::Debug for EtcdFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdFence")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

const NEWEST: &str = "newest";
const VALUE: &str = "value";
const ATTEMPTS: u32 = 4;

/// Which failures [`EtcdFence::retrying`] sends again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Any failure: reads, and claims (a claim applied twice, or late, changes nothing: it only
    /// raises `newest` to a token that is already there or refuses).
    Always,
    /// Only a request that certainly did not apply (never reached etcd, or refused before
    /// being proposed): a write applied late after a newer write with the same token would
    /// replace the newer value with the older one.
    UnlessSent,
}

fn parse_token(raw: &[u8]) -> Option<Token> {
    std::str::from_utf8(raw).ok()?.parse().ok()
}

fn parse_value(raw: &[u8]) -> Option<(Token, Bytes)> {
    let colon = raw.iter().position(|b| *b == b':')?;
    Some((
        parse_token(&raw[..colon])?,
        Bytes::copy_from_slice(&raw[colon + 1..]),
    ))
}

impl EtcdFence {
    /// Connects to the cluster `config` names (as [`crate::EtcdCoordinator::connect`]: lazily,
    /// except that credentials and a TLS handshake are checked now).
    pub async fn connect(config: EtcdConfig) -> Result<Self> {
        let client = crate::client::client_for(&config).await?;
        Ok(Self::from_client(client, config))
    }

    /// A fence on a client the application already has; `config` gives the key prefix and
    /// timeouts. Sends nothing.
    pub fn from_client(client: etcd_client::Client, config: EtcdConfig) -> Self {
        EtcdFence {
            client,
            config: Arc::new(config),
            writes: Arc::new((rand::random(), AtomicU64::new(0))),
        }
    }

    /// Parses `url` ([`EtcdConfig::from_url`]) and connects.
    pub async fn connect_url(url: &str) -> Result<Self> {
        Self::connect(EtcdConfig::from_url(url)?).await
    }

    /// The configuration.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    /// Runs `call` up to [`ATTEMPTS`] times (each call already sends a request again, within
    /// the request timeout, while it certainly did not apply: see
    /// [`crate::error::retry_unapplied`]). With `Retry::UnlessSent`, a failure after which the
    /// request may have applied ends the loop at once (the error is then `OutcomeUnknown`):
    /// only a request that never reached etcd, or that etcd refused before proposing it (`no
    /// leader`), is sent again.
    async fn retrying<T, F, Fut>(
        &self,
        operation: &'static str,
        retry: Retry,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, Failure>>,
    {
        let mut last = None;
        // Pauses of 50-100, 100-200 and 200-400 ms (jittered): at least the fixed 50 + 100 + 200
        // ms the fence waited before they were jittered.
        let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        for attempt in 0..ATTEMPTS {
            match call(self.client.clone()).await {
                Ok(t) => return Ok(t),
                Err(f) => {
                    let blind = retry == Retry::UnlessSent && !f.certainly_not_applied();
                    // Refused as too large: the same request is refused every time.
                    let again_refused = f.too_large_problem().is_some();
                    last = Some(f);
                    if blind || again_refused {
                        break;
                    }
                    if attempt + 1 < ATTEMPTS {
                        pause.sleep().await;
                    }
                }
            }
        }
        Err(last
            .expect("at least one attempt")
            .into_error(if operation == "read" {
                Op::read(operation)
            } else {
                Op::write(operation, false)
            }))
    }

    async fn accept(
        &self,
        operation: &'static str,
        resource: &ResourceId,
        token: Token,
        value: Option<Bytes>,
    ) -> Result<Accepted> {
        let base = keys::fence_prefix(self.config.key_prefix(), resource);
        let write = value.is_some();
        let marker = write.then(|| {
            let (fence, writes) = &*self.writes;
            let attempt = writes.fetch_add(1, Ordering::Relaxed);
            keys::retired_write_key(self.config.key_prefix(), resource, *fence, attempt)
        });
        let txn = accept_txn(&base, token, value);
        let txn = match &marker {
            Some(marker) => unless_retired(marker, txn),
            None => txn,
        };
        let timeout = self.config.request_timeout();
        let retry = if write {
            Retry::UnlessSent
        } else {
            Retry::Always
        };
        // Retires the write if the caller drops this future while a send may be on its way.
        let mut unsettled = Unsettled {
            config: self.config.clone(),
            marker: marker.clone(),
        };
        let sent = self
            .retrying(operation, retry, |c| {
                let txn = txn.clone();
                async move {
                    retry_unapplied(timeout, || {
                        let (mut c, txn) = (c.clone(), txn.clone());
                        async move { c.txn(txn).await }
                    })
                    .await
                }
            })
            .await;
        unsettled.marker = None;
        let resp = match (sent, &marker) {
            (Ok(resp), _) => resp,
            (
                Err(Error::OutcomeUnknown {
                    backend,
                    operation,
                    message,
                    source,
                }),
                Some(marker),
            ) => {
                // In a task of its own: a caller that drops this future now does not stop it.
                let retiring = tokio::spawn(retire(self.config.clone(), marker.clone()));
                let retired = retiring
                    .await
                    .unwrap_or_else(|e| Err(format!("its task failed: {e}")));
                let verdict = match retired {
                    Ok(()) => "the write was retired (a copy of it that reaches etcd later \
                               writes nothing), so a read now shows everything it did"
                        .to_owned(),
                    Err(why) => format!(
                        "the write could not be retired ({why}): it may still apply later; \
                         write again under a newer token"
                    ),
                };
                return Err(Error::OutcomeUnknown {
                    backend,
                    operation,
                    message: format!("{message}; {verdict}"),
                    source,
                });
            }
            (Err(e), _) => return Err(e),
        };
        let (succeeded, responses) = match &marker {
            None => (resp.succeeded(), resp.op_responses()),
            Some(_) => match (resp.succeeded(), resp.op_responses().into_iter().next()) {
                (true, Some(TxnOpResponse::Txn(inner))) => {
                    (inner.succeeded(), inner.op_responses())
                }
                // The marker exists only once the write was given up: never for a write whose
                // answer this is.
                _ => {
                    return Err(Error::OutcomeUnknown {
                        backend: BACKEND,
                        operation,
                        message: "the write's answer is not that of its transaction".into(),
                        source: None,
                    })
                }
            },
        };
        let stored = match responses.into_iter().next() {
            Some(TxnOpResponse::Get(g)) => g.kvs().first().and_then(|kv| parse_token(kv.value())),
            _ => None,
        };
        if succeeded {
            return Err(Error::Stale {
                resource: resource.to_string(),
                presented: token,
                current: stored.unwrap_or(Token::MAX),
            });
        }
        Ok(Accepted::new(stored))
    }
}

/// A write whose outcome is not settled yet: dropped with its `marker` (the caller dropped the
/// write's future while a send may have been on its way), it retires the write in the
/// background, as a write that got no answer is retired before it is reported.
struct Unsettled {
    config: Arc<EtcdConfig>,
    marker: Option<String>,
}

impl Drop for Unsettled {
    fn drop(&mut self) {
        let Some(marker) = self.marker.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let config = self.config.clone();
        runtime.spawn(async move {
            if let Err(why) = retire(config, marker.clone()).await {
                tracing::warn!(
                    backend = BACKEND,
                    marker = %marker,
                    "a fence write whose caller went away could not be retired ({why}): it may \
                     still apply later"
                );
            }
        });
    }
}

/// Retires a write that got no answer: puts its `marker`, attached to a lease of
/// [`RETIRED_TTL`], on a new connection (the old one may be the stalled path holding the write),
/// within the connect timeout plus twice the request timeout. `Err` says why not. A lease whose
/// marker certainly was not put is revoked (best effort), not left for its hour.
async fn retire(config: Arc<EtcdConfig>, marker: String) -> std::result::Result<(), String> {
    let timeout = config.request_timeout();
    let bound = config.connect_timeout() + 2 * timeout;
    let marker = marker.as_str();
    let retire = async {
        let fresh = crate::client::client_for(&config)
            .await
            .map_err(|e| e.to_string())?;
        let ttl = RETIRED_TTL.as_secs() as i64;
        let lease = retry_unapplied(timeout, || {
            let mut c = fresh.clone();
            async move { c.lease_grant(ttl, None).await }
        })
        .await
        .map_err(|f| f.to_string())?
        .id();
        let attached = PutOptions::new().with_lease(lease);
        // A put is the same whether it applies once or twice.
        let (put, _) = crate::error::retry_resendable(timeout, |_| {
            let (mut c, attached) = (fresh.clone(), attached.clone());
            async move { c.put(marker, "", Some(attached)).await }
        })
        .await;
        if let Err(f) = put {
            // A put that may have applied keeps its lease: the marker may be there, and helps.
            if f.certainly_not_applied() {
                let mut c = fresh.clone();
                let _ = tokio::time::timeout(timeout, c.lease_revoke(lease)).await;
            }
            return Err(f.to_string());
        }
        Ok(())
    };
    tokio::time::timeout(bound, retire)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {bound:?}")))
}

/// The transaction of a write (`value`) or claim of `token` on the resource whose range is
/// `base` (see the module docs).
fn accept_txn(base: &str, token: Token, value: Option<Bytes>) -> Txn {
    let newest = format!("{base}{NEWEST}");
    let presented = keys::token_bytes(token);
    let mut accept = vec![
        TxnOp::get(newest.clone(), None),
        TxnOp::put(newest.clone(), presented.clone(), None),
    ];
    if let Some(v) = value {
        let mut stored = format!("{presented}:").into_bytes();
        stored.extend_from_slice(&v);
        accept.push(TxnOp::put(format!("{base}{VALUE}"), stored, None));
    }
    Txn::new()
        .when([Compare::value(
            newest.clone(),
            CompareOp::Greater,
            presented,
        )])
        .and_then([TxnOp::get(newest, None)])
        .or_else(accept)
}

/// `txn`, applied only while `marker` is absent (nested: etcd 3.3 and later).
fn unless_retired(marker: &str, txn: Txn) -> Txn {
    Txn::new()
        .when([Compare::create_revision(marker, CompareOp::Equal, 0)])
        .and_then([TxnOp::txn(txn)])
}

#[async_trait]
impl Fence for EtcdFence {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        check_fence_value_len(value.len(), MAX_FENCE_VALUE_BYTES)?;
        self.accept("write", resource, token, Some(value)).await
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        self.accept("claim", resource, token, None).await
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        let base = keys::fence_prefix(self.config.key_prefix(), resource);
        let timeout = self.config.request_timeout();
        let resp = self
            .retrying("read", Retry::Always, |c| {
                let base = base.clone();
                async move {
                    retry_unapplied(timeout, || {
                        let (mut c, base) = (c.clone(), base.clone());
                        async move { c.get(base, Some(GetOptions::new().with_prefix())).await }
                    })
                    .await
                }
            })
            .await?;
        let mut newest = None;
        let mut value = None;
        for kv in resp.kvs() {
            // Only keys under `base` were asked for; anything else is not ours to read.
            let Some(name) = kv.key().strip_prefix(base.as_bytes()) else {
                continue;
            };
            if name == NEWEST.as_bytes() {
                newest = parse_token(kv.value());
            } else if name == VALUE.as_bytes() {
                value = parse_value(kv.value());
            }
        }
        Ok(newest.map(|n| FencedValue::new(n, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write retired after its answer was lost writes nothing when a copy of it reaches etcd
    /// later (here: its exact transaction, sent after the retirement); the same transaction
    /// under a marker not retired applies.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_retired_write_that_arrives_late_writes_nothing() {
        use conformance_tests::harness::{start_or_skip_async, Backend, EtcdServer};

        let test = "a_retired_write_that_arrives_late_writes_nothing";
        let Some(server) = start_or_skip_async(test, Backend::Etcd, EtcdServer::start).await else {
            return;
        };
        let fence = EtcdFence::connect_url(&server.url()).await.unwrap();
        let mut raw = fence.client.clone();
        let resource: ResourceId = "late-copy".parse().unwrap();
        let token = Token::new(5).unwrap();
        fence
            .write(&resource, token, Bytes::from_static(b"first"))
            .await
            .unwrap();
        let prefix = fence.config.key_prefix().to_owned();
        let base = keys::fence_prefix(&prefix, &resource);
        let copy = |marker: &str, value: &'static [u8]| {
            unless_retired(
                marker,
                accept_txn(&base, token, Some(Bytes::from_static(value))),
            )
        };
        let stored = |fence: EtcdFence, resource: ResourceId| async move {
            fence
                .read(&resource)
                .await
                .unwrap()
                .unwrap()
                .value
                .unwrap()
                .1
        };

        let retired = keys::retired_write_key(&prefix, &resource, 1, 1);
        retire(fence.config.clone(), retired.clone()).await.unwrap();
        let late = raw.txn(copy(&retired, b"late")).await.unwrap();
        assert!(!late.succeeded(), "the late copy passed its marker");
        assert_eq!(stored(fence.clone(), resource.clone()).await, "first");
        let lease = raw.get(retired.as_str(), None).await.unwrap().kvs()[0].lease();
        assert_ne!(lease, 0, "the marker lives on a lease");

        let live = keys::retired_write_key(&prefix, &resource, 1, 2);
        let applied = raw.txn(copy(&live, b"second")).await.unwrap();
        assert!(applied.succeeded());
        assert_eq!(stored(fence.clone(), resource.clone()).await, "second");
    }

    #[test]
    fn stored_values_round_trip() {
        let t = Token::new(42).unwrap();
        let mut raw = format!("{}:", keys::token_bytes(t)).into_bytes();
        raw.extend_from_slice(b"a:b");
        assert_eq!(parse_value(&raw), Some((t, Bytes::from_static(b"a:b"))));
        assert_eq!(parse_token(keys::token_bytes(t).as_bytes()), Some(t));
        assert_eq!(parse_value(b"garbage"), None);
    }
}
