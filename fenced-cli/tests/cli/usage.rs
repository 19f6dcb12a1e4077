//! Usage errors, an unreachable backend and the help text: no server needed.

use crate::support::*;

/// `fenced`'s commands, as its help lists them.
const COMMANDS: &[&str] = &[
    "inspect",
    "force-release",
    "audit",
    "run",
    "fence",
    "token-floor",
];

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
            &[
                "--url",
                "redis://h",
                "token-floor",
                "suggest",
                "k",
                "--fence",
                "redis://h",
            ],
            "--resource",
        ),
        (
            &[
                "--url",
                "redis://h",
                "token-floor",
                "suggest",
                "k",
                "--resource",
                "r",
            ],
            "--fence",
        ),
        (
            &[
                "--url",
                "redis://h",
                "token-floor",
                "suggest",
                "k",
                "--fence",
                "redis://h",
                "--resource",
                "a//b",
            ],
            "a//b",
        ),
        (&["token-floor", "suggest", "k"], "--url"),
        (
            &["--url", "redis://h", "token-floor", "suggest", "a//b"],
            "a//b",
        ),
        (
            &[
                "--url",
                "redis://h",
                "run",
                "k",
                "--metrics-addr",
                "nowhere",
                "--",
                "true",
            ],
            "--metrics-addr",
        ),
        (&["fence", "write", "r", "v"], "--token"),
        (&["fence", "write", "r", "v", "--token", "1"], "--fence-url"),
        (&["fence", "write", "r", "v", "--token", "x"], "--token"),
        (
            &[
                "fence",
                "write",
                "a//b",
                "v",
                "--token",
                "1",
                "--fence-url",
                "redis://h",
            ],
            "a//b",
        ),
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
    // Checked before connecting: the closed port would answer 69 (unavailable).
    let closed = "redis://127.0.0.1:1";
    let checked_first: &[(&[&str], &str)] = &[
        (
            &["--url", closed, "run", "k", "--ttl", "0s", "--", "true"],
            "TTL",
        ),
        (
            &["--url", closed, "run", "k", "--ttl", "3000d", "--", "true"],
            "TTL",
        ),
        (
            &["--url", closed, "run", "k", "--wait", "3000d", "--", "true"],
            "wait",
        ),
        (
            &[
                "--url",
                closed,
                "run",
                "k",
                "--operation",
                "a\u{7}b",
                "--",
                "true",
            ],
            "operation",
        ),
        (
            &[
                "--url",
                closed,
                "token-floor",
                "suggest",
                "k",
                "--fence",
                "nosuch://h",
                "--resource",
                "r",
            ],
            "nosuch",
        ),
    ];
    for (args, needle) in cases.iter().chain(checked_first) {
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

/// A URL given but empty (an unset variable in `--url "$REDIS_URL"`) is refused; it is not a
/// reason to send the command to the Consul agent that `CONSUL_HTTP_ADDR` names.
#[test]
fn an_empty_url_is_refused_not_replaced_by_consul() {
    let agent = "127.0.0.1:1";
    for (flag, env) in [(Some(""), None), (Some("  "), None), (None, Some(""))] {
        let mut cmd = fenced();
        cmd.env("CONSUL_HTTP_ADDR", agent);
        if let Some(env) = env {
            cmd.env("FENCED_URL", env);
        }
        if let Some(flag) = flag {
            cmd.args(["--url", flag]);
        }
        let out = cmd.args(["inspect", "k"]).output().unwrap();
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(USAGE), "{flag:?} {env:?}: {err}");
        assert_one_line(&err);
        assert!(err.contains("--url"), "{err}");
    }
}

/// An exported `FENCED_FENCE_URL` is read only when `--resource` names something to read on it:
/// without one, `token-floor suggest` asks the coordinator alone (here: unreachable, 69), and
/// does not blame a `--fence` that was never given.
#[test]
fn token_floor_without_resources_ignores_the_environments_fence() {
    let out = fenced()
        .env("FENCED_FENCE_URL", "redis://127.0.0.1:1")
        .args([
            "--url",
            "redis://127.0.0.1:1",
            "token-floor",
            "suggest",
            "k",
        ])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{err}");
    assert!(!err.contains("--fence"), "{err}");
}

