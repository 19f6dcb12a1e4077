//! A primary with a replica (decision 0016): the guard against repeated tokens after a failover,
//! and grants acknowledged by replicas.

use std::sync::Arc;
use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator, RedisFence};
use conformance_tests::harness::RedisServer;
use conformance_tests::proxy::FaultProxy;
use lease_core::{Coordinator, Error, Fence, ForceRelease, Lease, LeaseOptions, ResourceId, Token};
use tokio::time::Instant;

use crate::common::{blocking, coordinator, durable, eventually, fence, key, raw, server, url};

/// A primary with one replica following it, both durable and passwordless-equal (the replica
/// authenticates with the primary's password).
async fn primary_with_replica(test: &str) -> Option<(RedisServer, RedisServer)> {
    let primary = server(test, durable())?;
    let replica = server(test, durable())?;
    follow(&primary, &replica).await;
    Some((primary, replica))
}

/// Makes `replica` follow `primary`; returns once the primary reports it streaming.
async fn follow(primary: &RedisServer, replica: &RedisServer) {
    let pw = primary.config().requirepass.clone();
    let mut conn = raw(replica).await;
    if let Some(pw) = pw {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("masterauth")
            .arg(pw)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(primary.port())
        .query_async(&mut conn)
        .await
        .unwrap();
    let p = raw(primary).await;
    let linked = eventually(Duration::from_secs(20), || {
        let mut p = p.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("replication")
                .query_async(&mut p)
                .await
                .ok()?;
            (info.contains("connected_slaves:1") && info.contains("state=online")).then_some(())
        }
    })
    .await;
    assert!(linked.is_some(), "the replica never connected");
    // Online is not yet acknowledging: a replica still loading the primary's snapshot (or
    // rewriting its own AOF) acknowledges late, and a test's first `WAIT` would time out.
    let acking = eventually(Duration::from_secs(20), || {
        let mut p = p.clone();
        async move {
            let _: () = redis::cmd("SET")
                .arg("follow-probe")
                .arg(1)
                .query_async(&mut p)
                .await
                .ok()?;
            let acks: i64 = redis::cmd("WAIT")
                .arg(1)
                .arg(200)
                .query_async(&mut p)
                .await
                .ok()?;
            (acks >= 1).then_some(())
        }
    })
    .await;
    assert!(acking.is_some(), "the replica never acknowledged a write");
}

/// A replica that starts streaming after the coordinator and the fence connected is waited for:
/// `replica_acks=auto` counts the replicas again, at most once a second before a write, while it
/// has seen none. With that replica frozen, a fence write is then `OutcomeUnknown` and a grant
/// is undone, rather than accepted on the primary alone (a failover could lose them). A
/// coordinator with counter-only tokens is refused from then on, as at a connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_starts_streaming_later_is_waited_for() {
    let test = "a_replica_that_starts_streaming_later_is_waited_for";
    let Some(primary) = server(test, durable()) else {
        return;
    };
    // `WAIT` gets half the request timeout, well inside the reply's timeout.
    let options = "request_timeout_ms=1000";
    let f = fence(&primary, options).await;
    let c = coordinator(&primary, options).await;
    let counter_only = coordinator(&primary, "request_timeout_ms=1000&clock_tokens=false").await;
    let r = ResourceId::new("late-replica").unwrap();
    let k = key("late-replica");
    let ttl = LeaseOptions::new(Duration::from_secs(30));
    f.write(&r, Token::new(5).unwrap(), "v5".into())
        .await
        .unwrap();
    for c in [&c, &counter_only] {
        c.try_acquire(&k, &ttl)
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    // The replicas were last counted (at a connect, or before one of these writes) by now.
    let counted = Instant::now();

    let replica = server(test, durable()).unwrap();
    follow(&primary, &replica).await;
    // The documented interval between counts (`REPLICA_RECHECK`), on this process's clock.
    tokio::time::sleep_until(counted + Duration::from_secs(1)).await;
    // Returns once every thread of the replica shows stopped.
    replica.pause().unwrap();
    match f.write(&r, Token::new(6).unwrap(), "v6".into()).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("a fence write the frozen replica never had: {other:?}"),
    }
    match c.try_acquire(&k, &ttl).await.map(|l| l.token()) {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("a grant the frozen replica never had: {other:?}"),
    }
    assert!(
        c.inspect(&k).await.unwrap().is_none(),
        "the grant was not undone"
    );
    // Refused at the count, then at every connect that follows, not once a second.
    for _ in 0..3 {
        match counter_only.try_acquire(&k, &ttl).await.map(|l| l.token()) {
            Err(Error::Misconfigured { problems, .. }) => {
                assert!(
                    problems.iter().any(|p| p.contains("clock_tokens")),
                    "{problems:?}"
                )
            }
            other => panic!("counter-only tokens with a replica: {other:?}"),
        }
    }
    // Its shared connection, which read nothing wrong, was dropped too: a read reconnects and
    // is refused.
    match counter_only.inspect(&k).await {
        Err(Error::Misconfigured { .. }) => {}
        other => panic!("a read on the dropped shared connection: {other:?}"),
    }
    replica.resume().unwrap();
}

