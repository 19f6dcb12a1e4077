//! [`RedisConfig`]: where the server is and how the adapter behaves, parsed from a URL.

use std::fmt;
use std::time::Duration;

use lease_core::adapter::{
    read_pem, BackendUrl, CommonOptions, OptionSpec, PemKind, TlsFiles, UrlOptions,
};
use lease_core::{Error, InvalidInput, Result};

/// The default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "fenced";
/// The default bound on one command's response (also the bound on a re-read after it).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// The default bound on opening a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The default longest sleep of a waiting `acquire` between two attempts when no release
/// notification arrives (the fallback for lost pub/sub messages).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(250);
/// The longest key prefix, in bytes.
pub const MAX_KEY_PREFIX_BYTES: usize = 64;
/// The largest poll interval accepted (`poll_interval_ms`, [`RedisConfig::with_poll_interval`]);
/// request and connect timeouts take the common range, up to 600 s.
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

/// The URL options the adapter understands besides lease-core's common ones
/// ([`COMMON_OPTIONS`](lease_core::adapter::COMMON_OPTIONS)); every other one is rejected.
const OPTIONS: OptionSpec = OptionSpec {
    backend: &[
        "volatile_tokens",
        "clock_tokens",
        "replica_acks",
        "unguarded_replicas",
        "poll_interval_ms",
        "tls_ca_file",
        "tls_cert_file",
        "tls_key_file",
        "tls_server_name",
    ],
    secret: &[],
    key_prefix: validate_prefix,
};
/// The default port of a Sentinel.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;
/// The most replica acknowledgements an acquire can wait for.
pub const MAX_REPLICA_ACKS: u8 = 16;

/// How many replicas must have an acquire's write before the lease is handed out
/// (`replica_acks`; see [`RedisConfig`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaAcks {
    /// One once the primary reported a streaming (online) replica, at a connect or at a count
    /// made again (at most once a second, before a write) while none was seen; none otherwise
    /// (the default).
    Auto,
    /// Exactly this many (`0` never waits).
    Exactly(u8),
}

/// Where the Sentinels of a `redis+sentinel://` URL are and which primary they watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The Sentinels, `(host, port)`, in the URL's order.
    pub sentinels: Vec<(String, u16)>,
    /// The primary's name as the Sentinels know it (`sentinel monitor <name> ...`).
    pub primary: String,
}

