//! [`ZkConfig`]: where the ensemble is and how the adapter uses it, parsed from a URL.

use std::fmt;
use std::time::Duration;

use lease_core::adapter::{
    duration_in_range, BackendUrl, CommonOptions, HostPort, OptionSpec, Secret, UrlOptions,
};
use lease_core::{InvalidInput, LockKey, Result};

/// The base znode when the URL names no path.
pub const DEFAULT_BASE_PATH: &str = "/fenced";
/// The key prefix when the URL names no path: the default base znode without its leading `/`.
pub const DEFAULT_KEY_PREFIX: &str = "fenced";
/// The session timeout asked for when the URL does not say (the server negotiates it into its
/// `[minSessionTimeout, maxSessionTimeout]` range; the adapter uses the negotiated value).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// The smallest session timeout the URL may ask for.
pub const MIN_SESSION_TIMEOUT: Duration = Duration::from_millis(100);
/// The largest session timeout, request timeout or connect timeout accepted.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(600);
/// The default client port.
pub const DEFAULT_PORT: u16 = 2181;

/// The URL options the adapter understands besides lease-core's common ones
/// ([`COMMON_OPTIONS`](lease_core::adapter::COMMON_OPTIONS); `key_prefix` is the base path
/// without its leading `/`, an alternative to the URL's path); every other one is rejected.
const OPTIONS: OptionSpec = OptionSpec {
    backend: &["session_timeout_ms", "digest", "tick_ms"],
    secret: &["digest"],
    key_prefix: validate_prefix,
};
/// Digest credentials; the password leaves this type only towards the client library.
#[derive(Clone, PartialEq, Eq)]
struct Digest {
    user: String,
    password: Secret,
}

impl fmt::Debug for Digest {
    /// `"user:***"`, as the URL shows it redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&format!("{}:{}", self.user, self.password), f)
    }
}

/// How to reach a ZooKeeper ensemble and how the adapter uses it.
///
/// Parsed from a URL ([`ZkConfig::from_url`]):
///
/// ```text
/// zk://[user:password@]host[:port][,host[:port]...][/base/path][?option=value&...]
/// ```
///
/// The path is the base znode under which everything lives (it acts as a chroot; default
/// [`DEFAULT_BASE_PATH`]): lock nodes under `<base>/locks`, force-release audit records under
/// `<base>/audit-trails/<encoded key>` (earlier versions' under `<base>/audit`, read only).
///
/// | option | default | meaning |
/// |---|---|---|
/// | `session_timeout_ms` | `10000` | the session timeout asked for; the negotiated one is the minimum TTL of every lease |
/// | `request_timeout_ms` | the session timeout | bound on each request's response |
/// | `connect_timeout_ms` | the session timeout + 1 s | bound on establishing a session |
/// | `digest` | none | `user:password`: authenticate with the `digest` scheme and create every node with the ACL *creator: all, world: read* (same as `user:password@` before the hosts) |
/// | `token_floor` | none | every token issued must be above this value (raise it after restoring the ensemble from a backup) |
/// | `key_prefix` | the URL's path | the base path without its leading `/` (`svc/locks`), when the URL has no path |
/// | `owner` | this process's `host/pid` | the owner label leases carry unless their options name another |
/// | `tick_ms` | half the negotiated session timeout | the ensemble's `tickTime`: the session cap leaves it (plus a heartbeat period) for a follower's session-touch lag, see [`ZkConfig::tick`] |
///
/// Several hosts, each with its own port (`zk://h1:2181,h2:2182/x`), work here and through the
/// registry (`fenced::connect`).
///
/// `Debug` and `Display` show the URL with the password replaced by `***`; errors name the URL
/// the same way.
#[derive(Clone, Debug)]
pub struct ZkConfig {
    hosts: Vec<String>,
    /// The common options; `key_prefix` is the base path without its leading `/`.
    common: CommonOptions,
    session_timeout: Duration,
    digest: Option<Digest>,
    tick: Option<Duration>,
}

lease_core::common_config!(ZkConfig {
    common: common,
    key_prefix: (OPTIONS.key_prefix, DEFAULT_KEY_PREFIX),
    request_timeout: |c: &ZkConfig| c.session_timeout,
    connect_timeout: |c: &ZkConfig| c.session_timeout + Duration::from_secs(1),
});

