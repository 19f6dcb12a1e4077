//! PgFence and FencedTable against a real PostgreSQL started by the harness.

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use conformance_tests::proxy::FaultProxy;
use fence_postgres::{begin, FencedTable, Ident, PgFence};
use lease_core::{Bytes, Error, Fence, ResourceId, Token};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tokio_postgres::NoTls;

fn t(n: u64) -> Token {
    Token::new(n).unwrap()
}

async fn server(test: &str) -> Option<PostgresServer> {
    start_or_skip_async(test, Backend::Postgres, PostgresServer::start).await
}

async fn client(url: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(conn);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_semantics_transactions_concurrency_and_durability() {
    let Some(mut pg) = server("fence_semantics_transactions_concurrency_and_durability").await
    else {
        return;
    };
    let url = pg.connection_url();
    let fence = PgFence::connect(&url).await.unwrap();
    assert!(!format!("{fence:?}").contains("password"));
    let r = ResourceId::new("orders/42").unwrap();

    // Trait semantics: equal accepted, older rejected with the current token, claim, read.
    assert_eq!(
        fence
            .write(&r, t(5), Bytes::from_static(b"five"))
            .await
            .unwrap()
            .previous,
        None
    );
    assert_eq!(
        fence
            .write(&r, t(5), Bytes::from_static(b"five again"))
            .await
            .unwrap()
            .previous,
        Some(t(5))
    );
    match fence.write(&r, t(4), Bytes::from_static(b"four")).await {
        Err(Error::Stale {
            presented, current, ..
        }) => assert_eq!((presented, current), (t(4), t(5))),
        other => panic!("{other:?}"),
    }
    fence.claim(&r, t(9)).await.unwrap();
    let v = fence.read(&r).await.unwrap().unwrap();
    assert_eq!(v.newest, t(9));
    assert_eq!(v.value, Some((t(5), Bytes::from_static(b"five again"))));
    assert!(fence
        .read(&ResourceId::new("never").unwrap())
        .await
        .unwrap()
        .is_none());

    // The caller's statements commit with the fence, or roll back with a stale token.
    let mut c = client(&url).await;
    c.batch_execute("CREATE TABLE orders (id INT PRIMARY KEY, total INT NOT NULL, fence BIGINT NOT NULL DEFAULT 0)")
        .await
        .unwrap();
    c.execute("INSERT INTO orders (id, total) VALUES (1, 0)", &[])
        .await
        .unwrap();
    let table = Ident::new("fence_tokens").unwrap();
    let tx = begin(&mut c, &table, &r, t(10)).await.unwrap();
    assert_eq!(tx.previous(), Some(t(9)));
    tx.transaction()
        .execute("UPDATE orders SET total = 100 WHERE id = 1", &[])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    match begin(&mut c, &table, &r, t(7)).await {
        Err(Error::Stale { current, .. }) => assert_eq!(current, t(10)),
        other => panic!("{other:?}"),
    }
    // A transaction dropped without commit rolls back both the fence advance and the writes.
    {
        let tx = begin(&mut c, &table, &r, t(11)).await.unwrap();
        tx.transaction()
            .execute("UPDATE orders SET total = 999 WHERE id = 1", &[])
            .await
            .unwrap();
    }
    let total: i32 = c
        .query_one("SELECT total FROM orders WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(total, 100);
    assert_eq!(fence.read(&r).await.unwrap().unwrap().newest, t(10));
    // A statement that failed (its error swallowed by the caller) aborted the transaction:
    // PostgreSQL would answer COMMIT with ROLLBACK, so `commit` must not report `Ok`.
    {
        let tx = begin(&mut c, &table, &r, t(12)).await.unwrap();
        tx.transaction()
            .execute("UPDATE orders SET total = 555 WHERE id = 1", &[])
            .await
            .unwrap();
        let _ = tx.transaction().execute("SELECT 1/0", &[]).await;
        let committed = tx.commit().await;
        assert!(committed.is_err(), "{committed:?}");
    }
    assert_eq!(fence.read(&r).await.unwrap().unwrap().newest, t(10));

    // The single-statement form on the caller's own table.
    let orders = FencedTable::new("orders", "id", "fence").unwrap();
    orders
        .update(&c, &1i32, t(3), &[("total", &7i32)])
        .await
        .unwrap();
    match orders.update(&c, &1i32, t(2), &[("total", &8i32)]).await {
        Err(Error::Stale {
            presented, current, ..
        }) => assert_eq!((presented, current), (t(2), t(3))),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        orders.update(&c, &2i32, t(9), &[("total", &1i32)]).await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        orders.update(&c, &1i32, t(9), &[("fence", &1i64)]).await,
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        orders.update(&c, &1i32, t(9), &[("x; DROP", &1i32)]).await,
        Err(Error::InvalidInput(_))
    ));
    let total: i32 = c
        .query_one("SELECT total FROM orders WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(total, 7);
    // A row whose fence column is NULL has accepted nothing yet: the first token writes it.
    c.batch_execute("CREATE TABLE jobs (id INT PRIMARY KEY, state TEXT, fence BIGINT)")
        .await
        .unwrap();
    c.execute("INSERT INTO jobs (id, state) VALUES (1, 'new')", &[])
        .await
        .unwrap();
    let jobs = FencedTable::new("jobs", "id", "fence").unwrap();
    jobs.update(&c, &1i32, t(1), &[("state", &"running")])
        .await
        .unwrap();
    match jobs.update(&c, &1i32, t(0), &[("state", &"stale")]).await {
        Err(Error::Stale { current, .. }) => assert_eq!(current, t(1)),
        other => panic!("{other:?}"),
    }
    // Percent-encoded credentials and database names are decoded (`postgre%73` is `postgres`).
    let encoded = url
        .replace("postgres@", "postgre%73@")
        .replace("/postgres", "/postgre%73");
    PgFence::connect(&encoded)
        .await
        .expect("decoded user and database connect");

    // Concurrency: many writers, shuffled tokens, each on its own connection. Each accepted write
    // appends to a log in the same transaction; the log order is the row-lock order.
    c.batch_execute("CREATE TABLE write_log (seq BIGSERIAL PRIMARY KEY, token BIGINT NOT NULL)")
        .await
        .unwrap();
    let hot = ResourceId::new("hot").unwrap();
    let mut tokens: Vec<u64> = (1..=24).collect();
    // Seeded and printed, so that a failing order can be replayed.
    let seed: u64 = std::env::var("FENCE_SHUFFLE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("token order seed: {seed} (FENCE_SHUFFLE_SEED={seed} replays it)");
    tokens.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let mut tasks = Vec::new();
    for tok in tokens {
        let (url, hot, table) = (url.clone(), hot.clone(), table.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = client(&url).await;
            for round in 0..3 {
                let tx = match begin(&mut c, &table, &hot, t(tok)).await {
                    Ok(tx) => tx,
                    Err(Error::Stale { current, .. }) => {
                        assert!(current > t(tok));
                        return;
                    }
                    Err(e) => panic!("{e}"),
                };
                tx.store_value(format!("token {tok} round {round}").as_bytes())
                    .await
                    .unwrap();
                tx.transaction()
                    .execute(
                        "INSERT INTO write_log (token) VALUES ($1)",
                        &[&(tok as i64)],
                    )
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                tokio::task::yield_now().await;
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let log: Vec<i64> = c
        .query("SELECT token FROM write_log ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        log.windows(2).all(|w| w[0] <= w[1]),
        "a lower token was accepted after a higher one: {log:?}"
    );
    assert_eq!(*log.last().unwrap(), 24);
    let v = fence.read(&hot).await.unwrap().unwrap();
    assert_eq!(v.newest, t(24));
    assert_eq!(v.value.unwrap().1, Bytes::from_static(b"token 24 round 2"));

    // Durability: the newest accepted token survives SIGKILL and restart.
    drop(fence);
    tokio::task::spawn_blocking(move || {
        pg.kill().unwrap();
        pg.restart().unwrap();
        pg
    })
    .await
    .map(|pg| {
        let url = pg.connection_url();
        (pg, url)
    })
    .map(|(pg, url)| async move {
        let fence = PgFence::connect(&url).await.unwrap();
        match fence
            .write(&ResourceId::new("hot").unwrap(), t(23), Bytes::new())
            .await
        {
            Err(Error::Stale { current, .. }) => assert_eq!(current, t(24)),
            other => panic!("after a crash the fence must still reject 23: {other:?}"),
        }
        drop(pg);
    })
    .unwrap()
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_database_is_unavailable() {
    let port = conformance_tests::harness::free_ports(1).unwrap()[0];
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        PgFence::connect(&format!("postgres://u:secret@127.0.0.1:{port}/db")),
    )
    .await
    .unwrap();
    match r {
        Err(e @ Error::Unavailable { .. }) => assert!(!e.to_string().contains("secret")),
        other => panic!("{other:?}"),
    }
    let _ = Arc::new(());
}

/// Rows of `table` that any fenced update touched (`total` or `fence` moved from 0).
async fn touched(c: &tokio_postgres::Client, table: &str) -> i64 {
    c.query_one(
        &format!("SELECT count(*) FROM {table} WHERE total <> 0 OR COALESCE(fence, 0) <> 0"),
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

fn assert_misconfigured(r: Result<impl std::fmt::Debug, Error>, table: &str, column: &str) {
    match r {
        Err(e @ Error::Misconfigured { .. }) => {
            let s = e.to_string();
            assert!(
                s.contains(&format!("{table:?}")) && s.contains(&format!("{column:?}")),
                "the error must name table {table} and column {column}: {s}"
            );
            assert!(!e.is_retryable(), "{s}");
        }
        other => panic!("{table}.{column}: expected Misconfigured, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_table_with_a_non_unique_key_or_a_narrow_fence_is_misconfigured_and_untouched() {
    let Some(pg) = server(
        "fenced_table_with_a_non_unique_key_or_a_narrow_fence_is_misconfigured_and_untouched",
    )
    .await
    else {
        return;
    };
    let c = client(&pg.connection_url()).await;
    c.batch_execute(
        "CREATE TABLE dupes (id INT, total INT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0);
         INSERT INTO dupes (id) VALUES (1), (1);
         CREATE TABLE narrow (id INT PRIMARY KEY, total INT NOT NULL DEFAULT 0, fence INT NOT NULL DEFAULT 0);
         INSERT INTO narrow (id) VALUES (1);
         CREATE TABLE pairs (id INT, sub INT, total INT NOT NULL DEFAULT 0,
                             fence BIGINT NOT NULL DEFAULT 0, UNIQUE (id, sub));
         INSERT INTO pairs (id, sub) VALUES (1, 1), (1, 2);",
    )
    .await
    .unwrap();
    // A key that is not unique alone (no index; a composite unique index), a fence that is not
    // BIGINT: a configuration error naming table and column, and nothing is written.
    for (table, column) in [("dupes", "id"), ("pairs", "id"), ("narrow", "fence")] {
        let ft = FencedTable::new(table, "id", "fence").unwrap();
        assert_misconfigured(
            ft.update(&c, &1i32, t(5), &[("total", &9i32)]).await,
            table,
            column,
        );
        assert_eq!(touched(&c, table).await, 0, "{table}: the write applied");
    }
    // The fence's own table made by hand with a narrower token column: refused at connect,
    // naming the column, rather than accepting writes whose answer it then cannot read.
    c.batch_execute(
        "CREATE TABLE narrow_fence (resource TEXT PRIMARY KEY, newest INTEGER NOT NULL,
                                    value BYTEA, value_token BIGINT)",
    )
    .await
    .unwrap();
    let connected = PgFence::connect(&format!("{}?table=narrow_fence", pg.connection_url())).await;
    match connected {
        Err(Error::Misconfigured { problems, .. }) => {
            assert!(
                problems
                    .iter()
                    .any(|p| p.contains("newest of type integer")),
                "{problems:?}"
            );
        }
        other => panic!("expected Misconfigured, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_table_open_checks_the_catalog_once_and_a_multi_row_update_rolls_back() {
    let Some(pg) =
        server("fenced_table_open_checks_the_catalog_once_and_a_multi_row_update_rolls_back").await
    else {
        return;
    };
    let c = client(&pg.connection_url()).await;
    c.batch_execute(
        "CREATE TABLE dupes (id INT, total INT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0);
         CREATE TABLE partial (id INT, total INT NOT NULL DEFAULT 0, fence BIGINT NOT NULL DEFAULT 0);
         CREATE UNIQUE INDEX partial_id ON partial (id) WHERE id > 0;
         CREATE TABLE narrow (id INT PRIMARY KEY, total INT NOT NULL DEFAULT 0, fence INT NOT NULL DEFAULT 0);
         CREATE TABLE texty (id TEXT UNIQUE, total INT NOT NULL DEFAULT 0, fence NUMERIC);
         CREATE TABLE good (id INT, total INT NOT NULL DEFAULT 0, fence BIGINT);
         CREATE UNIQUE INDEX good_id ON good (id);
         INSERT INTO good (id) VALUES (1);",
    )
    .await
    .unwrap();
    assert_misconfigured(
        FencedTable::open(&c, "dupes", "id", "fence").await,
        "dupes",
        "id",
    );
    assert_misconfigured(
        FencedTable::open(&c, "partial", "id", "fence").await,
        "partial",
        "id",
    );
    assert_misconfigured(
        FencedTable::open(&c, "narrow", "id", "fence").await,
        "narrow",
        "fence",
    );
    assert_misconfigured(
        FencedTable::open(&c, "texty", "id", "fence").await,
        "texty",
        "fence",
    );
    assert_misconfigured(
        FencedTable::open(&c, "good", "nope", "fence").await,
        "good",
        "nope",
    );
    assert_misconfigured(
        FencedTable::open(&c, "good", "id", "nope").await,
        "good",
        "nope",
    );
    assert!(matches!(
        FencedTable::open(&c, "missing", "id", "fence").await,
        Err(Error::NotFound { .. })
    ));
    assert!(matches!(
        FencedTable::open(&c, "good", "id;", "fence").await,
        Err(Error::InvalidInput(_))
    ));

    // A good table passes, then its unique index is dropped behind the fence's back and a
    // duplicate key appears: the one statement that would update two rows is rolled back.
    let good = FencedTable::open(&c, "good", "id", "fence").await.unwrap();
    good.update(&c, &1i32, t(1), &[("total", &1i32)])
        .await
        .unwrap();
    c.batch_execute("DROP INDEX good_id; INSERT INTO good (id) VALUES (1);")
        .await
        .unwrap();
    assert_misconfigured(
        good.update(&c, &1i32, t(2), &[("total", &2i32)]).await,
        "good",
        "id",
    );
    let rows: Vec<(i32, Option<i64>)> = c
        .query("SELECT total, fence FROM good ORDER BY total DESC", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, vec![(1, Some(1)), (0, None)], "the update applied");
    // Inside the caller's transaction the failed statement aborts that transaction.
    let mut c2 = client(&pg.connection_url()).await;
    let tx = c2.transaction().await.unwrap();
    assert_misconfigured(
        good.update(&tx, &1i32, t(3), &[("total", &3i32)]).await,
        "good",
        "id",
    );
    // PostgreSQL answers COMMIT of an aborted transaction with ROLLBACK: nothing applied.
    let _ = tx.commit().await;
    let after: Vec<(i32, Option<i64>)> = c
        .query("SELECT total, fence FROM good ORDER BY total DESC", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        after, rows,
        "the update applied inside the caller's transaction"
    );
}

/// Waits (bounded) until the fence at `direct` shows `value` written with `token` for `r`.
async fn until_value(direct: &PgFence, r: &ResourceId, token: Token, value: &'static [u8]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v = direct.read(r).await.unwrap();
        if v.as_ref().and_then(|v| v.value.clone()) == Some((token, Bytes::from_static(value))) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{value:?} never applied: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_are_bounded_never_replayed_and_the_later_write_stands() {
    let Some(pg) =
        server("lost_replies_are_bounded_never_replayed_and_the_later_write_stands").await
    else {
        return;
    };
    let proxy = FaultProxy::start(pg.addr()).await.unwrap();
    let fence = PgFence::connect(&format!(
        "postgres://postgres@{}/postgres?table=lossy&timeout_ms=1000",
        proxy.addr()
    ))
    .await
    .unwrap();
    assert_eq!(fence.timeout(), Duration::from_secs(1));
    let direct = PgFence::connect(&format!("{}?table=lossy", pg.connection_url()))
        .await
        .unwrap();
    let r = ResourceId::new("lossy/1").unwrap();
    fence
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();

    // Every reply lost: the write ends within its bound, is not reported as applied, and the
    // fence does not send it again.
    proxy.drop_replies();
    let began = std::time::Instant::now();
    let lost = tokio::time::timeout(
        Duration::from_secs(10),
        fence.write(&r, t(6), Bytes::from_static(b"v1")),
    )
    .await
    .expect("a write whose replies are lost must end within its timeout");
    // The write is one pipelined request (BEGIN .. COMMIT): it reached the server, so its
    // outcome is unknown, and here it did apply.
    match &lost {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("{other:?}"),
    }
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    until_value(&direct, &r, t(6), b"v1").await;
    proxy.heal();
    // The later write with the same token, through the same fence (a new connection), stands.
    fence
        .write(&r, t(6), Bytes::from_static(b"v2"))
        .await
        .unwrap();
    until_value(&direct, &r, t(6), b"v2").await;
    let v = fence.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(6), Bytes::from_static(b"v2"))));

    // A COMMIT that is slower than the timeout: sent, then no answer in time. OutcomeUnknown,
    // never Unavailable, never retried; and its session is ended before the error returns, so
    // the COMMIT (still in its deferred trigger) never applies.
    direct
        .claim(&ResourceId::new("init").unwrap(), t(1))
        .await
        .unwrap();
    let c = client(&pg.connection_url()).await;
    c.batch_execute(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
         IF NEW.value = 'slow' AND OLD.value IS DISTINCT FROM 'slow' THEN PERFORM pg_sleep(30); END IF;
         RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER UPDATE ON lossy
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .await
    .unwrap();
    let before = proxy.request_bytes();
    match fence.write(&r, t(7), Bytes::from_static(b"slow")).await {
        Err(Error::OutcomeUnknown {
            operation, message, ..
        }) => {
            assert_eq!(operation, "write");
            assert!(message.contains(SESSION_ENDED), "{message}");
        }
        other => panic!("a COMMIT without answer must be OutcomeUnknown: {other:?}"),
    }
    let sent = proxy.request_bytes() - before;
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(6), Bytes::from_static(b"v2"))));
    // At most the 5-byte Terminate of the dropped connection may follow; a resent write would
    // be a whole transaction.
    let later = proxy.request_bytes() - before - sent;
    assert!(
        later <= 5,
        "the fence sent {later} more bytes after the unknown outcome (a blind retry?)"
    );
    fence
        .write(&r, t(7), Bytes::from_static(b"after"))
        .await
        .unwrap();
    until_value(&direct, &r, t(7), b"after").await;

    // The connection cut while COMMIT runs: OutcomeUnknown too, and again the session is ended
    // before the error returns, in the middle of the COMMIT's trigger.
    let slow = {
        let r = r.clone();
        let fence = Arc::new(
            PgFence::connect(&format!(
                "postgres://postgres@{}/postgres?table=lossy&timeout_ms=10000",
                proxy.addr()
            ))
            .await
            .unwrap(),
        );
        let f = fence.clone();
        (
            tokio::spawn(async move { f.write(&r, t(8), Bytes::from_static(b"slow")).await }),
            fence,
        )
    };
    until_a_commit_runs(&c).await;
    proxy.cut();
    match slow.0.await.unwrap() {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains(SESSION_ENDED), "{message}");
        }
        other => panic!("a connection lost during COMMIT must be OutcomeUnknown: {other:?}"),
    }
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(7), Bytes::from_static(b"after"))));
    slow.1
        .write(&r, t(8), Bytes::from_static(b"last"))
        .await
        .unwrap();
    until_value(&direct, &r, t(8), b"last").await;
}

/// What an `OutcomeUnknown` says once the write's server session is gone.
const SESSION_ENDED: &str = "its server session has since been ended";

/// A write whose bytes the network holds past the timeout (its connection stalls; a new
/// connection gets through) is `OutcomeUnknown`, and its session is ended before the error
/// returns: when the held bytes are delivered afterwards they commit nothing, so the read made
/// right after the error stays true. (Without ending the session, the held `COMMIT` applies
/// when the network heals: checked by hand with `end_unknown_sessions=false`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_write_cannot_commit_after_its_outcome_unknown() {
    let Some(pg) = server("a_stalled_write_cannot_commit_after_its_outcome_unknown").await else {
        return;
    };
    let proxy = FaultProxy::start(pg.addr()).await.unwrap();
    let fence = PgFence::connect(&format!(
        "postgres://postgres@{}/postgres?table=stalled&timeout_ms=500",
        proxy.addr()
    ))
    .await
    .unwrap();
    let direct = PgFence::connect(&format!("{}?table=stalled", pg.connection_url()))
        .await
        .unwrap();
    let r = ResourceId::new("stalled/1").unwrap();
    let five = (t(5), Bytes::from_static(b"five"));
    fence.write(&r, five.0, five.1.clone()).await.unwrap();

    proxy.stall_open();
    match fence.write(&r, t(6), Bytes::from_static(b"late")).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains(SESSION_ENDED), "{message}");
            // No synchronous standby is configured: the commit after it returns at once.
            assert!(
                message.contains("confirmed by the synchronous standbys, if any"),
                "{message}"
            );
        }
        other => panic!("a stalled write must be OutcomeUnknown: {other:?}"),
    }
    let read = || async { direct.read(&r).await.unwrap().unwrap().value };
    assert_eq!(read().await, Some(five.clone()));

    // Deliver the held bytes, and wait until the stalled connection has ended.
    let open = proxy.open_connections();
    proxy.heal();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.open_connections() >= open {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the stalled connection never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(read().await, Some(five), "the held write committed late");
    // The fence goes on: a write under the same token stands.
    fence
        .write(&r, t(6), Bytes::from_static(b"six"))
        .await
        .unwrap();
    assert_eq!(read().await, Some((t(6), Bytes::from_static(b"six"))));
}