/// Counter-only tokens on a primary with a replica would repeat after a failover to a replica
/// that missed grants: refused, naming the setting, unless opted in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_only_tokens_on_a_primary_with_replicas_are_refused_naming_the_setting() {
    let Some((primary, _replica)) =
        primary_with_replica("counter_only_tokens_on_a_primary_with_replicas_are_refused").await
    else {
        return;
    };
    let refused = RedisCoordinator::connect_url(&url(&primary, "clock_tokens=false")).await;
    match refused {
        Err(Error::Misconfigured { problems, .. }) => {
            let text = problems.join(" ");
            assert!(text.contains("clock_tokens"), "{text}");
            assert!(text.contains("unguarded_replicas"), "{text}");
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    let opted_in = coordinator(&primary, "clock_tokens=false&unguarded_replicas=true").await;
    let lease = opted_in
        .try_acquire(&key("opted-in"), &LeaseOptions::new(Duration::from_secs(2)))
        .await
        .unwrap();
    lease.release().await.unwrap();
}

/// With replicas, a grant is handed out only once `replica_acks` replicas have it; a grant that
/// cannot reach enough replicas is released again and the call fails `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_wait_for_replica_acknowledgements_and_are_undone_without_them() {
    let Some((primary, replica)) =
        primary_with_replica("grants_wait_for_replica_acknowledgements").await
    else {
        return;
    };
    let ttl = Duration::from_secs(2);
    // auto: one acknowledgement (one replica is connected).
    let c = coordinator(&primary, "").await;
    let k = key("acked");
    let lease = c.try_acquire(&k, &LeaseOptions::new(ttl)).await.unwrap();
    let token = lease.token();
    let mut r = raw(&replica).await;
    let on_replica: Option<String> = redis::cmd("GET")
        .arg(&adapter_redis::storage_keys(c.config(), &k)[0])
        .query_async(&mut r)
        .await
        .unwrap();
    assert!(
        on_replica.is_some_and(|v| v.contains(&format!("|{token}|"))),
        "the replica did not have the grant when acquire returned"
    );
    lease.release().await.unwrap();

    // Two acknowledgements asked, one replica exists: undone, nothing left locked.
    let strict = coordinator(&primary, "replica_acks=2&request_timeout_ms=400").await;
    let k2 = key("under-acked");
    match strict.try_acquire(&k2, &LeaseOptions::new(ttl)).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert!(
        c.inspect(&k2).await.unwrap().is_none(),
        "the key was left locked"
    );

    // The replica gone: `auto` still asks for one (as counted at connect) and fails closed.
    let config = RedisConfig::from_url(&url(&primary, "request_timeout_ms=400")).unwrap();
    let before_kill = RedisCoordinator::connect(config).await.unwrap();
    let mut replica = replica;
    blocking(move || {
        replica.kill().unwrap();
        replica
    })
    .await;
    let k3 = key("replica-gone");
    assert!(matches!(
        before_kill.try_acquire(&k3, &LeaseOptions::new(ttl)).await,
        Err(Error::Unavailable { .. })
    ));
    assert!(
        c.inspect(&k3).await.unwrap().is_none(),
        "the key was left locked"
    );
    // A reconnect finds no replica any more, and `auto` still asks for one: the count seen at
    // an earlier connect is never lowered (a primary cut off from its replicas, whose clients
    // reconnect, would otherwise grant without them while a failover promotes one).
    let mut p = raw(&primary).await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .query_async(&mut p)
        .await
        .unwrap();
    // A read first, so that the shared connection reconnects (and counts the replicas it finds
    // now) before the acquire decides how many acknowledgements to wait for.
    assert!(before_kill.inspect(&k3).await.unwrap().is_none());
    match before_kill.try_acquire(&k3, &LeaseOptions::new(ttl)).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("after a reconnect: expected Unavailable, got {other:?}"),
    }
    assert!(
        c.inspect(&k3).await.unwrap().is_none(),
        "the key was left locked"
    );
}

