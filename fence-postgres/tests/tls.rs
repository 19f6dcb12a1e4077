//! TLS against a real PostgreSQL started by the harness with a certificate from the test kit's
//! PKI (`conformance_tests::pki`): each `sslmode` means what libpq says it means, and client
//! certificates (`sslcert`/`sslkey`) work as with libpq against a server whose `pg_hba.conf`
//! says `cert`.

use conformance_tests::harness::postgres::{PostgresConfig, PostgresTls};
use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use conformance_tests::pki::{write_pem, Leaf, TestCa};
use fence_postgres::{PgFence, SslMode};
use lease_core::{Bytes, Error, Fence, ResourceId, Token};

/// The server's TLS: a certificate from `ca` for `localhost` only (a DNS name: `127.0.0.1`
/// does not match it).
fn localhost_server(ca: &TestCa) -> PostgresTls {
    ca.server(&["localhost"]).into()
}

async fn start(test: &str, config: PostgresConfig) -> Option<PostgresServer> {
    start_or_skip_async(test, Backend::Postgres, move || {
        PostgresServer::start_with(config)
    })
    .await
}

/// Whether the fence's pooled connection is encrypted, as the server sees it.
async fn encrypted(fence: &PgFence) -> bool {
    let c = fence.pool().get().await.unwrap();
    c.query_one(
        "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
        &[],
    )
    .await
    .unwrap()
    .get(0)
}

/// Connects, writes and reads back through the fence; returns it.
async fn works(url: &str) -> PgFence {
    let fence = PgFence::connect(url)
        .await
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let r = ResourceId::new("tls/1").unwrap();
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let token = Token::new(NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst)).unwrap();
    fence
        .write(&r, token, Bytes::from_static(b"over tls"))
        .await
        .unwrap();
    assert!(fence.read(&r).await.unwrap().unwrap().newest >= token);
    fence
}

