//! `fenced token-floor suggest`: on every backend with a Redis fence, and with a Redis and a
//! PostgreSQL fence at once.

use conformance_tests::harness::{start_or_skip, Backend, PostgresServer};
use predicates::prelude::*;

use crate::backends::{on_every_backend, Subject};
use crate::support::*;

on_every_backend!(token_floor_is_one_above_the_highest_token_found);

/// A free key and no fence: nothing to base a floor on (status 1). A held key: one above the
/// holder's token. With a fence whose resource accepted a higher token: one above that, each
/// number printed with its source; a resource never written is listed as such.
fn token_floor_is_one_above_the_highest_token_found(s: &Subject, test: &str) {
    let Some(fence) = s.fence_url(test) else {
        return;
    };
    let url = s.url.as_str();
    let key = "jobs/restored";
    let (code, v) = json_of(&["--url", url, "token-floor", "suggest", key, "--json"]);
    assert_eq!(code, 1, "{v}");
    assert_eq!(v["suggested_floor"], serde_json::Value::Null, "{v}");
    assert_eq!(v["coordinator"]["held"], false, "{v}");
    assert_eq!(v["backend"], s.name(), "{v}");

    let holder = Holder::start(url, key, &["--ttl", "3s"]);
    let (_, held) = holder.seen();
    let (code, v) = json_of(&["--url", url, "token-floor", "suggest", key, "--json"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["coordinator"]["token"], held, "{v}");
    assert_eq!(v["suggested_floor"], held + 1, "{v}");

    // A fence accepted a token above the coordinator's (as after a restore of the coordinator).
    let accepted = held + 100;
    fence_write(&fence, "orders/1", accepted, b"x");
    let args = [
        "--url",
        url,
        "token-floor",
        "suggest",
        key,
        "--fence",
        &fence,
        "--resource",
        "orders/1",
        "--resource",
        "orders/2",
    ];
    let (code, v) = json_of(&[&args[..], &["--json"]].concat());
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["suggested_floor"], accepted + 1, "{v}");
    assert_eq!(v["highest"]["token"], accepted, "{v}");
    assert_eq!(v["fences"][0]["resource"], "orders/1", "{v}");
    assert_eq!(v["fences"][0]["newest_token"], accepted, "{v}");
    assert_eq!(
        v["fences"][1]["newest_token"],
        serde_json::Value::Null,
        "{v}"
    );
    assert!(!v.to_string().contains(&fence), "no fence URL in {v}");
    fenced()
        .args(args)
        .assert()
        .code(0)
        .stdout(predicate::str::contains(format!("token {held}")))
        .stdout(predicate::str::contains(format!(
            "orders/1: newest accepted token {accepted}"
        )))
        .stdout(predicate::str::contains("orders/2: never accepted"))
        .stdout(predicate::str::contains(format!(
            "highest      {accepted} (fence 1"
        )))
        .stdout(predicate::str::contains(format!(
            "suggested    {}",
            accepted + 1
        )))
        .stdout(predicate::str::contains(format!(
            "token_floor={}",
            accepted + 1
        )))
        .stderr("");
    drop(holder);
}

/// Two fences (Redis and PostgreSQL), each resource read on each: the highest across both
/// wins; FENCED_FENCE_URL stands in for a missing --fence; an unreachable fence is one line
/// naming it by position.
#[test]
fn token_floor_reads_every_fence_named() {
    let test = "token_floor_reads_every_fence_named";
    let Some(s) = Subject::start(test, Backend::Redis) else {
        return;
    };
    let Some(pg) = start_or_skip(test, Backend::Postgres, PostgresServer::start) else {
        return;
    };
    let (url, redis_fence, pg_fence) = (
        s.url.as_str(),
        s.fence_url(test).unwrap(),
        pg.connection_url(),
    );
    fence_write(&redis_fence, "orders/1", 40, b"a");
    fence_write(&pg_fence, "orders/2", 70, b"b");
    let (code, v) = json_of(&[
        "--url",
        url,
        "token-floor",
        "suggest",
        "jobs/k",
        "--fence",
        &redis_fence,
        "--fence",
        &pg_fence,
        "--resource",
        "orders/1",
        "--resource",
        "orders/2",
        "--json",
    ]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["suggested_floor"], 71, "{v}");
    assert_eq!(v["fences"].as_array().map(Vec::len), Some(4), "{v}");
    assert_eq!(v["fences"][3]["backend"], "postgres", "{v}");
    assert_eq!(v["fences"][3]["newest_token"], 70, "{v}");
    assert!(
        v["highest"]["source"]
            .as_str()
            .is_some_and(|w| w.contains("fence 2") && w.contains("orders/2")),
        "{v}"
    );

    let out = fenced()
        .env("FENCED_FENCE_URL", &redis_fence)
        .args(["--url", url, "token-floor", "suggest", "jobs/k"])
        .args(["--resource", "orders/1", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["suggested_floor"], 41, "{v}");

    let port = conformance_tests::harness::free_ports(1).unwrap()[0];
    let down = format!("redis://127.0.0.1:{port}/?connect_timeout_ms=500");
    let out = fenced()
        .args(["--url", url, "token-floor", "suggest", "jobs/k"])
        .args(["--fence", &redis_fence, "--fence", &down])
        .args(["--resource", "orders/1"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(UNAVAILABLE), "{err}");
    assert_one_line(&err);
    assert!(err.contains("fence 2"), "{err}");
}

/// A `token_floor` already in the coordinator URL is kept when it is above every token found
/// (before, the suggestion was one above the highest token found, lowering the floor: tokens
/// the configured floor skipped could be issued again). One below is raised as usual. A highest
/// token that leaves no floor a URL accepts is refused (status 70), not printed as advice.
#[test]
fn token_floor_keeps_a_configured_floor_above_every_token_found() {
    let test = "token_floor_keeps_a_configured_floor_above_every_token_found";
    let Some(s) = Subject::start(test, Backend::Redis) else {
        return;
    };
    let fence = s.fence_url(test).unwrap();
    let with_floor = |floor: u64| {
        let sep = if s.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}token_floor={floor}", s.url)
    };
    fence_write(&fence, "orders/1", 57, b"x");
    let suggest = |url: &str| {
        json_of(&[
            "--url",
            url,
            "token-floor",
            "suggest",
            "jobs/free",
            "--fence",
            &fence,
            "--resource",
            "orders/1",
            "--json",
        ])
    };
    let (code, v) = suggest(&with_floor(1000));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["configured_floor"], 1000, "{v}");
    assert_eq!(v["highest"]["token"], 57, "{v}");
    assert_eq!(v["suggested_floor"], 1000, "{v}");
    fenced()
        .args([
            "--url",
            &with_floor(1000),
            "token-floor",
            "suggest",
            "jobs/free",
        ])
        .args(["--fence", &fence, "--resource", "orders/1"])
        .assert()
        .code(0)
        .stdout(predicate::str::contains("keep         token_floor=1000"));
    let (code, v) = suggest(&with_floor(10));
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["suggested_floor"], 58, "{v}");

    // The largest floor a URL accepts is i64::MAX - 1: a token of that size leaves none.
    let largest_floor: u64 = 9_223_372_036_854_775_806;
    fence_write(&fence, "orders/1", largest_floor, b"y");
    let out = fenced()
        .args(["--url", &s.url, "token-floor", "suggest", "jobs/free"])
        .args(["--fence", &fence, "--resource", "orders/1"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(70), "{err}");
    assert_one_line(&err);
    assert!(err.contains("no floor a URL accepts"), "{err}");
}
