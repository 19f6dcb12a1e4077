//! Closing a session from outside, as an operator holding its id and password would.
//!
//! A client that connects with another client's session id and password takes the session over
//! (the server drops the other connection) and may then close it: the server deletes the
//! session's ephemeral nodes at once. zookeeper-client reconnects a dropped client immediately,
//! so a takeover with a full client (connect, wait for the handshake, then close) loses the race
//! against the holder taking its session back most of the time. This tool sends the close
//! pipelined behind the connect request, in the same write, so the server processes it right
//! after the takeover: zookeeper-client builds the connect request (from the `SessionInfo`,
//! whose password it does not expose), and a one-shot relay forwards it with a `closeSession`
//! request appended.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zookeeper_client::{Client, SessionInfo};

/// The `closeSession` opcode.
const OP_CLOSE_SESSION: i32 = -11;
/// The xid of the appended close request (any value the client does not use for its first
/// requests).
const CLOSE_XID: i32 = 0x7fff_0001;
/// Frames larger than this are not a connect request or its answer.
const MAX_FRAME: usize = 64 * 1024;

/// What [`close_session_out_of_band`] achieved.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutOfBandClose {
    /// The server took the session over and closed it: its ephemeral nodes are deleted.
    Closed,
    /// The server says the session had already expired or been closed.
    AlreadyGone,
    /// The close was not confirmed (the holder's client took the session back first, and the
    /// server dropped this connection): check the session's nodes, and try again if they are
    /// still there.
    Raced,
}

/// Closes `session` on the server at `server` (`host:port`): takes it over with its id and
/// password and closes it, as an operator would with `zkCli` and the session's credentials.
/// The session's own client sees its connection dropped and, on reconnecting, that its session
/// is gone. For tests and operators' tools; `session` comes from
/// [`ZkCoordinator::current_session`](crate::ZkCoordinator::current_session). The password is
/// never read or shown by this function: the client library writes it into the connect request,
/// which is forwarded as is.
#[doc(hidden)]
pub async fn close_session_out_of_band(
    server: &str,
    session: SessionInfo,
    session_timeout: Duration,
    within: Duration,
) -> io::Result<OutOfBandClose> {
    let work = async {
        let relay = TcpListener::bind("127.0.0.1:0").await?;
        let relay_addr = relay.local_addr()?.to_string();
        let client = Client::connector()
            .with_session(session)
            .with_session_timeout(session_timeout)
            .connect(&relay_addr);
        let forward = async {
            let (mut from_client, _) = relay.accept().await?;
            let connect = read_frame(&mut from_client).await?;
            let mut upstream = TcpStream::connect(server).await?;
            upstream.set_nodelay(true)?;
            let mut out = Vec::with_capacity(connect.len() + 4 + 12);
            out.extend_from_slice(&(connect.len() as u32).to_be_bytes());
            out.extend_from_slice(&connect);
            out.extend_from_slice(&8u32.to_be_bytes());
            out.extend_from_slice(&CLOSE_XID.to_be_bytes());
            out.extend_from_slice(&OP_CLOSE_SESSION.to_be_bytes());
            upstream.write_all(&out).await?;
            // The connect response: protocol version (4), timeout (4), session id (8), ...
            let answer = match read_frame(&mut upstream).await {
                Ok(a) => a,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    return Ok(OutOfBandClose::Raced)
                }
                Err(e) => return Err(e),
            };
            let session_id = answer
                .get(8..16)
                .map(|b| i64::from_be_bytes(b.try_into().expect("8 bytes")))
                .ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidData, "short connect answer")
                })?;
            if session_id == 0 {
                return Ok(OutOfBandClose::AlreadyGone);
            }
            // Replies until ours: xid (4), zxid (8), err (4).
            loop {
                let reply = match read_frame(&mut upstream).await {
                    Ok(r) => r,
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                        return Ok(OutOfBandClose::Raced)
                    }
                    Err(e) => return Err(e),
                };
                let (Some(xid), Some(err)) = (reply.get(0..4), reply.get(12..16)) else {
                    continue;
                };
                if i32::from_be_bytes(xid.try_into().expect("4 bytes")) == CLOSE_XID {
                    return Ok(
                        if i32::from_be_bytes(err.try_into().expect("4 bytes")) == 0 {
                            OutOfBandClose::Closed
                        } else {
                            OutOfBandClose::Raced
                        },
                    );
                }
            }
        };
        tokio::select! {
            r = forward => r,
            // The client never gets an answer from the relay; it only gives up.
            _ = client => Err(io::Error::other("the client library gave up before the relay")),
        }
    };
    tokio::time::timeout(within, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "closing the session timed out"))?
}

async fn read_frame(stream: &mut TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await?;
    Ok(body)
}
