//! The Consul stand-in's own tests, over HTTP: the documented semantics the adapter relies on
//! (indexes, sessions, TTL invalidation, lock-delay, blocking queries, transactions, ACL) and the
//! fault controls (kill, restart, pause).

use std::time::{Duration, Instant};

use base64::Engine as _;
use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions};
use conformance_tests::subjects::consul::consul_http;
use serde_json::{json, Value};

const TOKEN: &str = "standin-test-token";

fn start() -> ConsulStandIn {
    ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(Duration::from_millis(200))
            .acl_token(TOKEN),
    )
    .expect("stand-in starts")
}

/// One request with the right token; the JSON body (or `Value::Null`) and the index header.
async fn call(
    s: &ConsulStandIn,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (u16, Option<u64>, Value) {
    let raw = body.map(|b| b.to_string().into_bytes());
    let (status, index, bytes) = consul_http(s.addr(), method, path, Some(TOKEN), raw.as_deref())
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let v = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, index, v)
}

/// A transaction (`PUT /v1/txn` with `ops`): its status and body.
async fn txn(s: &ConsulStandIn, ops: Value) -> (u16, Value) {
    let (status, _, v) = call(s, "PUT", "/v1/txn", Some(ops)).await;
    (status, v)
}

async fn session(s: &ConsulStandIn, body: Value) -> String {
    let (st, _, v) = call(s, "PUT", "/v1/session/create", Some(body)).await;
    assert_eq!(st, 200, "{v}");
    v["ID"].as_str().expect("ID").to_owned()
}

