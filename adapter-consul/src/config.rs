//! [`ConsulConfig`]: where the Consul agent is and how the adapter uses it, parsed from a URL.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lease_core::adapter::{
    server_name, BackendUrl, CommonOptions, OptionSpec, Secret, TlsFiles, UrlOptions,
};
use lease_core::{InvalidInput, LockKey, Result};

use crate::keys;

/// The default first segment of every KV key the adapter writes.
pub const DEFAULT_KEY_PREFIX: &str = "fenced";
/// Consul's default smallest session TTL (`session_ttl_min`), and the adapter's default session
/// TTL and minimum lease TTL.
pub const CONSUL_SESSION_TTL_MIN: Duration = Duration::from_secs(10);
/// Consul's largest session TTL (`SessionTTLMax`).
pub const CONSUL_SESSION_TTL_MAX: Duration = Duration::from_secs(24 * 3600);
/// Consul's largest lock-delay (`MaxLockDelay`); longer values are clamped by the server.
pub const CONSUL_MAX_LOCK_DELAY: Duration = Duration::from_secs(60);
/// The default session lock-delay. After a session is invalidated out of band (destroyed by an
/// operator, its node deregistered), Consul refuses its keys to every other session for this
/// long. It gives the old holders' monitors a head start, not a guarantee: a monitor's query
/// answers within a round trip of the change when it is parked, but a busy prefix spaces its
/// queries up to 2 s apart, a failing one backs off, and a holder cut off from its agent only
/// puts its leases in doubt. The fencing token, not this delay, keeps a late holder's writes
/// out (Consul's own default of 15 s serves locks without fencing tokens, which must cover a
/// whole pause).
pub const DEFAULT_LOCK_DELAY: Duration = Duration::from_secs(1);
/// The default bound on one request's answer (blocking queries add their wait to it).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The default bound on opening a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The default longest single blocking query of a waiting `acquire` (it re-arms until its wait
/// bound passes).
pub const DEFAULT_MAX_BLOCK: Duration = Duration::from_secs(30);
/// The longest key prefix, in bytes.
pub const MAX_KEY_PREFIX_BYTES: usize = 64;

/// The URL options the adapter understands besides lease-core's common ones
/// ([`COMMON_OPTIONS`](lease_core::adapter::COMMON_OPTIONS)); every other one is rejected.
const OPTIONS: OptionSpec = OptionSpec {
    backend: &[
        "token",
        "token_file",
        "session_ttl_ms",
        "lock_delay_ms",
        "max_block_ms",
        "tls_ca_file",
        "tls_ca_path",
        "tls_cert_file",
        "tls_key_file",
        "tls_server_name",
        "dc",
    ],
    secret: &["token"],
    key_prefix: validate_prefix,
};
/// The environment variables the adapter reads, as HashiCorp's clients (the `consul` CLI and the
/// Go `api` package) do, for every setting the URL leaves out (see [`ConsulConfig`]).
pub const ENV_VARS: &[&str] = &[
    "CONSUL_HTTP_ADDR",
    "CONSUL_HTTP_SSL",
    "CONSUL_HTTP_TOKEN",
    "CONSUL_HTTP_TOKEN_FILE",
    "CONSUL_CACERT",
    "CONSUL_CAPATH",
    "CONSUL_CLIENT_CERT",
    "CONSUL_CLIENT_KEY",
    "CONSUL_TLS_SERVER_NAME",
];

