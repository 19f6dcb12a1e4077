//! Adapter behaviour the shared suite does not single out, against the Consul stand-in
//! (`conformance_tests::consul_standin`): tokens across LockIndex resets, sessions without health
//! checks, token floor, ACL errors, lock-delay back-off without polling, blocking-query hand-off,
//! cancellation mid-request, committed acquires whose answer is lost, one client's leases on one
//! key, a coordinator on the application's own HTTP client, a lease in doubt whose key was
//! deleted meanwhile, and an acquire whose every resend applied.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adapter_consul::hyper_util::client::legacy::connect::HttpConnector;
use adapter_consul::{ConsulConfig, ConsulCoordinator};
use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions};
use conformance_tests::contend::{concurrent_try_acquires, one_holder_across};
use conformance_tests::proxy::FaultProxy;
use conformance_tests::status::{sample_until_lost, Sampled};
use conformance_tests::subjects::consul::consul_http;
use lease_core::{Coordinator, Error, Lease, LeaseOptions, LeaseStatus, LockKey, LostReason};
use serde_json::{json, Value};
use tokio::time::Instant;

const TOKEN: &str = "adapter-test-token";
const TTL: Duration = Duration::from_secs(1);

fn standin() -> ConsulStandIn {
    ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(Duration::from_millis(500))
            .acl_token(TOKEN),
    )
    .expect("stand-in")
}

fn url(s: &ConsulStandIn, extra: &str) -> String {
    format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=1000&key_prefix=t{:08x}{extra}",
        s.addr(),
        rand::random::<u32>()
    )
}

async fn client(url: &str) -> ConsulCoordinator {
    ConsulCoordinator::connect_url(url).await.expect("client")
}

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Waits (bounded) until exactly one blocking query, the client's lock monitor, is parked.
async fn monitor_parked(s: &ConsulStandIn) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.blocking_in_progress() != 1 {
        assert!(
            Instant::now() < deadline,
            "{} blocking queries in progress",
            s.blocking_in_progress()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past the monitor's spacing: an answer just taken would otherwise be followed by a query.
    tokio::time::sleep(adapter_monitor_spacing()).await;
    assert_eq!(s.blocking_in_progress(), 1);
}

/// Longer than the monitor's spacing for a small prefix (100 ms plus 100 µs per key).
fn adapter_monitor_spacing() -> Duration {
    Duration::from_millis(150)
}

async fn raw(s: &ConsulStandIn, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let body = body.map(|b| b.to_string().into_bytes());
    let (st, _, bytes) = consul_http(s.addr(), method, path, Some(TOKEN), body.as_deref())
        .await
        .unwrap();
    (st, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn token_is_the_modify_index_and_keeps_rising_while_lock_index_restarts() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("orders/42");
    let mut last = 0;
    for round in 0..3 {
        let lease = c.acquire(&k, &LeaseOptions::new(TTL)).await.unwrap();
        let (st, entry) = raw(&s, "GET", &format!("/v1/kv/{}", config.kv_key(&k)), None).await;
        assert_eq!(st, 200);
        // Release deletes the key, so Consul's LockIndex is 1 every time: not a usable token.
        assert_eq!(entry[0]["LockIndex"], 1, "round {round}");
        assert_eq!(entry[0]["ModifyIndex"].as_u64(), Some(lease.token().get()));
        assert!(lease.token().get() > last, "round {round}");
        last = lease.token().get();
        lease.release().await.unwrap();
    }
}

#[tokio::test]
async fn sessions_carry_no_health_check_and_survive_a_node_failure() {
    let s = standin();
    let c = client(&url(&s, "")).await;
    let lease = c
        .acquire(&key("k"), &LeaseOptions::new(TTL * 5))
        .await
        .unwrap();
    let id = c.session_id().expect("a session");
    let (_, info) = raw(&s, "GET", &format!("/v1/session/info/{id}"), None).await;
    assert_eq!(info[0]["NodeChecks"], Value::Null, "{info}");
    // Consul reports LockDelay in nanoseconds.
    assert_eq!(
        info[0]["LockDelay"].as_u64(),
        Some(adapter_consul::DEFAULT_LOCK_DELAY.as_nanos() as u64),
        "{info}"
    );
    assert_eq!(info[0]["TTL"], "1000ms");
    assert_eq!(info[0]["Behavior"], "delete");
    s.fail_serf_health();
    lease
        .renew()
        .await
        .expect("a session without checks is not invalidated");
    lease.release().await.unwrap();
    s.restore_serf_health();
}

#[tokio::test]
async fn a_token_floor_fails_closed_and_leaves_no_lock() {
    let s = standin();
    let c = client(&url(&s, "&token_floor=1000000")).await;
    let k = key("floored");
    match c.acquire(&k, &LeaseOptions::new(TTL)).await {
        Err(Error::TokenRegression { floor, .. }) => assert_eq!(floor.get(), 1_000_000),
        other => panic!("expected TokenRegression, got {other:?}"),
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while c.inspect(&k).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "the refused lock was left behind"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_refused_acl_token_is_misconfigured_and_never_shown() {
    let s = standin();
    let bad = format!(
        "consul://{}?token=wrong-secret-xyz&session_ttl_ms=1000",
        s.addr()
    );
    let c = client(&bad).await;
    let e = c
        .acquire(&key("k"), &LeaseOptions::new(TTL))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misconfigured { .. }), "{e:?}");
    for shown in [e.to_string(), format!("{e:?}"), format!("{c:?}")] {
        assert!(!shown.contains("wrong-secret-xyz"), "{shown}");
    }
}

#[tokio::test]
async fn lock_delay_is_waited_out_with_backoff_not_polling() {
    let s = standin();
    let u = url(&s, "");
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("delayed");
    // Another client's session with a 1 s lock-delay holds the key, then is invalidated.
    let (_, created) = raw(
        &s,
        "PUT",
        "/v1/session/create",
        Some(json!({"LockDelay": "1s", "Checks": []})),
    )
    .await;
    let id = created["ID"].as_str().unwrap().to_owned();
    let path = format!("/v1/kv/{}?acquire={id}", config.kv_key(&k));
    assert_eq!(raw(&s, "PUT", &path, None).await, (200, json!(true)));
    raw(&s, "PUT", &format!("/v1/session/destroy/{id}"), None).await;
    let c = client(&u).await;
    assert!(matches!(
        c.try_acquire(&k, &LeaseOptions::new(TTL)).await,
        Err(Error::Held { .. })
    ));
    let before = s.requests();
    let start = Instant::now();
    let lease = c
        .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(5)))
        .await
        .unwrap();
    let took = start.elapsed();
    let spent = s.requests() - before;
    assert!(
        took >= Duration::from_millis(800),
        "acquired during the lock-delay ({took:?})"
    );
    assert!(
        spent < 30,
        "{spent} requests while waiting out a 1 s lock-delay"
    );
    lease.release().await.unwrap();
}

