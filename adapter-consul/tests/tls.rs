//! TLS against the Consul stand-in serving HTTPS with certificates from the test kit's PKI
//! (`conformance_tests::pki`): `consuls://` with `tls_ca_file`, a wrong CA, a certificate for another name and
//! `tls_server_name`, mutual TLS required by the agent (a client certificate given, missing, or
//! signed by another CA), the `CONSUL_*` environment path through an injected lookup, and
//! secrets (ACL token, client key) in no `Debug`, `Display`, error or log line.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use adapter_consul::{ConsulConfig, ConsulCoordinator};
use conformance_tests::consul_standin::{ConsulStandIn, StandInOptions, StandInTls};
use conformance_tests::logs::CapturedLogs;
use conformance_tests::pki::{write_pem, Leaf, TestCa};
use lease_core::{Coordinator, Error, Lease, LeaseOptions, LockKey};

const TOKEN: &str = "tls-test-acl-s3cret";

/// A CA and the PEM files of certificates it signed, in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
    ca: TestCa,
}

impl Pki {
    fn new(name: &str) -> Self {
        Pki {
            dir: tempfile::tempdir().unwrap(),
            ca: TestCa::new(&format!("{name} test CA")),
        }
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    fn server(&self, names: &[&str]) -> Leaf {
        self.ca.server(names)
    }

    fn client(&self) -> Leaf {
        self.ca.client("fenced-client")
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        write_pem(self.dir.path(), name, contents)
    }
}

/// A stand-in serving HTTPS with a certificate for `127.0.0.1` and `localhost` from `pki`,
/// requiring `TOKEN`, and client certificates from `client_ca` when given.
fn tls_standin(pki: &Pki, client_ca: Option<&Pki>) -> ConsulStandIn {
    let server = pki.server(&["127.0.0.1", "localhost"]);
    let mut tls = StandInTls::new(server.cert_pem, server.key_pem);
    if let Some(ca) = client_ca {
        tls = tls.require_client_cert(ca.ca_pem());
    }
    ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(Duration::from_millis(500))
            .acl_token(TOKEN)
            .tls(tls),
    )
    .expect("stand-in with TLS")
}

fn prefix() -> String {
    format!("tls{:08x}", rand::random::<u32>())
}

fn no_env(_: &str) -> Option<String> {
    None
}

