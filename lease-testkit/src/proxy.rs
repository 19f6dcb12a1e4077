//! A TCP fault proxy: put it between a client and a server, then break the network on demand.
//!
//! [`FaultProxy::start`] listens on a free loopback port ([`FaultProxy::addr`]) and forwards every
//! accepted connection to one upstream address. Point the client at the proxy instead of the
//! server, then switch modes at any time (the switches are synchronous and take effect at once
//! for new *and* existing connections):
//!
//! | call | effect |
//! |---|---|
//! | [`heal`](FaultProxy::heal) / [`pass_through`](FaultProxy::pass_through) | forward bytes both ways as they come (the initial mode) |
//! | [`blackhole`](FaultProxy::blackhole) | a partition: connections are still accepted, but nothing is forwarded in either direction and nothing is closed; new connections are not even opened upstream |
//! | [`delay`](FaultProxy::delay) | each chunk is forwarded `d` after the proxy read it, in each direction (a round trip gains at least `2 d`) |
//! | [`cut`](FaultProxy::cut) | every current connection is reset (both sides get `RST`, as soon as its task runs) and forwards nothing more from the moment `cut` returns; new connections are accepted as usual in the current mode |
//! | [`drop_replies`](FaultProxy::drop_replies) | requests reach the server, its replies are read and **discarded** (a lost reply: the operation applied, the client never hears); a connection that lost reply bytes delivers no later reply, even after `heal` |
//! | [`drop_replies_on_open`](FaultProxy::drop_replies_on_open) | as `drop_replies`, but only on the connections open now, for as long as they stay open, whatever the mode; connections opened later are not affected (a reply lost with its connection, and a client that reconnects to ask again) |
//! | [`stall_open`](FaultProxy::stall_open) | as `blackhole`, but only for the connections open now, until `heal`; connections opened later pass (one connection's packets stuck in retransmission while a new connection gets through) |
//! | [`refuse_new`](FaultProxy::refuse_new) | until `heal`, every new connection is reset as soon as it is accepted, never opened upstream; the connections open now carry on in the current mode (a host that went away for new clients: a client with several hosts moves on to the next) |
//!
//! **Healing keeps held bytes.** While black-holed the proxy stops reading, so bytes wait in
//! kernel buffers (the proxy only peeks at a connection before it reads, and reads only while it
//! forwards: bytes that arrive once it stopped stay in the kernel, where
//! [`held_request_bytes`](FaultProxy::held_request_bytes) counts them; at most one chunk per
//! direction read just before the switch stays inside the proxy); after `heal()` they are
//! delivered, late and in order, like TCP retransmissions after a short partition. A side's close
//! (`FIN` or `RST`) is held the same way: the other side learns of it only after `heal()`. Nothing is
//! dropped silently: to model a partition that outlived the connections, call `cut()` and then
//! `heal()`.
//!
//! **A lost reply mutes its connection.** TCP never delivers bytes after a gap: a connection
//! whose reply bytes the proxy discarded (by `drop_replies`, even part of a chunk) discards every
//! later reply on it too, until it closes, as a connection whose lost segment is retransmitted in
//! vain stays silent until one side gives up on it. A client that reuses it after a timeout
//! waits again; one that opens a new connection, after `heal`, is answered. A close the server
//! makes after the gap is held behind it too: the client learns of it only once it closes its
//! own side (or the connection is [`cut`](FaultProxy::cut)), as a reset of both sides.
//! [`lost_reply_bytes`](FaultProxy::lost_reply_bytes) counts what was discarded.
//!
//! The proxy runs on the Tokio runtime that called `start` (it must be called inside one).
//! Dropping the `FaultProxy` stops accepting and resets every connection it carries.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// Forward as fast as possible.
    PassThrough,
    /// Forward nothing, close nothing.
    Blackhole,
    /// Forward each chunk this long after it was read, per direction.
    Delay(Duration),
    /// Forward client-to-server bytes; read and discard server-to-client bytes.
    DropReplies,
}

/// Which way a pump copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Client to server.
    Request,
    /// Server to client.
    Reply,
}

impl FaultMode {
    fn forwards(self) -> bool {
        self != FaultMode::Blackhole
    }

    fn discards(self, direction: Direction) -> bool {
        self == FaultMode::DropReplies && direction == Direction::Reply
    }

    fn delay(self) -> Duration {
        match self {
            FaultMode::Delay(d) => d,
            _ => Duration::ZERO,
        }
    }
}

/// Shared state: the mode, a counter bumped by every `cut()`, the first connection (by
/// accept order, from 1) whose replies `drop_replies_on_open` does not discard, and the first
/// connection that `stall_open` does not stall.
#[derive(Debug, Clone, Copy)]
struct Control {
    mode: FaultMode,
    cut_epoch: u64,
    replies_from: u64,
    stalled_below: u64,
    /// Set by `refuse_new`: new connections are reset on accept.
    refusing: bool,
}

impl Control {
    /// Whether connection `serial` forwards now.
    fn forwards(&self, serial: u64) -> bool {
        self.mode.forwards() && serial >= self.stalled_below
    }
}

