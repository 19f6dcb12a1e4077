//! `inspect`, `force-release` (with and without `--expect-token`), `audit` and `run`'s ordinary
//! life on every backend ([`on_every_backend!`]), and `fence read` on every fence backend.

use std::fs;
use std::time::Duration;

use conformance_tests::harness::{start_or_skip, Backend, EtcdServer, PostgresServer};
use predicates::prelude::*;

use crate::backends::{on_every_backend, Subject};
use crate::support::*;

on_every_backend!(
    inspect_of_a_free_key_exits_1,
    run_passes_the_token_and_exits_with_the_child_status,
    a_held_key_is_shown_refused_and_force_released,
    a_stale_expect_token_is_refused_and_the_right_one_removes,
    audit_lists_forced_releases_newest_first,
    a_lease_lost_just_before_the_command_exits_is_reported_lost,
);

fn inspect_of_a_free_key_exits_1(s: &Subject, _test: &str) {
    let url = s.url.as_str();
    fenced()
        .args(["--url", url, "inspect", "jobs/free"])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("free"))
        .stderr("");
    // FENCED_URL does as well as --url; --json says the same.
    let out = fenced()
        .env("FENCED_URL", url)
        .args(["inspect", "jobs/free", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["held"], false);
    assert_eq!(v["key"], "jobs/free");
    assert_eq!(v["backend"], s.name());
}

// run ---

/// A lease force-released by the command itself, which then exits at once: whether `run` hears
/// of the loss while the command runs or only when its release finds the key gone, it exits 76
/// and says so. Before, a loss found by the release was dropped without a word and `run` exited
/// with the command's 0 (on Consul, whose monitor spaces its queries, nearly always).
fn a_lease_lost_just_before_the_command_exits_is_reported_lost(s: &Subject, _test: &str) {
    let out = fenced()
        .env("FENCED_BIN", fenced_bin())
        .env("OPERATOR_URL", s.url.as_str())
        .args([
            "--url",
            s.url.as_str(),
            "run",
            "jobs/lost",
            "--ttl",
            "30s",
            "--",
        ])
        .args([
            "sh",
            "-c",
            r#""$FENCED_BIN" --url "$OPERATOR_URL" force-release "$FENCED_KEY" \
                 --actor ops --reason test >/dev/null || exit 9; exit 0"#,
        ])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(76), "{err}");
    assert!(err.contains("lost") || err.contains("Lost"), "{err}");
    let (code, v) = inspect_json(s.url.as_str(), "jobs/lost");
    assert_eq!(code, 1, "the key is free: {v}");
}

fn run_passes_the_token_and_exits_with_the_child_status(s: &Subject, _test: &str) {
    let url = s.url.as_str();
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
            "--ttl",
            "5s",
            "--",
            "/nonexistent/fenced-test-cmd",
        ])
        .assert()
        .code(127)
        .stderr(predicate::str::contains("/nonexistent/fenced-test-cmd"));
    assert_eq!(inspect_json(url, "jobs/b").0, 1);
}

// (c) and (d) ---

