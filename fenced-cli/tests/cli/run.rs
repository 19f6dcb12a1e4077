//! `fenced run` when the lease is lost under a paused command (the command is stopped and its
//! late write is rejected by the fence), its metrics endpoint, and a signal during its wait.

use std::fs;
use std::io::{Read, Write};
use std::time::Duration;

use conformance_tests::harness::Backend;
use conformance_tests::process;

use crate::backends::{on_backends, on_every_backend, Subject};
use crate::support::*;

on_every_backend!(
    a_paused_command_is_stopped_and_its_stale_write_rejected,
    metrics_are_served_while_the_command_runs,
);
// Where a waiter has a place on the server.
on_backends!(
    a_signal_while_waiting_leaves_no_place_in_the_queue: etcd => Etcd, zookeeper => ZooKeeper
);

/// The holder's command: writes `first` through the fence under its token, reports its PID and
/// token, idles; on SIGTERM it tries one more write (`stale`), records that write's exit status
/// in `$DIR/stale`, and exits.
const PAUSED_SCRIPT: &str = r#"trap '"$FENCED_BIN" fence write orders/1 stale >/dev/null 2>"$DIR/stale.err"; echo $? > "$DIR/stale.tmp"; mv "$DIR/stale.tmp" "$DIR/stale"; exit 143' TERM
"$FENCED_BIN" fence write orders/1 first >/dev/null || exit 9
echo $$ > "$DIR/pid"
echo "$FENCED_KEY $FENCED_TOKEN" > "$DIR/token.tmp" && mv "$DIR/token.tmp" "$DIR/token"
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"#;

