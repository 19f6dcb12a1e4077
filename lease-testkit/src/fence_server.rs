//! A protected resource reachable over TCP, so that worker *processes* write through the same
//! [`Fence`] as the test, and so that a [`crate::proxy::FaultProxy`] can sit between a worker and
//! its storage (or deliberately not: the partition case cuts the worker from the coordinator only).
//!
//! [`FenceServer`] serves any `Arc<dyn Fence>`; [`RemoteFence`] is a client that implements
//! [`Fence`] itself. The wire format is one line per request and one per reply:
//!
//! ```text
//! WRITE <resource-hex> <token> <value-hex>   ->  OK <previous|->  |  STALE <current>  |  UNKNOWN <message>  |  ERR <message>
//! CLAIM <resource-hex> <token>               ->  OK <previous|->  |  STALE <current>  |  UNKNOWN <message>  |  ERR <message>
//! READ <resource-hex>                        ->  NONE  |  VALUE <newest> <value-token|-> <value-hex|->  |  ERR <message>
//! ```
//!
//! `UNKNOWN` is the served fence's [`Error::OutcomeUnknown`] (the operation may have applied);
//! `ERR` any other error, which [`RemoteFence`] reports as `Unavailable`.
//!
//! Every accepted or rejected operation is also appended to a [`FenceLog`], the checker's input.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use lease_core::{Accepted, Bytes, Error, Fence, FencedValue, ResourceId, Token};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// One operation seen by a [`RecordingFence`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceRecord {
    /// The resource.
    pub resource: ResourceId,
    /// `write` or `claim`.
    pub op: &'static str,
    /// The token presented.
    pub token: Token,
    /// Whether the fence accepted it.
    pub accepted: bool,
    /// The value, for writes.
    pub value: Option<Bytes>,
}

/// The ordered log of a [`RecordingFence`].
#[derive(Debug, Clone, Default)]
pub struct FenceLog(Arc<Mutex<Vec<FenceRecord>>>);

impl FenceLog {
    /// Every record so far, in the order the fence answered.
    pub fn records(&self) -> Vec<FenceRecord> {
        self.0.lock().expect("log").clone()
    }

    /// Checks the safety property on the accepted records: per resource, accepted tokens never
    /// decrease, so no write was accepted from a holder superseded by an already accepted token.
    pub fn check_monotonic(&self) -> Result<usize, String> {
        let mut newest: std::collections::HashMap<ResourceId, Token> = Default::default();
        let mut accepted = 0;
        for (i, r) in self.records().iter().enumerate() {
            if !r.accepted {
                continue;
            }
            accepted += 1;
            if let Some(prev) = newest.get(&r.resource) {
                if r.token < *prev {
                    return Err(format!(
                        "record {i}: {} {} accepted token {} after {} was accepted",
                        r.op, r.resource, r.token, prev
                    ));
                }
            }
            newest.insert(r.resource.clone(), r.token);
        }
        Ok(accepted)
    }
}

/// Wraps a fence and logs every write and claim with its outcome, in answer order. The log
/// lock is held across the call, so the log order is the fence's commit order.
///
/// The log can miss an operation, never invent one: an `OutcomeUnknown` is settled by one read
/// right after it (see `record`), so a write that was applied after that read (its bytes still
/// on their way) or whose read failed is left out. A check over the log
/// ([`FenceLog::check_monotonic`]) can therefore miss a violation such a write made (a false
/// negative), but a violation it reports happened. Use a fence that settles unknown writes
/// itself (fence-postgres ends their sessions) where a missed record matters.
#[derive(Clone)]
pub struct RecordingFence {
    inner: Arc<dyn Fence>,
    log: FenceLog,
    order: Arc<tokio::sync::Mutex<()>>,
}

impl fmt::Debug for RecordingFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordingFence")
            .field("inner", &self.inner)
            .finish()
    }
}

