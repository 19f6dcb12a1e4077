//! `inspect`, `force-release`, `audit` and `fence read`; the backend URL and the output shared by every
//! command.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fenced::{
    AuditRecord, Coordinator, Error, Fence, ForceRelease, HolderInfo, LockKey, ResourceId, Token,
};
use serde_json::{json, Value};

use crate::cli::Output;
use crate::exit::{self, Failure};

/// The backend URL: `--url` (or `FENCED_URL`, which clap reads into it), else `consul://` when
/// `CONSUL_HTTP_ADDR` names an agent (adapter-consul then reads `CONSUL_HTTP_TOKEN`,
/// `CONSUL_CACERT` and the rest of `adapter_consul::ENV_VARS` itself).
/// A URL that was given but is empty (`--url "$UNSET"`) is a usage error, never a reason to fall
/// back to Consul: the command would go to another backend than the one meant.
pub(crate) fn backend_url(flag: Option<String>) -> Result<String, Failure> {
    if let Some(url) = flag {
        if url.trim().is_empty() {
            return Err(Failure::usage(
                "the backend URL is empty (--url or FENCED_URL): nothing was sent",
            ));
        }
        return Ok(url);
    }
    if std::env::var("CONSUL_HTTP_ADDR").is_ok_and(|a| !a.trim().is_empty()) {
        return Ok("consul://".to_owned());
    }
    Err(Failure::usage(
        "no backend: pass --url URL or set FENCED_URL (or CONSUL_HTTP_ADDR for a Consul agent)",
    ))
}

pub(crate) fn lock_key(key: &str) -> Result<LockKey, Failure> {
    LockKey::new(key).map_err(|e| Failure::usage(e.to_string()))
}

pub(crate) async fn connect(flag: Option<String>) -> Result<Arc<dyn Coordinator>, Failure> {
    let url = backend_url(flag)?;
    Ok(fenced::connect(&url).await?)
}

/// Writes `value` (JSON) or `text` on stdout, for a command that changed nothing. A reader
/// that closed the pipe (`| head`) has what it wanted: that failure is not reported, and the
/// exit status stays the command's. Any other failure to write (a full disk, an I/O error) is
/// [`exit::IOERR`], saying that the command itself ran: a script must not take a truncated or
/// missing output for the answer.
pub(crate) fn emit(output: Output, value: Value, text: String) -> Result<(), Failure> {
    write_out(output, value, text).map_err(|e| {
        Failure::new(
            exit::IOERR,
            format!("the command ran, but its output could not be written: {e}"),
        )
    })
}

/// [`emit`] for a command that took effect (a holder removed, a value written): the exit status
/// stays the command's, since a script that saw a failure status would act again (a second
/// force-release would remove the next holder); a failure to write is one line on stderr.
pub(crate) fn emit_effect(output: Output, value: Value, text: String) {
    if let Err(e) = write_out(output, value, text) {
        eprintln!("fenced: the command took effect, but its output could not be written: {e}");
    }
}

/// Writes the output; a closed pipe is not an error.
fn write_out(output: Output, value: Value, text: String) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let written = if output.json {
        writeln!(out, "{value}")
    } else {
        out.write_all(text.as_bytes())
    };
    match written.and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