/// A holder's command and `fenced run` itself freeze (SIGSTOP, until every thread shows
/// stopped) past the TTL; meanwhile another `fenced run` takes the key and writes through the
/// fence under its higher token. `fenced run` alone is thawed: it finds its lease lost and stops
/// the command, which is still frozen (SIGTERM, then SIGCONT so that it acts on it). The command's
/// last write is rejected as stale, the fence keeps the newer holder's value, `fenced` exits 76.
fn a_paused_command_is_stopped_and_its_stale_write_rejected(s: &Subject, test: &str) {
    let Some(fence_url) = s.fence_url(test) else {
        return;
    };
    let url = s.url.as_str();
    let key = "jobs/paused";
    let bin = fenced_bin();
    let bin = bin.to_str().unwrap();
    let env = [
        ("FENCED_FENCE_URL", fence_url.as_str()),
        ("FENCED_BIN", bin),
    ];
    let mut holder = Holder::start_script(
        url,
        key,
        &["--ttl", "2s", "--grace", "10s"],
        PAUSED_SCRIPT,
        &env,
    );
    let (_, old_token) = holder.seen();
    let command: u32 = fs::read_to_string(holder.path("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let fenced_pid = holder.pid();
    process::pause(command).expect("the command frozen");
    process::pause(fenced_pid).expect("fenced run frozen");

    // Another client waits for the key (the frozen holder renews nothing) and writes under its
    // own, higher token.
    let out = fenced()
        .env("FENCED_FENCE_URL", &fence_url)
        .env("FENCED_BIN", bin)
        .args([
            "--url", url, "run", key, "--ttl", "2s", "--wait", "30s", "--",
        ])
        .args([
            "sh",
            "-c",
            r#""$FENCED_BIN" fence write orders/1 newer >/dev/null && echo "$FENCED_TOKEN""#,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let new_token: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(new_token > old_token, "tokens {old_token} then {new_token}");

    // Only fenced run thaws; the command stays frozen until fenced stops it.
    process::resume(fenced_pid).expect("fenced run thawed");
    let status = holder.wait_exit(Duration::from_secs(30));
    let err = holder.stderr();
    assert_eq!(status.code(), Some(LOST), "{err}");
    assert_one_line(&err);
    assert!(err.contains("lost") && err.contains("SIGTERM"), "{err}");
    assert!(
        !err.contains("SIGKILL"),
        "the frozen command got SIGKILL: {err}"
    );
    eventually(Duration::from_secs(10), "the command to be gone", || {
        (!process::exists(command)).then_some(())
    });

    // Its late write was tried and refused as stale; the newer holder's value stands.
    let stale = fs::read_to_string(holder.path("stale")).unwrap_or_default();
    assert_eq!(
        stale.trim(),
        LOST.to_string(),
        "the command's last write: {}",
        fs::read_to_string(holder.path("stale.err")).unwrap_or_default()
    );
    let (code, v) = json_of(&[
        "fence",
        "read",
        "orders/1",
        "--fence-url",
        &fence_url,
        "--json",
    ]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["newest_token"], new_token, "{v}");
    assert_eq!(v["value"]["token"], new_token, "{v}");
    assert_eq!(v["value"]["utf8"], "newer", "{v}");
}

/// `GET /metrics` from `addr`, the body as text; `None` if nothing listens (yet).
fn scrape(addr: &str) -> Option<String> {
    let mut stream = std::net::TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: fenced\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// The sample lines of `metric` (`name{labels} value`, or `name_bucket{...}` and the like).
fn samples<'a>(body: &'a str, metric: &str) -> Vec<&'a str> {
    body.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(metric))
        .collect()
}

/// `fenced run --metrics-addr` serves the library's metrics while the command runs: the lease
/// held (gauge 1, with the backend label), the acquisition, and renewals once the keeper renewed.
/// The names come from `fenced::metrics`, the library's own constants.
fn metrics_are_served_while_the_command_runs(s: &Subject, _test: &str) {
    use fenced::metrics::{ACQUIRE_TOTAL, LEASES_HELD, RENEW_SECONDS};
    let port = conformance_tests::harness::free_ports(1).unwrap()[0];
    let addr = format!("127.0.0.1:{port}");
    let holder = Holder::start(
        &s.url,
        "jobs/metered",
        &["--ttl", "3s", "--metrics-addr", &addr],
    );
    let backend = format!("backend=\"{}\"", s.name());
    let body = eventually(
        Duration::from_secs(20),
        "a renewal in the scraped metrics",
        || scrape(&addr).filter(|b| !samples(b, RENEW_SECONDS).is_empty()),
    );
    let held = samples(&body, LEASES_HELD);
    assert!(
        held.iter()
            .any(|l| l.contains(&backend) && l.ends_with(" 1")),
        "{LEASES_HELD} {backend} 1 in {body}"
    );
    let acquired = samples(&body, ACQUIRE_TOTAL);
    assert!(
        acquired
            .iter()
            .any(|l| l.contains(&backend) && l.contains("acquired")),
        "{ACQUIRE_TOTAL} in {body}"
    );
    assert!(
        samples(&body, RENEW_SECONDS)
            .iter()
            .any(|l| l.contains("_bucket{") && l.contains(&backend)),
        "{RENEW_SECONDS} as a histogram with buckets in {body}"
    );
    assert!(
        body.contains(&format!("# HELP {LEASES_HELD}")),
        "described: {body}"
    );
    drop(holder);
}

/// While `run` waits for a held key, a spinner shows on stderr when stderr is a terminal (here a
/// pty from util-linux `script`), and nothing at all when it is not; both get the key once the
/// holder is force-released. Backend-agnostic, so on Redis only.
#[test]
fn the_wait_spinner_shows_on_a_terminal_only() {
    let test = "the_wait_spinner_shows_on_a_terminal_only";
    if conformance_tests::harness::find_in_path("script").is_none() {
        // Debian's bsdutils (essential) has it; a named skip elsewhere, a failure under CI=true.
        conformance_tests::harness::server_unavailable(test, "util-linux `script` not in PATH")
            .unwrap_or_else(|e| panic!("{e}"))
            .report();
        return;
    }
    let Some(s) = Subject::start(test, Backend::Redis) else {
        return;
    };
    let url = s.url.as_str();
    let key = "jobs/spin";
    let holder = Holder::start(url, key, &["--ttl", "10s"]);
    let waiter = |tty: bool| {
        let args = ["--url", url, "run", key, "--wait", "30s", "--", "true"];
        let mut c = if tty {
            let line = std::iter::once(fenced_bin().to_str().unwrap().to_owned())
                .chain(args.iter().map(|a| format!("'{a}'")))
                .collect::<Vec<_>>()
                .join(" ");
            let mut c = std::process::Command::new("script");
            c.args(["-q", "-e", "-c", &line, "/dev/null"]);
            c
        } else {
            let mut c = std::process::Command::new(fenced_bin());
            c.args(args);
            c
        };
        c.env_remove("FENCED_URL")
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let plain = waiter(false);
    let mut tty = waiter(true);
    // The terminal's output, read as it comes.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut tty_out = tty.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = tty_out.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    eventually(
        Duration::from_secs(20),
        "the spinner on the terminal",
        || {
            while let Ok(chunk) = rx.try_recv() {
                seen.extend(chunk);
            }
            String::from_utf8_lossy(&seen)
                .contains(&format!("waiting for {key}"))
                .then_some(())
        },
    );
    // Both waiters now wait (the spinner starts after a quarter second): free the key.
    fenced()
        .args([
            "--url",
            url,
            "force-release",
            key,
            "--actor",
            "test",
            "--reason",
            "spin",
        ])
        .assert()
        .code(0);
    let status = tty.wait().unwrap();
    reader.join().unwrap();
    seen.extend(rx.try_iter().flatten());
    assert!(status.success(), "{}", String::from_utf8_lossy(&seen));
    assert!(
        String::from_utf8_lossy(&seen).contains("\r\x1b[2K"),
        "the spinner's line is cleared once the key is acquired: {:?}",
        String::from_utf8_lossy(&seen)
    );
    let out = plain.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(stderr_of(&out), "", "silent when stderr is not a terminal");
    drop(holder);
}

/// A lease granted with no more validity than `run`'s safety margin (a tenth of the TTL) would
/// end the command as soon as it started: `run` does not start it, releases, and says why (76).
/// ZooKeeper without `tick_ms` assumes a tick of half the 1.5 s session timeout, which caps a new
/// lease's validity far below a 5 s TTL's margin.
#[test]
fn a_lease_with_no_validity_to_spare_does_not_start_the_command() {
    let test = "a_lease_with_no_validity_to_spare_does_not_start_the_command";
    let Some(s) = Subject::start(test, Backend::ZooKeeper) else {
        return;
    };
    let url = s.url.split("&tick_ms=").next().unwrap().to_owned();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("started");
    let out = fenced()
        .args(["--url", &url, "run", "jobs/short", "--ttl", "5s", "--"])
        .args(["sh", "-c", r#"echo started > "$MARKER""#])
        .env("MARKER", &marker)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(LOST), "{err}");
    assert_one_line(&err);
    assert!(
        err.contains("not started") && err.contains("margin"),
        "{err}"
    );
    assert!(!marker.exists(), "the command ran: {err}");
    assert_eq!(inspect_json(&url, "jobs/short").0, 1, "released");
}

/// A signal while `fenced run` waits for the key gives the wait up: `fenced` exits 128+N saying
/// the command was not started, after deleting its place in the key's queue, so the next
/// contender gets the key as soon as the holder lets go. Before, the signal ended `fenced` at
/// once, and its place stayed until its session expired, in the way of every waiter behind it.
/// On etcd and ZooKeeper, whose waiters have a place on the server: the waiter is signalled once
/// its debug log says the place is written.
fn a_signal_while_waiting_leaves_no_place_in_the_queue(s: &Subject, _test: &str) {
    let key = "jobs/signalled-waiter";
    // A TTL whose tenth leaves ZooKeeper's 1.5 s session validity to spare (see `run`'s margin).
    let mut holder = Holder::start(&s.url, key, &["--ttl", "3s"]);
    let dir = tempfile::tempdir().unwrap();
    let err_path = dir.path().join("waiter.err");
    // With SIGTERM at its default whatever this test process ignores (fenced keeps an ignored
    // signal ignored); env execs fenced, so the PID is fenced's.
    let mut waiter = std::process::Command::new("env")
        .arg("--default-signal=HUP,INT,TERM")
        .arg(fenced_bin())
        .args([
            "--url", &s.url, "run", key, "--ttl", "3s", "--wait", "60s", "--", "true",
        ])
        .env_remove("FENCED_URL")
        .env("RUST_LOG", "adapter_etcd=debug,adapter_zookeeper=debug")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the waiter's place in the queue",
        || {
            fs::read_to_string(&err_path)
                .ok()
                .filter(|e| e.contains("in the queue"))
        },
    );
    process::send(waiter.id(), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to the waiter");
    let status = eventually(Duration::from_secs(20), "the waiter to exit", || {
        waiter.try_wait().unwrap()
    });
    let stderr = fs::read_to_string(&err_path).unwrap();
    assert_eq!(status.code(), Some(143), "{status}: {stderr}");
    assert!(
        stderr.contains(&format!(
            "SIGTERM while waiting for {key}: gave up; the command was not started"
        )),
        "{stderr}"
    );
    // The holder lets go; the next contender finds the key free at once (a zero wait).
    process::send(holder.pid(), nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to the holder");
    holder.wait_exit(Duration::from_secs(20));
    let out = fenced()
        .args([
            "--url", &s.url, "run", key, "--ttl", "3s", "--wait", "0s", "--", "true",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the key was not free once its holder let go: {}",
        stderr_of(&out)
    );
}
