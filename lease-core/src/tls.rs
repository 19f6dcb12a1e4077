//! The TLS options every adapter spells the same way ([`TlsFiles`]), and the PEM files they
//! name ([`read_pem`]).

use std::path::{Path, PathBuf};

use crate::connect::{BackendUrl, HostPort};
use crate::error::InvalidInput;
use crate::url_options::UrlOptions;

/// What a URL says about TLS beyond its scheme, under the same names on every backend:
///
/// | option | meaning |
/// |---|---|
/// | `tls_ca_file` | PEM file of the CA(s) that signed the server certificate, trusted instead of the system roots |
/// | `tls_cert_file`, `tls_key_file` | PEM client certificate (chain) and its private key, for servers that check clients' certificates (mutual TLS); both or neither |
/// | `tls_server_name` | the name the server certificate is checked against and sent as SNI (default: the host); a `:port` after it is dropped ([`server_name`]) |
///
/// Each needs a URL whose scheme asks for TLS. The files are read when the adapter connects
/// ([`read_pem`]), so a config can be built on a machine that does not hold them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// `tls_ca_file`.
    pub ca_file: Option<PathBuf>,
    /// `tls_cert_file` and `tls_key_file`, in that order.
    pub client: Option<(PathBuf, PathBuf)>,
    /// `tls_server_name`.
    pub server_name: Option<String>,
}

impl TlsFiles {
    /// Takes the TLS options out of `options` (the adapter's
    /// [`OptionSpec`](crate::adapter::OptionSpec) lists all four). `tls` says whether the URL's scheme asks for TLS;
    /// when it does not, any of them is refused as needing `tls_url` (for example
    /// `"an etcds:// URL"`). A certificate without its key (or the reverse) is refused, as is a
    /// server name that cannot be one.
    pub fn take(
        options: &mut UrlOptions<'_>,
        tls: bool,
        tls_url: &str,
    ) -> Result<TlsFiles, InvalidInput> {
        let mut given = Vec::new();
        let mut path = |options: &mut UrlOptions<'_>, name: &'static str| {
            let p = options.path(name)?;
            if p.is_some() {
                given.push(name);
            }
            Ok::<_, InvalidInput>(p)
        };
        let ca_file = path(options, "tls_ca_file")?;
        let cert = path(options, "tls_cert_file")?;
        let key = path(options, "tls_key_file")?;
        let server_name = options.value("tls_server_name", SERVER_NAME, server_name)?;
        if server_name.is_some() {
            given.push("tls_server_name");
        }
        if let (Some(name), false) = (given.first(), tls) {
            return Err(options.invalid(format!("{name} needs {tls_url} (TLS options need TLS)")));
        }
        let client = match (cert, key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(_), None) => {
                return Err(options
                    .invalid("tls_cert_file needs tls_key_file (the certificate's private key)"))
            }
            (None, Some(_)) => {
                return Err(
                    options.invalid("tls_key_file needs tls_cert_file (the client certificate)")
                )
            }
        };
        Ok(TlsFiles {
            ca_file,
            client,
            server_name,
        })
    }
}

/// What a server name must be.
const SERVER_NAME: &str = "a DNS name or IP address";

/// The server name in `value`, checked: a host name or IP address, whose `:port` (after a host
/// or a bracketed IPv6 address) and brackets are dropped, as Go's clients do for
/// `tls_server_name`-style settings, so `members.example:2379` and `[::1]:8501` name the hosts.
/// Parsed as a host list's entry is ([`HostPort::parse`]), and a bare IPv6 address is taken as
/// it is. `Err` says what it must be.
///
/// ```
/// use lease_core::adapter::server_name;
///
/// assert_eq!(server_name("etcd.internal:2379").unwrap(), "etcd.internal");
/// assert_eq!(server_name("[::1]:8501").unwrap(), "::1");
/// assert_eq!(server_name("10.0.0.7").unwrap(), "10.0.0.7");
/// assert!(server_name("etcd internal").is_err());
/// ```
pub fn server_name(value: &str) -> Result<String, &'static str> {
    if value.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok(value.to_owned());
    }
    // Any default port: only the host is kept.
    HostPort::parse(value, Some(1))
        .map(|hp| hp.host)
        .map_err(|_| SERVER_NAME)
}

