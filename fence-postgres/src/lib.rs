#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use std::fmt;

use async_trait::async_trait;
use lease_core::{
    Accepted, BackendUrl, Bytes, Error, Fence, FencedValue, InvalidInput, ResourceId, Result, Token,
};
use tokio::sync::Mutex;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, GenericClient, NoTls, Transaction};

const BACKEND: &str = "postgres";

/// The default fence table.
pub const DEFAULT_TABLE: &str = "fence_tokens";

/// Maps a client error: connection trouble is `Unavailable` (nothing committed), except during
/// `COMMIT`, where the outcome is unknown.
fn map_err(operation: &'static str, e: tokio_postgres::Error) -> Error {
    let message = match e.as_db_error() {
        Some(db) => format!("{}: {} ({})", operation, db.message(), db.code().code()),
        None => format!("{operation}: {e}"),
    };
    if operation == "commit" && e.as_db_error().is_none() {
        return Error::OutcomeUnknown {
            backend: BACKEND,
            operation: "commit",
            message,
            source: Some(Box::new(e)),
        };
    }
    Error::Unavailable {
        backend: BACKEND,
        message,
        source: Some(Box::new(e)),
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
pub async fn migrate(client: &impl GenericClient, table: &Ident) -> Result<()> {
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

    /// Also stores `value` in the fence table as the resource's last written value.
    pub async fn store_value(&self, value: &[u8]) -> Result<()> {
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
    pub async fn commit(self) -> Result<Accepted> {
        self.tx.commit().await.map_err(|e| map_err("commit", e))?;
        Ok(Accepted::new(self.previous))
    }
}

/// The single-statement form on the caller's own table: a fence column compared in the
/// `UPDATE`'s `WHERE` clause, the seeds' `UPDATE ... WHERE id = :id AND fence <= :token`.
#[derive(Debug, Clone)]
pub struct FencedTable {
    table: Ident,
    key_column: Ident,
    fence_column: Ident,
}

impl FencedTable {
    /// A table whose rows are found by `key_column` and fenced by the `BIGINT` `fence_column`.
    /// Identifiers are validated (`InvalidInput` naming the bad one).
    pub fn new(
        table: &str,
        key_column: &str,
        fence_column: &str,
    ) -> std::result::Result<Self, InvalidInput> {
        Ok(FencedTable {
            table: Ident::new(table)?,
            key_column: Ident::new(key_column)?,
            fence_column: Ident::new(fence_column)?,
        })
    }

    /// Sets `assignments` (column, value) and the fence column to `token` on the row whose key is
    /// `key`, if and only if its fence is `<= token`, in one statement. A `NULL` fence column
    /// counts as 0 (nothing accepted yet).
    ///
    /// # Behaviour
    /// - `Ok(Accepted)`: one row updated. (`previous` is not reported by this form: `None`.)
    /// - `Err(Stale { current })`: the row's fence is newer; nothing changed.
    /// - `Err(NotFound)`: no row has that key.
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
        let (t, k, f) = (
            self.table.quoted(),
            self.key_column.quoted(),
            self.fence_column.quoted(),
        );
        sets.push(format!("{f} = $2"));
        let sql = format!(
            "UPDATE {t} SET {} WHERE {k} = $1 AND COALESCE({f}, 0) <= $2",
            sets.join(", ")
        );
        let n = client
            .execute(&sql, &params)
            .await
            .map_err(|e| map_err("fenced update", e))?;
        if n == 1 {
            return Ok(Accepted::new(None));
        }
        // Nothing updated: tell a stale token from a missing row. The fence only grows, so the
        // value read now is at least the one that rejected us.
        let row = client
            .query_opt(
                &format!("SELECT COALESCE({f}, 0) FROM {t} WHERE {k} = $1"),
                &[key],
            )
            .await
            .map_err(|e| map_err("fence read", e))?;
        match row {
            Some(r) => Err(Error::Stale {
                resource: format!("{}[{:?}]", self.table.0, key),
                presented: token,
                current: Token::from_i64(r.get::<_, i64>(0))?,
            }),
            None => Err(Error::NotFound {
                what: format!("row {key:?} of table {}", self.table.0),
            }),
        }
    }
}

/// A [`Fence`] on a PostgreSQL table (one connection; writes through it are serialised).
///
/// # Semantics
/// - Each write runs [`begin`] + store value + commit: the comparison and the write are one
///   transaction on a locked row; the newest accepted token is as durable as PostgreSQL's commit.
/// - `claim` is the same without the value.
pub struct PgFence {
    client: Mutex<Client>,
    table: Ident,
    url: BackendUrl,
}

impl fmt::Debug for PgFence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgFence")
            .field("url", &self.url)
            .field("table", &self.table)
            .finish()
    }
}

