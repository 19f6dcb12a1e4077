#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, ObjectId, Pool, PoolError, RecyclingMethod,
    Runtime,
};
use lease_core::{
    Accepted, Bytes, Error, Fence, FencedValue, InvalidInput, ResourceId, Result, Token,
};
use tokio::sync::OnceCell;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient, Transaction};

mod options;
mod recipes;
mod tls;

pub use deadpool_postgres;
pub use options::redact_url;
pub use recipes::{advance_sql, current_sql};
pub use tls::SslMode;

const BACKEND: &str = "postgres";

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// The default fence table.
pub const DEFAULT_TABLE: &str = "fence_tokens";

/// The default bound on one [`PgFence`] operation (connect, or a whole write, claim or read):
/// `timeout_ms` in the URL overrides it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest `timeout_ms` accepted (10 minutes).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(600);

/// The default number of pooled connections (`pool_size` in the URL overrides it).
pub const DEFAULT_POOL_SIZE: usize = 16;

/// The largest `pool_size` accepted.
pub const MAX_POOL_SIZE: usize = 1024;

/// Connections at most in the pool that ends the sessions of unknown writes.
const END_POOL_SIZE: usize = 2;

/// Marker in the error a [`FencedTable`] update raises when it matched more than one row.
const MULTI_ROW_MARKER: &str = "fenced update matched more than one row";

/// `e` and its chain of causes, `kind: cause: cause` (tokio-postgres's Display names only the kind,
/// such as "error performing TLS handshake"; the reason is in the source).
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = cause.source();
    }
    out
}

/// Maps a client error of a statement whose effects are not committed yet (a statement inside a
/// transaction, a read, a connect): nothing was applied.
///
/// A database error of SQLSTATE class 42 (undefined table or column, wrong type, missing
/// privilege) is a configuration problem, not retryable: `Misconfigured`. Any other failure is
/// `Unavailable`.
fn map_err(operation: &'static str, e: tokio_postgres::Error) -> Error {
    if let Some(db) = e.as_db_error() {
        let message = format!("{}: {} ({})", operation, db.message(), db.code().code());
        if db.code().code().starts_with("42") {
            return Error::misconfigured(BACKEND, message);
        }
        return Error::Unavailable {
            backend: BACKEND,
            message,
            source: Some(Box::new(e)),
        };
    }
    if is_parameter_error(&e) {
        return parameter_error(operation, &e);
    }
    Error::unavailable_from(BACKEND, format!("{operation}: {}", chain(&e)), e)
}

/// Maps a client error of a statement that commits when it succeeds (`COMMIT`, or a statement
/// run outside a transaction): a statement's own error means it did not apply (see
/// [`map_err`]); a lost connection, a timeout after it was sent, or an error that ends the
/// session ([`leaves_outcome_unknown`]) leaves the outcome unknown.
fn map_commit_err(operation: &'static str, e: tokio_postgres::Error) -> Error {
    let refused = match e.as_db_error() {
        Some(db) => !leaves_outcome_unknown(db),
        None => is_parameter_error(&e),
    };
    if refused {
        return map_err(operation, e);
    }
    Error::OutcomeUnknown {
        backend: BACKEND,
        operation,
        message: format!("{operation}: {}", chain(&e)),
        source: Some(Box::new(e)),
    }
}

/// Whether an error message that reached a statement which commits when it succeeds leaves its
/// outcome unknown: one that ends the session (severity FATAL or PANIC) or reports the connection
/// itself (SQLSTATE class 08), whoever sent it. Such a message can stand for a COMMIT that
/// applied: a pooler (PgBouncer, PgCat) whose server connection dies sends a FATAL for every
/// request still waiting for its reply; PostgreSQL's crash shutdown (`57P02`) is sent from a
/// signal handler, whatever the backend was doing; an error after the commit record is written
/// is a PANIC. A statement's own error (severity ERROR: a serialization failure, a lock wait
/// refused, an undefined column) means it, and the COMMIT after it, did not apply.
fn leaves_outcome_unknown(db: &tokio_postgres::error::DbError) -> bool {
    db.code().code().starts_with("08") || ends_session(db)
}

/// Whether the server's error message ends the session (severity FATAL or PANIC).
fn ends_session(db: &tokio_postgres::error::DbError) -> bool {
    use tokio_postgres::error::Severity;
    matches!(
        db.parsed_severity(),
        Some(Severity::Fatal | Severity::Panic)
    ) || matches!(db.severity(), "FATAL" | "PANIC")
}

/// Whether `e` carries the server's error ending the session (severity FATAL or PANIC: a
/// terminated backend, a shutdown): the connection is dead, whatever the pool's quick check says.
fn ended_by_the_server(e: &Error) -> bool {
    let Error::Unavailable {
        source: Some(source),
        ..
    } = e
    else {
        return false;
    };
    source
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(|e| e.as_db_error())
        .is_some_and(ends_session)
}

/// A parameter that could not be encoded for its column: refused before anything was sent.
fn is_parameter_error(e: &tokio_postgres::Error) -> bool {
    std::error::Error::source(e).is_some_and(|s| s.is::<tokio_postgres::types::WrongType>())
}

fn parameter_error(operation: &'static str, e: &tokio_postgres::Error) -> Error {
    InvalidInput::OutOfRange {
        field: "SQL parameter",
        value: format!("{operation}: {e}"),
        expected: "a Rust value whose type matches the column",
    }
    .into()
}

fn timed_out(operation: &'static str, committing: bool, timeout: Duration) -> Error {
    let message = format!("{operation}: no answer within {timeout:?}");
    if committing {
        Error::OutcomeUnknown {
            backend: BACKEND,
            operation,
            message: format!("{message} after COMMIT was sent"),
            source: None,
        }
    } else {
        Error::unavailable(BACKEND, format!("{message}; nothing was committed"))
    }
}

/// A validated SQL identifier (`[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes), quoted when used.
#[derive(Clone, PartialEq, Eq)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; anything else is `InvalidInput` naming it (so no SQL can be injected).
    pub fn new(name: &str) -> std::result::Result<Ident, InvalidInput> {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if ok {
            Ok(Ident(name.to_owned()))
        } else {
            Err(InvalidInput::OutOfRange {
                field: "SQL identifier",
                value: format!("{name:?}"),
                expected: "letters, digits and '_', not starting with a digit, at most 63 bytes",
            })
        }
    }

    fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }
}

impl fmt::Debug for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

/// Creates the fence table if it does not exist (the statement in `migrations/0001_fence_tokens.sql`).
///
/// An existing table is found first (`to_regclass`) and left alone, so a role that may only
/// read and write it (no `CREATE` on the schema, PostgreSQL 15's default for `public`) passes:
/// `CREATE TABLE IF NOT EXISTS` alone checks that privilege before it looks for the table.
/// Its columns are checked against the catalog: a table made by hand with another shape (say
/// `newest INTEGER`, which would accept writes and then fail to read them back, and overflow
/// past 2^31) is `Misconfigured`, naming each column that differs.
pub async fn migrate(client: &impl GenericClient, table: &Ident) -> Result<()> {
    if check_table(client, table).await? {
        return Ok(());
    }
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {t} (
            resource TEXT PRIMARY KEY,
            newest BIGINT NOT NULL CHECK (newest >= 0),
            value BYTEA,
            value_token BIGINT,
            updated_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        t = table.quoted()
    );
    client
        .batch_execute(&sql)
        .await
        .map_err(|e| map_err("migrate", e))
}

/// Checks an existing fence table's columns against the catalog (what [`migrate`] does first, and
/// what [`PgFence::connect`] does with `migrate=false`): `Ok(false)` if there is no such table,
/// `Ok(true)` if it has the shape the fence reads and writes, `Misconfigured` naming each column
/// that differs otherwise. A table of another shape would accept a write, commit it, and fail
/// only when its row is read back, or refuse the longest resource ids.
async fn check_table(client: &impl GenericClient, table: &Ident) -> Result<bool> {
    let columns = client
        .query(
            // A domain counts as its base type (with the domain's modifier).
            "SELECT a.attname::text, CASE WHEN t.typtype = 'd' \
             THEN format_type(t.typbasetype, t.typtypmod) \
             ELSE format_type(a.atttypid, a.atttypmod) END \
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&table.quoted()],
        )
        .await
        .map_err(|e| map_err("check the fence table", e))?;
    if columns.is_empty() {
        return Ok(false);
    }
    let found: Vec<(String, String)> = columns
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let problems = table_shape_problems(table, &found);
    if problems.is_empty() {
        return Ok(true);
    }
    Err(Error::Misconfigured {
        backend: BACKEND,
        problems,
    })
}

