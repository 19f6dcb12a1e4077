//! Real-server harness tests: start each server, talk to it over its raw protocol, crash it with
//! `SIGKILL`, restart it on the same data and port, freeze it with `SIGSTOP` and thaw it.
//!
//! A missing server binary is a named skip (`SKIPPED: <test>: <reason>` on stdout), or a failure
//! under `CI=true`. Every network call is bounded by a timeout.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use conformance_tests::harness::{
    server_unavailable, tcp_exchange, Backend, EtcdServer, HarnessError, RedisConfig, RedisServer,
    ServerControl, ZooKeeperServer,
};

/// How long a frozen server is given to (not) answer.
const FROZEN: Duration = Duration::from_millis(300);
/// Bound for requests to a healthy server.
const REQUEST: Duration = Duration::from_secs(5);
/// Bound for a thawed server to answer again.
const THAW: Duration = Duration::from_secs(10);

/// Starts a server, or applies the missing-server policy (skip, or panic under `CI=true`).
fn setup<T>(
    test: &str,
    backend: Backend,
    start: impl FnOnce() -> Result<T, HarnessError>,
) -> Option<T> {
    if let Err(reason) = backend.local_availability() {
        server_unavailable(test, reason)
            .unwrap_or_else(|e| panic!("{e}"))
            .report();
        return None;
    }
    let began = Instant::now();
    let server = start().unwrap_or_else(|e| panic!("{test}: {e}"));
    eprintln!("{test}: {backend} ready after {:?}", began.elapsed());
    Some(server)
}

/// Retries `f` until it succeeds or `limit` passes.
fn eventually<T>(limit: Duration, mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    let deadline = Instant::now() + limit;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn restart_timed(test: &str, server: &mut dyn ServerControl) {
    let began = Instant::now();
    server
        .restart()
        .unwrap_or_else(|e| panic!("{test}: restart: {e}"));
    eprintln!(
        "{test}: {} restarted after {:?}",
        server.backend(),
        began.elapsed()
    );
}

// ---------------------------------------------------------------- Redis (RESP) -------------

/// Whether `b` holds one complete RESP simple/error/integer/bulk reply.
fn resp_complete(b: &[u8]) -> bool {
    let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
        return false;
    };
    if b[0] != b'$' {
        return true;
    }
    let len: i64 = std::str::from_utf8(&b[1..eol])
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(-1);
    len < 0 || b.len() >= eol + 2 + len as usize + 2
}

