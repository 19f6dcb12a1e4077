//! Choosing a backend from a URL: [`BackendUrl`] (secrets redacted) and the [`Registry`].

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::coordinator::Coordinator;
use crate::error::{InvalidInput, Result};
use crate::fence::Fence;
use crate::instrument::Instrumented;
use crate::memory::{MemoryCoordinator, MemoryFence};
use crate::options::OwnerId;
use crate::url_options::{OptionSpec, UrlOptions};

/// A parsed backend URL such as `redis://user:pw@127.0.0.1:6379`, `memory://`, or a cluster
/// `zk://h1:2181,h2:2181,h3:2181/base`.
///
/// `Debug` and `Display` show the password (and secret query parameters) as `***`; only
/// [`BackendUrl::expose`] and [`BackendUrl::expose_str`] give the secrets.
///
/// A comma-separated host list with ports (which the `url` crate alone rejects) is accepted: the
/// parsed [`expose`](BackendUrl::expose) URL carries the first host, [`hosts`](BackendUrl::hosts)
/// all of them, and [`expose_str`](BackendUrl::expose_str) the original text.
#[derive(Clone, PartialEq, Eq)]
pub struct BackendUrl {
    url: url::Url,
    raw: String,
    /// Hosts after the first, as written (`host[:port]`), when the authority was a list.
    more_hosts: Vec<String>,
}

impl BackendUrl {
    /// Parses `s`. Errors name the URL with any password redacted.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let invalid = |problem: String| InvalidInput::Url {
            url: redact_unparsed(s),
            problem,
        };
        let (normalized, more_hosts) = split_host_list(s).map_err(|p| invalid(p.to_owned()))?;
        let url = url::Url::parse(&normalized).map_err(|e| invalid(e.to_string()))?;
        Ok(BackendUrl {
            url,
            raw: s.to_owned(),
            more_hosts,
        })
    }

    /// Every host of the URL as `host[:port]`, in order (one for an ordinary URL).
    pub fn hosts(&self) -> Vec<String> {
        let mut first = self.url.host_str().unwrap_or_default().to_owned();
        if let Some(port) = self.url.port() {
            first = format!("{first}:{port}");
        }
        std::iter::once(first)
            .filter(|h| !h.is_empty())
            .chain(self.more_hosts.iter().cloned())
            .collect()
    }

    /// Every host of the URL ([`hosts`](Self::hosts)) checked as a [`HostPort`], with
    /// `default_port` where a host has none. `InvalidInput` naming the URL (password redacted)
    /// when it names no host or one is not `host[:port]`.
    pub fn host_ports(&self, default_port: u16) -> Result<Vec<HostPort>, InvalidInput> {
        let hosts = self.hosts();
        if hosts.is_empty() {
            return Err(self.invalid("the URL names no host"));
        }
        hosts
            .iter()
            .map(|h| HostPort::parse(h, Some(default_port)).map_err(|p| self.invalid(p)))
            .collect()
    }

    /// The user name, percent-decoded (`None` when the URL has none). A malformed escape is
    /// `InvalidInput` naming the redacted URL.
    pub fn username(&self) -> Result<Option<String>, InvalidInput> {
        match self.url.username() {
            "" => Ok(None),
            u => percent_decode(u)
                .map(Some)
                .ok_or_else(|| self.invalid("the user name has a malformed percent escape")),
        }
    }

    /// The password, percent-decoded (`None` when the URL has none). Never log it.
    pub fn password(&self) -> Result<Option<String>, InvalidInput> {
        match self.url.password() {
            None => Ok(None),
            Some(p) => percent_decode(p)
                .map(Some)
                .ok_or_else(|| self.invalid("the password has a malformed percent escape")),
        }
    }

    /// The URL exactly as given, with its secrets. Pass it only to a client library or an
    /// adapter's own parser; never log it.
    pub fn expose_str(&self) -> &str {
        &self.raw
    }

    /// The scheme (`redis`, `etcd`, `memory`, ...).
    pub fn scheme(&self) -> &str {
        self.url.scheme()
    }

    /// The URL with its secrets. Pass it only to the client library; never log it.
    pub fn expose(&self) -> &url::Url {
        &self.url
    }

    /// The URL with its secrets replaced by `***`: the password, a user name given without one
    /// (`consul://<token>@host` passes a token that way), the values of the query parameters
    /// commonly holding secrets (`password`, `token`, `secret`, `auth`, `acl_token`, `digest`),
    /// and a fragment (text after a `#`, which may be the rest of a secret holding one).
    pub fn redacted(&self) -> String {
        self.redacted_hiding(&[])
    }

    /// Like [`BackendUrl::redacted`], also hiding the values of the query parameters named in
    /// `secret` (an adapter's own secret options).
    pub fn redacted_hiding(&self, secret: &[&str]) -> String {
        self.redacted_with(&|name| is_secret_param(name) || secret.contains(&name))
    }

    /// Like [`BackendUrl::redacted`], hiding the value of every query parameter for which
    /// `hide` (given its decoded name) is true.
    pub(crate) fn redacted_with(&self, hide: &dyn Fn(&str) -> bool) -> String {
        let mut u = self.url.clone();
        if u.cannot_be_a_base() && u.path().contains('@') {
            // No `//`: `user:password@host` without a scheme reads as scheme `user` and an
            // opaque path holding the password.
            return format!("{}:(not shown, as it may hold a secret)", u.scheme());
        }
        if u.password().is_some() {
            let _ = u.set_password(Some("***"));
        } else if !u.username().is_empty() {
            let _ = u.set_username("***");
        }
        if let Some(query) = u.query() {
            let shown: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if hide(&decode_lossy(name)) => format!("{name}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            u.set_query(Some(&shown.join("&")));
        }
        if u.fragment().is_some() {
            u.set_fragment(Some("***"));
        }
        let shown = u.to_string();
        if self.more_hosts.is_empty() {
            return shown;
        }
        // Put the rest of the host list back after the first host.
        // It is the host after the user info (`h1:pw@h1`: not the user name `h1`).
        let first = self.hosts().remove(0);
        let from = shown.find("://").map_or(0, |i| i + 3);
        let authority = from
            + shown[from..]
                .find(['/', '?', '#'])
                .unwrap_or(shown.len() - from);
        let host_at = shown[from..authority]
            .rfind('@')
            .map_or(from, |at| from + at + 1);
        match shown[host_at..].find(&first).map(|i| host_at + i) {
            Some(i) => format!(
                "{}{},{}{}",
                &shown[..i],
                first,
                self.more_hosts.join(","),
                &shown[i + first.len()..]
            ),
            None => shown,
        }
    }

    /// The query's `name=value` pairs in order, each part percent-decoded as the user name and
    /// the path are (RFC 3986: `+` is a plus sign, not a space); empty pairs are skipped and a
    /// pair without `=` has an empty value. `InvalidInput` naming the URL (every query value
    /// hidden) and the option when a part has a malformed escape or is not UTF-8 once decoded.
    pub fn query_pairs(&self) -> Result<Vec<(String, String)>, InvalidInput> {
        let Some(query) = self.url.query() else {
            return Ok(Vec::new());
        };
        query
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                // Every value hidden: which names are secrets is not known yet here.
                let invalid = |problem: String| InvalidInput::Url {
                    url: self.redacted_with(&|_| true),
                    problem,
                };
                let name = percent_decode(name).ok_or_else(|| {
                    invalid("a query option's name has a malformed percent escape".into())
                })?;
                let value = percent_decode(value).ok_or_else(|| {
                    invalid(format!(
                        "the value of query option {name:?} has a malformed percent escape"
                    ))
                })?;
                Ok((name, value))
            })
            .collect()
    }

    /// An `InvalidInput::Url` naming this URL (redacted).
    pub fn invalid(&self, problem: impl Into<String>) -> InvalidInput {
        InvalidInput::Url {
            url: self.redacted(),
            problem: problem.into(),
        }
    }
}