/// How to reach a Consul agent and how the adapter uses it.
///
/// Parsed from a URL and the `CONSUL_*` environment ([`ConsulConfig::from_url`]; with an
/// injected environment, [`ConsulConfig::from_url_with_env`]):
///
/// ```text
/// consul://host[:port][?option=value&...]     HTTP, port 8500 by default
/// consuls://host[:port][?option=value&...]    HTTPS, port 8501 by default; the server
///                                             certificate is checked against the system roots,
///                                             or against tls_ca_file / tls_ca_path
/// consul://[?option=value&...]                the agent of CONSUL_HTTP_ADDR (127.0.0.1:8500 by
///                                             default), HTTPS if CONSUL_HTTP_ADDR says https://
///                                             or CONSUL_HTTP_SSL is true
/// consuls://[?option=value&...]               the same, always HTTPS
/// ```
///
/// `http://` and `https://` (the form of `CONSUL_HTTP_ADDR`) are accepted here as synonyms of
/// `consul://` and `consuls://`; the `fenced` registry only routes the `consul` schemes.
///
/// | option | default | meaning |
/// |---|---|---|
/// | `token` | `CONSUL_HTTP_TOKEN_FILE`'s contents, else `CONSUL_HTTP_TOKEN` | ACL token, sent as `X-Consul-Token` (never shown: redacted in every `Debug`, `Display` and error) |
/// | `token_file` | | file holding the ACL token (surrounding whitespace trimmed); not with `token` |
/// | `key_prefix` | `fenced` | first part of every KV key; `/`-separated segments of `A-Z a-z 0-9 - _`, at most 64 bytes |
/// | `session_ttl_ms` | `10000` | TTL of this client's Consul session, and the smallest lease TTL accepted (see the crate docs). Consul refuses TTLs below its `session_ttl_min` (10 s unless the server is configured otherwise) |
/// | `lock_delay_ms` | `1000` | the session's lock-delay: after the session is invalidated out of band, nobody takes its keys for this long, so its holders (whose monitors see the change within a round trip) stop first (Consul's default is 15 s; at most 60 s) |
/// | `token_floor` | none | every token issued is above this value (raise it after a snapshot restore) |
/// | `request_timeout_ms` | `2000` | bound on each request's answer |
/// | `connect_timeout_ms` | `2000` | bound on opening a connection |
/// | `owner` | this process's `host/pid` | the owner label leases carry unless their options name another |
/// | `max_block_ms` | `30000` | longest single blocking query while waiting for a key |
/// | `tls_ca_file` | `CONSUL_CACERT` | PEM file of the CA(s) that signed the server certificate (instead of the system roots) |
/// | `tls_ca_path` | `CONSUL_CAPATH` | directory of PEM CA files (used when no CA file is given) |
/// | `tls_cert_file`, `tls_key_file` | `CONSUL_CLIENT_CERT`, `CONSUL_CLIENT_KEY` | PEM client certificate (chain) and its private key, for agents with `verify_incoming` (mTLS); both or neither. The key is never shown |
/// | `tls_server_name` | `CONSUL_TLS_SERVER_NAME` | the name the server certificate is checked against and sent as SNI (default: the host); a `:port` is dropped, as HashiCorp's clients do |
/// | `dc` | the agent's | datacenter for every request |
///
/// The `tls_*` options need TLS (`consuls://`, or a host-less URL whose environment says
/// HTTPS); the `tls_*` environment variables are ignored for plain HTTP, as the official
/// clients ignore them.
///
/// # The environment
///
/// **The URL always wins; the environment fills what the URL leaves out**, read as HashiCorp's
/// clients read it (empty variables count as unset):
///
/// - `CONSUL_HTTP_ADDR` (`host[:port]`, `http://host[:port]` or `https://host[:port]`) names the
///   agent only when the URL has no host. Its scheme, if any, decides HTTP or HTTPS; without one
///   `CONSUL_HTTP_SSL` (`true`/`false`, Go's `ParseBool` spellings) does. A port it leaves out
///   is the scheme's (80 or 443), as with the official clients. `consuls://` without a host always
///   uses HTTPS. A URL with a host ignores both variables: its scheme says HTTP or HTTPS.
/// - `CONSUL_HTTP_TOKEN_FILE`, else `CONSUL_HTTP_TOKEN`, when the URL has neither `token` nor
///   `token_file` (the CLI also prefers the token file).
/// - `CONSUL_CACERT` (else `CONSUL_CAPATH`) when the URL has neither `tls_ca_file` nor
///   `tls_ca_path`; `CONSUL_CLIENT_CERT` and `CONSUL_CLIENT_KEY` (both or neither) when the URL
///   has no `tls_cert_file`/`tls_key_file`; `CONSUL_TLS_SERVER_NAME` when the URL has no
///   `tls_server_name`.
///
/// `CONSUL_HTTP_SSL_VERIFY=false` (skip certificate verification) is deliberately not honoured:
/// give the CA instead. A `unix://` agent address is refused (`InvalidInput`), as is a
/// `CONSUL_HTTP_SSL` that is not a boolean (the Go client would only log a warning and use HTTP).
#[derive(Clone, Debug)]
pub struct ConsulConfig {
    url: BackendUrl,
    host: String,
    port: u16,
    tls: bool,
    token: Option<Secret>,
    token_file: Option<PathBuf>,
    common: CommonOptions,
    session_ttl: Duration,
    lock_delay: Duration,
    max_block: Duration,
    tls_files: TlsFiles,
    tls_ca_path: Option<PathBuf>,
    datacenter: Option<String>,
    /// The environment variables that supplied a setting (names only).
    from_env: Vec<&'static str>,
}

lease_core::common_config!(ConsulConfig {
    common: common,
    key_prefix: (OPTIONS.key_prefix, DEFAULT_KEY_PREFIX),
    request_timeout: |_| DEFAULT_REQUEST_TIMEOUT,
    connect_timeout: |_| DEFAULT_CONNECT_TIMEOUT,
});

impl fmt::Display for ConsulConfig {
    /// The URL, token redacted; when the environment supplied settings, the agent address and
    /// the names of those variables (never their values).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.url, f)?;
        if !self.from_env.is_empty() {
            write!(
                f,
                " (agent {}; from the environment: {})",
                self.base_url(),
                self.from_env.join(", ")
            )?;
        }
        Ok(())
    }
}

/// Brackets an IPv6 literal for a URL authority.
fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_owned()
    }
}

/// Go's `strconv.ParseBool`, which the official clients use for `CONSUL_HTTP_SSL`.
fn parse_go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

fn env_invalid(field: &'static str, value: &str, expected: &'static str) -> lease_core::Error {
    InvalidInput::OutOfRange {
        field,
        value: value.chars().take(200).collect(),
        expected,
    }
    .into()
}