impl fmt::Display for ZkConfig {
    /// The URL, password redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl ZkConfig {
    /// Parses `url` (see the type docs). Errors are `Error::InvalidInput` naming the URL with the
    /// password redacted. Nothing is sent.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_backend_url(BackendUrl::parse(url)?)
    }

    /// Like [`ZkConfig::from_url`], for an already parsed URL (as the registry hands it over).
    pub fn from_backend_url(url: BackendUrl) -> Result<Self> {
        let raw = url.expose();
        if !raw.scheme().eq_ignore_ascii_case("zk") {
            return Err(url
                .invalid(format!(
                    "scheme {:?} is not the ZooKeeper scheme (use zk://)",
                    raw.scheme()
                ))
                .into());
        }
        let hosts = url
            .host_ports(DEFAULT_PORT)?
            .iter()
            .map(ToString::to_string)
            .collect();
        let mut digest = match (url.username()?, url.password()?) {
            (None, None) => None,
            (user, password) => Some(
                parse_digest(&format!(
                    "{}:{}",
                    user.unwrap_or_default(),
                    password.unwrap_or_default()
                ))
                .map_err(|p| {
                    url.invalid(format!(
                        "the credentials before '@' are not user:password: {p}"
                    ))
                })?,
            ),
        };
        // The path as written: the parsed URL would already have resolved `.` and `..`.
        let path = raw_path(url.expose_str());
        let (common, mut options) = UrlOptions::parse(&url, OPTIONS)?;
        let mut common = common;
        if common.key_prefix.is_some() && !matches!(path, "" | "/") {
            return Err(options
                .invalid("the base path is given both as the URL's path and as key_prefix")
                .into());
        }
        if common.key_prefix.is_none() {
            let base = parse_base_path(path).map_err(|p| options.invalid(p))?;
            common.key_prefix = Some(base[1..].to_owned());
        }
        if let Some(d) = options.value("digest", "user:password", |v| {
            parse_digest(v).map_err(|_| "user:password (both non-empty, no control characters)")
        })? {
            if digest.is_some() {
                return Err(options
                    .invalid("credentials are given both before '@' and as digest=")
                    .into());
            }
            digest = Some(d);
        }
        let session_timeout = options
            .millis("session_timeout_ms", MIN_SESSION_TIMEOUT, MAX_TIMEOUT)?
            .unwrap_or(DEFAULT_SESSION_TIMEOUT);
        let tick = options.millis("tick_ms", Duration::from_millis(1), MAX_TIMEOUT)?;
        Ok(ZkConfig {
            hosts,
            common,
            session_timeout,
            digest,
            tick,
        })
    }

    /// The same configuration with other hosts (for example a fault proxy's address).
    pub fn with_hosts<I, S>(mut self, hosts: I) -> Result<Self>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut parsed = Vec::new();
        for h in hosts {
            let host = HostPort::parse(h.as_ref(), Some(DEFAULT_PORT)).map_err(|problem| {
                InvalidInput::Url {
                    url: self.redacted(),
                    problem,
                }
            })?;
            parsed.push(host.to_string());
        }
        if parsed.is_empty() {
            return Err(InvalidInput::Url {
                url: self.redacted(),
                problem: "no host given".into(),
            }
            .into());
        }
        self.hosts = parsed;
        Ok(self)
    }

    /// Sets the session timeout asked for ([`MIN_SESSION_TIMEOUT`] to [`MAX_TIMEOUT`]).
    pub fn with_session_timeout(mut self, timeout: Duration) -> Result<Self> {
        self.session_timeout = duration_in_range(
            "session_timeout",
            timeout,
            MIN_SESSION_TIMEOUT,
            MAX_TIMEOUT,
            "between 100 ms and 600 s",
        )?;
        Ok(self)
    }

    /// Sets the ensemble's `tickTime` (the `tick_ms` option; see [`ZkConfig::tick`]).
    pub fn with_tick(mut self, tick: Duration) -> Result<Self> {
        let tick = duration_in_range(
            "tick",
            tick,
            Duration::from_millis(1),
            MAX_TIMEOUT,
            "between 1 ms and 600 s",
        )?;
        self.tick = Some(tick);
        Ok(self)
    }

    /// The ensemble's `tickTime` as configured (`tick_ms`), if given.
    ///
    /// A follower passes its clients' session touches on to the leader only with its pings
    /// (every half tick), so the leader's view of a session can lag a touch answered by a
    /// follower; the session cap of every lease leaves `tick + T / 6` for it (see the crate's
    /// README, "The session caps validity", and decision 0017). Without `tick_ms` the adapter
    /// assumes the largest tick a server granting the negotiated timeout `T` can run with under
    /// ZooKeeper's default `minSessionTimeout` of two ticks: `T / 2`.
    pub fn tick(&self) -> Option<Duration> {
        self.tick
    }

    /// The hosts, each `host:port`.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// The connect string the client library wants: `host:port,host:port`.
    pub fn connect_string(&self) -> String {
        self.hosts.join(",")
    }

    /// The base znode path: `/` and the key prefix (no trailing `/`).
    pub fn base_path(&self) -> String {
        format!("/{}", self.key_prefix())
    }

    /// The session timeout asked for.
    pub fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    /// The digest user, if credentials are configured (never the password).
    pub fn digest_user(&self) -> Option<&str> {
        self.digest.as_ref().map(|d| d.user.as_str())
    }

    /// `user:password` for the client library's `digest` authentication.
    pub(crate) fn digest_auth(&self) -> Option<Vec<u8>> {
        self.digest
            .as_ref()
            .map(|d| format!("{}:{}", d.user, d.password.expose()).into_bytes())
    }

    /// The znode of `key`'s lock (the parent of its contender nodes), for operators' tools:
    /// `<base>/locks/<key, percent-encoded into one node name>`.
    pub fn lock_path(&self, key: &LockKey) -> String {
        crate::keys::Paths::new(&self.base_path()).lock_dir(key)
    }

    /// The URL with the password replaced by `***`.
    pub fn redacted(&self) -> String {
        let mut s = format!("zk://{}{}", self.hosts.join(","), self.base_path());
        let mut params = vec![format!(
            "session_timeout_ms={}",
            self.session_timeout.as_millis()
        )];
        if let Some(d) = self.common.request_timeout {
            params.push(format!("request_timeout_ms={}", d.as_millis()));
        }
        if let Some(d) = self.common.connect_timeout {
            params.push(format!("connect_timeout_ms={}", d.as_millis()));
        }
        if let Some(d) = &self.digest {
            params.push(format!("digest={}:***", d.user));
        }
        if let Some(t) = self.common.token_floor {
            params.push(format!("token_floor={t}"));
        }
        if let Some(t) = self.tick {
            params.push(format!("tick_ms={}", t.as_millis()));
        }
        s.push('?');
        s.push_str(&params.join("&"));
        s
    }
}