/// An address already taken: a one-line usage error before anything is sent.
#[test]
fn a_metrics_address_in_use_is_a_usage_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = fenced()
        .args([
            "--url",
            "redis://127.0.0.1:1",
            "run",
            "k",
            "--metrics-addr",
            &addr,
        ])
        .args(["--", "true"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(USAGE), "{err}");
    assert_one_line(&err);
    assert!(
        err.contains("--metrics-addr") && err.contains(&addr),
        "{err}"
    );
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

/// `fenced --help` names every command, the URL variable and every exit status; each
/// subcommand's `--help` documents each of its options and lists its exit statuses.
#[test]
fn help_documents_every_command_and_status() {
    let help = |args: &[&str]| {
        let out = fenced().args(args).arg("--help").output().unwrap();
        assert!(out.status.success(), "{args:?} --help: {}", stderr_of(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&[]);
    for needle in COMMANDS.iter().chain(&["FENCED_URL", "Exit statuses"]) {
        assert!(top.contains(needle), "--help lacks {needle}: {top}");
    }
    for status in [
        "0", "1", "2", "69", "70", "74", "75", "76", "78", "126", "127", "128+N",
    ] {
        assert!(
            top.lines().any(|l| l.trim_start().starts_with(status)),
            "--help lists no status {status}: {top}"
        );
    }

    let subcommands: &[(&[&str], &[&str])] = &[
        (
            &["inspect"],
            &["<KEY>", "--json", "--url", "1   the key is free"],
        ),
        (
            &["force-release"],
            &["--actor", "--reason", "--expect-token", "--json", "exits 1"],
        ),
        (
            &["audit"],
            &["--limit", "newest first", "--json", "1 if none"],
        ),
        (
            &["run"],
            &[
                "--ttl",
                "--wait",
                "--grace",
                "--operation",
                "--metrics-addr",
                "FENCED_TOKEN",
                "FENCED_KEY",
                "SIGTERM",
                "SIGCONT",
                "SIGKILL",
                "spinner",
                "75",
                "76",
                "127",
            ],
        ),
        (&["fence", "read"], &["<RESOURCE>", "--fence-url", "--json"]),
        (
            &["fence", "write"],
            &[
                "<RESOURCE>",
                "<VALUE>",
                "--token",
                "FENCED_TOKEN",
                "--fence-url",
                "76",
            ],
        ),
        (
            &["token-floor", "suggest"],
            &["<KEY>", "--fence", "--resource", "token_floor", "--json"],
        ),
    ];
    for (path, needles) in subcommands {
        let text = help(path);
        for needle in needles.iter().chain(&["Exit statuses", "69", "70", "78"]) {
            assert!(
                text.contains(needle),
                "fenced {path:?} --help lacks {needle}: {text}"
            );
        }
    }
    for group in [&["fence"][..], &["token-floor"]] {
        let text = help(group);
        assert!(text.contains("Commands:"), "{group:?}: {text}");
    }
}

/// Output into a pipe whose reader is gone (`fenced inspect k --json | true`): no panic, and the
/// exit status is the command's (1: nobody holds the key).
#[test]
fn a_closed_stdout_pipe_keeps_the_commands_exit_status() {
    let (reader, writer) = nix::unistd::pipe().unwrap();
    drop(reader);
    let out = std::process::Command::new(fenced_bin())
        .args(["--url", "memory://", "inspect", "k", "--json"])
        .env_remove("FENCED_URL")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::from(writer))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `fenced --url memory:// <args>` with its stdout on `/dev/full` (every write fails: ENOSPC).
fn onto_a_full_disk(args: &[&str]) -> std::process::Output {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    std::process::Command::new(fenced_bin())
        .args(["--url", "memory://"])
        .args(args)
        .env_remove("FENCED_URL")
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::from(full))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap()
}

/// Output that cannot be written for another reason than a closed pipe (here a full disk,
/// `/dev/full`) is reported: status 74 and one line saying the command ran. Before, the failure
/// was dropped, and a script read an empty file as the command's answer.
#[test]
fn output_that_cannot_be_written_is_reported() {
    let out = onto_a_full_disk(&["inspect", "k", "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(74), "{stderr}");
    assert_one_line(&stderr);
    assert!(stderr.contains("output could not be written"), "{stderr}");

    // A command that took effect keeps its status: a script that saw a failure would force
    // the release again (and remove the next holder). The line on stderr says so.
    let out = onto_a_full_disk(&[
        "force-release",
        "k",
        "--actor",
        "alice",
        "--reason",
        "drill",
        "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_one_line(&stderr);
    assert!(stderr.contains("took effect"), "{stderr}");
}

/// `token-floor suggest` without a coordinator URL is a usage error before any fence is
/// connected (here the fence is unreachable: before, that was reported instead, status 69).
#[test]
fn token_floor_without_a_coordinator_url_sends_nothing() {
    let out = fenced()
        .env_remove("FENCED_URL")
        .env_remove("CONSUL_HTTP_ADDR")
        .args(["token-floor", "suggest", "k"])
        .args(["--fence", "redis://127.0.0.1:1", "--resource", "orders/1"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(USAGE), "{err}");
    assert!(err.contains("FENCED_URL"), "{err}");
}

/// `fenced`, `fenced fence` and `fenced token-floor` without a subcommand print that command's
/// whole help on stderr (its commands listed) and exit 2, also with `--url` given or FENCED_URL
/// exported. Before, the one-line error kept only the help's first line, the command's
/// description, and named no command (with a URL: clap's "requires a subcommand", naming none).
#[test]
fn a_missing_subcommand_shows_the_commands_help() {
    for (args, commands) in [
        (&[][..], COMMANDS),
        (&["fence"], &["read", "write"]),
        (&["token-floor"], &["suggest"]),
    ] {
        // Alone, after `--url`, and with FENCED_URL exported (which clap counts as given).
        let with_url = [&["--url", "memory://"][..], args].concat();
        let runs = [
            fenced().args(args).output().unwrap(),
            fenced().args(&with_url).output().unwrap(),
            fenced()
                .env("FENCED_URL", "memory://")
                .args(args)
                .output()
                .unwrap(),
        ];
        for (run, out) in runs.iter().enumerate() {
            let err = stderr_of(out);
            assert_eq!(out.status.code(), Some(USAGE), "{args:?} ({run}): {err}");
            assert!(err.contains("Usage:"), "{args:?} ({run}): {err}");
            for c in commands {
                assert!(
                    err.contains(&format!("\n  {c} ")),
                    "{args:?} ({run}) does not list {c}: {err}"
                );
            }
        }
    }
}

/// A URL given where clap expects something else (an extra argument) is quoted in clap's error
/// cut to its scheme: its password or token is never printed.
#[test]
fn a_misplaced_url_is_quoted_without_its_secret() {
    for url in [
        "redis://:s3cret@127.0.0.1:6379",
        "postgres://app:s3cret@db/app?sslmode=disable",
        "consul://s3cret@127.0.0.1:8500",
    ] {
        let out = fenced()
            .args(["--url", "memory://", "inspect", "k", url])
            .output()
            .unwrap();
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(USAGE), "{err}");
        assert_one_line(&err);
        assert!(!err.contains("s3cret"), "{err}");
        let scheme = url.split("://").next().unwrap();
        assert!(err.contains(&format!("'{scheme}://***'")), "{err}");
    }
}

/// A coordinator URL that does not parse is refused before any fence is asked: a usage error
/// naming the URL (its password hidden), not the unreachable fence's `Unavailable`.
#[test]
fn token_floor_with_a_malformed_coordinator_url_sends_nothing() {
    let out = fenced()
        .args([
            "--url",
            "redis://u:hunter2@[bad",
            "token-floor",
            "suggest",
            "k",
        ])
        .args(["--fence", "redis://127.0.0.1:1", "--resource", "orders/1"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(USAGE), "{err}");
    assert_one_line(&err);
    assert!(
        err.contains("redis://u:***") && !err.contains("hunter2"),
        "{err}"
    );
}
