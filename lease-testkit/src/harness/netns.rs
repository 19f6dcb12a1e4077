//! Network namespaces for the members of a cluster, so that a member can be cut off from its
//! peers while its clients still reach it.
//!
//! A [`NetLab`] creates one network namespace per member, each joined to the root namespace by
//! a veth pair on its own `/30`:
//!
//! ```text
//! root namespace                          namespace <prefix>-<tag>-<i>
//!   <tag>h<i>  10.X.Y.(4i+1)/30  <-veth->  <tag>n<i>  10.X.Y.(4i+2)/30, default via 10.X.Y.(4i+1)
//! ```
//!
//! The root namespace forwards between the veths (`net.ipv4.ip_forward=1`, set on creation and
//! left on), so member `i` reaches member `j` at [`NetLab::member_ip`]`(j)` through the root
//! namespace, and clients (which stay in the root namespace, for example a
//! [`FaultProxy`](crate::proxy::FaultProxy)) reach every member directly.
//!
//! **Cuts are blackhole routes**, no firewall: [`NetLab::isolate`]`(i)` adds
//! `blackhole <ip of j>/32` inside namespace `i` and `blackhole <ip of i>/32` inside every other
//! namespace `j`, so member-to-member packets between `i` and the others are dropped in both
//! directions (established TCP connections included: a route change invalidates the sockets'
//! cached routes), while packets between `i` and the root namespace (its clients) still flow.
//! [`NetLab::heal`]`(i)` removes the routes that no other cut needs. The cut is in place when the
//! call returns.
//!
//! **Processes** run in a namespace through [`NetLab::command`] (`ip netns exec <ns> <program>`,
//! which execs the program: the child's PID is the program's, so signals reach it).
//!
//! **Cleanup.** Dropping the lab deletes its namespaces and veths. Every lab writes a marker file
//! `<tmp>/fenced-netns/<tag>` holding the creating process's PID and the names it made; creating a
//! lab first removes the namespaces and veths of markers whose process is gone (a crashed run),
//! and only those: names are never guessed. Processes still running in a namespace keep it alive
//! until they exit, so stop them before dropping the lab.
//!
//! Needs root (or `CAP_NET_ADMIN`) and iproute2's `ip`; [`NetLab::availability`] says why not.

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::harness::cluster::{Cuts, Marks};
use crate::harness::{find_in_path, HarnessError};

/// The directory holding the markers of live labs.
fn marker_dir() -> PathBuf {
    std::env::temp_dir().join("fenced-netns")
}

/// One member's namespace and addresses.
#[derive(Debug, Clone)]
struct Slot {
    namespace: String,
    host_veth: String,
    host_ip: Ipv4Addr,
    member_ip: Ipv4Addr,
}

/// Namespaces for `n` members with blackhole-route cuts (see the [module docs](self)).
#[derive(Debug)]
pub struct NetLab {
    tag: String,
    slots: Vec<Slot>,
    /// Which members are cut from their peers.
    cut: Cuts,
    marker: PathBuf,
}

impl NetLab {
    /// `Ok` when namespaces can be made here (root, `ip` on `PATH`), else why not.
    pub fn availability() -> Result<PathBuf, String> {
        let ip = find_in_path("ip")
            .ok_or("iproute2's `ip` not found in PATH (apt-get install iproute2)")?;
        if !effective_uid_is_root() {
            return Err("network namespaces need root (the harness is not running as root)".into());
        }
        Ok(ip)
    }

