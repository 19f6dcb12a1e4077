//! `etcds://` end to end against a real `etcd` started by the conformance harness with TLS on
//! its client port, using certificates from the test kit's PKI (`conformance_tests::pki`): a CA, a server certificate
//! for `127.0.0.1`/`localhost` and client certificates. Covers the right CA (acquire, renew,
//! release, the fence), a wrong CA or name (a prompt `Misconfigured` naming the TLS problem),
//! client-certificate authentication (given, missing, from another CA) and a password over TLS
//! that never shows. Without an `etcd` binary each test is a named skip (a failure under
//! `CI=true`).

use std::path::PathBuf;
use std::time::Duration;

use adapter_etcd::etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use adapter_etcd::{EtcdConfig, EtcdCoordinator, EtcdFence};
use bytes::Bytes;
use conformance_tests::harness::etcd::EtcdTls;
use conformance_tests::harness::EtcdServer;
use conformance_tests::harness::{start_or_skip_async, Backend, EtcdConfig as ServerConfig};
use conformance_tests::pki::{write_pem, TestCa};
use lease_core::{Coordinator, Error, Fence, LeaseOptions, LockKey, ResourceId};
use tempfile::TempDir;
use tokio::time::Instant;

const TTL: Duration = Duration::from_secs(2);

/// A bound on how long a refused TLS connection may take to be reported (connect timeout 2 s,
/// request timeout 1 s, with room for a loaded machine).
const REFUSAL_BOUND: Duration = Duration::from_secs(8);

/// A generated PKI in a temporary directory: `ca.pem`, `server.pem`/`server-key.pem` (names
/// `127.0.0.1` and `localhost`, server and client auth: etcd 3.4's gateway presents the server
/// certificate as a client certificate), `client.pem`/`client-key.pem` (CN `root`, client auth).
struct Pki {
    dir: TempDir,
}

impl Pki {
    fn generate(ca_name: &str) -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new(ca_name);
        let write = |name: &str, pem: &str| write_pem(dir.path(), name, pem);
        write("ca.pem", &ca.pem());
        let server = ca.server(&["127.0.0.1", "localhost"]);
        write("server.pem", &server.cert_pem);
        write("server-key.pem", &server.key_pem);
        let client = ca.client("root");
        write("client.pem", &client.cert_pem);
        write("client-key.pem", &client.key_pem);
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A URL query fragment `name=<path of file>`.
    fn opt(&self, name: &str, file: &str) -> String {
        format!("{name}={}", self.path(file).display())
    }

    fn server_tls(&self) -> EtcdTls {
        EtcdTls::new(self.path("server.pem"), self.path("server-key.pem"))
    }

    /// etcd-client options for an administrator connection (CA and client certificate).
    fn admin_options(&self) -> ConnectOptions {
        let read = |f: &str| std::fs::read(self.path(f)).unwrap();
        ConnectOptions::new().with_tls(
            TlsOptions::new()
                .ca_certificate(Certificate::from_pem(read("ca.pem")))
                .identity(Identity::from_pem(
                    read("client.pem"),
                    read("client-key.pem"),
                )),
        )
    }
}

/// Starts etcd with `tls`, or reports a named skip (`None`).
async fn server(test: &str, tls: EtcdTls) -> Option<EtcdServer> {
    start_or_skip_async(test, Backend::Etcd, move || {
        EtcdServer::start_with(ServerConfig {
            tls: Some(tls),
            ..ServerConfig::default()
        })
    })
    .await
}

fn key(name: &str) -> LockKey {
    LockKey::new(name).unwrap()
}

/// Acquire, renew, release, a second holder's larger token, and the fence refusing the older
/// token: everything a user does, over the connection `url` describes.
async fn exercise(url: &str) {
    let c = EtcdCoordinator::connect_url(url).await.expect("connect");
    let fence = EtcdFence::connect_url(url).await.expect("fence connect");
    let k = key("tls");
    let resource = ResourceId::from(&k);
    let o = LeaseOptions::new(TTL);
    let first = c.acquire(&k, &o).await.expect("acquire over TLS");
    let before = first.valid_until();
    let renewed = first.renew().await.expect("renew over TLS");
    assert!(renewed >= before, "renewal moved validity back");
    fence
        .write(&resource, first.token(), Bytes::from_static(b"one"))
        .await
        .expect("fenced write over TLS");
    first.release().await.expect("release over TLS");

    let second = c.try_acquire(&k, &o).await.expect("second acquire");
    assert!(second.token() > first.token());
    fence
        .write(&resource, second.token(), Bytes::from_static(b"two"))
        .await
        .unwrap();
    let stale = fence
        .write(&resource, first.token(), Bytes::from_static(b"late"))
        .await
        .unwrap_err();
    assert!(matches!(stale, Error::Stale { .. }), "{stale:?}");
    let read = fence.read(&resource).await.unwrap().expect("a value");
    assert_eq!(
        read.value,
        Some((second.token(), Bytes::from_static(b"two")))
    );
    second.release().await.unwrap();
}