/// A write whose `COMMIT` waits for a synchronous standby past the timeout has committed on the
/// primary once its session is ended (PostgreSQL's documented behaviour), so a read there shows
/// it although no standby has it, and a failover would lose it. Before, the error said that a
/// read now shows whether the write committed; now the fence commits once more after ending the
/// session, which waits for the standbys, and the error says that none confirmed it, and to
/// write again under a new token. The standby is one `synchronous_standby_names` names and
/// that never connects (as one that is down), so every commit waits for it; the wait of the
/// fence's own commit is cancelled when it gives up, leaving no session waiting. The fence's
/// role is an ordinary one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_ended_while_waiting_for_a_standby_says_a_failover_may_lose_it() {
    let Some(pg) = server("a_write_ended_while_waiting_for_a_standby").await else {
        return;
    };
    let url = pg.connection_url();
    let r = ResourceId::new("standby/1").unwrap();
    // The owner creates the table (and the row) while commits need no standby; the fence under
    // test runs as a role with no more than it needs (it ends sessions of its own role).
    PgFence::connect(&format!("{url}?table=standby"))
        .await
        .unwrap()
        .write(&r, t(1), Bytes::from_static(b"one"))
        .await
        .unwrap();
    let admin = client(&url).await;
    admin
        .batch_execute(
            "CREATE ROLE fence_app LOGIN; \
             GRANT SELECT, INSERT, UPDATE ON standby TO fence_app",
        )
        .await
        .unwrap();
    let app_url = url.replacen("postgres://postgres@", "postgres://fence_app@", 1);
    let fence = PgFence::connect(&format!("{app_url}?table=standby&timeout_ms=1000"))
        .await
        .unwrap();
    // (`ALTER SYSTEM` cannot share a query string: it would run in a transaction.)
    for sql in [
        "ALTER SYSTEM SET synchronous_standby_names = 'never_connects'",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
    // The postmaster signals every session as it reloads; a new session showing the setting
    // means that it did.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let fresh = client(&url).await;
        let names: String = fresh
            .query_one("SHOW synchronous_standby_names", &[])
            .await
            .unwrap()
            .get(0);
        if names == "never_connects" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never reloaded");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    match fence.write(&r, t(2), Bytes::from_static(b"two")).await {
        Err(Error::OutcomeUnknown { message, .. }) => assert!(
            message.contains(SESSION_ENDED)
                && message.contains("no synchronous standby confirmed")
                && message.contains("a failover may still lose")
                && message.contains("new token"),
            "{message}"
        ),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    // Committed on the primary all the same: a read there shows it.
    assert_eq!(fence.read(&r).await.unwrap().unwrap().newest, t(2));
    // Nothing is left waiting for the standby (the write's session was ended, the fence's own
    // commit after it cancelled).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sessions(&admin, "wait_event = 'SyncRep'").await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a session is still waiting for the standby"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for sql in [
        "ALTER SYSTEM RESET synchronous_standby_names",
        "SELECT pg_reload_conf()",
    ] {
        admin.batch_execute(sql).await.unwrap();
    }
}

