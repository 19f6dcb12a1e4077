//! One PgFence object across a server crash (SIGKILL) and restart: writes in flight end as
//! OutcomeUnknown or Unavailable (never Stale, never a success that did not commit), and the same
//! object writes again once the server is back, through fresh pooled connections.

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use fence_postgres::PgFence;
use lease_core::{Bytes, Error, Fence, ResourceId, Token};
use tokio::sync::watch;

/// A PostgreSQL server of this test's own, or `None` when skipped (reported by name).
async fn server(test: &str) -> Option<PostgresServer> {
    start_or_skip_async(test, Backend::Postgres, PostgresServer::start).await
}

fn t(n: u64) -> Token {
    Token::new(n).unwrap()
}

/// How one writer's run before the crash ended.
#[derive(Debug)]
struct Run {
    resource: ResourceId,
    /// The newest token whose write returned `Ok`.
    last_ok: u64,
    /// The token of the write that failed, and how.
    failed: u64,
    error: Error,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_fence_survives_a_server_crash_and_restart() {
    let Some(mut pg) = server("the_same_fence_survives_a_server_crash_and_restart").await else {
        return;
    };
    // A pool smaller than the writers: some writes wait for a connection.
    let fence = Arc::new(
        PgFence::connect(&format!(
            "{}?pool_size=4&timeout_ms=5000",
            pg.connection_url()
        ))
        .await
        .unwrap(),
    );
    assert_eq!(fence.pool_size(), 4);
    let (progress_tx, progress_rx) = watch::channel(0u64);
    let progress_tx = Arc::new(progress_tx);
    let mut writers = Vec::new();
    for w in 0..8 {
        let (fence, progress) = (fence.clone(), progress_tx.clone());
        writers.push(tokio::spawn(async move {
            let resource = ResourceId::new(format!("crash/{w}")).unwrap();
            let mut last_ok = 0;
            for token in 1u64.. {
                let value = Bytes::from(token.to_string());
                match fence.write(&resource, t(token), value).await {
                    Ok(_) => {
                        last_ok = token;
                        progress.send_modify(|n| *n += 1);
                    }
                    Err(error) => {
                        return Run {
                            resource,
                            last_ok,
                            failed: token,
                            error,
                        }
                    }
                }
            }
            unreachable!()
        }));
    }
    // Every writer is busy (at least 40 writes done in all), then the server is killed.
    let mut rx = progress_rx.clone();
    tokio::time::timeout(Duration::from_secs(30), rx.wait_for(|n| *n >= 40))
        .await
        .expect("writers make progress")
        .unwrap();
    // One write surely in flight: its COMMIT runs a deferred trigger that takes seconds.
    let slow_resource = ResourceId::new("crash/slow").unwrap();
    fence
        .write(&slow_resource, t(1), Bytes::from_static(b"1"))
        .await
        .unwrap();
    {
        let c = fence.pool().get().await.unwrap();
        c.batch_execute(
            "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN IF NEW.value = 'slow' THEN PERFORM pg_sleep(30); END IF; RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON fence_tokens
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
        )
        .await
        .unwrap();
    }
    let slow = {
        let (fence, r) = (fence.clone(), slow_resource.clone());
        tokio::spawn(async move { fence.write(&r, t(2), Bytes::from_static(b"slow")).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let c = fence.pool().get().await.unwrap();
        let n: i64 = c
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND wait_event = 'PgSleep'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slow COMMIT never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pg_pid = pg.pid().unwrap();
    // The whole server dies at once (postmaster and backends), as in a machine crash.
    pg = tokio::task::spawn_blocking(move || {
        pg.crash().unwrap();
        pg
    })
    .await
    .unwrap();
    assert!(pg.pid().is_none(), "server {pg_pid} still running");
    // Each writer's current write fails promptly (the connection is gone or cannot be made).
    let mut runs = Vec::new();
    for w in writers {
        runs.push(
            tokio::time::timeout(Duration::from_secs(20), w)
                .await
                .expect("a write in flight during the crash must end")
                .unwrap(),
        );
    }
    for run in &runs {
        eprintln!(
            "{}: Ok up to {}, then {} for {}",
            run.resource, run.last_ok, run.error, run.failed
        );
        match &run.error {
            Error::OutcomeUnknown { .. } | Error::Unavailable { .. } => {}
            other => panic!(
                "{}: a write during the crash returned {other:?}",
                run.resource
            ),
        }
        let shown = run.error.to_string();
        assert!(!shown.contains("Stale"), "{shown}");
    }

    let slow = tokio::time::timeout(Duration::from_secs(20), slow)
        .await
        .expect("the write in flight during the crash must end")
        .unwrap();
    match &slow {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("a write whose COMMIT was cut by the crash returned {other:?}"),
    }
    runs.push(Run {
        resource: slow_resource,
        last_ok: 1,
        failed: 2,
        error: slow.unwrap_err(),
    });
    pg = tokio::task::spawn_blocking(move || {
        pg.restart().unwrap();
        pg
    })
    .await
    .unwrap();
    // The same fence object reads and writes again; what it reported before the crash holds:
    // every Ok committed, an Unavailable write did not, an OutcomeUnknown one may have.
    for run in &runs {
        let v = fence
            .read(&run.resource)
            .await
            .unwrap_or_else(|e| panic!("{}: read after restart: {e}", run.resource))
            .expect("the row exists");
        let newest = v.newest.get();
        let allowed: &[u64] = match run.error {
            Error::OutcomeUnknown { .. } => &[run.last_ok, run.failed],
            _ => &[run.last_ok],
        };
        assert!(
            allowed.contains(&newest),
            "{}: newest {newest} after restart, but the fence reported Ok up to {} and {:?} for {}",
            run.resource,
            run.last_ok,
            run.error,
            run.failed
        );
        let value = v.value.unwrap().1;
        assert!(
            value == newest.to_string().as_bytes() || value == b"slow"[..],
            "{}: {value:?}",
            run.resource
        );
        fence
            .write(
                &run.resource,
                t(run.failed + 1),
                Bytes::from_static(b"after"),
            )
            .await
            .unwrap_or_else(|e| panic!("{}: write after restart: {e}", run.resource));
        // The older token is still fenced off after the restart.
        match fence
            .write(&run.resource, t(run.failed), Bytes::from_static(b"old"))
            .await
        {
            Err(Error::Stale { current, .. }) => assert_eq!(current, t(run.failed + 1)),
            other => panic!("{}: {other:?}", run.resource),
        }
    }
    let status = fence.pool().status();
    assert!(status.size <= 4, "{status:?}");
    drop(pg);
}

/// A paused server (the postmaster and every backend it forked frozen) answers nothing, on a
/// connection opened before the pause either, and answers again once resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_answers_nothing_until_resumed() {
    let Some(pg) = server("a_paused_server_answers_nothing_until_resumed").await else {
        return;
    };
    let fence = PgFence::connect(&format!(
        "{}?pool_size=1&timeout_ms=2000",
        pg.connection_url()
    ))
    .await
    .unwrap();
    let resource = ResourceId::new("paused").unwrap();
    // The pool's one connection, and its backend, exist before the pause.
    fence
        .write(&resource, t(1), Bytes::from_static(b"1"))
        .await
        .unwrap();
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    let frozen = fence.write(&resource, t(2), Bytes::from_static(b"2")).await;
    assert!(
        matches!(
            frozen,
            Err(Error::Unavailable { .. } | Error::OutcomeUnknown { .. })
        ),
        "a write to a paused server: {frozen:?}"
    );
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    // The write sent to the frozen backend may have committed once it thawed: its session
    // could not be ended while the server was paused. (A fence with a longer timeout: the
    // thawed server has backlog to work through on a loaded machine.)
    let fence = PgFence::connect(&format!("{}?timeout_ms=10000", pg.connection_url()))
        .await
        .unwrap();
    let after = fence
        .write(&resource, t(3), Bytes::from_static(b"3"))
        .await
        .unwrap();
    assert!(
        after.previous == Some(t(1)) || after.previous == Some(t(2)),
        "{after:?}"
    );
}

/// A paused server stopped (or dropped) leaves none of its backends stopped behind it: they
/// are thawed, see the postmaster gone and end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_server_stopped_leaves_no_backend_frozen() {
    use conformance_tests::process::{children, task_states};
    let Some(mut pg) = server("a_paused_server_stopped_leaves_no_backend_frozen").await else {
        return;
    };
    let fence = PgFence::connect(&pg.connection_url()).await.unwrap();
    fence
        .write(&ResourceId::new("frozen").unwrap(), t(1), Bytes::new())
        .await
        .unwrap();
    let forked = children(pg.pid().unwrap());
    assert!(!forked.is_empty(), "a postmaster with no backend");
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    // No client left for the postmaster's shutdown to wait for, once it runs again.
    drop(fence);
    tokio::task::block_in_place(|| pg.stop()).unwrap();
    let stopped = |p: &u32| task_states(*p).is_ok_and(|s| s.iter().any(|&(_, st)| st == 'T'));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while forked.iter().any(stopped) {
        if std::time::Instant::now() >= deadline {
            let frozen: Vec<u32> = forked.iter().copied().filter(stopped).collect();
            // Nobody else would ever end them.
            for &p in &frozen {
                let _ = conformance_tests::process::kill(p);
            }
            panic!("backends still stopped 10 s after the stop: {frozen:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
