//! PgFence and FencedTable against a real PostgreSQL started by the harness.

use std::sync::Arc;
use std::time::Duration;

use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use fence_postgres::{begin, FencedTable, Ident, PgFence};
use lease_core::{Bytes, Error, Fence, ResourceId, Token};
use rand::seq::SliceRandom;
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
    tokens.shuffle(&mut rand::thread_rng());
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