fn env_of(vars: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<&'static str, String> = vars.into_iter().collect();
    move |k| map.get(k).cloned()
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Acquires and releases one lease through `config`.
async fn round_trip(config: ConsulConfig) -> lease_core::Result<()> {
    let c = ConsulCoordinator::connect(config).await?;
    let lease = c
        .acquire(
            &LockKey::new("tls/one").unwrap(),
            &LeaseOptions::new(Duration::from_secs(1)).wait(Duration::from_secs(5)),
        )
        .await?;
    assert!(lease.token().get() > 0);
    lease.release().await
}

/// The first acquire's error through `config` (it must fail).
async fn acquire_error(config: ConsulConfig) -> Error {
    let c = ConsulCoordinator::connect(config)
        .await
        .expect("coordinator");
    match c
        .acquire(
            &LockKey::new("tls/one").unwrap(),
            &LeaseOptions::new(Duration::from_secs(1)).wait(Duration::from_secs(5)),
        )
        .await
    {
        Ok(_) => panic!("acquire succeeded"),
        Err(e) => e,
    }
}

fn misconfigured_naming(e: &Error, needles: &[&str]) {
    let text = e.to_string();
    eprintln!("error as shown: {text}");
    assert!(matches!(e, Error::Misconfigured { .. }), "{text}");
    for n in needles {
        assert!(text.contains(n), "{n:?} not in {text}");
    }
    assert!(!text.contains(TOKEN), "{text}");
}

#[tokio::test]
async fn consuls_with_tls_ca_file_acquires_and_releases() {
    let pki = Pki::new("server");
    let s = tls_standin(&pki, None);
    assert!(s.http_addr().starts_with("https://"));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    for host in ["127.0.0.1", "localhost"] {
        let url = format!(
            "consuls://{host}:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_file={}",
            s.addr().port(),
            prefix(),
            path_str(&ca)
        );
        round_trip(ConsulConfig::from_url_with_env(&url, no_env).unwrap())
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
    }
    // A directory of CA files (tls_ca_path) works the same.
    let dir = pki.dir.path().join("cas");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("other.pem"), Pki::new("unrelated").ca_pem()).unwrap();
    std::fs::write(dir.join("server.pem"), pki.ca_pem()).unwrap();
    let url = format!(
        "consuls://127.0.0.1:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_path={}",
        s.addr().port(),
        prefix(),
        path_str(&dir)
    );
    round_trip(ConsulConfig::from_url_with_env(&url, no_env).unwrap())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_wrong_ca_is_misconfigured_naming_the_ca_setting() {
    let pki = Pki::new("server");
    let s = tls_standin(&pki, None);
    let wrong = Pki::new("wrong");
    let ca = wrong.write("wrong-ca.pem", &wrong.ca_pem());
    let url = format!(
        "consuls://127.0.0.1:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_file={}",
        s.addr().port(),
        prefix(),
        path_str(&ca)
    );
    let e = acquire_error(ConsulConfig::from_url_with_env(&url, no_env).unwrap()).await;
    misconfigured_naming(&e, &["TLS", "not signed by a trusted CA", "tls_ca_file"]);
    assert!(
        !e.is_retryable(),
        "a wrong CA does not heal by retrying: {e}"
    );
}

#[tokio::test]
async fn a_certificate_for_another_name_needs_tls_server_name() {
    let pki = Pki::new("server");
    let server = pki.server(&["consul.service.test"]);
    let s = ConsulStandIn::start(
        StandInOptions::default()
            .session_ttl_min(Duration::from_millis(500))
            .acl_token(TOKEN)
            .tls(StandInTls::new(server.cert_pem, server.key_pem)),
    )
    .unwrap();
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let base = format!(
        "consuls://127.0.0.1:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_file={}",
        s.addr().port(),
        prefix(),
        path_str(&ca)
    );
    let e = acquire_error(ConsulConfig::from_url_with_env(&base, no_env).unwrap()).await;
    misconfigured_naming(&e, &["does not name this host", "tls_server_name"]);
    round_trip(
        ConsulConfig::from_url_with_env(
            &format!("{base}&tls_server_name=consul.service.test"),
            no_env,
        )
        .unwrap(),
    )
    .await
    .unwrap();
    // The same through CONSUL_TLS_SERVER_NAME (its port dropped, as HashiCorp's clients do).
    let env = env_of(vec![(
        "CONSUL_TLS_SERVER_NAME",
        "consul.service.test:8501".to_owned(),
    )]);
    round_trip(ConsulConfig::from_url_with_env(&base, env).unwrap())
        .await
        .unwrap();
}

#[tokio::test]
async fn mtls_required_by_the_agent_works_with_a_client_cert_and_fails_clearly_without() {
    let pki = Pki::new("server");
    let clients = Pki::new("clients");
    let s = tls_standin(&pki, Some(&clients));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let base = format!(
        "consuls://127.0.0.1:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_file={}",
        s.addr().port(),
        prefix(),
        path_str(&ca)
    );
    let good = clients.client();
    let cert = pki.write("client.pem", &good.cert_pem);
    let key = pki.write("client-key.pem", &good.key_pem);
    round_trip(
        ConsulConfig::from_url_with_env(
            &format!(
                "{base}&tls_cert_file={}&tls_key_file={}",
                path_str(&cert),
                path_str(&key)
            ),
            no_env,
        )
        .unwrap(),
    )
    .await
    .unwrap();

    // No client certificate: the agent ends the handshake; the error says what to set.
    let e = acquire_error(ConsulConfig::from_url_with_env(&base, no_env).unwrap()).await;
    misconfigured_naming(
        &e,
        &[
            "requires a client certificate",
            "tls_cert_file",
            "CONSUL_CLIENT_CERT",
        ],
    );
    assert!(!e.to_string().contains(&good.key_pem[40..80]));

    // A client certificate from a CA the agent does not trust.
    let stranger = Pki::new("stranger").client();
    let cert = pki.write("stranger.pem", &stranger.cert_pem);
    let key = pki.write("stranger-key.pem", &stranger.key_pem);
    let e = acquire_error(
        ConsulConfig::from_url_with_env(
            &format!(
                "{base}&tls_cert_file={}&tls_key_file={}",
                path_str(&cert),
                path_str(&key)
            ),
            no_env,
        )
        .unwrap(),
    )
    .await;
    misconfigured_naming(&e, &["refused the client certificate"]);
}

#[tokio::test]
async fn the_consul_environment_configures_address_token_ca_and_client_cert() {
    let pki = Pki::new("server");
    let clients = Pki::new("clients");
    let s = tls_standin(&pki, Some(&clients));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let client = clients.client();
    let cert = pki.write("client.pem", &client.cert_pem);
    let key = pki.write("client-key.pem", &client.key_pem);
    let token_file = pki.write("token", &format!("{TOKEN}\n"));
    let files = vec![
        ("CONSUL_CACERT", path_str(&ca).to_owned()),
        ("CONSUL_CLIENT_CERT", path_str(&cert).to_owned()),
        ("CONSUL_CLIENT_KEY", path_str(&key).to_owned()),
    ];
    let url = format!("consul://?session_ttl_ms=1000&key_prefix={}", prefix());
    // The address with its scheme, and the ACL token from CONSUL_HTTP_TOKEN.
    let mut vars = files.clone();
    vars.push(("CONSUL_HTTP_ADDR", s.http_addr()));
    vars.push(("CONSUL_HTTP_TOKEN", TOKEN.to_owned()));
    let config = ConsulConfig::from_url_with_env(&url, env_of(vars)).unwrap();
    assert_eq!(config.base_url(), s.http_addr());
    for shown in [config.to_string(), format!("{config:?}")] {
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(shown.contains("CONSUL_HTTP_TOKEN"), "{shown}");
    }
    round_trip(config).await.unwrap();
    // A bare host:port with CONSUL_HTTP_SSL=true, and the token from CONSUL_HTTP_TOKEN_FILE.
    let mut vars = files.clone();
    vars.push(("CONSUL_HTTP_ADDR", s.addr().to_string()));
    vars.push(("CONSUL_HTTP_SSL", "true".to_owned()));
    vars.push(("CONSUL_HTTP_TOKEN_FILE", path_str(&token_file).to_owned()));
    round_trip(ConsulConfig::from_url_with_env(&url, env_of(vars)).unwrap())
        .await
        .unwrap();
    // Without CONSUL_HTTP_SSL the same address is plain HTTP, which the TLS agent does not
    // answer: the environment really decides.
    let mut vars = files;
    vars.push(("CONSUL_HTTP_ADDR", s.addr().to_string()));
    vars.push(("CONSUL_HTTP_TOKEN", TOKEN.to_owned()));
    let config = ConsulConfig::from_url_with_env(&url, env_of(vars)).unwrap();
    assert!(!config.tls());
    let c = ConsulCoordinator::connect(config).await.unwrap();
    let r = c
        .try_acquire(
            &LockKey::new("tls/one").unwrap(),
            &LeaseOptions::new(Duration::from_secs(1)),
        )
        .await;
    assert!(r.is_err(), "plain HTTP to a TLS agent must fail");
}

#[tokio::test]
async fn secrets_never_show_in_debug_display_errors_or_logs() {
    // The other tests of this binary log into it too, which only widens the check.
    let logs = CapturedLogs::install(tracing::Level::TRACE);

    let pki = Pki::new("server");
    let clients = Pki::new("clients");
    let s = tls_standin(&pki, Some(&clients));
    let ca = pki.write("ca.pem", &pki.ca_pem());
    let client = clients.client();
    let cert = pki.write("client.pem", &client.cert_pem);
    let key = pki.write("client-key.pem", &client.key_pem);
    // The base64 body of the key, which must never appear anywhere.
    let key_body: String = client
        .key_pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .collect();
    let key_line = client.key_pem.lines().nth(1).unwrap().to_owned();
    let url = format!(
        "consuls://127.0.0.1:{}?token={TOKEN}&session_ttl_ms=1000&key_prefix={}&tls_ca_file={}&tls_cert_file={}&tls_key_file={}",
        s.addr().port(),
        prefix(),
        path_str(&ca),
        path_str(&cert),
        path_str(&key)
    );
    let config = ConsulConfig::from_url_with_env(&url, no_env).unwrap();
    let c = ConsulCoordinator::connect(config.clone()).await.unwrap();
    let mut shown = vec![config.to_string(), format!("{config:?}"), format!("{c:?}")];
    let lease = c
        .acquire(
            &LockKey::new("tls/secret").unwrap(),
            &LeaseOptions::new(Duration::from_secs(1)).wait(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    shown.push(format!("{lease:?}"));
    lease.release().await.unwrap();

    // A wrong token's 403, a missing key file, and a key file that is not a key but holds
    // secret-looking text: none of the errors carries the token or the file's contents.
    let wrong = url.replace(TOKEN, "wrong-s3cret-token");
    let e = acquire_error(ConsulConfig::from_url_with_env(&wrong, no_env).unwrap()).await;
    assert!(matches!(e, Error::Misconfigured { .. }), "{e}");
    shown.push(e.to_string());
    shown.push(format!("{e:?}"));
    let bogus = pki.write(
        "bogus-key.pem",
        &format!("-----BEGIN PRIVATE KEY-----\n{key_line}!!\n-----END PRIVATE KEY-----\n"),
    );
    let bad_key = url.replace(path_str(&key), path_str(&bogus));
    let e = ConsulCoordinator::connect(ConsulConfig::from_url_with_env(&bad_key, no_env).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Misconfigured { .. }), "{e}");
    assert!(e.to_string().contains("tls_key_file"), "{e}");
    shown.push(e.to_string());
    shown.push(format!("{e:?}"));
    let missing = url.replace(path_str(&key), "/nonexistent/key.pem");
    let e = ConsulCoordinator::connect(ConsulConfig::from_url_with_env(&missing, no_env).unwrap())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("/nonexistent/key.pem"), "{e}");
    shown.push(e.to_string());
    drop(c);

    let logs = logs.text();
    assert!(
        logs.contains("consul session created"),
        "the adapter's log lines are captured: {logs}"
    );
    shown.push(logs);
    for text in &shown {
        assert!(!text.contains(TOKEN), "token shown: {text}");
        assert!(!text.contains("wrong-s3cret-token"), "token shown: {text}");
        assert!(!text.contains(&key_line), "key shown: {text}");
        assert!(!text.contains(&key_body), "key shown: {text}");
    }
}