/// What differs between an existing fence table's columns (`(name, type)`, the type with its
/// modifier as `format_type` prints it) and the ones the fence reads and writes.
fn table_shape_problems(table: &Ident, found: &[(String, String)]) -> Vec<String> {
    const WANTED: &[(&str, &[&str])] = &[
        ("resource", &["text", "character varying"]),
        ("newest", &["bigint"]),
        ("value", &["bytea"]),
        ("value_token", &["bigint"]),
    ];
    WANTED
        .iter()
        .filter_map(|(name, types)| {
            let want = types[0];
            match found.iter().find(|(n, _)| n == name) {
                None => Some(format!(
                    "the fence table {table:?} has no column {name} ({want}); create it as \
                     migrations/0001_fence_tokens.sql does"
                )),
                Some((_, t)) if !types.contains(&t.as_str()) => {
                    // `character varying(n)`: long enough for every resource id?
                    let limit = t
                        .strip_prefix("character varying(")
                        .and_then(|n| n.strip_suffix(')'))
                        .and_then(|n| n.parse::<usize>().ok())
                        .filter(|_| *name == "resource");
                    match limit {
                        Some(n) if n >= lease_core::MAX_NAME_BYTES => None,
                        Some(_) => Some(format!(
                            "the fence table {table:?} has column {name} of type {t}, shorter \
                             than the longest resource id ({} bytes); make it {want}",
                            lease_core::MAX_NAME_BYTES
                        )),
                        None => Some(format!(
                            "the fence table {table:?} has column {name} of type {t}, not {want}"
                        )),
                    }
                }
                Some(_) => None,
            }
        })
        .collect()
}

/// A transaction that has passed the fence: the resource's row is locked, its newest accepted
/// token is now this transaction's token. Run the protected statements on
/// [`FencedTransaction::transaction`], then [`commit`](FencedTransaction::commit): the fence
/// advance and the writes commit together or not at all. Dropping it rolls everything back.
pub struct FencedTransaction<'a> {
    tx: Transaction<'a>,
    table: Ident,
    resource: ResourceId,
    token: Token,
    previous: Option<Token>,
}

impl fmt::Debug for FencedTransaction<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FencedTransaction")
            .field("resource", &self.resource)
            .field("token", &self.token)
            .field("previous", &self.previous)
            .finish()
    }
}

/// Opens a transaction on `client` and passes the fence for `resource` with `token`.
///
/// # Behaviour
/// - `Ok`: the row is locked (`SELECT ... FOR UPDATE`) and advanced to `token`; a concurrent
///   writer of the same resource waits until this transaction ends, then compares against it.
/// - `Err(Stale { presented, current })`: a newer token was accepted; the transaction is rolled
///   back and nothing was written.
/// - `Err(Unavailable)`: the database could not be reached; nothing was written.
pub async fn begin<'a>(
    client: &'a mut Client,
    table: &Ident,
    resource: &ResourceId,
    token: Token,
) -> Result<FencedTransaction<'a>> {
    let tx = client
        .transaction()
        .await
        .map_err(|e| map_err("begin", e))?;
    let t = table.quoted();
    let inserted = tx
        .query_opt(
            &format!("INSERT INTO {t} (resource, newest) VALUES ($1, $2) ON CONFLICT (resource) DO NOTHING RETURNING newest"),
            &[&resource.as_str(), &token.to_i64()],
        )
        .await
        .map_err(|e| map_err("fence insert", e))?;
    let previous = if inserted.is_some() {
        None
    } else {
        let row = tx
            .query_one(
                &format!("SELECT newest FROM {t} WHERE resource = $1 FOR UPDATE"),
                &[&resource.as_str()],
            )
            .await
            .map_err(|e| map_err("fence read", e))?;
        let current = Token::from_i64(row.get::<_, i64>(0))?;
        if token < current {
            // Dropping `tx` rolls back.
            return Err(Error::Stale {
                resource: resource.to_string(),
                presented: token,
                current,
            });
        }
        tx.execute(
            &format!("UPDATE {t} SET newest = $2, updated_at = now() WHERE resource = $1"),
            &[&resource.as_str(), &token.to_i64()],
        )
        .await
        .map_err(|e| map_err("fence advance", e))?;
        Some(current)
    };
    Ok(FencedTransaction {
        tx,
        table: table.clone(),
        resource: resource.clone(),
        token,
        previous,
    })
}

impl<'a> FencedTransaction<'a> {
    /// The transaction, for the caller's own statements.
    pub fn transaction(&self) -> &Transaction<'a> {
        &self.tx
    }

    /// The newest token accepted before this one (`None` for a fresh resource).
    pub fn previous(&self) -> Option<Token> {
        self.previous
    }

    /// Also stores `value` in the fence table as the resource's last written value (at most
    /// [`MAX_VALUE_BYTES`]; a longer one is `InvalidInput` and nothing is sent).
    pub async fn store_value(&self, value: &[u8]) -> Result<()> {
        check_value_len(value.len())?;
        self.tx
            .execute(
                &format!(
                    "UPDATE {} SET value = $2, value_token = $3 WHERE resource = $1",
                    self.table.quoted()
                ),
                &[&self.resource.as_str(), &value, &self.token.to_i64()],
            )
            .await
            .map_err(|e| map_err("store value", e))?;
        Ok(())
    }

    /// Commits the fence advance and the caller's writes together.
    ///
    /// A statement's own error (for example a serialization failure) means nothing was
    /// committed; so does an error for a transaction that an earlier failed statement aborted (PostgreSQL
    /// answers `COMMIT` of such a transaction with `ROLLBACK`, not an error, so the fence row is
    /// read first: one more round trip). A connection lost after `COMMIT` was sent is
    /// `OutcomeUnknown`, as is an error that ends the session (a pooler's `FATAL` when its server
    /// connection died, a crash shutdown): re-read before acting, and do not retry blind.
    pub async fn commit(self) -> Result<Accepted> {
        self.tx
            .query_one(
                &format!(
                    "SELECT newest FROM {} WHERE resource = $1",
                    self.table.quoted()
                ),
                &[&self.resource.as_str()],
            )
            .await
            .map_err(|e| map_err("commit (the transaction was aborted: nothing committed)", e))?;
        self.tx
            .commit()
            .await
            .map_err(|e| map_commit_err("commit", e))?;
        Ok(Accepted::new(self.previous))
    }
}

/// The single-statement form on the caller's own table: a fence column compared in the
/// `UPDATE`'s `WHERE` clause, the seeds' `UPDATE ... WHERE id = :id AND fence <= :token`.
///
/// The table's shape is checked once against the catalog (by [`FencedTable::open`], or by the
/// first [`FencedTable::update`] of a table made with [`FencedTable::new`]): the key column must
/// have a unique index or primary key of its own (one column, not partial, not on an
/// expression), and the fence column must be `BIGINT`. Otherwise the error is
/// [`Error::Misconfigured`] naming the table and the column, and nothing is written.
#[derive(Debug, Clone)]
pub struct FencedTable {
    table: Ident,
    key_column: Ident,
    fence_column: Ident,
    /// Set once the catalog check passed.
    checked: Arc<OnceCell<()>>,
}

impl FencedTable {
    /// A table whose rows are found by `key_column` and fenced by the `BIGINT` `fence_column`.
    /// Identifiers are validated (`InvalidInput` naming the bad one); the catalog check runs on
    /// the first [`update`](FencedTable::update). Prefer [`FencedTable::open`], which checks now.
    pub fn new(
        table: &str,
        key_column: &str,
        fence_column: &str,
    ) -> std::result::Result<Self, InvalidInput> {
        Ok(FencedTable {
            table: Ident::new(table)?,
            key_column: Ident::new(key_column)?,
            fence_column: Ident::new(fence_column)?,
            checked: Arc::new(OnceCell::new()),
        })
    }

    /// Like [`FencedTable::new`], then checks the table's shape in the catalog of `client`'s
    /// database (the table is resolved with the session's `search_path`, as the update will be).
    ///
    /// # Errors
    /// - `InvalidInput`: an identifier is not a plain SQL identifier.
    /// - `NotFound`: no such table.
    /// - `Misconfigured`: a column is missing, the key column has no unique index or primary key
    ///   of its own, or the fence column is not `BIGINT`; each problem names table and column.
    /// - `Unavailable`: the catalog could not be read.
    pub async fn open(
        client: &impl GenericClient,
        table: &str,
        key_column: &str,
        fence_column: &str,
    ) -> Result<Self> {
        let t = FencedTable::new(table, key_column, fence_column)?;
        t.ensure_checked(client).await?;
        Ok(t)
    }

    async fn ensure_checked(&self, client: &impl GenericClient) -> Result<()> {
        self.checked
            .get_or_try_init(|| self.check(client))
            .await
            .map(|_| ())
    }