#[tokio::test]
async fn a_waiter_is_woken_by_the_release_through_a_blocking_query() {
    let s = standin();
    let u = url(&s, "");
    let (a, b) = (client(&u).await, client(&u).await);
    let k = key("handoff");
    let held = a.acquire(&k, &LeaseOptions::new(TTL * 10)).await.unwrap();
    let waiter = {
        let k = k.clone();
        tokio::spawn(async move {
            let l = b
                .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(10)))
                .await;
            (Instant::now(), l)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = s.requests();
    let released_at = Instant::now();
    held.release().await.unwrap();
    let (got_at, lease) = waiter.await.unwrap();
    let lease = lease.unwrap();
    assert!(lease.token() > held.token());
    // The request count below proves the wake-up came from the blocking query, not a poll;
    // this bound only catches a wake-up that never came (with room for a loaded machine).
    assert!(
        got_at - released_at < Duration::from_secs(1),
        "hand-off took {:?}",
        got_at - released_at
    );
    // While waiting, the waiter sat in one blocking query: a handful of requests, not a poll.
    assert!(s.requests() - before < 10);
    lease.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_cancelled_mid_request_leaves_no_lock() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let other = client(&u).await;
    let k = key("cancelled");
    // Make sure the session exists, so that the acquire's only request is the lock transaction.
    c.acquire(&key("warm"), &LeaseOptions::new(TTL))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    s.pause();
    let attempt = {
        let (c, k) = (c.clone(), k.clone());
        tokio::spawn(async move { c.acquire(&k, &LeaseOptions::new(TTL * 30)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    attempt.abort();
    assert!(attempt.await.is_err(), "the acquire was cancelled");
    // The lock request is still queued in the paused server and is applied (or refused) on
    // resume; the cancellation's marker and clean-up must win either way.
    s.resume();
    let got = other
        .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(3)))
        .await
        .expect("the cancelled acquire left the key locked");
    got.release().await.unwrap();
    // And the same client can take it again.
    c.acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(3)))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[tokio::test]
async fn an_acquire_committed_but_answered_with_an_error_leaves_no_lock() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let other = client(&u).await;
    // Make sure the session exists, so that the acquire's only write is the lock transaction.
    c.acquire(&key("warm"), &LeaseOptions::new(TTL))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    // Each time the leader commits the lock and the client hears something else.
    // Each answer leaves the outcome unknown; a 200 without the lock used to be `Unsupported`,
    // which reads as "nothing was done" although the lock was committed.
    let cases = [
        (500, "rpc error making call: EOF"),
        (
            500,
            "rpc error making call: leadership lost while committing log",
        ),
        (502, "Bad Gateway"),
        (504, "Gateway Timeout"),
        (200, r#"{"Results": [{"KV": {"Key""#),
        (200, r#"{"Results": [], "Errors": null}"#),
    ];
    for (i, (status, body)) in cases.into_iter().enumerate() {
        let k = key(&format!("answer-lost-{i}"));
        s.answer_next_commit(status, body);
        let e = c
            .try_acquire(&k, &LeaseOptions::new(TTL * 30))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::OutcomeUnknown { .. }), "{status}: {e:?}");
        // The committed lock is undone: another process gets the key, and so does this client.
        other
            .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(3)))
            .await
            .unwrap_or_else(|e| panic!("{status} {body}: the committed lock was left: {e:?}"))
            .release()
            .await
            .unwrap();
        c.acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(3)))
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn one_clients_leases_on_one_key_are_kept_apart() {
    let s = standin();
    let c = Arc::new(client(&url(&s, "")).await);
    let k = key("same-client");
    let first = c.acquire(&k, &LeaseOptions::new(TTL * 5)).await.unwrap();
    // Consul would let the same session "re-acquire"; the adapter must not hand out two leases.
    assert!(matches!(
        c.try_acquire(&k, &LeaseOptions::new(TTL)).await,
        Err(Error::Held { .. })
    ));
    let second = {
        let (c, k) = (c.clone(), k.clone());
        tokio::spawn(async move {
            c.acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(5)))
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!second.is_finished());
    assert_eq!(first.status(), LeaseStatus::Held);
    let t1 = first.token();
    drop(first);
    let second = second.await.unwrap().unwrap();
    assert!(second.token() > t1);
    second.release().await.unwrap();
}