/// One server of a URL's host list (or of a list option): a host name or IPv4 address (ASCII
/// letters, digits, `.`, `-`, `_`) or an IPv6 address, and a port.
///
/// `Display` gives `host:port`, the IPv6 address in brackets (`[::1]:2181`), as connect strings
/// and URLs want it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    /// The host name or address; an IPv6 address without its brackets.
    pub host: String,
    /// The port, 1 to 65535.
    pub port: u16,
}

impl HostPort {
    /// Parses `host[:port]` or `[ipv6][:port]` (surrounding blanks ignored). Without a port the
    /// host gets `default_port`; with `None` a port is required. The error says what is wrong
    /// with `s`, for the caller to put in its `InvalidInput`.
    pub fn parse(s: &str, default_port: Option<u16>) -> Result<Self, String> {
        let h = s.trim();
        if h.is_empty() {
            return Err("an empty host in the host list".into());
        }
        let (host, port) = if let Some(rest) = h.strip_prefix('[') {
            let Some((host, after)) = rest.split_once(']') else {
                return Err(format!("host {h:?} has no closing ']'"));
            };
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(format!("{host:?} is not an IPv6 address"));
            }
            match after.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None if after.is_empty() => (host, None),
                None => return Err(format!("host {h:?} has junk after ']'")),
            }
        } else {
            if h.matches(':').count() > 1 {
                return Err(format!(
                    "host {h:?}: an IPv6 address is written in brackets ([::1] or [::1]:port)"
                ));
            }
            let (host, port) = match h.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (h, None),
            };
            if host.is_empty()
                || !host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
            {
                return Err(format!("{host:?} is not a host name or address"));
            }
            (host, port)
        };
        let port = match (port, default_port) {
            (None, Some(default)) => default,
            (None, None) => return Err(format!("host {h:?} has no port (host:port)")),
            (Some(p), _) => match p.parse::<u16>() {
                // Digits only: `parse` would also take `+80`, which the first host of a URL
                // (parsed by `url`) is refused.
                Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => n,
                _ => return Err(format!("port {p:?} of host {host} is not a port number")),
            },
        };
        Ok(HostPort {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Whether a query parameter carries a secret (its value is shown as `***`). `digest` is
/// ZooKeeper's `user:password`.
pub(crate) fn is_secret_param(key: &str) -> bool {
    matches!(
        key.to_ascii_lowercase().as_str(),
        "password" | "token" | "secret" | "auth" | "acl_token" | "digest"
    )
}

/// Percent-encodes `s`: every byte other than RFC 3986's unreserved characters
/// (`A-Z a-z 0-9 - . _ ~`) becomes `%XX` (upper-case hex). The result has no `/` or other
/// separator, distinct inputs give distinct results, and [`percent_decode`] gives `s` back.
pub fn percent_encode(s: &str) -> String {
    /// Every byte but RFC 3986's unreserved characters.
    const RESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(s, RESERVED).to_string()
}

/// Percent-decodes `s` (`%40` is `@`; `+` stays `+`); `None` for a malformed escape (`%`
/// not followed by two hex digits) or bytes that are not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            if !hex.iter().all(u8::is_ascii_hexdigit) {
                return None;
            }
            out.push(u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// [`percent_decode`], or `s` as written when it does not decode (for matching a name only).
fn decode_lossy(s: &str) -> String {
    percent_decode(s).unwrap_or_else(|| s.to_owned())
}

/// Splits `scheme://[userinfo@]h1[:p1],h2[:p2],...[/path][?query]` into the same URL with only
/// the first host, and the other hosts. A URL without a comma in its authority is returned as is.
fn split_host_list(s: &str) -> Result<(String, Vec<String>), &'static str> {
    let Some(scheme_end) = s.find("://") else {
        return Ok((s.to_owned(), Vec::new()));
    };
    let rest = &s[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let host_start = authority.rfind('@').map_or(0, |i| i + 1);
    let hosts = &authority[host_start..];
    if !hosts.contains(',') {
        return Ok((s.to_owned(), Vec::new()));
    }
    let mut list = hosts.split(',');
    let first = list.next().unwrap_or_default();
    let more: Vec<String> = list.map(str::to_owned).collect();
    let bad_port = |h: &str| match h.rsplit_once(':') {
        Some((_, port)) if !h.ends_with(']') => {
            port.parse::<u16>().is_err() || !port.bytes().all(|b| b.is_ascii_digit())
        }
        _ => false,
    };
    if first.is_empty()
        || more
            .iter()
            .any(|h| h.is_empty() || h.contains(['@', ' ']) || bad_port(h))
    {
        return Err("the host list has an empty or malformed entry (host[:port],...)");
    }
    let normalized = format!(
        "{}{}{}",
        &s[..scheme_end + 3 + host_start],
        first,
        &rest[authority_end..]
    );
    Ok((normalized, more))
}

/// `raw` (any text: a URL, one that did not parse, or no URL at all) with every secret it may
/// hold replaced by `***`: the password of its user info, and the values of query parameters
/// that carry secrets (`password`, `token`, `secret`, `auth`, `acl_token`, `digest`, and the
/// names in `secret_keys`; compared percent-decoded and ignoring case). Text without `://`
/// that holds an `@` or `=` (`user:password@host` without a scheme, a `key=value` connection
/// string) is not shown at all.
///
/// A password may itself hold `/`, `?`, `#` or `:` (often the reason the URL did not parse), so
/// everything from the first `:` after `scheme://` up to the *last* `@` counts as the password:
/// a raw `@` further on (in a query value) hides more than the password, never less.
pub fn redact_url_text(raw: &str, secret_keys: &[&str]) -> String {
    redact_text(raw, false, &|name| {
        is_secret_param(name) || secret_keys.contains(&name)
    })
}

/// [`redact_url_text`], hiding the values of the query parameters for which `hide` (given the
/// decoded, lowercased name) is true, and a user name without a password when `lone_user`.
fn redact_text(raw: &str, lone_user: bool, hide: &dyn Fn(&str) -> bool) -> String {
    let Some(start) = raw.find("://").map(|i| i + 3) else {
        if raw.contains(['@', '=']) {
            return "(not a URL; not shown, as it may hold a secret)".to_owned();
        }
        return raw.to_owned();
    };
    let rest = &raw[start..];
    let query = |query: &str| -> String {
        let pieces: Vec<String> = query
            .split('&')
            .map(|piece| match piece.split_once('=') {
                Some((key, _))
                    if hide(&percent_decode(key).unwrap_or_default().to_ascii_lowercase()) =>
                {
                    format!("{key}=***")
                }
                _ => piece.to_owned(),
            })
            .collect();
        pieces.join("&")
    };
    // What stands before the password (or before the last `@`) may itself run into a query,
    // when that `@` is one in a query value (`?password=s3cret&user=alice@srv`).
    let shown_before = |s: &str| match s.split_once('?') {
        Some((before, q)) => format!("{before}?{}", query(q)),
        None => s.to_owned(),
    };
    let (mut out, tail) = match rest.rfind('@') {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => (
                format!("{}{}:***", &raw[..start], shown_before(user)),
                &rest[at..],
            ),
            None if lone_user => (format!("{}***", &raw[..start]), &rest[at..]),
            None => (
                format!("{}{}", &raw[..start], shown_before(&rest[..at])),
                &rest[at..],
            ),
        },
        None => (raw[..start].to_owned(), rest),
    };
    match tail.split_once('?') {
        Some((before, q)) => {
            out.push_str(before);
            out.push('?');
            out.push_str(&query(q));
        }
        // No `?` after the last `@`: that `@` may be one in a query value
        // (`?user=alice@srv&password=...`), so what follows is read as query pieces too (hosts and
        // a path have no `&`-separated `key=value` to hide).
        None => out.push_str(&query(tail)),
    }
    out
}

/// [`redact_url_text`] for a URL that did not parse, cut to a readable length. Stricter than
/// [`BackendUrl::redacted`], as no backend's option names are known yet: a user name without a
/// password is hidden (`consul://<token>@host` passes a token that way), and so is the value of
/// every query parameter (a misspelt `passwd=` may hold a password).
fn redact_unparsed(s: &str) -> String {
    redact_text(s, true, &|_| true).chars().take(256).collect()
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BackendUrl({})", self.redacted())
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// What a `memory://` URL is asked to make.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Coordinator,
    Fence,
}

/// The options of a `memory://` URL: a coordinator's `owner`, nothing else (no option means
/// anything to a map in this process).
fn memory_options(url: &BackendUrl, role: Role) -> Result<Option<OwnerId>, InvalidInput> {
    const SPEC: OptionSpec = OptionSpec {
        backend: &[],
        secret: &[],
        key_prefix: |_| Ok(()),
    };
    let raw = url.expose();
    if raw.host_str().is_some_and(|h| !h.is_empty())
        || !matches!(raw.path(), "" | "/")
        || !raw.username().is_empty()
        || raw.password().is_some()
    {
        return Err(url.invalid(
            "memory:// names no server, path or user: each connect makes a new in-process \
             coordinator or fence, shared with nobody (share one handle instead)",
        ));
    }
    let (common, _) = UrlOptions::parse(url, SPEC)?;
    let given = [
        ("key_prefix", common.key_prefix.is_some()),
        ("token_floor", common.token_floor.is_some()),
        ("request_timeout_ms", common.request_timeout.is_some()),
        ("connect_timeout_ms", common.connect_timeout.is_some()),
        ("owner", role == Role::Fence && common.owner.is_some()),
    ];
    if let Some((name, _)) = given.iter().find(|(_, given)| *given) {
        return Err(url.invalid(format!(
            "option {name:?} means nothing to an in-process {} (memory:// takes {})",
            if role == Role::Fence {
                "fence"
            } else {
                "coordinator"
            },
            if role == Role::Fence {
                "no option"
            } else {
                "only owner="
            }
        )));
    }
    Ok(common.owner)
}

/// Makes a coordinator from a URL.
pub type CoordinatorFactory =
    Arc<dyn Fn(BackendUrl) -> BoxFuture<'static, Result<Arc<dyn Coordinator>>> + Send + Sync>;
/// Makes a fence from a URL.
pub type FenceFactory =
    Arc<dyn Fn(BackendUrl) -> BoxFuture<'static, Result<Arc<dyn Fence>>> + Send + Sync>;

/// Maps URL schemes to backends, so that library code picks a backend from configuration.
///
/// lease-core knows only `memory://`; each adapter crate registers its own scheme(s). Handles made
/// by [`Registry::connect`] and [`Registry::connect_fence`] are always [`Instrumented`].
#[derive(Clone)]
pub struct Registry {
    coordinators: HashMap<String, CoordinatorFactory>,
    fences: HashMap<String, FenceFactory>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut c: Vec<_> = self.coordinators.keys().collect();
        let mut fe: Vec<_> = self.fences.keys().collect();
        c.sort();
        fe.sort();
        f.debug_struct("Registry")
            .field("coordinators", &c)
            .field("fences", &fe)
            .finish()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    /// A registry that knows `memory://`: each connect makes a new in-process coordinator or
    /// fence, shared with nobody (two components that each connect to `memory://` do not
    /// exclude each other; share one handle instead). Its only option is a coordinator's
    /// `owner`; any other option is `InvalidInput` naming it.
    pub fn new() -> Self {
        let mut r = Registry {
            coordinators: HashMap::new(),
            fences: HashMap::new(),
        };
        r.register_coordinator_fn(&["memory"], |url| async move {
            Ok(match memory_options(&url, Role::Coordinator)? {
                Some(owner) => MemoryCoordinator::with_owner(owner),
                None => MemoryCoordinator::new(),
            })
        });
        r.register_fence_fn(&["memory"], |url| async move {
            memory_options(&url, Role::Fence)?;
            Ok(MemoryFence::new())
        });
        r
    }

    /// Registers (or replaces) the coordinator for `scheme`.
    pub fn register_coordinator(&mut self, scheme: &str, factory: CoordinatorFactory) {
        self.coordinators
            .insert(scheme.to_ascii_lowercase(), factory);
    }

    /// Registers (or replaces) the fence for `scheme`.
    pub fn register_fence(&mut self, scheme: &str, factory: FenceFactory) {
        self.fences.insert(scheme.to_ascii_lowercase(), factory);
    }

    /// Registers (or replaces), for each of `schemes`, the coordinator `connect` makes from the
    /// URL: [`Self::register_coordinator`] with the `Arc`, the boxed future and the cast to
    /// `dyn Coordinator` written once.
    ///
    /// ```
    /// use lease_core::memory::MemoryCoordinator;
    /// use lease_core::Registry;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> lease_core::Result<()> {
    /// let mut registry = Registry::new();
    /// registry.register_coordinator_fn(&["mine", "mine+tls"], |_url| async {
    ///     Ok(MemoryCoordinator::new())
    /// });
    /// let coordinator = registry.connect("mine://anywhere").await?;
    /// assert_eq!(coordinator.capabilities().backend, "memory");
    /// # Ok(())
    /// # }
    /// ```
    pub fn register_coordinator_fn<C, F, Fut>(&mut self, schemes: &[&str], connect: F)
    where
        C: Coordinator + 'static,
        F: Fn(BackendUrl) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<C>> + Send + 'static,
    {
        let connect = Arc::new(connect);
        for scheme in schemes {
            let connect = connect.clone();
            let factory: CoordinatorFactory = Arc::new(move |url| {
                let made = connect(url);
                Box::pin(async move { Ok(Arc::new(made.await?) as Arc<dyn Coordinator>) })
            });
            self.register_coordinator(scheme, factory);
        }
    }

    /// Registers (or replaces), for each of `schemes`, the fence `connect` makes from the URL:
    /// [`Self::register_fence`] with the `Arc`, the boxed future and the cast written once.
    pub fn register_fence_fn<T, F, Fut>(&mut self, schemes: &[&str], connect: F)
    where
        T: Fence + 'static,
        F: Fn(BackendUrl) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<T>> + Send + 'static,
    {
        let connect = Arc::new(connect);
        for scheme in schemes {
            let connect = connect.clone();
            let factory: FenceFactory = Arc::new(move |url| {
                let made = connect(url);
                Box::pin(async move { Ok(Arc::new(made.await?) as Arc<dyn Fence>) })
            });
            self.register_fence(scheme, factory);
        }
    }

    fn unknown(&self, url: &BackendUrl, what: &str, known: Vec<&String>) -> InvalidInput {
        let mut known: Vec<_> = known.into_iter().map(String::as_str).collect();
        known.sort();
        url.invalid(format!(
            "no {what} is registered for scheme {:?} (known: {})",
            url.scheme(),
            known.join(", ")
        ))
    }

    /// Connects to the coordinator named by `url`, instrumented.
    pub async fn connect(&self, url: &str) -> Result<Arc<dyn Coordinator>> {
        let url = BackendUrl::parse(url)?;
        let factory = self
            .coordinators
            .get(url.scheme())
            .ok_or_else(|| self.unknown(&url, "coordinator", self.coordinators.keys().collect()))?;
        let inner = factory(url).await?;
        Ok(Arc::new(Instrumented::new(inner)))
    }

    /// Connects to the fence named by `url`, instrumented.
    pub async fn connect_fence(&self, url: &str) -> Result<Arc<dyn Fence>> {
        let url = BackendUrl::parse(url)?;
        let factory = self
            .fences
            .get(url.scheme())
            .ok_or_else(|| self.unknown(&url, "fence", self.fences.keys().collect()))?;
        let inner = factory(url).await?;
        Ok(Arc::new(Instrumented::new(inner)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_shows() {
        let u = BackendUrl::parse("redis://alice:s3cret@127.0.0.1:6379/0?token=abc&db=1").unwrap();
        for shown in [format!("{u}"), format!("{u:?}")] {
            assert!(
                !shown.contains("s3cret") && !shown.contains("abc"),
                "{shown}"
            );
            assert!(shown.contains("alice") && shown.contains("db=1"), "{shown}");
        }
        assert_eq!(u.expose().password(), Some("s3cret"));
    }

    /// A user name without a password is how some tools pass a token
    /// (`consul://<token>@agent`): it is hidden as a password is.
    #[test]
    fn a_user_name_without_a_password_never_shows() {
        let u = BackendUrl::parse("consul://0b2f5a3e-tok@127.0.0.1:8500?key_prefix=app").unwrap();
        for shown in [format!("{u}"), format!("{u:?}"), u.invalid("x").to_string()] {
            assert!(!shown.contains("0b2f5a3e"), "{shown}");
            assert!(shown.contains("***@127.0.0.1"), "{shown}");
        }
    }

    /// A malformed escape is reported before the options are known, so no value is shown: a
    /// misspelt secret option with a raw `%` in its value stays hidden.
    #[test]
    fn a_malformed_escape_in_the_query_shows_no_value() {
        let u = BackendUrl::parse("redis://h:1?passwd=50%off&db=1").unwrap();
        let e = u.query_pairs().unwrap_err().to_string();
        assert!(
            e.contains("malformed percent escape") && e.contains("\"passwd\""),
            "{e}"
        );
        assert!(!e.contains("50%off") && !e.contains("db=1"), "{e}");
    }

    #[test]
    fn a_malformed_escape_does_not_decode() {
        for bad in ["%+1", "%-1", "% 1", "%1", "%", "%zz", "%FF"] {
            assert_eq!(percent_decode(bad), None, "{bad}");
        }
        assert_eq!(percent_decode("a+b%2B").as_deref(), Some("a+b+"));
    }

    /// `memory://` makes a coordinator of this process: only `owner` means anything to it, and
    /// any other option is refused by name rather than ignored.
    #[tokio::test]
    async fn memory_urls_take_an_owner_and_refuse_every_other_option() {
        let r = Registry::new();
        let c = r.connect("memory://?owner=billing").await.unwrap();
        let key = crate::LockKey::new("k").unwrap();
        let _lease = c
            .try_acquire(
                &key,
                &crate::LeaseOptions::new(std::time::Duration::from_secs(5)),
            )
            .await
            .unwrap();
        let holder = c.inspect(&key).await.unwrap().unwrap();
        assert_eq!(holder.owner.as_str(), "billing");
        for url in [
            "memory://?nosuch=1",
            "memory://?token_floor=1000",
            "memory://?key_prefix=app",
            "memory://?request_timeout_ms=10",
        ] {
            let e = r.connect(url).await.unwrap_err().to_string();
            let name = url.split_once('?').unwrap().1.split('=').next().unwrap();
            assert!(e.contains(&format!("\"{name}\"")), "{url}: {e}");
        }
        // A name suggests a shared coordinator, which memory:// never is.
        for url in ["memory://shared-name", "memory:///x", "memory://u:pw@h"] {
            let e = r.connect(url).await.unwrap_err().to_string();
            assert!(e.contains("shared with nobody"), "{url}: {e}");
        }
        r.connect("memory:///").await.unwrap();
        let e = r
            .connect_fence("memory://?owner=billing")
            .await
            .unwrap_err();
        assert!(e.to_string().contains("\"owner\""), "{e}");
        r.connect_fence("memory://").await.unwrap();
    }

    #[test]
    fn percent_encoding_keeps_unreserved_bytes_and_round_trips() {
        assert_eq!(percent_encode("a-Z.9_~"), "a-Z.9_~");
        assert_eq!(percent_encode("a/b c%é"), "a%2Fb%20c%25%C3%A9");
        for s in ["", "orders/42", "with space", "%2F", "é/ü"] {
            assert_eq!(percent_decode(&percent_encode(s)).as_deref(), Some(s));
        }
    }

    #[test]
    fn host_ports_take_names_addresses_and_default_ports() {
        let hp = |s: &str, d| HostPort::parse(s, d).map(|h| h.to_string());
        assert_eq!(hp("h1", Some(2181)).unwrap(), "h1:2181");
        assert_eq!(hp(" db-2.svc_x:7 ", None).unwrap(), "db-2.svc_x:7");
        assert_eq!(hp("10.0.0.1:65535", None).unwrap(), "10.0.0.1:65535");
        assert_eq!(hp("[::1]", Some(1)).unwrap(), "[::1]:1");
        let v6 = HostPort::parse("[fe80::2]:2379", None).unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("fe80::2", 2379));
        for (bad, why) in [
            ("", "empty"),
            ("h1", "no port"),
            ("h:0", "not a port"),
            ("h:70000", "not a port"),
            ("h:x", "not a port"),
            (":80", "not a host"),
            ("a/b:1", "not a host"),
            ("u@h:1", "not a host"),
            ("[::1", "closing"),
            ("[nope]:1", "IPv6"),
            ("[::1]x", "junk"),
        ] {
            let e = hp(bad, None).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
        let u = BackendUrl::parse("zk://u:pw@h1:2181,[::1],h3:7/base").unwrap();
        let all: Vec<String> = u
            .host_ports(2181)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(all, ["h1:2181", "[::1]:2181", "h3:7"]);
        let e = BackendUrl::parse("zk://u:secret@h1:0/x")
            .unwrap()
            .host_ports(2181)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a port") && !e.contains("secret"), "{e}");
    }

    #[test]
    fn host_lists_with_ports_parse_and_stay_redacted() {
        let u = BackendUrl::parse("zk://bob:pw@h1:2181,h2:2182,h3/base?digest=u:secret").unwrap();
        assert_eq!(u.hosts(), vec!["h1:2181", "h2:2182", "h3"]);
        assert_eq!(u.scheme(), "zk");
        assert_eq!(u.expose().path(), "/base");
        assert!(u.expose_str().contains("h2:2182") && u.expose_str().contains("secret"));
        let shown = u.to_string();
        assert!(shown.contains("h1:2181,h2:2182,h3/base"), "{shown}");
        assert!(
            !shown.contains("pw@") && !shown.contains("secret"),
            "{shown}"
        );
        // A user name equal to the first host: the list goes after the host, not the name.
        assert_eq!(
            BackendUrl::parse("zk://h1:pw@h1,h2/x").unwrap().to_string(),
            "zk://h1:***@h1,h2/x"
        );
        assert!(BackendUrl::parse("etcd://a:1,,b:2").is_err());
        assert_eq!(
            BackendUrl::parse("redis://h:1").unwrap().hosts(),
            vec!["h:1"]
        );
    }

    #[test]
    fn credentials_are_percent_decoded() {
        let u = BackendUrl::parse("postgres://us%65r:p%40ss%2Fw@h/db").unwrap();
        assert_eq!(u.username().unwrap().as_deref(), Some("user"));
        assert_eq!(u.password().unwrap().as_deref(), Some("p@ss/w"));
        assert!(BackendUrl::parse("x://u:%zz@h")
            .unwrap()
            .password()
            .is_err());
        assert_eq!(
            BackendUrl::parse("x://h").unwrap().username().unwrap(),
            None
        );
        assert_eq!(percent_decode("a%2"), None);
    }

    #[test]
    fn passwords_with_url_delimiters_never_show() {
        for url in [
            "redis://u:p#ss@h:6379",
            "zk://u:pa/ss@h:2181/x",
            "etcd://u:a?b@h:1",
        ] {
            let e = BackendUrl::parse(url)
                .map(|u| u.to_string())
                .unwrap_or_else(|e| e.to_string());
            for secret in ["p#ss", "pa/ss", "a?b"] {
                assert!(!e.contains(secret), "{url}: {e}");
            }
        }
    }

    #[test]
    fn url_text_redaction_hides_every_secret_form() {
        for (raw, want) in [
            ("redis://u:pw@h/0", "redis://u:***@h/0"),
            ("redis://u@h/0", "redis://u@h/0"),
            ("redis://:pw@h", "redis://:***@h"),
            // A password holding `/`, `?`, `#`, `:` or `@` is hidden whole.
            ("etcd://u:a/b?c#d:e@f@h:2379", "etcd://u:***@h:2379"),
            // Secret query values: known names, the caller's names, any case, percent-encoded.
            (
                "pg://h/db?Password=a&sslpassword=b&pass%77ord=c&table=t",
                "pg://h/db?Password=***&sslpassword=***&pass%77ord=***&table=t",
            ),
            ("zk://h/x?digest=alice:s3cret&x", "zk://h/x?digest=***&x"),
            // An `@` in a query value: the secrets after it are hidden too.
            (
                "pg://db:5432/app?user=alice@srv&password=s3cret&pool_size=0",
                "pg://db:***@srv&password=***&pool_size=0",
            ),
            (
                "consul://agent:85x?owner=ops@corp&token=s3cret",
                "consul://agent:***@corp&token=***",
            ),
            (
                "redis://h/0?owner=ops@corp&password=s3cret",
                "redis://h/0?owner=ops@corp&password=***",
            ),
            // And secrets before such an `@`.
            (
                "pg://db/app?password=s3cret&user=alice@srv",
                "pg://db/app?password=***&user=alice@srv",
            ),
            (
                "pg://alice@db/app?password=s3cret&x=a@b",
                "pg://alice@db/app?password=***&x=a@b",
            ),
            (
                "pg://h/db?password=s3:cret&o=a@b",
                "pg://h/db?password=***:***@b",
            ),
            ("plain-host", "plain-host"),
            (
                "app:s3cret@db",
                "(not a URL; not shown, as it may hold a secret)",
            ),
        ] {
            assert_eq!(redact_url_text(raw, &["sslpassword"]), want, "{raw}");
        }
    }

    #[test]
    fn unparsable_url_error_is_redacted() {
        let e = BackendUrl::parse("redis://bob:hunter2@[bad")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("bob:***"), "{e}");
        // An unparsable URL's secret query values must not show either.
        let e = BackendUrl::parse("zk://h1:2181,h2:bad/x?digest=alice:s3cret")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret") && e.contains("digest=***"), "{e}");
        let u = BackendUrl::parse("zk://h/x?digest=alice:s3cret").unwrap();
        assert!(!format!("{u:?} {u}").contains("s3cret"), "{u:?}");
        assert!(BackendUrl::parse("not a url").is_err());
        // Not a URL at all: a libpq keyword string is not quoted.
        let e = BackendUrl::parse("host=db user=app password=s3cret")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret") && e.contains("not shown"), "{e}");
        // User info without a scheme parses as scheme `app` and an opaque path: not shown.
        let u = BackendUrl::parse("app:s3cret@db:5432").unwrap();
        let shown = format!("{u:?} {u} {}", u.redacted());
        assert!(
            !shown.contains("s3cret") && shown.contains("not shown"),
            "{shown}"
        );
        let e = BackendUrl::parse("redis-host 6379")
            .unwrap_err()
            .to_string();
        assert!(e.contains("redis-host 6379"), "{e}");
    }

    /// A host list's port is digits only, as the first host's (`url` refuses `+2181` there),
    /// and an IPv6 address without brackets is named, with how to write it.
    #[test]
    fn host_list_ports_are_digits_and_ipv6_needs_brackets() {
        assert!(HostPort::parse("h:+80", None).is_err());
        assert!(HostPort::parse("h:80", None).is_ok());
        assert!(BackendUrl::parse("zk://h1:2181,h2:+2181/x").is_err());
        let e = HostPort::parse("::1", Some(1)).unwrap_err();
        assert!(e.contains("::1") && e.contains("brackets"), "{e}");
        assert!(HostPort::parse("[::1]:2181", None).is_ok());
    }

    /// A URL that does not parse shows no user name given alone (a Consul token passed as
    /// `consul://<token>@host`) and no query value (no backend's option names are known yet, and
    /// a misspelt `passwd=` may hold a password), as a parsed one's redaction hides them.
    /// Before, both were shown.
    #[test]
    fn an_unparsable_urls_lone_user_and_query_values_are_hidden() {
        for (raw, secret, shown) in [
            (
                "consul://0b2f5a3e-tok@127.0.0.1:99999",
                "0b2f5a3e",
                "consul://***@127.0.0.1:99999",
            ),
            (
                "redis://h:99999?passwd=hunter2&db=1",
                "hunter2",
                "redis://h:99999?passwd=***&db=***",
            ),
            (
                "zk://h1,h2:bad/x?authx=alice:s3cret",
                "s3cret",
                "zk://h1,h2:bad/x?authx=***",
            ),
        ] {
            let e = BackendUrl::parse(raw).unwrap_err().to_string();
            assert!(!e.contains(secret), "{raw}: {e}");
            assert!(e.contains(shown), "{raw}: {e}");
        }
        // The same URLs, parsed, hide the same (the lone user) or the values of secret and
        // unknown names when an adapter reads them.
        let u = BackendUrl::parse("consul://0b2f5a3e-tok@127.0.0.1:8500").unwrap();
        assert!(!u.to_string().contains("0b2f5a3e"), "{u}");
    }

    #[tokio::test]
    async fn unknown_scheme_is_invalid_input_naming_it() {
        let r = Registry::new();
        let e = r.connect("nosuch://x:pw@h").await.unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, crate::Error::InvalidInput(_)), "{s}");
        assert!(
            s.contains("\"nosuch\"") && s.contains("memory") && !s.contains("pw@"),
            "{s}"
        );
        let c = r.connect("memory://").await.unwrap();
        assert_eq!(c.capabilities().backend, "memory");
        assert!(r.connect_fence("memory://").await.is_ok());
    }
}