    /// Creates `n` namespaces named `<prefix>-<tag>-<i>` (the prefix: a few lower-case letters
    /// naming the user, e.g. `etcd`) with their veths, addresses and routes, after removing the
    /// leftovers of crashed runs. Partial setups are undone on error.
    pub fn create(prefix: &str, n: usize) -> Result<Self, HarnessError> {
        assert!(n > 0 && n <= 60, "a lab holds 1 to 60 members");
        Self::availability().map_err(|e| HarnessError::io("network namespaces", other(e)))?;
        remove_stale();
        let (tag, base) = pick_subnet()?;
        let slots: Vec<Slot> = (0..n)
            .map(|i| {
                let o = (4 * i) as u8;
                Slot {
                    namespace: format!("{prefix}-{tag}-{i}"),
                    host_veth: format!("fd{tag}h{i}"),
                    host_ip: Ipv4Addr::new(base[0], base[1], base[2], o + 1),
                    member_ip: Ipv4Addr::new(base[0], base[1], base[2], o + 2),
                }
            })
            .collect();
        let dir = marker_dir();
        fs::create_dir_all(&dir).map_err(|e| HarnessError::io("create the netns marker dir", e))?;
        let marker = dir.join(&tag);
        let mut text = format!("{}\n", std::process::id());
        for s in &slots {
            text.push_str(&format!("ns {}\nlink {}\n", s.namespace, s.host_veth));
        }
        fs::write(&marker, text).map_err(|e| HarnessError::io("write the netns marker", e))?;
        let lab = NetLab {
            tag,
            cut: Cuts::new(n),
            slots,
            marker,
        };
        // Forwarding between the veths (the members reach each other through the root namespace).
        fs::write("/proc/sys/net/ipv4/ip_forward", "1")
            .map_err(|e| HarnessError::io("enable net.ipv4.ip_forward", e))?;
        for (i, s) in lab.slots.iter().enumerate() {
            let peer = format!("fd{}n{i}", lab.tag);
            let host_cidr = format!("{}/30", s.host_ip);
            let member_cidr = format!("{}/30", s.member_ip);
            let host_ip = s.host_ip.to_string();
            let ns = s.namespace.as_str();
            ip(&["netns", "add", ns])?;
            ip(&[
                "link",
                "add",
                &s.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &peer,
                "netns",
                ns,
            ])?;
            ip(&["addr", "add", &host_cidr, "dev", &s.host_veth])?;
            ip(&["link", "set", &s.host_veth, "up"])?;
            ip(&["-n", ns, "addr", "add", &member_cidr, "dev", &peer])?;
            ip(&["-n", ns, "link", "set", &peer, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
            ip(&["-n", ns, "route", "add", "default", "via", &host_ip])?;
        }
        Ok(lab)
    }

    /// How many members the lab has.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether the lab has no member (never: [`Self::create`] refuses 0).
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The per-run tag in every name of this lab (8 hex digits).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Member `i`'s address (inside its namespace; reachable from the root namespace and, unless
    /// cut, from the other members).
    pub fn member_ip(&self, i: usize) -> Ipv4Addr {
        self.slots[i].member_ip
    }

    /// Member `i`'s namespace name.
    pub fn namespace(&self, i: usize) -> &str {
        &self.slots[i].namespace
    }

    /// A command that runs `program` inside member `i`'s namespace (`ip netns exec`, which execs
    /// it: the child's PID is the program's).
    pub fn command(&self, i: usize, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.slots[i].namespace])
            .arg(program);
        cmd
    }

    /// Cuts member `i` from every other member, both directions; its clients still reach it.
    /// In place when this returns.
    pub fn isolate(&self, i: usize) -> Result<(), HarnessError> {
        self.cut.set(i, true, |_, after| self.apply(after))
    }

    /// Undoes [`Self::isolate`] for member `i` (routes another member's cut still needs stay).
    pub fn heal(&self, i: usize) -> Result<(), HarnessError> {
        self.cut.set(i, false, |_, after| self.apply(after))
    }

    /// Whether member `i` is cut from its peers.
    pub fn is_isolated(&self, i: usize) -> bool {
        self.cut.is_cut(i)
    }

    /// Adds and removes blackhole routes so that the pair (a, b) is cut iff `a` or `b` is cut
    /// in `marks`. Each namespace's routes are read first and compared with `marks`, not with
    /// the marks before: a change that failed part-way (one `ip` command refused) is completed
    /// by the next one, instead of leaving a route that no mark accounts for.
    fn apply(&self, marks: &Marks) -> Result<(), HarnessError> {
        for a in 0..self.slots.len() {
            let ns = self.slots[a].namespace.as_str();
            let routes = ip_output(&["-n", ns, "route", "show", "type", "blackhole"])?;
            let present: Vec<&str> = routes
                .lines()
                .filter_map(|l| l.split_whitespace().nth(1))
                .map(|dst| dst.trim_end_matches("/32"))
                .collect();
            for b in 0..self.slots.len() {
                if a == b {
                    continue;
                }
                let ip_b = self.slots[b].member_ip.to_string();
                let target = format!("{ip_b}/32");
                match (marks.severs(a, b), present.contains(&ip_b.as_str())) {
                    (true, false) => ip(&["-n", ns, "route", "replace", "blackhole", &target])?,
                    (false, true) => ip(&["-n", ns, "route", "del", "blackhole", &target])?,
                    _ => {}
                }
            }
        }
        Ok(())
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        for s in &self.slots {
            let _ = ip(&["netns", "del", &s.namespace]);
            let _ = ip_quiet(&["link", "del", &s.host_veth]);
        }
        let _ = fs::remove_file(&self.marker);
    }
}

/// Whether the effective user id (`/proc/self/status`, line `Uid:`, second field) is 0.
fn effective_uid_is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