#[tokio::test]
async fn a_lease_longer_than_the_session_lives_on_the_sessions_renewals() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let lease = c
        .acquire(&key("long"), &LeaseOptions::new(TTL * 4))
        .await
        .unwrap();
    // Capped by the session's validity (about one session TTL), pushed by its renewals.
    assert!(lease.remaining() <= TTL);
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(lease.status(), LeaseStatus::Held);
    // Without a renewal of the lease itself, it ends at its own TTL and the key is freed.
    let mut lost = lease.lost();
    tokio::time::timeout(TTL * 3, lost.wait()).await.unwrap();
    let other = client(&u).await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while other.inspect(&key("long")).await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "the expired lease's key was not freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A session destroyed behind the holder's back (`consul session destroy`, or its node
/// deregistered): the key's monitor marks the lease lost within a round trip, long before the
/// session's next renewal (5 s away here), and the default lock-delay keeps a new holder out
/// until then.
#[tokio::test]
async fn a_session_destroyed_out_of_band_is_noticed_at_once_and_lock_delay_keeps_others_out() {
    let s = standin();
    let u = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=10000&key_prefix=t{:08x}",
        s.addr(),
        rand::random::<u32>()
    );
    let (a, b) = (client(&u).await, client(&u).await);
    let k = key("destroyed");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    let session = a.session_id().expect("a session");
    let mut lost = lease.lost();
    let destroyed = Instant::now();
    let (st, _) = raw(&s, "PUT", &format!("/v1/session/destroy/{session}"), None).await;
    assert_eq!(st, 200);
    // Well before the renewal 5 s away, with room for a loaded machine.
    let reason = tokio::time::timeout(Duration::from_secs(2), lost.wait())
        .await
        .expect("lost() fires within a round trip of the destroy, not at the next renewal");
    assert!(
        matches!(
            reason,
            lease_core::LostReason::Revoked | lease_core::LostReason::SessionEnded
        ),
        "{reason:?}"
    );
    let noticed = destroyed.elapsed();
    let next = b
        .acquire(
            &k,
            &LeaseOptions::new(Duration::from_secs(10)).wait(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    let taken = destroyed.elapsed();
    assert!(
        taken >= adapter_consul::DEFAULT_LOCK_DELAY && noticed < taken,
        "noticed after {noticed:?}, new holder after {taken:?}"
    );
    assert!(next.token() > lease.token());
    assert!(matches!(lease.renew().await, Err(Error::Lost { .. })));
    next.release().await.unwrap();
}

/// The holder's agent leaves the cluster: Consul ends the sessions of its node (with or without
/// checks) and the agent stops answering, so neither the lock monitor nor the renewer can hear
/// of the loss. Another client then takes the key once the lock-delay passes. The holder's lease
/// must not still say `Held` by then: the monitor's unanswered query puts it in doubt at once.
/// Before, it stayed `Held` until the next renewal failed (half a session TTL, 5 s here), long
/// after the other client held the key.
#[tokio::test]
async fn a_lease_whose_agent_leaves_is_in_doubt_before_another_client_holds_its_key() {
    let s = standin();
    let prefix = format!("t{:08x}", rand::random::<u32>());
    let agent = FaultProxy::start(s.addr()).await.unwrap();
    let via_agent = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=10000&key_prefix={prefix}",
        agent.addr()
    );
    let direct = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=10000&key_prefix={prefix}",
        s.addr()
    );
    let (a, b) = (client(&via_agent).await, client(&direct).await);
    let k = key("agent-leaves");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    let session = a.session_id().expect("a session");
    monitor_parked(&s).await;
    // The agent leaves: its node's sessions end, and it answers nothing more.
    agent.refuse_new();
    agent.cut();
    let (st, _) = raw(&s, "PUT", &format!("/v1/session/destroy/{session}"), None).await;
    assert_eq!(st, 200);
    let next = b
        .acquire(
            &k,
            &LeaseOptions::new(Duration::from_secs(10)).wait(Duration::from_secs(10)),
        )
        .await
        .unwrap();
    assert_ne!(
        lease.status(),
        LeaseStatus::Held,
        "another client holds the key (token {}) while this lease says Held",
        next.token()
    );
    next.release().await.unwrap();
}

