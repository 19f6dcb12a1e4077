//! One PgFence object across a server crash (SIGKILL) and restart: writes in flight end as
//! OutcomeUnknown or Unavailable (never Stale, never a success that did not commit), and the same
//! object writes again once the server is back, through fresh pooled connections.

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use fence_postgres::PgFence;
use lease_core::{Bytes, Error, Fence, ResourceId, Token};
use tokio::sync::watch;

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
    let Some(mut pg) = start_or_skip_async(
        "the_same_fence_survives_a_server_crash_and_restart",
        Backend::Postgres,
        PostgresServer::start,
    )
    .await
    else {
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