/// Sends one command (with optional `AUTH` first) and returns the raw reply of the last one.
fn redis(addr: SocketAddr, timeout: Duration, args: &[&str]) -> io::Result<String> {
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    let reply = tcp_exchange(addr, req.as_bytes(), timeout, resp_complete)?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

#[test]
fn redis_aof_always_survives_kill_and_pause_stalls() {
    let test = "redis_aof_always_survives_kill_and_pause_stalls";
    let Some(mut server) = setup(test, Backend::Redis, RedisServer::start) else {
        return;
    };
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    let addr = server.addr();
    for i in 1..=5 {
        assert_eq!(
            redis(addr, REQUEST, &["INCR", "fence"]).unwrap(),
            format!(":{i}\r\n")
        );
    }

    let old_pid = server.pid().unwrap();
    server.kill().unwrap();
    assert_eq!(server.pid(), None);
    assert!(
        redis(addr, FROZEN, &["PING"]).is_err(),
        "killed server answered"
    );
    restart_timed(test, &mut server);
    assert_eq!(server.addr(), addr, "restart must keep the port");
    assert_ne!(server.pid(), Some(old_pid));
    assert_eq!(
        redis(addr, REQUEST, &["GET", "fence"]).unwrap(),
        "$1\r\n5\r\n",
        "AOF with appendfsync always must keep acknowledged INCRs across kill -9"
    );

    server.pause().unwrap();
    let frozen = redis(addr, FROZEN, &["INCR", "fence"]);
    assert!(frozen.is_err(), "paused server answered: {frozen:?}");
    server.resume().unwrap();
    // The INCR sent while frozen is executed on resume (its connection was open): 6 then 7.
    let after = eventually(THAW, || redis(addr, REQUEST, &["INCR", "fence"])).unwrap();
    assert!(
        after == ":7\r\n" || after == ":6\r\n",
        "unexpected reply after resume: {after:?}"
    );

    assert!(server.stop().unwrap().is_some());
    assert!(server.log_tail().contains("Ready to accept connections"));
}

#[test]
fn redis_without_aof_loses_data_on_kill() {
    let test = "redis_without_aof_loses_data_on_kill";
    let config = RedisConfig {
        appendonly: false,
        ..RedisConfig::default()
    };
    let Some(mut server) = setup(test, Backend::Redis, || RedisServer::start_with(config)) else {
        return;
    };
    let addr = server.addr();
    assert_eq!(redis(addr, REQUEST, &["INCR", "fence"]).unwrap(), ":1\r\n");
    server.kill().unwrap();
    restart_timed(test, &mut server);
    assert_eq!(
        redis(addr, REQUEST, &["GET", "fence"]).unwrap(),
        "$-1\r\n",
        "without AOF and with --save \"\" nothing survives kill -9"
    );
}

#[test]
fn redis_with_password_is_ready_and_requires_auth() {
    let test = "redis_with_password_is_ready_and_requires_auth";
    let config = RedisConfig {
        requirepass: Some("s3cret".into()),
        ..RedisConfig::default()
    };
    let Some(server) = setup(test, Backend::Redis, || RedisServer::start_with(config)) else {
        return;
    };
    assert!(redis(server.addr(), REQUEST, &["PING"])
        .unwrap()
        .starts_with("-NOAUTH"));
    assert_eq!(
        server.url_with_auth(),
        format!("redis://:s3cret@127.0.0.1:{}", server.port())
    );
    // AUTH then PING on one connection.
    let reply = tcp_exchange(
        server.addr(),
        b"*2\r\n$4\r\nAUTH\r\n$6\r\ns3cret\r\n*1\r\n$4\r\nPING\r\n",
        REQUEST,
        |b| b.ends_with(b"+PONG\r\n"),
    )
    .unwrap();
    assert_eq!(reply, b"+OK\r\n+PONG\r\n");
}

// ---------------------------------------------------------------- etcd (HTTP gateway) ------

/// One HTTP/1.0 request; returns the whole response (the server closes the connection).
fn http(
    addr: SocketAddr,
    timeout: Duration,
    method: &str,
    path: &str,
    body: &str,
) -> io::Result<String> {
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let reply = tcp_exchange(addr, req.as_bytes(), timeout, |_| false)?;
    let text = String::from_utf8_lossy(&reply).into_owned();
    if text.starts_with("HTTP/1.") {
        Ok(text)
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidData, text))
    }
}

#[test]
fn etcd_survives_kill_and_pause_stalls() {
    let test = "etcd_survives_kill_and_pause_stalls";
    let Some(mut server) = setup(test, Backend::Etcd, EtcdServer::start) else {
        return;
    };
    let addr = server.addr();
    assert_eq!(server.url(), format!("etcd://127.0.0.1:{}", server.port()));
    assert_eq!(
        server.http_endpoint(),
        format!("http://127.0.0.1:{}", server.port())
    );
    let version = http(addr, REQUEST, "GET", "/version", "").unwrap();
    assert!(version.contains("etcdserver"), "{version}");

    // key "harness" = value "survived" (base64 in the JSON gateway).
    let put = http(
        addr,
        REQUEST,
        "POST",
        "/v3/kv/put",
        r#"{"key":"aGFybmVzcw==","value":"c3Vydml2ZWQ="}"#,
    )
    .unwrap();
    assert!(put.starts_with("HTTP/1.0 200"), "{put}");

    server.kill().unwrap();
    assert!(http(addr, FROZEN, "GET", "/health", "").is_err());
    restart_timed(test, &mut server);
    let range = http(
        addr,
        REQUEST,
        "POST",
        "/v3/kv/range",
        r#"{"key":"aGFybmVzcw=="}"#,
    )
    .unwrap();
    assert!(
        range.contains("c3Vydml2ZWQ="),
        "key lost across kill -9: {range}"
    );

    server.pause().unwrap();
    let frozen = http(addr, FROZEN, "GET", "/health", "");
    assert!(frozen.is_err(), "paused etcd answered: {frozen:?}");
    server.resume().unwrap();
    let health = eventually(THAW, || {
        let h = http(addr, REQUEST, "GET", "/health", "")?;
        if h.contains("\"health\":\"true\"") {
            Ok(h)
        } else {
            Err(io::Error::other(h))
        }
    });
    assert!(health.is_ok(), "etcd unhealthy after resume: {health:?}");
}

// ---------------------------------------------------------------- ZooKeeper (jute) ---------

/// A minimal blocking ZooKeeper client: connect, create, getData. Enough to prove persistence.
struct Zk {
    stream: TcpStream,
    xid: i32,
}