fn a_held_key_is_shown_refused_and_force_released(s: &Subject, _test: &str) {
    let (url, ttl) = (s.url.as_str(), "3s");
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

// force-release --expect-token ---

/// `force-release --expect-token` with a stale token (the holder changed after `inspect`) is
/// refused with status 1 and removes nothing; with the holder's token it removes it; on a free
/// key it is refused and says the key is free.
fn a_stale_expect_token_is_refused_and_the_right_one_removes(s: &Subject, _test: &str) {
    let url = s.url.as_str();
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

// audit ---

/// `fenced audit KEY --json` as `(status, value)`.
fn audit_json(url: &str, key: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = vec!["--url", url, "audit", key, "--json"];
    args.extend_from_slice(extra);
    json_of(&args)
}

/// Two forced releases by different actors: `audit` lists both newest first (status 0) with
/// actor, reason, removed token and owner, in JSON and one line each in text; `--limit 1` shows
/// the newest only; a key never force-released has an empty trail (status 1).
fn audit_lists_forced_releases_newest_first(s: &Subject, _test: &str) {
    let url = s.url.as_str();
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

// fence read -------------------------------------------------------------------------------

/// `fence read` of a resource never written (status 1), then of one written under token 7
/// (status 0, the token and the value), on the fence at `url`.
fn fence_read_shows_the_newest_token_and_value(url: &str, backend: &str) {
    fenced()
        .args(["fence", "read", "orders/42", "--fence-url", url])
        .assert()
        .code(1)
        .stdout(predicate::str::contains("never accepted"));
    fence_write(url, "orders/42", 7, b"paid");
    let out = fenced()
        .env("FENCED_FENCE_URL", url)
        .args(["fence", "read", "orders/42", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["backend"], backend, "{v}");
    assert_eq!(v["newest_token"], 7, "{v}");
    assert_eq!(v["value"]["token"], 7);
    assert_eq!(v["value"]["utf8"], "paid");
    fenced()
        .args(["fence", "read", "orders/42", "--fence-url", url])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("written by 7"))
        .stdout(predicate::str::contains("paid"));

    // fence write: a token below the newest is refused as stale (76, nothing written); the
    // token comes from --token or FENCED_TOKEN (as `fenced run` sets it).
    let out = fenced()
        .args(["fence", "write", "orders/42", "late", "--token", "5"])
        .args(["--fence-url", url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(LOST), "{}", stderr_of(&out));
    assert_one_line(&stderr_of(&out));
    assert!(stderr_of(&out).contains("stale"), "{}", stderr_of(&out));
    assert!(
        out.stdout.is_empty(),
        "text mode prints the refusal on stderr only"
    );
    let (code, v) = json_of(&[
        "fence",
        "write",
        "orders/42",
        "late",
        "--token",
        "5",
        "--fence-url",
        url,
        "--json",
    ]);
    assert_eq!(code, LOST, "{v}");
    assert_eq!(
        (&v["written"], &v["token"], &v["newest_token"]),
        (&false.into(), &5.into(), &7.into()),
        "{v}"
    );
    let out = fenced()
        .env("FENCED_TOKEN", "8")
        .args(["fence", "write", "orders/42", "shipped", "--json"])
        .args(["--fence-url", url])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (&v["token"], &v["previous_token"]),
        (&8.into(), &7.into()),
        "{v}"
    );
    let (_, v) = json_of(&["fence", "read", "orders/42", "--fence-url", url, "--json"]);
    assert_eq!(
        (&v["newest_token"], &v["value"]["utf8"]),
        (&8.into(), &"shipped".into()),
        "{v}"
    );
}

mod fence_read {
    use super::*;

    #[test]
    fn redis() {
        let test = "fence_read::redis";
        if let Some(s) = Subject::start(test, Backend::Redis) {
            let url = s.fence_url(test).expect("the coordinator's Redis");
            fence_read_shows_the_newest_token_and_value(&url, "redis");
        }
    }

    #[test]
    fn etcd() {
        if let Some(server) = start_or_skip("fence_read::etcd", Backend::Etcd, EtcdServer::start) {
            fence_read_shows_the_newest_token_and_value(&server.url(), "etcd");
        }
    }

    /// Reading never creates the fence table (it did, with the fence's default `migrate`): a
    /// table that is not there, or a mistyped `table=`, is a misconfiguration naming it (78),
    /// not a resource that never accepted a token. Once a write has created it, reads work.
    #[test]
    fn postgres() {
        let test = "fence_read::postgres";
        if let Some(server) = start_or_skip(test, Backend::Postgres, PostgresServer::start) {
            let url = server.connection_url();
            let sep = if url.contains('?') { '&' } else { '?' };
            let typo = format!("{url}{sep}table=fence_token");
            for _ in 0..2 {
                let out = fenced()
                    .args(["fence", "read", "orders/42", "--fence-url", &typo])
                    .output()
                    .unwrap();
                let err = stderr_of(&out);
                assert_eq!(out.status.code(), Some(78), "{err}");
                assert_one_line(&err);
                assert!(err.contains("fence_token"), "{err}");
            }
            let out = fenced()
                .args(["token-floor", "suggest", "jobs/k", "--url", "memory://"])
                .args(["--fence", &typo, "--resource", "orders/42"])
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(78), "{}", stderr_of(&out));
            fence_write(&url, "orders/0", 1, b"created the table");
            fence_read_shows_the_newest_token_and_value(&url, "postgres");
            // Still not created by the reads: the mistyped table is refused as before.
            let out = fenced()
                .args(["fence", "read", "orders/42", "--fence-url", &typo])
                .output()
                .unwrap();
            assert_eq!(out.status.code(), Some(78), "{}", stderr_of(&out));
        }
    }

    /// A host list (`target_session_attrs` picks among them on failover) reaches the fence
    /// whole: the first host refuses connections, the second is the server.
    #[test]
    fn postgres_host_list() {
        let test = "fence_read::postgres_host_list";
        if let Some(server) = start_or_skip(test, Backend::Postgres, PostgresServer::start) {
            let dead = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap();
            let url = format!("postgres://postgres@{dead},{}/postgres", server.addr());
            fence_write(&url, "orders/7", 3, b"v");
            fenced()
                .args(["fence", "read", "orders/7", "--fence-url", &url])
                .assert()
                .code(0)
                .stdout(predicate::str::contains("written by 3"));
        }
    }
}
