//! Test PKI shared by the TLS tests and the suite: a CA, a server certificate it signed, and
//! client certificates it signs on demand.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use conformance_tests::harness::postgres::PostgresTls;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A CA and a server certificate it signed for `localhost` (a DNS name only: `127.0.0.1` does
/// not match it).
pub(crate) struct Pki {
    pub(crate) ca_pem: String,
    pub(crate) server: PostgresTls,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A client certificate and its private key, PEM.
pub(crate) struct ClientLeaf {
    pub(crate) cert_pem: String,
    pub(crate) key_pem: String,
}

pub(crate) fn make_pki(ca_name: &str) -> Pki {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, ca_name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, "localhost");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = leaf.signed_by(&key, &ca).unwrap();
    Pki {
        ca_pem: ca.pem(),
        server: PostgresTls {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
        ca,
    }
}

impl Pki {
    /// A client certificate signed by this CA with common name `cn` (PostgreSQL's `cert`
    /// authentication compares it with the user name).
    pub(crate) fn client(&self, cn: &str) -> ClientLeaf {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        ClientLeaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

pub(crate) fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap();
    path
}