fn put_str(buf: &mut Vec<u8>, s: &[u8]) {
    buf.extend_from_slice(&(s.len() as i32).to_be_bytes());
    buf.extend_from_slice(s);
}

impl Zk {
    fn connect(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, REQUEST)?;
        stream.set_read_timeout(Some(REQUEST))?;
        stream.set_write_timeout(Some(REQUEST))?;
        let mut zk = Self { stream, xid: 0 };
        let mut req = Vec::new();
        req.extend_from_slice(&0i32.to_be_bytes()); // protocolVersion
        req.extend_from_slice(&0i64.to_be_bytes()); // lastZxidSeen
        req.extend_from_slice(&4000i32.to_be_bytes()); // timeOut (ms)
        req.extend_from_slice(&0i64.to_be_bytes()); // sessionId
        put_str(&mut req, &[0u8; 16]); // passwd
        req.push(0); // readOnly
        zk.send(&req)?;
        let resp = zk.recv()?;
        if resp.len() < 16 {
            return Err(io::Error::other("short ConnectResponse"));
        }
        Ok(zk)
    }

    fn send(&mut self, payload: &[u8]) -> io::Result<()> {
        let mut frame = (payload.len() as i32).to_be_bytes().to_vec();
        frame.extend_from_slice(payload);
        self.stream.write_all(&frame)
    }

    fn recv(&mut self) -> io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        self.stream.read_exact(&mut len)?;
        let mut body = vec![0u8; i32::from_be_bytes(len) as usize];
        self.stream.read_exact(&mut body)?;
        Ok(body)
    }

    /// Sends a request of `op` type; returns the reply body after a successful ReplyHeader.
    fn call(&mut self, op: i32, body: &[u8]) -> io::Result<Vec<u8>> {
        self.xid += 1;
        let mut req = self.xid.to_be_bytes().to_vec();
        req.extend_from_slice(&op.to_be_bytes());
        req.extend_from_slice(body);
        self.send(&req)?;
        let reply = self.recv()?;
        let err = i32::from_be_bytes(reply[12..16].try_into().unwrap());
        if err != 0 {
            return Err(io::Error::other(format!("zookeeper error code {err}")));
        }
        Ok(reply[16..].to_vec())
    }

    fn create(&mut self, path: &str, data: &[u8]) -> io::Result<()> {
        let mut body = Vec::new();
        put_str(&mut body, path.as_bytes());
        put_str(&mut body, data);
        body.extend_from_slice(&1i32.to_be_bytes()); // one ACL
        body.extend_from_slice(&31i32.to_be_bytes()); // perms ALL
        put_str(&mut body, b"world");
        put_str(&mut body, b"anyone");
        body.extend_from_slice(&0i32.to_be_bytes()); // flags: persistent
        self.call(1, &body).map(|_| ())
    }

    fn get_data(&mut self, path: &str) -> io::Result<Vec<u8>> {
        let mut body = Vec::new();
        put_str(&mut body, path.as_bytes());
        body.push(0); // no watch
        let reply = self.call(4, &body)?;
        let len = i32::from_be_bytes(reply[0..4].try_into().unwrap());
        Ok(reply[4..4 + len.max(0) as usize].to_vec())
    }
}

fn srvr(addr: SocketAddr, timeout: Duration) -> io::Result<String> {
    let reply = tcp_exchange(addr, b"srvr", timeout, |_| false)?;
    let text = String::from_utf8_lossy(&reply).into_owned();
    if text.contains("Zookeeper version") {
        Ok(text)
    } else {
        Err(io::Error::other(text))
    }
}

#[test]
fn zookeeper_survives_kill_and_pause_stalls() {
    let test = "zookeeper_survives_kill_and_pause_stalls";
    let Some(mut server) = setup(test, Backend::ZooKeeper, ZooKeeperServer::start) else {
        return;
    };
    let addr = server.addr();
    assert_eq!(server.url(), format!("zk://127.0.0.1:{}", server.port()));
    let stats = srvr(addr, REQUEST).unwrap();
    assert!(stats.contains("Mode: standalone"), "{stats}");

    let mut zk = Zk::connect(addr).unwrap();
    zk.create("/harness", b"survived").unwrap();
    assert_eq!(zk.get_data("/harness").unwrap(), b"survived");
    drop(zk);

    server.kill().unwrap();
    assert!(srvr(addr, FROZEN).is_err());
    restart_timed(test, &mut server);
    let mut zk = Zk::connect(addr).unwrap();
    assert_eq!(
        zk.get_data("/harness").unwrap(),
        b"survived",
        "znode lost across kill -9"
    );
    drop(zk);

    server.pause().unwrap();
    let frozen = srvr(addr, FROZEN);
    assert!(frozen.is_err(), "paused zookeeper answered: {frozen:?}");
    server.resume().unwrap();
    eventually(THAW, || srvr(addr, REQUEST)).expect("zookeeper silent after resume");
    let log = std::fs::read_to_string(server.log_path()).unwrap();
    assert!(log.contains("binding to port"), "server log not captured");
}