/// Connecting fails with a configuration error (not retryable) whose message has `needles`
/// and never the password.
async fn refused(url: &str, needles: &[&str]) -> Error {
    let e = match PgFence::connect(url).await {
        Err(e) => e,
        Ok(f) => panic!("{url}: connected: {f:?}"),
    };
    let (shown, debug) = (e.to_string(), format!("{e:?}"));
    assert!(
        matches!(e, Error::Misconfigured { .. }),
        "{url}: expected Misconfigured: {debug}"
    );
    assert!(!e.is_retryable(), "{shown}");
    eprintln!("refused as expected: {shown}");
    for n in needles {
        assert!(shown.contains(n), "{url}: {n:?} not in {shown}");
    }
    assert!(
        !shown.contains("s3cret") && !debug.contains("s3cret"),
        "{url}: the password leaked: {debug}"
    );
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sslmode_means_what_libpq_says_against_a_tls_only_server() {
    let pki = TestCa::new("fence-postgres test CA");
    let other = TestCa::new("some other CA");
    let Some(pg) = start(
        "each_sslmode_means_what_libpq_says_against_a_tls_only_server",
        PostgresConfig {
            tls: Some(localhost_server(&pki)),
            tls_only: true,
            ..PostgresConfig::default()
        },
    )
    .await
    else {
        return;
    };
    let dir = pg.root_dir().to_path_buf();
    let ca = write_pem(&dir, "ca.pem", &pki.pem());
    let wrong_ca = write_pem(&dir, "other-ca.pem", &other.pem());
    let port = pg.port();
    // The password is ignored by trust authentication; it is here to prove it never leaks.
    let url = |host: &str, query: String| {
        format!("postgres://postgres:s3cret@{host}:{port}/postgres?{query}")
    };
    let (ca, wrong_ca) = (ca.display(), wrong_ca.display());

    // verify-full: the chain and the host name.
    let full = works(&url(
        "localhost",
        format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert_eq!(full.ssl_mode(), SslMode::VerifyFull);
    assert!(encrypted(&full).await);
    assert!(!format!("{full:?} {full}").contains("s3cret"));
    refused(
        &url("127.0.0.1", format!("sslmode=verify-full&sslrootcert={ca}")),
        &["certificate", "not valid for name \"127.0.0.1\""],
    )
    .await;
    refused(
        &url(
            "localhost",
            format!("sslmode=verify-full&sslrootcert={wrong_ca}"),
        ),
        &["certificate", "UnknownIssuer"],
    )
    .await;

    // verify-ca: the chain only, so the wrong host name is accepted; a foreign CA is not.
    let ca_only = works(&url(
        "127.0.0.1",
        format!("sslmode=verify-ca&sslrootcert={ca}"),
    ))
    .await;
    assert!(encrypted(&ca_only).await);
    refused(
        &url(
            "127.0.0.1",
            format!("sslmode=verify-ca&sslrootcert={wrong_ca}"),
        ),
        &["certificate", "UnknownIssuer"],
    )
    .await;

    // require: encrypted, nothing verified; with sslrootcert, as verify-ca (libpq's rule).
    let require = works(&url("127.0.0.1", "sslmode=require".into())).await;
    assert!(encrypted(&require).await);
    refused(
        &url(
            "127.0.0.1",
            format!("sslmode=require&sslrootcert={wrong_ca}"),
        ),
        &["UnknownIssuer"],
    )
    .await;

    // prefer (and no sslmode at all, libpq's default): encrypted when the server offers it.
    assert!(encrypted(&works(&url("127.0.0.1", "sslmode=prefer".into())).await).await);
    assert!(encrypted(&works(&url("127.0.0.1", String::new())).await).await);

    // disable against a server that takes TCP only over TLS: a clear refusal naming the fix.
    refused(
        &url("127.0.0.1", "sslmode=disable".into()),
        &["pg_hba.conf", "no encryption", "sslmode=verify-full"],
    )
    .await;

    // An sslrootcert that is not there, or holds no certificate: refused before connecting.
    refused(
        &url(
            "localhost",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".into(),
        ),
        &["/nonexistent/ca.pem"],
    )
    .await;
    let empty = write_pem(&dir, "empty.pem", "");
    refused(
        &url(
            "localhost",
            format!("sslmode=verify-full&sslrootcert={}", empty.display()),
        ),
        &["no usable CA certificate"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tls_on_the_server_require_is_refused_and_prefer_stays_plain() {
    let Some(pg) = start(
        "without_tls_on_the_server_require_is_refused_and_prefer_stays_plain",
        PostgresConfig::default(),
    )
    .await
    else {
        return;
    };
    let base = format!(
        "postgres://postgres:s3cret@127.0.0.1:{}/postgres",
        pg.port()
    );
    refused(
        &format!("{base}?sslmode=require"),
        &["does not support TLS"],
    )
    .await;
    assert!(!encrypted(&works(&format!("{base}?sslmode=prefer")).await).await);
    assert!(!encrypted(&works(&format!("{base}?sslmode=disable")).await).await);
}

/// The base64 lines of a PEM key: none of them may appear in any message.
fn key_lines(key_pem: &str) -> Vec<&str> {
    key_pem
        .lines()
        .filter(|l| !l.starts_with("-----") && !l.contains(':') && l.len() >= 16)
        .collect()
}

/// `e`'s Display and Debug quote no line of `key_pem`.
fn no_key_in(what: &str, e: &dyn std::fmt::Debug, shown: &str, key_pem: &str) {
    let debug = format!("{e:?}");
    for line in key_lines(key_pem) {
        assert!(
            !shown.contains(line) && !debug.contains(line),
            "{what}: the key leaked: {debug}"
        );
    }
}

/// The client certificate's files in `dir`: (sslcert, sslkey) as a query fragment.
fn client_files(dir: &std::path::Path, name: &str, leaf: &Leaf) -> String {
    let cert = write_pem(dir, &format!("{name}.crt"), &leaf.cert_pem);
    let key = write_pem(dir, &format!("{name}.key"), &leaf.key_pem);
    format!("sslcert={}&sslkey={}", cert.display(), key.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_as_with_libpq_against_a_cert_server() {
    let pki = TestCa::new("fence-postgres client CA");
    let other = TestCa::new("some other CA");
    let Some(pg) = start(
        "client_certificates_authenticate_as_with_libpq_against_a_cert_server",
        PostgresConfig {
            tls: Some(localhost_server(&pki)),
            client_ca_pem: Some(pki.pem()),
            ..PostgresConfig::default()
        },
    )
    .await
    else {
        return;
    };
    let dir = pg.root_dir().to_path_buf();
    let ca = write_pem(&dir, "ca.pem", &pki.pem());
    let port = pg.port();
    let url = |host: &str, query: String| {
        format!("postgres://postgres:s3cret@{host}:{port}/postgres?{query}")
    };
    let verify = format!("sslmode=verify-full&sslrootcert={}", ca.display());
    let good = pki.client("postgres");
    let good_files = client_files(&dir, "good", &good);

    // The certificate of the user, signed by the server's CA: connects and writes, and the
    // server saw that certificate.
    let fence = works(&url("localhost", format!("{verify}&{good_files}"))).await;
    assert!(encrypted(&fence).await);
    let c = fence.pool().get().await.unwrap();
    let dn: Option<String> = c
        .query_one(
            "SELECT client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dn.as_deref(), Some("/CN=postgres"));
    drop(c);
    let described = format!("{fence:?} {fence}");
    assert!(described.contains("good.crt"), "{described}");
    for line in key_lines(&good.key_pem) {
        assert!(!described.contains(line), "the key leaked: {described}");
    }
    // Also without verifying the server (require): the client certificate is still presented.
    works(&url("127.0.0.1", format!("sslmode=require&{good_files}"))).await;

    // No client certificate: refused by the server, and the error says what is missing.
    refused(
        &url("localhost", verify.clone()),
        &["requires a valid client certificate", "sslcert", "sslkey"],
    )
    .await;

    // A certificate with CN=postgres, but from a CA the server does not trust: the TLS
    // handshake is refused.
    let foreign = other.client("postgres");
    let e = refused(
        &url(
            "localhost",
            format!("{verify}&{}", client_files(&dir, "foreign", &foreign)),
        ),
        &[
            "refused the client certificate",
            "foreign.crt",
            "ssl_ca_file",
        ],
    )
    .await;
    no_key_in("foreign CA", &e, &e.to_string(), &foreign.key_pem);

    // Signed by the right CA, but its CN is not the user name.
    let alice = pki.client("alice");
    let e = refused(
        &url(
            "localhost",
            format!("{verify}&{}", client_files(&dir, "alice", &alice)),
        ),
        &[
            "certificate authentication failed for user \"postgres\"",
            "common name (CN)",
        ],
    )
    .await;
    no_key_in("CN alice", &e, &e.to_string(), &alice.key_pem);
}

/// A P-256 key encrypted with a passphrase, as `openssl pkcs8 -topk8 -v2 aes-256-cbc` writes it.
const ENCRYPTED_PKCS8: &str = "\
-----BEGIN ENCRYPTED PRIVATE KEY-----
MIHsMFcGCSqGSIb3DQEFDTBKMCkGCSqGSIb3DQEFDDAcBAiim3tYuRkVIAICCAAw
DAYIKoZIhvcNAgkFADAdBglghkgBZQMEASoEEH8sslpxYyLMLdQ/uWekoQ8EgZCV
NGgYehcp4fgU1NW1m9oj0a2DoXCY5xJAGAjPWrnqMvC+amG7O8vXdZXHoF/ls17q
LFJGDm02lZMPha5sP5ryhBc1ba4IWIcXLWt4CJUXXLUw4V1hjUNpyK81VyYczv00
uPGnvfpcbjEcRzCV0HHvgn8mrAKVUwTyekkHCO6J7PyZHKsPzVX8QbqlPoob544=
-----END ENCRYPTED PRIVATE KEY-----
";

/// The same kind of key in OpenSSL's legacy encrypted form (`openssl ec -aes256`).
const ENCRYPTED_LEGACY: &str = "\
-----BEGIN EC PRIVATE KEY-----
Proc-Type: 4,ENCRYPTED
DEK-Info: AES-256-CBC,2C9E860D658C4FF8808F18259964F1B6

T6AUzbiYF3kIYO1X2x/Q7hUqHIDLFaiECdAt7PbvG69FhF3NBT+JeKt/xjBVDQXc
6oUZ7ow9gUSLU8ZNNEjWE4xsxR4yidaS9PPr3KckpH34XjE0cHQ83HEK44A75dqZ
HwhCBpHclL3zqvBDU9CpyoRhmW7PJZbMFW8zTvCYqas=
-----END EC PRIVATE KEY-----
";

/// The client certificate's files are read before anything is sent (no server needed: the
/// URL's port is closed).
#[tokio::test]
async fn client_certificate_files_are_checked_before_connecting() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fence-postgres-client-cert-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pki = TestCa::new("fence-postgres file CA");
    let leaf = pki.client("postgres");
    let cert = write_pem(&dir, "client.crt", &leaf.cert_pem);
    let key = write_pem(&dir, "client.key", &leaf.key_pem);
    let other = pki.client("postgres");
    let other_key = write_pem(&dir, "other.key", &other.key_pem);
    let url = |query: String| format!("postgres://postgres:s3cret@127.0.0.1:1/postgres?{query}");
    let (cert, key, other_key) = (cert.display(), key.display(), other_key.display());

    // An encrypted key: InvalidInput naming sslkey, its contents quoted nowhere.
    for (name, pem) in [("pkcs8", ENCRYPTED_PKCS8), ("legacy", ENCRYPTED_LEGACY)] {
        let enc = write_pem(&dir, &format!("{name}.key"), pem);
        let e = PgFence::connect(&url(format!("sslcert={cert}&sslkey={}", enc.display())))
            .await
            .unwrap_err();
        let shown = e.to_string();
        assert!(matches!(e, Error::InvalidInput(_)), "{name}: {e:?}");
        assert!(!e.is_retryable(), "{shown}");
        for needle in ["sslkey", &*enc.display().to_string(), "encrypted"] {
            assert!(shown.contains(needle), "{name}: {needle:?} not in {shown}");
        }
        no_key_in(name, &e, &shown, pem);
        assert!(!shown.contains("s3cret") && !format!("{e:?}").contains("s3cret"));
    }

    // Misconfigured, naming the file: a missing certificate, a key file without a key, a key
    // that is not the certificate's.
    let missing = "/nonexistent/client.crt";
    for (query, needles) in [
        (
            format!("sslcert={missing}&sslkey={key}"),
            vec!["sslcert", missing],
        ),
        (
            format!("sslcert={cert}&sslkey={cert}"),
            vec!["sslkey", "no private key"],
        ),
        (
            format!("sslcert={key}&sslkey={key}"),
            vec!["sslcert", "no certificate"],
        ),
        (
            format!("sslcert={cert}&sslkey={other_key}"),
            vec!["other.key", "is not the private key of sslcert"],
        ),
    ] {
        let e = refused(&url(query.clone()), &needles).await;
        no_key_in(&query, &e, &e.to_string(), &leaf.key_pem);
        no_key_in(&query, &e, &e.to_string(), &other.key_pem);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