/// Makes a `COMMIT` that wrote the value `slow` to `table` sleep 30 s in a deferred trigger
/// (holding the row's lock), so that only ending its session stops it within a test.
async fn slow_commits_on(c: &tokio_postgres::Client, table: &str) {
    c.batch_execute(&format!(
        "CREATE FUNCTION {table}_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
         IF NEW.value = 'slow' THEN PERFORM pg_sleep(30); END IF;
         RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER {table}_commit AFTER UPDATE ON {table}
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {table}_commit();"
    ))
    .await
    .unwrap();
}

/// Waits until a `COMMIT` runs on the server (caught in a slow deferred trigger).
async fn until_a_commit_runs(c: &tokio_postgres::Client) {
    until_a_session(c, "query = 'COMMIT' AND state = 'active'").await;
}

/// How many sessions `pg_stat_activity` shows `WHERE condition`.
async fn sessions(c: &tokio_postgres::Client, condition: &str) -> i64 {
    let sql = format!("SELECT count(*) FROM pg_stat_activity WHERE {condition}");
    c.query_one(&sql, &[]).await.unwrap().get(0)
}

/// Waits (10 s at most) until `pg_stat_activity` shows a session `WHERE condition`.
async fn until_a_session(c: &tokio_postgres::Client, condition: &str) {
    until_a_session_or(c, condition, || false).await;
}