/// A plain `PUT` to the held key (no `?acquire`) keeps the key's session: the lease stays held
/// with its token, `inspect` shows that token (the key's `CreateIndex`), and release deletes
/// the key.
#[tokio::test]
async fn an_outside_write_to_a_held_key_leaves_it_ours_and_release_deletes_it() {
    let s = standin();
    let u = url(&s, "");
    let (a, b) = (client(&u).await, client(&u).await);
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("outside");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    let path = format!("/v1/kv/{}", config.kv_key(&k));
    let (st, _, _) = consul_http(s.addr(), "PUT", &path, Some(TOKEN), Some(b"not a record"))
        .await
        .unwrap();
    assert_eq!(st, 200);
    let info = b.inspect(&k).await.unwrap().expect("still locked");
    assert_eq!(info.token, lease.token());
    assert!(
        info.owner.as_str().contains(&a.session_id().unwrap()),
        "{info:?}"
    );
    lease.renew().await.expect("still ours");
    assert_eq!(lease.status(), LeaseStatus::Held);
    lease.release().await.expect("release deletes the key");
    assert!(b.inspect(&k).await.unwrap().is_none());
    let next = b
        .try_acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// An audit trail another tool overwrote is not read as empty and overwritten: a force-release
/// removes nothing and says so (`Misconfigured`, naming the audit key), `audit_trail` says the
/// same, and the value stays. Before, the unreadable value counted as no record, the next
/// force-release replaced it (up to 100 records erased), and `audit_trail` said none was kept.
#[tokio::test]
async fn an_audit_trail_written_by_another_tool_is_neither_read_as_empty_nor_overwritten() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("audit-overwritten");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    let audit_key = config.audit_key(&k);
    let path = format!("/v1/kv/{audit_key}");
    let (st, _, _) = consul_http(s.addr(), "PUT", &path, Some(TOKEN), Some(b"another tool's"))
        .await
        .unwrap();
    assert_eq!(st, 200);
    let request = lease_core::ForceRelease::new("oncall", "stuck").unwrap();
    for e in [
        c.force_release(&k, &request).await.map(|_| ()),
        c.audit_trail(&k, 10).await.map(|_| ()),
    ] {
        match e {
            Err(Error::Misconfigured { problems, .. })
                if problems.iter().any(|p| p.contains(&audit_key)) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, lease.token());
    let (st, _, body) = consul_http(s.addr(), "GET", &format!("{path}?raw"), Some(TOKEN), None)
        .await
        .unwrap();
    assert_eq!((st, body.as_ref()), (200, &b"another tool's"[..]));
    lease.release().await.unwrap();
}

/// A key that exists, unlocked, before the lock (an operator's leftover value) is deleted and
/// locked afresh, so the holder's token is the key's `CreateIndex` that `inspect` shows.
#[tokio::test]
async fn a_preexisting_unlocked_key_is_locked_afresh() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("leftover");
    let path = format!("/v1/kv/{}", config.kv_key(&k));
    let (st, _, _) = consul_http(s.addr(), "PUT", &path, Some(TOKEN), Some(b"leftover"))
        .await
        .unwrap();
    assert_eq!(st, 200);
    let lease = c
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    let (_, v) = raw(&s, "GET", &path, None).await;
    assert_eq!(v[0]["CreateIndex"].as_u64(), Some(lease.token().get()));
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, lease.token());
    lease.release().await.unwrap();
}

/// Renewals cost sessions, not leases: 100 leases renewed at once send no session renewal of
/// their own (the session is fresh) and check their keys in read-only transactions of up to 64
/// `check-session`s (a handful of requests, not 200); a lone renewal costs one request; and a
/// key deleted behind the holder's back fails only its own lease's renewal in the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_renewals_share_batched_reads_and_no_session_renewal() {
    let s = standin();
    let u = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=10000&key_prefix=t{:08x}",
        s.addr(),
        rand::random::<u32>()
    );
    let c = client(&u).await;
    let config = ConsulConfig::from_url(&u).unwrap();
    let mut leases = Vec::new();
    for i in 0..100 {
        let lease = c
            .acquire(&key(&format!("batch/{i}")), &LeaseOptions::new(TTL * 20))
            .await
            .unwrap();
        leases.push(Arc::<dyn Lease>::from(lease));
    }
    let renew_all = |leases: &[Arc<dyn Lease>]| {
        let mut set = tokio::task::JoinSet::new();
        for (i, l) in leases.iter().enumerate() {
            let l = l.clone();
            set.spawn(async move { (i, l.renew().await) });
        }
        set
    };
    // The lock monitor catches up with the acquires, then parks in its one blocking query: the
    // counts below are the renewals' alone.
    monitor_parked(&s).await;
    let before = s.requests();
    let mut set = renew_all(&leases);
    while let Some(r) = set.join_next().await {
        let (i, r) = r.unwrap();
        r.unwrap_or_else(|e| panic!("lease {i}: {e}"));
    }
    let spent = s.requests() - before;
    assert!(spent <= 6, "100 concurrent renewals sent {spent} requests");

    let before = s.requests();
    leases[0].renew().await.unwrap();
    assert_eq!(s.requests() - before, 1, "a lone renewal is one request");

    let gone = config.kv_key(&key("batch/7"));
    let (st, _) = raw(&s, "DELETE", &format!("/v1/kv/{gone}"), None).await;
    assert_eq!(st, 200);
    let mut set = renew_all(&leases);
    while let Some(r) = set.join_next().await {
        match r.unwrap() {
            (7, Err(Error::Lost { .. })) => {}
            (7, other) => panic!("the deleted key's renewal: {other:?}"),
            (i, Err(e)) => panic!("lease {i}: {e}"),
            (_, Ok(_)) => {}
        }
    }
    assert!(matches!(leases[7].status(), LeaseStatus::Lost(_)));
    assert_eq!(leases[8].status(), LeaseStatus::Held);
}