/// A `WAIT` refused after the grant's script ran (here: `WAIT` taken from the user after the
/// coordinator connected; a failover that demotes the primary answers a blocked `WAIT`
/// `UNBLOCKED` the same way) counts no replica: the grant is undone as one too few replicas
/// acknowledged, and the key is not left locked. Before, the pipeline's error hid the script's
/// answer and was taken for "nothing applied" (`Misconfigured`), leaving the lock the script
/// wrote for its whole TTL. A coordinator that connects once `WAIT` is refused learns it at
/// the connection's check, and a write that must wait for replicas is refused `Misconfigured`
/// before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_wait_after_the_script_leaves_nothing_locked() {
    let Some((primary, _replica)) = primary_with_replica("a_refused_wait_after_the_script").await
    else {
        return;
    };
    let mut admin = raw(&primary).await;
    let setuser = |rules: &'static [&'static str]| {
        let mut admin = admin.clone();
        async move {
            let mut cmd = redis::cmd("ACL");
            cmd.arg(&["SETUSER", "nowait", "on", ">pw-nowait", "~*", "&*", "+@all"])
                .arg(rules);
            let _: () = cmd.query_async(&mut admin).await.unwrap();
        }
    };
    setuser(&[]).await;
    let url = format!(
        "redis://nowait:pw-nowait@{}/?request_timeout_ms=1000",
        primary.addr()
    );
    let c = RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    setuser(&["-wait"]).await;
    let k = key("refused-wait");
    let ttl = Duration::from_secs(30);
    match c.try_acquire(&k, &LeaseOptions::new(ttl)).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected Unavailable (no replica acknowledged), got {other:?}"),
    }
    let admin_coordinator = coordinator(&primary, "").await;
    assert!(
        admin_coordinator.inspect(&k).await.unwrap().is_none(),
        "the key was left locked"
    );

    // Connected with `WAIT` refused: refused before anything is sent.
    let before: i64 = redis::cmd("GET")
        .arg(&adapter_redis::storage_keys(admin_coordinator.config(), &k)[1])
        .query_async::<Option<i64>>(&mut admin)
        .await
        .unwrap()
        .unwrap_or(0);
    let late = RedisCoordinator::connect(RedisConfig::from_url(&url).unwrap())
        .await
        .unwrap();
    match late.try_acquire(&k, &LeaseOptions::new(ttl)).await {
        Err(Error::Misconfigured { problems, .. }) => {
            assert!(problems.iter().any(|p| p.contains("WAIT")), "{problems:?}")
        }
        other => panic!("expected Misconfigured (WAIT refused), got {other:?}"),
    }
    let after: i64 = redis::cmd("GET")
        .arg(&adapter_redis::storage_keys(admin_coordinator.config(), &k)[1])
        .query_async::<Option<i64>>(&mut admin)
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(
        after, before,
        "the grant script ran: the token counter moved"
    );
    assert!(admin_coordinator.inspect(&k).await.unwrap().is_none());
}