    /// The catalog check (see the type's docs).
    async fn check(&self, client: &impl GenericClient) -> Result<()> {
        let sql = "
            WITH rel AS (SELECT to_regclass($1::text)::oid AS oid),
                 cols AS (
                    SELECT a.attname::text AS name, a.attnum, a.atttypid,
                           format_type(a.atttypid, a.atttypmod) AS type
                    FROM pg_attribute a, rel
                    WHERE a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped)
            SELECT rel.oid IS NOT NULL,
                   (SELECT type FROM cols WHERE name = $2),
                   (SELECT type FROM cols WHERE name = $3),
                   COALESCE((SELECT atttypid = 'int8'::regtype::oid FROM cols WHERE name = $3), false),
                   EXISTS (
                    SELECT 1 FROM pg_index i, cols k
                    WHERE i.indrelid = rel.oid AND k.name = $2
                      AND i.indisunique AND i.indisvalid AND i.indnkeyatts = 1
                      AND i.indkey[0] = k.attnum
                      AND i.indpred IS NULL AND i.indexprs IS NULL)
            FROM rel";
        let row = client
            .query_one(
                sql,
                &[
                    &self.table.quoted(),
                    &self.key_column.0,
                    &self.fence_column.0,
                ],
            )
            .await
            .map_err(|e| map_err("fenced table check", e))?;
        let bad = |e: tokio_postgres::Error| map_err("fenced table check", e);
        let exists: bool = row.try_get(0).map_err(bad)?;
        if !exists {
            return Err(Error::NotFound {
                what: format!("table {:?} (for a fenced table)", self.table.0),
            });
        }
        let key_type: Option<String> = row.try_get(1).map_err(bad)?;
        let fence_type: Option<String> = row.try_get(2).map_err(bad)?;
        let fence_is_bigint: bool = row.try_get(3).map_err(bad)?;
        let key_unique: bool = row.try_get(4).map_err(bad)?;
        let (t, k, f) = (&self.table.0, &self.key_column.0, &self.fence_column.0);
        let mut problems = Vec::new();
        match key_type {
            None => problems.push(format!("table {t:?} has no key column {k:?}")),
            Some(_) if !key_unique => problems.push(format!(
                "key column {k:?} of table {t:?} has no unique index or primary key of its own \
                 (one column, not partial): a key could match more than one row"
            )),
            Some(_) => {}
        }
        match fence_type {
            None => problems.push(format!("table {t:?} has no fence column {f:?}")),
            Some(ty) if !fence_is_bigint => problems.push(format!(
                "fence column {f:?} of table {t:?} is {ty}, not bigint (tokens are 64-bit)"
            )),
            Some(_) => {}
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::Misconfigured {
                backend: BACKEND,
                problems,
            })
        }
    }

    /// Sets `assignments` (column, value) and the fence column to `token` on the row whose key is
    /// `key`, if and only if its fence is `<= token`, in one statement. A `NULL` fence column
    /// counts as 0 (nothing accepted yet).
    ///
    /// # Behaviour
    /// - `Ok(Accepted)`: one row updated. (`previous` is not reported by this form: `None`.)
    /// - `Err(Stale { current })`: the row's fence is newer; nothing changed.
    /// - `Err(NotFound)`: no row has that key.
    /// - `Err(Misconfigured)`: the table's shape failed the catalog check (run once per
    ///   `FencedTable`), or the statement matched more than one row (a unique index was dropped
    ///   since): nothing changed, the statement was rolled back (inside the caller's
    ///   transaction, that transaction is aborted and must be rolled back).
    /// - `Err(OutcomeUnknown)`: the connection was lost after the statement was sent, or the
    ///   answer was an error that ends the session (`FATAL`, as a pooler sends). Outside a transaction it may have committed:
    ///   re-read, and do not retry blind (inside one, nothing can have committed: the caller's
    ///   transaction is gone with its connection).
    /// - `Err(Unavailable)`: the database refused for a transient reason, or the row appeared or
    ///   changed between the update and the read that explains it; nothing changed, retry.
    pub async fn update(
        &self,
        client: &impl GenericClient,
        key: &(dyn ToSql + Sync),
        token: Token,
        assignments: &[(&str, &(dyn ToSql + Sync))],
    ) -> Result<Accepted> {
        let mut sets = Vec::with_capacity(assignments.len() + 1);
        let token_i64 = token.to_i64();
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![key, &token_i64];
        for (i, (column, value)) in assignments.iter().enumerate() {
            let c = Ident::new(column)?;
            if c == self.fence_column {
                return Err(InvalidInput::OutOfRange {
                    field: "assignment",
                    value: format!("{column:?}"),
                    expected: "a column other than the fence column (it is set to the token)",
                }
                .into());
            }
            sets.push(format!("{} = ${}", c.quoted(), i + 3));
            params.push(*value);
        }
        self.ensure_checked(client).await?;
        let (t, k, f) = (
            self.table.quoted(),
            self.key_column.quoted(),
            self.fence_column.quoted(),
        );
        sets.push(format!("{f} = $2"));
        // One statement: if the UPDATE ever matches more than one row, the cast of a non-constant
        // text fails and the whole statement (the UPDATE with it) is rolled back.
        let sql = format!(
            "WITH u AS (UPDATE {t} SET {} WHERE {k} = $1 AND COALESCE({f}, 0) <= $2 RETURNING 1) \
             SELECT CASE WHEN n > 1 THEN ('{MULTI_ROW_MARKER}: ' || n)::bigint ELSE n END \
             FROM (SELECT count(*) AS n FROM u) c",
            sets.join(", ")
        );
        if client.client().is_closed() {
            return Err(Error::unavailable(
                BACKEND,
                "fenced update: the connection is closed; nothing was sent",
            ));
        }
        let multi_row = |t: &str, k: &str| {
            Error::misconfigured(
                BACKEND,
                format!(
                    "key column {k:?} of table {t:?} matched more than one row for key {key:?}; \
                     the update was rolled back (is its unique index gone?)"
                ),
            )
        };
        let n: i64 = match client.query_one(&sql, &params).await {
            Ok(row) => row.try_get(0).map_err(|e| map_err("fenced update", e))?,
            Err(e)
                if e.as_db_error()
                    .is_some_and(|db| db.message().contains(MULTI_ROW_MARKER)) =>
            {
                return Err(multi_row(&self.table.0, &self.key_column.0));
            }
            Err(e) => return Err(map_commit_err("fenced update", e)),
        };
        if n == 1 {
            return Ok(Accepted::new(None));
        }
        // Nothing updated: tell a stale token from a missing row. The fence only grows, so the
        // value read now is at least the one that rejected us.
        let rows = client
            .query(
                &format!("SELECT COALESCE({f}, 0) FROM {t} WHERE {k} = $1"),
                &[key],
            )
            .await
            .map_err(|e| map_err("fence read", e))?;
        match rows.as_slice() {
            [] => Err(Error::NotFound {
                what: format!("row {key:?} of table {}", self.table.0),
            }),
            [r] => {
                let current = Token::from_i64(
                    r.try_get::<_, i64>(0)
                        .map_err(|e| map_err("fence read", e))?,
                )?;
                if current > token {
                    Err(Error::Stale {
                        resource: format!("{}[{:?}]", self.table.0, key),
                        presented: token,
                        current,
                    })
                } else {
                    // The row appeared (or changed) between the update and this read: nothing
                    // was written, and the token was not refused by a newer one. Never a false
                    // `Stale`.
                    Err(Error::unavailable(BACKEND, format!(
                            "row {key:?} of table {} changed during the fenced update; nothing was written, retry",
                            self.table.0
                        )))
                }
            }
            _ => Err(multi_row(&self.table.0, &self.key_column.0)),
        }
    }
}