/// Connecting and then acquiring with `url` must fail within [`REFUSAL_BOUND`] with
/// `Misconfigured` whose message contains every one of `needles`. Returns the message.
async fn refused(url: &str, needles: &[&str]) -> String {
    refused_or_closed(url, needles, false).await
}

/// Like [`refused`]; with `closed_ok`, also accepts the `Unavailable` the adapter reports when
/// every connection it tried was closed right after the handshake without the alert reaching
/// it (a member refusing a client certificate under TLS 1.3 resets the connection, which can
/// lose its alert; the adapter retries for the alert, so this is rare).
async fn refused_or_closed(url: &str, needles: &[&str], closed_ok: bool) -> String {
    let started = Instant::now();
    let outcome = tokio::time::timeout(REFUSAL_BOUND, async {
        let c = EtcdCoordinator::connect_url(url).await?;
        c.try_acquire(&key("refused"), &LeaseOptions::new(TTL))
            .await
            .map(|_| ())
    })
    .await
    .unwrap_or_else(|_| panic!("{url}: no answer within {REFUSAL_BOUND:?}"));
    let e = outcome.expect_err("a refused TLS connection acquired a lease");
    let shown = e.to_string();
    let closed = closed_ok
        && matches!(e, Error::Unavailable { .. })
        && shown.contains("closed by the member right after the handshake");
    assert!(
        matches!(e, Error::Misconfigured { .. }) || closed,
        "{url}: expected Misconfigured, got {e:?}"
    );
    for needle in needles {
        assert!(shown.contains(needle), "{url}: {needle:?} not in {shown}");
    }
    assert!(started.elapsed() < REFUSAL_BOUND);
    shown
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcds_with_the_right_ca_acquires_renews_releases_and_fences() {
    let pki = Pki::generate("right CA");
    let Some(server) = server(
        "etcds_with_the_right_ca_acquires_renews_releases_and_fences",
        pki.server_tls(),
    )
    .await
    else {
        return;
    };
    let base = server.adapter_url();
    assert!(base.starts_with("etcds://127.0.0.1:"), "{base}");
    exercise(&format!("{base}?{}", pki.opt("tls_ca_file", "ca.pem"))).await;
    // The name checked can differ from the address dialled (given here by the option's earlier
    // name, `tls_domain`, which is still understood).
    exercise(&format!(
        "{base}?{}&tls_domain=localhost&key_prefix=by-name",
        pki.opt("tls_ca_file", "ca.pem")
    ))
    .await;
    // Plain gRPC against a TLS port does not pass either.
    let plain = tokio::time::timeout(REFUSAL_BOUND, async {
        EtcdCoordinator::connect_url(&server.url())
            .await?
            .try_acquire(&key("plain"), &LeaseOptions::new(TTL))
            .await
            .map(|_| ())
    })
    .await
    .expect("plain gRPC to a TLS port hung");
    assert!(plain.is_err(), "plain gRPC to a TLS port acquired a lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_or_name_is_refused_promptly_naming_the_problem() {
    let pki = Pki::generate("server's CA");
    let other = Pki::generate("another CA");
    let Some(server) = server(
        "a_wrong_ca_or_name_is_refused_promptly_naming_the_problem",
        pki.server_tls(),
    )
    .await
    else {
        return;
    };
    let base = server.adapter_url();
    let wrong_ca = refused(
        &format!("{base}?{}", other.opt("tls_ca_file", "ca.pem")),
        &["TLS", "UnknownIssuer", "tls_ca_file"],
    )
    .await;
    println!("wrong CA: {wrong_ca}");
    // No CA file: the system roots do not know the generated CA.
    let system = refused(&base, &["TLS", "UnknownIssuer", "system roots"]).await;
    println!("system roots: {system}");
    let wrong_name = refused(
        &format!(
            "{base}?{}&tls_server_name=etcd.example",
            pki.opt("tls_ca_file", "ca.pem")
        ),
        &[
            "TLS",
            "not valid for name \"etcd.example\"",
            "tls_server_name",
        ],
    )
    .await;
    println!("wrong name: {wrong_name}");
    // The fence refuses the same way, at connect (a TLS connection is checked then).
    let e = tokio::time::timeout(
        REFUSAL_BOUND,
        EtcdFence::connect_url(&format!("{base}?{}", other.opt("tls_ca_file", "ca.pem"))),
    )
    .await
    .expect("the fence hung on a refused TLS connection")
    .unwrap_err();
    assert!(matches!(e, Error::Misconfigured { .. }), "{e:?}");
    assert!(e.to_string().contains("UnknownIssuer"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_auth_admits_a_signed_certificate_only() {
    let pki = Pki::generate("cluster CA");
    let other = Pki::generate("stranger CA");
    let tls = pki.server_tls().require_client_certs(pki.path("ca.pem"));
    let Some(server) = server(
        "client_certificate_auth_admits_a_signed_certificate_only",
        tls,
    )
    .await
    else {
        return;
    };
    let base = server.adapter_url();
    let ca = pki.opt("tls_ca_file", "ca.pem");
    exercise(&format!(
        "{base}?{ca}&{}&{}",
        pki.opt("tls_cert_file", "client.pem"),
        pki.opt("tls_key_file", "client-key.pem")
    ))
    .await;
    // The same through the builder.
    let config = EtcdConfig::from_url(&base)
        .unwrap()
        .with_tls_ca_file(pki.path("ca.pem"))
        .unwrap()
        .with_tls_client_cert(pki.path("client.pem"), pki.path("client-key.pem"))
        .unwrap()
        .with_key_prefix("builder")
        .unwrap();
    let c = EtcdCoordinator::connect(config).await.unwrap();
    c.try_acquire(&key("builder"), &LeaseOptions::new(TTL))
        .await
        .expect("client certificate through the builder")
        .release()
        .await
        .unwrap();

    let missing = refused_or_closed(
        &format!("{base}?{ca}"),
        &["client certificate", "tls_cert_file", "tls_key_file"],
        true,
    )
    .await;
    println!("missing client cert: {missing}");
    let stranger = refused_or_closed(
        &format!(
            "{base}?{ca}&{}&{}",
            other.opt("tls_cert_file", "client.pem"),
            other.opt("tls_key_file", "client-key.pem")
        ),
        &["client certificate", "tls_cert_file", "--trusted-ca-file"],
        true,
    )
    .await;
    println!("stranger's client cert: {stranger}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_over_tls_is_used_and_never_shown() {
    const SECRET: &str = "tls-s3cr3t-Pa55";
    let pki = Pki::generate("auth CA");
    let tls = pki.server_tls().require_client_certs(pki.path("ca.pem"));
    let Some(server) = server("a_password_over_tls_is_used_and_never_shown", tls).await else {
        return;
    };
    let mut admin = Client::connect([server.client_endpoint()], Some(pki.admin_options()))
        .await
        .unwrap();
    admin.user_add("root", SECRET, None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.user_add("alice", SECRET, None).await.unwrap();
    admin.auth_enable().await.unwrap();

    let certs = format!(
        "{}&{}&{}",
        pki.opt("tls_ca_file", "ca.pem"),
        pki.opt("tls_cert_file", "client.pem"),
        pki.opt("tls_key_file", "client-key.pem")
    );
    let addr = server.addr();
    let url = format!("etcds://root:{SECRET}@{addr}?{certs}&key_prefix=auth");
    exercise(&url).await;

    // A wrong password over TLS is refused at connect, naming authentication.
    let wrong = tokio::time::timeout(
        REFUSAL_BOUND,
        EtcdCoordinator::connect_url(&format!("etcds://root:{SECRET}x@{addr}?{certs}")),
    )
    .await
    .expect("a wrong password hung")
    .unwrap_err();
    assert!(matches!(wrong, Error::Misconfigured { .. }), "{wrong:?}");
    // A user without a role: the TLS connection works, the request is refused by etcd.
    let alice = format!("etcds://alice:{SECRET}@{addr}?{certs}");
    let alice_c = EtcdCoordinator::connect_url(&alice).await.unwrap();
    let denied = alice_c
        .try_acquire(&key("denied"), &LeaseOptions::new(TTL))
        .await
        .unwrap_err();
    assert!(matches!(denied, Error::Misconfigured { .. }), "{denied:?}");
    // A refused TLS connection with credentials in the URL.
    let other = Pki::generate("not the server's CA");
    let tls_refused = tokio::time::timeout(
        REFUSAL_BOUND,
        EtcdCoordinator::connect_url(&format!(
            "etcds://root:{SECRET}@{addr}?{}",
            other.opt("tls_ca_file", "ca.pem")
        )),
    )
    .await
    .expect("a refused TLS connection with a password hung")
    .unwrap_err();
    assert!(
        matches!(tls_refused, Error::Misconfigured { .. }),
        "{tls_refused:?}"
    );

    let config = EtcdConfig::from_url(&url).unwrap();
    let c = EtcdCoordinator::connect(config.clone()).await.unwrap();
    let fence = EtcdFence::connect(config.clone()).await.unwrap();
    let lease = c
        .acquire(&key("shown"), &LeaseOptions::new(TTL))
        .await
        .unwrap();
    let bad_file = EtcdConfig::from_url(&format!(
        "etcds://root:{SECRET}@{addr}?tls_ca_file=/nonexistent/ca.pem"
    ))
    .unwrap();
    let bad_file = EtcdCoordinator::connect(bad_file).await.unwrap_err();
    assert!(matches!(bad_file, Error::InvalidInput(_)), "{bad_file:?}");
    for shown in [
        format!("{config} {config:?}"),
        format!("{c:?}"),
        format!("{fence:?}"),
        format!("{lease:?}"),
        format!("{wrong} {wrong:?}"),
        format!("{denied} {denied:?}"),
        format!("{tls_refused} {tls_refused:?}"),
        format!("{bad_file} {bad_file:?}"),
    ] {
        assert!(!shown.contains(SECRET), "password shown: {shown}");
    }
    lease.release().await.unwrap();
}
