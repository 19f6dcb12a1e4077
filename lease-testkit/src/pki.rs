//! A test PKI made with `rcgen`: a self-signed CA ([`TestCa`]) that signs server and client
//! certificates ([`Leaf`]), and [`write_pem`] to put them in files for the servers and clients
//! that read PEM from disk. Every function panics on failure: this is test code.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::harness::postgres::PostgresTls;

/// A self-signed certificate authority (key usages `keyCertSign` and `cRLSign`) with a fresh
/// key, signing the leaves of one test.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate signed by a [`TestCa`] and its private key, both PEM.
#[derive(Clone)]
pub struct Leaf {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The certificate's private key, PEM (PKCS#8).
    pub key_pem: String,
}

impl std::fmt::Debug for Leaf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaf")
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

impl From<Leaf> for PostgresTls {
    fn from(leaf: Leaf) -> Self {
        PostgresTls {
            cert_pem: leaf.cert_pem,
            key_pem: leaf.key_pem,
        }
    }
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA whose subject is the common name `common_name`.
    pub fn new(common_name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        TestCa { issuer }
    }

    /// The CA's certificate, PEM: what a client or server is told to trust.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for `names` (subject alternative names: DNS names, or IP addresses
    /// when they parse as one), common name the first of them. Its extended key usages are
    /// server and client authentication, since etcd 3.4's gateway presents the server
    /// certificate as a client certificate.
    pub fn server(&self, names: &[&str]) -> Leaf {
        let sans = names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let mut params = CertificateParams::new(sans).unwrap();
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, *first);
        }
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        self.sign(params)
    }

    /// A client certificate (extended key usage client authentication, no subject alternative
    /// names) with common name `common_name`, which servers such as PostgreSQL (`cert`
    /// authentication) and etcd (`--client-cert-auth`) take as the user name.
    pub fn client(&self, common_name: &str) -> Leaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// Writes `pem` to the file `name` in `dir` (replacing it) and returns the file's path.
pub fn write_pem(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    path
}