/// What a PEM file given to a TLS option must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PemKind {
    /// At least one certificate (`-----BEGIN CERTIFICATE-----`).
    Certificate,
    /// An unencrypted private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

/// Reads the PEM file `path`, named by the option `option` of `url`, and checks that it holds a
/// `kind` block, so that a wrong or missing file is named here instead of failing inside the TLS
/// stack: the error is [`BackendUrl::invalid`] with `"<option> <path>: <problem>"`.
pub fn read_pem(
    url: &BackendUrl,
    option: &str,
    path: &Path,
    kind: PemKind,
) -> Result<Vec<u8>, InvalidInput> {
    let problem = |what: String| url.invalid(format!("{option} {}: {what}", path.display()));
    let pem = std::fs::read(path).map_err(|e| problem(format!("cannot read: {e}")))?;
    let text = String::from_utf8_lossy(&pem);
    let found = text.lines().map(str::trim).any(|line| match kind {
        PemKind::Certificate => line == "-----BEGIN CERTIFICATE-----",
        PemKind::PrivateKey => {
            line.starts_with("-----BEGIN ")
                && line.ends_with("PRIVATE KEY-----")
                && !line.contains("ENCRYPTED")
        }
    });
    if !found {
        return Err(problem(match kind {
            PemKind::Certificate => "no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
            PemKind::PrivateKey => {
                "no unencrypted PEM private key (-----BEGIN PRIVATE KEY-----, RSA or EC)".into()
            }
        }));
    }
    Ok(pem)
}

/// A TLS handshake that a retry will not fix, as rustls words it in an error's sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsRefusal {
    /// This client refused the server's certificate (`invalid peer certificate: ...`: not signed
    /// by a trusted CA, not for the name, expired): fixed by `tls_ca_file` or `tls_server_name`.
    ServerCertificate(String),
    /// The server refused the handshake (`received fatal alert: ...`), typically because it
    /// requires a client certificate it did not get or does not trust: fixed by
    /// `tls_cert_file` and `tls_key_file`.
    ByServer(String),
}

