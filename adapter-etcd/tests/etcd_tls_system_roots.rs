//! `etcds://` without `tls_ca_file` trusts the system roots. The test makes its generated CA
//! the system roots through `SSL_CERT_FILE` (honoured by `rustls-native-certs`), which is
//! process-wide: hence this file's single test, which sets it before any thread starts.

use std::time::Duration;

use adapter_etcd::EtcdCoordinator;
use conformance_tests::harness::etcd::EtcdTls;
use conformance_tests::harness::{start_or_skip, Backend, EtcdConfig as ServerConfig, EtcdServer};
use conformance_tests::pki::{write_pem, TestCa};
use lease_core::{Coordinator, LeaseOptions, LockKey};

#[test]
fn etcds_without_a_ca_file_trusts_the_system_roots() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("system CA");
    let server_cert = ca.server(&["127.0.0.1"]);
    let ca_file = write_pem(dir.path(), "ca.pem", &ca.pem());
    let cert_file = write_pem(dir.path(), "server.pem", &server_cert.cert_pem);
    let key_file = write_pem(dir.path(), "server-key.pem", &server_cert.key_pem);
    // Before any other thread exists (the test harness runs this file's only test on one).
    std::env::set_var("SSL_CERT_FILE", &ca_file);
    std::env::remove_var("SSL_CERT_DIR");

    let Some(server) = start_or_skip(
        "etcds_without_a_ca_file_trusts_the_system_roots",
        Backend::Etcd,
        || {
            EtcdServer::start_with(ServerConfig {
                tls: Some(EtcdTls::new(&cert_file, &key_file)),
                ..ServerConfig::default()
            })
        },
    ) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let c = EtcdCoordinator::connect_url(&server.adapter_url())
            .await
            .expect("connect trusting the system roots");
        let lease = c
            .try_acquire(
                &LockKey::new("system-roots").unwrap(),
                &LeaseOptions::new(Duration::from_secs(2)),
            )
            .await
            .expect("acquire over TLS trusting the system roots");
        lease.release().await.unwrap();
    });
}