// ---------------------------------------------------------------- drop cleans up -----------

#[test]
fn drop_kills_the_server_and_removes_its_directory() {
    let test = "drop_kills_the_server_and_removes_its_directory";
    let Some(server) = setup(test, Backend::Redis, RedisServer::start) else {
        return;
    };
    let pid = server.pid().unwrap();
    let root = server.root_dir().to_owned();
    let log = server.log_path().to_owned();
    assert!(log.starts_with(&root) && log.is_file());
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        let _owned = server;
        panic!("test body panics while owning the server");
    }));
    assert!(result.is_err());
    assert!(
        !conformance_tests::process::exists(pid),
        "server survived drop"
    );
    assert!(!root.exists(), "temp dir survived drop");
}

// ---------------------------------------------------------------- failure paths ------------

#[test]
fn startup_failure_reports_the_log_tail() {
    let test = "startup_failure_reports_the_log_tail";
    if let Err(reason) = Backend::Redis.local_availability() {
        server_unavailable(test, reason)
            .unwrap_or_else(|e| panic!("{e}"))
            .report();
        return;
    }
    let config = RedisConfig {
        extra_args: vec!["--no-such-option".into(), "1".into()],
        ..RedisConfig::default()
    };
    match RedisServer::start_with(config) {
        Err(HarnessError::Startup {
            server: "redis",
            exited: true,
            log_tail,
            ..
        }) => assert!(log_tail.contains("no-such-option"), "log tail: {log_tail}"),
        other => panic!("expected a startup failure, got {other:?}"),
    }
}

#[test]
fn restart_fails_while_the_port_is_taken_and_recovers() {
    let test = "restart_fails_while_the_port_is_taken_and_recovers";
    let Some(mut server) = setup(test, Backend::Redis, RedisServer::start) else {
        return;
    };
    server.kill().unwrap();
    let squatter = std::net::TcpListener::bind(server.addr()).unwrap();
    let err = server.restart().unwrap_err();
    assert!(
        matches!(&err, HarnessError::Startup { exited: true, log_tail, .. }
            if log_tail.contains("Address already in use")),
        "{err}"
    );
    drop(squatter);
    server.restart().unwrap();
    assert_eq!(
        redis(server.addr(), REQUEST, &["PING"]).unwrap(),
        "+PONG\r\n"
    );
}

// ---------------------------------------------------------------- proxy + real server ------

/// Sends `PING` on `conn` and reads one `+PONG\r\n`, bounded by `limit`.
async fn ping(conn: &mut tokio::net::TcpStream, limit: Duration) -> io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    conn.write_all(b"PING\r\n").await?;
    let mut buf = [0u8; 7];
    tokio::time::timeout(limit, conn.read_exact(&mut buf))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no PONG"))??;
    Ok(buf.to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_in_front_of_redis() {
    use conformance_tests::proxy::FaultProxy;

    let test = "fault_proxy_in_front_of_redis";
    let started =
        tokio::task::spawn_blocking(move || setup(test, Backend::Redis, RedisServer::start))
            .await
            .unwrap();
    let Some(server) = started else {
        return;
    };
    let proxy = FaultProxy::start(server.addr()).await.unwrap();
    let mut conn = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(ping(&mut conn, REQUEST).await.unwrap(), b"+PONG\r\n");
    proxy.blackhole();
    let stalled = ping(&mut conn, FROZEN).await.unwrap_err();
    assert_eq!(stalled.kind(), io::ErrorKind::TimedOut);
    proxy.heal();
    // The held PING is delivered after the heal: two PONGs arrive, the held one first.
    assert_eq!(ping(&mut conn, REQUEST).await.unwrap(), b"+PONG\r\n");
    let mut second = [0u8; 7];
    tokio::time::timeout(
        REQUEST,
        tokio::io::AsyncReadExt::read_exact(&mut conn, &mut second),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(&second, b"+PONG\r\n");
    drop(proxy);
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
}
