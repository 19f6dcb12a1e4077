//! TLS through rustls (ring): the `sslmode` ladder of libpq.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use lease_core::{Error, Result};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
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

fn misconfigured(problem: String) -> Error {
    Error::Misconfigured {
        backend: BACKEND,
        problems: vec![problem],
    }
}

fn load_roots(root: &RootCert) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    let certs: Vec<CertificateDer<'static>> = match root {
        RootCert::File(path) => CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|e| misconfigured(format!("sslrootcert {}: {e}", path.display())))?,
        RootCert::System => rustls_native_certs::load_native_certs().certs,
    };
    let (added, _ignored) = store.add_parsable_certificates(certs);
    if added == 0 {
        let what = match root {
            RootCert::File(path) => path.display().to_string(),
            RootCert::System => "system".into(),
        };
        return Err(misconfigured(format!(
            "sslrootcert {what}: no usable CA certificate (PEM) in it"
        )));
    }
    Ok(store)
}

/// The rustls connector for `mode` (with `root` for the verifying modes). A connector is also
/// built for `disable` (tokio-postgres then never uses it), so the pool has one type.
pub(crate) fn connector(mode: SslMode, root: Option<&RootCert>) -> Result<MakeRustlsConnect> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| misconfigured(format!("TLS: {e}")))?;
    let verify_ca = |roots: RootCertStore| -> Result<Arc<WebPkiServerVerifier>> {
        WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| misconfigured(format!("sslrootcert: {e}")))
    };
    let mut config = match (mode, root) {
        (SslMode::VerifyFull, Some(root)) => builder
            .with_root_certificates(load_roots(root)?)
            .with_no_client_auth(),
        (SslMode::VerifyCa | SslMode::Require, Some(root)) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyHostName(verify_ca(load_roots(root)?)?)))
            .with_no_client_auth(),
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(misconfigured(format!(
                "sslmode={mode} needs sslrootcert=<PEM file> (or sslrootcert=system)"
            )))
        }
        (SslMode::Disable | SslMode::Prefer | SslMode::Require, _) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider.clone())))
            .with_no_client_auth(),
    };
    // PostgreSQL 17+ checks the ALPN protocol when the client sends one.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(MakeRustlsConnect::new(config))
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
