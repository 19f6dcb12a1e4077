//! Token durability, the connect-time check, crashes, timeouts and secrets.

use std::time::Duration;

use adapter_redis::{RedisConfig, RedisCoordinator, RedisFence};
use conformance_tests::harness::RedisConfig as ServerConfig;
use conformance_tests::proxy::FaultProxy;
use lease_core::{Coordinator, Error, Fence, Lease, LeaseOptions, ResourceId, Token};
use redis::AsyncCommands;
use tokio::time::Instant;

use crate::common::{self, blocking, coordinator, durable, key, raw, server, url, volatile};

const SEC: Duration = Duration::from_secs(1);

fn opts(ttl: Duration) -> LeaseOptions {
    LeaseOptions::new(ttl)
}

/// Acquires and releases `n` times, returning the tokens.
async fn cycle(c: &RedisCoordinator, k: &lease_core::LockKey, n: usize) -> Vec<Token> {
    let mut out = Vec::new();
    for _ in 0..n {
        let l = c.try_acquire(k, &opts(10 * SEC)).await.unwrap();
        out.push(l.token());
        l.release().await.unwrap();
    }
    out
}

/// Retries `try_acquire` while the coordinator reconnects after a restart.
async fn acquire_after_restart(
    c: &RedisCoordinator,
    k: &lease_core::LockKey,
) -> Result<Box<dyn Lease>, Error> {
    let deadline = Instant::now() + 10 * SEC;
    loop {
        match c.try_acquire(k, &opts(10 * SEC)).await {
            Err(e @ (Error::Unavailable { .. } | Error::OutcomeUnknown { .. }))
                if Instant::now() < deadline =>
            {
                eprintln!("while reconnecting: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_continue_after_kill_9_with_aof() {
    let Some(mut srv) = server("tokens_continue_after_kill_9_with_aof", durable()) else {
        return;
    };
    // Counters start at 0 here, so the exact values prove the counter itself survived.
    let c = coordinator(&srv, "clock_tokens=false").await;
    let f = common::fence(&srv, "").await;
    let k = key("aof");
    let before = cycle(&c, &k, 3).await;
    assert_eq!(before.last(), Some(&Token::new(3).unwrap()));
    let res = ResourceId::from(&k);
    f.claim(&res, before[2]).await.unwrap();

    let srv = blocking(move || {
        srv.kill().unwrap();
        srv.restart().unwrap();
        srv
    })
    .await;

    // The same coordinator reconnects (and re-checks durability); tokens continue.
    let l = acquire_after_restart(&c, &k).await.unwrap();
    assert_eq!(l.token(), Token::new(4).unwrap());
    l.release().await.unwrap();
    let fresh = coordinator(&srv, "clock_tokens=false").await;
    assert_eq!(cycle(&fresh, &k, 1).await, vec![Token::new(5).unwrap()]);
    // The fence kept its newest token too.
    assert_eq!(f.read(&res).await.unwrap().unwrap().newest, before[2]);
}

#[tokio::test]
async fn servers_that_lose_tokens_are_refused_naming_each_setting() {
    let Some(srv) = server(
        "servers_that_lose_tokens_are_refused_naming_each_setting",
        volatile(),
    ) else {
        return;
    };
    for r in [
        RedisCoordinator::connect_url(&srv.url()).await.map(|_| ()),
        RedisFence::connect_url(&srv.url()).await.map(|_| ()),
    ] {
        match r {
            Err(Error::Misconfigured { problems, .. }) => {
                let all = problems.join("\n");
                assert!(all.contains("appendonly is no"), "{all}");
                assert!(all.contains("appendfsync is everysec"), "{all}");
                assert!(!all.contains("maxmemory-policy is"), "{all}");
                assert!(all.contains("volatile_tokens=true"), "{all}");
            }
            other => panic!("expected Misconfigured, got {other:?}"),
        }
    }
    drop(srv);

    let evicting = ServerConfig {
        maxmemory_policy: "volatile-lru".into(),
        ..ServerConfig::default()
    };
    let Some(srv) = server("evicting server", evicting) else {
        return;
    };
    match RedisCoordinator::connect_url(&srv.url()).await {
        Err(Error::Misconfigured { problems, .. }) => {
            assert!(
                problems[0].contains("maxmemory-policy is volatile-lru"),
                "{problems:?}"
            );
            assert!(
                !problems.join(" ").contains("appendonly is"),
                "{problems:?}"
            );
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    // The opt-in connects, and says the tokens are not durable.
    let c = coordinator(&srv, "volatile_tokens=true").await;
    assert!(!c.capabilities().durable_tokens);
}

#[tokio::test]
async fn disabled_config_command_cannot_be_verified() {
    let cfg = ServerConfig {
        extra_args: vec!["--rename-command".into(), "CONFIG".into(), "".into()],
        ..ServerConfig::default()
    };
    let Some(srv) = server("disabled_config_command_cannot_be_verified", cfg) else {
        return;
    };
    match RedisCoordinator::connect_url(&srv.url()).await {
        Err(Error::Misconfigured { problems, .. }) => {
            let all = problems.join(" ");
            assert!(all.contains("cannot verify"), "{all}");
            assert!(all.contains("volatile_tokens=true"), "{all}");
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    let c = coordinator(&srv, "volatile_tokens=true").await;
    let k = key("managed");
    assert_eq!(cycle(&c, &k, 1).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volatile_tokens_fail_closed_or_stay_above_the_floor_after_a_crash() {
    let Some(mut srv) = server(
        "volatile_tokens_fail_closed_or_stay_above_the_floor_after_a_crash",
        volatile(),
    ) else {
        return;
    };
    // Counters start at 0 here (not at the server clock), so the crash makes them go back.
    let c = coordinator(&srv, "volatile_tokens=true&clock_tokens=false").await;
    let clocked = coordinator(&srv, "volatile_tokens=true").await;
    let k = key("volatile");
    let kc = key("volatile-clock");
    let clocked_before = cycle(&clocked, &kc, 2).await;
    assert_eq!(cycle(&c, &k, 3).await.last(), Some(&Token::new(3).unwrap()));
    assert_eq!(c.high_water_mark(&k), Some(Token::new(3).unwrap()));

    let srv = blocking(move || {
        srv.kill().unwrap();
        srv.restart().unwrap();
        srv
    })
    .await;

    // The counter is gone: Redis issues 1 again, which this process has seen: fail closed, and
    // leave no lock behind.
    match acquire_after_restart(&c, &k).await {
        Err(Error::TokenRegression {
            observed, floor, ..
        }) => {
            assert_eq!(observed, Token::new(1).unwrap());
            assert_eq!(floor, Token::new(3).unwrap());
        }
        other => panic!("expected TokenRegression, got {other:?}"),
    }
    assert!(
        c.inspect(&k).await.unwrap().is_none(),
        "regressed lock left behind"
    );

    // An operator sets a floor above everything issued before the crash: tokens continue above
    // it, for a new process and for the old one alike.
    let floored = coordinator(
        &srv,
        "volatile_tokens=true&token_floor=1000&clock_tokens=false",
    )
    .await;
    assert_eq!(
        cycle(&floored, &k, 1).await,
        vec![Token::new(1001).unwrap()]
    );
    assert_eq!(cycle(&c, &k, 1).await, vec![Token::new(1002).unwrap()]);

    // With the default clock start, the lost counter resumes at the server clock, above every
    // token issued before the crash.
    let after = acquire_after_restart(&clocked, &kc).await.unwrap();
    assert!(
        after.token() > clocked_before[1],
        "{} not above {}",
        after.token(),
        clocked_before[1]
    );
    after.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_unavailable_never_a_lease() {
    let Some(mut srv) = server("unreachable_server_is_unavailable_never_a_lease", durable()) else {
        return;
    };
    let c = coordinator(&srv, "connect_timeout_ms=500&request_timeout_ms=500").await;
    let k = key("down");
    let port = srv.port();
    srv = blocking(move || {
        srv.kill().unwrap();
        srv
    })
    .await;
    // The pub/sub connection notices the crash and drops the command connection, so the next
    // call reconnects and is refused.
    tokio::time::sleep(Duration::from_millis(200)).await;
    for attempt in 0..3 {
        match c.try_acquire(&k, &opts(SEC)).await {
            Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
            // On a loaded machine the pub/sub task may not have dropped the broken connection
            // yet: the first call then goes out on it, and its outcome is unknown. Never a
            // lease; the calls after it reconnect and are refused.
            Err(Error::OutcomeUnknown { .. }) if attempt == 0 => {}
            other => panic!("attempt {attempt}: expected Unavailable, got {other:?}"),
        }
    }
    assert!(matches!(
        c.inspect(&k).await,
        Err(Error::Unavailable { .. })
    ));
    match RedisCoordinator::connect_url(&format!("redis://127.0.0.1:{port}")).await {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
    drop(srv);
}

/// Warms up the script cache so that a request held back by a fault runs when it arrives
/// (instead of answering `NOSCRIPT`).
async fn warm_up(c: &RedisCoordinator) {
    let k = key("warm-up");
    cycle(c, &k, 1).await;
}

/// The connection is reset after the server ran the acquire script but before its reply
/// arrived. The script is sent again on a new connection, finds our nonce and returns that grant:
/// one holder, one token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_connection_retries_the_idempotent_script() {
    let Some(srv) = server(
        "a_reset_connection_retries_the_idempotent_script",
        durable(),
    ) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = RedisCoordinator::connect_url(&format!("redis://{}?clock_tokens=false", proxy.addr()))
        .await
        .unwrap();
    warm_up(&c).await;
    let k = key("reset");
    proxy.delay(Duration::from_millis(300));
    let k2 = k.clone();
    let c2 = c.clone();
    let call = tokio::spawn(async move { c2.try_acquire(&k2, &opts(60 * SEC)).await });
    // The request reaches the server at ~300 ms; its reply would arrive at ~600 ms.
    tokio::time::sleep(Duration::from_millis(450)).await;
    proxy.cut();
    proxy.heal();
    let l = call
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("expected the grant, got {e}"));
    assert_eq!(l.token(), Token::new(1).unwrap());
    let direct = coordinator(&srv, "").await;
    assert_eq!(direct.inspect(&k).await.unwrap().unwrap().token, l.token());
    l.release().await.unwrap();
    assert!(direct.inspect(&k).await.unwrap().is_none());
}

/// The reply is slower than the request timeout, but the network recovers before the re-read:
/// the re-read finds our nonce and the call returns the grant the request made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_reply_resolves_by_re_reading() {
    let Some(srv) = server("a_timed_out_reply_resolves_by_re_reading", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = RedisCoordinator::connect_url(&format!(
        "redis://{}?request_timeout_ms=500&clock_tokens=false",
        proxy.addr()
    ))
    .await
    .unwrap();
    warm_up(&c).await;
    let k = key("re-read");
    proxy.delay(Duration::from_millis(300));
    let (c2, k2) = (c.clone(), k.clone());
    let began = Instant::now();
    let call = tokio::spawn(async move { c2.try_acquire(&k2, &opts(60 * SEC)).await });
    // The request runs at ~300 ms; its reply is due at ~600 ms, after the 500 ms timeout. New
    // bytes pass at once from ~400 ms on.
    tokio::time::sleep(Duration::from_millis(400)).await;
    proxy.heal();
    let l = call
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("expected the grant, got {e}"));
    assert!(
        began.elapsed() >= Duration::from_millis(500),
        "the reply did time out"
    );
    assert_eq!(l.token(), Token::new(1).unwrap());
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, l.token());
    l.release().await.unwrap();
}

/// Replies (and the re-read) are slower than the request timeout: the call reports the unknown
/// outcome, and the background cleanup removes the lock that the request did set, long before
/// its 60 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unseen_acquire_leaves_no_orphan_lock() {
    let Some(srv) = server("an_unseen_acquire_leaves_no_orphan_lock", durable()) else {
        return;
    };
    let proxy = FaultProxy::start(srv.addr()).await.unwrap();
    let c = RedisCoordinator::connect_url(&format!(
        "redis://{}?request_timeout_ms=500&connect_timeout_ms=500&clock_tokens=false",
        proxy.addr()
    ))
    .await
    .unwrap();
    warm_up(&c).await;
    let k = key("orphan");
    proxy.delay(Duration::from_millis(400));
    match c.try_acquire(&k, &opts(60 * SEC)).await {
        Err(Error::OutcomeUnknown { operation, .. }) => assert_eq!(operation, "acquire"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    proxy.heal();
    let lock_key = format!("fenced:{{{}}}:lock", k.as_str());
    let counter_key = format!("fenced:{{{}}}:token", k.as_str());
    let mut conn = raw(&srv).await;
    let counter: Option<i64> = conn.get(&counter_key).await.unwrap();
    assert_eq!(counter, Some(1), "the request did run on the server");
    let freed = common::eventually(10 * SEC, || {
        let mut conn = conn.clone();
        let lock_key = lock_key.clone();
        async move {
            let lock: Option<String> = conn.get(&lock_key).await.unwrap();
            lock.is_none().then_some(())
        }
    })
    .await;
    assert!(
        freed.is_some(),
        "the unseen acquire's lock was not cleaned up"
    );
    let l = c.try_acquire(&k, &opts(SEC)).await.unwrap();
    assert_eq!(l.token(), Token::new(2).unwrap());
    l.release().await.unwrap();
}

/// The server holds writes back (`CLIENT PAUSE ... WRITE`) for longer than the request timeout:
/// the first reply is lost, the re-read (read-only, not paused) finds the key free, and the
/// waiting acquire's idempotent retry gets the one grant once the pause ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_gives_one_grant() {
    let Some(srv) = server("a_paused_server_gives_one_grant", durable()) else {
        return;
    };
    let c = coordinator(&srv, "request_timeout_ms=400&clock_tokens=false").await;
    warm_up(&c).await;
    let k = key("paused");
    let mut conn = raw(&srv).await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(700)
        .arg("WRITE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let l = c
        .acquire(&k, &opts(60 * SEC).wait(10 * SEC))
        .await
        .unwrap_or_else(|e| panic!("expected a lease, got {e}"));
    assert_eq!(l.token(), Token::new(1).unwrap(), "one grant, one token");
    assert_eq!(c.inspect(&k).await.unwrap().unwrap().token, l.token());
    l.release().await.unwrap();
    assert!(c.inspect(&k).await.unwrap().is_none());
}

#[tokio::test]
async fn passwords_never_show_in_debug_display_or_errors() {
    const PW: &str = "s3cr3t-pw-9f";
    let cfg = ServerConfig {
        requirepass: Some(PW.into()),
        ..ServerConfig::default()
    };
    let Some(srv) = server("passwords_never_show_in_debug_display_or_errors", cfg) else {
        return;
    };
    let good = url(&srv, "key_prefix=pw");
    assert!(good.contains(PW));
    let config = RedisConfig::from_url(&good).unwrap();
    let c = RedisCoordinator::connect(config.clone()).await.unwrap();
    let f = RedisFence::connect(config.clone()).await.unwrap();
    let k = key("pw");
    let l = c.try_acquire(&k, &opts(SEC)).await.unwrap();
    let shown = [
        format!("{config}"),
        format!("{config:?}"),
        format!("{c}"),
        format!("{c:?}"),
        format!("{f:?}"),
        format!("{l:?}"),
        format!("{:?}", c.config().url()),
    ];
    for s in &shown {
        assert!(!s.contains(PW), "{s}");
    }
    l.release().await.unwrap();

    // Wrong password, bad option, unreachable: errors never carry the password either.
    let wrong = good.replace(PW, "wrong-pw-1234");
    let errors = [
        RedisCoordinator::connect_url(&wrong).await.unwrap_err(),
        RedisCoordinator::connect_url(&format!("{good}&bogus=1"))
            .await
            .unwrap_err(),
        RedisCoordinator::connect_url(&format!("redis://:{PW}@127.0.0.1:1"))
            .await
            .unwrap_err(),
        RedisCoordinator::connect_url(&format!("redis://:{PW}@127.0.0.1:1?token_floor=x"))
            .await
            .unwrap_err(),
    ];
    assert!(
        matches!(errors[0], Error::Misconfigured { .. }),
        "{}",
        errors[0]
    );
    assert!(matches!(errors[1], Error::InvalidInput(_)), "{}", errors[1]);
    assert!(
        matches!(errors[2], Error::Unavailable { .. }),
        "{}",
        errors[2]
    );
    for e in &errors {
        for s in [e.to_string(), format!("{e:?}")] {
            assert!(!s.contains(PW) && !s.contains("wrong-pw-1234"), "{s}");
        }
    }
}

/// A grant that raises the counter (to the floor here, to the clock by default) writes it as the
/// decimal string plus one, computed in the script: exact past 2^53 (where Lua's numbers round)
/// and across a carry, and the next grant increments from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_raised_to_a_floor_are_exact_past_two_to_the_53() {
    let Some(srv) = server(
        "tokens_raised_to_a_floor_are_exact_past_two_to_the_53",
        durable(),
    ) else {
        return;
    };
    for (floor, first) in [
        ("9007199254740993", 9_007_199_254_740_994u64),
        ("99999999999999999", 100_000_000_000_000_000),
        ("1099999999999999999", 1_100_000_000_000_000_000),
    ] {
        let c = coordinator(&srv, &format!("token_floor={floor}")).await;
        let k = key(&format!("floor-{floor}"));
        assert_eq!(
            cycle(&c, &k, 2).await,
            vec![Token::new(first).unwrap(), Token::new(first + 1).unwrap()],
            "floor {floor}"
        );
    }
}