/// As [`until_a_session`], or until `done()`.
async fn until_a_session_or(c: &tokio_postgres::Client, condition: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if done() || sessions(c, condition).await > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no session ever showed {condition}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A write whose `COMMIT` outlives the timeout holds its row's lock until its session ends.
/// With every pooled connection taken by a writer queued on that lock (one already waiting on
/// it, one waiting for the connection the unknown write's timeout frees), the fence still ends
/// the session (from connections of its own, not the fence's pool): the unknown write says its
/// session was ended, and the queued writers then get the row. (Ending it from the fence's
/// pool, the termination waited behind the queued writers, which waited on the lock: the one
/// on the lock gave up when its lock timeout fired.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_queued_on_an_unknown_writes_lock_cannot_starve_its_end() {
    let Some(pg) = server("writers_queued_on_an_unknown_writes_lock_cannot_starve_its_end").await
    else {
        return;
    };
    let url = pg.connection_url();
    let fence = Arc::new(
        PgFence::connect(&format!("{url}?table=starved&timeout_ms=3000&pool_size=2"))
            .await
            .unwrap(),
    );
    let direct = PgFence::connect(&format!("{url}?table=starved"))
        .await
        .unwrap();
    let r = ResourceId::new("starved/1").unwrap();
    fence
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();
    let c = client(&url).await;
    slow_commits_on(&c, "starved").await;

    let write = |token: u64, value: &'static [u8]| {
        let (fence, r) = (fence.clone(), r.clone());
        tokio::spawn(async move { fence.write(&r, t(token), Bytes::from_static(value)).await })
    };
    let slow = write(6, b"slow");
    until_a_commit_runs(&c).await;
    // Half the timeout later, so that the queued writers' own timeouts (and the server's
    // lock_timeout) end well after the slow write's has ended its session.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let on_the_lock = write(7, b"seven");
    // Until it waits on the row lock (or, on a machine stalled for longer than the margin
    // above, the slow write is over already: the rest still holds, less is proven).
    until_a_session_or(&c, "wait_event_type = 'Lock'", || slow.is_finished()).await;
    // Both pooled connections are taken now: this one waits for the one the slow write's
    // timeout frees, first in line for it.
    let on_the_pool = write(8, b"eight");
    match slow.await.unwrap() {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains(SESSION_ENDED), "{message}");
        }
        other => panic!("a COMMIT without answer must be OutcomeUnknown: {other:?}"),
    }
    // Whichever of the two gets the row first, neither is starved: 7 is accepted, or refused
    // as stale once 8 is in.
    match on_the_lock.await.unwrap() {
        Ok(_) | Err(Error::Stale { .. }) => {}
        Err(e) => panic!("the writer queued on the lock gets the row: {e}"),
    }
    on_the_pool
        .await
        .unwrap()
        .expect("the writer queued on the pool gets a connection and the row");
    let v = direct.read(&r).await.unwrap().unwrap();
    assert_eq!(v.value, Some((t(8), Bytes::from_static(b"eight"))));
}