/// Parses `CONSUL_HTTP_ADDR` as the Go client does: an optional `http://`/`https://` scheme
/// (which decides TLS), then `host[:port]`, the port defaulting to the scheme's (80/443).
/// Returns `(host, port, tls)`; `ssl` is `CONSUL_HTTP_SSL`, used when the address has no scheme.
fn parse_env_addr(value: &str, ssl: bool) -> Result<(String, u16, bool)> {
    const FIELD: &str = "CONSUL_HTTP_ADDR";
    const EXPECTED: &str = "host[:port], http://host[:port] or https://host[:port]";
    // Errors show the value without a `user:password@` part (refused below, never shown).
    let shown = without_userinfo(value);
    let (tls, rest) = match value.split_once("://") {
        Some(("http", rest)) => (false, rest),
        Some(("https", rest)) => (true, rest),
        Some(("unix", _)) => {
            return Err(env_invalid(
                FIELD,
                &shown,
                "a TCP address: unix:// sockets are not supported by this adapter",
            ))
        }
        Some(_) => return Err(env_invalid(FIELD, &shown, EXPECTED)),
        None => (ssl, value),
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() || rest.contains(['/', '?', '#', '@']) {
        return Err(env_invalid(FIELD, &shown, EXPECTED));
    }
    let scheme = if tls { "https" } else { "http" };
    let parsed = url::Url::parse(&format!("{scheme}://{rest}"))
        .map_err(|_| env_invalid(FIELD, &shown, EXPECTED))?;
    let host = parsed
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| env_invalid(FIELD, &shown, EXPECTED))?
        .to_owned();
    let port = parsed
        .port_or_known_default()
        .ok_or_else(|| env_invalid(FIELD, &shown, EXPECTED))?;
    Ok((host, port, tls))
}

/// `value` with a `user:password@` part before its host replaced by `***@`.
fn without_userinfo(value: &str) -> String {
    let (scheme, rest) = value.split_once("://").unwrap_or(("", value));
    match rest.rfind('@') {
        Some(at) if scheme.is_empty() => format!("***@{}", &rest[at + 1..]),
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => value.to_owned(),
    }
}

/// Reads an ACL token file (surrounding whitespace trimmed). Errors name the file, never its
/// contents.
fn read_token_file(path: &Path, from: &str) -> Result<String> {
    let misconfigured = |problem: String| {
        lease_core::Error::misconfigured(
            crate::BACKEND,
            format!("{from} {}: {problem}", path.display()),
        )
    };
    let raw = std::fs::read(path).map_err(|e| misconfigured(format!("cannot be read: {e}")))?;
    let token = String::from_utf8(raw)
        .map_err(|_| misconfigured("does not hold a UTF-8 token".into()))?
        .trim()
        .to_owned();
    if token.is_empty() || token.chars().any(char::is_control) {
        return Err(misconfigured(
            "does not hold a token (empty, or control characters inside)".into(),
        ));
    }
    Ok(token)
}