async fn put(s: &ConsulStandIn, path: &str, value: &str) -> (u16, Value) {
    let (status, _, bytes) =
        consul_http(s.addr(), "PUT", path, Some(TOKEN), Some(value.as_bytes()))
            .await
            .unwrap();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

async fn get(s: &ConsulStandIn, key: &str) -> (u16, Option<u64>, Value) {
    let (st, idx, v) = call(s, "GET", &format!("/v1/kv/{key}"), None).await;
    (st, idx, if st == 200 { v[0].clone() } else { Value::Null })
}

/// Starts a blocking `GET` of `path_and_query` and returns once the stand-in has read it: every
/// change after that wakes it. (The count is taken before the query is sent, so a query read at
/// once is not waited for forever.)
async fn blocking_get(
    s: &ConsulStandIn,
    path_and_query: String,
) -> tokio::task::JoinHandle<(u16, Option<u64>, bytes::Bytes)> {
    let (addr, reads) = (s.addr(), s.blocking_reads());
    let waiter = tokio::spawn(async move {
        consul_http(addr, "GET", &path_and_query, Some(TOKEN), None)
            .await
            .unwrap()
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.blocking_reads() == reads {
        assert!(Instant::now() < deadline, "the query never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    waiter
}

#[tokio::test]
async fn lock_index_restarts_at_one_after_delete_while_modify_index_rises() {
    let s = start();
    let id = session(&s, json!({"Checks": [], "LockDelay": "0s"})).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/k?acquire={id}"), "a").await,
        (200, json!(true))
    );
    let (_, idx1, e1) = get(&s, "k").await;
    assert_eq!(e1["LockIndex"], 1);
    assert_eq!(e1["Session"], id.as_str());
    assert_eq!(
        Some(e1["ModifyIndex"].as_u64().unwrap()),
        idx1,
        "X-Consul-Index is the ModifyIndex"
    );
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(e1["Value"].as_str().unwrap())
            .unwrap(),
        b"a"
    );
    assert_eq!(
        put(&s, &format!("/v1/kv/k?release={id}"), "b").await,
        (200, json!(true))
    );
    assert_eq!(
        put(&s, &format!("/v1/kv/k?acquire={id}"), "c").await,
        (200, json!(true))
    );
    let (_, _, e2) = get(&s, "k").await;
    assert_eq!(e2["LockIndex"], 2);
    let (st, _, v) = call(&s, "DELETE", "/v1/kv/k", None).await;
    assert_eq!((st, v), (200, json!(true)));
    assert_eq!(get(&s, "k").await.0, 404);
    assert_eq!(
        put(&s, &format!("/v1/kv/k?acquire={id}"), "d").await,
        (200, json!(true))
    );
    let (_, _, e3) = get(&s, "k").await;
    assert_eq!(
        e3["LockIndex"], 1,
        "LockIndex starts again at 1 after the delete"
    );
    assert!(
        e3["ModifyIndex"].as_u64() > e2["ModifyIndex"].as_u64(),
        "ModifyIndex keeps rising"
    );
    assert!(e2["ModifyIndex"].as_u64() > e1["ModifyIndex"].as_u64());
    // A second session cannot take it; an unknown session is an error.
    let other = session(&s, json!({"Checks": []})).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/k?acquire={other}"), "x").await,
        (200, json!(false))
    );
    assert_eq!(put(&s, "/v1/kv/k?acquire=nope", "x").await.0, 500);
    // cas
    let idx = e3["ModifyIndex"].as_u64().unwrap();
    assert_eq!(
        put(&s, &format!("/v1/kv/k?cas={}", idx + 1), "y").await,
        (200, json!(false))
    );
    assert_eq!(
        put(&s, &format!("/v1/kv/k?cas={idx}"), "y").await,
        (200, json!(true))
    );
    assert_eq!(put(&s, "/v1/kv/new?cas=0", "z").await, (200, json!(true)));
    assert_eq!(put(&s, "/v1/kv/new?cas=0", "z").await, (200, json!(false)));
}

#[tokio::test]
async fn blocking_query_wakes_on_change_and_times_out_otherwise() {
    let s = start();
    assert_eq!(put(&s, "/v1/kv/w", "1").await, (200, json!(true)));
    let (_, idx, _) = get(&s, "w").await;
    let idx = idx.unwrap();
    // No change: answers after the wait (plus at most wait/16 of jitter) with the same index.
    let t = Instant::now();
    let (st, same, _) = call(&s, "GET", &format!("/v1/kv/w?index={idx}&wait=300ms"), None).await;
    let waited = t.elapsed();
    assert_eq!((st, same), (200, Some(idx)));
    assert!(
        waited >= Duration::from_millis(290) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    // A change wakes it at once.
    let addr = s.addr();
    let waiter = tokio::spawn(async move {
        let t = Instant::now();
        let r = consul_http(
            addr,
            "GET",
            &format!("/v1/kv/w?index={idx}&wait=10s"),
            Some(TOKEN),
            None,
        )
        .await
        .unwrap();
        (t.elapsed(), r)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !waiter.is_finished(),
        "the blocking query answered before any change"
    );
    // A change to another key does not wake it.
    put(&s, "/v1/kv/other", "x").await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "woken by another key");
    put(&s, "/v1/kv/w", "2").await;
    let (took, (st, new_idx, _)) = waiter.await.unwrap();
    assert_eq!(st, 200);
    assert!(new_idx.unwrap() > idx);
    assert!(took < Duration::from_secs(2), "{took:?}");
    // An index older than the current one answers at once.
    let t = Instant::now();
    call(&s, "GET", &format!("/v1/kv/w?index={idx}&wait=10s"), None).await;
    assert!(t.elapsed() < Duration::from_secs(1));
    // A deletion wakes a waiter with 404.
    let (_, idx, _) = get(&s, "w").await;
    let waiter = tokio::spawn(async move {
        consul_http(
            addr,
            "GET",
            &format!("/v1/kv/w?index={}&wait=10s", idx.unwrap()),
            Some(TOKEN),
            None,
        )
        .await
        .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    call(&s, "DELETE", "/v1/kv/w", None).await;
    let (st, _, _) = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st, 404);
}

/// As in Consul (memdb watch channels fire per key), a blocking query on one key is not even
/// woken by writes to other keys: 50 writes to `a` leave a query on `b` asleep (it read the store
/// once, when it arrived), and one write to `b` wakes and answers it (one more read). Lock
/// releases by session invalidation wake it too. A prefix query is woken by every commit under
/// its prefix.
#[tokio::test]
async fn a_blocking_query_on_one_key_is_woken_only_by_changes_to_that_key() {
    let s = start();
    put(&s, "/v1/kv/b", "1").await;
    let (_, idx, _) = get(&s, "b").await;
    let idx = idx.unwrap();
    let addr = s.addr();
    let reads = s.blocking_reads();
    let waiter = tokio::spawn(async move {
        consul_http(
            addr,
            "GET",
            &format!("/v1/kv/b?index={idx}&wait=10s"),
            Some(TOKEN),
            None,
        )
        .await
        .unwrap()
    });
    // Subscribed before its first read: once it has read, every later change is seen.
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.blocking_reads() == reads {
        assert!(Instant::now() < deadline, "the query never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for i in 0..50 {
        assert_eq!(put(&s, "/v1/kv/a", &i.to_string()).await.0, 200);
    }
    assert_eq!(
        s.blocking_reads(),
        reads + 1,
        "writes to another key woke the query on b"
    );
    assert!(!waiter.is_finished());
    put(&s, "/v1/kv/b", "2").await;
    let (st, new_idx, _) = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st, 200);
    assert!(new_idx.unwrap() > idx);
    assert_eq!(s.blocking_reads(), reads + 2, "one wake-up, for b's write");

    // A session's invalidation releases its lock on b and wakes b's query.
    let id = session(&s, json!({ "Checks": [] })).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/b?acquire={id}"), "held").await,
        (200, json!(true))
    );
    let (_, idx, _) = get(&s, "b").await;
    let waiter = blocking_get(&s, format!("/v1/kv/b?index={}&wait=10s", idx.unwrap())).await;
    call(&s, "PUT", &format!("/v1/session/destroy/{id}"), None).await;
    let (st, _, body) = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v[0].get("Session").is_none(), "released: {v}");

    // A prefix query is woken by a commit under its prefix.
    let (_, idx, _) = call(&s, "GET", "/v1/kv/?recurse", None).await;
    let waiter = tokio::spawn(async move {
        consul_http(
            addr,
            "GET",
            &format!("/v1/kv/?recurse&index={}&wait=10s", idx.unwrap()),
            Some(TOKEN),
            None,
        )
        .await
        .unwrap()
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    put(&s, "/v1/kv/c", "1").await;
    let (st, _, _) = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(st, 200);
}

#[tokio::test]
async fn session_ttl_invalidation_releases_locks_between_ttl_and_twice_ttl() {
    let s = start();
    let id = session(&s, json!({"TTL": "400ms", "Checks": [], "LockDelay": "0s"})).await;
    let del = session(
        &s,
        json!({"TTL": "400ms", "Checks": [], "Behavior": "delete"}),
    )
    .await;
    let t0 = Instant::now();
    assert_eq!(
        put(&s, &format!("/v1/kv/ttl?acquire={id}"), "v").await.1,
        json!(true)
    );
    assert_eq!(
        put(&s, &format!("/v1/kv/eph?acquire={del}"), "v").await.1,
        json!(true)
    );
    tokio::time::sleep(Duration::from_millis(450).saturating_sub(t0.elapsed())).await;
    // Past the TTL, not yet past twice the TTL: still valid.
    let (_, _, info) = call(&s, "GET", &format!("/v1/session/info/{id}"), None).await;
    assert_eq!(info.as_array().map(Vec::len), Some(1), "{info}");
    assert_eq!(info[0]["TTL"], "400ms");
    assert_eq!(info[0]["Behavior"], "release");
    tokio::time::sleep(Duration::from_millis(900).saturating_sub(t0.elapsed())).await;
    let (_, _, info) = call(&s, "GET", &format!("/v1/session/info/{id}"), None).await;
    assert_eq!(info, json!([]), "invalidated at twice the TTL");
    let (st, _, e) = get(&s, "ttl").await;
    assert_eq!(st, 200);
    assert!(e.get("Session").is_none(), "released: {e}");
    assert_eq!(
        get(&s, "eph").await.0,
        404,
        "behavior=delete deletes the key"
    );
    let (st, _, body) = call(&s, "PUT", &format!("/v1/session/renew/{id}"), None).await;
    assert_eq!(st, 404, "{body}");
    // Renewal keeps a session alive past twice its TTL.
    let kept = session(&s, json!({"TTL": "400ms", "Checks": []})).await;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (st, _, v) = call(&s, "PUT", &format!("/v1/session/renew/{kept}"), None).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v[0]["ID"], kept.as_str());
    }
    // TTL bounds.
    let (st, _, v) = call(
        &s,
        "PUT",
        "/v1/session/create",
        Some(json!({"TTL": "100ms"})),
    )
    .await;
    assert_eq!(st, 500, "{v}");
    assert!(v.as_str().unwrap().contains("Invalid Session TTL"));
}

#[tokio::test]
async fn lock_delay_blocks_acquire_after_invalidation() {
    let s = start();
    let id = session(&s, json!({"LockDelay": "500ms", "Checks": []})).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/ld?acquire={id}"), "").await.1,
        json!(true)
    );
    let (st, _, v) = call(&s, "PUT", &format!("/v1/session/destroy/{id}"), None).await;
    assert_eq!((st, v), (200, json!(true)));
    let t0 = Instant::now();
    let other = session(&s, json!({"Checks": []})).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/ld?acquire={other}"), "").await.1,
        json!(false)
    );
    let lock = json!([{"KV": {"Verb": "lock", "Key": "ld", "Session": other}}]);
    let (st, v) = txn(&s, lock.clone()).await;
    assert_eq!(st, 409);
    assert!(
        v["Errors"][0]["What"]
            .as_str()
            .unwrap()
            .contains("lock delay"),
        "{v}"
    );
    tokio::time::sleep(Duration::from_millis(550).saturating_sub(t0.elapsed())).await;
    let (st, v) = txn(&s, lock).await;
    assert_eq!(st, 200, "{v}");
    // A release by the holder itself starts no lock-delay.
    let rel = session(&s, json!({"LockDelay": "10s", "Checks": []})).await;
    put(&s, &format!("/v1/kv/ld2?acquire={rel}"), "").await;
    put(&s, &format!("/v1/kv/ld2?release={rel}"), "").await;
    assert_eq!(
        put(&s, &format!("/v1/kv/ld2?acquire={other}"), "").await.1,
        json!(true)
    );
}

