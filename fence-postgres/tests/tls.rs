//! TLS against a real PostgreSQL started by the harness with a certificate made here (rcgen):
//! each `sslmode` means what libpq says it means.

use conformance_tests::harness::postgres::PostgresConfig;
use conformance_tests::harness::{start_or_skip_async, Backend, PostgresServer};
use fence_postgres::{PgFence, SslMode};
use lease_core::{Bytes, Error, Fence, ResourceId, Token};

mod pki;
use pki::{make_pki, write};

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
    let pki = make_pki("fence-postgres test CA");
    let other = make_pki("some other CA");
    let Some(pg) = start(
        "each_sslmode_means_what_libpq_says_against_a_tls_only_server",
        PostgresConfig {
            tls: Some(pki.server.clone()),
            tls_only: true,
        },
    )
    .await
    else {
        return;
    };
    let dir = pg.root_dir().to_path_buf();
    let ca = write(&dir, "ca.pem", &pki.ca_pem);
    let wrong_ca = write(&dir, "other-ca.pem", &other.ca_pem);
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
    let empty = write(&dir, "empty.pem", "");
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
