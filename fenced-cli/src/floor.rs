//! `fenced token-floor suggest KEY [--fence URL]... [--resource R]...`: the floor to configure
//! after a restore of the coordinator.

use serde_json::{json, Value};

use fenced::Token;

use crate::cli::Output;
use crate::commands::{backend_url, connect_fence_to_read, emit, lock_key, resource_id};
use crate::exit::{self, Failure};

/// One number the suggestion rests on, and where it came from.
struct Source {
    token: Token,
    what: String,
}

/// Reads the coordinator's current token for KEY and each resource's newest accepted token on
/// each fence, and suggests one above the highest. Input is checked before anything is sent.
pub(crate) async fn suggest(
    url: Option<String>,
    key: &str,
    mut fences: Vec<String>,
    resources: Vec<String>,
    output: Output,
) -> Result<u8, Failure> {
    let key = lock_key(key)?;
    // The coordinator's URL is settled (and its `token_floor` read) before any fence is
    // connected: a missing URL is a usage error with nothing sent.
    let url = backend_url(url)?;
    // A URL that does not parse is refused here, before any fence is asked; its scheme and
    // options are checked when it is connected, after the fences were read.
    let parsed =
        fenced::adapter::BackendUrl::parse(&url).map_err(|e| Failure::usage(e.to_string()))?;
    let configured = configured_floor(&parsed);
    let resources = resources
        .iter()
        .map(|r| resource_id(r).map_err(|e| Failure::usage(format!("--resource: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    // The environment's fence is read only when resources are named: without any, the command
    // asks the coordinator alone (and an exported FENCED_FENCE_URL is not a `--fence` given).
    if fences.is_empty() && !resources.is_empty() {
        if let Some(url) = std::env::var("FENCED_FENCE_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
        {
            fences.push(url);
        }
    }
    if let Some(empty) = fences.iter().position(|f| f.trim().is_empty()) {
        return Err(Failure::usage(format!("--fence {} is empty", empty + 1)));
    }
    match (fences.is_empty(), resources.is_empty()) {
        (false, true) => {
            return Err(Failure::usage(
                "--fence needs at least one --resource RESOURCE to read on it",
            ))
        }
        (true, false) => {
            return Err(Failure::usage(
                "--resource needs a fence to read it on: --fence URL (or FENCED_FENCE_URL)",
            ))
        }
        _ => {}
    }

    // Every fence is connected (its URL checked) before the coordinator is asked anything, so a
    // bad `--fence` is refused before a request is sent.
    let mut connected = Vec::with_capacity(fences.len());
    for (i, fence_url) in fences.into_iter().enumerate() {
        let n = i + 1;
        let fence = connect_fence_to_read(Some(fence_url), "token-floor suggest")
            .await
            .map_err(|f| Failure::new(f.status, format!("fence {n}: {f}")))?;
        connected.push((n, fence));
    }

    let coord = fenced::connect(&url).await?;
    let backend = coord.capabilities().backend;
    let holder = coord.inspect(&key).await?;
    let mut sources = Vec::new();
    let mut text = format!("key          {key}\n");
    let coordinator = match &holder {
        Some(h) => {
            text += &format!(
                "coordinator  {backend}: token {} (inspect {key}: held by {})\n",
                h.token, h.owner
            );
            sources.push(Source {
                token: h.token,
                what: format!("the coordinator ({backend}), holder of {key}"),
            });
            json!({"backend": backend, "held": true, "token": h.token.get(), "owner": h.owner.as_str()})
        }
        None => {
            text += &format!("coordinator  {backend}: no current token (inspect {key}: free)\n");
            json!({"backend": backend, "held": false, "token": null, "owner": null})
        }
    };

    let mut read = Vec::new();
    for (n, fence) in connected {
        let fence_backend = fence.backend();
        for resource in &resources {
            let state = fence
                .read(resource)
                .await
                .map_err(|e| Failure::new(exit::status_of(&e), format!("fence {n}: {e}")))?;
            let newest = state.map(|s| s.newest);
            match newest {
                Some(t) => {
                    text += &format!(
                        "fence {n}      {fence_backend} {resource}: newest accepted token {t}\n"
                    );
                    sources.push(Source {
                        token: t,
                        what: format!("fence {n} ({fence_backend}), resource {resource}"),
                    });
                }
                None => {
                    text += &format!(
                        "fence {n}      {fence_backend} {resource}: never accepted a token\n"
                    );
                }
            }
            read.push(json!({
                "fence": n,
                "backend": fence_backend,
                "resource": resource.as_str(),
                "newest_token": newest.map(|t| t.get()),
            }));
        }
    }

    let mut value = json!({
        "key": key.as_str(),
        "backend": backend,
        "coordinator": coordinator,
        "fences": read,
        "configured_floor": configured.map(|t| t.get()),
    });
    if let Some(f) = configured {
        text += &format!("configured   token_floor={f} in the coordinator URL\n");
    }
    let Some(highest) = sources.iter().max_by_key(|s| s.token) else {
        value["highest"] = Value::Null;
        value["suggested_floor"] = Value::Null;
        text += "suggested    none: no token found (the key is free and no fence named accepted \
                 one); name the fences and resources its holders write to\n";
        emit(output, value, text)?;
        return Ok(exit::ABSENT);
    };
    // A floor is what every token must exceed, and the URL refuses `Token::MAX` as one.
    let above = highest
        .token
        .get()
        .checked_add(1)
        .and_then(|t| Token::new(t).ok())
        .filter(|t| *t < Token::MAX)
        .ok_or_else(|| {
            Failure::new(
                exit::SOFTWARE,
                format!(
                    "the highest token {} ({}) leaves no floor a URL accepts above it (at most \
                     {})",
                    highest.token,
                    highest.what,
                    Token::MAX.get() - 1
                ),
            )
        })?;
    value["highest"] = json!({"token": highest.token.get(), "source": highest.what});
    text += &format!("highest      {} ({})\n", highest.token, highest.what);
    // A floor already configured above it stays: a lower one would let the coordinator issue
    // again tokens the configured floor was set to skip (some may be held or fenced already).
    let floor = match configured {
        Some(f) if f >= above => {
            text += &format!("suggested    {f}\n");
            text +=
                &format!("keep         token_floor={f}: it is already above every token found\n");
            f
        }
        _ => {
            text += &format!("suggested    {above}\n");
            text += &format!(
                "configure    token_floor={above} in the backend URL of every client of {key}, \
                 before any acquires it again\n"
            );
            above
        }
    };
    value["suggested_floor"] = json!(floor.get());
    emit(output, value, text)?;
    Ok(exit::OK)
}

/// The `token_floor` option of the coordinator URL `url`, if it has one. A floor that is not a
/// token is left to `connect` to refuse with its own error.
fn configured_floor(url: &fenced::adapter::BackendUrl) -> Option<Token> {
    let pairs = url.query_pairs().ok()?;
    pairs
        .into_iter()
        .find(|(name, _)| name == "token_floor")
        .and_then(|(_, v)| v.parse::<Token>().ok())
}
