//! [`ConsulConfig`]: where the Consul agent is and how the adapter uses it, parsed from a URL.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lease_core::{BackendUrl, InvalidInput, LockKey, OwnerId, Result, Token};

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
/// long; the old holders' monitors see the change within one round trip, so a second is ample
/// for them to mark their leases lost before a new holder can start (Consul's own default of
/// 15 s serves locks without fencing tokens, which must cover a whole pause).
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

/// The URL query parameters the adapter understands (every other one is rejected).
const PARAMS: &[&str] = &[
    "token",
    "key_prefix",
    "session_ttl_ms",
    "lock_delay_ms",
    "token_floor",
    "request_timeout_ms",
    "connect_timeout_ms",
    "max_block_ms",
    "tls_ca_file",
    "dc",
];

/// How to reach a Consul agent and how the adapter uses it.
///
/// Parsed from a URL ([`ConsulConfig::from_url`]):
///
/// ```text
/// consul://host[:port][?option=value&...]     HTTP, port 8500 by default
/// consuls://host[:port][?option=value&...]    HTTPS, port 8501 by default; the server
///                                             certificate is checked against the system roots,
///                                             or against `tls_ca_file`
/// ```
///
/// `http://` and `https://` (the form of `CONSUL_HTTP_ADDR`) are accepted here as synonyms of
/// `consul://` and `consuls://`; the `fenced` registry only routes the `consul` schemes.
///
/// | option | default | meaning |
/// |---|---|---|
/// | `token` | none | ACL token, sent as `X-Consul-Token` (never shown: redacted in every `Debug`, `Display` and error) |
/// | `key_prefix` | `fenced` | first part of every KV key; `/`-separated segments of `A-Z a-z 0-9 - _`, at most 64 bytes |
/// | `session_ttl_ms` | `10000` | TTL of this client's Consul session, and the smallest lease TTL accepted (see the crate docs). Consul refuses TTLs below its `session_ttl_min` (10 s unless the server is configured otherwise) |
/// | `lock_delay_ms` | `1000` | the session's lock-delay: after the session is invalidated out of band, nobody takes its keys for this long, so its holders (whose monitors see the change within a round trip) stop first (Consul's default is 15 s; at most 60 s) |
/// | `token_floor` | none | every token issued is above this value (raise it after a snapshot restore) |
/// | `request_timeout_ms` | `2000` | bound on each request's answer |
/// | `connect_timeout_ms` | `2000` | bound on opening a connection |
/// | `max_block_ms` | `30000` | longest single blocking query while waiting for a key |
/// | `tls_ca_file` | none | PEM file of the CA that signed the server certificate (`consuls://` only) |
/// | `dc` | the agent's | datacenter for every request |
#[derive(Clone)]
pub struct ConsulConfig {
    url: BackendUrl,
    tls: bool,
    token: Option<String>,
    key_prefix: String,
    session_ttl: Duration,
    lock_delay: Duration,
    token_floor: Option<Token>,
    request_timeout: Duration,
    connect_timeout: Duration,
    max_block: Duration,
    tls_ca_file: Option<PathBuf>,
    datacenter: Option<String>,
    owner: Option<OwnerId>,
}

impl fmt::Debug for ConsulConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsulConfig")
            .field("url", &self.url)
            .field("tls", &self.tls)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("key_prefix", &self.key_prefix)
            .field("session_ttl", &self.session_ttl)
            .field("lock_delay", &self.lock_delay)
            .field("token_floor", &self.token_floor)
            .field("request_timeout", &self.request_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_block", &self.max_block)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("datacenter", &self.datacenter)
            .field("owner", &self.owner)
            .finish()
    }
}

impl fmt::Display for ConsulConfig {
    /// The URL, token redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.url, f)
    }
}

