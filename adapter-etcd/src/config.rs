//! [`EtcdConfig`]: where the cluster is and how the adapter behaves, parsed from a URL.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use lease_core::adapter::{
    read_pem, server_name, BackendUrl, CommonOptions, HostPort, OptionSpec, PemKind, Secret,
    TlsFiles, UrlOptions,
};
use lease_core::{InvalidInput, Result};

/// The default key prefix.
pub const DEFAULT_KEY_PREFIX: &str = "fenced";
/// The default bound on one request's response.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(1);
/// The default bound on opening a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest key prefix, in bytes.
pub const MAX_KEY_PREFIX_BYTES: usize = 128;
/// The default client port when the URL names none.
pub const DEFAULT_PORT: u16 = 2379;

/// The URL options the adapter understands besides lease-core's common ones
/// ([`COMMON_OPTIONS`](lease_core::adapter::COMMON_OPTIONS)); every other one is rejected.
const OPTIONS: OptionSpec = OptionSpec {
    backend: &[
        "endpoints",
        "tls_ca_file",
        "tls_cert_file",
        "tls_key_file",
        "tls_server_name",
        "tls_domain",
    ],
    secret: &[],
    key_prefix: validate_prefix,
};
/// How to reach an etcd cluster and how the adapter uses it.
///
/// Parsed from a URL ([`EtcdConfig::from_url`]):
///
/// ```text
/// etcd://[user:password@]host[:port][?option=value&...]      plain gRPC (http)
/// etcds://[user:password@]host[:port][?option=value&...]     gRPC over TLS
/// ```
///
/// More members: a host list `etcd://a:2379,b:2379,c` (each host its own port, 2379 when
/// omitted), or `endpoints=host2:port,host3:port`.
///
/// | option | default | meaning |
/// |---|---|---|
/// | `key_prefix` | `fenced` | first part of every key the adapter writes; 1 to 128 bytes, printable, no leading or trailing `/` |
/// | `token_floor` | none | every token issued is above this value; set it after a snapshot restore or when moving to a new cluster (see the crate docs) |
/// | `endpoints` | none | further members, comma-separated `host:port` |
/// | `request_timeout_ms` | `1000` | bound on each request's response |
/// | `connect_timeout_ms` | `2000` | bound on opening a connection |
/// | `owner` | this process's `host/pid` | the owner label leases carry unless their options name another |
/// | `tls_ca_file` | system roots | PEM file of the CA(s) that signed the members' certificates; when given, only these are trusted (`etcds://` only) |
/// | `tls_server_name` | the host | the name to check the members' certificates against (`etcds://` only); `tls_domain`, its earlier name, is still understood |
/// | `tls_cert_file` | none | PEM client certificate (chain) for etcd's `--client-cert-auth`; needs `tls_key_file` (`etcds://` only) |
/// | `tls_key_file` | none | PEM private key of `tls_cert_file` (PKCS#8, PKCS#1 or SEC1); needs `tls_cert_file` (`etcds://` only) |
///
/// The members' certificates are always verified (chain and name); there is no option to turn
/// that off. The system roots are those `rustls-native-certs` finds (honouring `SSL_CERT_FILE`
/// and `SSL_CERT_DIR`). The files are read when connecting; a missing or malformed file is
/// `InvalidInput` naming it, and a certificate the server or the client refuses is
/// `Misconfigured` naming the TLS problem.
///
/// User and password come from the URL's user info and are sent with etcd's `Authenticate` RPC.
/// `Debug` and `Display` show the URL with the password replaced by `***`; errors name values
/// the same way, and the password is never logged.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    url: BackendUrl,
    endpoints: Vec<String>,
    user: Option<(String, Secret)>,
    common: CommonOptions,
    tls: bool,
    tls_files: TlsFiles,
}

lease_core::common_config!(EtcdConfig {
    common: common,
    key_prefix: (OPTIONS.key_prefix, DEFAULT_KEY_PREFIX),
    request_timeout: |_| DEFAULT_REQUEST_TIMEOUT,
    connect_timeout: |_| DEFAULT_CONNECT_TIMEOUT,
});

impl fmt::Display for EtcdConfig {
    /// The URL, password redacted.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.url, f)
    }
}

