//! `rediss://`: TLS with a private CA (`tls_ca_file`) and a client certificate (`tls_cert_file`,
//! `tls_key_file`), plus a password, against redis-server's TLS port with `tls-auth-clients yes`
//! (its default once TLS is on).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use adapter_redis::{RedisCoordinator, RedisFence};
use conformance_tests::harness::{find_in_path, free_ports, server_unavailable};
use lease_core::{Bytes, Coordinator, Error, Fence, Lease, LeaseOptions, ResourceId};

use crate::common::{durable, key, server};

const PW: &str = "tls-pw-7c1";

/// A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, made with the
/// `openssl` CLI.
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
    // A key and a certificate `<name>.key` / `<name>.crt` for `cn`, signed by the CA, with the
    // X.509 v3 extension `ext` (rustls refuses v1 certificates).
    let signed = |name: &str, cn: &str, ext: &str| -> Result<(), String> {
        let (key, csr, crt, ext_file) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("{name}.ext"),
        );
        std::fs::write(dir.join(&ext_file), format!("{ext}\n")).map_err(|e| e.to_string())?;
        let subj = format!("/CN={cn}");
        run(&[
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj", &subj,
        ])?;
        run(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "1",
            "-extfile",
            &ext_file,
        ])
    };
    signed(
        "srv",
        "localhost",
        "subjectAltName=DNS:localhost,IP:127.0.0.1",
    )?;
    signed("cli", "fenced-test-client", "extendedKeyUsage=clientAuth")
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::test]
async fn rediss_with_a_private_ca_a_client_certificate_and_a_password() {
    const NAME: &str = "rediss_with_a_private_ca_a_client_certificate_and_a_password";
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
        "yes".into(),
    ];
    let Some(_srv) = server(NAME, config) else {
        return;
    };

    let url = format!(
        "rediss://:{PW}@127.0.0.1:{tls_port}/?tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
        path("ca.crt"),
        path("cli.crt"),
        path("cli.key")
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

    // Without the private CA the server certificate is not trusted, and without the client
    // certificate the server refuses the handshake: no connection, no secret shown.
    for refused in [
        format!("rediss://:{PW}@127.0.0.1:{tls_port}/?connect_timeout_ms=2000"),
        format!(
            "rediss://:{PW}@127.0.0.1:{tls_port}/?connect_timeout_ms=2000&tls_ca_file={}",
            path("ca.crt")
        ),
    ] {
        match RedisCoordinator::connect_url(&refused).await {
            Err(e @ Error::Misconfigured { .. }) => {
                assert!(!e.to_string().contains(PW) && !format!("{e:?}").contains(PW));
            }
            other => panic!("{refused}: expected Misconfigured, got {other:?}"),
        }
    }
    // A key file that holds no key is named before anything is sent.
    let wrong_key = url.replace(&path("cli.key"), &path("cli.crt"));
    match RedisCoordinator::connect_url(&wrong_key).await {
        Err(Error::InvalidInput(e)) => {
            let e = e.to_string();
            assert!(e.contains("tls_key_file") && e.contains("cli.crt"), "{e}");
            assert!(!e.contains(PW), "{e}");
        }
        other => panic!("expected InvalidInput naming the key file, got {other:?}"),
    }
}