/// With a multi-host URL, the connection that ends an unknown write's session may reach another
/// server than the write's (the first host stopped taking new connections, so the client moved
/// on). There the session is not listed, which must not be taken for "gone": the error says the
/// session could not be ended, and indeed it still runs on its own server. (Matching on pid and
/// start time alone, the other server's empty answer read as "ended".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_never_taken_for_ended_on_another_server() {
    let test = "a_session_is_never_taken_for_ended_on_another_server";
    let Some(first) = server(test).await else {
        return;
    };
    let Some(second) = server(test).await else {
        return;
    };
    let proxy = FaultProxy::start(first.addr()).await.unwrap();
    let fence = Arc::new(
        PgFence::connect(&format!(
            "postgres://postgres@{},{}/postgres?table=hosts&timeout_ms=3000&pool_size=1",
            proxy.addr(),
            second.addr()
        ))
        .await
        .unwrap(),
    );
    let r = ResourceId::new("hosts/1").unwrap();
    fence
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();
    let c = client(&first.connection_url()).await;
    slow_commits_on(&c, "hosts").await;

    // The pooled connection (to the first server) is kept; any new one goes to the second.
    proxy.refuse_new();
    match fence.write(&r, t(6), Bytes::from_static(b"slow")).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(
                message.contains("could not be ended") && message.contains("another server"),
                "{message}"
            );
        }
        other => panic!("a COMMIT without answer must be OutcomeUnknown: {other:?}"),
    }
    let running = sessions(&c, "query = 'COMMIT' AND state = 'active'").await;
    assert_eq!(running, 1, "the unknown write's session is still running");
    c.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query = 'COMMIT'",
        &[],
    )
    .await
    .unwrap();

    // Once the first host takes connections again, the next unknown write there has its session
    // ended: the connection that reached the second server was closed, not kept for next time.
    proxy.heal();
    match fence.write(&r, t(7), Bytes::from_static(b"slow")).await {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains(SESSION_ENDED), "{message}");
        }
        other => panic!("a COMMIT without answer must be OutcomeUnknown: {other:?}"),
    }
    let running = sessions(&c, "query = 'COMMIT'").await;
    assert_eq!(running, 0, "the second unknown write's session is gone");
}

