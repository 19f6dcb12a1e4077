//! `rediss://`: TLS with a private CA (`tls_ca_file`), plus a password, against redis-server's TLS
//! port.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use adapter_redis::{RedisCoordinator, RedisFence};
use conformance_tests::harness::{find_in_path, free_ports, server_unavailable};
use lease_core::{Bytes, Coordinator, Error, Fence, Lease, LeaseOptions, ResourceId};

use crate::common::{durable, key, server};

const PW: &str = "tls-pw-7c1";

/// A CA and a server certificate for 127.0.0.1 / localhost, made with the `openssl` CLI.
fn make_certs(dir: &Path) -> Result<(), String> {
    let run = |args: &[&str]| -> Result<(), String> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .map_err(|e| format!("openssl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=fenced-test-ca",
    ])?;
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=localhost",
    ])?;
    std::fs::write(
        dir.join("ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .map_err(|e| e.to_string())?;
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.crt",
        "-days",
        "1",
        "-extfile",
        "ext",
    ])
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn rediss_with_a_private_ca_and_password() {
    const NAME: &str = "rediss_with_a_private_ca_and_password";
    if find_in_path("openssl").is_none() {
        server_unavailable(
            NAME,
            "openssl not found in PATH (needed to make test certificates)",
        )
        .unwrap_or_else(|e| panic!("{e}"))
        .report();
        return;
    }
    let dir = TempDir(std::env::temp_dir().join(format!(
        "fenced-redis-tls-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    )));
    std::fs::create_dir_all(&dir.0).unwrap();
    make_certs(&dir.0).unwrap();
    let tls_port = free_ports(1).unwrap()[0];
    let path = |f: &str| dir.0.join(f).display().to_string();
    let mut config = durable();
    config.requirepass = Some(PW.into());
    config.extra_args = vec![
        "--tls-port".into(),
        tls_port.to_string(),
        "--tls-cert-file".into(),
        path("srv.crt"),
        "--tls-key-file".into(),
        path("srv.key"),
        "--tls-ca-cert-file".into(),
        path("ca.crt"),
        "--tls-auth-clients".into(),
        "no".into(),
    ];
    let Some(_srv) = server(NAME, config) else {
        return;
    };

    let url = format!(
        "rediss://:{PW}@127.0.0.1:{tls_port}/?tls_ca_file={}",
        path("ca.crt")
    );
    let c = RedisCoordinator::connect_url(&url)
        .await
        .unwrap_or_else(|e| panic!("TLS connect: {e}"));
    assert!(!format!("{c:?}").contains(PW));
    let k = key("tls");
    let lease = c
        .try_acquire(&k, &LeaseOptions::new(Duration::from_secs(5)))
        .await
        .unwrap();
    let f = RedisFence::connect_url(&url).await.unwrap();
    f.write(
        &ResourceId::from(&k),
        lease.token(),
        Bytes::from_static(b"over tls"),
    )
    .await
    .unwrap();
    lease.release().await.unwrap();

    // Without the private CA the server certificate is not trusted: no connection, no secret.
    let untrusted = format!("rediss://:{PW}@127.0.0.1:{tls_port}/?connect_timeout_ms=2000");
    match RedisCoordinator::connect_url(&untrusted).await {
        Err(e @ Error::Unavailable { .. }) => {
            assert!(!e.to_string().contains(PW) && !format!("{e:?}").contains(PW));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}