/// A [`Fence`] on a PostgreSQL table, over a pool of connections (TLS as the URL says).
///
/// # Semantics
/// - Each write runs [`begin`] + store value + commit: the comparison and the write are one
///   transaction on a locked row; the newest accepted token is as durable as PostgreSQL's commit.
/// - `claim` is the same without the value.
/// - Each operation is bounded by the URL's `timeout_ms` ([`DEFAULT_TIMEOUT`] by default) twice
///   over: the wait for a pooled connection (or a new one, and its session's lookup on first
///   use) gets that bound, then the statements get it. A
///   failure before `COMMIT` was sent is `Unavailable` (nothing was committed); a timeout or a
///   lost connection after `COMMIT` was sent is `OutcomeUnknown`. Nothing is retried: a write
///   whose outcome is unknown is never sent again by the fence.
/// - Such a write's bytes may still be on their way (a delayed network, a stalled proxy) and
///   could reach the server and commit after the caller gave up, even after a later write under
///   the same token, whose value it would then replace. So before returning `OutcomeUnknown`
///   the fence ends that connection's server session (`pg_terminate_backend` on a connection
///   of a separate pool of at most two, so that writers queued on that session's row lock
///   cannot starve it, opened for it and closed after; then waits until it is gone; all within
///   one more `timeout_ms`): after that nothing of the write can commit, and a read shows
///   whether it did. The error's message says whether the session was ended; if not (for
///   example the ending connection reached another host of a multi-host URL), retry under a
///   new token (a new lease) rather than re-read.
///   Behind a transaction-pooling proxy (PgBouncer's `pool_mode=transaction`) a connection's
///   server session is not its own: set `end_unknown_sessions=false` there. Fencing between
///   holders is unaffected either way: a late write still loses to any newer token.
/// - A session ended while its `COMMIT` waited for a synchronous standby has committed on the
///   primary without the standby's word, and a read there shows it. So the same connection then
///   commits a transaction of its own that, with synchronous standbys configured, writes WAL
///   (a logical decoding message: `pg_logical_emit_message` must not be revoked from the role),
///   waiting for them as the fence's writes do, within one more `timeout_ms`: once it returns,
///   they have the ended one too. If it does not return in time, its session is ended in the
///   background (a session waiting for a standby that is down keeps its transaction open) and
///   the message says that no synchronous standby confirmed it: write again under a new token
///   rather than re-read.
/// - Values are at most [`MAX_VALUE_BYTES`]; a longer one is `InvalidInput`, nothing sent.
/// - Connections: up to `pool_size` ([`DEFAULT_POOL_SIZE`] by default) at once for the fence's
///   own operations (plus up to two, each opened for one termination and then closed, that end
///   unknown writes' sessions); writes of different resources run in parallel. A connection
///   that timed out, or whose operation was cancelled, is closed rather than returned (its
///   replies can no longer be matched to requests); a closed one (server restart, network cut)
///   is replaced on the next checkout, so one `PgFence` outlives any number of server restarts.
///   [`PgFence::pool`] lends connections from a second pool, never from the fence's own.
pub struct PgFence {
    /// The fence's own connections.
    own: Pool,
    /// The connections [`PgFence::pool`] lends.
    pool: Pool,
    /// When `end_unknown_sessions` is on: what ends the server session of an unknown write
    /// (never through the fence's own pool, see [`end_session`]), and the session of each of
    /// the fence's own connections.
    sessions: Option<Arc<(Pool, Sessions)>>,
    timeout: Duration,
    pool_size: usize,
    ssl_mode: SslMode,
    /// `sslcert`, when a client certificate is presented.
    ssl_cert: Option<PathBuf>,
    table: Ident,
    /// The connection URL with its secrets redacted.
    url: String,
}

impl fmt::Debug for PgFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgFence")
            .field("url", &self.url)
            .field("table", &self.table)
            .field("timeout", &self.timeout)
            .field("pool_size", &self.pool_size)
            .field("sslmode", &self.ssl_mode)
            .field("sslcert", &self.ssl_cert)
            .finish()
    }
}

impl fmt::Display for PgFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PostgreSQL fence {} (table {:?})", self.url, self.table)
    }
}

/// A pooled connection held for one operation. Unless the operation finished
/// ([`Checkout::finish`]), dropping it closes the connection instead of returning it to the
/// pool: after a timeout or a cancellation its replies could be taken for the next request's.
struct Checkout {
    client: Option<Object>,
    finished: bool,
    /// The connection's server session (when sessions are tracked).
    session: Option<Session>,
}

impl Checkout {
    fn client(&self) -> &Client {
        self.client.as_ref().expect("held until drop")
    }

    fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            if !self.finished {
                // Out of the pool; dropping the client ends its connection task.
                drop(Object::take(client));
            }
        }
    }
}

/// Maps a connect error. Wrong credentials, a `pg_hba.conf` that refuses the connection (for
/// example a server that requires TLS, asked with `sslmode=disable`), a missing database, a
/// server certificate that fails verification, or `sslmode=require` against a server without
/// TLS, and a client certificate the server refused (or one it requires and was not given) are
/// configuration errors (`Misconfigured`, not retryable); anything else is `Unavailable`.
/// `ssl_cert` is the `sslcert` given, if any.
fn map_connect_err(
    e: tokio_postgres::Error,
    mode: SslMode,
    ssl_cert: Option<&std::path::Path>,
) -> Error {
    let text = chain(&e);
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        if code.starts_with("28") || code == "3D000" {
            let mut problem = format!("connect: {} ({code})", db.message());
            if mode == SslMode::Disable && db.message().contains("no encryption") {
                problem.push_str(
                    "; the server accepts this connection only over TLS: \
                     use sslmode=verify-full (or verify-ca, require)",
                );
            }
            if db.message().contains("requires a valid client certificate") && ssl_cert.is_none() {
                problem.push_str(
                    "; the server requires a client certificate: give sslcert=<PEM file> and \
                     sslkey=<PEM file of its key>, signed by a CA in the server's ssl_ca_file",
                );
            }
            if db.message().contains("certificate authentication failed") {
                problem.push_str(
                    "; the client certificate (sslcert) was accepted, but PostgreSQL's `cert` \
                     authentication needs its common name (CN) to be the user name (or mapped \
                     to it in pg_ident.conf)",
                );
            }
            return Error::misconfigured(BACKEND, problem);
        }
    }
    if text.contains("invalid peer certificate") {
        return Error::misconfigured(
            BACKEND,
            format!(
                "connect (sslmode={mode}): the server's certificate was rejected: {text} \
                 (check sslrootcert, and for verify-full the host name in the URL)"
            ),
        );
    }
    if let Some(alert) = tls::received_alert(&e).filter(|a| tls::is_client_cert_alert(*a)) {
        let given = match ssl_cert {
            Some(path) => format!("the client certificate (sslcert {})", path.display()),
            None => "the connection without a client certificate (no sslcert)".into(),
        };
        return Error::misconfigured(
            BACKEND,
            format!(
            "connect (sslmode={mode}): the server refused {given} in the TLS handshake: {text} \
             (alert {alert:?}; the certificate must be signed by a CA in the server's \
             ssl_ca_file, be valid now, and be meant for client authentication)"
        ),
        );
    }
    if text.contains("server does not support TLS") {
        return Error::misconfigured(
            BACKEND,
            format!(
            "connect (sslmode={mode}): {text} (enable ssl on the server, or use sslmode=prefer)"
        ),
        );
    }
    map_err("connect", e)
}