/// The fence write's transaction does not take the database's defaults. With
/// `default_transaction_isolation = 'repeatable read'` and `synchronous_commit = off` set on the
/// database, writers contending on one resource are each accepted or refused as stale, never
/// failed by a serialization error (under repeatable read, `FOR UPDATE` on a row another
/// writer committed since the snapshot fails with 40001).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_transaction_ignores_the_databases_isolation_and_commit_defaults() {
    let Some(pg) = server("the_write_transaction_ignores_the_databases_defaults").await else {
        return;
    };
    let url = pg.connection_url();
    let admin = client(&url).await;
    admin
        .batch_execute("CREATE DATABASE strict_defaults")
        .await
        .unwrap();
    admin
        .batch_execute(
            "ALTER DATABASE strict_defaults SET default_transaction_isolation = 'repeatable read'; \
             ALTER DATABASE strict_defaults SET synchronous_commit = off",
        )
        .await
        .unwrap();
    let base = url
        .strip_suffix("/postgres")
        .expect("the harness URL ends in /postgres");
    let strict = format!("{base}/strict_defaults");
    // The setting applies to new sessions of that database.
    let check = client(&strict).await;
    let isolation: String = check
        .query_one("SHOW transaction_isolation", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(isolation, "repeatable read");
    let fence = Arc::new(
        PgFence::connect(&format!("{strict}?pool_size=8"))
            .await
            .unwrap(),
    );
    let r = ResourceId::new("contended").unwrap();
    const WRITERS: u64 = 8;
    const ROUNDS: u64 = 25;
    let tasks: Vec<_> = (1..=WRITERS)
        .map(|w| {
            let (fence, r) = (fence.clone(), r.clone());
            tokio::spawn(async move {
                let mut failures = Vec::new();
                for round in 0..ROUNDS {
                    let token = t(round * WRITERS + w);
                    match fence.write(&r, token, Bytes::from_static(b"v")).await {
                        Ok(_) | Err(Error::Stale { .. }) => {}
                        Err(e) => failures.push(e.to_string()),
                    }
                }
                failures
            })
        })
        .collect();
    let mut failures = Vec::new();
    for task in tasks {
        failures.extend(task.await.unwrap());
    }
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    assert_eq!(
        fence.read(&r).await.unwrap().map(|v| v.newest),
        Some(t(ROUNDS * WRITERS))
    );
}

/// An application role that may only read and write the existing fence table (no `CREATE` on
/// the schema: PostgreSQL 15's default for `public`) connects with the default `migrate=true`
/// and writes: the table is found and left alone, where `CREATE TABLE IF NOT EXISTS` alone was
/// refused (42501) before it looked for the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_create_on_the_schema_connects_to_an_existing_table() {
    let Some(pg) = server("a_role_without_create_on_the_schema_connects").await else {
        return;
    };
    let url = pg.connection_url();
    // The owner creates the table.
    PgFence::connect(&url).await.unwrap();
    let admin = client(&url).await;
    admin
        .batch_execute(
            "CREATE ROLE fence_app LOGIN; \
             REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
             GRANT SELECT, INSERT, UPDATE ON fence_tokens TO fence_app",
        )
        .await
        .unwrap();
    let app_url = url.replacen("postgres://postgres@", "postgres://fence_app@", 1);
    let fence = PgFence::connect(&app_url)
        .await
        .unwrap_or_else(|e| panic!("the application role could not connect: {e}"));
    let r = ResourceId::new("app/1").unwrap();
    fence
        .write(&r, t(3), Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert_eq!(fence.read(&r).await.unwrap().map(|v| v.newest), Some(t(3)));
}

/// What a caller leaves in a session of a lent connection (`PgFence::pool`) never reaches a
/// fence write: a temporary table named like the fence table would otherwise take the fence's
/// writes on that connection (temporary tables come first in the search path), out of every
/// other writer's sight. And the lent connection comes back reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_session_state_never_reaches_the_fence() {
    let Some(pg) = server("a_callers_session_state_never_reaches_the_fence").await else {
        return;
    };
    let fence = PgFence::connect(&format!(
        "{}?table=shadowed&pool_size=1",
        pg.connection_url()
    ))
    .await
    .unwrap();
    let direct = PgFence::connect(&format!("{}?table=shadowed", pg.connection_url()))
        .await
        .unwrap();
    {
        let c = fence.pool().get().await.unwrap();
        c.batch_execute(
            "CREATE TEMP TABLE shadowed (resource TEXT PRIMARY KEY, newest BIGINT NOT NULL, \
             value BYTEA, value_token BIGINT, updated_at TIMESTAMPTZ NOT NULL DEFAULT now()); \
             SET search_path = pg_temp, public",
        )
        .await
        .unwrap();
    }
    let r = ResourceId::new("shadowed/1").unwrap();
    fence
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();
    let v = direct
        .read(&r)
        .await
        .unwrap()
        .expect("written to the fence table");
    assert_eq!(v.value, Some((t(5), Bytes::from_static(b"five"))));
    let c = fence.pool().get().await.unwrap();
    let left: Option<String> = c
        .query_one("SELECT to_regclass('pg_temp.shadowed')::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, None, "the lent connection was not reset");
}

/// A stand-in for a connection pooler (PgBouncer) between the fence and PostgreSQL: it forwards
/// both ways until [`Pooler::hold_replies`]; from then on the server's replies on the
/// connections open at that moment are read and dropped (after the first `pass` whole replies,
/// counted in `ReadyForQuery` messages), and [`Pooler::crash`] sends each of them what a pooler
/// sends its clients when its server connection dies (an `ErrorResponse` `FATAL 08P01`,
/// severity in the `S` field only, as PgBouncer writes it) and closes it, at once or (as a
/// server process exits some time after its `FATAL`) a while later. Connections accepted later
/// pass through.
struct Pooler {
    addr: std::net::SocketAddr,
    accepted: Arc<std::sync::atomic::AtomicU64>,
    held_below: Arc<std::sync::atomic::AtomicU64>,
    pass: Arc<std::sync::atomic::AtomicU64>,
    dropped: Arc<std::sync::atomic::AtomicU64>,
    crash: tokio::sync::watch::Sender<Option<Duration>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Pooler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Pooler {
    async fn start(upstream: std::net::SocketAddr) -> Pooler {
        use std::sync::atomic::{AtomicU64, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let held_below = Arc::new(AtomicU64::new(0));
        let pass = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let (crash, crashed) = tokio::sync::watch::channel(None);
        let task = tokio::spawn({
            let (accepted, held_below) = (accepted.clone(), held_below.clone());
            let (pass, dropped) = (pass.clone(), dropped.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let n = accepted.fetch_add(1, Ordering::SeqCst);
                    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                    });
                    let (held_below, mut crashed) = (held_below.clone(), crashed.clone());
                    let (pass, dropped) = (pass.clone(), dropped.clone());
                    tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        // Whether this connection's replies are held: read when each reply
                        // arrives and when the crash comes, not before waiting for either.
                        let held = || n < held_below.load(Ordering::SeqCst);
                        // Once held: the bytes of a message not yet whole, and the replies
                        // passed so far.
                        let (mut partial, mut passed) = (Vec::new(), 0u64);
                        loop {
                            tokio::select! {
                                read = server_read.read(&mut buf) => match read {
                                    Ok(0) | Err(_) => break,
                                    Ok(k) if held() => {
                                        partial.extend_from_slice(&buf[..k]);
                                        let mut out = Vec::new();
                                        while partial.len() >= 5 {
                                            let len = i32::from_be_bytes(
                                                partial[1..5].try_into().unwrap(),
                                            ) as usize;
                                            if partial.len() < 1 + len {
                                                break;
                                            }
                                            let message: Vec<u8> =
                                                partial.drain(..1 + len).collect();
                                            if passed < pass.load(Ordering::SeqCst) {
                                                passed += u64::from(message[0] == b'Z');
                                                out.extend_from_slice(&message);
                                            } else {
                                                dropped.fetch_add(1, Ordering::SeqCst);
                                            }
                                        }
                                        if client_write.write_all(&out).await.is_err() {
                                            break;
                                        }
                                    }
                                    Ok(k) => {
                                        if client_write.write_all(&buf[..k]).await.is_err() {
                                            break;
                                        }
                                    }
                                },
                                // The only change is to `Some`.
                                Ok(()) = crashed.changed() => {
                                    if !held() {
                                        continue;
                                    }
                                    let linger = crashed.borrow().unwrap_or_default();
                                    let fields = b"SFATAL\0C08P01\0Mserver conn crashed?\0\0";
                                    let mut message = vec![b'E'];
                                    message.extend_from_slice(&(fields.len() as i32 + 4).to_be_bytes());
                                    message.extend_from_slice(fields);
                                    let _ = client_write.write_all(&message).await;
                                    tokio::time::sleep(linger).await;
                                    let _ = client_write.shutdown().await;
                                    break;
                                }
                            }
                        }
                    });
                }
            }
        });
        Pooler {
            addr,
            accepted,
            held_below,
            pass,
            dropped,
            crash,
            task,
        }
    }

    /// From now on, drop the server's replies on the connections open now.
    fn hold_replies(&self) {
        self.hold_replies_after(0);
    }

    /// From now on, pass the next `pass` whole replies on each connection open now (each ends
    /// with a `ReadyForQuery`), and drop the server's messages after them.
    fn hold_replies_after(&self, pass: u64) {
        use std::sync::atomic::Ordering;
        self.pass.store(pass, Ordering::SeqCst);
        self.held_below
            .store(self.accepted.load(Ordering::SeqCst), Ordering::SeqCst);
    }

    /// How many of the server's messages were dropped so far.
    fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The server connections behind the held connections die: each gets the pooler's FATAL.
    fn crash(&self) {
        self.crash_then_close_after(Duration::ZERO);
    }

    /// As [`Pooler::crash`], each held connection closed `linger` after its `FATAL`.
    fn crash_then_close_after(&self, linger: Duration) {
        self.crash.send_replace(Some(linger));
    }
}