/// How to reach a Redis server and how the adapter uses it.
///
/// Parsed from a URL ([`RedisConfig::from_url`]):
///
/// ```text
/// redis://[user[:password]@]host[:port][/db][?option=value&...]
/// rediss://...                      (TLS; the server certificate is checked against the
///                                    system roots, or against `tls_ca_file`)
/// redis+sentinel://[user[:password]@]sentinel[:port][,sentinel[:port]...]/primary-name[/db][?...]
///                                   (the primary is asked of the Sentinels, in order, at every
///                                    (re)connect, and checked with ROLE; user and password are
///                                    the data nodes', Sentinels are asked without them)
/// ```
///
/// | option | default | meaning |
/// |---|---|---|
/// | `key_prefix` | `fenced` | first part of every key; 1 to 64 bytes, no `{`, `}`, spaces or control characters |
/// | `volatile_tokens` | `false` | `true` accepts a server that cannot keep the token counter across a crash (see the crate docs); the durability check at connect is skipped |
/// | `token_floor` | none | every token issued is above this value (raise it after a restore or failover) |
/// | `clock_tokens` | `true` | every token is at least the server's clock in microseconds (`max(counter + 1, TIME)`), so tokens keep increasing when the counter is lost or a failover promotes a replica that missed the last grants; `false`: the counter alone (tokens 1, 2, 3, ...), refused on a primary with replicas unless `unguarded_replicas=true` |
/// | `replica_acks` | `auto` | after a grant, and with each renewal, `WAIT` until this many replicas have it (bounded by half the request timeout); fewer in time: the grant is undone and the acquire fails `Unavailable`, or the renewal fails `Unavailable` and extends nothing. A fence write or claim accepted on the primary, and a force-release, wait the same way; fewer in time: `OutcomeUnknown` (applied on the primary; a failover may lose it). `auto`: 1 once the primary had a streaming (online) replica at a connect of this coordinator or fence, or at a count made again before a write (at most once a second, while none was seen: a replica still in its first sync at the connect, or added later, is waited for from then on); a later count that finds none does not lower it (a primary cut off from its replicas keeps refusing); else 0; `0..=16` (while none was seen, one write a second pays the count's round trip) |
/// | `unguarded_replicas` | `false` | `true` accepts a primary with replicas while `clock_tokens=false` (tokens can then repeat after a failover) |
/// | `request_timeout_ms` | `2000` | bound on each command's response |
/// | `connect_timeout_ms` | `2000` | bound on opening a connection |
/// | `owner` | this process's `host/pid` | the owner label leases carry unless their options name another |
/// | `poll_interval_ms` | `250` | longest sleep of a waiter between attempts without a notification; also the holder monitor's ping interval (and its poll interval without client-side tracking) |
/// | `tls_ca_file` | none | PEM file of the CA that signed the server certificate (`rediss://` only) |
/// | `tls_cert_file`, `tls_key_file` | none | PEM client certificate (chain) and its private key, for a server with `tls-auth-clients yes` (Redis's default when TLS is on); both or neither (`rediss://` only) |
///
/// `Debug` and `Display` show the URL with the password replaced by `***`; errors name values
/// the same way.
#[derive(Clone, Debug)]
pub struct RedisConfig {
    url: BackendUrl,
    common: CommonOptions,
    volatile_tokens: bool,
    clock_tokens: bool,
    replica_acks: ReplicaAcks,
    unguarded_replicas: bool,
    sentinel: Option<SentinelConfig>,
    poll_interval: Duration,
    tls_files: TlsFiles,
}

lease_core::common_config!(RedisConfig {
    common: common,
    key_prefix: (OPTIONS.key_prefix, DEFAULT_KEY_PREFIX),
    request_timeout: |_| DEFAULT_REQUEST_TIMEOUT,
    connect_timeout: |_| DEFAULT_CONNECT_TIMEOUT,
});

impl fmt::Display for RedisConfig {
    /// The URL, password redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.url, f)
    }
}

impl RedisConfig {
    /// Parses `url` (`redis://`, `rediss://` or `redis+sentinel://`, options as query parameters;
    /// see the type docs).
    ///
    /// Errors are `Error::InvalidInput` naming the offending value, with the password redacted.
    /// Nothing is sent.
    pub fn from_url(url: &str) -> Result<Self> {
        let parsed = BackendUrl::parse(url)?;
        Self::from_backend_url(parsed)
    }

