//! Just enough of the Redis protocol (RESP2) for the Sentinel harness to drive its members and
//! Sentinels (`INFO`, `REPLICAOF`, `CONFIG SET`, `SENTINEL ...`), as `redis-cli` would: one
//! command per connection, no client library.

use std::fmt;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `+OK`
    Status(String),
    /// `-ERR ...`
    Error(String),
    /// `:42`
    Int(i64),
    /// `$n ...` or `$-1`
    Bulk(Option<Vec<u8>>),
    /// `*n ...` or `*-1`
    Array(Option<Vec<Reply>>),
}

/// The request bytes of one command.
fn encode(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// Parses one reply at the start of `buf`: `Ok(None)` when more bytes are needed, else the reply
/// and how many bytes it took.
fn parse(buf: &[u8]) -> Result<Option<(Reply, usize)>, String> {
    let Some(end) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let Some((&kind, line)) = buf[..end].split_first() else {
        return Err("empty reply line".into());
    };
    let line = String::from_utf8_lossy(line).into_owned();
    let after = end + 2;
    let len = || -> Result<i64, String> {
        line.parse()
            .map_err(|_| format!("bad length {line:?} in a reply"))
    };
    Ok(Some(match kind {
        b'+' => (Reply::Status(line), after),
        b'-' => (Reply::Error(line), after),
        b':' => (Reply::Int(len()?), after),
        b'$' => match usize::try_from(len()?) {
            Err(_) => (Reply::Bulk(None), after),
            Ok(n) if buf.len() < after + n + 2 => return Ok(None),
            Ok(n) => (
                Reply::Bulk(Some(buf[after..after + n].to_vec())),
                after + n + 2,
            ),
        },
        b'*' => match usize::try_from(len()?) {
            Err(_) => (Reply::Array(None), after),
            Ok(n) => {
                let mut items = Vec::with_capacity(n);
                let mut at = after;
                for _ in 0..n {
                    let Some((item, used)) = parse(&buf[at..])? else {
                        return Ok(None);
                    };
                    items.push(item);
                    at += used;
                }
                (Reply::Array(Some(items)), at)
            }
        },
        other => return Err(format!("unknown reply type {:?}", other as char)),
    }))
}

/// Sends `args` to `127.0.0.1:port` on a new connection and reads one reply. The caller bounds
/// the time.
pub(crate) async fn command(port: u16, args: &[&str]) -> Result<Reply, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(&encode(args))
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some((reply, _)) = parse(&buf)? {
            return match reply {
                Reply::Error(e) => Err(e),
                r => Ok(r),
            };
        }
        let n = stream.read(&mut chunk).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("connection closed before a whole reply".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Converts a reply to what a command's caller expects.
pub(crate) trait FromReply: Sized {
    /// The value, or why the reply is not one.
    fn from_reply(reply: Reply) -> Result<Self, String>;
}

impl FromReply for () {
    fn from_reply(_: Reply) -> Result<Self, String> {
        Ok(())
    }
}

impl FromReply for String {
    fn from_reply(reply: Reply) -> Result<Self, String> {
        match reply {
            Reply::Status(s) => Ok(s),
            Reply::Bulk(Some(b)) => Ok(String::from_utf8_lossy(&b).into_owned()),
            Reply::Int(i) => Ok(i.to_string()),
            other => Err(format!("expected a string, got {other}")),
        }
    }
}

impl FromReply for u16 {
    fn from_reply(reply: Reply) -> Result<Self, String> {
        let s = String::from_reply(reply)?;
        s.parse().map_err(|_| format!("expected a port, got {s:?}"))
    }
}

impl<T: FromReply> FromReply for Vec<T> {
    fn from_reply(reply: Reply) -> Result<Self, String> {
        match reply {
            Reply::Array(Some(items)) => items.into_iter().map(T::from_reply).collect(),
            Reply::Array(None) | Reply::Bulk(None) => Ok(Vec::new()),
            other => Err(format!("expected an array, got {other}")),
        }
    }
}

impl<T: FromReply> FromReply for Option<T> {
    fn from_reply(reply: Reply) -> Result<Self, String> {
        match reply {
            Reply::Array(None) | Reply::Bulk(None) => Ok(None),
            r => T::from_reply(r).map(Some),
        }
    }
}

impl<A: FromReply, B: FromReply> FromReply for (A, B) {
    fn from_reply(reply: Reply) -> Result<Self, String> {
        match reply {
            Reply::Array(Some(items)) if items.len() == 2 => {
                let mut it = items.into_iter();
                let (a, b) = (it.next().expect("two"), it.next().expect("two"));
                Ok((A::from_reply(a)?, B::from_reply(b)?))
            }
            other => Err(format!("expected a pair, got {other}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_a_command() {
        assert_eq!(
            encode(&["INFO", "replication"]),
            b"*2\r\n$4\r\nINFO\r\n$11\r\nreplication\r\n"
        );
    }

    #[test]
    fn parses_nested_and_null_replies_and_waits_for_more_bytes() {
        let whole = b"*2\r\n*2\r\n$4\r\nport\r\n$4\r\n6379\r\n*-1\r\n";
        for cut in 0..whole.len() {
            assert_eq!(parse(&whole[..cut]).unwrap(), None, "cut at {cut}");
        }
        let (reply, used) = parse(whole).unwrap().unwrap();
        assert_eq!(used, whole.len());
        let v: Vec<Option<Vec<String>>> = FromReply::from_reply(reply).unwrap();
        assert_eq!(v, [Some(vec!["port".to_owned(), "6379".to_owned()]), None]);
        let (r, _) = parse(b"*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6380\r\n")
            .unwrap()
            .unwrap();
        let addr: Option<(String, u16)> = FromReply::from_reply(r).unwrap();
        assert_eq!(addr, Some(("127.0.0.1".to_owned(), 6380)));
        let (r, _) = parse(b"*-1\r\n").unwrap().unwrap();
        assert_eq!(Option::<(String, u16)>::from_reply(r).unwrap(), None);
        let (r, _) = parse(b"-ERR no such master\r\n").unwrap().unwrap();
        assert_eq!(r, Reply::Error("ERR no such master".into()));
        assert_eq!(
            parse(b"+OK\r\n").unwrap().unwrap().0,
            Reply::Status("OK".into())
        );
    }
}
