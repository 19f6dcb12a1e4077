//! The `fenced` binary against real servers the conformance harness starts (Redis for every
//! command, etcd for `run`), and its usage errors without any server.
//!
//! A missing server is a named skip on a developer machine and a failure under `CI=true`.
//! Tests wait for conditions with bounded deadlines; none sleeps to synchronise.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::Command;
use conformance_tests::harness::{start_or_skip, Backend, EtcdServer, RedisServer};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use predicates::prelude::*;

/// Statuses documented in the README.
const NOT_ACQUIRED: i32 = 75;
const LOST: i32 = 76;
const USAGE: i32 = 2;
const UNAVAILABLE: i32 = 69;
/// force-release --expect-token: the holder has another token, or the key is free.
const REFUSED: i32 = 1;

/// `fenced` with a clean environment: no backend unless the test gives one.
fn fenced() -> Command {
    let mut c = Command::cargo_bin("fenced").expect("the fenced binary");
    c.env_remove("FENCED_URL")
        .env_remove("FENCED_FENCE_URL")
        .env_remove("CONSUL_HTTP_ADDR")
        .env_remove("RUST_LOG")
        .timeout(Duration::from_secs(60));
    c
}

fn redis(test: &str) -> Option<RedisServer> {
    start_or_skip(test, Backend::Redis, RedisServer::start)
}