    /// Like [`RedisConfig::from_url`], for an already parsed URL (as the registry hands it over).
    pub fn from_backend_url(url: BackendUrl) -> Result<Self> {
        let raw = url.expose();
        let sentinel_scheme = match raw.scheme() {
            "redis" | "rediss" => false,
            "redis+sentinel" => true,
            "rediss+sentinel" => {
                return Err(url
                    .invalid(
                        "scheme \"rediss+sentinel\" is not supported yet (Sentinel over TLS); \
                         use redis+sentinel:// on a trusted network or rediss:// to the primary",
                    )
                    .into())
            }
            other => {
                return Err(url
                    .invalid(format!(
                        "scheme {other:?} is not a Redis scheme (use redis://, rediss:// or \
                         redis+sentinel://)"
                    ))
                    .into())
            }
        };
        if raw.host_str().is_none_or(str::is_empty) {
            return Err(url.invalid("the URL names no host").into());
        }
        let hosts = url.hosts();
        if hosts.len() > 1 && !sentinel_scheme {
            return Err(url
                .invalid(
                    "a host list needs redis+sentinel:// (a plain redis:// URL names one server)",
                )
                .into());
        }
        if raw.fragment().is_some() {
            return Err(url
                .invalid(
                    "URL fragments are not supported (certificate checks cannot be turned off; \
                     use tls_ca_file for a private CA)",
                )
                .into());
        }
        let path = raw.path().trim_matches('/');
        let (sentinel, db) = if sentinel_scheme {
            let (name, db) = path.split_once('/').unwrap_or((path, ""));
            if name.is_empty() {
                return Err(url
                    .invalid(
                        "a redis+sentinel:// URL names the primary after the hosts \
                         (redis+sentinel://host:26379/mymaster)",
                    )
                    .into());
            }
            let sentinels = url
                .host_ports(DEFAULT_SENTINEL_PORT)?
                .into_iter()
                .map(|h| (h.host, h.port))
                .collect();
            (
                Some(SentinelConfig {
                    sentinels,
                    primary: name.to_owned(),
                }),
                db,
            )
        } else {
            (None, path)
        };
        if !db.is_empty() && db.parse::<u16>().is_err() {
            return Err(url
                .invalid(format!(
                    "the path {db:?} is not a database number (use /0, /1, ...)"
                ))
                .into());
        }

        let (common, mut options) = UrlOptions::parse(&url, OPTIONS)?;
        let replica_acks = options.value("replica_acks", "auto or a number in 0..=16", |v| {
            if v.eq_ignore_ascii_case("auto") {
                return Ok(ReplicaAcks::Auto);
            }
            match v.parse::<u8>() {
                Ok(n) if n <= MAX_REPLICA_ACKS => Ok(ReplicaAcks::Exactly(n)),
                _ => Err("auto or a number in 0..=16"),
            }
        })?;
        let tls_files = TlsFiles::take(&mut options, raw.scheme() == "rediss", "a rediss:// URL")?;
        if tls_files.server_name.is_some() {
            return Err(options
                .invalid(
                    "tls_server_name: the Redis client checks the server certificate against the \
                     URL's host; connect by a name the certificate carries",
                )
                .into());
        }
        let interval = |options: &mut UrlOptions<'_>, name| {
            options.millis(name, Duration::from_millis(1), MAX_INTERVAL)
        };
        let config = RedisConfig {
            common,
            volatile_tokens: options.flag("volatile_tokens")?.unwrap_or(false),
            clock_tokens: options.flag("clock_tokens")?.unwrap_or(true),
            replica_acks: replica_acks.unwrap_or(ReplicaAcks::Auto),
            unguarded_replicas: options.flag("unguarded_replicas")?.unwrap_or(false),
            sentinel,
            poll_interval: interval(&mut options, "poll_interval_ms")?
                .unwrap_or(DEFAULT_POLL_INTERVAL),
            tls_files,
            url: url.clone(),
        };
        Ok(config)
    }

    /// Accepts (`true`) a server whose token counter may not survive a crash; see the crate docs.
    pub fn with_volatile_tokens(mut self, yes: bool) -> Self {
        self.volatile_tokens = yes;
        self
    }

    /// Whether every token is at least the server's clock in microseconds (`true`, the default)
    /// or the key's counter alone (`false`: 1, 2, 3, ...). See the crate docs, "Token source".
    pub fn with_clock_tokens(mut self, yes: bool) -> Self {
        self.clock_tokens = yes;
        self
    }

    /// How many replicas must have a grant before `acquire` returns it (see the type docs).
    pub fn with_replica_acks(mut self, acks: ReplicaAcks) -> Result<Self> {
        if let ReplicaAcks::Exactly(n) = acks {
            if n > MAX_REPLICA_ACKS {
                return Err(InvalidInput::OutOfRange {
                    field: "replica_acks",
                    value: n.to_string(),
                    expected: "0..=16",
                }
                .into());
            }
        }
        self.replica_acks = acks;
        Ok(self)
    }

    /// Accepts (`true`) a primary with replicas while `clock_tokens` is off.
    pub fn with_unguarded_replicas(mut self, yes: bool) -> Self {
        self.unguarded_replicas = yes;
        self
    }

    /// Sets the longest sleep of a waiter between attempts without a notification (1 ms to
    /// [`MAX_INTERVAL`]).
    pub fn with_poll_interval(mut self, d: Duration) -> Result<Self> {
        self.poll_interval = checked_interval("poll_interval", d)?;
        Ok(self)
    }

    /// The URL (its `Display` and `Debug` redact the password).
    pub fn url(&self) -> &BackendUrl {
        &self.url
    }

    /// Whether the user accepted tokens that may not survive a crash.
    pub fn volatile_tokens(&self) -> bool {
        self.volatile_tokens
    }

    /// Whether every token is at least the server's clock in microseconds.
    pub fn clock_tokens(&self) -> bool {
        self.clock_tokens
    }

    /// The replica acknowledgements an acquire waits for.
    pub fn replica_acks(&self) -> ReplicaAcks {
        self.replica_acks
    }

    /// Whether a primary with replicas is accepted while `clock_tokens` is off.
    pub fn unguarded_replicas(&self) -> bool {
        self.unguarded_replicas
    }

    /// The Sentinels of a `redis+sentinel://` URL, if that is the scheme.
    pub fn sentinel(&self) -> Option<&SentinelConfig> {
        self.sentinel.as_ref()
    }

    /// The waiters' fallback poll interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }

    /// Whether the server is reached over TLS (`rediss://`).
    pub fn tls(&self) -> bool {
        self.url.expose().scheme() == "rediss"
    }

    /// The CA file for `rediss://`, if any.
    pub fn tls_ca_file(&self) -> Option<&std::path::Path> {
        self.tls_files.ca_file.as_deref()
    }

    /// The client certificate and key files for `rediss://`, if any.
    pub fn tls_client_cert(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        let client = self.tls_files.client.as_ref();
        client.map(|(cert, key)| (cert.as_path(), key.as_path()))
    }

    /// Builds the redis-rs client: the URL without the adapter's own options. For
    /// `redis+sentinel://`, a client of the first Sentinel's address; use
    /// [`Self::client_for`] with the primary's address instead.
    pub(crate) fn client(&self) -> Result<redis::Client> {
        match &self.sentinel {
            Some(s) => {
                let (host, port) = &s.sentinels[0];
                self.client_for(host, *port)
            }
            None => self.client_of(self.url.expose().clone()),
        }
    }

    /// A client of the data node at `host:port` with the URL's user, password and database (the
    /// primary a Sentinel named).
    pub(crate) fn client_for(&self, host: &str, port: u16) -> Result<redis::Client> {
        let mut raw = self.url.expose().clone();
        let db = match &self.sentinel {
            Some(_) => raw
                .path()
                .trim_matches('/')
                .split_once('/')
                .map(|(_, db)| db.to_owned())
                .unwrap_or_default(),
            None => raw.path().trim_matches('/').to_owned(),
        };
        let rebuilt = raw
            .set_scheme("redis")
            .ok()
            .and_then(|()| raw.set_host(Some(host)).ok())
            .and_then(|()| raw.set_port(Some(port)).ok());
        if rebuilt.is_none() {
            return Err(self
                .url
                .invalid(format!("cannot address the data node {host}:{port}"))
                .into());
        }
        raw.set_path(&db);
        self.client_of(raw)
    }

    fn client_of(&self, mut raw: url::Url) -> Result<redis::Client> {
        raw.set_query(None);
        let TlsFiles {
            ca_file, client, ..
        } = &self.tls_files;
        let client = if ca_file.is_none() && client.is_none() {
            if raw.scheme() == "rediss" {
                install_crypto_provider();
            }
            redis::Client::open(raw)
        } else {
            install_crypto_provider();
            let pem = |option, path, kind| read_pem(&self.url, option, path, kind);
            let root_cert = match ca_file {
                Some(ca) => Some(pem("tls_ca_file", ca, PemKind::Certificate)?),
                None => None,
            };
            let client_tls = match client {
                Some((cert, key)) => Some(redis::ClientTlsConfig {
                    client_cert: pem("tls_cert_file", cert, PemKind::Certificate)?,
                    client_key: pem("tls_key_file", key, PemKind::PrivateKey)?,
                }),
                None => None,
            };
            let certificates = redis::TlsCertificates {
                client_tls,
                root_cert,
            };
            redis::Client::build_with_tls(raw, certificates)
        };
        client.map_err(|e| {
            Error::from(
                self.url
                    .invalid(format!("the Redis client rejected it: {e}")),
            )
        })
    }
}