impl RecordingFence {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Fence>) -> Self {
        RecordingFence {
            inner,
            log: FenceLog::default(),
            order: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The log.
    pub fn log(&self) -> FenceLog {
        self.log.clone()
    }

    /// Logs an answered operation: accepted, stale, or of unknown outcome and found applied.
    /// An `OutcomeUnknown` is settled by reading the resource (under the order lock, so no
    /// operation through this fence comes in between): it was applied when the newest token is
    /// `token` and, for a write, the value is `value` written with `token`. An operation whose
    /// outcome stays unknown (the read fails too) is not logged.
    async fn record(
        &self,
        resource: &ResourceId,
        op: &'static str,
        token: Token,
        value: Option<Bytes>,
        r: &lease_core::Result<Accepted>,
    ) {
        let accepted = match r {
            Ok(_) => true,
            Err(Error::Stale { .. }) => false,
            Err(Error::OutcomeUnknown { .. }) => match self.inner.read(resource).await {
                Ok(Some(now)) if now.newest == token => match &value {
                    Some(v) => now.value.as_ref() == Some(&(token, v.clone())),
                    None => true,
                },
                _ => return,
            },
            Err(_) => return,
        };
        self.log.0.lock().expect("log").push(FenceRecord {
            resource: resource.clone(),
            op,
            token,
            accepted,
            value,
        });
    }
}

#[async_trait]
impl Fence for RecordingFence {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    async fn write(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Bytes,
    ) -> lease_core::Result<Accepted> {
        let _g = self.order.lock().await;
        let r = self.inner.write(resource, token, value.clone()).await;
        self.record(resource, "write", token, Some(value), &r).await;
        r
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> lease_core::Result<Accepted> {
        let _g = self.order.lock().await;
        let r = self.inner.claim(resource, token).await;
        self.record(resource, "claim", token, None, &r).await;
        r
    }

    async fn read(&self, resource: &ResourceId) -> lease_core::Result<Option<FencedValue>> {
        self.inner.read(resource).await
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 {
        return Err(format!("odd hex length in {s:?}"));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("bad hex {s:?}: {e}")))
        .collect()
}

/// Serves a fence on a loopback port until dropped; dropping it closes every connection it
/// serves, so a client still connected sees the server gone.
pub struct FenceServer {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl fmt::Debug for FenceServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FenceServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for FenceServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FenceServer {
    /// Serves `fence` on a free loopback port.
    pub async fn start(fence: Arc<dyn Fence>) -> std::io::Result<FenceServer> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            // Owned by this task: aborting it (on drop) aborts every connection too.
            let mut connections = tokio::task::JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((sock, _)) => {
                            let fence = fence.clone();
                            connections.spawn(async move {
                                let _ = serve(sock, fence).await;
                            });
                        }
                        // For example EMFILE: back off instead of spinning.
                        Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
                    },
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Ok(FenceServer { addr, task })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

async fn serve(sock: TcpStream, fence: Arc<dyn Fence>) -> std::io::Result<()> {
    let (r, mut w) = sock.into_split();
    let mut lines = BufReader::new(r).lines();
    while let Some(line) = lines.next_line().await? {
        let reply = match handle(&line, &*fence).await {
            Ok(s) => s,
            Err(e) => format!("ERR {}", e.replace('\n', " ")),
        };
        w.write_all(reply.as_bytes()).await?;
        w.write_all(b"\n").await?;
    }
    Ok(())
}

async fn handle(line: &str, fence: &dyn Fence) -> Result<String, String> {
    let parts: Vec<&str> = line.split(' ').collect();
    let resource = |i: usize| -> Result<ResourceId, String> {
        let raw = unhex(parts.get(i).ok_or("missing resource")?)?;
        ResourceId::from_bytes(&raw).map_err(|e| e.to_string())
    };
    let token = |i: usize| -> Result<Token, String> {
        parts
            .get(i)
            .ok_or("missing token")?
            .parse::<Token>()
            .map_err(|e| e.to_string())
    };
    let answer = |r: lease_core::Result<Accepted>| match r {
        Ok(a) => Ok(format!(
            "OK {}",
            a.previous.map_or("-".into(), |t| t.to_string())
        )),
        Err(Error::Stale { current, .. }) => Ok(format!("STALE {current}")),
        // May have applied: the client must not be told it did not.
        Err(e @ Error::OutcomeUnknown { .. }) => {
            Ok(format!("UNKNOWN {}", e.to_string().replace('\n', " ")))
        }
        Err(e) => Err(e.to_string()),
    };
    match parts.first().copied() {
        Some("WRITE") => {
            let value = unhex(parts.get(3).ok_or("missing value")?)?;
            answer(
                fence
                    .write(&resource(1)?, token(2)?, Bytes::from(value))
                    .await,
            )
        }
        Some("CLAIM") => answer(fence.claim(&resource(1)?, token(2)?).await),
        Some("READ") => match fence.read(&resource(1)?).await.map_err(|e| e.to_string())? {
            None => Ok("NONE".into()),
            Some(v) => Ok(match &v.value {
                Some((t, b)) => format!("VALUE {} {t} {}", v.newest, hex(b)),
                None => format!("VALUE {} - -", v.newest),
            }),
        },
        _ => Err(format!("unknown request {line:?}")),
    }
}

/// A [`Fence`] client of a [`FenceServer`] (one connection, requests in turn).
///
/// It sets no time limit of its own (a case may hold a request in a [`FaultProxy`] for as long as
/// a takeover takes): bound a request with the caller's timeout. Every request is cancel-safe:
/// one dropped before its reply arrived closes its connection (its outcome is then unknown, as
/// after `OutcomeUnknown`), and the next request opens another, so it never reads the reply
/// meant for the dropped one.
///
/// [`FaultProxy`]: crate::proxy::FaultProxy
pub struct RemoteFence {
    addr: SocketAddr,
    conn: tokio::sync::Mutex<Option<BufReader<TcpStream>>>,
}

impl fmt::Debug for RemoteFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteFence")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RemoteFence {
    /// A client of the server at `addr` (connects on first use, reconnects after an error).
    pub fn new(addr: SocketAddr) -> Self {
        RemoteFence {
            addr,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    async fn call(&self, request: String) -> lease_core::Result<String> {
        let mut guard = self.conn.lock().await;
        let unavailable = |e: std::io::Error| {
            Error::unavailable_from("remote-fence", "fence server unreachable", e)
        };
        // Out of the slot for the request: a request dropped midway drops (closes) its
        // connection with it, rather than leave its reply unread for the next request.
        let mut conn = match guard.take() {
            Some(conn) => conn,
            None => BufReader::new(TcpStream::connect(self.addr).await.map_err(unavailable)?),
        };
        let result = async {
            conn.get_mut().write_all(request.as_bytes()).await?;
            conn.get_mut().write_all(b"\n").await?;
            let mut line = String::new();
            if conn.read_line(&mut line).await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "fence server closed",
                ));
            }
            // Only the line's end: an empty value's hex is empty, after a space.
            Ok(line.trim_end_matches(['\n', '\r']).to_owned())
        }
        .await;
        match result {
            Ok(line) => {
                *guard = Some(conn);
                Ok(line)
            }
            Err(e) => Err(Error::OutcomeUnknown {
                backend: "remote-fence",
                operation: "fence request",
                message: e.to_string(),
                source: None,
            }),
        }
    }