impl PgFence {
    /// Connects to `postgres://user:password@host:port/db?options` and, unless
    /// `migrate=false`, creates the fence table.
    ///
    /// The URL is read by [`tokio_postgres::Config`]'s own parser (percent-encoded user,
    /// password and database; several `host:port` pairs; its options such as
    /// `application_name`, `connect_timeout`, `keepalives`, `target_session_attrs`), after this
    /// crate's options are taken out of the query:
    /// - `table=NAME` (default [`DEFAULT_TABLE`]), `migrate=true|false` (default `true`);
    /// - `timeout_ms=N` (1..=600000, default 30000): bounds the connect and each operation;
    /// - `end_unknown_sessions=true|false` (default `true`): end the server session of a write
    ///   whose outcome is unknown (see [`PgFence`]); each pooled connection then asks for its
    ///   session (`pg_backend_pid()`, its `backend_start` and the server's
    ///   `pg_postmaster_start_time()`) once, on its first use;
    /// - `pool_size=N` (1..=1024, default [`DEFAULT_POOL_SIZE`]): the fence's own connections at
    ///   most; [`PgFence::pool`] opens as many again, and ending unknown writes' sessions two
    ///   more at most;
    /// - `sslmode=disable|prefer|require|verify-ca|verify-full` (default `prefer`, as libpq; see
    ///   [`SslMode`]) and `sslrootcert=<PEM file>|system` (needed by `verify-ca`/`verify-full`);
    /// - `sslcert=<PEM file>` and `sslkey=<PEM file>` (both or neither): a client certificate,
    ///   presented when the server asks for one (PostgreSQL's `cert` authentication, or
    ///   `clientcert=verify-ca|verify-full` in `pg_hba.conf`). The key must not be encrypted.
    ///
    /// `request_timeout_ms` is accepted for `timeout_ms`, as on the other backends (both names
    /// at once, or one option given twice, is `InvalidInput`); `true|false` options also take
    /// `1|0` and `yes|no`. The other backends' `tls_*_file` options are not: TLS here is
    /// libpq's `sslmode` and `ssl*` options.
    ///
    /// # Errors
    /// - `InvalidInput`: the URL or an option is malformed, or `sslkey` is encrypted (nothing
    ///   was sent).
    /// - `Misconfigured`: refused for a reason a retry will not fix (credentials, `pg_hba.conf`,
    ///   certificate verification, TLS required but absent, an unreadable `sslrootcert`,
    ///   `sslcert` or `sslkey`, a key that does not match the certificate, a client certificate
    ///   the server refused or requires but was not given, a certificate CN that is not the
    ///   user).
    /// - `Unavailable`: the server could not be reached within `timeout_ms`.
    ///
    /// The password is redacted in every message.
    pub async fn connect(url: &str) -> Result<PgFence> {
        let o = options::parse(url)?;
        let tls = tls::connector(
            o.ssl_mode,
            o.root_cert.as_ref(),
            o.client_cert.as_ref(),
            &o.redacted,
        )?;
        // Two pools on the same settings: the fence's own, whose connections only ever run its
        // statements (so nothing is reset between uses), and the one `pool()` lends, reset on
        // every return (`RecyclingMethod::Clean`), so that a caller's session state (a temporary
        // table named like the fence table, a `search_path`, a role) never reaches a fence write.
        let build = |recycling_method: RecyclingMethod, max_size: usize| {
            let manager = Manager::from_config(
                o.config.clone(),
                tls.clone(),
                ManagerConfig { recycling_method },
            );
            Pool::builder(manager)
                .max_size(max_size)
                .runtime(Runtime::Tokio1)
                .wait_timeout(Some(o.timeout))
                .create_timeout(Some(o.timeout))
                .recycle_timeout(Some(o.timeout))
                .build()
                .map_err(|e| Error::misconfigured(BACKEND, format!("connection pool: {e}")))
        };
        let own = build(RecyclingMethod::Fast, o.pool_size)?;
        let lent = build(RecyclingMethod::Clean, o.pool_size)?;
        // A third, small one for ending the sessions of unknown writes: the fence's own pool
        // may be full of writes waiting on the very row lock such a session holds. It only
        // bounds how many are open at once: each is closed after use (see `end_session`).
        let ends = build(RecyclingMethod::Fast, END_POOL_SIZE)?;
        let fence = PgFence {
            own,
            pool: lent,
            sessions: o
                .end_unknown_sessions
                .then(|| Arc::new((ends, Sessions::default()))),
            timeout: o.timeout,
            pool_size: o.pool_size,
            ssl_mode: o.ssl_mode,
            ssl_cert: o.client_cert.map(|c| c.cert),
            table: o.table,
            url: o.redacted,
        };
        let first = fence.checkout().await.map_err(|e| fence.scrubbed(url, e))?;
        // Bounded like every operation; on a timeout `first` is dropped unfinished, so the
        // connection (whose replies are unknown) leaves the pool.
        if o.migrate {
            tokio::time::timeout(fence.timeout, migrate(first.client(), &fence.table))
                .await
                .map_err(|_| timed_out("migrate", false, fence.timeout))??;
        } else {
            // Not created here, but one of another shape is refused now rather than at a write
            // that commits and then fails to read its row back. One not there yet is left to the
            // first write (`Misconfigured`, undefined table).
            tokio::time::timeout(fence.timeout, check_table(first.client(), &fence.table))
                .await
                .map_err(|_| timed_out("check the fence table", false, fence.timeout))??;
        }
        first.finish();
        Ok(fence)
    }

    /// `e` with any secret of `url` scrubbed from its message (a safety net: tokio-postgres
    /// does not quote passwords).
    fn scrubbed(&self, url: &str, e: Error) -> Error {
        match e {
            Error::Unavailable {
                backend,
                message,
                source,
            } => Error::Unavailable {
                backend,
                message: options::scrub(url, message),
                source,
            },
            Error::Misconfigured { backend, problems } => Error::Misconfigured {
                backend,
                problems: problems
                    .into_iter()
                    .map(|p| options::scrub(url, p))
                    .collect(),
            },
            other => other,
        }
    }

    /// The fence table.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    /// The bound on each operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The most connections the fence's own pool opens at once (the lent pool and the ending of
    /// unknown writes' sessions have their own; see [`PgFence`]).
    pub fn pool_size(&self) -> usize {
        self.pool_size
    }

    /// The TLS mode in force.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// A connection pool on the same settings, for the caller's own statements (for example
    /// [`begin`] on a pooled connection: `begin(&mut **pool.get().await?, ...)`).
    ///
    /// It is not the fence's own pool: its connections never run a fence write, and each is
    /// reset when it returns (deadpool's `RecyclingMethod::Clean`: `RESET ALL`, `DISCARD TEMP`
    /// and the rest, one round trip on the next checkout), so what a caller leaves in a session
    /// stays out of the next caller's. It holds up to `pool_size` connections of its own,
    /// opened when first asked for.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// A pooled connection (a new one if none is idle; a closed one is replaced), waiting at
    /// most the timeout.
    async fn checkout(&self) -> Result<Checkout> {
        // One bound over the whole checkout: the wait for a pooled connection, a new one's
        // connect, and a first use's session lookup together (each has the same bound of its
        // own too). Dropped unfinished, a connection being made or asked is closed.
        tokio::time::timeout(self.timeout, self.checkout_unbounded())
            .await
            .map_err(|_| {
                Error::unavailable(
                    BACKEND,
                    format!(
                        "connect: no usable connection within {:?} (pool of {}); nothing was sent",
                        self.timeout, self.pool_size
                    ),
                )
            })?
    }

    async fn checkout_unbounded(&self) -> Result<Checkout> {
        let client = self.own.get().await.map_err(|e| match e {
            PoolError::Backend(e) => map_connect_err(e, self.ssl_mode, self.ssl_cert.as_deref()),
            PoolError::Timeout(_) => Error::unavailable(
                BACKEND,
                format!(
                    "connect: no connection within {:?} (pool of {}); nothing was sent",
                    self.timeout, self.pool_size
                ),
            ),
            other => Error::unavailable(BACKEND, format!("connect: {other}; nothing was sent")),
        })?;
        let mut held = Checkout {
            client: Some(client),
            finished: false,
            session: None,
        };
        if let Some((_, sessions)) = self.sessions.as_deref() {
            let id = Object::id(held.client.as_ref().expect("just set"));
            held.session = Some(match sessions.get(id) {
                Some(session) => session,
                None => {
                    // First use of this connection: one round trip to learn its session. On a
                    // failure `held` is dropped unfinished (the connection is closed).
                    let session = tokio::time::timeout(self.timeout, Session::of(held.client()))
                        .await
                        .map_err(|_| timed_out("connect", false, self.timeout))??;
                    sessions.insert(id, session.clone(), self.pool_size);
                    session
                }
            });
        }
        Ok(held)
    }

    /// Runs `op` on a pooled connection, bounded by the timeout. `op` reports through its
    /// [`Progress`]: `COMMIT` sent (a timeout after that is `OutcomeUnknown`), and a session the
    /// server ended behind a result that does not say so (the connection is then closed).
    /// After a timeout (or if this future is dropped) the connection is closed, not returned.
    ///
    /// When the outcome is unknown (a timeout or a lost connection after `COMMIT` was sent) the
    /// `COMMIT` may still be on its way (held by a stalled network or proxy) and commit later.
    /// With `end_unknown_sessions` on, the connection's server session is then ended
    /// ([`end_session`]) before this returns, so that nothing it sent commits afterwards and a
    /// read tells what happened; the error says whether that succeeded. A dropped future ends it
    /// in the background.
    async fn run<T, F>(&self, operation: &'static str, op: F) -> Result<T>
    where
        F: for<'c> FnOnce(&'c Client, &'c Progress) -> BoxFuture<'c, Result<T>>,
    {
        let held = self.checkout().await?;
        let progress = Progress::default();
        let mut unsettled = Unsettled {
            end: held
                .session
                .clone()
                .zip(self.sessions.as_deref())
                .map(|(s, (ends, _))| (ends.clone(), s, self.timeout)),
            committing: &progress.commit_sent,
        };
        let result = tokio::time::timeout(self.timeout, op(held.client(), &progress)).await;
        let error = match result {
            Ok(Err(e @ Error::OutcomeUnknown { .. })) => e,
            Ok(r) => {
                unsettled.end = None;
                if matches!(&r, Err(e) if ended_by_the_server(e))
                    || progress.session_ended.load(Ordering::SeqCst)
                {
                    // The server ended the session (its FATAL): `held` is dropped unfinished,
                    // so the dead connection is closed rather than lent to the next operation,
                    // whose pipeline would be written into it and end `OutcomeUnknown`.
                    drop(held);
                } else {
                    held.finish();
                }
                return r;
            }
            Err(_) if progress.commit_sent.load(Ordering::SeqCst) => {
                timed_out(operation, true, self.timeout)
            }
            // `held` is dropped unfinished: the connection is closed (the server aborts anything
            // uncommitted).
            Err(_) => {
                unsettled.end = None;
                return Err(timed_out(operation, false, self.timeout));
            }
        };
        drop(held);
        let Some((pool, session, timeout)) = unsettled.end.take() else {
            return Err(error);
        };
        // In a task of its own, so that it finishes even if this future is dropped meanwhile.
        let ended = tokio::spawn(end_session(pool, session, timeout))
            .await
            .unwrap_or_else(|e| Err(NotEnded::Failed(format!("the task ending it failed: {e}"))));
        Err(session_note(error, ended))
    }

    async fn accept(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Option<Bytes>,
    ) -> Result<Accepted> {
        if let Some(value) = &value {
            check_value_len(value.len())?;
        }
        let table = self.table.clone();
        let resource = resource.clone();
        let operation = if value.is_some() { "write" } else { "claim" };
        let timeout = self.timeout;
        self.run(operation, move |client, progress| {
            Box::pin(async move {
                pipelined_accept(
                    client,
                    &table,
                    &resource,
                    token,
                    value.as_deref(),
                    timeout,
                    progress,
                )
                .await
            })
        })
        .await
    }
}

/// A connection's server session: its backend's process id and start time, which together
/// name it even after the process id is reused by a later session, and the start time of the
/// server it runs on, which tells another server (a multi-host URL) or a restarted one apart.
/// Times are whole microseconds since the epoch, computed by the server the same way each
/// time, so no time zone or date style setting can make two readings differ.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Session {
    pid: i32,
    started: i64,
    server_started: i64,
}