/// A running fault proxy. See the [module docs](self) for the modes and their contract.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    control: watch::Sender<Control>,
    accepted: Arc<AtomicU64>,
    open: Arc<AtomicU64>,
    request_bytes: Arc<AtomicU64>,
    lost_bytes: Arc<AtomicU64>,
    accept_task: JoinHandle<()>,
}

impl FaultProxy {
    /// Binds `127.0.0.1:0` and starts forwarding to `upstream` in pass-through mode.
    ///
    /// Must be called within a Tokio runtime; the proxy's tasks run there. Fails only if the
    /// listening socket cannot be bound. Upstream connect failures close the client connection.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let (control, rx) = watch::channel(Control {
            mode: FaultMode::PassThrough,
            cut_epoch: 0,
            replies_from: 0,
            stalled_below: 0,
            refusing: false,
        });
        let accepted = Arc::new(AtomicU64::new(0));
        let open = Arc::new(AtomicU64::new(0));
        let request_bytes = Arc::new(AtomicU64::new(0));
        let lost_bytes = Arc::new(AtomicU64::new(0));
        let accept_task = tokio::spawn(accept_loop(
            listener,
            upstream,
            rx,
            Counters {
                accepted: accepted.clone(),
                open: open.clone(),
                request_bytes: request_bytes.clone(),
                lost_bytes: lost_bytes.clone(),
            },
        ));
        Ok(Self {
            addr,
            upstream,
            control,
            accepted,
            open,
            request_bytes,
            lost_bytes,
            accept_task,
        })
    }

    /// The address clients should connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// The current mode.
    pub fn mode(&self) -> FaultMode {
        self.control.borrow().mode
    }

    /// How many client connections the proxy has accepted so far.
    pub fn accepted_connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// How many client connections are open now: accepted and not yet ended on both sides
    /// (a connection ends once each direction has forwarded its end, or on an error or a cut).
    pub fn open_connections(&self) -> u64 {
        self.open.load(Ordering::SeqCst)
    }

    /// Sets the mode (for all connections, at once).
    pub fn set_mode(&self, mode: FaultMode) {
        self.control.send_modify(|c| c.mode = mode);
    }

    /// Back to pass-through, no connection stalled, new ones accepted; bytes held by a blackhole
    /// or a stall are then delivered (see module docs).
    pub fn heal(&self) {
        self.control.send_modify(|c| {
            c.mode = FaultMode::PassThrough;
            c.stalled_below = 0;
            c.refusing = false;
        });
    }

    /// Same as [`Self::heal`].
    pub fn pass_through(&self) {
        self.heal();
    }

    /// Partition: accept and hold connections, forward nothing either way, close nothing.
    pub fn blackhole(&self) {
        self.set_mode(FaultMode::Blackhole);
    }

    /// Forward each chunk `d` after it was read, in each direction.
    pub fn delay(&self, d: Duration) {
        self.set_mode(FaultMode::Delay(d));
    }

    /// Lost replies: requests are forwarded, the server's replies are read and discarded (never
    /// delivered, even after `heal`). Connections stay open; one that lost reply bytes discards
    /// every later reply too, until it closes (see the module docs): [`cut`](Self::cut) it to
    /// make its client reconnect at once.
    pub fn drop_replies(&self) {
        self.set_mode(FaultMode::DropReplies);
    }

    /// Lost replies on the connections open now: from this call until each closes, the server's
    /// replies on them are read and discarded, whatever the mode. Connections accepted later are
    /// not affected. (A client that gives up on a connection and opens another then gets its
    /// answers: the lost reply of one request, then a working reconnect.)
    pub fn drop_replies_on_open(&self) {
        let open_until = self.accepted_connections();
        self.control
            .send_modify(|c| c.replies_from = c.replies_from.max(open_until + 1));
    }

    /// A partition of the connections open now: until [`heal`](Self::heal) they forward nothing
    /// either way and close nothing (their bytes wait, and are delivered after `heal`, as with
    /// a blackhole), whatever the mode. Connections accepted later are not affected.
    pub fn stall_open(&self) {
        let open_until = self.accepted_connections();
        self.control
            .send_modify(|c| c.stalled_below = c.stalled_below.max(open_until + 1));
    }

    /// Until [`heal`](Self::heal), resets every new connection as soon as it is accepted
    /// (it is counted, never opened upstream); the connections open now are not affected.
    pub fn refuse_new(&self) {
        self.control.send_modify(|c| c.refusing = true);
    }

    /// How many request bytes (client to server) the proxy has written upstream so far: wait on
    /// it to know a request has reached the server.
    pub fn request_bytes(&self) -> u64 {
        self.request_bytes.load(Ordering::Relaxed)
    }

    /// How many reply bytes (server to client) the proxy has read and discarded so far
    /// ([`drop_replies`](Self::drop_replies), [`drop_replies_on_open`](Self::drop_replies_on_open)):
    /// wait on it to know a reply was lost, rather than only late. (Bytes a
    /// [`cut`](Self::cut) ends with a connection are neither delivered nor counted.)
    pub fn lost_reply_bytes(&self) -> u64 {
        self.lost_bytes.load(Ordering::Relaxed)
    }

    /// This process's TCP sockets connected to the proxy, as inode numbers (read from
    /// `/proc/self/net/tcp` and `tcp6`; Linux only). Take them before a [`cut`](Self::cut),
    /// then wait for [`sockets_closed`] to know that the client has read the reset and closed
    /// its end, rather than sleeping for a time that is usually long enough.
    pub fn client_sockets(&self) -> io::Result<Vec<u64>> {
        let mut inodes = Vec::new();
        for fields in tcp_sockets()? {
            if fields.len() > 9 && proc_net_addr(&fields[2]) == Some(self.addr) {
                if let Ok(inode) = fields[9].parse::<u64>() {
                    if inode != 0 {
                        inodes.push(inode);
                    }
                }
            }
        }
        Ok(inodes)
    }

    /// How many request bytes the proxy holds unread now, summed over its connections: bytes a
    /// client sent that wait in the kernel's queue because the proxy forwards nothing on that
    /// connection (a [`stall_open`](Self::stall_open) or a blackhole; read from
    /// `/proc/self/net/tcp` and `tcp6`, Linux only). Wait on it to know that a request reached
    /// the proxy and is held there, never reaching the server if the connection is then
    /// [`cut`](Self::cut).
    pub fn held_request_bytes(&self) -> io::Result<u64> {
        let mut held = 0;
        for fields in tcp_sockets()? {
            // `sl local remote state tx_queue:rx_queue ...`: the proxy's end of a connection it
            // accepted (established), and what it has not read.
            if fields.len() > 4 && fields[3] == "01" && proc_net_addr(&fields[1]) == Some(self.addr)
            {
                held += rx_queue(&fields).unwrap_or(0);
            }
        }
        Ok(held)
    }

    /// Resets every connection open now (both the client and the upstream side see `RST`).
    /// The mode is unchanged and new connections are accepted.
    pub fn cut(&self) {
        self.control.send_modify(|c| c.cut_epoch += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        // Dropping `control` (after this) closes the watch channel; every connection task sees
        // it and resets its sockets.
    }
}