    /// The answer `line` to a `WRITE` or `CLAIM` (`operation`) of `token` on `resource`.
    fn accepted(
        operation: &'static str,
        resource: &ResourceId,
        token: Token,
        line: &str,
    ) -> lease_core::Result<Accepted> {
        let bad = || Error::unavailable("remote-fence", format!("bad reply {line:?}"));
        let (head, rest) = line.split_once(' ').ok_or_else(bad)?;
        match head {
            "OK" => Ok(Accepted::new(if rest == "-" {
                None
            } else {
                Some(rest.parse().map_err(|_| bad())?)
            })),
            "STALE" => Err(Error::Stale {
                resource: resource.to_string(),
                presented: token,
                current: rest.parse().map_err(|_| bad())?,
            }),
            "UNKNOWN" => Err(Error::OutcomeUnknown {
                backend: "remote-fence",
                operation,
                message: rest.to_owned(),
                source: None,
            }),
            _ => Err(Error::unavailable("remote-fence", rest.to_owned())),
        }
    }
}

#[async_trait]
impl Fence for RemoteFence {
    fn backend(&self) -> &'static str {
        "remote-fence"
    }

    async fn write(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Bytes,
    ) -> lease_core::Result<Accepted> {
        let line = self
            .call(format!(
                "WRITE {} {token} {}",
                hex(resource.as_str().as_bytes()),
                hex(&value)
            ))
            .await?;
        Self::accepted("write", resource, token, &line)
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> lease_core::Result<Accepted> {
        let line = self
            .call(format!(
                "CLAIM {} {token}",
                hex(resource.as_str().as_bytes())
            ))
            .await?;
        Self::accepted("claim", resource, token, &line)
    }

    async fn read(&self, resource: &ResourceId) -> lease_core::Result<Option<FencedValue>> {
        let line = self
            .call(format!("READ {}", hex(resource.as_str().as_bytes())))
            .await?;
        let bad = || Error::unavailable("remote-fence", format!("bad reply {line:?}"));
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["NONE"] => Ok(None),
            ["VALUE", newest, "-", "-"] => Ok(Some(FencedValue::new(
                newest.parse().map_err(|_| bad())?,
                None,
            ))),
            ["VALUE", newest, t, v] => Ok(Some(FencedValue::new(
                newest.parse().map_err(|_| bad())?,
                Some((
                    t.parse().map_err(|_| bad())?,
                    Bytes::from(unhex(v).map_err(|_| bad())?),
                )),
            ))),
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::memory::MemoryFence;

    /// A fence whose writes of `lost` apply but answer `OutcomeUnknown`, and whose writes of
    /// `refused` do not apply and answer the same.
    #[derive(Debug)]
    struct Doubtful(MemoryFence);

    #[async_trait]
    impl Fence for Doubtful {
        fn backend(&self) -> &'static str {
            "doubtful"
        }

        async fn write(
            &self,
            resource: &ResourceId,
            token: Token,
            value: Bytes,
        ) -> lease_core::Result<Accepted> {
            let unknown = Error::OutcomeUnknown {
                backend: "doubtful",
                operation: "write",
                message: "no answer".into(),
                source: None,
            };
            match &value[..] {
                b"lost" => {
                    self.0.write(resource, token, value).await?;
                    Err(unknown)
                }
                b"refused" => Err(unknown),
                _ => self.0.write(resource, token, value).await,
            }
        }

        async fn claim(&self, resource: &ResourceId, token: Token) -> lease_core::Result<Accepted> {
            self.0.claim(resource, token).await
        }

        async fn read(&self, resource: &ResourceId) -> lease_core::Result<Option<FencedValue>> {
            self.0.read(resource).await
        }
    }

    #[tokio::test]
    async fn dropping_the_server_closes_its_connections() {
        let server = FenceServer::start(Arc::new(MemoryFence::new()))
            .await
            .unwrap();
        let mut sock = TcpStream::connect(server.addr()).await.unwrap();
        sock.write_all(format!("READ {}\n", hex(b"r")).as_bytes())
            .await
            .unwrap();
        let mut lines = BufReader::new(sock).lines();
        assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("NONE"));
        drop(server);
        let end = tokio::time::timeout(std::time::Duration::from_secs(5), lines.next_line())
            .await
            .expect("the connection outlived its server");
        assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    }

