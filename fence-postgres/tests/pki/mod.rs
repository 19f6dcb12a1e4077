//! Test PKI shared by the TLS tests and the suite: a CA and a server certificate it signed.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use conformance_tests::harness::postgres::PostgresTls;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// A CA and a server certificate it signed for `localhost` (a DNS name only: `127.0.0.1` does
/// not match it).
pub(crate) struct Pki {
    pub(crate) ca_pem: String,
    pub(crate) server: PostgresTls,
}

pub(crate) fn make_pki(ca_name: &str) -> Pki {
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, ca_name);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let mut leaf = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    leaf.distinguished_name
        .push(DnType::CommonName, "localhost");
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let cert = leaf.signed_by(&key, &ca_cert, &ca_key).unwrap();
    Pki {
        ca_pem: ca_cert.pem(),
        server: PostgresTls {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
    }
}

pub(crate) fn write(dir: &Path, name: &str, pem: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, pem).unwrap();
    path
}