fn rfc3339(at: SystemTime) -> String {
    humantime::format_rfc3339_seconds(at).to_string()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn human(d: Duration) -> String {
    humantime::format_duration(Duration::from_millis(millis(d))).to_string()
}

fn holder_json(h: &HolderInfo) -> Value {
    json!({
        "owner": h.owner.as_str(),
        "token": h.token.get(),
        "operation": h.operation,
        "acquired_at": h.acquired_at.map(rfc3339),
        "expires_in_ms": h.expires_in.map(millis),
    })
}

fn holder_text(h: &HolderInfo) -> String {
    let mut s = format!("holder     {}\ntoken      {}\n", h.owner, h.token);
    // The label as stored: another writer may have put anything there, so it is escaped (one
    // line, no terminal escapes), like a fenced value.
    let operation = h
        .operation
        .as_deref()
        .map_or_else(|| "-".to_owned(), |op| op.escape_debug().to_string());
    s += &format!("operation  {operation}\n");
    if let Some(at) = h.acquired_at {
        s += &format!("acquired   {}\n", rfc3339(at));
    }
    if let Some(left) = h.expires_in {
        s += &format!("time left  {}\n", human(left));
    }
    s
}

/// `fenced inspect KEY`.
pub(crate) async fn inspect(url: Option<String>, key: &str, output: Output) -> Result<u8, Failure> {
    let key = lock_key(key)?;
    let coord = connect(url).await?;
    let holder = coord.inspect(&key).await?;
    let backend = coord.capabilities().backend;
    match holder {
        Some(h) => {
            let mut value = json!({"key": key.as_str(), "backend": backend, "held": true});
            value["holder"] = holder_json(&h);
            emit(
                output,
                value,
                format!(
                    "key        {key}\nbackend    {backend}\nstate      held\n{}",
                    holder_text(&h)
                ),
            )?;
            Ok(exit::OK)
        }
        None => {
            emit(
                output,
                json!({"key": key.as_str(), "backend": backend, "held": false, "holder": null}),
                format!("key        {key}\nbackend    {backend}\nstate      free\n"),
            )?;
            Ok(exit::ABSENT)
        }
    }
}

/// `fenced force-release KEY --actor NAME --reason TEXT [--expect-token N]`. Both labels are
/// checked before anything is sent. With an expected token the backend compares and deletes in
/// one step; a refusal prints what holds the key now and exits [`exit::REFUSED`].
pub(crate) async fn force_release(
    url: Option<String>,
    key: &str,
    actor: Option<String>,
    reason: Option<String>,
    expect_token: Option<Token>,
    output: Output,
) -> Result<u8, Failure> {
    let (actor, reason) = match (actor, reason) {
        (Some(a), Some(r)) => (a, r),
        (None, None) => {
            return Err(Failure::usage(
                "force-release needs --actor NAME and --reason TEXT (both are recorded)",
            ))
        }
        (None, Some(_)) => {
            return Err(Failure::usage(
                "force-release needs --actor NAME (who forces the release; recorded)",
            ))
        }
        (Some(_), None) => {
            return Err(Failure::usage(
                "force-release needs --reason TEXT (why; recorded)",
            ))
        }
    };
    let mut request =
        ForceRelease::new(actor, reason).map_err(|e| Failure::usage(e.to_string()))?;
    if let Some(t) = expect_token {
        request = request.expect_token(t);
    }
    let key = lock_key(key)?;
    let coord = connect(url).await?;
    let result = coord.force_release(&key, &request).await;
    let backend = coord.capabilities().backend;
    let mut value = json!({
        "key": key.as_str(),
        "backend": backend,
        "actor": request.actor(),
        "reason": request.reason(),
        "expected_token": request.expected_token().map(|t| t.get()),
    });
    let removed = match result {
        Ok(removed) => removed,
        Err(Error::HolderChanged {
            expected, found, ..
        }) => return refused(&*coord, &key, expected, found, value, output).await,
        Err(e) => return Err(e.into()),
    };
    value["refused"] = json!(false);
    value["found_token"] = json!(removed.as_ref().map(|h| h.token.get()));
    match &removed {
        Some(h) => {
            value["removed"] = holder_json(h);
            emit_effect(
                output,
                value,
                format!(
                    "removed the holder of {key} on {backend}\n{}",
                    holder_text(h)
                ),
            );
        }
        None => {
            value["removed"] = Value::Null;
            // Recorded in the audit trail all the same: it took effect.
            emit_effect(
                output,
                value,
                format!("{key} was free on {backend}: nothing removed\n"),
            );
        }
    }
    Ok(exit::OK)
}

/// A force-release refused because the holder is not the expected one: nothing was removed.
/// Prints the token found and, from a fresh `inspect`, who holds the key now (it may have changed
/// again since the refusal; the `found_token` is the one the backend compared). The refusal is
/// reported (status 1) even when that `inspect` fails: the holder is then shown as unknown.
async fn refused(
    coord: &dyn Coordinator,
    key: &LockKey,
    expected: Token,
    found: Option<Token>,
    mut value: Value,
    output: Output,
) -> Result<u8, Failure> {
    let now = coord.inspect(key).await;
    value["refused"] = json!(true);
    value["found_token"] = json!(found.map(|t| t.get()));
    value["removed"] = Value::Null;
    value["holder"] = match &now {
        Ok(now) => now.as_ref().map_or(Value::Null, holder_json),
        Err(e) => json!({ "unknown": e.to_string() }),
    };
    let found_text = match found {
        Some(t) => format!("held under token {t}"),
        None => "free".to_owned(),
    };
    let mut text = format!(
        "refused: {key} is {found_text}, not held under token {expected}: nothing removed\n"
    );
    let backend = coord.capabilities().backend;
    text += &format!("key        {key}\nbackend    {backend}\n");
    match &now {
        Ok(Some(h)) => text += &format!("state      held\n{}", holder_text(h)),
        Ok(None) => text += "state      free\n",
        Err(e) => text += &format!("state      unknown ({e})\n"),
    }
    emit(output, value, text)?;
    Ok(exit::REFUSED)
}

/// `fenced audit KEY [--limit N]`: the forced releases, newest first, one line each; exits
/// [`exit::ABSENT`] when none is recorded. The limit is checked before anything is sent.
pub(crate) async fn audit(
    url: Option<String>,
    key: &str,
    limit: usize,
    output: Output,
) -> Result<u8, Failure> {
    let limit =
        AuditRecord::check_limit(limit).map_err(|e| Failure::usage(format!("--limit: {e}")))?;
    let key = lock_key(key)?;
    let coord = connect(url).await?;
    let records = coord.audit_trail(&key, limit).await?;
    let value = json!({
        "key": key.as_str(),
        "backend": coord.capabilities().backend,
        "limit": limit,
        "records": records.iter().map(record_json).collect::<Vec<_>>(),
    });
    if records.is_empty() {
        emit(
            output,
            value,
            format!("{key}: no forced release recorded\n"),
        )?;
        return Ok(exit::ABSENT);
    }
    let text: String = records.iter().map(record_text).collect();
    emit(output, value, text)?;
    Ok(exit::OK)
}

fn record_json(r: &AuditRecord) -> Value {
    json!({
        "at": r.at.map(rfc3339),
        "actor": r.actor,
        "reason": r.reason,
        "removed_token": r.removed_token.map(|t| t.get()),
        "removed_owner": r.removed_owner,
    })
}

/// One line: `<time> actor="..." reason="..." removed_token=N removed_owner="..."` (`-` for what
/// is unknown or was not there). Strings are quoted and escaped, so a line is one record.
fn record_text(r: &AuditRecord) -> String {
    let at = r.at.map_or_else(|| "-".to_owned(), rfc3339);
    let token = r
        .removed_token
        .map_or_else(|| "-".to_owned(), |t| t.to_string());
    let owner = r
        .removed_owner
        .as_ref()
        .map_or_else(|| "-".to_owned(), |o| format!("{o:?}"));
    format!(
        "{at} actor={:?} reason={:?} removed_token={token} removed_owner={owner}\n",
        r.actor, r.reason
    )
}

/// The fence at `--fence-url` (or `FENCED_FENCE_URL`), which `command` needs.
pub(crate) async fn connect_fence(
    fence_url: Option<String>,
    command: &str,
) -> Result<Arc<dyn Fence>, Failure> {
    let url = fence_url.filter(|u| !u.trim().is_empty()).ok_or_else(|| {
        Failure::usage(format!(
            "{command} needs --fence-url URL (or FENCED_FENCE_URL)"
        ))
    })?;
    Ok(fenced::connect_fence(&url).await?)
}

/// [`connect_fence`] for a command that only reads the fence (`fence read`, `token-floor
/// suggest`): a PostgreSQL fence URL that does not say `migrate=` gets `migrate=false`, so that
/// a read never creates the fence table. A mistyped `table=` then fails naming the table
/// (status 78) instead of reading a new, empty table as "never accepted".
pub(crate) async fn connect_fence_to_read(
    fence_url: Option<String>,
    command: &str,
) -> Result<Arc<dyn Fence>, Failure> {
    connect_fence(fence_url.map(|u| without_migration(&u)), command).await
}

/// `url` with `migrate=false` added when it is a PostgreSQL URL without a `migrate` option
/// (found as tokio-postgres cuts the URL: the user info runs to the first `@`, the query from
/// the first `?` after it); any other URL unchanged.
fn without_migration(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    if !matches!(
        scheme.to_ascii_lowercase().as_str(),
        "postgres" | "postgresql"
    ) {
        return url.to_owned();
    }
    let after_userinfo = rest.find('@').map_or(0, |at| at + 1);
    let query = rest[after_userinfo..]
        .find('?')
        .map(|q| &rest[after_userinfo + q + 1..]);
    let given = query.is_some_and(|q| {
        q.split('&').any(|piece| {
            let name = piece.split_once('=').map_or(piece, |(name, _)| name);
            fenced::adapter::percent_decode(name).is_some_and(|n| n == "migrate")
        })
    });
    match query {
        _ if given => url.to_owned(),
        Some(q) if q.is_empty() || q.ends_with('&') => format!("{url}migrate=false"),
        Some(_) => format!("{url}&migrate=false"),
        None => format!("{url}?migrate=false"),
    }
}

pub(crate) fn resource_id(resource: &str) -> Result<ResourceId, Failure> {
    ResourceId::new(resource).map_err(|e| Failure::usage(e.to_string()))
}

/// `fenced fence write RESOURCE VALUE --token N --fence-url URL`: written (0), or refused as
/// stale ([`exit::LOST`], nothing written; with `--json` the object says `"written": false` and
/// the newest token). Input is checked before connecting.
pub(crate) async fn fence_write(
    fence_url: Option<String>,
    resource: &str,
    value: String,
    token: Option<Token>,
    output: Output,
) -> Result<u8, Failure> {
    let resource = resource_id(resource)?;
    let token = token.ok_or_else(|| {
        Failure::usage("fence write needs --token N (or FENCED_TOKEN, which `fenced run` sets)")
    })?;
    let fence = connect_fence(fence_url, "fence write").await?;
    let written = fence
        .write(&resource, token, fenced::Bytes::from(value.into_bytes()))
        .await;
    let accepted = match written {
        Ok(accepted) => accepted,
        Err(e @ Error::Stale { current, .. }) => {
            // A script reading `--json` gets the answer as JSON too (and the line on stderr).
            if output.json {
                let value = json!({
                    "resource": resource.as_str(),
                    "backend": fence.backend(),
                    "token": token.get(),
                    "written": false,
                    "newest_token": current.get(),
                });
                emit_effect(output, value, String::new());
            }
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    let previous = accepted.previous;
    emit_effect(
        output,
        json!({
            "resource": resource.as_str(),
            "backend": fence.backend(),
            "token": token.get(),
            "written": true,
            "previous_token": previous.map(|t| t.get()),
        }),
        format!(
            "written to {resource} under token {token} (newest before: {})\n",
            previous.map_or_else(|| "none".to_owned(), |t| t.to_string())
        ),
    );
    Ok(exit::OK)
}

/// `fenced fence read RESOURCE --fence-url URL`.
pub(crate) async fn fence_read(
    fence_url: Option<String>,
    resource: &str,
    output: Output,
) -> Result<u8, Failure> {
    let resource = resource_id(resource)?;
    let fence = connect_fence_to_read(fence_url, "fence read").await?;
    let state = fence.read(&resource).await?;
    let base = json!({"resource": resource.as_str(), "backend": fence.backend()});
    let mut value = base;
    let Some(state) = state else {
        value["newest_token"] = Value::Null;
        value["value"] = Value::Null;
        emit(
            output,
            value,
            format!("resource   {resource}\nstate      never accepted a token\n"),
        )?;
        return Ok(exit::ABSENT);
    };
    value["newest_token"] = json!(state.newest.get());
    let mut text = format!("resource   {resource}\nnewest     {}\n", state.newest);
    match &state.value {
        Some((token, bytes)) => {
            let mut v = json!({"token": token.get(), "bytes": bytes.len()});
            match std::str::from_utf8(bytes) {
                Ok(s) => {
                    v["utf8"] = json!(s);
                    text += &format!("written by {token}\nvalue      {}\n", s.escape_debug());
                }
                Err(_) => {
                    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                    v["hex"] = json!(hex);
                    text += &format!(
                        "written by {token}\nvalue      0x{hex} ({} bytes)\n",
                        bytes.len()
                    );
                }
            }
            value["value"] = v;
        }
        None => {
            value["value"] = Value::Null;
            text += "value      - (claimed only, never written)\n";
        }
    }
    emit(output, value, text)?;
    Ok(exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fenced::OwnerId;

    /// An operation label that another writer stored with a newline or a terminal escape cannot
    /// forge a line of `inspect`'s output (a `token` line an operator would copy).
    #[test]
    fn a_stored_operation_is_shown_on_one_line() {
        let h = HolderInfo::new(
            LockKey::new("jobs/x").unwrap(),
            OwnerId::new("w-1").unwrap(),
            Token::new(7).unwrap(),
        )
        .with_operation(Some("op\ntoken      99\u{1b}[2J".to_owned()));
        let text = holder_text(&h);
        let tokens: Vec<&str> = text.lines().filter(|l| l.starts_with("token")).collect();
        assert_eq!(tokens, ["token      7"], "{text}");
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(text.contains(r"op\ntoken      99\u{1b}[2J"), "{text}");
    }

    #[test]
    fn a_postgres_url_is_read_without_migration_unless_it_says_otherwise() {
        for (given, read) in [
            ("postgres://h/db", "postgres://h/db?migrate=false"),
            ("postgresql://h/db?", "postgresql://h/db?migrate=false"),
            (
                "postgres://h/db?table=t",
                "postgres://h/db?table=t&migrate=false",
            ),
            (
                "postgres://u:a?b@h/db",
                "postgres://u:a?b@h/db?migrate=false",
            ),
            (
                "postgres://h/db?migrate=true",
                "postgres://h/db?migrate=true",
            ),
            (
                "postgres://h/db?table=t&m%69grate=1",
                "postgres://h/db?table=t&m%69grate=1",
            ),
            ("redis://h/0", "redis://h/0"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(without_migration(given), read, "{given}");
        }
    }
}