/// The process environment, as [`ConsulConfig::from_url`] reads it.
fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl ConsulConfig {
    /// Parses `url` (`consul://` or `consuls://`, options as query parameters; see the type
    /// docs), filling what it leaves out from the process's `CONSUL_*` environment variables.
    ///
    /// Errors are `Error::InvalidInput` naming the offending value (or variable), with the token
    /// redacted; `Error::Misconfigured` for a token file that cannot be read. Nothing is sent.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_url_with_env(url, process_env)
    }

    /// Like [`ConsulConfig::from_url`], reading the environment through `env` (a variable's
    /// name to its value, `None` when unset) instead of the process environment: tests and
    /// embedders inject one; `|_| None` ignores the environment.
    pub fn from_url_with_env(url: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::from_backend_url_with_env(BackendUrl::parse(url)?, env)
    }

    /// Like [`ConsulConfig::from_url`], for an already parsed URL (as the registry hands it over).
    pub fn from_backend_url(url: BackendUrl) -> Result<Self> {
        Self::from_backend_url_with_env(url, process_env)
    }

    /// Like [`ConsulConfig::from_url_with_env`], for an already parsed URL.
    pub fn from_backend_url_with_env(
        url: BackendUrl,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        // Empty variables count as unset, as in HashiCorp's clients.
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let raw = url.expose();
        let scheme_tls = match raw.scheme() {
            "consul" | "http" => false,
            "consuls" | "https" => true,
            other => {
                return Err(url
                    .invalid(format!(
                        "scheme {other:?} is not a Consul scheme (use consul:// or consuls://)"
                    ))
                    .into())
            }
        };
        if !raw.username().is_empty() || raw.password().is_some() {
            return Err(url
                .invalid("user information is not used by Consul; pass the ACL token as ?token=")
                .into());
        }
        if !matches!(raw.path(), "" | "/") {
            return Err(url
                .invalid(format!(
                    "the path {:?} means nothing to Consul (use key_prefix=...)",
                    raw.path()
                ))
                .into());
        }
        if url.hosts().len() > 1 {
            return Err(url
                .invalid(
                    "a host list is not supported: a Consul client talks to one agent (its \
                     local agent, or a load balancer in front of the servers)",
                )
                .into());
        }
        let mut from_env: Vec<&'static str> = Vec::new();
        let (host, port, tls) = match raw.host_str().filter(|h| !h.is_empty()) {
            Some(h) => {
                // The URL parser hides a port equal to its scheme's usual one (`http://h:80`):
                // a port written in the URL is read from it as given.
                let port = raw
                    .port()
                    .or_else(|| written_port(url.expose_str()))
                    .unwrap_or(if scheme_tls { 8501 } else { 8500 });
                if port == 0 {
                    return Err(url.invalid("port 0 is not a port to connect to").into());
                }
                (h.to_owned(), port, scheme_tls)
            }
            None => {
                if raw.port().is_some() {
                    return Err(url.invalid("a port without a host").into());
                }
                let ssl = match env("CONSUL_HTTP_SSL") {
                    Some(v) => {
                        let b = parse_go_bool(v.trim()).ok_or_else(|| {
                            env_invalid("CONSUL_HTTP_SSL", &v, "true or false (or 1/0, t/f)")
                        })?;
                        from_env.push("CONSUL_HTTP_SSL");
                        b
                    }
                    None => false,
                };
                let (host, port, tls) = match env("CONSUL_HTTP_ADDR") {
                    Some(addr) => {
                        from_env.push("CONSUL_HTTP_ADDR");
                        parse_env_addr(addr.trim(), ssl)?
                    }
                    // The official clients' default agent address.
                    None => ("127.0.0.1".to_owned(), 8500, ssl),
                };
                // `consuls://` without a host: the URL asks for TLS whatever the environment says.
                (host, port, tls || scheme_tls)
            }
        };
        let (common, mut o) = UrlOptions::parse(&url, OPTIONS)?;
        let millis = |o: &mut UrlOptions<'_>, name, lo, hi| {
            o.millis(name, Duration::from_millis(lo), Duration::from_millis(hi))
        };
        let token = o.value(
            "token",
            "a non-empty token without control characters",
            |v| {
                if v.is_empty() || v.chars().any(|ch| ch.is_control()) {
                    Err("a non-empty token without control characters")
                } else {
                    Ok(Secret::new(v))
                }
            },
        )?;
        let token_file = o.path("token_file")?;
        let session_ttl = millis(&mut o, "session_ttl_ms", 100, 86_400_000)?;
        let lock_delay = millis(&mut o, "lock_delay_ms", 0, 60_000)?;
        let max_block = millis(&mut o, "max_block_ms", 1_000, 600_000)?;
        let tls_files = TlsFiles::take(&mut o, tls, "a consuls:// URL")?;
        let tls_ca_path = o.path("tls_ca_path")?;
        if tls_ca_path.is_some() && !tls {
            return Err(o
                .invalid("tls_ca_path needs a consuls:// URL (TLS options need TLS)")
                .into());
        }
        let datacenter = o.value("dc", "a datacenter name of A-Z a-z 0-9 - _ .", |v| {
            let ok = !v.is_empty()
                && v.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch));
            if ok {
                Ok(v.to_owned())
            } else {
                Err("a datacenter name of A-Z a-z 0-9 - _ .")
            }
        })?;
        let mut c = ConsulConfig {
            url: url.clone(),
            host,
            port,
            tls,
            token,
            token_file,
            common,
            session_ttl: session_ttl.unwrap_or(CONSUL_SESSION_TTL_MIN),
            lock_delay: lock_delay.unwrap_or(DEFAULT_LOCK_DELAY),
            max_block: max_block.unwrap_or(DEFAULT_MAX_BLOCK),
            tls_files,
            tls_ca_path,
            datacenter,
            from_env: Vec::new(),
        };
        if c.token.is_some() && c.token_file.is_some() {
            return Err(url
                .invalid("give the ACL token as token or token_file, not both")
                .into());
        }
        if c.tls_files.ca_file.is_some() && c.tls_ca_path.is_some() {
            return Err(url
                .invalid("give the CA as tls_ca_file or tls_ca_path, not both")
                .into());
        }
        // The ACL token: the URL's, else the environment's (the token file first, as the CLI).
        if let Some(file) = c.token_file.clone() {
            c.token = Some(Secret::new(read_token_file(&file, "token_file")?));
        } else if c.token.is_none() {
            if let Some(file) = env("CONSUL_HTTP_TOKEN_FILE") {
                let file = PathBuf::from(file);
                c.token = Some(Secret::new(read_token_file(
                    &file,
                    "CONSUL_HTTP_TOKEN_FILE",
                )?));
                c.token_file = Some(file);
                from_env.push("CONSUL_HTTP_TOKEN_FILE");
            } else if let Some(t) = env("CONSUL_HTTP_TOKEN") {
                let t = t.trim().to_owned();
                if t.chars().any(char::is_control) {
                    return Err(env_invalid(
                        "CONSUL_HTTP_TOKEN",
                        "***",
                        "a token without control characters",
                    ));
                }
                if !t.is_empty() {
                    c.token = Some(Secret::new(t));
                    from_env.push("CONSUL_HTTP_TOKEN");
                }
            }
        }
        // TLS files: only for HTTPS, each setting the URL leaves out.
        if c.tls {
            if c.tls_files.ca_file.is_none() && c.tls_ca_path.is_none() {
                if let Some(f) = env("CONSUL_CACERT") {
                    c.tls_files.ca_file = Some(PathBuf::from(f));
                    from_env.push("CONSUL_CACERT");
                } else if let Some(p) = env("CONSUL_CAPATH") {
                    c.tls_ca_path = Some(PathBuf::from(p));
                    from_env.push("CONSUL_CAPATH");
                }
            }
            if c.tls_files.client.is_none() {
                match (env("CONSUL_CLIENT_CERT"), env("CONSUL_CLIENT_KEY")) {
                    (Some(cert), Some(key)) => {
                        c.tls_files.client = Some((PathBuf::from(cert), PathBuf::from(key)));
                        from_env.extend(["CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY"]);
                    }
                    (None, None) => {}
                    (Some(_), None) => {
                        return Err(env_invalid(
                            "CONSUL_CLIENT_KEY",
                            "",
                            "the client key file that goes with CONSUL_CLIENT_CERT",
                        ))
                    }
                    (None, Some(_)) => {
                        return Err(env_invalid(
                            "CONSUL_CLIENT_CERT",
                            "",
                            "the client certificate file that goes with CONSUL_CLIENT_KEY",
                        ))
                    }
                }
            }
            if c.tls_files.server_name.is_none() {
                if let Some(n) = env("CONSUL_TLS_SERVER_NAME") {
                    let name = server_name(n.trim())
                        .map_err(|expected| env_invalid("CONSUL_TLS_SERVER_NAME", &n, expected))?;
                    c.tls_files.server_name = Some(name);
                    from_env.push("CONSUL_TLS_SERVER_NAME");
                }
            }
        }
        c.from_env = from_env;
        Ok(c)
    }

    /// Sets the ACL token (instead of, or overriding, the URL's `token`). It is sent as
    /// `X-Consul-Token` and never shown.
    ///
    /// # Errors
    /// `InvalidInput` for an empty token or one with control characters.
    pub fn with_token(mut self, token: impl Into<String>) -> Result<Self> {
        let token = token.into();
        if token.is_empty() || token.chars().any(char::is_control) {
            return Err(InvalidInput::OutOfRange {
                field: "token",
                value: "***".into(),
                expected: "a non-empty token without control characters",
            }
            .into());
        }
        self.token = Some(Secret::new(token));
        self.token_file = None;
        self.from_env
            .retain(|v| !matches!(*v, "CONSUL_HTTP_TOKEN" | "CONSUL_HTTP_TOKEN_FILE"));
        Ok(self)
    }

    /// The URL as given, token redacted.
    pub fn url(&self) -> &BackendUrl {
        &self.url
    }

    /// Whether requests use HTTPS (`consuls://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// `http(s)://host:port`, where requests go (from the URL, or the environment when the URL
    /// names no host).
    pub fn base_url(&self) -> String {
        format!(
            "{}://{}:{}",
            if self.tls { "https" } else { "http" },
            bracket(&self.host),
            self.port
        )
    }

    /// The agent's host (an IPv6 literal in brackets or not, as written).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The agent's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The names of the environment variables that supplied a setting (never their values).
    pub fn from_env(&self) -> &[&'static str] {
        &self.from_env
    }

    /// The scope of this client's token watermark: the agent's address, the datacenter (empty
    /// for the agent's own) and the key prefix. Each datacenter has its own Raft index, and two
    /// key prefixes are two lock namespaces, so their tokens are not comparable.
    pub(crate) fn token_scope(&self) -> String {
        format!(
            "{} dc={} prefix={}",
            self.base_url(),
            self.datacenter().unwrap_or(""),
            self.key_prefix()
        )
    }

    /// Whether an ACL token is configured.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_ref().map(Secret::expose)
    }

    /// The session TTL, which is also the smallest lease TTL accepted.
    pub fn session_ttl(&self) -> Duration {
        self.session_ttl
    }

    /// The session's lock-delay.
    pub fn lock_delay(&self) -> Duration {
        self.lock_delay
    }

    /// The longest single blocking query.
    pub fn max_block(&self) -> Duration {
        self.max_block
    }

    /// The CA file for `consuls://`, if set (`tls_ca_file` or `CONSUL_CACERT`).
    pub fn tls_ca_file(&self) -> Option<&Path> {
        self.tls_files.ca_file.as_deref()
    }

    /// The directory of CA files, if set (`tls_ca_path` or `CONSUL_CAPATH`).
    pub fn tls_ca_path(&self) -> Option<&Path> {
        self.tls_ca_path.as_deref()
    }

    /// The client certificate file for mTLS, if set (`tls_cert_file` or `CONSUL_CLIENT_CERT`).
    pub fn tls_cert_file(&self) -> Option<&Path> {
        self.tls_files
            .client
            .as_ref()
            .map(|(cert, _)| cert.as_path())
    }

    /// The client key file for mTLS, if set (`tls_key_file` or `CONSUL_CLIENT_KEY`).
    pub fn tls_key_file(&self) -> Option<&Path> {
        self.tls_files.client.as_ref().map(|(_, key)| key.as_path())
    }

    /// The client certificate and key files for mTLS, if set (as [`Self::tls_cert_file`] and
    /// [`Self::tls_key_file`], together).
    pub fn tls_client_cert(&self) -> Option<(&Path, &Path)> {
        let client = self.tls_files.client.as_ref();
        client.map(|(cert, key)| (cert.as_path(), key.as_path()))
    }

    /// The name the server certificate is checked against, if not the host
    /// (`tls_server_name` or `CONSUL_TLS_SERVER_NAME`).
    pub fn tls_server_name(&self) -> Option<&str> {
        self.tls_files.server_name.as_deref()
    }

    /// The datacenter, if set.
    pub fn datacenter(&self) -> Option<&str> {
        self.datacenter.as_deref()
    }

    /// The Consul KV key holding the lock on `key`: `<prefix>/locks/<escaped key>` (see
    /// [`escape_key`](crate::escape_key)). Operators delete this key to remove a lock by hand.
    pub fn kv_key(&self, key: &LockKey) -> String {
        keys::lock_key(self.key_prefix(), key)
    }

    /// Where the forced releases of `key` are recorded: `<prefix>/forced/<escaped key>`, a JSON
    /// array of the newest 100 (read them with `Coordinator::audit_trail`).
    pub fn audit_key(&self, key: &LockKey) -> String {
        keys::audit_key(self.key_prefix(), key)
    }

    /// The prefix every lock key ([`Self::kv_key`]) starts with: what the lock monitor watches.
    pub(crate) fn locks_prefix(&self) -> String {
        keys::locks_prefix(self.key_prefix())
    }

    /// The marker that cancels an acquire attempt whose outcome was not seen (see the crate docs).
    pub(crate) fn attempt_key(&self, session: &str, attempt: &str) -> String {
        keys::attempt_key(self.key_prefix(), session, attempt)
    }
}

