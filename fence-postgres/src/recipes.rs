//! The fence as plain SQL, for code that does not use tokio-postgres (sqlx, diesel, raw SQL).

use crate::Ident;

/// The fence advance as one statement, to run inside the caller's own transaction before the
/// protected writes (any client: sqlx, diesel, psql).
///
/// Parameters: `$1` the resource (`TEXT`), `$2` the token (`BIGINT`). It returns one row
/// (`newest`, the token just accepted) when the token is accepted, and **no row** when a newer
/// token was accepted before: then roll the transaction back (the caller's writes go with it) and
/// report stale, reading the current token with [`current_sql`] if needed.
///
/// The statement inserts the resource's row or locks it (`ON CONFLICT DO UPDATE` locks the row
/// even when its `WHERE` is false), so a concurrent writer of the same resource waits until this
/// transaction ends and then compares against what it committed. An equal token is accepted.
///
/// ```text
/// INSERT INTO "fence_tokens" AS f (resource, newest) VALUES ($1, $2)
/// ON CONFLICT (resource) DO UPDATE SET newest = EXCLUDED.newest, updated_at = now()
/// WHERE f.newest <= EXCLUDED.newest
/// RETURNING f.newest
/// ```
pub fn advance_sql(table: &Ident) -> String {
    format!(
        "INSERT INTO {t} AS f (resource, newest) VALUES ($1, $2) \
         ON CONFLICT (resource) DO UPDATE SET newest = EXCLUDED.newest, updated_at = now() \
         WHERE f.newest <= EXCLUDED.newest \
         RETURNING f.newest",
        t = table.quoted()
    )
}

/// `SELECT newest FROM <table> WHERE resource = $1`: the newest accepted token of a resource
/// (for the `Stale` report after [`advance_sql`] returned no row).
pub fn current_sql(table: &Ident) -> String {
    format!("SELECT newest FROM {} WHERE resource = $1", table.quoted())
}