/// Loss detection costs one blocking query per coordinator, not one per held lease: 150 held
/// leases keep at most one long poll (one connection) open at the server; deleting one of their
/// keys behind the holder's back marks that lease alone lost (`Revoked`), within a round trip of
/// the change, and taking another key over with another session marks it `Superseded`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_leases_share_one_blocking_query_and_each_loss_reaches_its_lease() {
    let s = standin();
    let u = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=10000&key_prefix=t{:08x}",
        s.addr(),
        rand::random::<u32>()
    );
    let c = client(&u).await;
    let config = ConsulConfig::from_url(&u).unwrap();
    let mut leases = Vec::new();
    for i in 0..150 {
        let lease = c
            .acquire(&key(&format!("many/{i}")), &LeaseOptions::new(TTL * 30))
            .await
            .unwrap();
        leases.push(lease);
    }
    // The monitor parks in one blocking query once it has seen every acquire.
    monitor_parked(&s).await;
    for _ in 0..20 {
        assert!(
            s.blocking_in_progress() <= 1,
            "{}",
            s.blocking_in_progress()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let gone = config.kv_key(&key("many/7"));
    let mut lost = leases[7].lost();
    let (st, _) = raw(&s, "DELETE", &format!("/v1/kv/{gone}"), None).await;
    assert_eq!(st, 200);
    // Seen by the monitor's next answer; 2 s for a loaded machine, still under the session's
    // renewal interval (3.3 s here), the only other way the loss would be noticed.
    let reason = tokio::time::timeout(Duration::from_secs(2), lost.wait())
        .await
        .expect("the deleted key's lease is lost within a round trip");
    assert_eq!(reason, lease_core::LostReason::Revoked);

    // Another session takes key 9 over (released from ours by hand, then locked by it).
    let taken = config.kv_key(&key("many/9"));
    let ours = c.session_id().unwrap();
    let (_, created) = raw(
        &s,
        "PUT",
        "/v1/session/create",
        Some(json!({"LockDelay": "0s", "Checks": []})),
    )
    .await;
    let other = created["ID"].as_str().unwrap().to_owned();
    let mut lost = leases[9].lost();
    assert_eq!(
        raw(&s, "PUT", &format!("/v1/kv/{taken}?release={ours}"), None).await,
        (200, json!(true))
    );
    assert_eq!(
        raw(&s, "PUT", &format!("/v1/kv/{taken}?acquire={other}"), None).await,
        (200, json!(true))
    );
    // Seen by the monitor's next answer; 2 s for a loaded machine, still under the session's
    // renewal interval (3.3 s here), the only other way the loss would be noticed.
    let reason = tokio::time::timeout(Duration::from_secs(2), lost.wait())
        .await
        .expect("the taken key's lease is lost within a round trip");
    assert_eq!(reason, lease_core::LostReason::Superseded);

    for (i, l) in leases.iter().enumerate() {
        if i != 7 && i != 9 {
            assert_eq!(l.status(), LeaseStatus::Held, "lease {i}");
        }
    }
    for (i, l) in leases.into_iter().enumerate() {
        if i != 7 && i != 9 {
            l.release().await.unwrap();
        }
    }
    // Nothing held: the monitor stops (no long poll left).
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.blocking_in_progress() != 0 {
        assert!(Instant::now() < deadline, "the monitor outlived the leases");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A connector that counts the connections it opens: proves the requests went through the
/// application's client.
#[derive(Clone)]
struct CountingConnector {
    inner: HttpConnector,
    connects: Arc<AtomicUsize>,
}

impl tower_service::Service<hyper::Uri> for CountingConnector {
    type Response = <HttpConnector as tower_service::Service<hyper::Uri>>::Response;
    type Error = <HttpConnector as tower_service::Service<hyper::Uri>>::Error;
    type Future = <HttpConnector as tower_service::Service<hyper::Uri>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: hyper::Uri) -> Self::Future {
        self.connects.fetch_add(1, Ordering::SeqCst);
        self.inner.call(uri)
    }
}

/// `from_client` builds a coordinator on the application's own HTTP client: its requests go
/// through that client's connector, and its leases exclude (and are fenced against) those of a
/// coordinator made from the URL.
#[tokio::test]
async fn a_coordinator_from_the_applications_own_http_client_sends_through_it() {
    use adapter_consul::hyper_util::client::legacy::Client;
    use adapter_consul::hyper_util::rt::TokioExecutor;

    let s = standin();
    let u = url(&s, "");
    let connects = Arc::new(AtomicUsize::new(0));
    let own = Client::builder(TokioExecutor::new()).build(CountingConnector {
        inner: HttpConnector::new(),
        connects: connects.clone(),
    });
    let from_client = ConsulCoordinator::from_client(own, ConsulConfig::from_url(&u).unwrap())
        .await
        .unwrap();
    assert_eq!(connects.load(Ordering::SeqCst), 0, "made without sending");
    let from_url = client(&u).await;
    let k = key("from-client");
    one_holder_across(&from_client, &from_url, &k, &LeaseOptions::new(TTL)).await;
    assert!(
        connects.load(Ordering::SeqCst) >= 1,
        "sent through the client"
    );
}

/// A lease in doubt (its session renewals failing behind a partition) whose key an operator
/// deleted meanwhile is not `Held` again when a renewal of the session succeeds: that proves the
/// session lives, not that the key is still locked by it. The lease stays in doubt until it is
/// known lost (`Revoked`), never `Held` in between; a lease of the same session whose key is
/// still there is `Held` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_in_doubt_whose_key_was_deleted_meanwhile_is_never_held_again() {
    let s = standin();
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let c = client(&format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=4000&request_timeout_ms=300&key_prefix=t{:08x}",
        proxy.addr(),
        rand::random::<u32>()
    ))
    .await;
    let o = LeaseOptions::new(Duration::from_secs(30));
    let (gone, kept) = (key("doubt/deleted"), key("doubt/kept"));
    let deleted_lease = c.acquire(&gone, &o).await.unwrap();
    let kept_lease = c.acquire(&kept, &o).await.unwrap();
    proxy.blackhole();
    proxy.cut();
    let deadline = Instant::now() + Duration::from_secs(10);
    while deleted_lease.status() != LeaseStatus::InDoubt
        || kept_lease.status() != LeaseStatus::InDoubt
    {
        assert!(
            Instant::now() < deadline,
            "both leases in doubt within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _) = raw(
        &s,
        "DELETE",
        &format!("/v1/kv/{}", c.config().kv_key(&gone)),
        None,
    )
    .await;
    assert_eq!(status, 200, "the holder's key deleted");
    let watcher = sample_until_lost(deleted_lease.lost(), Duration::from_secs(15));
    // Partitioned for more than a quarter of the session TTL since the last renewal, so that
    // the next one confirms every lease of the session (`Session::confirm` walks them only
    // once the session's validity moved by that much).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    // The requests held by the partition go with their connections (the lock monitor's
    // included, which would otherwise be answered first).
    proxy.cut();
    proxy.heal();
    // The kept lease's renewal renews the session at once (its validity is stale), which
    // confirms every lease of the session.
    let deadline = Instant::now() + Duration::from_secs(10);
    while kept_lease.renew().await.is_err() || kept_lease.status() != LeaseStatus::Held {
        assert!(
            Instant::now() < deadline,
            "the kept lease held again within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let Sampled {
        held: seen_held,
        lost,
    } = watcher.await.unwrap();
    assert!(
        !seen_held,
        "a lease whose key was deleted while it was in doubt reported Held after the partition"
    );
    assert_eq!(lost, Some(lease_core::LostReason::Revoked));
    kept_lease.release().await.unwrap();
}

/// An acquire whose connection is reset after each send, while every send applies: the first
/// locks the key, the resend also writes the attempt's marker, and the next resend is refused
/// on that marker alone. The attempt is undone (its lock deleted) and a new one is made: the
/// caller gets a lease, not an error about an answer it could not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resends_that_all_applied_end_in_a_lease_not_an_error() {
    let s = standin();
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let prefix = format!("t{:08x}", rand::random::<u32>());
    let c = Arc::new(
        client(&format!(
            "consul://{}?token={TOKEN}&session_ttl_ms=4000&request_timeout_ms=5000&key_prefix={prefix}",
            proxy.addr()
        ))
        .await,
    );
    let o = LeaseOptions::new(Duration::from_secs(30));
    // The session exists: the acquire's only writes are its transaction's sends.
    c.acquire(&key("warm"), &o)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    async fn until_present(s: &ConsulStandIn, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while raw(s, "GET", path, None).await.0 != 200 {
            assert!(Instant::now() < deadline, "{path} never appeared");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    proxy.drop_replies();
    let acquiring = {
        let (c, o) = (c.clone(), o.clone());
        tokio::spawn(async move { c.try_acquire(&key("resent-twice"), &o).await })
    };
    // The first send applies; its reply is lost.
    until_present(&s, &format!("/v1/kv/{prefix}/locks/resent-twice")).await;
    // Reset: the resend (with the attempt's marker) applies too, its reply lost as well.
    proxy.cut();
    until_present(&s, &format!("/v1/kv/{prefix}/attempts/?recurse")).await;
    // Reset again, replies delivered from now on: the next resend is refused on the marker.
    proxy.heal();
    proxy.cut();
    let lease = tokio::time::timeout(Duration::from_secs(20), acquiring)
        .await
        .expect("the try_acquire returned")
        .unwrap()
        .expect("a lease, after the applied attempt was undone");
    assert_eq!(lease.status(), LeaseStatus::Held);
    let shown = c
        .inspect(&key("resent-twice"))
        .await
        .unwrap()
        .map(|h| h.token);
    assert_eq!(shown, Some(lease.token()));
    lease.release().await.unwrap();
}

/// A key that exists before the lock (an operator's leftover value) is rewritten from outside
/// just before every transaction on it: the acquire locks it, but each delete of the leftover
/// (or of an attempt whose answer was unusable) is refused by the moved `ModifyIndex`, so it
/// gives up. The lock it took must still be removed once the writes stop, so another client
/// gets the key. (Before, a refused delete counted as done: the key stayed locked by the live
/// session, held by no lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leftover_rewritten_from_outside_is_not_left_locked() {
    let s = standin();
    let u = url(&s, "");
    let (a, b) = (client(&u).await, client(&u).await);
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("rewritten");
    let path = format!("/v1/kv/{}", config.kv_key(&k));
    let (st, _, _) = consul_http(s.addr(), "PUT", &path, Some(TOKEN), Some(b"leftover"))
        .await
        .unwrap();
    assert_eq!(st, 200);
    s.write_before_txns(config.kv_key(&k), u32::MAX);
    match a.acquire(&k, &LeaseOptions::new(TTL)).await {
        Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. }) => {}
        other => panic!("an acquire outrun by outside writes: {other:?}"),
    }
    // The lock is deleted in the background, and a refused delete is not the end of it: the
    // deletes go on while the writes do (several of them, each refused).
    let left = s.outside_writes_left();
    let until = Instant::now() + Duration::from_secs(10);
    while left - s.outside_writes_left() < 6 {
        assert!(
            Instant::now() < until,
            "the lock's deletes stopped while it was still locked by the client's session"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.write_before_txns(config.kv_key(&k), 0);
    let next = b
        .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(10)))
        .await
        .expect("the abandoned acquire's lock stayed on the key");
    let (_, v) = raw(&s, "GET", &path, None).await;
    assert_eq!(v[0]["CreateIndex"].as_u64(), Some(next.token().get()));
    next.release().await.unwrap();
    // `a` is still alive, and can take the key again.
    a.acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(3)))
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// The ACL token loses `key:write` on the lock's key while a lease is held. Consul refuses the
/// release's transaction with 409 and a `Permission denied` error, not 403: the release must
/// fail as `Misconfigured`, not report the lease lost to another owner and stop there, and once
/// the policy allows writes again the lease's background cleanup deletes the key. (Before, the
/// denial read as "not ours": the key stayed locked by the live session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_refused_by_the_acl_is_misconfigured_and_retried() {
    let s = standin();
    let u = url(&s, "");
    let (a, b) = (client(&u).await, client(&u).await);
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("acl-denied");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    s.deny_key_writes(Some(config.kv_key(&k)));
    match lease.release().await {
        Err(Error::Misconfigured { problems, .. }) => {
            assert!(problems[0].contains("Permission denied"), "{problems:?}")
        }
        other => panic!("a release the ACL refuses: {other:?}"),
    }
    assert_eq!(
        b.inspect(&k).await.unwrap().map(|h| h.token),
        Some(lease.token()),
        "still locked while writes are refused"
    );
    s.deny_key_writes(None);
    let next = b
        .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(10)))
        .await
        .expect("the key stayed locked after the ACL allowed writes again");
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// An outside writer raises the held key's `ModifyIndex` just before every delete of the
/// release. The release must not report the key as no longer ours while its session still locks
/// it: it fails (`Unavailable`), and once the writes stop the key is deleted by the lease's
/// background cleanup, so another client gets it. (Before, the release gave up after three
/// re-reads, reported the lease lost and left the key locked by the live session.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_outrun_by_outside_writes_still_frees_the_key() {
    let s = standin();
    let u = url(&s, "");
    let (a, b) = (client(&u).await, client(&u).await);
    let config = ConsulConfig::from_url(&u).unwrap();
    let k = key("outrun");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    s.write_before_txns(config.kv_key(&k), u32::MAX);
    match lease.release().await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("written from outside"), "{message}")
        }
        other => panic!("release outrun by outside writes: {other:?}"),
    }
    assert_eq!(
        b.inspect(&k).await.unwrap().map(|h| h.token),
        Some(lease.token()),
        "still locked while the writes go on"
    );
    s.write_before_txns(config.kv_key(&k), 0);
    let next = b
        .acquire(&k, &LeaseOptions::new(TTL).wait(Duration::from_secs(10)))
        .await
        .expect("the released key stayed locked");
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// A release whose future is dropped before it ends (a caller's timeout around it) ends the
/// lease as a failed release does: the lease reports `Lost(Released)`, never `Held` again, and
/// the key is freed (by the release's delete, or else by the guardian). Before, `releasing`
/// stayed set, so no later news of the key reached the lease, which reported `Held` until its
/// validity ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_dropped_before_it_ends_leaves_the_lease_released() {
    let s = standin();
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let prefix = format!("t{:08x}", rand::random::<u32>());
    let at =
        |addr| format!("consul://{addr}?token={TOKEN}&session_ttl_ms=4000&key_prefix={prefix}");
    let a = client(&at(proxy.addr())).await;
    let b = client(&at(s.addr())).await;
    let k = key("dropped-release");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    // The release gets no answer; the caller's own timeout drops it.
    proxy.blackhole();
    let dropped = tokio::time::timeout(Duration::from_millis(200), lease.release()).await;
    assert!(dropped.is_err(), "{dropped:?}");
    assert_eq!(
        lease.status(),
        LeaseStatus::Lost(lease_core::LostReason::Released)
    );
    proxy.heal();
    let next = b
        .acquire(
            &k,
            &LeaseOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(10)),
        )
        .await
        .expect("the key stayed locked after a dropped release");
    assert!(next.token() > lease.token());
    next.release().await.unwrap();
}