    #[tokio::test]
    async fn a_write_of_unknown_outcome_is_logged_as_what_it_did() {
        let rec = RecordingFence::new(Arc::new(Doubtful(MemoryFence::new())));
        let log = rec.log();
        let r = ResourceId::new("doubt").unwrap();
        let t = |n| Token::new(n).unwrap();
        rec.write(&r, t(7), Bytes::from_static(b"lost"))
            .await
            .unwrap_err();
        rec.write(&r, t(9), Bytes::from_static(b"refused"))
            .await
            .unwrap_err();
        rec.write(&r, t(6), Bytes::from_static(b"late"))
            .await
            .unwrap_err();
        let records: Vec<(Token, bool)> = log
            .records()
            .iter()
            .map(|r| (r.token, r.accepted))
            .collect();
        // The lost write applied and is logged accepted; the refused one is not logged; the
        // stale write after it is logged refused.
        assert_eq!(records, vec![(t(7), true), (t(6), false)]);
        assert_eq!(log.check_monotonic(), Ok(1));
    }

    #[tokio::test]
    async fn remote_fence_round_trips_and_records() {
        let rec = RecordingFence::new(Arc::new(MemoryFence::new()));
        let log = rec.log();
        let server = FenceServer::start(Arc::new(rec)).await.unwrap();
        let remote = RemoteFence::new(server.addr());
        let r = ResourceId::new("res/ü").unwrap();
        let t = |n| Token::new(n).unwrap();
        assert_eq!(
            remote
                .write(&r, t(3), Bytes::from_static(b"v\n3"))
                .await
                .unwrap()
                .previous,
            None
        );
        assert_eq!(remote.claim(&r, t(5)).await.unwrap().previous, Some(t(3)));
        match remote.write(&r, t(4), Bytes::new()).await {
            Err(Error::Stale {
                presented, current, ..
            }) => assert_eq!((presented, current), (t(4), t(5))),
            other => panic!("{other:?}"),
        }
        let v = remote.read(&r).await.unwrap().unwrap();
        assert_eq!(v.newest, t(5));
        assert_eq!(v.value, Some((t(3), Bytes::from_static(b"v\n3"))));
        assert_eq!(log.check_monotonic(), Ok(2));
        assert_eq!(log.records().len(), 3);
        assert!(remote
            .read(&ResourceId::new("none").unwrap())
            .await
            .unwrap()
            .is_none());
    }