impl PgFence {
    /// Connects to `postgres://user:password@host:port/db[?table=NAME&migrate=false]` and, unless
    /// `migrate=false`, creates the fence table. Only plain TCP: `sslmode` other than `disable`
    /// is refused as unsupported.
    pub async fn connect(url: &str) -> Result<PgFence> {
        let url = BackendUrl::parse(url)?;
        let u = url.expose();
        if !matches!(u.scheme(), "postgres" | "postgresql") {
            return Err(url
                .invalid("scheme must be postgres:// or postgresql://")
                .into());
        }
        let mut cfg = tokio_postgres::Config::new();
        cfg.host(u.host_str().ok_or_else(|| url.invalid("missing host"))?);
        cfg.port(u.port().unwrap_or(5432));
        cfg.user(url.username()?.as_deref().unwrap_or("postgres"));
        if let Some(pw) = url.password()? {
            cfg.password(pw);
        }
        let db = lease_core::percent_decode(u.path().trim_start_matches('/'))
            .ok_or_else(|| url.invalid("the database name has a malformed percent escape"))?;
        if !db.is_empty() {
            cfg.dbname(&db);
        }
        let mut table = Ident::new(DEFAULT_TABLE)?;
        let mut run_migration = true;
        for (k, v) in u.query_pairs() {
            match k.as_ref() {
                "table" => table = Ident::new(&v)?,
                "migrate" => run_migration = v != "false",
                "sslmode" if v == "disable" => {}
                "sslmode" => {
                    return Err(Error::Unsupported {
                        backend: BACKEND,
                        what: format!("sslmode={v} (TLS)"),
                    })
                }
                other => return Err(url.invalid(format!("unknown option {other:?}")).into()),
            }
        }
        cfg.connect_timeout(std::time::Duration::from_secs(10));
        let (client, connection) = cfg
            .connect(NoTls)
            .await
            .map_err(|e| map_err("connect", e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::warn!(error = %e, "postgres fence connection ended");
            }
        });
        if run_migration {
            migrate(&client, &table).await?;
        }
        Ok(PgFence {
            client: Mutex::new(client),
            table,
            url,
        })
    }

    /// The fence table.
    pub fn table(&self) -> &Ident {
        &self.table
    }

    async fn accept(
        &self,
        resource: &ResourceId,
        token: Token,
        value: Option<&[u8]>,
    ) -> Result<Accepted> {
        let mut client = self.client.lock().await;
        let tx = begin(&mut client, &self.table, resource, token).await?;
        if let Some(v) = value {
            tx.store_value(v).await?;
        }
        tx.commit().await
    }
}

#[async_trait]
impl Fence for PgFence {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn write(&self, resource: &ResourceId, token: Token, value: Bytes) -> Result<Accepted> {
        self.accept(resource, token, Some(&value)).await
    }

    async fn claim(&self, resource: &ResourceId, token: Token) -> Result<Accepted> {
        self.accept(resource, token, None).await
    }

    async fn read(&self, resource: &ResourceId) -> Result<Option<FencedValue>> {
        let client = self.client.lock().await;
        let row = client
            .query_opt(
                &format!(
                    "SELECT newest, value, value_token FROM {} WHERE resource = $1",
                    self.table.quoted()
                ),
                &[&resource.as_str()],
            )
            .await
            .map_err(|e| map_err("read", e))?;
        let Some(row) = row else { return Ok(None) };
        let newest = Token::from_i64(row.get::<_, i64>(0))?;
        let value = match (
            row.get::<_, Option<Vec<u8>>>(1),
            row.get::<_, Option<i64>>(2),
        ) {
            (Some(v), Some(t)) => Some((Token::from_i64(t)?, Bytes::from(v))),
            _ => None,
        };
        Ok(Some(FencedValue::new(newest, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ] {
            let e = PgFence::connect(url).await.unwrap_err().to_string();
            assert!(e.contains(needle) && !e.contains("pw@"), "{url}: {e}");
        }
        assert!(matches!(
            PgFence::connect("postgres://u@127.0.0.1:1/db?sslmode=require").await,
            Err(Error::Unsupported { .. })
        ));
    }
}