impl ConsulConfig {
    /// Parses `url` (`consul://` or `consuls://`, options as query parameters; see the type docs).
    ///
    /// Errors are `Error::InvalidInput` naming the offending value, with the token redacted.
    /// Nothing is sent.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_backend_url(BackendUrl::parse(url)?)
    }

    /// Like [`ConsulConfig::from_url`], for an already parsed URL (as the registry hands it over).
    pub fn from_backend_url(url: BackendUrl) -> Result<Self> {
        let raw = url.expose();
        let tls = match raw.scheme() {
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
        if raw.host_str().is_none_or(str::is_empty) {
            return Err(url.invalid("the URL names no host").into());
        }
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
        if raw.fragment().is_some() {
            return Err(url.invalid("URL fragments are not supported").into());
        }
        let mut c = ConsulConfig {
            url: url.clone(),
            tls,
            token: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            session_ttl: CONSUL_SESSION_TTL_MIN,
            lock_delay: DEFAULT_LOCK_DELAY,
            token_floor: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_block: DEFAULT_MAX_BLOCK,
            tls_ca_file: None,
            datacenter: None,
            owner: None,
        };
        let mut seen: Vec<String> = Vec::new();
        for (name, value) in raw.query_pairs() {
            let (name, value) = (name.into_owned(), value.into_owned());
            if !PARAMS.contains(&name.as_str()) {
                return Err(url
                    .invalid(format!(
                        "unknown option {name:?} (known: {})",
                        PARAMS.join(", ")
                    ))
                    .into());
            }
            if seen.contains(&name) {
                return Err(url
                    .invalid(format!("option {name:?} is given twice"))
                    .into());
            }
            seen.push(name.clone());
            // The token's value is never echoed.
            let shown = if name == "token" {
                "***".to_owned()
            } else {
                format!("{value:?}")
            };
            let bad = |expected: &str| url.invalid(format!("{name}={shown}: expected {expected}"));
            let millis = |lo: u64, hi: u64, expected: &str| {
                lease_core::parse_millis(
                    &value,
                    Duration::from_millis(lo),
                    Duration::from_millis(hi),
                )
                .ok_or_else(|| bad(expected))
            };
            match name.as_str() {
                "token" => {
                    if value.is_empty() || value.chars().any(|ch| ch.is_control()) {
                        return Err(bad("a non-empty token without control characters").into());
                    }
                    c.token = Some(value);
                }
                "key_prefix" => {
                    validate_prefix(&value).map_err(bad)?;
                    c.key_prefix = value;
                }
                "session_ttl_ms" => {
                    c.session_ttl = millis(100, 86_400_000, "milliseconds in 100..=86400000")?
                }
                "lock_delay_ms" => c.lock_delay = millis(0, 60_000, "milliseconds in 0..=60000")?,
                "request_timeout_ms" => {
                    c.request_timeout = millis(1, 600_000, "milliseconds in 1..=600000")?
                }
                "connect_timeout_ms" => {
                    c.connect_timeout = millis(1, 600_000, "milliseconds in 1..=600000")?
                }
                "max_block_ms" => {
                    c.max_block = millis(1_000, 600_000, "milliseconds in 1000..=600000")?
                }
                "token_floor" => {
                    let floor: Token = value
                        .parse()
                        .map_err(|_| bad("an integer in 0..=9223372036854775806"))?;
                    if floor == Token::MAX {
                        return Err(bad("an integer in 0..=9223372036854775806").into());
                    }
                    c.token_floor = Some(floor);
                }
                "tls_ca_file" => {
                    if !tls {
                        return Err(bad("a consuls:// URL (TLS) for tls_ca_file").into());
                    }
                    if value.is_empty() {
                        return Err(bad("a file path").into());
                    }
                    c.tls_ca_file = Some(PathBuf::from(value));
                }
                "dc" => {
                    if value.is_empty()
                        || !value
                            .chars()
                            .all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch))
                    {
                        return Err(bad("a datacenter name of A-Z a-z 0-9 - _ .").into());
                    }
                    c.datacenter = Some(value);
                }
                _ => unreachable!("checked against PARAMS"),
            }
        }
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
        self.token = Some(token);
        Ok(self)
    }

    /// Sets the owner label leases carry unless their options name one (default: `host/pid`).
    pub fn with_owner(mut self, owner: OwnerId) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The URL as given, token redacted.
    pub fn url(&self) -> &BackendUrl {
        &self.url
    }

    /// Whether requests use HTTPS (`consuls://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// `http(s)://host:port`, where requests go.
    pub fn base_url(&self) -> String {
        let raw = self.url.expose();
        let host = raw.host_str().unwrap_or("127.0.0.1");
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        let port = raw.port().unwrap_or(if self.tls { 8501 } else { 8500 });
        format!(
            "{}://{host}:{port}",
            if self.tls { "https" } else { "http" }
        )
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
        self.token.as_deref()
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The session TTL, which is also the smallest lease TTL accepted.
    pub fn session_ttl(&self) -> Duration {
        self.session_ttl
    }

    /// The session's lock-delay.
    pub fn lock_delay(&self) -> Duration {
        self.lock_delay
    }

    /// The token floor, if set.
    pub fn token_floor(&self) -> Option<Token> {
        self.token_floor
    }

    /// The bound on each request.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// The bound on opening a connection.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The longest single blocking query.
    pub fn max_block(&self) -> Duration {
        self.max_block
    }

    /// The CA file for `consuls://`, if set.
    pub fn tls_ca_file(&self) -> Option<&std::path::Path> {
        self.tls_ca_file.as_deref()
    }

    /// The datacenter, if set.
    pub fn datacenter(&self) -> Option<&str> {
        self.datacenter.as_deref()
    }

    /// The configured owner label, if any.
    pub fn owner(&self) -> Option<&OwnerId> {
        self.owner.as_ref()
    }

    /// The Consul KV key holding the lock on `key`: `<prefix>/locks/<escaped key>` (see
    /// [`escape_key`]). Operators delete this key to remove a lock by hand.
    pub fn kv_key(&self, key: &LockKey) -> String {
        format!("{}/locks/{}", self.key_prefix, escape_key(key))
    }

    /// Where the last forced release of `key` is recorded: `<prefix>/forced/<escaped key>`.
    pub fn audit_key(&self, key: &LockKey) -> String {
        format!("{}/forced/{}", self.key_prefix, escape_key(key))
    }

    /// The marker that cancels an acquire attempt whose outcome was not seen (see the crate docs).
    pub(crate) fn attempt_key(&self, session: &str, attempt: &str) -> String {
        format!("{}/attempts/{session}/{attempt}", self.key_prefix)
    }
}