/// A client cut off from Consul for more than twice its session TTL: Consul's timer may have
/// fired, and the destroy it starts still lands after a renewal that then succeeds (Consul
/// retries it), so a session renewed that late must not be used again. Here the stand-in ends
/// sessions only after eight TTLs, so the late renewal does succeed: the client must still end
/// that session (and destroy it) and take a new one for its next lease. (Before, the renewal
/// made the session valid again, and new leases were granted on a session a real Consul may be
/// about to destroy.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_renewed_after_twice_its_ttl_is_not_used_again() {
    let s = ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(Duration::from_millis(500))
            .acl_token(TOKEN)
            .ttl_multiplier(8),
    )
    .expect("stand-in");
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let c = client(&format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=1000&request_timeout_ms=300&key_prefix=t{:08x}",
        proxy.addr(),
        rand::random::<u32>()
    ))
    .await;
    let first = c
        .acquire(&key("late/a"), &LeaseOptions::new(TTL))
        .await
        .unwrap();
    let old = c.session_id().expect("a session");
    proxy.blackhole();
    proxy.cut();
    // More than twice the TTL without a renewal (the stand-in keeps the session for eight).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    proxy.cut();
    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, info) = raw(&s, "GET", &format!("/v1/session/info/{old}"), None).await;
        if info.as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the late-renewed session {old} was not ended within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        matches!(first.status(), LeaseStatus::Lost(_)),
        "{:?}",
        first.status()
    );
    let next = c
        .acquire(&key("late/b"), &LeaseOptions::new(TTL))
        .await
        .unwrap();
    assert_ne!(c.session_id().as_deref(), Some(old.as_str()));
    next.release().await.unwrap();
}