/// A write whose COMMIT applied, and then a pooler's `FATAL` instead of the replies (its server
/// connection died after the commit): the error says nothing of what applied before it, so the
/// write is `OutcomeUnknown`. Before, any error from the server was taken as "nothing written"
/// (`Unavailable`), for a write that had committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poolers_fatal_error_after_the_commit_is_outcome_unknown() {
    let Some(pg) = server("a_poolers_fatal_error_after_the_commit_is_outcome_unknown").await else {
        return;
    };
    let pooler = Pooler::start(pg.addr()).await;
    let fence = Arc::new(
        PgFence::connect(&format!(
            "postgres://postgres@{}/postgres?table=pooled&timeout_ms=20000&pool_size=1",
            pooler.addr
        ))
        .await
        .unwrap(),
    );
    let direct = PgFence::connect(&format!("{}?table=pooled", pg.connection_url()))
        .await
        .unwrap();
    let r = ResourceId::new("pooled/1").unwrap();
    fence
        .write(&r, t(5), Bytes::from_static(b"five"))
        .await
        .unwrap();
    pooler.hold_replies();
    let write = tokio::spawn({
        let (fence, r) = (fence.clone(), r.clone());
        async move { fence.write(&r, t(6), Bytes::from_static(b"six")).await }
    });
    // Committed on the server; its replies held by the pooler.
    until_value(&direct, &r, t(6), b"six").await;
    pooler.crash();
    let got = tokio::time::timeout(Duration::from_secs(60), write)
        .await
        .expect("the write ends within its bounds")
        .unwrap();
    match got {
        Err(Error::OutcomeUnknown { .. }) => {}
        other => panic!("a write that committed, answered by a pooler's FATAL: {other:?}"),
    }
    // The fence goes on, on a new connection.
    fence
        .write(&r, t(6), Bytes::from_static(b"again"))
        .await
        .unwrap();
}