/// With replicas, a renewal is acknowledged by them as a grant is: a primary cut off from its
/// replicas (which a failover may already have replaced) cannot keep a lease held. Here the
/// replica is killed under a held lease: the next renewal fails `Unavailable` naming the
/// setting, and the lease's validity does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_wait_for_replica_acknowledgements_and_extend_nothing_without_them() {
    let Some((primary, replica)) =
        primary_with_replica("renewals_wait_for_replica_acknowledgements").await
    else {
        return;
    };
    // auto: one acknowledgement (one replica is connected). The grant and the first renewal
    // must be acknowledged within half the request timeout, on a loaded machine too.
    let c = coordinator(&primary, "request_timeout_ms=2000").await;
    let lease = c
        .try_acquire(&key("renewed"), &LeaseOptions::new(Duration::from_secs(30)))
        .await
        .unwrap();
    lease
        .renew()
        .await
        .expect("renewed with the replica's acknowledgement");
    let mut replica = replica;
    blocking(move || {
        replica.kill().unwrap();
        replica
    })
    .await;
    let before = lease.state().valid_until();
    match lease.renew().await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    assert_eq!(
        lease.state().valid_until(),
        before,
        "a renewal no replica acknowledged extended the lease"
    );
    let _ = lease.release().await;
}

/// A grant whose reply was lost is handed out only once replicas have it, as any other grant.
/// The replica is frozen (still connected, acknowledging nothing) and the acquire's reply is lost
/// with its connection: past the request timeout, the re-read on a new connection finds the grant
/// ours, but no replica has it. Before, that grant was handed out without a `WAIT`; now the
/// script runs again (its `WAIT` covering the grant) and the call fails `Unavailable` naming the
/// setting, leaving the key free.
///
/// The replies are lost on every connection open at the time: both connections kept for writes
/// that wait (opened by two grants first, taken in turn), so that the grant's is lost whichever
/// it goes on, and the shared one, which the test then replaces with a read that times out, so
/// that the re-read is answered. The first two runs of the script lose their replies (one on
/// each connection kept for writes that wait, each ended and replaced); the runs after that are
/// answered, and each reports that no replica acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_whose_reply_was_lost_waits_for_replicas_as_any_other() {
    let Some((primary, replica)) = primary_with_replica("a_grant_whose_reply_was_lost").await
    else {
        return;
    };
    let proxy = FaultProxy::start(primary.addr()).await.unwrap();
    let via = url(&primary, "request_timeout_ms=1000")
        .replace(&primary.addr().to_string(), &proxy.addr().to_string());
    // auto: one acknowledgement (one replica is connected).
    let c = RedisCoordinator::connect_url(&via).await.unwrap();
    let direct = coordinator(&primary, "").await;
    for warm in ["warm-up-1", "warm-up-2"] {
        // Retried: a replica slow to acknowledge (a loaded machine) fails a grant `Unavailable`,
        // and the warm-up only has to open the connections.
        let lease = eventually(Duration::from_secs(10), || {
            let c = &c;
            async move {
                c.try_acquire(&key(warm), &LeaseOptions::new(Duration::from_secs(30)))
                    .await
                    .ok()
            }
        })
        .await
        .expect("the warm-up grants");
        lease.release().await.unwrap();
    }
    let k = key("lost-reply-acked");
    // Returns once every thread of the replica shows stopped.
    replica.pause().unwrap();
    proxy.drop_replies_on_open();
    assert!(
        c.inspect(&k).await.is_err(),
        "a read answered on a connection whose replies are lost"
    );
    let result = c
        .acquire(
            &k,
            &LeaseOptions::new(Duration::from_secs(30)).wait(Duration::from_secs(4)),
        )
        .await
        .map(|l| l.token());
    match result {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let freed = eventually(Duration::from_secs(10), || {
        let direct = &direct;
        let k = &k;
        async move { direct.inspect(k).await.unwrap().is_none().then_some(()) }
    })
    .await;
    assert!(freed.is_some(), "the key was left locked");
    replica.resume().unwrap();
}

/// A fence write on a primary with a replica is accepted only once `replica_acks` replicas have
/// it, as a grant is: with `auto` (one replica connected) the replica has the newest token when
/// the write returns; asking for two, the write is applied on the primary but reported
/// `OutcomeUnknown`, naming the setting, since a failover may still lose it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_writes_wait_for_replica_acknowledgements() {
    let Some((primary, replica)) =
        primary_with_replica("fence_writes_wait_for_replica_acknowledgements").await
    else {
        return;
    };
    let f = fence(&primary, "").await;
    let r = ResourceId::new("replicated").unwrap();
    f.write(&r, Token::new(5).unwrap(), "v5".into())
        .await
        .unwrap();
    assert_eq!(
        newest_on(&replica, "replicated").await.as_deref(),
        Some("5"),
        "the replica did not have the write when it returned"
    );

    let strict = fence(&primary, "replica_acks=2&request_timeout_ms=400").await;
    match strict.write(&r, Token::new(6).unwrap(), "v6".into()).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // Applied on the primary all the same: an older token is refused.
    assert!(matches!(
        f.write(&r, Token::new(5).unwrap(), "again".into()).await,
        Err(Error::Stale { .. })
    ));
}