#[tokio::test]
async fn txn_is_all_or_nothing_with_consuls_verbs_and_errors() {
    let s = start();
    let id = session(&s, json!({"Checks": []})).await;
    let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
    let (st, v) = txn(
        &s,
        json!([
            {"KV": {"Verb": "check-not-exists", "Key": "marker"}},
            {"KV": {"Verb": "lock", "Key": "t", "Session": id, "Value": b64("owner")}},
            {"KV": {"Verb": "get", "Key": "t"}},
        ]),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let results = v["Results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "check-not-exists returns no entry: {v}");
    assert_eq!(
        results[0]["KV"]["Value"],
        Value::Null,
        "write results carry no value"
    );
    assert_eq!(results[1]["KV"]["Value"], b64("owner"));
    assert_eq!(results[1]["KV"]["Session"], id.as_str());
    let token = results[1]["KV"]["ModifyIndex"].as_u64().unwrap();
    // A failing check rolls everything back and names each failed operation.
    let before = s.index();
    let (st, v) = txn(
        &s,
        json!([
            {"KV": {"Verb": "set", "Key": "side", "Value": b64("x")}},
            {"KV": {"Verb": "check-index", "Key": "t", "Index": token + 1}},
            {"KV": {"Verb": "check-session", "Key": "t", "Session": "someone-else"}},
        ]),
    )
    .await;
    assert_eq!(st, 409, "{v}");
    assert_eq!(v["Results"], Value::Null);
    let errors = v["Errors"].as_array().unwrap();
    assert_eq!(
        (errors[0]["OpIndex"].as_u64(), errors[1]["OpIndex"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(s.index(), before, "nothing applied");
    assert_eq!(get(&s, "side").await.0, 404);
    // Compare-and-delete as the adapter releases.
    let (st, v) = txn(
        &s,
        json!([
            {"KV": {"Verb": "check-index", "Key": "t", "Index": token}},
            {"KV": {"Verb": "check-session", "Key": "t", "Session": id}},
            {"KV": {"Verb": "delete", "Key": "t"}},
        ]),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(get(&s, "t").await.0, 404);
    // Unknown verbs and non-KV operations are refused.
    let (st, v) = txn(&s, json!([{"KV": {"Verb": "frobnicate", "Key": "t"}}])).await;
    assert_eq!(st, 409, "{v}");
    let (st, _) = txn(&s, json!([{"Node": {"Verb": "get"}}])).await;
    assert_eq!(st, 400);
}

/// An outside write committed just before a transaction that is then refused wakes the
/// blocking queries on its key, as every Consul commit does.
#[tokio::test]
async fn an_outside_write_before_a_refused_txn_wakes_blocking_queries() {
    let s = start();
    put(&s, "/v1/kv/w", "1").await;
    let (_, idx, _) = get(&s, "w").await;
    let idx = idx.unwrap();
    let waiter = blocking_get(&s, format!("/v1/kv/w?index={idx}&wait=10s")).await;
    s.write_before_txns("w", 1);
    let b64 = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
    let (st, v) = txn(
        &s,
        json!([
            {"KV": {"Verb": "check-index", "Key": "w", "Index": idx}},
            {"KV": {"Verb": "set", "Key": "w", "Value": b64("mine")}},
        ]),
    )
    .await;
    assert_eq!(st, 409, "the outside write moved the index first: {v}");
    let (st, new_idx, _) = tokio::time::timeout(Duration::from_secs(2), waiter)
        .await
        .expect("the outside write did not wake the query")
        .unwrap();
    assert_eq!(st, 200);
    assert!(new_idx.unwrap() > idx);
}

/// `check-not-exists` needs `key:write` in a transaction, as in Consul's `kvsPreApply`, although
/// a transaction of checks alone is served as a read.
#[tokio::test]
async fn check_not_exists_needs_write_permission() {
    let s = start();
    s.deny_key_writes(Some("denied/".into()));
    let (st, v) = txn(
        &s,
        json!([{"KV": {"Verb": "check-not-exists", "Key": "denied/x"}}]),
    )
    .await;
    assert_eq!(st, 409, "{v}");
    assert!(
        v["Errors"][0]["What"]
            .as_str()
            .unwrap()
            .contains("Permission denied"),
        "{v}"
    );
    let (st, v) = txn(&s, json!([{"KV": {"Verb": "get-tree", "Key": "denied/"}}])).await;
    assert_eq!(st, 200, "reads stay allowed: {v}");
}

#[tokio::test]
async fn acl_token_is_required_and_checked() {
    let s = start();
    let addr = s.addr();
    let (st, _, body) = consul_http(addr, "GET", "/v1/kv/a", None, None)
        .await
        .unwrap();
    assert_eq!((st, &body[..]), (403, &b"Permission denied"[..]));
    let (st, _, body) = consul_http(addr, "GET", "/v1/kv/a", Some("wrong"), None)
        .await
        .unwrap();
    assert_eq!((st, &body[..]), (403, &b"ACL not found"[..]));
    let (st, _, _) = consul_http(
        addr,
        "PUT",
        "/v1/session/create",
        Some("wrong"),
        Some(b"{}"),
    )
    .await
    .unwrap();
    assert_eq!(st, 403);
    let (st, _, _) = consul_http(addr, "GET", &format!("/v1/kv/a?token={TOKEN}"), None, None)
        .await
        .unwrap();
    assert_eq!(st, 404, "the token may also come as ?token=");
    assert_eq!(get(&s, "a").await.0, 404);
}

#[tokio::test]
async fn default_sessions_carry_serf_health_and_die_with_it() {
    let s = start();
    let default = session(&s, json!({"Name": "default"})).await;
    let none = session(
        &s,
        json!({"Checks": [], "NodeChecks": [], "ServiceChecks": []}),
    )
    .await;
    let (_, _, info) = call(&s, "GET", &format!("/v1/session/info/{default}"), None).await;
    assert_eq!(info[0]["NodeChecks"], json!(["serfHealth"]));
    assert_eq!(
        info[0]["LockDelay"], 15_000_000_000u64,
        "Consul's default lock-delay"
    );
    put(&s, &format!("/v1/kv/h?acquire={default}"), "").await;
    s.fail_serf_health();
    let (_, _, info) = call(&s, "GET", &format!("/v1/session/info/{default}"), None).await;
    assert_eq!(info, json!([]));
    let (_, _, info) = call(&s, "GET", &format!("/v1/session/info/{none}"), None).await;
    assert_eq!(info[0]["NodeChecks"], Value::Null, "no checks: {info}");
    assert!(
        get(&s, "h").await.2.get("Session").is_none(),
        "its lock was released"
    );
    // Lock-delay from the invalidation, then free.
    assert_eq!(
        put(&s, &format!("/v1/kv/h?acquire={none}"), "").await.1,
        json!(false)
    );
    let (st, _, _) = call(
        &s,
        "PUT",
        "/v1/session/create",
        Some(json!({"Name": "again"})),
    )
    .await;
    assert_eq!(st, 500, "serfHealth is critical");
    s.restore_serf_health();
}

#[tokio::test]
async fn current_consul_key_rules_are_enforced() {
    let s = start();
    for bad in ["a%20b", "conf.json", "x/../y", "%C3%A9"] {
        let (st, _, _) = call(&s, "PUT", &format!("/v1/kv/{bad}"), None).await;
        assert_eq!(st, 400, "{bad}");
    }
    assert_eq!(
        put(&s, "/v1/kv/ok/a,2Eb/c-d_e", "").await,
        (200, json!(true))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_restart_keeps_state_and_indexes_and_pause_holds_answers() {
    let mut s = start();
    let id = session(&s, json!({"TTL": "300ms", "Checks": []})).await;
    put(&s, &format!("/v1/kv/p?acquire={id}"), "v").await;
    // A lock-delay started before the crash.
    let gone = session(&s, json!({"LockDelay": "30s", "Checks": []})).await;
    put(&s, &format!("/v1/kv/ld?acquire={gone}"), "").await;
    call(&s, "PUT", &format!("/v1/session/destroy/{gone}"), None).await;
    let (_, idx, _) = get(&s, "p").await;
    tokio::task::block_in_place(|| s.kill()).unwrap();
    assert!(
        consul_http(s.addr(), "GET", "/v1/kv/p", Some(TOKEN), None)
            .await
            .is_err(),
        "killed"
    );
    // Longer than twice the TTL while down: a new leader restarts the session timers.
    tokio::time::sleep(Duration::from_millis(700)).await;
    tokio::task::block_in_place(|| s.restart()).unwrap();
    let (st, idx2, e) = get(&s, "p").await;
    assert_eq!(st, 200);
    assert_eq!(idx2, idx, "state survived the crash");
    assert_eq!(
        e["Session"],
        id.as_str(),
        "the session survived and got a fresh timer"
    );
    // Every Consul server applied the invalidation, and with it the lock-delay: a new leader
    // still refuses the key.
    let other = session(&s, json!({"Checks": []})).await;
    assert_eq!(
        put(&s, &format!("/v1/kv/ld?acquire={other}"), "").await,
        (200, json!(false)),
        "a lock-delay did not outlive the restart"
    );
    put(&s, "/v1/kv/q", "x").await;
    let (_, q_idx, _) = get(&s, "q").await;
    assert!(q_idx > idx, "indexes keep rising across restarts");
    // Pause: connections are accepted by the kernel but nothing is answered until resume.
    s.pause();
    let addr = s.addr();
    let pending = tokio::spawn(async move {
        consul_http(addr, "GET", "/v1/kv/q", Some(TOKEN), None)
            .await
            .unwrap()
            .0
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "a paused stand-in answered");
    s.resume();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(2), pending)
            .await
            .unwrap()
            .unwrap(),
        200
    );
}

#[tokio::test]
async fn answer_next_commit_applies_the_write_and_replaces_its_answer_once() {
    let s = start();
    let set = json!([{"KV": {"Verb": "set", "Key": "k", "Value": "YQ=="}}]);
    // A read-only transaction does not use it up.
    s.answer_next_commit(500, "rpc error making call: EOF");
    let (st, _) = txn(&s, json!([{"KV": {"Verb": "get", "Key": "nope"}}])).await;
    assert_eq!(st, 409);
    let (st, v) = txn(&s, set.clone()).await;
    assert_eq!((st, v), (500, json!("rpc error making call: EOF")));
    let (st, _, e) = get(&s, "k").await;
    assert_eq!(st, 200, "the write was committed");
    assert_eq!(e["Value"], "YQ==");
    let (st, v) = txn(&s, set).await;
    assert_eq!(st, 200, "once: {v}");
}