/// A stale write whose `COMMIT` is answered by a pooler's `FATAL`: the write is `Stale` (its
/// `UPDATE` changed nothing, whatever the `COMMIT`'s reply) and the dead connection is closed,
/// not lent to the next write. Before, the `Stale` returned it to the pool, and the next write,
/// pipelined into it, ended `OutcomeUnknown` whenever the pool's check ran before the
/// connection's end was seen (here it comes half a second after the FATAL). Five rounds, each
/// with a new stand-in and fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_write_whose_commit_meets_a_fatal_does_not_lend_its_dead_connection() {
    let Some(pg) =
        server("a_stale_write_whose_commit_meets_a_fatal_does_not_lend_its_dead_connection").await
    else {
        return;
    };
    let direct = PgFence::connect(&format!("{}?table=stale_pooled", pg.connection_url()))
        .await
        .unwrap();
    for round in 0..5u64 {
        let pooler = Pooler::start(pg.addr()).await;
        let fence = Arc::new(
            PgFence::connect(&format!(
                "postgres://postgres@{}/postgres?table=stale_pooled&timeout_ms=20000&pool_size=1",
                pooler.addr
            ))
            .await
            .unwrap(),
        );
        let r = ResourceId::new(format!("stale/{round}")).unwrap();
        fence.claim(&r, t(5)).await.unwrap();
        direct.claim(&r, t(7)).await.unwrap();
        // The write's pipeline: BEGIN, the insert, the row lock and the UPDATE are answered;
        // the COMMIT's reply is held, then replaced by the pooler's FATAL.
        pooler.hold_replies_after(4);
        let write = tokio::spawn({
            let (fence, r) = (fence.clone(), r.clone());
            async move { fence.write(&r, t(6), Bytes::from_static(b"six")).await }
        });
        let held = tokio::time::timeout(Duration::from_secs(30), async {
            while pooler.dropped() == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(held.is_ok(), "round {round}: the COMMIT's reply never came");
        // As a server process's exit follows its FATAL: the connection ends a while after it.
        pooler.crash_then_close_after(Duration::from_millis(500));
        let got = tokio::time::timeout(Duration::from_secs(60), write)
            .await
            .expect("the write ends within its bounds")
            .unwrap();
        match got {
            Err(Error::Stale { current, .. }) => assert_eq!(current, t(7), "round {round}"),
            other => panic!("round {round}: a stale write answered by a FATAL: {other:?}"),
        }
        match fence.write(&r, t(8), Bytes::from_static(b"eight")).await {
            Ok(_) => {}
            other => panic!("round {round}: the write after it: {other:?}"),
        }
    }
}

/// With `migrate=false` an existing table of another shape is refused when the fence connects,
/// naming the column. Before, it was not checked: a table with `newest INTEGER` took a write,
/// committed it, and then reported `InvalidInput` ("nothing sent") when reading its row back; a
/// `resource VARCHAR(8)` passed and refused longer ids with a retryable `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_table_of_another_shape_is_refused_without_migrate() {
    let Some(pg) = server("an_existing_table_of_another_shape_is_refused_without_migrate").await
    else {
        return;
    };
    let url = pg.connection_url();
    let c = client(&url).await;
    c.batch_execute(
        "CREATE TABLE handmade (resource text PRIMARY KEY, newest integer NOT NULL, \
           value bytea, value_token integer, updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE short_ids (resource varchar(8) PRIMARY KEY, newest bigint NOT NULL, \
           value bytea, value_token bigint, updated_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE long_ids (resource varchar(300) PRIMARY KEY, newest bigint NOT NULL, \
           value bytea, value_token bigint, updated_at timestamptz NOT NULL DEFAULT now());",
    )
    .await
    .unwrap();
    for (table, named) in [
        ("handmade", "newest of type integer"),
        ("short_ids", "character varying(8)"),
    ] {
        for migrate in ["false", "true"] {
            match PgFence::connect(&format!("{url}?table={table}&migrate={migrate}")).await {
                Err(Error::Misconfigured { problems, .. }) => {
                    assert!(problems.iter().any(|p| p.contains(named)), "{problems:?}")
                }
                other => panic!("{table}, migrate={migrate}: {other:?}"),
            }
        }
    }
    // A long enough limit is fine, and a domain counts as its base type.
    c.batch_execute(
        "CREATE DOMAIN fence_token AS bigint CHECK (VALUE >= 0);
         CREATE TABLE domained (resource text PRIMARY KEY, newest fence_token NOT NULL, \
           value bytea, value_token fence_token, updated_at timestamptz NOT NULL DEFAULT now());",
    )
    .await
    .unwrap();
    let r = ResourceId::new("x".repeat(lease_core::MAX_NAME_BYTES)).unwrap();
    for table in ["long_ids", "domained"] {
        let fence = PgFence::connect(&format!("{url}?table={table}&migrate=false"))
            .await
            .unwrap();
        fence.claim(&r, t(1)).await.unwrap();
    }
    // A row holding no valid token (a table made without the migration's CHECK): a write above
    // it takes effect and is reported accepted. Before, the row's value was converted first, and
    // the committed write came back as `InvalidInput` ("nothing was sent").
    c.execute(
        "INSERT INTO long_ids (resource, newest) VALUES ('negative', -5)",
        &[],
    )
    .await
    .unwrap();
    let fence = PgFence::connect(&format!("{url}?table=long_ids&migrate=false"))
        .await
        .unwrap();
    let negative = ResourceId::new("negative").unwrap();
    let accepted = fence
        .write(&negative, t(3), Bytes::from_static(b"v"))
        .await
        .unwrap();
    assert_eq!(accepted.previous, None, "-5 is no token to report");
    let row = c
        .query_one(
            "SELECT newest FROM long_ids WHERE resource = 'negative'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 3);
    // No table yet is left to the first write, which names it.
    let fence = PgFence::connect(&format!("{url}?table=not_yet&migrate=false"))
        .await
        .unwrap();
    match fence.claim(&r, t(1)).await {
        Err(Error::Misconfigured { .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// A write queued behind a row lock held past its bound is refused by the server (its
/// `lock_timeout`): `Unavailable`, nothing applied, the connection kept. Before, the server's
/// bound equalled the client's, which starts earlier, so the client always gave up first:
/// `OutcomeUnknown`, and the session ended, for a write that could not have applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_behind_a_held_row_lock_is_refused_by_the_server_in_time() {
    let Some(pg) = server("a_write_behind_a_held_row_lock_is_refused_by_the_server").await else {
        return;
    };
    let url = pg.connection_url();
    // 6 s: the server's bound (three quarters of it) then ends the wait 1.5 s before the
    // client's, room for a slow reply on a loaded machine.
    let fence = PgFence::connect(&format!("{url}?table=locked&timeout_ms=6000"))
        .await
        .unwrap();
    let r = ResourceId::new("locked/1").unwrap();
    fence.claim(&r, t(1)).await.unwrap();
    let mut c = client(&url).await;
    let tx = c.transaction().await.unwrap();
    tx.query(
        "SELECT 1 FROM locked WHERE resource = $1 FOR UPDATE",
        &[&r.as_str()],
    )
    .await
    .unwrap();
    let began = std::time::Instant::now();
    match fence.write(&r, t(2), Bytes::from_static(b"two")).await {
        Err(Error::Unavailable { message, .. }) => {
            assert!(message.contains("55P03"), "{message}")
        }
        other => panic!("a lock wait the server refuses, nothing applied: {other:?}"),
    }
    assert!(
        began.elapsed() < Duration::from_secs(6),
        "{:?}",
        began.elapsed()
    );

    // The session terminated while its write waits for the lock (as at a shutdown): a FATAL,
    // which leaves the outcome unknown whoever sent it (a crash shutdown's or a pooler's can
    // stand for a COMMIT that applied); the session is gone, so a read shows what applied:
    // nothing. Its dead connection is not lent again: before, the next write was often
    // pipelined into it and ended `OutcomeUnknown`.
    let write = tokio::spawn({
        let (fence, r) = (Arc::new(fence), r.clone());
        async move {
            let got = fence.write(&r, t(3), Bytes::from_static(b"three")).await;
            (fence, got)
        }
    });
    let watcher = client(&url).await;
    let waiting = loop {
        let row = watcher
            .query_opt(
                "SELECT pid FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE '%locked%' AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap();
        if let Some(row) = row {
            break row.get::<_, i32>(0);
        }
        assert!(
            !write.is_finished(),
            "the write ended before it was seen waiting"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    watcher
        .execute("SELECT pg_terminate_backend($1)", &[&waiting])
        .await
        .unwrap();
    let (fence, got) = write.await.unwrap();
    match got {
        Err(Error::OutcomeUnknown { message, .. }) => {
            assert!(message.contains("administrator command"), "{message}")
        }
        other => panic!("a FATAL after the pipeline was sent: unknown, got {other:?}"),
    }
    assert_eq!(fence.read(&r).await.unwrap().unwrap().newest, t(1));
    tx.rollback().await.unwrap();
    fence
        .write(&r, t(2), Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(fence.read(&r).await.unwrap().unwrap().newest, t(2));
}