/// Whether none of `inodes` ([`FaultProxy::client_sockets`]) is open in this process any more:
/// no entry of `/proc/self/fd` refers to one of them.
pub fn sockets_closed(inodes: &[u64]) -> io::Result<bool> {
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue; // closed between the listing and the read
        };
        let target = target.to_string_lossy();
        let open = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
            .is_some_and(|inode| inodes.contains(&inode));
        if open {
            return Ok(false);
        }
    }
    Ok(true)
}

/// This network namespace's TCP sockets, a row of fields each (`/proc/self/net/tcp` and
/// `tcp6`, without their headers).
fn tcp_sockets() -> io::Result<Vec<Vec<String>>> {
    let mut rows = Vec::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let text = match std::fs::read_to_string(table) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        rows.extend(
            text.lines()
                .skip(1)
                .map(|line| line.split_whitespace().map(str::to_owned).collect()),
        );
    }
    Ok(rows)
}

/// A socket's receive queue (bytes received, not yet read) from its row of `/proc/net/tcp{,6}`
/// (the `rx_queue` half of `tx_queue:rx_queue`, in hex).
fn rx_queue(fields: &[String]) -> Option<u64> {
    u64::from_str_radix(fields.get(4)?.split_once(':')?.1, 16).ok()
}

/// An address as `/proc/net/tcp{,6}` prints it: the address's bytes in network order, written as
/// native-endian 32-bit words in hex, then `:` and the port in hex.
fn proc_net_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..ip.len()).step_by(8) {
        let word = u32::from_str_radix(ip.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip: std::net::IpAddr = match bytes.len() {
        4 => Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]).into(),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            v6.to_ipv4_mapped().map_or(v6.into(), Into::into)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The proxy's counters, shared with its tasks.
struct Counters {
    accepted: Arc<AtomicU64>,
    open: Arc<AtomicU64>,
    request_bytes: Arc<AtomicU64>,
    lost_bytes: Arc<AtomicU64>,
}

/// Counts one open connection until dropped.
struct OpenConnection(Arc<AtomicU64>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    control: watch::Receiver<Control>,
    counters: Counters,
) {
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
                counters.open.fetch_add(1, Ordering::SeqCst);
                let open = OpenConnection(counters.open.clone());
                let serial = counters.accepted.fetch_add(1, Ordering::Relaxed) + 1;
                // Taken at accept, as the serial is: a `cut()` after this point resets the
                // connection even if its task has not run yet.
                let (refusing, epoch) = {
                    let c = control.borrow();
                    (c.refusing, c.cut_epoch)
                };
                if refusing {
                    reset(&client);
                    drop((client, open));
                    continue;
                }
                let _ = client.set_nodelay(true);
                let bytes = ByteCounts {
                    forwarded: counters.request_bytes.clone(),
                    lost: counters.lost_bytes.clone(),
                };
                let control = control.clone();
                tokio::spawn(async move {
                    connection(serial, epoch, client, upstream, control, bytes).await;
                    drop(open);
                });
            }
            Err(e) => {
                // E.g. EMFILE: back off instead of spinning.
                tracing::warn!(error = %e, "fault proxy accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Resolves once a `cut()` after `epoch` happened or the proxy was dropped.
async fn cut_or_closed(mut control: watch::Receiver<Control>, epoch: u64) {
    loop {
        if control.borrow_and_update().cut_epoch != epoch {
            return;
        }
        if control.changed().await.is_err() {
            return;
        }
    }
}

/// Waits until connection `serial` forwards; errors when the proxy was dropped.
async fn forwarding(control: &mut watch::Receiver<Control>, serial: u64) -> io::Result<()> {
    control
        .wait_for(|c| c.forwards(serial))
        .await
        .map(|_| ())
        .map_err(|_| io::Error::new(io::ErrorKind::ConnectionAborted, "fault proxy stopped"))
}

/// Closes with `RST` instead of `FIN` (zero linger).
fn reset(stream: &TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

async fn connection(
    serial: u64,
    epoch: u64,
    mut client: TcpStream,
    upstream_addr: SocketAddr,
    control: watch::Receiver<Control>,
    bytes: ByteCounts,
) {
    let connect = async {
        let mut ctl = control.clone();
        forwarding(&mut ctl, serial).await?;
        TcpStream::connect(upstream_addr).await
    };
    let mut upstream = tokio::select! {
        up = connect => match up {
            Ok(up) => up,
            Err(e) => {
                tracing::debug!(error = %e, %upstream_addr, "fault proxy upstream connect failed");
                reset(&client);
                return;
            }
        },
        () = cut_or_closed(control.clone(), epoch) => {
            reset(&client);
            return;
        }
    };
    let _ = upstream.set_nodelay(true);
    // Set once the client's end of stream has been read (see `pump`).
    let client_closed = watch::channel(false).0;
    let was_cut = {
        let (client_read, client_write) = client.split();
        let (upstream_read, upstream_write) = upstream.split();
        let both = async {
            tokio::try_join!(
                pump(
                    client_read,
                    upstream_write,
                    control.clone(),
                    Pumped {
                        epoch,
                        serial,
                        direction: Direction::Request,
                    },
                    &bytes,
                    &client_closed,
                ),
                pump(
                    upstream_read,
                    client_write,
                    control.clone(),
                    Pumped {
                        epoch,
                        serial,
                        direction: Direction::Reply,
                    },
                    &bytes,
                    &client_closed,
                ),
            )
        };
        tokio::select! {
            biased;
            () = cut_or_closed(control.clone(), epoch) => true,
            // The pumps may see a cut, or the proxy's drop, before this task does: it is a cut
            // all the same, and closes with `RST`. A side's reset is passed on as a reset.
            r = both => {
                r.is_err_and(|e| e.kind() == io::ErrorKind::ConnectionReset)
                    || control.has_changed().is_err()
                    || control.borrow().cut_epoch != epoch
            }
        }
    };
    if was_cut {
        reset(&client);
        reset(&upstream);
    }
}

/// The proxy's byte counters, for a connection's pumps: request bytes written upstream, reply
/// bytes discarded.
struct ByteCounts {
    forwarded: Arc<AtomicU64>,
    lost: Arc<AtomicU64>,
}

/// What one pump copies: which connection (its `cut` epoch and accept serial), which way.
#[derive(Debug, Clone, Copy)]
struct Pumped {
    epoch: u64,
    serial: u64,
    direction: Direction,
}

impl Pumped {
    /// Whether `control` says to discard what this pump reads.
    fn discards(self, control: &Control) -> bool {
        control.mode.discards(self.direction)
            || (self.direction == Direction::Reply && self.serial < control.replies_from)
    }
}

/// Copies one direction, honouring the mode; ends after forwarding EOF as a write shutdown.
/// Once it has discarded bytes it discards everything after them, its EOF too (a lost reply
/// mutes its connection, module docs): it then waits for `client_closed` (set by the request
/// pump on the client's EOF) and ends with a reset.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    control: watch::Receiver<Control>,
    pumped: Pumped,
    bytes: &ByteCounts,
    client_closed: &watch::Sender<bool>,
) -> io::Result<()> {
    let epoch = pumped.epoch;
    let forwarded = (pumped.direction == Direction::Request).then_some(&bytes.forwarded);
    // Set by the first discarded byte, by the reader or the writer (both run on this task).
    let muted = AtomicBool::new(false);
    let muted = &muted;
    let discards = |ctl: &watch::Receiver<Control>| {
        muted.load(Ordering::Relaxed) || pumped.discards(&ctl.borrow())
    };
    let lose = |n: usize| {
        muted.store(true, Ordering::Relaxed);
        bytes.lost.fetch_add(n as u64, Ordering::Relaxed);
    };
    // The reader saw the end of its stream: for the request pump, the client's close.
    let at_end = || {
        if pumped.direction == Direction::Request {
            client_closed.send_replace(true);
        }
    };
    // A connection from before a `cut()` forwards nothing more from the moment `cut` returns,
    // even before its task has reset the sockets.
    let cut = |ctl: &watch::Receiver<Control>| -> io::Result<()> {
        if ctl.borrow().cut_epoch == epoch {
            Ok(())
        } else {
            Err(io::Error::new(io::ErrorKind::ConnectionReset, "cut"))
        }
    };
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(64);
    let mut read_ctl = control.clone();
    let mut write_ctl = control;
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            forwarding(&mut read_ctl, pumped.serial).await?;
            // Waits for bytes without taking them: if the connection stopped forwarding
            // meanwhile, they stay in the kernel's queue (counted by `held_request_bytes`,
            // discarded by a `cut`) until it forwards again.
            // A close (EOF or reset) crosses only while the connection forwards, as bytes do:
            // a partition tells neither side that the other closed, until it heals.
            let peeked = from.peek(&mut buf[..1]).await;
            if !matches!(peeked, Ok(n) if n > 0) {
                forwarding(&mut read_ctl, pumped.serial).await?;
                peeked?;
                at_end();
                return Ok(()); // drops `tx`: the writer shuts down after the queue drains
            }
            if !read_ctl.borrow().forwards(pumped.serial) {
                continue;
            }
            let n = from.read(&mut buf).await?;
            if n == 0 {
                at_end();
                return Ok(());
            }
            cut(&read_ctl)?;
            if discards(&read_ctl) {
                lose(n);
                continue;
            }
            let due = Instant::now() + read_ctl.borrow().mode.delay();
            if tx.send((due, buf[..n].to_vec())).await.is_err() {
                return Ok(());
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            // Written piece by piece, the control checked before each and watched while a piece
            // waits for room (a reader that does not read): a blackhole, stall, cut or loss of
            // replies set meanwhile stops the rest of the chunk where it is, as it stops the
            // chunks after it. Held bytes go on after `heal`; lost ones mute the connection.
            let mut rest = &chunk[..];
            while !rest.is_empty() {
                forwarding(&mut write_ctl, pumped.serial).await?;
                cut(&write_ctl)?;
                if discards(&write_ctl) {
                    lose(rest.len());
                    break;
                }
                tokio::select! {
                    biased;
                    changed = write_ctl.changed() => changed.map_err(|_| {
                        io::Error::new(io::ErrorKind::ConnectionAborted, "fault proxy stopped")
                    })?,
                    written = to.write(rest) => {
                        let n = written?;
                        if n == 0 {
                            return Err(io::ErrorKind::WriteZero.into());
                        }
                        rest = &rest[n..];
                        if let Some(c) = forwarded {
                            c.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    }
                }
            }
        }
        if muted.load(Ordering::Relaxed) {
            // An end of stream after lost bytes: TCP would hold it behind them. Held until the
            // client closes its side too (or a cut ends the connection), then both sides are
            // reset, as when one gives up on a connection that stopped answering.
            let _ = client_closed.subscribe().wait_for(|closed| *closed).await;
            return Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "a connection that lost replies was closed",
            ));
        }
        forwarding(&mut write_ctl, pumped.serial).await?;
        cut(&write_ctl)?;
        to.shutdown().await
    };
    tokio::try_join!(reader, writer).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot;
    use tokio::time::timeout;

    /// A tiny echo server; returns its address.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream, msg: &[u8], limit: Duration) -> io::Result<Vec<u8>> {
        s.write_all(msg).await?;
        let mut buf = vec![0u8; msg.len()];
        timeout(limit, s.read_exact(&mut buf))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "echo timed out"))??;
        Ok(buf)
    }

    const SHORT: Duration = Duration::from_millis(300);
    const LONG: Duration = Duration::from_secs(5);

    /// A proxy in front of a listener of this test, a client connected through it, and the
    /// server's end of that connection.
    async fn proxied_pair() -> (FaultProxy, TcpStream, TcpStream) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let proxy = FaultProxy::start(listener.local_addr().unwrap())
            .await
            .unwrap();
        let client = TcpStream::connect(proxy.addr()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (proxy, client, server)
    }

    /// More than the socket buffers and the proxy's queue hold.
    const TOTAL: usize = 32 << 20;

    /// Byte `i` of the stream the large-transfer tests send: any prefix is recognisable.
    fn pattern_byte(i: usize) -> u8 {
        (i % 251) as u8
    }

    /// The first `len` bytes of that stream.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(pattern_byte).collect()
    }

    #[tokio::test]
    async fn pass_through_echoes() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s, b"hello", LONG).await.unwrap(), b"hello");
        assert_eq!(proxy.mode(), FaultMode::PassThrough);
        assert_eq!(proxy.accepted_connections(), 1);
    }

    #[tokio::test]
    async fn blackhole_stalls_and_heal_restores() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut old, b"x", LONG).await.unwrap(), b"x");

        proxy.blackhole();
        // An existing connection stalls without being closed.
        let err = roundtrip(&mut old, b"held", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // A new connection is accepted but gets nothing either.
        let mut fresh = timeout(LONG, TcpStream::connect(proxy.addr()))
            .await
            .unwrap()
            .unwrap();
        let err = roundtrip(&mut fresh, b"new", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);

        proxy.heal();
        let mut after = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut after, b"ok", LONG).await.unwrap(), b"ok");
        // Held bytes are delivered late, in order (documented choice).
        let mut held = [0u8; 4];
        timeout(LONG, old.read_exact(&mut held))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&held, b"held");
        let mut held = [0u8; 3];
        timeout(LONG, fresh.read_exact(&mut held))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&held, b"new");
    }

    /// A blackhole set while a chunk waits for room at a reader that does not read stops the
    /// rest of that chunk too: the reader then gets what the proxy had written when
    /// `blackhole` returned, nothing more until `heal`, then the rest, in order.
    #[tokio::test]
    async fn blackhole_stops_a_chunk_half_written() {
        let (proxy, mut client, mut server) = proxied_pair().await;
        let data = pattern(TOTAL);
        let sent = data.clone();
        let writer = tokio::spawn(async move { client.write_all(&sent).await.map(|()| client) });
        // The server reads nothing yet: the proxy's write waits for room once it has written
        // nothing more for a while with bytes still to read. (Were it not waiting, the test
        // would only prove less, never fail: this runtime has one thread, so nothing of the
        // proxy's runs between `blackhole` and `request_bytes` below.)
        timeout(LONG, async {
            let mut last = u64::MAX;
            loop {
                let now = proxy.request_bytes();
                if now == last && proxy.held_request_bytes().unwrap() > 0 {
                    break;
                }
                last = now;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the proxy never stopped writing");
        proxy.blackhole();
        let forwarded = proxy.request_bytes() as usize;
        assert!(forwarded > 0 && forwarded < TOTAL, "{forwarded}");
        let mut got = vec![0u8; forwarded];
        timeout(LONG, server.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        assert!(
            got == data[..forwarded],
            "the bytes before the blackhole, in order"
        );
        let mut more = [0u8; 1];
        let late = timeout(SHORT, server.read(&mut more)).await;
        assert!(
            late.is_err(),
            "bytes crossed the blackhole: {late:?} after the {forwarded} forwarded before it"
        );
        proxy.heal();
        let mut rest = vec![0u8; TOTAL - forwarded];
        timeout(LONG, server.read_exact(&mut rest))
            .await
            .unwrap()
            .unwrap();
        assert!(
            rest == data[forwarded..],
            "the held bytes after heal, in order"
        );
        timeout(LONG, writer).await.unwrap().unwrap().unwrap();
    }

    /// A server that echoes one byte on its one connection, then, when told, closes it (with
    /// `RST` if `rst`); it reports when it sees the client's own close.
    async fn closing_server(rst: bool) -> (SocketAddr, oneshot::Sender<()>, oneshot::Receiver<()>) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (close, mut told) = oneshot::channel::<()>();
        let (saw, closed) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf).await.unwrap();
            tokio::select! {
                _ = &mut told => {
                    if rst {
                        reset(&s);
                    }
                }
                n = s.read(&mut buf) => {
                    if matches!(n, Ok(0)) {
                        let _ = saw.send(());
                    }
                    let _ = told.await;
                }
            }
        });
        (addr, close, closed)
    }

    #[tokio::test]
    async fn blackhole_holds_a_servers_close_until_heal() {
        for rst in [false, true] {
            let (addr, close, _) = closing_server(rst).await;
            let proxy = FaultProxy::start(addr).await.unwrap();
            let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
            assert_eq!(roundtrip(&mut s, b"x", LONG).await.unwrap(), b"x");
            proxy.blackhole();
            close.send(()).unwrap();
            let mut buf = [0u8; 1];
            let early = timeout(SHORT, s.read(&mut buf)).await;
            assert!(
                early.is_err(),
                "the close crossed the partition (rst {rst}): {early:?}"
            );
            proxy.heal();
            // As it was sent: FIN as EOF, RST as a reset.
            match timeout(LONG, s.read(&mut buf))
                .await
                .expect("the close was not delivered after heal")
            {
                Ok(0) => assert!(!rst, "the server's reset arrived as FIN"),
                Ok(n) => panic!("read {n} bytes after the server closed"),
                Err(e) => assert_eq!((e.kind(), rst), (io::ErrorKind::ConnectionReset, true)),
            }
        }
    }

    #[tokio::test]
    async fn blackhole_holds_a_clients_close_until_heal() {
        let (addr, _close, mut closed) = closing_server(false).await;
        let proxy = FaultProxy::start(addr).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut s, b"x", LONG).await.unwrap(), b"x");
        proxy.blackhole();
        s.shutdown().await.unwrap();
        assert!(
            timeout(SHORT, &mut closed).await.is_err(),
            "the client's close crossed the partition"
        );
        proxy.heal();
        timeout(LONG, closed)
            .await
            .expect("the close was not delivered after heal")
            .unwrap();
    }

    #[tokio::test]
    async fn delay_adds_latency_per_direction() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut s, b"warm", LONG).await.unwrap();
        let d = Duration::from_millis(100);
        proxy.delay(d);
        let began = std::time::Instant::now();
        assert_eq!(roundtrip(&mut s, b"slow", LONG).await.unwrap(), b"slow");
        let took = began.elapsed();
        assert!(
            took >= 2 * d,
            "round trip took {took:?}, expected >= {:?}",
            2 * d
        );
        proxy.heal();
        let began = std::time::Instant::now();
        roundtrip(&mut s, b"fast", LONG).await.unwrap();
        assert!(began.elapsed() < d, "healed round trip still slow");
    }

    /// Waits until the proxy has written `n` request bytes upstream.
    async fn forwarded(proxy: &FaultProxy, n: u64) {
        timeout(LONG, async {
            while proxy.request_bytes() < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{} of {n} request bytes forwarded", proxy.request_bytes()));
    }

    /// Waits until the proxy has discarded `n` reply bytes.
    async fn lost(proxy: &FaultProxy, n: u64) {
        timeout(LONG, async {
            while proxy.lost_reply_bytes() < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{} of {n} reply bytes lost", proxy.lost_reply_bytes()));
    }

    #[tokio::test]
    async fn drop_replies_forwards_requests_and_discards_answers() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut s, b"warm", LONG).await.unwrap();
        let before = proxy.request_bytes();
        proxy.drop_replies();
        let err = roundtrip(&mut s, b"lost", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // The request reached the server, and its answer was discarded.
        forwarded(&proxy, before + 4).await;
        lost(&proxy, 4).await;
        // The discarded reply never arrives, even after healing, and neither does a later one
        // on its connection (TCP delivers nothing past a gap); a new connection is answered.
        proxy.heal();
        s.write_all(b"next").await.unwrap();
        forwarded(&proxy, before + 8).await;
        lost(&proxy, 8).await;
        let mut byte = [0u8; 1];
        let late = timeout(SHORT, s.read(&mut byte)).await;
        assert!(late.is_err(), "a reply crossed the gap: {late:?}");
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut new, b"new", LONG).await.unwrap(), b"new");
        assert_eq!(proxy.request_bytes(), before + 11);
        assert_eq!(proxy.lost_reply_bytes(), 8);
    }

    /// Lost replies set while a reply waits for room at a client that does not read: the
    /// client gets what was written before, then nothing, even after `heal`: never the end of
    /// the reply, or a later one, after the gap.
    #[tokio::test]
    async fn drop_replies_mid_chunk_mutes_the_connection() {
        let (proxy, mut client, mut server) = proxied_pair().await;
        let written =
            tokio::spawn(async move { server.write_all(&pattern(TOTAL)).await.map(|()| server) });
        // Read some, so the reply is under way, then stop reading until the client's receive
        // queue stops growing: the proxy's write then waits for room, most likely in the middle
        // of a chunk. (Were it not, the test would prove less, never fail.)
        let mut head = vec![0u8; 1 << 20];
        timeout(LONG, client.read_exact(&mut head))
            .await
            .unwrap()
            .unwrap();
        let (local, peer) = (client.local_addr().unwrap(), proxy.addr());
        let queued = || {
            tcp_sockets()
                .unwrap()
                .into_iter()
                .find(|f| {
                    f.len() > 4
                        && proc_net_addr(&f[1]) == Some(local)
                        && proc_net_addr(&f[2]) == Some(peer)
                })
                .and_then(|f| rx_queue(&f))
                .expect("the client's socket in /proc/self/net/tcp")
        };
        timeout(LONG, async {
            let mut last = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                let now = queued();
                if now > 0 && now == last {
                    break;
                }
                last = now;
            }
        })
        .await
        .expect("the client's receive queue never filled");
        proxy.drop_replies();
        // The rest is discarded: the server's write completes although the client reads none.
        // (Buffers along the way may hold all of it: the loss is waited for on its own.)
        let mut server = timeout(LONG, written).await.unwrap().unwrap().unwrap();
        lost(&proxy, 1).await;
        proxy.heal();
        // What the client can still read is a prefix of the reply, then nothing.
        let mut got = head;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match timeout(SHORT, client.read(&mut buf)).await {
                Err(_) => break,
                Ok(r) => {
                    let n = r.unwrap();
                    assert!(n > 0, "the connection was closed");
                    got.extend_from_slice(&buf[..n]);
                }
            }
        }
        assert!(got.len() < TOTAL, "the whole reply arrived");
        assert!(
            got.iter().enumerate().all(|(i, &b)| b == pattern_byte(i)),
            "not a prefix of the reply"
        );
        // Every byte not delivered is counted lost (no more: the rest was delivered).
        lost(&proxy, (TOTAL - got.len()) as u64).await;
        assert_eq!(proxy.lost_reply_bytes() as usize, TOTAL - got.len());
        // A later reply after the gap is lost too.
        server.write_all(b"later").await.unwrap();
        lost(&proxy, (TOTAL - got.len() + 5) as u64).await;
        let late = timeout(SHORT, client.read(&mut buf)).await;
        assert!(late.is_err(), "a reply crossed the gap: {late:?}");
    }

    /// A server's close after lost replies is held behind them, as TCP would: the client sees
    /// no end of stream, even after `heal`; once it closes its own side, both are reset.
    #[tokio::test]
    async fn drop_replies_holds_a_servers_close_after_the_gap() {
        let (addr, close, _) = closing_server(false).await;
        let proxy = FaultProxy::start(addr).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.drop_replies();
        s.write_all(b"x").await.unwrap();
        lost(&proxy, 1).await;
        proxy.heal();
        close.send(()).unwrap();
        let mut buf = [0u8; 1];
        let early = timeout(SHORT, s.read(&mut buf)).await;
        assert!(early.is_err(), "the close crossed the gap: {early:?}");
        assert_eq!(proxy.open_connections(), 1);
        s.shutdown().await.unwrap();
        match timeout(LONG, s.read(&mut buf))
            .await
            .expect("the connection was not ended once the client closed")
        {
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
            other => panic!("{other:?}: not a reset"),
        }
        timeout(LONG, async {
            while proxy.open_connections() > 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the proxy still counts the connection open");
    }

    #[tokio::test]
    async fn drop_replies_on_open_spares_later_connections() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut old, b"warm", LONG).await.unwrap();
        proxy.drop_replies_on_open();
        assert_eq!(proxy.mode(), FaultMode::PassThrough);
        let before = proxy.request_bytes();
        let err = roundtrip(&mut old, b"lost", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // The request reached the server, and its answer was discarded.
        forwarded(&proxy, before + 4).await;
        lost(&proxy, 4).await;
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut new, b"next", LONG).await.unwrap(), b"next");
        // The old connection stays mute, even after healing.
        proxy.heal();
        let err = roundtrip(&mut old, b"more", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn stall_open_holds_old_connections_until_heal() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut old, b"warm", LONG).await.unwrap();
        assert_eq!(proxy.open_connections(), 1);
        proxy.stall_open();
        let before = proxy.request_bytes();
        let err = roundtrip(&mut old, b"held", SHORT).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(proxy.request_bytes(), before, "nothing reached the server");
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut new, b"next", LONG).await.unwrap(), b"next");
        // Healing delivers the held bytes, late and in order.
        proxy.heal();
        let mut buf = [0u8; 4];
        timeout(LONG, old.read_exact(&mut buf))
            .await
            .expect("held bytes not delivered after heal")
            .unwrap();
        assert_eq!(&buf, b"held");
        // A connection closed on both sides is no longer counted.
        drop((old, new));
        let deadline = Instant::now() + LONG;
        while proxy.open_connections() > 0 {
            assert!(Instant::now() < deadline, "connections still counted open");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn cut_resets_existing_connections_only() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut s, b"a", LONG).await.unwrap();
        proxy.cut();
        let mut buf = [0u8; 1];
        match timeout(LONG, s.read(&mut buf)).await.expect("no EOF/reset") {
            Ok(0) => {}
            Ok(n) => panic!("read {n} bytes after cut"),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
        }
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut again, b"b", LONG).await.unwrap(), b"b");
    }

    #[tokio::test]
    async fn refuse_new_resets_new_connections_only() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let mut old = TcpStream::connect(proxy.addr()).await.unwrap();
        roundtrip(&mut old, b"a", LONG).await.unwrap();
        proxy.refuse_new();
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        let mut buf = [0u8; 1];
        match timeout(LONG, fresh.read(&mut buf))
            .await
            .expect("no EOF/reset")
        {
            Ok(0) => {}
            Ok(n) => panic!("read {n} bytes on a refused connection"),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
        }
        assert_eq!(roundtrip(&mut old, b"b", LONG).await.unwrap(), b"b");
        assert_eq!(proxy.accepted_connections(), 2);
        proxy.heal();
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(roundtrip(&mut again, b"c", LONG).await.unwrap(), b"c");
    }

    #[tokio::test]
    async fn drop_stops_the_proxy() {
        let proxy = FaultProxy::start(echo_server().await).await.unwrap();
        let addr = proxy.addr();
        let mut s = TcpStream::connect(addr).await.unwrap();
        roundtrip(&mut s, b"a", LONG).await.unwrap();
        drop(proxy);
        let mut buf = [0u8; 1];
        match timeout(LONG, s.read(&mut buf)).await.expect("no EOF/reset") {
            Ok(0) => {}
            Ok(n) => panic!("read {n} bytes after drop"),
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionReset),
        }
        // The listener is gone (the abort is processed at the next scheduling point).
        tokio::task::yield_now().await;
        let refused = timeout(LONG, async {
            loop {
                if TcpStream::connect(addr).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(refused.is_ok(), "proxy still accepting after drop");
    }
}