impl EtcdConfig {
    /// Parses `url` (`etcd://` or `etcds://`, options as query parameters; see the type docs).
    ///
    /// Errors are `Error::InvalidInput` naming the offending value, with the password redacted.
    /// Nothing is sent.
    pub fn from_url(url: &str) -> Result<Self> {
        Self::from_backend_url(BackendUrl::parse(url)?)
    }

    /// Like [`EtcdConfig::from_url`], for an already parsed URL (as the registry hands it over).
    pub fn from_backend_url(url: BackendUrl) -> Result<Self> {
        let raw = url.expose();
        let tls = match raw.scheme() {
            "etcd" => false,
            "etcds" => true,
            other => {
                return Err(url
                    .invalid(format!(
                        "scheme {other:?} is not an etcd scheme (use etcd:// or etcds://)"
                    ))
                    .into())
            }
        };
        if !raw.path().trim_matches('/').is_empty() {
            return Err(url
                .invalid(format!(
                    "the path {:?} means nothing to etcd (use ?key_prefix= for a namespace)",
                    raw.path()
                ))
                .into());
        }
        let scheme = if tls { "https" } else { "http" };
        // Each host keeps its own port; a host without one gets etcd's default.
        let mut endpoints: Vec<String> = url
            .host_ports(DEFAULT_PORT)?
            .iter()
            .map(|h| format!("{scheme}://{h}"))
            .collect();
        let user = match (url.username()?, url.password()?) {
            (None, None) => None,
            (None, Some(_)) => return Err(url.invalid("a password needs a user name").into()),
            (Some(_), None) => {
                return Err(url
                    .invalid("etcd authentication needs a password with the user name")
                    .into())
            }
            (Some(u), Some(p)) => Some((u, Secret::new(p))),
        };

        let (common, mut options) = UrlOptions::parse(&url, OPTIONS)?;
        if let Some(list) = options.value("endpoints", "comma-separated host:port pairs", |v| {
            v.split(',')
                .map(|ep| HostPort::parse(ep, None))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| "comma-separated host:port pairs")
        })? {
            endpoints.extend(list.iter().map(|ep| format!("{scheme}://{ep}")));
        }
        // `tls_domain`: the earlier name of `tls_server_name`.
        let domain = options.value("tls_domain", "a DNS name or IP address", server_name)?;
        let mut tls_files = TlsFiles::take(&mut options, tls, "an etcds:// URL")?;
        if let Some(domain) = domain {
            if !tls {
                return Err(options
                    .invalid("tls_domain needs an etcds:// URL (TLS options need TLS)")
                    .into());
            }
            if tls_files.server_name.is_some() {
                return Err(options
                    .invalid("give tls_server_name or its earlier name tls_domain, not both")
                    .into());
            }
            tls_files.server_name = Some(domain);
        }
        let config = EtcdConfig {
            url: url.clone(),
            endpoints,
            user,
            common,
            tls,
            tls_files,
        };
        Ok(config)
    }

    /// Trusts only the CA certificate(s) in the PEM file `path` for the members' certificates
    /// (instead of the system roots). `etcds://` only.
    pub fn with_tls_ca_file(mut self, path: impl Into<PathBuf>) -> Result<Self> {
        self.require_tls("tls_ca_file")?;
        self.tls_files.ca_file = Some(path.into());
        Ok(self)
    }

    /// Checks the members' certificates against `name` (a DNS name or IP address) instead of
    /// the host in the URL. `etcds://` only.
    pub fn with_tls_server_name(mut self, name: impl Into<String>) -> Result<Self> {
        self.require_tls("tls_server_name")?;
        let name = name.into();
        let name = server_name(&name).map_err(|expected| InvalidInput::OutOfRange {
            field: "tls_server_name",
            value: name.clone(),
            expected,
        })?;
        self.tls_files.server_name = Some(name);
        Ok(self)
    }

    /// [`EtcdConfig::with_tls_server_name`], under its earlier name.
    #[deprecated(note = "use with_tls_server_name, the name every adapter uses")]
    pub fn with_tls_domain(self, name: impl Into<String>) -> Result<Self> {
        self.with_tls_server_name(name)
    }

    /// Presents the client certificate (chain) in PEM file `cert` with its private key in PEM
    /// file `key`, for etcd's `--client-cert-auth`. `etcds://` only.
    pub fn with_tls_client_cert(
        mut self,
        cert: impl Into<PathBuf>,
        key: impl Into<PathBuf>,
    ) -> Result<Self> {
        self.require_tls("tls_cert_file")?;
        self.tls_files.client = Some((cert.into(), key.into()));
        Ok(self)
    }

    fn require_tls(&self, field: &'static str) -> Result<()> {
        if self.tls {
            Ok(())
        } else {
            Err(InvalidInput::OutOfRange {
                field,
                value: self.url.to_string(),
                expected: "an etcds:// URL (TLS options need TLS)",
            }
            .into())
        }
    }

    /// The URL (its `Display` and `Debug` redact the password).
    pub fn url(&self) -> &BackendUrl {
        &self.url
    }

    /// The members' gRPC endpoints (`http://host:port` or `https://host:port`).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The user name, if the URL carries credentials.
    pub fn user(&self) -> Option<&str> {
        self.user.as_ref().map(|(u, _)| u.as_str())
    }

    /// Whether the members are reached over TLS (`etcds://`).
    pub fn tls(&self) -> bool {
        self.tls
    }

    /// The CA file for `etcds://`, if any.
    pub fn tls_ca_file(&self) -> Option<&std::path::Path> {
        self.tls_files.ca_file.as_deref()
    }

    /// The name checked against the members' certificates, if not the host.
    pub fn tls_server_name(&self) -> Option<&str> {
        self.tls_files.server_name.as_deref()
    }

    /// [`EtcdConfig::tls_server_name`], under its earlier name.
    #[deprecated(note = "use tls_server_name, the name every adapter uses")]
    pub fn tls_domain(&self) -> Option<&str> {
        self.tls_server_name()
    }

    /// The client certificate and key files for `etcds://`, if any.
    pub fn tls_client_cert(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        self.tls_files
            .client
            .as_ref()
            .map(|(c, k)| (c.as_path(), k.as_path()))
    }

    /// The etcd-client connect options: credentials, TLS, timeouts, HTTP/2 keepalive.
    pub(crate) fn connect_options(&self) -> Result<etcd_client::ConnectOptions> {
        let mut o = etcd_client::ConnectOptions::new()
            .with_connect_timeout(self.connect_timeout())
            // etcd refuses pings more often than every 5 s (`--grpc-keepalive-min-time`); the
            // adapter's own request timeouts and session deadline bound everything else.
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(3))
            // Every request carries etcd's `hasleader` metadata: a member cut off from its
            // leader refuses requests and cancels its watch and keepalive streams (after a few
            // election timeouts) instead of serving a waiter's watch that can never fire or
            // acknowledging nothing; the adapter then re-reads, backs off, or ends the session.
            .with_require_leader(true);
        if let Some((user, password)) = &self.user {
            o = o
                .with_user(user.clone(), password.expose())
                .with_auto_token_refresh(true);
        }
        if self.tls {
            // Bounds the TLS handshake too (tonic's default has none).
            let mut tls = etcd_client::TlsOptions::new().timeout(self.connect_timeout());
            let url = &self.url;
            match &self.tls_files.ca_file {
                Some(path) => {
                    let pem = read_pem(url, "tls_ca_file", path, PemKind::Certificate)?;
                    tls = tls.ca_certificate(etcd_client::Certificate::from_pem(pem));
                }
                None => tls = tls.with_native_roots(),
            }
            if let Some(name) = &self.tls_files.server_name {
                tls = tls.domain_name(name.clone());
            }
            if let Some((cert, key)) = &self.tls_files.client {
                let cert = read_pem(url, "tls_cert_file", cert, PemKind::Certificate)?;
                let key = read_pem(url, "tls_key_file", key, PemKind::PrivateKey)?;
                tls = tls.identity(etcd_client::Identity::from_pem(cert, key));
            }
            o = o.with_tls(tls);
        }
        Ok(o)
    }
}