impl TlsRefusal {
    /// Walks `err` and its sources for rustls' message of a refused handshake (client
    /// libraries wrap it in their own errors, gRPC statuses or I/O errors, sometimes only as
    /// text); `None` when there is none. The detail is the message from the marker on, at most
    /// about 300 characters, unquoted.
    pub fn find(err: &(dyn std::error::Error + 'static)) -> Option<TlsRefusal> {
        let mut next = Some(err);
        while let Some(e) = next {
            // Its text first; some wrappers show their cause only in `Debug`, quoted.
            for shown in [e.to_string(), format!("{e:?}")] {
                if let Some(at) = shown.find("invalid peer certificate") {
                    return Some(TlsRefusal::ServerCertificate(unquoted(&shown[at..])));
                }
                if let Some(at) = shown.find("received fatal alert") {
                    return Some(TlsRefusal::ByServer(unquoted(&shown[at..])));
                }
            }
            next = e.source();
        }
        None
    }
}

/// The text up to the end of the quoted string it starts in (as `Debug` shows it), unescaped.
fn unquoted(s: &str) -> String {
    let mut out = String::new();
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(n) => out.push(n),
                None => break,
            },
            '"' => break,
            c => out.push(c),
        }
        if out.len() >= 300 {
            break;
        }
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::url_options::OptionSpec;

    #[test]
    fn a_server_name_drops_its_port_and_brackets_but_keeps_a_bare_ipv6_address() {
        for (value, name) in [
            ("etcd.internal", "etcd.internal"),
            ("etcd.internal:2379", "etcd.internal"),
            ("10.0.0.7:8501", "10.0.0.7"),
            ("[::1]:8501", "::1"),
            ("[fe80::1]", "fe80::1"),
            ("fe80::1", "fe80::1"),
        ] {
            assert_eq!(server_name(value).as_deref(), Ok(name), "{value}");
        }
        for bad in ["", ":2379", "[]:1", "a b", "a/b", "a\tb"] {
            assert_eq!(server_name(bad), Err(SERVER_NAME), "{bad:?}");
        }
    }

    #[test]
    fn a_refused_handshake_is_found_in_the_sources_and_other_errors_are_not() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("transport error")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let io = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
        let untrusted = Wrapper(io("invalid peer certificate: UnknownIssuer"));
        assert_eq!(
            TlsRefusal::find(&untrusted),
            Some(TlsRefusal::ServerCertificate(
                "invalid peer certificate: UnknownIssuer".into()
            ))
        );
        let alert = Wrapper(io("received fatal alert: CertificateRequired"));
        assert_eq!(
            TlsRefusal::find(&alert),
            Some(TlsRefusal::ByServer(
                "received fatal alert: CertificateRequired".into()
            ))
        );
        assert_eq!(TlsRefusal::find(&Wrapper(io("connection refused"))), None);
    }

    const SPEC: OptionSpec = OptionSpec {
        backend: &[
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "tls_server_name",
        ],
        secret: &[],
        key_prefix: |_| Ok(()),
    };

    fn take(url: &str, tls: bool) -> Result<TlsFiles, String> {
        let url = BackendUrl::parse(url).unwrap();
        let (_, mut options) = UrlOptions::parse(&url, SPEC).unwrap();
        TlsFiles::take(&mut options, tls, "a tls:// URL").map_err(|e| e.to_string())
    }

    #[test]
    fn the_options_parse_pair_up_and_need_tls() {
        let t = take(
            "x://h?tls_ca_file=/ca&tls_cert_file=/c&tls_key_file=/k&tls_server_name=n.example",
            true,
        )
        .unwrap();
        assert_eq!(t.ca_file.as_deref(), Some(Path::new("/ca")));
        assert_eq!(t.client, Some(("/c".into(), "/k".into())));
        assert_eq!(t.server_name.as_deref(), Some("n.example"));
        assert_eq!(take("x://h", false).unwrap(), TlsFiles::default());
        for (url, needle) in [
            ("x://h?tls_key_file=/k", "tls_key_file needs a tls:// URL"),
            (
                "x://h?tls_server_name=n",
                "tls_server_name needs a tls:// URL",
            ),
        ] {
            let e = take(url, false).unwrap_err();
            assert!(e.contains(needle), "{url}: {e}");
        }
        for (url, needle) in [
            ("x://h?tls_cert_file=/c", "needs tls_key_file"),
            ("x://h?tls_key_file=/k", "needs tls_cert_file"),
            ("x://h?tls_server_name=a%2Fb", "a DNS name or IP address"),
            ("x://h?tls_ca_file=", "a file path"),
        ] {
            let e = take(url, true).unwrap_err();
            assert!(e.contains(needle), "{url}: {e}");
        }
    }

    #[test]
    fn read_pem_names_the_option_and_the_file() {
        let dir = std::env::temp_dir().join(format!("lease-core-pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(
            &cert,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        std::fs::write(
            &key,
            "-----BEGIN EC PRIVATE KEY-----\nAA==\n-----END EC PRIVATE KEY-----\n",
        )
        .unwrap();
        let url = BackendUrl::parse("x://u:hunter2@h").unwrap();
        assert!(read_pem(&url, "tls_ca_file", &cert, PemKind::Certificate).is_ok());
        assert!(read_pem(&url, "tls_key_file", &key, PemKind::PrivateKey).is_ok());
        let wrong = read_pem(&url, "tls_key_file", &cert, PemKind::PrivateKey)
            .unwrap_err()
            .to_string();
        assert!(
            wrong.contains("tls_key_file") && wrong.contains("cert.pem"),
            "{wrong}"
        );
        assert!(wrong.contains("no unencrypted PEM private key"), "{wrong}");
        let missing = read_pem(
            &url,
            "tls_ca_file",
            &dir.join("none.pem"),
            PemKind::Certificate,
        )
        .unwrap_err()
        .to_string();
        assert!(
            missing.contains("none.pem") && missing.contains("cannot read"),
            "{missing}"
        );
        assert!(!wrong.contains("hunter2") && !missing.contains("hunter2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
