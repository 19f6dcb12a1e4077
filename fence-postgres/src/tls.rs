//! TLS through rustls (ring): the `sslmode` ladder of libpq.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use lease_core::{Error, InvalidInput, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    AlertDescription, CertificateError, ClientConfig, DigitallySignedStruct, InconsistentKeys,
    RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::BACKEND;

/// How a connection uses TLS: libpq's `sslmode`, with libpq's meanings.
///
/// | mode | encrypted | server certificate checked |
/// | --- | --- | --- |
/// | `disable` | never | - |
/// | `prefer` (default) | if the server offers TLS, else plain | no |
/// | `require` | always (fails if the server has no TLS) | no; with `sslrootcert`, as `verify-ca` (as libpq) |
/// | `verify-ca` | always | chain to a root in `sslrootcert`; any host name |
/// | `verify-full` | always | chain to a root in `sslrootcert`, and the URL's host name is in the certificate |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS if the server offers it, without checking its certificate; plain otherwise.
    Prefer,
    /// TLS always, without checking the certificate (unless `sslrootcert` is given).
    Require,
    /// TLS always; the certificate must chain to a root in `sslrootcert`.
    VerifyCa,
    /// TLS always; chain to a root in `sslrootcert` and the host name must match.
    VerifyFull,
}

impl SslMode {
    /// Parses a libpq `sslmode` value.
    pub fn parse(s: &str) -> Option<SslMode> {
        Some(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    /// The libpq spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the mode needs `sslrootcert`.
    pub(crate) fn needs_root(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }

    /// The mode handed to tokio-postgres (which knows only the first three).
    pub(crate) fn wire(self) -> tokio_postgres::config::SslMode {
        match self {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the trusted roots come from (`sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RootCert {
    /// A PEM file of one or more CA certificates.
    File(PathBuf),
    /// `sslrootcert=system`: the platform's trust store.
    System,
}

/// A client certificate for the server's `cert` authentication (or `clientcert=verify-*`):
/// `sslcert` and `sslkey`, both PEM files. Only the paths are kept; the key is read when the
/// connector is built and lives on only inside rustls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ClientCert {
    /// `sslcert`: the certificate chain, client certificate first.
    pub(crate) cert: PathBuf,
    /// `sslkey`: its private key (PKCS#8, PKCS#1 or SEC1; not encrypted).
    pub(crate) key: PathBuf,
}

fn load_roots(root: &RootCert) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    let certs: Vec<CertificateDer<'static>> = match root {
        RootCert::File(path) => CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| {
                Error::misconfigured(BACKEND, format!("sslrootcert {}: {e}", path.display()))
            })?,
        RootCert::System => rustls_native_certs::load_native_certs().certs,
    };
    let (added, _ignored) = store.add_parsable_certificates(certs);
    if added == 0 {
        let what = match root {
            RootCert::File(path) => path.display().to_string(),
            RootCert::System => "system".into(),
        };
        return Err(Error::misconfigured(
            BACKEND,
            format!("sslrootcert {what}: no usable CA certificate (PEM) in it"),
        ));
    }
    Ok(store)
}

/// Whether a PEM file holds an encrypted private key: PKCS#8 `ENCRYPTED PRIVATE KEY`, or the
/// legacy OpenSSL form (`Proc-Type: 4,ENCRYPTED` in a `RSA/EC PRIVATE KEY` section).
fn is_encrypted_key(pem: &[u8]) -> bool {
    let has = |needle: &[u8]| pem.windows(needle.len()).any(|w| w == needle);
    has(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") || has(b"Proc-Type: 4,ENCRYPTED")
}

/// Reads `sslcert` and `sslkey`. No message quotes the key file's contents (the parser's own
/// errors are not passed on: they may quote a line of it).
///
/// An encrypted key is `InvalidInput` naming `sslkey` (there is no `sslpassword`); a file that
/// cannot be read or holds no certificate or key is `Misconfigured`, as for `sslrootcert`.
fn load_client_cert(
    client: &ClientCert,
    url: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)> {
    let cert_path = client.cert.display();
    // Only an I/O error is quoted: a parse error may quote a line of the file (which could be
    // the key, given as sslcert by mistake).
    let pem_error = |option: &str, path: &dyn fmt::Display, e: rustls::pki_types::pem::Error| {
        let why = match e {
            rustls::pki_types::pem::Error::Io(e) => e.to_string(),
            rustls::pki_types::pem::Error::NoItemsFound => "nothing usable in it".into(),
            _ => "not a readable PEM file".into(),
        };
        Error::misconfigured(BACKEND, format!("{option} {path}: {why}"))
    };
    let certs = CertificateDer::pem_file_iter(&client.cert)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| pem_error("sslcert", &cert_path, e))?;
    if certs.is_empty() {
        return Err(Error::misconfigured(
            BACKEND,
            format!("sslcert {cert_path}: no certificate (PEM) in it"),
        ));
    }
    let key_path = client.key.display();
    let pem = std::fs::read(&client.key)
        .map_err(|e| Error::misconfigured(BACKEND, format!("sslkey {key_path}: {e}")))?;
    if is_encrypted_key(&pem) {
        return Err(InvalidInput::Url {
            url: url.to_owned(),
            problem: format!(
                "sslkey {key_path}: the private key is encrypted (passphrase-protected), which \
                 is not supported (no sslpassword): store it decrypted, for example \
                 `openssl pkey -in KEY -out KEY.plain`, readable only by this process's user"
            ),
        }
        .into());
    }
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        let why = match e {
            rustls::pki_types::pem::Error::NoItemsFound => "no private key in it",
            _ => "not a readable PEM file",
        };
        Error::misconfigured(
            BACKEND,
            format!(
                "sslkey {key_path}: {why} (expected PEM: PRIVATE KEY, RSA PRIVATE KEY or \
                 EC PRIVATE KEY)"
            ),
        )
    })?;
    Ok((certs, key))
}

/// The rustls connector for `mode` (with `root` for the verifying modes), presenting `client`'s
/// certificate when the server asks for one. `url` (redacted) is for the errors. A connector is
/// also built for `disable` (tokio-postgres then never uses it), so the pool has one type.
pub(crate) fn connector(
    mode: SslMode,
    root: Option<&RootCert>,
    client: Option<&ClientCert>,
    url: &str,
) -> Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::misconfigured(BACKEND, format!("TLS: {e}")))?;
    let verify_ca = |roots: RootCertStore| -> Result<Arc<WebPkiServerVerifier>> {
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| Error::misconfigured(BACKEND, format!("sslrootcert: {e}")))
    };
    let builder = match (mode, root) {
        (SslMode::VerifyFull, Some(root)) => builder.with_root_certificates(load_roots(root)?),
        (SslMode::VerifyCa | SslMode::Require, Some(root)) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyHostName(verify_ca(load_roots(root)?)?))),
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(Error::misconfigured(
                BACKEND,
                format!("sslmode={mode} needs sslrootcert=<PEM file> (or sslrootcert=system)"),
            ))
        }
        (SslMode::Disable | SslMode::Prefer | SslMode::Require, _) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider.clone()))),
    };
    let mut config = match client {
        None => builder.with_no_client_auth(),
        Some(client) => {
            let (certs, key) = load_client_cert(client, url)?;
            // rustls checks that the key belongs to the certificate; its errors name no key bytes.
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                let (cert, key) = (client.cert.display(), client.key.display());
                Error::misconfigured(
                    BACKEND,
                    match e {
                        rustls::Error::InconsistentKeys(InconsistentKeys::KeyMismatch) => {
                            format!("sslkey {key} is not the private key of sslcert {cert}")
                        }
                        e => format!("sslcert {cert} / sslkey {key}: {e}"),
                    },
                )
            })?
        }
    };
    // PostgreSQL 17+ checks the ALPN protocol when the client sends one.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(MakeRustlsConnect::new(config))
}

/// The TLS alert the server sent, if `e` (or an error in its chain) is rustls reporting one
/// (tokio-rustls wraps rustls's errors in an `io::Error`, whose `source` skips the wrapped one).
pub(crate) fn received_alert(e: &(dyn std::error::Error + 'static)) -> Option<AlertDescription> {
    let mut next = Some(e);
    while let Some(cause) = next {
        let tls = cause.downcast_ref::<rustls::Error>().or_else(|| {
            cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(rustls::Error::AlertReceived(alert)) = tls {
            return Some(*alert);
        }
        next = cause.source();
    }
    None
}

/// Whether the server's `alert` says it refused the client's certificate (or its absence).
pub(crate) fn is_client_cert_alert(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::CertificateRequired
            | AlertDescription::AccessDenied
            | AlertDescription::DecryptError
    )
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is not compared. webpki
/// checks the chain before the name, so a name mismatch means the chain was good.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer` and `require` without `sslrootcert`: encrypted, the certificate is not checked
/// (the handshake signature still is, so the peer holds the certificate's key).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
