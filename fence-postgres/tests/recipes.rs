//! The README's recipes, run against a real PostgreSQL: the fenced statement inside a team's own
//! sqlx transaction, and the raw-SQL guard on the team's own table with its migration.

use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use fence_postgres::{advance_sql, current_sql, FencedTable, Ident};
use sqlx::{Connection, Row};

/// A PostgreSQL server of this test's own, or `None` when skipped (reported by name).
async fn server(test: &str) -> Option<PostgresServer> {
    start_or_skip_async(test, Backend::Postgres, PostgresServer::start).await
}

const FENCE_TABLE_MIGRATION: &str = include_str!("../migrations/0001_fence_tokens.sql");
const FENCE_COLUMN_MIGRATION: &str = include_str!("../migrations/0002_fence_column.sql");

/// The sqlx recipe: returns `Ok(true)` if the write committed, `Ok(false)` if the token was
/// stale (the transaction, with the team's write, rolled back).
async fn fenced_total_update(
    pool: &sqlx::PgPool,
    order: i32,
    total: i32,
    resource: &str,
    token: i64,
) -> sqlx::Result<bool> {
    let table = Ident::new("fence_tokens").unwrap();
    let mut tx = pool.begin().await?;
    // 1. The fence, first: locks the resource's row; no row back means a newer token won.
    let accepted = sqlx::query(&advance_sql(&table))
        .bind(resource)
        .bind(token)
        .fetch_optional(&mut *tx)
        .await?;
    if accepted.is_none() {
        tx.rollback().await?;
        return Ok(false);
    }
    // 2. The team's own statements, in the same transaction.
    sqlx::query("UPDATE orders SET total = $1 WHERE id = $2")
        .bind(total)
        .bind(order)
        .execute(&mut *tx)
        .await?;
    // 3. Commit: the fence advance and the write together.
    tx.commit().await?;
    Ok(true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_recipe_the_fence_inside_the_teams_own_transaction() {
    let Some(pg) = server("sqlx_recipe_the_fence_inside_the_teams_own_transaction").await else {
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&pg.connection_url())
        .await
        .unwrap();
    sqlx::raw_sql(FENCE_TABLE_MIGRATION)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id INT PRIMARY KEY, total INT NOT NULL); INSERT INTO orders VALUES (1, 0)")
        .execute(&pool)
        .await
        .unwrap();
    let total = |pool: sqlx::PgPool| async move {
        sqlx::query("SELECT total FROM orders WHERE id = 1")
            .fetch_one(&pool)
            .await
            .unwrap()
            .get::<i32, _>(0)
    };

    assert!(fenced_total_update(&pool, 1, 10, "orders/1", 5)
        .await
        .unwrap());
    assert_eq!(total(pool.clone()).await, 10);
    // An equal token is accepted; an older one is stale and its write rolls back.
    assert!(fenced_total_update(&pool, 1, 11, "orders/1", 5)
        .await
        .unwrap());
    assert!(!fenced_total_update(&pool, 1, 99, "orders/1", 4)
        .await
        .unwrap());
    assert_eq!(total(pool.clone()).await, 11);
    let current: i64 = sqlx::query(&current_sql(&Ident::new("fence_tokens").unwrap()))
        .bind("orders/1")
        .fetch_one(&pool)
        .await
        .unwrap()
        .get(0);
    assert_eq!(current, 5);

    // Concurrent holders of one resource: the row lock orders them; once a newer token has
    // committed, no older one gets through.
    let mut tasks = Vec::new();
    for token in 6..=30i64 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            (
                token,
                fenced_total_update(&pool, 1, token as i32, "orders/1", token)
                    .await
                    .unwrap(),
            )
        }));
    }
    let mut accepted = Vec::new();
    for task in tasks {
        let (token, ok) = task.await.unwrap();
        if ok {
            accepted.push(token);
        }
    }
    assert!(
        accepted.contains(&30),
        "the newest token must win: {accepted:?}"
    );
    assert_eq!(total(pool.clone()).await, 30);
    assert!(!fenced_total_update(&pool, 1, 0, "orders/1", 29)
        .await
        .unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_sql_recipe_the_migration_and_the_guarded_update() {
    let Some(pg) = server("raw_sql_recipe_the_migration_and_the_guarded_update").await else {
        return;
    };
    let mut c = sqlx::PgConnection::connect(&pg.connection_url())
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE orders (id INT PRIMARY KEY, total INT NOT NULL); INSERT INTO orders VALUES (1, 0), (2, 0)")
        .execute(&mut c)
        .await
        .unwrap();
    // The migration as shipped, twice (it is idempotent).
    for _ in 0..2 {
        sqlx::raw_sql(FENCE_COLUMN_MIGRATION)
            .execute(&mut c)
            .await
            .unwrap();
    }
    let guarded =
        "UPDATE orders SET total = $1, fence_token = $2 WHERE id = $3 AND fence_token <= $2";
    async fn update(c: &mut sqlx::PgConnection, sql: &str, total: i32, token: i64, id: i32) -> u64 {
        sqlx::query(sql)
            .bind(total)
            .bind(token)
            .bind(id)
            .execute(c)
            .await
            .unwrap()
            .rows_affected()
    }
    assert_eq!(
        update(&mut c, guarded, 10, 5, 1).await,
        1,
        "a first token updates the row"
    );
    assert_eq!(
        update(&mut c, guarded, 11, 5, 1).await,
        1,
        "an equal token is accepted"
    );
    assert_eq!(
        update(&mut c, guarded, 99, 4, 1).await,
        0,
        "a stale token updates 0 rows"
    );
    assert_eq!(
        update(&mut c, guarded, 99, 4, 3).await,
        0,
        "no such row: 0 rows too"
    );
    let (total, fence): (i32, i64) =
        sqlx::query_as("SELECT total, fence_token FROM orders WHERE id = 1")
            .fetch_one(&mut c)
            .await
            .unwrap();
    assert_eq!((total, fence), (11, 5));

    // The migrated table passes the library's own catalog check for the same guard.
    let (client, conn) = tokio_postgres::connect(&pg.connection_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    FencedTable::open(&client, "orders", "id", "fence_token")
        .await
        .unwrap();
}