fn parse_digest(s: &str) -> Result<Digest, String> {
    let Some((user, password)) = s.split_once(':') else {
        return Err("no ':' between user and password".into());
    };
    if user.is_empty() || password.is_empty() {
        return Err("user and password must both be non-empty".into());
    }
    if s.chars().any(char::is_control) {
        return Err("control characters are not allowed".into());
    }
    Ok(Digest {
        user: user.to_owned(),
        password: Secret::new(password),
    })
}

fn parse_base_path(path: &str) -> Result<String, String> {
    if path.is_empty() || path == "/" {
        return Ok(DEFAULT_BASE_PATH.to_owned());
    }
    if path.ends_with('/') {
        return Err(format!("the base path {path:?} ends with '/'"));
    }
    let mut out = String::new();
    for raw in path[1..].split('/') {
        let seg = percent_decode(raw)?;
        check_segment(path, &seg)?;
        out.push('/');
        out.push_str(&seg);
    }
    check_not_reserved(&out)?;
    Ok(out)
}

/// One znode name of the base path `path`, already percent-decoded.
fn check_segment(path: &str, seg: &str) -> Result<(), String> {
    if seg.is_empty() {
        return Err(format!("the base path {path:?} has an empty segment"));
    }
    if seg == "." || seg == ".." {
        return Err(format!("the base path {path:?} has a '.' or '..' segment"));
    }
    if seg
        .chars()
        .any(|c| c.is_control() || ('\u{e000}'..='\u{f8ff}').contains(&c) || c >= '\u{fff0}')
        || seg.contains('/')
    {
        return Err(format!(
            "segment {seg:?} of the base path has a character ZooKeeper rejects"
        ));
    }
    Ok(())
}