fn other(message: String) -> std::io::Error {
    std::io::Error::other(message)
}

/// Runs `ip args…`; an error names the command and its stderr.
fn ip(args: &[&str]) -> Result<(), HarnessError> {
    ip_output(args).map(drop)
}

/// Runs `ip args…` and returns what it printed; an error names the command and its stderr.
fn ip_output(args: &[&str]) -> Result<String, HarnessError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError::io(format!("run ip {}", args.join(" ")), e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(HarnessError::io(
            format!("ip {}", args.join(" ")),
            other(format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
        ))
    }
}

/// Like [`ip`], for cleanup where "does not exist" is the expected answer.
fn ip_quiet(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A fresh tag and a `10.X.Y.0/24` no address or route of the root namespace uses.
fn pick_subnet() -> Result<(String, [u8; 3]), HarnessError> {
    let used = Command::new("ip")
        .args(["-4", "route", "show", "table", "all"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for _ in 0..64 {
        let r: u32 = rand::random();
        let tag = format!("{r:08x}");
        let base = [10, 128 + (r >> 24) as u8 % 100, (r >> 16) as u8];
        let prefix = format!("{}.{}.{}.", base[0], base[1], base[2]);
        if !used.contains(&prefix) && !marker_dir().join(&tag).exists() {
            return Ok((tag, base));
        }
    }
    Err(HarnessError::io(
        "pick a subnet for network namespaces",
        other("64 random 10.x.y.0/24 were all in use".into()),
    ))
}

/// Removes the namespaces and veths of markers whose creating process no longer exists.
fn remove_stale() {
    let Ok(entries) = fs::read_dir(marker_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(text) = fs::read_to_string(&path) else {
            continue;
        };
        let mut lines = text.lines();
        let Some(pid) = lines.next().and_then(|l| l.trim().parse::<u32>().ok()) else {
            continue;
        };
        if crate::process::exists(pid) {
            continue;
        }
        remove_listed(lines, &path);
    }
}

fn remove_listed<'a>(lines: impl Iterator<Item = &'a str>, marker: &Path) {
    for line in lines {
        match line.split_once(' ') {
            Some(("ns", name)) => {
                // Servers a crashed run left in its own namespace: provably ours, by PID.
                if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
                    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                        if let Ok(pid) = pid.parse::<u32>() {
                            let _ = crate::process::kill(pid);
                        }
                    }
                }
                let _ = ip_quiet(&["netns", "del", name]);
            }
            Some(("link", name)) => {
                let _ = ip_quiet(&["link", "del", name]);
            }
            _ => {}
        }
    }
    let _ = fs::remove_file(marker);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::server_unavailable;

    /// The members member `a`'s namespace has a blackhole route to, in order.
    fn routed(lab: &NetLab, a: usize) -> Vec<usize> {
        let routes =
            ip_output(&["-n", lab.namespace(a), "route", "show", "type", "blackhole"]).unwrap();
        let mut to: Vec<usize> = routes
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .map(|dst| {
                let dst = dst.trim_end_matches("/32");
                (0..lab.len())
                    .find(|&b| lab.member_ip(b).to_string() == dst)
                    .unwrap_or_else(|| panic!("a blackhole route to {dst}, not a member"))
            })
            .collect();
        to.sort_unstable();
        to
    }

    #[test]
    fn a_change_completes_what_an_earlier_one_left_half_done() {
        if let Err(reason) = NetLab::availability() {
            server_unavailable("netns", reason)
                .unwrap_or_else(|e| panic!("{e}"))
                .report();
            return;
        }
        let lab = NetLab::create("lab", 3).unwrap();
        lab.isolate(1).unwrap();
        assert_eq!(
            [routed(&lab, 0), routed(&lab, 1), routed(&lab, 2)],
            [vec![1], vec![0, 2], vec![1]]
        );
        lab.heal(1).unwrap();
        assert!((0..3).all(|a| routed(&lab, a).is_empty()));
        // A heal whose `ip route del` failed in one namespace leaves a route that no mark
        // accounts for; the next change, of another member, removes it.
        let stray = format!("{}/32", lab.member_ip(1));
        ip(&[
            "-n",
            lab.namespace(0),
            "route",
            "replace",
            "blackhole",
            &stray,
        ])
        .unwrap();
        lab.isolate(2).unwrap();
        assert_eq!(
            [routed(&lab, 0), routed(&lab, 1), routed(&lab, 2)],
            [vec![2], vec![2], vec![0, 1]]
        );
        lab.heal(2).unwrap();
        assert!((0..3).all(|a| routed(&lab, a).is_empty()));
    }
}