fn validate_prefix(p: &str) -> std::result::Result<(), &'static str> {
    if p.is_empty() || p.len() > MAX_KEY_PREFIX_BYTES {
        return Err("1 to 64 bytes");
    }
    if p.split('/').any(|s| {
        s.is_empty()
            || !s
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    }) {
        return Err("'/'-separated non-empty segments of A-Z a-z 0-9 - _");
    }
    Ok(())
}

/// The port written in `raw`'s authority (after any user info; an IPv6 address in brackets),
/// if there is one.
fn written_port(raw: &str) -> Option<u16> {
    let rest = &raw[raw.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let after_host = match host.strip_prefix('[') {
        Some(v6) => &v6[v6.find(']')? + 1..],
        None => host,
    };
    after_host.rsplit_once(':')?.1.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::Token;

    /// Parses without any environment.
    fn parse(url: &str) -> Result<ConsulConfig> {
        ConsulConfig::from_url_with_env(url, |_| None)
    }

    #[test]
    fn parses_defaults_and_options() {
        let c = parse("consul://127.0.0.1").unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:8500");
        assert_eq!(c.session_ttl(), CONSUL_SESSION_TTL_MIN);
        assert_eq!(c.lock_delay(), Duration::from_secs(1));
        let c = parse(
            "consuls://consul.example:9501?token=s3cret&key_prefix=app/locks-1&session_ttl_ms=1000&lock_delay_ms=250&token_floor=7&dc=dc2",
        )
        .unwrap();
        assert_eq!(c.base_url(), "https://consul.example:9501");
        assert_eq!(c.token(), Some("s3cret"));
        assert_eq!(c.key_prefix(), "app/locks-1");
        assert_eq!(c.session_ttl(), Duration::from_secs(1));
        assert_eq!(c.token_floor(), Some(Token::new(7).unwrap()));
        let h = parse("https://10.0.0.1").unwrap();
        assert!(h.tls());
        assert_eq!(h.base_url(), "https://10.0.0.1:8501");
        // A written port is used even when it is the scheme's usual one.
        assert_eq!(parse("http://h:80").unwrap().base_url(), "http://h:80");
        assert_eq!(parse("https://h:443").unwrap().base_url(), "https://h:443");
        assert_eq!(written_port("http://[::1]:80/"), Some(80));
        assert_eq!(written_port("http://[::1]/"), None);
        assert_eq!(written_port("http://u:p:w@h:81?x=y:1"), Some(81));
        assert_eq!(written_port("http://h?x=y:1"), None);
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    /// Each datacenter has its own Raft index and two key prefixes are two lock namespaces: a
    /// token watermark shared between them fails closed on tokens that never went backwards.
    #[test]
    fn the_token_watermark_is_scoped_by_agent_datacenter_and_prefix() {
        let scope = |u: &str| parse(u).unwrap().token_scope();
        let base = scope("consul://127.0.0.1:8500?dc=dc1&key_prefix=a");
        assert_ne!(base, scope("consul://127.0.0.1:8500?dc=dc2&key_prefix=a"));
        assert_ne!(base, scope("consul://127.0.0.1:8500?key_prefix=a"));
        assert_ne!(base, scope("consul://127.0.0.1:8500?dc=dc1&key_prefix=b"));
        assert_ne!(base, scope("consul://127.0.0.2:8500?dc=dc1&key_prefix=a"));
        assert_eq!(base, scope("consul://127.0.0.1:8500?key_prefix=a&dc=dc1"));
        assert!(!scope("consul://h?token=s3cret").contains("s3cret"));
    }

    #[test]
    fn rejects_bad_urls_naming_the_value_without_the_token() {
        for (url, needle) in [
            ("redis://h", "not a Consul scheme"),
            ("consul://h?nope=1", "unknown option"),
            ("consul://h?session_ttl_ms=5", "session_ttl_ms"),
            ("consul://h?key_prefix=a.b", "key_prefix"),
            ("consul://h?key_prefix=/a", "key_prefix"),
            ("consul://h/path", "path"),
            ("consul://h1:8500,h2:8500", "host list"),
            ("consul://h?tls_ca_file=/x", "consuls://"),
            ("consul://u:pw@h", "user information"),
            ("consul://h?token=a&token=b", "twice"),
            ("consul://h:0", "port 0"),
        ] {
            let e = parse(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
            assert!(!e.contains("pw@"), "{e}");
        }
        let e = parse("consul://h?token=%00secret").unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
    }
}

#[cfg(test)]
mod env_tests {
    use super::*;
    use std::collections::HashMap;

    fn with_env(url: &str, vars: &[(&str, &str)]) -> Result<ConsulConfig> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        ConsulConfig::from_url_with_env(url, move |k| env.get(k).cloned())
    }

    #[test]
    fn a_host_less_url_takes_the_agent_from_consul_http_addr() {
        let c = with_env("consul://", &[]).unwrap();
        assert_eq!(
            c.base_url(),
            "http://127.0.0.1:8500",
            "the official default"
        );
        for (addr, ssl, want) in [
            ("10.1.2.3:8500", "", "http://10.1.2.3:8500"),
            ("10.1.2.3:8501", "true", "https://10.1.2.3:8501"),
            (
                "https://consul.example:8501",
                "",
                "https://consul.example:8501",
            ),
            ("https://consul.example", "", "https://consul.example:443"),
            ("http://consul.example/", "", "http://consul.example:80"),
            // The address's own scheme wins over CONSUL_HTTP_SSL, as in the Go client.
            (
                "http://consul.example:8500",
                "1",
                "http://consul.example:8500",
            ),
            ("[::1]:8500", "", "http://[::1]:8500"),
        ] {
            let c = with_env(
                "consul://?key_prefix=p",
                &[("CONSUL_HTTP_ADDR", addr), ("CONSUL_HTTP_SSL", ssl)],
            )
            .unwrap();
            assert_eq!(c.base_url(), want, "{addr} ssl={ssl:?}");
            assert_eq!(c.tls(), want.starts_with("https"));
            assert!(c.from_env().contains(&"CONSUL_HTTP_ADDR"));
        }
        let c = with_env("consul://", &[("CONSUL_HTTP_SSL", "true")]).unwrap();
        assert_eq!(c.base_url(), "https://127.0.0.1:8500");
        // consuls:// without a host is always TLS.
        let c = with_env("consuls://", &[("CONSUL_HTTP_ADDR", "http://h:1")]).unwrap();
        assert_eq!(c.base_url(), "https://h:1");
    }

    #[test]
    fn the_url_always_wins_over_the_environment() {
        let env = [
            ("CONSUL_HTTP_ADDR", "https://other:9999"),
            ("CONSUL_HTTP_SSL", "true"),
            ("CONSUL_HTTP_TOKEN", "env-token"),
            ("CONSUL_CACERT", "/env/ca.pem"),
            ("CONSUL_CLIENT_CERT", "/env/cert.pem"),
            ("CONSUL_CLIENT_KEY", "/env/key.pem"),
            ("CONSUL_TLS_SERVER_NAME", "env.example"),
        ];
        let c = with_env("consul://h:8500?token=url-token", &env).unwrap();
        assert_eq!(c.base_url(), "http://h:8500");
        assert_eq!(c.token(), Some("url-token"));
        assert_eq!(c.tls_ca_file(), None, "TLS variables mean nothing to HTTP");
        assert!(c.from_env().is_empty(), "{:?}", c.from_env());
        let c = with_env(
            "consuls://h?tls_ca_path=/url/cas&tls_cert_file=/url/c.pem&tls_key_file=/url/k.pem&tls_server_name=url.example",
            &env,
        )
        .unwrap();
        assert_eq!(c.base_url(), "https://h:8501");
        assert_eq!(c.token(), Some("env-token"), "the env fills the token");
        assert_eq!(
            c.tls_ca_file(),
            None,
            "the URL's CA path excludes CONSUL_CACERT"
        );
        assert_eq!(c.tls_ca_path(), Some(Path::new("/url/cas")));
        assert_eq!(c.tls_cert_file(), Some(Path::new("/url/c.pem")));
        assert_eq!(
            c.tls_client_cert(),
            Some((Path::new("/url/c.pem"), Path::new("/url/k.pem")))
        );
        assert_eq!(c.tls_key_file(), Some(Path::new("/url/k.pem")));
        assert_eq!(c.tls_server_name(), Some("url.example"));
        // And what the URL leaves out comes from the environment.
        let c = with_env("consuls://h", &env).unwrap();
        assert_eq!(c.tls_ca_file(), Some(Path::new("/env/ca.pem")));
        assert_eq!(c.tls_cert_file(), Some(Path::new("/env/cert.pem")));
        assert_eq!(c.tls_key_file(), Some(Path::new("/env/key.pem")));
        assert_eq!(c.tls_server_name(), Some("env.example"));
        let c = with_env("consuls://h", &[("CONSUL_CAPATH", "/env/cas")]).unwrap();
        assert_eq!(c.tls_ca_path(), Some(Path::new("/env/cas")));
        let c = with_env(
            "consuls://h",
            &[("CONSUL_CACERT", "/f.pem"), ("CONSUL_CAPATH", "/d")],
        )
        .unwrap();
        assert_eq!(
            c.tls_ca_file(),
            Some(Path::new("/f.pem")),
            "CACERT first, as in Go"
        );
        assert_eq!(c.tls_ca_path(), None);
        let c = with_env(
            "consuls://h",
            &[("CONSUL_TLS_SERVER_NAME", "srv.example:8501")],
        )
        .unwrap();
        assert_eq!(
            c.tls_server_name(),
            Some("srv.example"),
            "the port is dropped"
        );
    }

    #[test]
    fn tokens_come_from_the_token_file_first_then_the_variable() {
        let dir = std::env::temp_dir().join(format!("consul-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("token");
        std::fs::write(&file, "  file-s3cret\n").unwrap();
        let f = file.to_str().unwrap();
        let c = with_env(
            "consul://h",
            &[
                ("CONSUL_HTTP_TOKEN", "var-s3cret"),
                ("CONSUL_HTTP_TOKEN_FILE", f),
            ],
        )
        .unwrap();
        assert_eq!(c.token(), Some("file-s3cret"));
        let c = with_env("consul://h", &[("CONSUL_HTTP_TOKEN", "var-s3cret")]).unwrap();
        assert_eq!(c.token(), Some("var-s3cret"));
        let c = with_env(&format!("consul://h?token_file={f}"), &[]).unwrap();
        assert_eq!(c.token(), Some("file-s3cret"));
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
        let c = with_env(
            "consul://h",
            &[
                ("CONSUL_HTTP_TOKEN", "var-s3cret"),
                ("CONSUL_HTTP_ADDR", "x:1"),
            ],
        )
        .unwrap();
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
        let c = with_env("consul://", &[("CONSUL_HTTP_TOKEN", "var-s3cret")]).unwrap();
        let shown = c.to_string();
        assert!(
            shown.contains("CONSUL_HTTP_TOKEN") && !shown.contains("s3cret"),
            "{shown}"
        );
        let e = with_env(
            "consul://h",
            &[("CONSUL_HTTP_TOKEN_FILE", "/nonexistent/token")],
        )
        .unwrap_err();
        assert!(matches!(e, lease_core::Error::Misconfigured { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/token"), "{e}");
        std::fs::write(&file, "file-s3cret\u{7}").unwrap();
        let e = with_env("consul://h", &[("CONSUL_HTTP_TOKEN_FILE", f)]).unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
        let e = with_env(&format!("consul://h?token=a&token_file={f}"), &[]).unwrap_err();
        assert!(e.to_string().contains("not both"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn bad_environment_values_name_the_variable() {
        for (vars, needle) in [
            (
                &[("CONSUL_HTTP_ADDR", "unix:///var/run/consul.sock")][..],
                "unix",
            ),
            (&[("CONSUL_HTTP_ADDR", "ftp://h")][..], "CONSUL_HTTP_ADDR"),
            (&[("CONSUL_HTTP_ADDR", "h:8500/v1")][..], "CONSUL_HTTP_ADDR"),
            (
                &[("CONSUL_HTTP_ADDR", "h:notaport")][..],
                "CONSUL_HTTP_ADDR",
            ),
            (&[("CONSUL_HTTP_SSL", "yes")][..], "CONSUL_HTTP_SSL"),
        ] {
            let e = with_env("consul://", vars).unwrap_err().to_string();
            assert!(e.contains(needle), "{vars:?}: {e}");
        }
        // An address carrying credentials is refused without showing them.
        for addr in ["https://alice:s3cr3t@h:8501", "alice:s3cr3t@h"] {
            let e = with_env("consul://", &[("CONSUL_HTTP_ADDR", addr)]).unwrap_err();
            let (shown, debug) = (e.to_string(), format!("{e:?}"));
            assert!(
                shown.contains("CONSUL_HTTP_ADDR") && shown.contains("***@h"),
                "{shown}"
            );
            assert!(
                !shown.contains("s3cr3t") && !debug.contains("s3cr3t"),
                "{debug}"
            );
        }
        let e = with_env("consuls://h", &[("CONSUL_CLIENT_CERT", "/c.pem")]).unwrap_err();
        assert!(e.to_string().contains("CONSUL_CLIENT_KEY"), "{e}");
        let e = with_env("consuls://h", &[("CONSUL_CLIENT_KEY", "/k.pem")]).unwrap_err();
        assert!(e.to_string().contains("CONSUL_CLIENT_CERT"), "{e}");
        for (url, needle) in [
            ("consuls://h?tls_cert_file=/c.pem", "needs tls_key_file"),
            ("consuls://h?tls_ca_file=/a&tls_ca_path=/b", "not both"),
            ("consul://h?tls_key_file=/k", "consuls://"),
            ("consul://h?tls_server_name=x", "consuls://"),
        ] {
            let e = with_env(url, &[]).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
        }
        // A host-less consul:// URL whose environment says HTTPS accepts the TLS options.
        let c = with_env(
            "consul://?tls_ca_file=/ca.pem",
            &[("CONSUL_HTTP_ADDR", "https://h:8501")],
        )
        .unwrap();
        assert_eq!(c.tls_ca_file(), Some(Path::new("/ca.pem")));
    }
}