/// `$t` as whole microseconds since the epoch (an `int8`).
macro_rules! micros {
    ($t:literal) => {
        concat!("(extract(epoch FROM ", $t, ") * 1000000)::int8")
    };
}

impl Session {
    /// The session `client` is connected to.
    async fn of(client: &Client) -> Result<Session> {
        let row = client
            .query_typed_one(
                concat!(
                    "SELECT pid, ",
                    micros!("backend_start"),
                    ", ",
                    micros!("pg_postmaster_start_time()"),
                    " FROM pg_stat_activity WHERE pid = pg_backend_pid()"
                ),
                &[],
            )
            .await
            .map_err(|e| map_err("connect", e))?;
        let pid: i32 = row.try_get(0).map_err(|e| map_err("connect", e))?;
        let started: Option<i64> = row.try_get(1).map_err(|e| map_err("connect", e))?;
        let server_started: i64 = row.try_get(2).map_err(|e| map_err("connect", e))?;
        let started = started.ok_or_else(|| {
            Error::misconfigured(
                BACKEND,
                "pg_stat_activity does not show this connection's backend_start, so a write \
                 whose outcome is unknown cannot have its session ended; grant the role \
                 pg_read_all_stats, or set end_unknown_sessions=false",
            )
        })?;
        Ok(Session {
            pid,
            started,
            server_started,
        })
    }
}

/// The [`Session`] of each pooled connection, learnt on its first checkout.
#[derive(Debug, Default)]
struct Sessions(Mutex<HashMap<ObjectId, Session>>);

impl Sessions {
    fn get(&self, id: ObjectId) -> Option<Session> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Records `session` for connection `id`. Entries of connections the pool has since closed
    /// are not reported; once there are four per pooled connection, only the newest two per
    /// pooled connection are kept (ids increase; an evicted live one is looked up again).
    fn insert(&self, id: ObjectId, session: Session, pool_size: usize) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() >= 4 * pool_size {
            let mut ids: Vec<ObjectId> = map.keys().copied().collect();
            ids.sort_unstable();
            for old in &ids[..ids.len() - 2 * pool_size] {
                map.remove(old);
            }
        }
        map.insert(id, session);
    }
}

/// What an operation run by [`PgFence::run`] reports besides its result.
#[derive(Debug, Default)]
struct Progress {
    /// `COMMIT` was sent (or may have been): from then on an unanswered operation's outcome is
    /// unknown.
    commit_sent: AtomicBool,
    /// The server ended the connection's session (a FATAL) although the operation's result is
    /// not that error (a `Stale` decided before the `COMMIT`'s reply): the connection is
    /// closed, not returned to the pool.
    session_ended: AtomicBool,
}

/// What [`PgFence::run`] has to do if its future is dropped: end the session of a connection
/// whose `COMMIT` may have been sent.
struct Unsettled<'a> {
    end: Option<(Pool, Session, Duration)>,
    committing: &'a AtomicBool,
}

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        let Some((pool, session, timeout)) = self.end.take() else {
            return;
        };
        if !self.committing.load(Ordering::SeqCst) {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                match end_session(pool, session.clone(), timeout).await {
                    Ok(Ended::Replicated) => {}
                    Ok(Ended::Unreplicated(why)) => tracing::warn!(
                        backend = BACKEND,
                        pid = session.pid,
                        "a cancelled write's session was ended, but {why}: what it committed may \
                         be on the primary alone"
                    ),
                    Err(why) => tracing::warn!(
                        backend = BACKEND,
                        pid = session.pid,
                        "a cancelled write's session could not be ended ({why}): its COMMIT may \
                         still arrive"
                    ),
                }
            });
        }
    }
}

/// How [`end_session`] ended a session.
#[derive(Debug)]
enum Ended {
    /// Ended, and then a commit made after it returned, waiting for the synchronous standbys:
    /// every one `synchronous_standby_names` asks for has what the session committed (none asked
    /// for: the server's own flush).
    Replicated,
    /// Ended, but a commit made after it did not return in time, or failed (why): what the
    /// session committed may be on the primary alone, where a failover may lose it.
    Unreplicated(String),
}

/// Why [`end_session`] could not end a session.
#[derive(Debug)]
enum NotEnded {
    /// The ending connection reached another server than the session's (a multi-host URL), or
    /// the session's server restarted since (which ended it). Which of the two cannot be told.
    ServerChanged,
    /// No connection, an error, or the deadline.
    Failed(String),
}

impl std::fmt::Display for NotEnded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotEnded::ServerChanged => f.write_str(
                "the connection that would end it reached another server than the session's, \
                 or that server restarted since",
            ),
            NotEnded::Failed(why) => f.write_str(why),
        }
    }
}

/// Ends the [`Session`] named by the parameters (`pg_terminate_backend`, only if it is still
/// the same session on the same server), and answers whether this connection is on that server.
const TERMINATE: &str = concat!(
    "SELECT ",
    micros!("pg_postmaster_start_time()"),
    " = $3, (SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1 AND ",
    micros!("backend_start"),
    " = $2 AND ",
    micros!("pg_postmaster_start_time()"),
    " = $3)"
);

/// Whether the [`Session`] of `$1` (pid) and `$2` (start) is still listed.
const REMAINS: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND ",
    micros!("backend_start"),
    " = $2)"
);

/// Ends `session` ([`terminate`]) and then, on the same connection, [`settle`]s: a session ended
/// while its `COMMIT` waited for a synchronous standby has committed on the primary (a read
/// there sees it) without the standby's word.
async fn end_session(pool: Pool, session: Session, timeout: Duration) -> Result<Ended, NotEnded> {
    let (ended, client) = terminate(&pool, &session, timeout).await;
    ended?;
    let Some(client) = client else {
        return Ok(Ended::Unreplicated(
            "no connection was left to make a commit after it".into(),
        ));
    };
    Ok(match settle(&client, &pool, timeout).await {
        Ok(()) => Ended::Replicated,
        Err(why) => Ended::Unreplicated(why),
    })
}