fn validate_prefix(prefix: &str) -> std::result::Result<(), &'static str> {
    if prefix.is_empty() {
        return Err("a non-empty prefix");
    }
    if prefix.len() > MAX_KEY_PREFIX_BYTES {
        return Err("at most 128 bytes");
    }
    if prefix.starts_with('/') || prefix.ends_with('/') {
        return Err("no leading or trailing '/'");
    }
    if prefix.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("no whitespace or control characters");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lease_core::{Error, Token};

    fn invalid(url: &str) -> String {
        match EtcdConfig::from_url(url) {
            Err(Error::InvalidInput(e)) => e.to_string(),
            other => panic!("{url}: expected InvalidInput, got {other:?}"),
        }
    }

    #[test]
    fn parses_options() {
        let c = EtcdConfig::from_url(
            "etcd://alice:s%40cret@127.0.0.1:2390?key_prefix=app/locks&token_floor=1000&endpoints=127.0.0.2:2391,h3:2392&request_timeout_ms=500&connect_timeout_ms=700",
        )
        .unwrap();
        assert_eq!(c.key_prefix(), "app/locks");
        assert_eq!(c.token_floor(), Some(Token::new(1000).unwrap()));
        assert_eq!(
            c.endpoints(),
            [
                "http://127.0.0.1:2390",
                "http://127.0.0.2:2391",
                "http://h3:2392"
            ]
        );
        assert_eq!(c.user(), Some("alice"));
        assert_eq!(c.user.as_ref().unwrap().1.expose(), "s@cret");
        assert_eq!(c.request_timeout(), Duration::from_millis(500));
        assert_eq!(c.connect_timeout(), Duration::from_millis(700));
        assert!(!c.tls());
    }

    #[test]
    fn defaults_and_host_lists() {
        let c = EtcdConfig::from_url("etcd://a,b").unwrap();
        assert_eq!(c.endpoints(), ["http://a:2379", "http://b:2379"]);
        let c = EtcdConfig::from_url("etcd://u:pw@a:1,b:2,c").unwrap();
        assert_eq!(c.endpoints(), ["http://a:1", "http://b:2", "http://c:2379"]);
        assert_eq!(c.key_prefix(), DEFAULT_KEY_PREFIX);
        assert_eq!(c.request_timeout(), DEFAULT_REQUEST_TIMEOUT);
        let c = EtcdConfig::from_url("etcds://h:1?tls_server_name=etcd.internal").unwrap();
        assert!(c.tls());
        assert_eq!(c.endpoints(), ["https://h:1"]);
        assert_eq!(c.tls_server_name(), Some("etcd.internal"));
        // The option's earlier name.
        let c = EtcdConfig::from_url("etcds://h:1?tls_domain=etcd.internal").unwrap();
        assert_eq!(c.tls_server_name(), Some("etcd.internal"));
        // A port is dropped, as on Consul: the same URL option names the same host.
        let c = EtcdConfig::from_url("etcds://h:1?tls_server_name=etcd.internal:2379").unwrap();
        assert_eq!(c.tls_server_name(), Some("etcd.internal"));
    }

    #[test]
    fn rejects_bad_input_naming_it_without_the_password() {
        for (url, needle) in [
            ("redis://u:pw@h:1", "not an etcd scheme"),
            ("etcd://u:pw@h:1/x", "path"),
            ("etcd://u:pw@h:1?nope=1", "unknown option \"nope\""),
            ("etcd://u:pw@h:1?key_prefix=", "key_prefix"),
            ("etcd://u:pw@h:1?key_prefix=/a", "leading"),
            ("etcd://u:pw@h:1?token_floor=-1", "token_floor"),
            (
                "etcd://u:pw@h:1?token_floor=9223372036854775807",
                "token_floor",
            ),
            ("etcd://u:pw@h:1?request_timeout_ms=0", "request_timeout_ms"),
            ("etcd://u:pw@h:1?endpoints=nohostport", "endpoints"),
            ("etcd://u:pw@h:1?tls_ca_file=/x", "etcds://"),
            ("etcd://u:pw@h:1?key_prefix=a&key_prefix=b", "twice"),
            ("etcd://:pw@h:1", "user name"),
            ("etcd://u:pw@h:1,,b:2", "host list"),
        ] {
            let e = invalid(url);
            assert!(e.contains(needle), "{url}: {e}");
            assert!(!e.contains("pw@"), "{url}: password shown: {e}");
        }
        assert!(matches!(
            EtcdConfig::from_url("etcd://u@h:1"),
            Err(Error::InvalidInput(_))
        ));
    }

    #[test]
    fn debug_and_display_redact_the_password() {
        let c = EtcdConfig::from_url("etcd://root:hunter2@127.0.0.1:2379?key_prefix=x").unwrap();
        for shown in [format!("{c}"), format!("{c:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
            assert!(shown.contains("root"), "{shown}");
        }
    }

    #[test]
    fn tls_options_parse_and_pair_up() {
        let c = EtcdConfig::from_url(
            "etcds://u:pw@h:1?tls_ca_file=/ca.pem&tls_cert_file=/c.pem&tls_key_file=/k.pem",
        )
        .unwrap();
        assert_eq!(c.tls_ca_file(), Some(std::path::Path::new("/ca.pem")));
        assert_eq!(
            c.tls_client_cert(),
            Some((
                std::path::Path::new("/c.pem"),
                std::path::Path::new("/k.pem")
            ))
        );
        for (url, needle) in [
            (
                "etcds://u:pw@h:1?tls_cert_file=/c.pem",
                "needs tls_key_file",
            ),
            (
                "etcds://u:pw@h:1?tls_key_file=/k.pem",
                "needs tls_cert_file",
            ),
            ("etcd://u:pw@h:1?tls_cert_file=/c.pem", "etcds://"),
            ("etcd://u:pw@h:1?tls_key_file=/k.pem", "etcds://"),
            ("etcds://u:pw@h:1?tls_cert_file=", "a file path"),
            ("etcd://u:pw@h:1?tls_server_name=x", "etcds://"),
            ("etcd://u:pw@h:1?tls_domain=x", "etcds://"),
            (
                "etcds://u:pw@h:1?tls_domain=x&tls_server_name=y",
                "not both",
            ),
            (
                "etcds://u:pw@h:1?tls_server_name=a%20b",
                "a DNS name or IP address",
            ),
        ] {
            let e = invalid(url);
            assert!(e.contains(needle), "{url}: {e}");
            assert!(!e.contains("pw@"), "{url}: password shown: {e}");
        }
        let plain = EtcdConfig::from_url("etcd://h").unwrap();
        assert!(plain.clone().with_tls_ca_file("/ca.pem").is_err());
        assert!(plain.clone().with_tls_server_name("x").is_err());
        assert!(plain.with_tls_client_cert("/c", "/k").is_err());
        let tls = EtcdConfig::from_url("etcds://h").unwrap();
        assert!(tls.clone().with_tls_server_name("").is_err());
        let tls = tls
            .with_tls_server_name("etcd.internal")
            .unwrap()
            .with_tls_client_cert("/c", "/k")
            .unwrap();
        assert_eq!(tls.tls_server_name(), Some("etcd.internal"));
        assert!(tls.tls_client_cert().is_some());
    }

    #[test]
    fn tls_files_are_checked_when_connecting_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("adapter-etcd-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let url = |q: String| format!("etcds://root:hunter2@h:1?{q}");
        let p = |f: &std::path::Path| f.display().to_string();
        let ok = EtcdConfig::from_url(&url(format!(
            "tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
            p(&cert),
            p(&cert),
            p(&key)
        )))
        .unwrap();
        assert!(ok.connect_options().is_ok());
        for (q, needle) in [
            (
                "tls_ca_file=/nonexistent/ca.pem".to_owned(),
                "tls_ca_file /nonexistent/ca.pem: cannot read",
            ),
            (format!("tls_ca_file={}", p(&key)), "no PEM certificate"),
            (
                format!("tls_cert_file={}&tls_key_file={}", p(&key), p(&key)),
                "tls_cert_file",
            ),
            (
                format!("tls_cert_file={}&tls_key_file={}", p(&cert), p(&cert)),
                "tls_key_file",
            ),
        ] {
            let c = EtcdConfig::from_url(&url(q.clone())).unwrap();
            let e = match c.connect_options() {
                Err(Error::InvalidInput(e)) => e.to_string(),
                Err(other) => panic!("{q}: expected InvalidInput, got {other:?}"),
                Ok(_) => panic!("{q}: accepted"),
            };
            assert!(e.contains(needle), "{q}: {e}");
            assert!(!e.contains("hunter2"), "{q}: password shown: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn builder_setters_check_ranges() {
        let c = EtcdConfig::from_url("etcd://h").unwrap();
        assert!(c.clone().with_key_prefix("").is_err());
        assert!(c.clone().with_request_timeout(Duration::ZERO).is_err());
        assert!(c
            .clone()
            .with_connect_timeout(Duration::from_secs(601))
            .is_err());
        let c = c.with_token_floor(Token::new(5).unwrap()).unwrap();
        assert_eq!(c.token_floor(), Some(Token::new(5).unwrap()));
    }
}