/// Concurrent calls on a client with no session share the outcome of one attempt to create it.
/// Before, the client held a lock across the creation and each caller queued behind it made its
/// own attempt once the previous failed: with Consul unreachable, the k-th of N concurrent calls
/// failed after k request timeouts, whatever its wait bound (the bug class fixed for etcd and
/// ZooKeeper in the same stop; Redis's connection open already works this way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_share_the_failure_of_one_session_creation() {
    let s = standin();
    let proxy = FaultProxy::start(s.addr()).await.unwrap();
    let timeout = Duration::from_millis(300);
    let c = Arc::new(
        client(&format!(
            "consul://{}?token={TOKEN}&session_ttl_ms=4000&request_timeout_ms={}&key_prefix=t{:08x}",
            proxy.addr(),
            timeout.as_millis(),
            rand::random::<u32>()
        ))
        .await,
    );
    proxy.blackhole();
    let calls = (0..8)
        .map(|i| {
            let k = key(&format!("shared-create/{i}"));
            (k, LeaseOptions::new(Duration::from_secs(5)))
        })
        .collect();
    for (r, took) in concurrent_try_acquires(c.clone(), calls).await {
        assert!(r.is_err(), "granted through a blackholed proxy: {r:?}");
        // One creation's bound each, more on a loaded machine; queued creations took up to
        // eight.
        assert!(
            took < 5 * timeout,
            "a try_acquire returned {took:?} after the start, with a {timeout:?} request timeout"
        );
    }
}