/// Ends `session` (`pg_terminate_backend`) and waits until it is gone, all within `timeout`
/// (the wait for a connection of `pool` included). Once it is gone nothing sent on it can
/// commit any more. Allowed for a session of the same role; a session already gone is fine.
/// Also returns the connection it used, taken out of the pool (closed when dropped, never
/// returned).
///
/// `pool` must not be the fence's own: when a write's outcome is unknown its session may still
/// hold the row lock that the fence's other connections are all waiting on. The connection is
/// closed after use, never returned: it is used rarely, so an idle one could have gone
/// half-open since (a network fault is what makes outcomes unknown), and one that reached
/// another server would keep reaching it.
///
/// A connection that reached another server than the session's (a multi-host URL), or a
/// server that restarted since, cannot tell whether the session is gone: that is
/// [`NotEnded::ServerChanged`], never taken for "gone".
async fn terminate(
    pool: &Pool,
    session: &Session,
    timeout: Duration,
) -> (Result<(), NotEnded>, Option<ClientWrapper>) {
    let params: [(&(dyn ToSql + Sync), Type); 3] = [
        (&session.pid, Type::INT4),
        (&session.started, Type::INT8),
        (&session.server_started, Type::INT8),
    ];
    let failed = |e: tokio_postgres::Error| NotEnded::Failed(chain(&e));
    // Held out here so that the connection leaves the pool however this ends.
    let mut held: Option<Object> = None;
    let ended = tokio::time::timeout(timeout, async {
        let client = held.insert(
            pool.get()
                .await
                .map_err(|e| NotEnded::Failed(format!("no connection: {e}")))?,
        );
        let row = client
            .query_typed_one(TERMINATE, &params)
            .await
            .map_err(failed)?;
        if !row
            .try_get::<_, Option<bool>>(0)
            .map_err(failed)?
            .unwrap_or(false)
        {
            return Err(NotEnded::ServerChanged);
        }
        // pg_terminate_backend only signals; the session may finish what it is doing first.
        // Still the same server: a restart would have closed this connection.
        loop {
            let row = client
                .query_typed_one(REMAINS, &params[..2])
                .await
                .map_err(failed)?;
            if !row.try_get::<_, bool>(0).map_err(failed)? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap_or_else(|_| Err(NotEnded::Failed(format!("not gone within {timeout:?}"))));
    // Out of the pool now: the caller's settle may take a whole `timeout` (a synchronous
    // standby that is down), and the pool's connections must stay free to end the sessions of
    // other unknown writes meanwhile.
    (ended, held.take().map(Object::take))
}

/// The transaction [`settle`] commits, in a read-write transaction whatever the role's
/// defaults, with a commit that waits for the synchronous standbys as the fence's writes do
/// (`synchronous_commit` raised to `on` from `off`, `local` or `remote_write`; `remote_apply`
/// kept): a logical decoding message (`pg_logical_emit_message`, transactional: it writes WAL,
/// which a commit waits for standbys only after; no table sees it, a logical decoding consumer
/// that asks for messages does, under the prefix `lease_fence_settle`).
const SETTLE: &str = "BEGIN READ WRITE; \
                      SELECT set_config('synchronous_commit', 'on', true) \
                      WHERE current_setting('synchronous_commit') IN ('off', 'local', 'remote_write'); \
                      SELECT pg_logical_emit_message(true, 'lease_fence_settle', ''); \
                      COMMIT";

/// With synchronous standbys configured (`synchronous_standby_names` is not empty), commits
/// [`SETTLE`] on `client`, within `timeout`. WAL is ordered, so its commit returns only once
/// every synchronous standby `synchronous_standby_names` asks for has everything committed
/// before it. Without them there is nothing to wait for. Not within `timeout` (or failed):
/// `Err`, and the session waiting for the standbys, its transaction open, is ended from `pool`
/// in the background (a cancel request could arrive before the commit does; the server's
/// `statement_timeout` is off during a commit).
async fn settle(client: &Client, pool: &Pool, timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    let late = || {
        format!(
            "a commit made after it did not return within {timeout:?} (no synchronous standby \
             confirmed it)"
        )
    };
    // Whether there are standbys to wait for and, if so, who this connection is (to end its
    // session should the wait outlast `timeout`).
    let found = tokio::time::timeout_at(deadline, async {
        let names: String = client
            .query_one("SELECT current_setting('synchronous_standby_names')", &[])
            .await
            .and_then(|row| row.try_get(0))
            .map_err(|e| format!("reading synchronous_standby_names failed ({})", chain(&e)))?;
        if names.trim().is_empty() {
            return Ok(None);
        }
        Session::of(client)
            .await
            .map(Some)
            .map_err(|e| e.to_string())
    })
    .await
    .unwrap_or_else(|_| Err(late()))?;
    let Some(me) = found else {
        return Ok(());
    };
    let why = match tokio::time::timeout_at(deadline, client.batch_execute(SETTLE)).await {
        Ok(Ok(())) => return Ok(()),
        // Refused (the function revoked, say): nothing waits.
        Ok(Err(e)) if e.as_db_error().is_some() => {
            return Err(format!("a commit made after it failed ({})", chain(&e)))
        }
        Ok(Err(e)) => format!("a commit made after it failed ({})", chain(&e)),
        Err(_) => late(),
    };
    // The commit may still be waiting for a standby that is down, its transaction open.
    let pool = pool.clone();
    tokio::spawn(async move {
        if let (Err(e), _) = terminate(&pool, &me, timeout).await {
            tracing::warn!(
                backend = BACKEND,
                pid = me.pid,
                "the session of a commit made to wait for the synchronous standbys could not be \
                 ended ({e}): it may keep waiting for them, its transaction open"
            );
        }
    });
    Err(why)
}

/// `error` (an `OutcomeUnknown`), saying whether its session was ended, and confirmed.
fn session_note(error: Error, ended: Result<Ended, NotEnded>) -> Error {
    match error {
        Error::OutcomeUnknown {
            backend,
            operation,
            message,
            source,
        } => Error::OutcomeUnknown {
            backend,
            operation,
            message: match ended {
                Ok(Ended::Replicated) => format!(
                    "{message}; its server session has since been ended, so nothing more of \
                     it can commit, and a commit made after it was confirmed by the synchronous \
                     standbys, if any: a read now shows whether it was committed"
                ),
                Ok(Ended::Unreplicated(why)) => format!(
                    "{message}; its server session has since been ended, so nothing more of \
                     it can commit, but {why}: a read shows what it committed on the primary, \
                     and a failover may still lose that; write again under a new token rather \
                     than re-read"
                ),
                Err(why @ NotEnded::ServerChanged) => format!(
                    "{message}; its server session could not be ended ({why}): whether it \
                     can still commit cannot be told, so write again under a new token rather \
                     than re-read"
                ),
                Err(why @ NotEnded::Failed(_)) => format!(
                    "{message}; its server session could not be ended ({why}): it may still \
                     commit later"
                ),
            },
            source,
        },
        other => other,
    }
}

/// Polls `f` once; its output if it completed. tokio-postgres writes a request on the first
/// poll of its future, so polling in order fixes the order of the requests on the wire.
async fn first_poll<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *f).poll(cx) {
            Poll::Ready(out) => Some(out),
            Poll::Pending => None,
        })
    })
    .await
}

/// How each fence write's transaction starts, whatever the role's or the database's defaults
/// (one simple-query message, in the same pipeline as the rest):
/// - read committed: the recipe relies on `FOR UPDATE` reading the newest committed row; a
///   stricter default isolation would turn contention into serialization failures;
/// - a commit that waits at least for the local flush and any synchronous standby:
///   `synchronous_commit` `off`, `local` or `remote_write` (a standby that has the commit only
///   in memory) would let a crash or a failover forget a token the fence accepted, and a stale
///   writer's older token be accepted after it (`on` and `remote_apply` are kept). It waits
///   for a standby only when `synchronous_standby_names` names one: with asynchronous
///   replication, a failover can still forget the newest tokens (see the README);
/// - a lock wait bounded by three quarters of the request timeout ([`lock_timeout`]): a write
///   queued behind a row lock is refused by the server before the client gives up on it, rather
///   than committed long after.
fn begin_sql(timeout: Duration) -> String {
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; \
         SELECT set_config('synchronous_commit', 'on', true) \
         WHERE current_setting('synchronous_commit') IN ('off', 'local', 'remote_write'); \
         SET LOCAL lock_timeout = {}",
        lock_timeout(timeout).as_millis().max(1)
    )
}

/// The server's bound on a fence write's row-lock wait for a request `timeout`: three quarters of
/// it. The client's bound starts before the request is sent and the server's only once the wait
/// begins, so with the same value the client always gave up first (`OutcomeUnknown`, and the
/// session ended) on a write that the server would have refused; a quarter of the bound is left
/// for the refusal to travel back (`Unavailable`, nothing applied).
fn lock_timeout(timeout: Duration) -> Duration {
    timeout * 3 / 4
}