/// A force-release on a primary with a replica counts only once `replica_acks` replicas have
/// it, as a grant does: with `auto` (one replica connected) the replica no longer has the lock
/// and has the audit entry when the call returns; asking for two, the holder is removed on the
/// primary (and its lease in this process revoked) but the call is `OutcomeUnknown`, naming
/// the setting, since a failover may still bring the holder back. Before, both returned the
/// removed holder at once, whatever the replicas had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_releases_wait_for_replica_acknowledgements() {
    let Some((primary, replica)) =
        primary_with_replica("force_releases_wait_for_replica_acknowledgements").await
    else {
        return;
    };
    let c = coordinator(&primary, "").await;
    let ttl = LeaseOptions::new(Duration::from_secs(30));
    let request = ForceRelease::new("ops", "replication test").unwrap();
    let k = key("forced-replicated");
    let lease = c.try_acquire(&k, &ttl).await.unwrap();
    let removed = c.force_release(&k, &request).await.unwrap().unwrap();
    assert_eq!(removed.token, lease.token());
    let on_replica = raw_lock_and_audit(&replica, "forced-replicated").await;
    assert_eq!(
        on_replica,
        (None, 1),
        "the replica still had the lock, or not the audit entry, when the call returned"
    );

    let strict = coordinator(&primary, "replica_acks=2&request_timeout_ms=400").await;
    let k = key("forced-strict");
    let lease = strict.try_acquire(&k, &ttl).await;
    // A grant waits for two replicas too, and gets one: take the lock with `c` instead.
    assert!(matches!(lease, Err(Error::Unavailable { .. })), "{lease:?}");
    let lease = c.try_acquire(&k, &ttl).await.unwrap();
    match strict.force_release(&k, &request).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains("replica_acks"), "{message}")
        }
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // Removed on the primary all the same.
    assert!(c.inspect(&k).await.unwrap().is_none());
    assert!(
        lease.release().await.is_err(),
        "the removed holder released"
    );
}

/// What `server` holds for the lock `name`: its value, and how many audit entries it has.
async fn raw_lock_and_audit(server: &RedisServer, name: &str) -> (Option<String>, usize) {
    let mut conn = raw(server).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{name}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    let lock = keys.iter().find(|k| k.ends_with(":lock"));
    let audit = keys.iter().find(|k| k.ends_with(":audit"));
    let value = match lock {
        Some(lock) => redis::cmd("GET")
            .arg(lock)
            .query_async(&mut conn)
            .await
            .unwrap(),
        None => None,
    };
    let entries: usize = match audit {
        Some(audit) => redis::cmd("XLEN")
            .arg(audit)
            .query_async(&mut conn)
            .await
            .unwrap(),
        None => 0,
    };
    (value, entries)
}

/// The newest token `server` holds for the fence resource `resource` (one key matches).
async fn newest_on(server: &RedisServer, resource: &str) -> Option<String> {
    let mut conn = raw(server).await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{resource}*fence"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    redis::cmd("HGET")
        .arg(&keys[0])
        .arg("newest")
        .query_async(&mut conn)
        .await
        .unwrap()
}