/// A renewal whose ownership check finds the key gone reports the loss even when the session
/// renewal sent with it fails. Before, the session renewal's error (the agent answering 500 `No
/// cluster leader`) was returned first and the lease stayed `Held`, though a consistent read
/// made after the call started had found the key gone.
#[tokio::test]
async fn a_renewal_finding_the_key_gone_reports_the_loss_whatever_the_session_renewal() {
    let s = standin();
    let u = format!(
        "consul://{}?token={TOKEN}&session_ttl_ms=4000&key_prefix=t{:08x}",
        s.addr(),
        rand::random::<u32>()
    );
    let config = ConsulConfig::from_url(&u).unwrap();
    let a = ConsulCoordinator::connect(config.clone()).await.unwrap();
    let k = key("gone-while-renewals-fail");
    let lease = a
        .acquire(&k, &LeaseOptions::new(Duration::from_secs(40)))
        .await
        .unwrap();
    s.fail_renewals(true);
    // Once less than half the session TTL of validity is left, a renewal sends a session renewal
    // of its own (which fails) with its ownership check; 2 s are left for the rest.
    let deadline = Instant::now() + Duration::from_secs(10);
    while lease
        .valid_until()
        .saturating_duration_since(Instant::now())
        >= Duration::from_secs(2)
    {
        assert!(Instant::now() < deadline, "the session was never due");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let gone = config.kv_key(&k);
    let (st, _) = raw(&s, "DELETE", &format!("/v1/kv/{gone}"), None).await;
    assert_eq!(st, 200);
    match lease.renew().await {
        Err(Error::Lost { reason, .. }) => {
            assert_ne!(reason, LostReason::Expired, "validity ran out first")
        }
        other => panic!("expected Lost, got {other:?}"),
    }
    assert!(matches!(lease.status(), LeaseStatus::Lost(_)));
    s.fail_renewals(false);
}

/// A release refused by Consul (the ACL token lost `key:write`) leaves the delete to the
/// lease's guardian, which retries it: `settle`, called once the lease is dropped, waits until
/// that delete got through, and another client then takes the key at once. Before, the drop of
/// a lease whose release had failed counted nothing, and `settle` returned with the key still
/// locked.
#[tokio::test]
async fn settle_waits_for_the_delete_after_a_failed_release() {
    let s = standin();
    let u = url(&s, "");
    let c = client(&u).await;
    let other = client(&u).await;
    let k = key("failed-release");
    let lease = c.acquire(&k, &LeaseOptions::new(TTL * 30)).await.unwrap();
    s.deny_key_writes(Some(c.config().kv_key(&k)));
    assert!(lease.release().await.is_err(), "the release was refused");
    drop(lease);
    // Refused for as long as writes are denied: settle cannot return meanwhile.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), c.settle())
            .await
            .is_err(),
        "settle returned while the key was still locked"
    );
    s.deny_key_writes(None);
    tokio::time::timeout(Duration::from_secs(10), c.settle())
        .await
        .expect("settle once writes are allowed again");
    other
        .try_acquire(&k, &LeaseOptions::new(TTL))
        .await
        .expect("the key is free once settle returned")
        .release()
        .await
        .unwrap();
}