/// ZooKeeper's own tree is not a base path.
fn check_not_reserved(base: &str) -> Result<(), String> {
    if base == "/zookeeper" || base.starts_with("/zookeeper/") {
        return Err("the base path may not be under /zookeeper (reserved)".into());
    }
    Ok(())
}

fn percent_decode(s: &str) -> Result<String, String> {
    lease_core::adapter::percent_decode(s).ok_or_else(|| {
        "a '%' not followed by two hex digits, or escaped bytes that are not UTF-8".to_owned()
    })
}

/// The path of a URL as written (between the authority and the query), before any `.` or `..`
/// resolution.
fn raw_path(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    rest.find('/').map_or("", |i| &rest[i..])
}

/// The rule for `key_prefix` (the base path without its leading `/`).
fn validate_prefix(prefix: &str) -> std::result::Result<(), &'static str> {
    if prefix.is_empty() {
        // `parse_base_path("/")` is the default base path: an empty prefix is not.
        return Err("a non-empty base path without its leading '/'");
    }
    // The URL options parser has already percent-decoded the value: its segments are checked
    // as they are, not decoded a second time.
    prefix
        .split('/')
        .try_for_each(|seg| check_segment(prefix, seg))
        .and_then(|()| check_not_reserved(&format!("/{prefix}")))
        .map_err(|_| {
            "znode names separated by '/' (none empty, '.' or '..', no control characters, \
         not under zookeeper/)"
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::Token;

    #[test]
    fn passwords_with_delimiters_never_show_in_errors() {
        for url in [
            "zk://u:pa/ss@h:2181/x",
            "zk://u:p?ss@h:2181/x",
            "zk://u:p#ss@h/x",
        ] {
            let e = match ZkConfig::from_url(url) {
                Ok(c) => format!("{c:?} {c}"),
                Err(e) => e.to_string(),
            };
            for secret in ["pa/ss", "p?ss", "p#ss", "\"pa\""] {
                assert!(!e.contains(secret), "{url}: {e}");
            }
        }
    }

    #[test]
    fn host_lists_with_ports_come_through_the_registry_url() {
        let url = BackendUrl::parse("zk://u:pw@h1:2181,h2:2182/x?session_timeout_ms=2000").unwrap();
        let c = ZkConfig::from_backend_url(url).unwrap();
        assert_eq!(c.hosts().len(), 2);
        assert!(
            c.hosts()[1].contains("h2") && c.hosts()[1].contains("2182"),
            "{:?}",
            c.hosts()
        );
        assert!(!format!("{c:?} {c}").contains("pw"));
    }

    fn invalid(url: &str) -> String {
        match ZkConfig::from_url(url) {
            Err(lease_core::Error::InvalidInput(e)) => e.to_string(),
            other => panic!("{url}: expected InvalidInput, got {other:?}"),
        }
    }

    #[test]
    fn parses_hosts_path_and_options() {
        let c = ZkConfig::from_url(
            "zk://127.0.0.1:2181,zk2,[::1]:2182/svc/locks?session_timeout_ms=1500&digest=alice:s3cret&token_floor=42",
        )
        .unwrap();
        assert_eq!(
            c.hosts(),
            ["127.0.0.1:2181", "zk2:2181", "[::1]:2182"].map(String::from)
        );
        assert_eq!(c.base_path(), "/svc/locks");
        assert_eq!(c.session_timeout(), Duration::from_millis(1500));
        assert_eq!(c.request_timeout(), Duration::from_millis(1500));
        assert_eq!(c.digest_user(), Some("alice"));
        assert_eq!(c.digest_auth().unwrap(), b"alice:s3cret");
        assert_eq!(c.token_floor(), Some(Token::new(42).unwrap()));
        assert_eq!(c.tick(), None);
        let t = ZkConfig::from_url("zk://h/x?tick_ms=250").unwrap();
        assert_eq!(t.tick(), Some(Duration::from_millis(250)));
        assert!(t.redacted().contains("tick_ms=250"));
        let k = ZkConfig::from_url("zk://h?key_prefix=svc/locks&owner=w1").unwrap();
        assert_eq!(k.base_path(), "/svc/locks");
        // The option's value is decoded once, as the path's segments are.
        let p = ZkConfig::from_url("zk://h?key_prefix=50%25off").unwrap();
        assert_eq!(p.base_path(), "/50%off");
        assert_eq!(
            p.base_path(),
            ZkConfig::from_url("zk://h/50%25off").unwrap().base_path()
        );
        let p = ZkConfig::from_url("zk://h?key_prefix=a%2541").unwrap();
        assert_eq!(p.base_path(), "/a%41");
        assert_eq!(k.owner().map(|o| o.as_str()), Some("w1"));
        let d = ZkConfig::from_url("zk://h").unwrap();
        assert_eq!(d.base_path(), DEFAULT_BASE_PATH);
        assert_eq!(d.hosts(), ["h:2181".to_owned()]);
        assert_eq!(d.session_timeout(), DEFAULT_SESSION_TIMEOUT);
    }

    #[test]
    fn userinfo_credentials_are_a_digest() {
        let c = ZkConfig::from_url("zk://bob:pa%40ss@h:1/x").unwrap();
        assert_eq!(c.digest_auth().unwrap(), b"bob:pa@ss");
        let q = ZkConfig::from_url("zk://h:1/x?digest=bob:pa%40ss").unwrap();
        assert_eq!(q.digest_auth().unwrap(), b"bob:pa@ss");
    }

    #[test]
    fn secrets_never_show() {
        for url in [
            "zk://h:1/x?digest=alice:s3cret",
            "zk://alice:s3cret@h:1/x",
            "zk://alice:s3cret@h1:1,h2:2/x?session_timeout_ms=1000",
        ] {
            let c = ZkConfig::from_url(url).unwrap();
            for shown in [format!("{c}"), format!("{c:?}"), c.redacted()] {
                assert!(!shown.contains("s3cret"), "{shown}");
                assert!(shown.contains("alice"), "{shown}");
            }
        }
        for bad in [
            "zk://h:1/x?digest=alice:s3cret&nope=1",
            "zk://alice:s3cret@h:99999/x",
            "zk://alice:s3cret@/x",
            "zk://h:1/x?digest=alice:s3cret&session_timeout_ms=abc",
            "zk://h:1/x?session_timeout_ms=abc&digest=alice:s3cret",
            "zk://h:1/x?digest=s3cret",
        ] {
            let e = invalid(bad);
            assert!(!e.contains("s3cret"), "{bad}: {e}");
        }
    }

    #[test]
    fn bad_input_names_the_problem() {
        assert!(invalid("redis://h").contains("not the ZooKeeper scheme"));
        assert!(invalid("zk://").contains("no host"));
        assert!(invalid("zk://h:0").contains("port"));
        assert!(invalid("zk://h:1/a//b").contains("empty segment"));
        assert!(invalid("zk://h:1/a/../b").contains("'..'"));
        assert!(invalid("zk://h:1/a/").contains("ends with"));
        assert!(invalid("zk://h:1/zookeeper/x").contains("reserved"));
        assert!(invalid("zk://h:1/x?session_timeout_ms=5")
            .contains("session_timeout_ms=\"5\": expected milliseconds in 100..=600000"));
        assert!(
            invalid("zk://h:1/x?session_timeout_ms=1000&session_timeout_ms=2000").contains("twice")
        );
        assert!(invalid("zk://h:1/x?frobnicate=1").contains("unknown option"));
        assert!(invalid("zk://h:1/x?token_floor=-1").contains("token_floor"));
        assert!(invalid("zk://a:b@h:1/x?digest=c:d").contains("both"));
        assert!(invalid("zk://h:1/x#frag").contains("fragment"));
        assert!(invalid("zk://h:1/x?tick_ms=0").contains("expected milliseconds in 1..=600000"));
        assert!(invalid("zk://h:1/x?key_prefix=y").contains("both"));
        assert!(invalid("zk://h:1?key_prefix=zookeeper/y").contains("key_prefix"));
        assert!(invalid("zk://h:1?key_prefix=a//b").contains("key_prefix"));
        assert!(invalid("zk://h:1?key_prefix=").contains("key_prefix"));
    }

    #[test]
    fn with_hosts_replaces_the_address() {
        let c = ZkConfig::from_url("zk://h:1/x?digest=u:p")
            .unwrap()
            .with_hosts(["127.0.0.1:5555"])
            .unwrap();
        assert_eq!(c.connect_string(), "127.0.0.1:5555");
        assert_eq!(c.digest_user(), Some("u"));
        assert!(c.clone().with_hosts(Vec::<String>::new()).is_err());
    }
}