/// A fence write on a primary with a replica whose reply was lost says whether the replicas have
/// what it did. Its connection is ended on the server (decision 0037), but it may have applied
/// on the primary without its `WAIT` reaching the replicas: a re-read then shows, on the primary
/// alone, a write that a failover loses. The fence now writes the newest token again, unchanged,
/// on a new connection and waits for the replicas: with a live replica the error says the
/// replicas have it (and the replica does, when the write returns); with the replica frozen, it
/// says a failover may still lose it and to write again under a new token. Before, both said
/// only that a read now shows everything the write did. A write that never applied, to a
/// resource with no token, has nothing to wait for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_write_whose_reply_was_lost_says_whether_the_replicas_have_it() {
    let Some((primary, replica)) = primary_with_replica("a_fence_write_whose_reply_was_lost").await
    else {
        return;
    };
    let proxy = FaultProxy::start(primary.addr()).await.unwrap();
    let via = url(&primary, "request_timeout_ms=1000")
        .replace(&primary.addr().to_string(), &proxy.addr().to_string());
    // auto: one acknowledgement (one replica is connected).
    let f = RedisFence::connect_url(&via).await.unwrap();
    let r = ResourceId::new("settled").unwrap();
    // Opens both connections kept for writes that wait (writes take them in turn), and loads
    // the script.
    for t in 1..=2 {
        // Retried: a replica slow to acknowledge (a loaded machine) fails a write, and the
        // warm-up only has to open the connections (the same token may be written again).
        let written = eventually(Duration::from_secs(10), || {
            let f = &f;
            let r = &r;
            async move { f.write(r, Token::new(t).unwrap(), "warm".into()).await.ok() }
        })
        .await;
        assert!(written.is_some(), "the warm-up writes");
    }
    proxy.drop_replies_on_open();
    match f.write(&r, Token::new(3).unwrap(), "v3".into()).await {
        Err(Error::OutcomeUnknown { message, .. }) => assert!(
            message.contains("ended on the server") && message.contains("the replicas have it"),
            "{message}"
        ),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // (A live replica gets the write anyway: without the settle, this check passes and the
    // message's fails.)
    assert_eq!(
        newest_on(&replica, "settled").await.as_deref(),
        Some("3"),
        "the error said the replicas have the write, but the replica does not"
    );

    // Returns once every thread of the replica shows stopped.
    replica.pause().unwrap();
    proxy.drop_replies_on_open();
    match f.write(&r, Token::new(4).unwrap(), "v4".into()).await {
        Err(Error::OutcomeUnknown { message, .. }) => assert!(
            message.contains("0 of the 1 replica(s)")
                && message.contains("a failover may still lose")
                && message.contains("new token"),
            "{message}"
        ),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // Applied on the primary: a read there shows it, which is why the error must not say that a
    // read tells the write's outcome.
    assert_eq!(newest_on(&primary, "settled").await.as_deref(), Some("4"));
    replica.resume().unwrap();

    // A write that never reached the server (held in the proxy, then its connection ended) to a
    // resource with no token: nothing to write again, so nothing to wait for, even where the
    // replicas could never acknowledge one (two asked of one replica).
    let strict = RedisFence::connect_url(&format!("{via}&replica_acks=2"))
        .await
        .unwrap();
    let other = ResourceId::new("other").unwrap();
    for t in 1..=2 {
        // Opens both connections for writes that wait; each write is applied on the primary
        // and reported `OutcomeUnknown` (one replica of two).
        let written = strict
            .write(&other, Token::new(t).unwrap(), "x".into())
            .await;
        assert!(
            matches!(written, Err(Error::OutcomeUnknown { .. })),
            "{written:?}"
        );
    }
    let never = ResourceId::new("never-written").unwrap();
    proxy.stall_open();
    match strict
        .write(&never, Token::new(1).unwrap(), "held".into())
        .await
    {
        Err(Error::OutcomeUnknown { message, .. }) => assert!(
            message.contains("ended on the server, so a read now shows everything it did")
                && !message.contains("failover"),
            "{message}"
        ),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    let direct = fence(&primary, "").await;
    assert!(direct.read(&never).await.unwrap().is_none());
}

/// A grant waiting for a frozen replica's acknowledgement does not hold up the requests that do
/// not wait: Redis reads nothing more from a client blocked in `WAIT`, so on the one shared
/// connection an `inspect` or a release queued behind such a grant waited for it (half the
/// request timeout), and one queued behind two timed out. Writes that wait now go on connections
/// of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_waiting_for_replicas_does_not_hold_up_other_requests() {
    let Some((primary, replica)) =
        primary_with_replica("a_grant_waiting_for_replicas_does_not_hold_up").await
    else {
        return;
    };
    // `WAIT` gives up after half of this: 1.5 s.
    let c = Arc::new(coordinator(&primary, "request_timeout_ms=3000").await);
    let ttl = Duration::from_secs(30);
    let k1 = key("held-while-frozen");
    let held = c.try_acquire(&k1, &LeaseOptions::new(ttl)).await.unwrap();
    // Frozen, the replica stays connected (online) as far as the primary knows.
    replica.pause().unwrap();
    // More grants than connections for writes that wait: each waits its turn on one (at most
    // one `WAIT` per connection), none queues behind another's `WAIT` until its own request
    // times out (which would also mark every lease of the coordinator in doubt).
    let pending: Vec<_> = (0..6)
        .map(|_| {
            let (c, k) = (c.clone(), key("granted-while-frozen"));
            tokio::spawn(async move { c.try_acquire(&k, &LeaseOptions::new(ttl)).await })
        })
        .collect();
    let mut admin = raw(&primary).await;
    let blocked = eventually(Duration::from_secs(5), || {
        let mut admin = admin.clone();
        async move {
            let info: String = redis::cmd("INFO")
                .arg("clients")
                .query_async(&mut admin)
                .await
                .unwrap();
            info.lines()
                .find_map(|l| l.strip_prefix("blocked_clients:"))
                .and_then(|n| n.trim().parse::<u64>().ok())
                .filter(|n| *n >= 1)
        }
    })
    .await;
    assert!(blocked.is_some(), "the grant never waited in WAIT");
    let asked = Instant::now();
    assert_eq!(
        c.inspect(&k1).await.unwrap().map(|h| h.token),
        Some(held.token())
    );
    let took = asked.elapsed();
    assert!(
        took < Duration::from_millis(700),
        "inspect took {took:?} while grants waited in WAIT"
    );
    for p in pending {
        match p.await.unwrap() {
            Err(Error::Unavailable { .. }) => {}
            other => panic!("a grant while the replica is frozen: {other:?}"),
        }
    }
    assert_eq!(
        held.status(),
        lease_core::LeaseStatus::Held,
        "a grant's request timed out behind another's WAIT and marked the leases in doubt"
    );
    let asked = Instant::now();
    held.release().await.unwrap();
    assert!(asked.elapsed() < Duration::from_millis(700));
    replica.resume().unwrap();
    let _: () = redis::cmd("PING").query_async(&mut admin).await.unwrap();
}

/// A server refusing a write that waits for replicas is a retryable `Unavailable` naming the
/// refusal, as it is without replicas: `OOM` (at `maxmemory` under `noeviction`, the policy the
/// adapter requires) and `NOREPLICAS` (under `min-replicas-to-write`, the usual guard against a
/// primary cut off from its replicas). Such a write goes with its `WAIT` as one pipeline, and
/// redis-rs gives a pipeline's failure no code for errors it does not know: before, both were
/// reported `Misconfigured` ("a different type of value"), so a waiting `acquire` gave up at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_that_waits_for_replicas_is_unavailable() {
    let Some((primary, _replica)) = primary_with_replica("a_refused_write_that_waits").await else {
        return;
    };
    // auto: one acknowledgement (one replica is connected).
    let c = coordinator(&primary, "").await;
    let k = key("refused");
    let ttl = LeaseOptions::new(Duration::from_secs(30));
    let mut p = raw(&primary).await;
    for (setting, value, refusal) in [
        ("maxmemory", "1", "OOM"),
        ("min-replicas-to-write", "2", "NOREPLICAS"),
    ] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(setting)
            .arg(value)
            .query_async(&mut p)
            .await
            .unwrap();
        match c.try_acquire(&k, &ttl).await.map(|l| l.token()) {
            Err(e @ Error::Unavailable { .. }) => {
                assert!(e.to_string().contains(refusal), "{refusal}: {e}")
            }
            other => panic!("{refusal}: expected Unavailable, got {other:?}"),
        }
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(setting)
            .arg("0")
            .query_async(&mut p)
            .await
            .unwrap();
    }
    assert!(
        c.inspect(&k).await.unwrap().is_none(),
        "a refused grant left the key locked"
    );
    c.try_acquire(&k, &ttl)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}