fn etcd(test: &str) -> Option<EtcdServer> {
    start_or_skip(test, Backend::Etcd, EtcdServer::start)
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn assert_one_line(stderr: &str) {
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
}

/// Polls `f` until it returns `Some` or `limit` passes.
fn eventually<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `fenced run` started in the background, whose child shell records its token and the
/// SIGTERM it gets in `dir`. Dropped: SIGTERM to `fenced` (forwarded to the child), then SIGKILL.
struct Holder {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

/// The child: write the token, then idle (bounded, about 60 s) until SIGTERM, recorded.
const HOLDER_SCRIPT: &str = r#"trap 'echo term > "$DIR/term"; exit 143' TERM
echo "$FENCED_KEY $FENCED_TOKEN" > "$DIR/token.tmp" && mv "$DIR/token.tmp" "$DIR/token"
i=0; while [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done"#;

impl Holder {
    fn start(url: &str, key: &str, extra: &[&str]) -> Holder {
        let dir = tempfile::tempdir().unwrap();
        let out = fs::File::create(dir.path().join("run.out")).unwrap();
        let err = fs::File::create(dir.path().join("run.err")).unwrap();
        let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("fenced"))
            .env_remove("FENCED_URL")
            .env_remove("RUST_LOG")
            .env("DIR", dir.path())
            .args(["--url", url, "run", key])
            .args(extra)
            .args(["--", "sh", "-c", HOLDER_SCRIPT])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap();
        let mut h = Holder {
            child: Some(child),
            dir,
        };
        let token_file = h.path("token");
        let child = h.child.as_mut().unwrap();
        eventually(
            Duration::from_secs(20),
            "the child to report its token",
            || {
                if let Some(status) = child.try_wait().unwrap() {
                    panic!(
                        "fenced run exited early with {status}: {}",
                        fs::read_to_string(dir_err(&token_file)).unwrap_or_default()
                    );
                }
                fs::read_to_string(&token_file)
                    .ok()
                    .filter(|s| s.ends_with('\n'))
            },
        );
        h
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `(key, token)` as the child saw them in `FENCED_KEY` and `FENCED_TOKEN`.
    fn seen(&self) -> (String, u64) {
        let s = fs::read_to_string(self.path("token")).unwrap();
        let (key, token) = s.trim().split_once(' ').expect("key and token");
        (key.to_owned(), token.parse().expect("a numeric token"))
    }

    fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        let status = eventually(limit, "fenced run to exit", || child.try_wait().unwrap());
        self.child = None;
        status
    }

    fn stderr(&self) -> String {
        fs::read_to_string(self.path("run.err")).unwrap_or_default()
    }
}

fn dir_err(token_file: &Path) -> PathBuf {
    token_file.with_file_name("run.err")
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn inspect_json(url: &str, key: &str) -> (i32, serde_json::Value) {
    let out = fenced()
        .args(["--url", url, "inspect", key, "--json"])
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("inspect --json printed no JSON ({e}): {}", stderr_of(&out)));
    (out.status.code().expect("exited"), v)
}

// (a) --------------------------------------------------------------------------------------

#[test]
fn redis_inspect_of_a_free_key_exits_1() {
    let Some(server) = redis("redis_inspect_of_a_free_key_exits_1") else {
        return;
    };
    let url = server.url_with_auth();
    fenced()
        .args(["--url", &url, "inspect", "jobs/free"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("free"))
        .stderr("");
    // FENCED_URL does as well as --url; --json says the same.
    let out = fenced()
        .env("FENCED_URL", &url)
        .args(["inspect", "jobs/free", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["held"], false);
    assert_eq!(v["key"], "jobs/free");
    assert_eq!(v["backend"], "redis");
}

// (b) --------------------------------------------------------------------------------------

fn run_passes_the_token_and_exits_with_the_child_status(url: &str) {
    let out = fenced()
        .args(["--url", url, "run", "jobs/b", "--ttl", "5s", "--"])
        .args([
            "sh",
            "-c",
            r#"echo "token=$FENCED_TOKEN key=$FENCED_KEY"; exit 3"#,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout} / {}", stderr_of(&out));
    assert_eq!(stderr_of(&out), "", "silent on success");
    let line = stdout.trim();
    let token = line
        .strip_prefix("token=")
        .and_then(|rest| rest.strip_suffix(" key=jobs/b"))
        .unwrap_or_else(|| panic!("unexpected child output {line:?}"));
    assert!(token.parse::<u64>().is_ok_and(|t| t > 0), "{token:?}");
    let (code, v) = inspect_json(url, "jobs/b");
    assert_eq!(
        (code, &v["held"]),
        (1, &serde_json::Value::Bool(false)),
        "{v}"
    );
    // A child killed by a signal: 128 + N, as a shell reports it.
    fenced()
        .args(["--url", url, "run", "jobs/b", "--ttl", "5s", "--"])
        .args(["sh", "-c", "kill -KILL $$"])
        .assert()
        .code(128 + 9);
    // A command that does not exist: 127, and the key is released.
    fenced()
        .args([
            "--url",
            url,
            "run",
            "jobs/b",
            "--",
            "/nonexistent/fenced-test-cmd",
        ])
        .assert()
        .code(127)
        .stderr(predicate::str::contains("/nonexistent/fenced-test-cmd"));
    assert_eq!(inspect_json(url, "jobs/b").0, 1);
}

#[test]
fn redis_run_passes_the_token_and_exits_with_the_child_status() {
    let Some(server) = redis("redis_run_passes_the_token_and_exits_with_the_child_status") else {
        return;
    };
    run_passes_the_token_and_exits_with_the_child_status(&server.url_with_auth());
}

#[test]
fn etcd_run_passes_the_token_and_exits_with_the_child_status() {
    let Some(server) = etcd("etcd_run_passes_the_token_and_exits_with_the_child_status") else {
        return;
    };
    run_passes_the_token_and_exits_with_the_child_status(&server.url());
}

// (c) and (d) ------------------------------------------------------------------------------

fn a_held_key_is_shown_refused_and_force_released(url: &str, ttl: &str) {
    let mut holder = Holder::start(url, "jobs/held", &["--ttl", ttl, "--operation", "nightly"]);
    let (key, token) = holder.seen();
    assert_eq!(key, "jobs/held");

    // (c) inspect shows the holder.
    let (code, v) = inspect_json(url, "jobs/held");
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["held"], true);
    assert_eq!(v["holder"]["token"], token);
    assert_eq!(v["holder"]["operation"], "nightly");
    fenced()
        .args(["--url", url, "inspect", "jobs/held"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains(format!("token      {token}")));

    // (c) a second run does not get the key.
    let out = fenced()
        .args([
            "--url",
            url,
            "run",
            "jobs/held",
            "--wait",
            "200ms",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(NOT_ACQUIRED), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert_one_line(&err);
    assert!(
        err.contains("not acquired") && err.contains(&token.to_string()),
        "{err}"
    );

    // (d) force-release without --reason: refused, nothing removed.
    let out = fenced()
        .args(["--url", url, "force-release", "jobs/held", "--actor", "ops"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(USAGE));
    let err = stderr_of(&out);
    assert_one_line(&err);
    assert!(err.contains("--reason"), "{err}");
    let out = fenced()
        .args([
            "--url",
            url,
            "force-release",
            "jobs/held",
            "--reason",
            "stuck",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(USAGE));
    assert!(stderr_of(&out).contains("--actor"), "{}", stderr_of(&out));
    let (code, v) = inspect_json(url, "jobs/held");
    assert_eq!(
        (code, &v["holder"]["token"]),
        (0, &token.into()),
        "still held: {v}"
    );

    // (d) with actor and reason: removed, and the running child is stopped with SIGTERM.
    let out = fenced()
        .args(["--url", url, "force-release", "jobs/held", "--json"])
        .args(["--actor", "ops", "--reason", "stuck job"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["removed"]["token"], token, "{v}");
    assert_eq!(v["actor"], "ops");
    let status = holder.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(LOST), "{}", holder.stderr());
    assert_eq!(
        fs::read_to_string(holder.path("term"))
            .unwrap_or_default()
            .trim(),
        "term",
        "the child got SIGTERM"
    );
    let err = holder.stderr();
    assert_one_line(&err);
    assert!(err.contains("lost") && err.contains("SIGTERM"), "{err}");

    // Nothing left behind; a second force-release finds the key free.
    assert_eq!(inspect_json(url, "jobs/held").0, 1);
    fenced()
        .args(["--url", url, "force-release", "jobs/held"])
        .args(["--actor", "ops", "--reason", "again"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("was free"));
}

#[test]
fn redis_a_held_key_is_shown_refused_and_force_released() {
    let Some(server) = redis("redis_a_held_key_is_shown_refused_and_force_released") else {
        return;
    };
    a_held_key_is_shown_refused_and_force_released(&server.url_with_auth(), "3s");
}

#[test]
fn etcd_a_held_key_is_shown_refused_and_force_released() {
    let Some(server) = etcd("etcd_a_held_key_is_shown_refused_and_force_released") else {
        return;
    };
    a_held_key_is_shown_refused_and_force_released(&server.url(), "3s");
}

// force-release --expect-token -------------------------------------------------------------

/// `force-release --expect-token` with a stale token (the holder changed after `inspect`) is
/// refused with status 1 and removes nothing; with the holder's token it removes it; on a free
/// key it is refused and says the key is free.
fn a_stale_expect_token_is_refused_and_the_right_one_removes(url: &str) {
    let key = "jobs/expect";
    let first = Holder::start(url, key, &["--ttl", "3s"]);
    let (_, stale) = first.seen();
    drop(first);
    eventually(
        Duration::from_secs(20),
        "the first holder to release",
        || (inspect_json(url, key).0 == 1).then_some(()),
    );
    let mut second = Holder::start(url, key, &["--ttl", "3s"]);
    let (_, current) = second.seen();
    assert!(current > stale, "tokens {stale} then {current}");

    let out = fenced()
        .args(["--url", url, "force-release", key, "--json"])
        .args(["--actor", "ops", "--reason", "stuck after inspect"])
        .args(["--expect-token", &stale.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(REFUSED), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["refused"], true, "{v}");
    assert_eq!(v["expected_token"], stale, "{v}");
    assert_eq!(v["found_token"], current, "{v}");
    assert_eq!(v["removed"], serde_json::Value::Null, "{v}");
    assert_eq!(v["holder"]["token"], current, "{v}");
    fenced()
        .args(["--url", url, "force-release", key])
        .args(["--actor", "ops", "--reason", "stuck after inspect"])
        .args(["--expect-token", &stale.to_string()])
        .assert()
        .code(REFUSED)
        .stdout(predicate::str::contains(format!(
            "refused: {key} is held under token {current}, not held under token {stale}"
        )))
        .stdout(predicate::str::contains(format!("token      {current}")));
    // Nothing removed: the holder still holds, and its command still runs.
    let (code, v) = inspect_json(url, key);
    assert_eq!((code, &v["holder"]["token"]), (0, &current.into()), "{v}");
    assert!(
        second.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "the holder's run exited after a refused force-release: {}",
        second.stderr()
    );

    let out = fenced()
        .args(["--url", url, "force-release", key, "--json"])
        .args(["--actor", "ops", "--reason", "stuck after inspect"])
        .args(["--expect-token", &current.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["refused"], false, "{v}");
    assert_eq!(v["expected_token"], current, "{v}");
    assert_eq!(v["removed"]["token"], current, "{v}");
    let status = second.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(LOST), "{}", second.stderr());

    let out = fenced()
        .args(["--url", url, "force-release", key, "--json"])
        .args(["--actor", "ops", "--reason", "again"])
        .args(["--expect-token", &current.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(REFUSED), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["found_token"], serde_json::Value::Null, "{v}");
    assert_eq!(v["holder"], serde_json::Value::Null, "{v}");
    fenced()
        .args(["--url", url, "force-release", key])
        .args(["--actor", "ops", "--reason", "again"])
        .args(["--expect-token", &current.to_string()])
        .assert()
        .code(REFUSED)
        .stdout(predicate::str::contains("state      free"));
}

#[test]
fn redis_a_stale_expect_token_is_refused_and_the_right_one_removes() {
    let Some(server) = redis("redis_a_stale_expect_token_is_refused_and_the_right_one_removes")
    else {
        return;
    };
    a_stale_expect_token_is_refused_and_the_right_one_removes(&server.url_with_auth());
}

#[test]
fn etcd_a_stale_expect_token_is_refused_and_the_right_one_removes() {
    let Some(server) = etcd("etcd_a_stale_expect_token_is_refused_and_the_right_one_removes")
    else {
        return;
    };
    a_stale_expect_token_is_refused_and_the_right_one_removes(&server.url());
}

// audit ------------------------------------------------------------------------------------

/// `fenced audit KEY --json` as `(status, value)`.
fn audit_json(url: &str, key: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let out = fenced()
        .args(["--url", url, "audit", key, "--json"])
        .args(extra)
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("audit --json printed no JSON ({e}): {}", stderr_of(&out)));
    (out.status.code().expect("exited"), v)
}

/// Two forced releases by different actors: `audit` lists both newest first (status 0) with
/// actor, reason, removed token and owner, in JSON and one line each in text; `--limit 1` shows
/// the newest only; a key never force-released has an empty trail (status 1).
fn audit_lists_forced_releases_newest_first(url: &str) {
    let key = "jobs/audited";
    let (code, v) = audit_json(url, key, &[]);
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["records"], serde_json::json!([]), "{v}");
    fenced()
        .args(["--url", url, "audit", key])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("no forced release recorded"));

    let mut removed = Vec::new();
    for (actor, reason) in [
        ("alice", "stuck after deploy 1"),
        ("bob", "stuck after deploy 2"),
    ] {
        let mut holder = Holder::start(url, key, &["--ttl", "3s"]);
        let (_, token) = holder.seen();
        fenced()
            .args(["--url", url, "force-release", key])
            .args(["--actor", actor, "--reason", reason])
            .assert()
            .code(0);
        let status = holder.wait_exit(Duration::from_secs(30));
        assert_eq!(status.code(), Some(LOST), "{}", holder.stderr());
        removed.push((actor, reason, token));
    }

    let (code, v) = audit_json(url, key, &[]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["key"], key, "{v}");
    assert_eq!(v["limit"], 20, "{v}");
    let records = v["records"].as_array().expect("records");
    assert_eq!(records.len(), 2, "{v}");
    for (r, (actor, reason, token)) in records.iter().zip(removed.iter().rev()) {
        assert_eq!(r["actor"], *actor, "{v}");
        assert_eq!(r["reason"], *reason, "{v}");
        assert_eq!(r["removed_token"], *token, "{v}");
        assert!(r["removed_owner"].is_string(), "{v}");
        assert!(r["at"].is_string(), "{v}");
    }

    let (_, _, newest) = removed[1];
    let out = fenced()
        .args(["--url", url, "audit", key, "--limit", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 1, "{text}");
    for needle in [
        "actor=\"bob\"".to_owned(),
        "reason=\"stuck after deploy 2\"".to_owned(),
        format!("removed_token={newest} "),
        "removed_owner=\"".to_owned(),
    ] {
        assert!(text.contains(&needle), "{text:?} lacks {needle}");
    }
}

#[test]
fn redis_audit_lists_forced_releases_newest_first() {
    let Some(server) = redis("redis_audit_lists_forced_releases_newest_first") else {
        return;
    };
    audit_lists_forced_releases_newest_first(&server.url_with_auth());
}

#[test]
fn etcd_audit_lists_forced_releases_newest_first() {
    let Some(server) = etcd("etcd_audit_lists_forced_releases_newest_first") else {
        return;
    };
    audit_lists_forced_releases_newest_first(&server.url());
}

// fence read -------------------------------------------------------------------------------

#[test]
fn redis_fence_read_shows_the_newest_token_and_value() {
    let Some(server) = redis("redis_fence_read_shows_the_newest_token_and_value") else {
        return;
    };
    let url = server.url_with_auth();
    fenced()
        .args(["fence", "read", "orders/42", "--fence-url", &url])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("never accepted"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let fence = fenced::connect_fence(&url).await.unwrap();
        let resource = fenced::ResourceId::new("orders/42").unwrap();
        let token = fenced::Token::new(7).unwrap();
        fence
            .write(&resource, token, fenced::Bytes::from_static(b"paid"))
            .await
            .unwrap();
    });
    let out = fenced()
        .env("FENCED_FENCE_URL", &url)
        .args(["fence", "read", "orders/42", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["newest_token"], 7, "{v}");
    assert_eq!(v["value"]["token"], 7);
    assert_eq!(v["value"]["utf8"], "paid");
}

// (e) usage errors and an unreachable backend ------------------------------------------------

#[test]
fn bad_urls_durations_and_keys_are_one_line_usage_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["--url", "nosuch://h", "inspect", "k"], "nosuch"),
        (
            &["--url", "redis://u:hunter2@[bad", "inspect", "k"],
            "redis://u:***",
        ),
        (
            &[
                "--url",
                "redis://h",
                "run",
                "k",
                "--ttl",
                "10x",
                "--",
                "true",
            ],
            "10x",
        ),
        (
            &[
                "--url",
                "redis://h",
                "run",
                "k",
                "--wait",
                "soon",
                "--",
                "true",
            ],
            "soon",
        ),
        (&["--url", "redis://h", "inspect", "a//b"], "a//b"),
        (&["inspect", "k"], "--url"),
        (&["--url", "redis://h", "run", "k"], "CMD"),
        (&["fence", "read", "r"], "--fence-url"),
        (
            &["--url", "redis://h", "audit", "k", "--limit", "0"],
            "limit",
        ),
        (
            &["--url", "redis://h", "audit", "k", "--limit", "101"],
            "limit",
        ),
        (
            &["--url", "redis://h", "audit", "k", "--limit", "many"],
            "--limit",
        ),
        (
            &["--url", "redis://h", "force-release", "k"],
            "--actor NAME and --reason",
        ),
        (
            &[
                "--url",
                "redis://h",
                "force-release",
                "k",
                "--actor",
                "a",
                "--reason",
                "r",
                "--expect-token",
                "soon",
            ],
            "--expect-token",
        ),
        (
            &[
                "--url",
                "redis://h",
                "force-release",
                "k",
                "--actor",
                "a",
                "--reason",
                "r",
                "--expect-token",
                "-1",
            ],
            "-1",
        ),
    ];
    for (args, needle) in cases {
        let out = fenced().args(*args).output().unwrap();
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(USAGE), "{args:?}: {err}");
        assert_one_line(&err);
        assert!(
            err.contains(needle),
            "{args:?}: {err:?} should name {needle:?}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn an_unreachable_backend_exits_69() {
    let port = conformance_tests::harness::free_ports(1).unwrap()[0];
    let url = format!("redis://127.0.0.1:{port}/?connect_timeout_ms=500");
    let out = fenced()
        .args(["--url", &url, "inspect", "k"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{err}");
    assert_one_line(&err);
}

#[test]
fn help_documents_every_command_and_status() {
    let out = fenced().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "inspect",
        "force-release",
        "audit",
        "run",
        "fence",
        "FENCED_URL",
        "75",
        "76",
        "69",
    ] {
        assert!(help.contains(needle), "--help lacks {needle}: {help}");
    }
    let out = fenced().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["--ttl", "--wait", "--grace", "FENCED_TOKEN", "SIGTERM"] {
        assert!(help.contains(needle), "run --help lacks {needle}: {help}");
    }
    let out = fenced().args(["audit", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["--limit", "newest first", "--json", "1 if none"] {
        assert!(help.contains(needle), "audit --help lacks {needle}: {help}");
    }
    let out = fenced().args(["force-release", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["--expect-token", "--actor", "--reason", "exits 1"] {
        assert!(
            help.contains(needle),
            "force-release --help lacks {needle}: {help}"
        );
    }
}