/// The fence write as one pipelined transaction: `BEGIN` ([`begin_sql`]), ensure the row, lock it, the fenced
/// `UPDATE` and `COMMIT` are sent together (unnamed statements with typed parameters, no
/// separate prepare), so the write is one request on the wire and one round trip. Any loss of
/// the connection after that is `OutcomeUnknown`, as is an error that ends the session
/// ([`leaves_outcome_unknown`]); a statement's own error in any statement aborts the
/// transaction (nothing applied).
async fn pipelined_accept(
    client: &Client,
    table: &Ident,
    resource: &ResourceId,
    token: Token,
    value: Option<&[u8]>,
    timeout: Duration,
    progress: &Progress,
) -> Result<Accepted> {
    let t = table.quoted();
    let ins_sql = format!(
        "INSERT INTO {t} (resource, newest) VALUES ($1, $2) \
         ON CONFLICT (resource) DO NOTHING RETURNING newest"
    );
    let sel_sql = format!("SELECT newest FROM {t} WHERE resource = $1 FOR UPDATE");
    let upd_sql = format!(
        "UPDATE {t} SET newest = $2, \
         value = CASE WHEN $3 THEN $4 ELSE value END, \
         value_token = CASE WHEN $3 THEN $2 ELSE value_token END, \
         updated_at = now() \
         WHERE resource = $1 AND newest <= $2 RETURNING 1"
    );
    let (r, tok, has_value) = (resource.as_str(), token.to_i64(), value.is_some());
    let ensure_params: [(&(dyn ToSql + Sync), Type); 2] = [(&r, Type::TEXT), (&tok, Type::INT8)];
    let lock_params: [(&(dyn ToSql + Sync), Type); 1] = [(&r, Type::TEXT)];
    let advance_params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&r, Type::TEXT),
        (&tok, Type::INT8),
        (&has_value, Type::BOOL),
        (&value, Type::BYTEA),
    ];
    let begin_sql = begin_sql(timeout);
    let mut begin = Box::pin(client.batch_execute(&begin_sql));
    let mut ensure = Box::pin(client.query_typed_opt(&ins_sql, &ensure_params));
    let mut lock = Box::pin(client.query_typed_one(&sel_sql, &lock_params));
    let mut advance = Box::pin(client.query_typed(&upd_sql, &advance_params));
    let mut commit = Box::pin(client.batch_execute("COMMIT"));
    let begin_early = first_poll(&mut begin).await;
    let ensure_early = first_poll(&mut ensure).await;
    let lock_early = first_poll(&mut lock).await;
    let advance_early = first_poll(&mut advance).await;
    let commit_early = first_poll(&mut commit).await;
    // Only a COMMIT refused before it was written (a closed connection) is known not to be sent.
    let commit_sent = !matches!(&commit_early, Some(Err(e)) if e.as_db_error().is_none());
    progress.commit_sent.store(commit_sent, Ordering::SeqCst);
    let step = |operation: &'static str, e: tokio_postgres::Error| {
        if commit_sent {
            map_commit_err(operation, e)
        } else {
            map_err(operation, e)
        }
    };
    let began = match begin_early {
        Some(r) => r,
        None => begin.await,
    };
    began.map_err(|e| step("begin", e))?;
    let inserted = match ensure_early {
        Some(r) => r,
        None => ensure.await,
    }
    .map_err(|e| step("fence insert", e))?;
    let row = match lock_early {
        Some(r) => r,
        None => lock.await,
    }
    .map_err(|e| step("fence read", e))?;
    let advanced = match advance_early {
        Some(r) => r,
        None => advance.await,
    }
    .map_err(|e| step("fence advance", e))?;
    let committed = match commit_early {
        Some(r) => r,
        None => commit.await,
    };
    let newest: i64 = row.try_get(0).map_err(|e| step("fence read", e))?;
    if advanced.is_empty() {
        // Refused: the row's `newest` is above a token, so it is one too.
        let current = Token::from_i64(newest)?;
        // The row's token is newer: nothing was changed (the COMMIT committed nothing), whatever
        // the COMMIT's reply. One that ended the session (a pooler's or the server's FATAL)
        // leaves a dead connection behind the `Stale`.
        if let Err(e) = &committed {
            if e.as_db_error().is_some_and(ends_session) {
                progress.session_ended.store(true, Ordering::SeqCst);
            }
        }
        return Err(Error::Stale {
            resource: resource.to_string(),
            presented: token,
            current,
        });
    }
    committed.map_err(|e| step("commit", e))?;
    // Committed: whatever the row held before is only reported. A value no token can have (a
    // negative `newest` in a table made by hand without the migration's CHECK) is not an error
    // of this write, which took effect.
    let previous = match Token::from_i64(newest) {
        Ok(t) if inserted.is_none() => Some(t),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(%resource, newest, error = %e, "the fence row held no valid token before this write");
            None
        }
    };
    Ok(Accepted::new(previous))
}

#[async_trait]
impl Fence for PgFence {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        self.accept(resource, token, Some(value)).await
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        self.accept(resource, token, None).await
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        let sql = format!(
            "SELECT newest, value, value_token FROM {} WHERE resource = $1",
            self.table.quoted()
        );
        let resource = resource.clone();
        let row = self
            .run("read", move |client, _| {
                Box::pin(async move {
                    client
                        .query_opt(&sql, &[&resource.as_str()])
                        .await
                        .map_err(|e| map_err("read", e))
                })
            })
            .await?;
        let Some(row) = row else { return Ok(None) };
        let col = |e| map_err("read", e);
        let newest = Token::from_i64(row.try_get::<_, i64>(0).map_err(col)?)?;
        let value = match (
            row.try_get::<_, Option<Vec<u8>>>(1).map_err(col)?,
            row.try_get::<_, Option<i64>>(2).map_err(col)?,
        ) {
            (Some(v), Some(t)) => Some((Token::from_i64(t)?, Bytes::from(v))),
            _ => None,
        };
        Ok(Some(FencedValue::new(newest, value)))
    }
}

/// The longest value [`PgFence`] writes, in bytes: 512 MiB, half of what one `bytea` and one
/// protocol message can carry, so that a value is refused with `InvalidInput` before anything
/// is sent rather than by the client library halfway through a pipelined transaction (whose
/// earlier statements, the fence's advance among them, would then commit without the value).
pub const MAX_VALUE_BYTES: usize = 512 * 1024 * 1024;

fn check_value_len(len: usize) -> Result<()> {
    lease_core::adapter::check_fence_value_len(len, MAX_VALUE_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_table_of_another_shape_is_named_column_by_column() {
        let table = Ident::new("fence_tokens").unwrap();
        let col = |n: &str, t: &str| (n.to_owned(), t.to_owned());
        let good = [
            col("resource", "text"),
            col("newest", "bigint"),
            col("value", "bytea"),
            col("value_token", "bigint"),
            col("updated_at", "timestamp with time zone"),
        ];
        assert!(table_shape_problems(&table, &good).is_empty());
        let bad = [
            col("resource", "text"),
            col("newest", "integer"),
            col("value", "bytea"),
        ];
        let problems = table_shape_problems(&table, &bad);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains("newest of type integer, not bigint"));
        assert!(problems[1].contains("no column value_token"));
        // A length limit on `resource` passes only if every resource id fits.
        let with_resource = |t: &str| {
            let mut cols = good.to_vec();
            cols[0] = col("resource", t);
            table_shape_problems(&table, &cols)
        };
        assert!(with_resource("character varying").is_empty());
        assert!(with_resource("character varying(256)").is_empty());
        let short = with_resource("character varying(32)");
        assert_eq!(short.len(), 1, "{short:?}");
        assert!(short[0].contains("character varying(32), shorter than the longest resource id"));
    }

    #[test]
    fn the_server_refuses_a_lock_wait_before_the_client_gives_up() {
        assert_eq!(
            lock_timeout(Duration::from_secs(2)),
            Duration::from_millis(1500)
        );
        assert!(begin_sql(Duration::from_secs(2)).contains("lock_timeout = 1500"));
    }

    #[test]
    fn a_value_above_the_limit_is_refused_before_sending() {
        assert!(check_value_len(MAX_VALUE_BYTES).is_ok());
        let e = check_value_len(MAX_VALUE_BYTES + 1).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidInput(InvalidInput::TooLong {
                    what: "fence value",
                    ..
                })
            ),
            "{e:?}"
        );
    }

    #[test]
    fn identifiers_are_validated() {
        assert!(Ident::new("fence_tokens").is_ok());
        assert!(Ident::new("_x9").is_ok());
        for bad in ["", "9a", "a-b", "a\"; DROP TABLE x; --", &"x".repeat(64)] {
            assert!(Ident::new(bad).is_err(), "{bad:?}");
        }
        assert!(FencedTable::new("orders", "id", "fence").is_ok());
        assert!(FencedTable::new("orders", "id;", "fence").is_err());
    }

    #[tokio::test]
    async fn bad_urls_are_rejected_before_connecting_and_redacted() {
        for (url, needle) in [
            ("redis://u:pw@h/db", "scheme"),
            ("postgres://u:pw@h/db?table=a-b", "SQL identifier"),
            ("postgres://u:pw@h/db?frobnicate=1", "unknown option"),
            ("postgres://u:pw@h/db?sslmode=verify-full", "sslrootcert"),
            (
                "postgres://u:pw@h/db?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem",
                "/nonexistent/ca.pem",
            ),
        ] {
            let e = PgFence::connect(url).await.unwrap_err();
            let (shown, debug) = (e.to_string(), format!("{e:?}"));
            assert!(
                shown.contains(needle) && !shown.contains("pw@"),
                "{url}: {shown}"
            );
            assert!(!debug.contains(":pw@"), "{url}: {debug}");
            assert!(!e.is_retryable(), "{url}: {shown}");
        }
    }
}