/// Maps a lock key onto Consul's KV key alphabet.
///
/// Current Consul releases accept only `A-Z a-z 0-9 , - _ . /` in KV keys and refuse keys ending
/// in a file extension such as `.json`; older ones accept anything. Every `/`-separated segment
/// keeps `A-Z a-z 0-9 - _` and writes every other byte of its UTF-8 form as `,XX` (upper-case
/// hex), so no key contains `.` and distinct lock keys never collide: `orders/42` stays
/// `orders/42`, `with space` becomes `with,20space`, `q.r` becomes `q,2Er`.
pub fn escape_key(key: &LockKey) -> String {
    let mut out = String::with_capacity(key.as_str().len());
    for (i, segment) in key.segments().enumerate() {
        if i > 0 {
            out.push('/');
        }
        for b in segment.bytes() {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                out.push(b as char);
            } else {
                out.push_str(&format!(",{b:02X}"));
            }
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_defaults_and_options() {
        let c = ConsulConfig::from_url("consul://127.0.0.1").unwrap();
        assert_eq!(c.base_url(), "http://127.0.0.1:8500");
        assert_eq!(c.session_ttl(), CONSUL_SESSION_TTL_MIN);
        assert_eq!(c.lock_delay(), Duration::from_secs(1));
        let c = ConsulConfig::from_url(
            "consuls://consul.example:9501?token=s3cret&key_prefix=app/locks-1&session_ttl_ms=1000&lock_delay_ms=250&token_floor=7&dc=dc2",
        )
        .unwrap();
        assert_eq!(c.base_url(), "https://consul.example:9501");
        assert_eq!(c.token(), Some("s3cret"));
        assert_eq!(c.key_prefix(), "app/locks-1");
        assert_eq!(c.session_ttl(), Duration::from_secs(1));
        assert_eq!(c.token_floor(), Some(Token::new(7).unwrap()));
        let h = ConsulConfig::from_url("https://10.0.0.1").unwrap();
        assert!(h.tls());
        assert_eq!(h.base_url(), "https://10.0.0.1:8501");
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
        }
    }

    /// Each datacenter has its own Raft index and two key prefixes are two lock namespaces: a
    /// token watermark shared between them fails closed on tokens that never went backwards.
    #[test]
    fn the_token_watermark_is_scoped_by_agent_datacenter_and_prefix() {
        let scope = |u: &str| ConsulConfig::from_url(u).unwrap().token_scope();
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
            ("consul://h?tls_ca_file=/x", "consuls://"),
            ("consul://u:pw@h", "user information"),
            ("consul://h?token=a&token=b", "twice"),
        ] {
            let e = ConsulConfig::from_url(url).unwrap_err().to_string();
            assert!(e.contains(needle), "{url}: {e}");
            assert!(!e.contains("pw@"), "{e}");
        }
        let e = ConsulConfig::from_url("consul://h?token=%00secret")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn keys_escape_into_consuls_alphabet_without_collisions() {
        let k = |s: &str| LockKey::new(s).unwrap();
        assert_eq!(escape_key(&k("orders/42")), "orders/42");
        assert_eq!(escape_key(&k("with space")), "with,20space");
        assert_eq!(escape_key(&k("q.r")), "q,2Er");
        assert_eq!(escape_key(&k("a,b")), "a,2Cb");
        assert_eq!(escape_key(&k("é")), ",C3,A9");
        assert_ne!(escape_key(&k("a,2Eb")), escape_key(&k("a.b")));
        let c = ConsulConfig::from_url("consul://h").unwrap();
        assert_eq!(c.kv_key(&k("report.json")), "fenced/locks/report,2Ejson");
    }
}