/// Makes sure rustls has a process-wide crypto provider (ring), even when another crate in the
/// build enables a second one (then rustls cannot pick one by itself).
fn install_crypto_provider() {
    // An error means a provider is installed already, which is all we need.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn validate_prefix(prefix: &str) -> std::result::Result<(), &'static str> {
    if prefix.is_empty() {
        return Err("a non-empty prefix");
    }
    if prefix.len() > MAX_KEY_PREFIX_BYTES {
        return Err("at most 64 bytes");
    }
    if prefix
        .chars()
        .any(|c| c == '{' || c == '}' || c.is_whitespace() || c.is_control())
    {
        return Err("no '{', '}', whitespace or control characters");
    }
    Ok(())
}

fn checked_interval(field: &'static str, d: Duration) -> Result<Duration> {
    Ok(lease_core::adapter::duration_in_range(
        field,
        d,
        Duration::from_millis(1),
        MAX_INTERVAL,
        "1 ms to 60 s",
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::Token;

    fn invalid(url: &str) -> String {
        match RedisConfig::from_url(url) {
            Err(Error::InvalidInput(e)) => e.to_string(),
            other => panic!("{url}: expected InvalidInput, got {other:?}"),
        }
    }

    #[test]
    fn parses_options() {
        let c = RedisConfig::from_url(
            "redis://alice:pw@127.0.0.1:6390/2?key_prefix=app&volatile_tokens=true&token_floor=1000&request_timeout_ms=500&connect_timeout_ms=700&poll_interval_ms=50&clock_tokens=false&replica_acks=2&unguarded_replicas=true",
        )
        .unwrap();
        assert!(!c.clock_tokens());
        assert_eq!(c.replica_acks(), ReplicaAcks::Exactly(2));
        assert!(c.unguarded_replicas());
        assert!(c.sentinel().is_none());
        assert_eq!(c.key_prefix(), "app");
        assert!(c.volatile_tokens());
        assert_eq!(c.token_floor(), Some(Token::new(1000).unwrap()));
        assert_eq!(c.request_timeout(), Duration::from_millis(500));
        assert_eq!(c.connect_timeout(), Duration::from_millis(700));
        assert_eq!(c.poll_interval(), Duration::from_millis(50));
        let d = RedisConfig::from_url("rediss://h").unwrap();
        assert!(d.tls() && !c.tls());
        assert_eq!(d.key_prefix(), DEFAULT_KEY_PREFIX);
        let m = RedisConfig::from_url("rediss://h?tls_cert_file=/c&tls_key_file=/k").unwrap();
        assert_eq!(
            m.tls_client_cert(),
            Some((std::path::Path::new("/c"), std::path::Path::new("/k")))
        );
        assert!(!d.volatile_tokens());
        assert!(d.clock_tokens());
        assert_eq!(d.replica_acks(), ReplicaAcks::Auto);
        assert!(!d.unguarded_replicas());
        assert_eq!(d.request_timeout(), DEFAULT_REQUEST_TIMEOUT);
    }

    #[test]
    fn parses_sentinel_urls() {
        let c = RedisConfig::from_url(
            "redis+sentinel://:pw@10.0.0.1:26380,10.0.0.2,[::1]:26381/mymaster/3?replica_acks=1",
        )
        .unwrap();
        let s = c.sentinel().unwrap();
        assert_eq!(s.primary, "mymaster");
        assert_eq!(
            s.sentinels,
            vec![
                ("10.0.0.1".to_owned(), 26380),
                ("10.0.0.2".to_owned(), DEFAULT_SENTINEL_PORT),
                ("::1".to_owned(), 26381),
            ]
        );
        let client = c.client_for("127.0.0.1", 6390).unwrap();
        let info = client.get_connection_info();
        assert_eq!(info.redis_settings().db(), 3);
        assert_eq!(info.redis_settings().password(), Some("pw"));
        assert!(format!("{:?}", info.addr()).contains("6390"));
        assert!(!format!("{c:?}").contains("pw@"));
    }

    #[test]
    fn rejects_bad_values_naming_them_without_the_password() {
        for (url, needle) in [
            ("redis://:hunter2@h?volatile_tokens=maybe", "maybe"),
            ("redis://:hunter2@h?clock_tokens=2", "clock_tokens"),
            ("redis://:hunter2@h?replica_acks=17", "replica_acks"),
            ("redis://:hunter2@h?replica_acks=some", "some"),
            ("redis://:hunter2@a,b", "redis+sentinel"),
            ("redis+sentinel://:hunter2@a,b", "primary"),
            ("redis+sentinel://:hunter2@a:x,b/m", "a:x"),
            ("rediss+sentinel://:hunter2@a/m", "not supported"),
            ("redis://:hunter2@h?token_floor=-1", "-1"),
            (
                "redis://:hunter2@h?token_floor=9223372036854775807",
                "token_floor",
            ),
            (
                "redis://:hunter2@h?request_timeout_ms=0",
                "request_timeout_ms",
            ),
            (
                "redis://:hunter2@h?poll_interval_ms=600000",
                "poll_interval_ms",
            ),
            ("redis://:hunter2@h?key_prefix=a%7Bb", "key_prefix"),
            ("redis://:hunter2@h?key_prefix=", "key_prefix"),
            ("redis://:hunter2@h?nosuch=1", "nosuch"),
            ("redis://:hunter2@h?key_prefix=a&key_prefix=b", "twice"),
            ("redis://:hunter2@h/abc", "abc"),
            ("redis://:hunter2@h#insecure", "fragment"),
            ("redis://:hunter2@h?tls_ca_file=/x", "rediss"),
            (
                "redis://:hunter2@h?tls_cert_file=/c&tls_key_file=/k",
                "rediss",
            ),
            ("rediss://:hunter2@h?tls_cert_file=/c", "needs tls_key_file"),
            ("rediss://:hunter2@h?tls_server_name=x", "URL's host"),
            ("http://:hunter2@h", "http"),
            ("redis://:hunter2@[bad", "redis://:***@"),
        ] {
            let e = invalid(url);
            assert!(e.contains(needle), "{url}: {e}");
            assert!(!e.contains("hunter2"), "{url}: {e}");
        }
    }

    #[test]
    fn debug_and_display_redact_the_password() {
        let c = RedisConfig::from_url("redis://bob:s3cret@h:1/0?key_prefix=p").unwrap();
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("bob"), "{shown}");
        }
    }

    #[test]
    fn setters_validate() {
        let c = RedisConfig::from_url("redis://h").unwrap();
        assert!(c.clone().with_key_prefix("a}b").is_err());
        assert!(c.clone().with_key_prefix("ok:prefix").is_ok());
        assert!(c.clone().with_request_timeout(Duration::ZERO).is_err());
        assert!(c
            .clone()
            .with_poll_interval(Duration::from_secs(61))
            .is_err());
        assert!(c.with_connect_timeout(Duration::from_millis(5)).is_ok());
    }
}