    /// A served fence's unknown outcome reaches the client as one (the write may have applied:
    /// before, it was reported `Unavailable`, "nothing applied"), and an empty value reads back
    /// (before, its reply did not parse).
    #[tokio::test]
    async fn remote_fence_keeps_unknown_outcomes_and_empty_values() {
        let server = FenceServer::start(Arc::new(Doubtful(MemoryFence::new())))
            .await
            .unwrap();
        let remote = RemoteFence::new(server.addr());
        let r = ResourceId::new("doubt").unwrap();
        let t = |n| Token::new(n).unwrap();
        match remote.write(&r, t(7), Bytes::from_static(b"lost")).await {
            Err(Error::OutcomeUnknown { operation, .. }) => assert_eq!(operation, "write"),
            other => panic!("{other:?}"),
        }
        let v = remote.read(&r).await.unwrap().unwrap();
        assert_eq!(v.value, Some((t(7), Bytes::from_static(b"lost"))));
        remote.write(&r, t(8), Bytes::new()).await.unwrap();
        let v = remote.read(&r).await.unwrap().unwrap();
        assert_eq!((v.newest, v.value), (t(8), Some((t(8), Bytes::new()))));
    }

    /// A request dropped after it was sent and before its reply arrived (a caller's timeout)
    /// leaves nothing for the next request to read: before, the connection stayed in use, and
    /// the next request read the dropped one's reply as its own.
    #[tokio::test]
    async fn a_request_dropped_before_its_reply_leaves_no_reply_for_the_next() {
        let server = FenceServer::start(Arc::new(MemoryFence::new()))
            .await
            .unwrap();
        let proxy = crate::proxy::FaultProxy::start(server.addr())
            .await
            .unwrap();
        let remote = RemoteFence::new(proxy.addr());
        let r = ResourceId::new("dropped").unwrap();
        let t = |n| Token::new(n).unwrap();
        remote.claim(&r, t(5)).await.unwrap();
        // The write is held in the proxy, then dropped by its caller.
        proxy.stall_open();
        {
            let write = remote.write(&r, t(7), Bytes::from_static(b"dropped"));
            tokio::pin!(write);
            let held = async {
                while proxy.held_request_bytes().unwrap() == 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                biased;
                done = &mut write => panic!("the write ended while held: {done:?}"),
                _ = held => {}
            }
        }
        // The held write may still reach the server (its connection is closed: before or
        // after the requests below, in any order) and its reply goes nowhere.
        proxy.heal();
        let read = remote.read(&r).await.unwrap().unwrap();
        assert!([t(5), t(7)].contains(&read.newest), "{read:?}");
        let claimed = remote.claim(&r, t(9)).await.unwrap().previous.unwrap();
        assert!([t(5), t(7)].contains(&claimed) && claimed >= read.newest);
        assert_eq!(remote.read(&r).await.unwrap().unwrap().newest, t(9));
    }

    #[test]
    fn checker_finds_a_regression() {
        let log = FenceLog::default();
        let r = ResourceId::new("r").unwrap();
        for (t, accepted) in [(2, true), (1, false), (1, true)] {
            log.0.lock().unwrap().push(FenceRecord {
                resource: r.clone(),
                op: "write",
                token: Token::new(t).unwrap(),
                accepted,
                value: None,
            });
        }
        assert!(log
            .check_monotonic()
            .unwrap_err()
            .contains("accepted token 1 after 2"));
    }
}
