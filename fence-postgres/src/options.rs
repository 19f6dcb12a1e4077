//! The connection URL: tokio-postgres's own parser for everything it knows, this crate's options
//! taken out of the query first, and a redacted form for every message.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use lease_core::{Error, InvalidInput, Result};
use tokio_postgres::Config;

use crate::tls::{ClientCert, RootCert, SslMode};
use crate::{Ident, DEFAULT_POOL_SIZE, DEFAULT_TABLE, DEFAULT_TIMEOUT, MAX_POOL_SIZE, MAX_TIMEOUT};

/// Query keys whose values are secret.
const SECRET_KEYS: [&str; 2] = ["password", "sslpassword"];

/// A connection URL taken apart.
pub(crate) struct Options {
    pub(crate) config: Config,
    pub(crate) table: Ident,
    pub(crate) migrate: bool,
    /// `end_unknown_sessions`: end the server session of a write whose outcome is unknown.
    pub(crate) end_unknown_sessions: bool,
    pub(crate) timeout: Duration,
    pub(crate) pool_size: usize,
    pub(crate) ssl_mode: SslMode,
    pub(crate) root_cert: Option<RootCert>,
    /// `sslcert` and `sslkey` (both or neither).
    pub(crate) client_cert: Option<ClientCert>,
    /// The URL with every secret replaced by `***`.
    pub(crate) redacted: String,
}

/// The parts of a connection URL as tokio-postgres reads them: after `scheme://`, the user info
/// runs to the first `@` (so a password may hold a raw `/` or `?`), and the query starts at the
/// first `?` after it. `None` when `raw` has no `://`.
struct Parts<'a> {
    /// `user:password` (empty without an `@`).
    userinfo: &'a str,
    /// Everything before the query: `scheme://userinfo@hosts/database`.
    base: &'a str,
    /// After the `?` (empty without one).
    query: &'a str,
}

impl<'a> Parts<'a> {
    fn of(raw: &'a str) -> Option<Self> {
        let start = raw.find("://")? + 3;
        let rest = &raw[start..];
        let userinfo = rest.find('@').map_or("", |at| &rest[..at]);
        let after_userinfo = start + rest.find('@').map_or(0, |at| at + 1);
        let (base, query) = match raw[after_userinfo..].find('?') {
            Some(q) => (&raw[..after_userinfo + q], &raw[after_userinfo + q + 1..]),
            None => (raw, ""),
        };
        Some(Parts {
            userinfo,
            base,
            query,
        })
    }
}

/// `raw` with the password of the user info and the values of `password=` and `sslpassword=`
/// query options replaced by `***`. Works on anything (not only valid URLs), so it can be used
/// in the error for a URL that did not parse; text that is not a URL and may hold a secret (a
/// libpq `key=value` string) is not shown at all ([`lease_core::adapter::redact_url_text`]).
///
/// The password runs from the first `:` after `scheme://` to the *last* `@`: tokio-postgres
/// ends the user info at the first `@`, so a raw `@` in a password (which it cannot read) or
/// in a query value hides more than the password rather than show part of one.
pub fn redact_url(raw: &str) -> String {
    lease_core::adapter::redact_url_text(raw, &SECRET_KEYS)
}

/// Every secret of `raw` (decoded and as written), for scrubbing messages that might quote one.
fn secrets(raw: &str) -> Vec<String> {
    let mut found = Vec::new();
    let Some(parts) = Parts::of(raw) else {
        return found;
    };
    if let Some((_, pw)) = parts.userinfo.split_once(':') {
        found.push(pw.to_owned());
    }
    // Every `key=value` of the whole text, not only of the query as tokio-postgres cuts it: an
    // `@` in a query value (`user=alice@srv&password=...`) ends its user info there, and what
    // follows, secrets included, may then be quoted as a host name.
    for piece in raw.split(['?', '&']) {
        if let Some((k, v)) = piece.split_once('=') {
            let k = lease_core::adapter::percent_decode(k).unwrap_or_default();
            if SECRET_KEYS.contains(&k.to_ascii_lowercase().as_str()) {
                found.push(v.to_owned());
            }
        }
    }
    let decoded: Vec<String> = found
        .iter()
        .filter_map(|s| lease_core::adapter::percent_decode(s))
        .collect();
    found.extend(decoded);
    // A one- or two-character secret would scrub innocent text; the URL itself is redacted anyway.
    found.retain(|s| s.len() >= 3);
    found
}

/// `message` with every secret of `raw` replaced by `***`.
pub(crate) fn scrub(raw: &str, message: String) -> String {
    secrets(raw)
        .iter()
        .fold(message, |m, s| m.replace(s.as_str(), "***"))
}

/// The query options this crate reads itself (the others go to tokio-postgres).
const OWN_OPTIONS: [&str; 9] = [
    "table",
    "migrate",
    "end_unknown_sessions",
    "timeout_ms",
    "pool_size",
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
];

/// The names the other backends give the same settings, each read as the name after it.
/// Giving both names is refused as an option given twice. The other backends' `tls_*_file`
/// options are not aliases of `sslrootcert` and the like: there they also mean "verified TLS",
/// while here `sslmode` decides that (with its libpq default, `prefer`, a CA file would be
/// ignored and TLS not even required), so they stay unknown options.
const ALIASES: [(&str, &str); 1] = [("request_timeout_ms", "timeout_ms")];

/// Takes `raw` apart. This crate's options (`table`, `migrate`, `timeout_ms`, `pool_size`,
/// `sslmode`, `sslrootcert`, `sslcert`, `sslkey`) are taken out of the query; the rest goes to
/// [`tokio_postgres::Config`]'s parser (user, password, hosts, ports, database and its options
/// such as `application_name`, `connect_timeout`, `keepalives`, `target_session_attrs`).
pub(crate) fn parse(raw: &str) -> Result<Options> {
    let redacted = redact_url(raw);
    let invalid = |problem: String| -> Error {
        InvalidInput::Url {
            url: redacted.clone(),
            problem: scrub(raw, problem),
        }
        .into()
    };
    if !(raw.starts_with("postgres://") || raw.starts_with("postgresql://")) {
        return Err(invalid(
            "scheme must be postgres:// or postgresql://".into(),
        ));
    }
    let Parts {
        userinfo,
        base,
        query,
    } = Parts::of(raw).expect("checked: postgres:// or postgresql://");
    // tokio-postgres ends the user info at the first `@` wherever it is, so an `@` written raw
    // in the path or in a query value (`?user=alice@corp`) makes everything before it the user
    // and password, and what follows it the host: this crate's options (`sslmode` included)
    // would be lost and the password sent as a user name to that host. A user name holding a
    // raw `/` or `?`, a password holding `?` and then `=` (an option), or one that starts with
    // digits and a `/` (`host:port/path` read as `user:password`) is that mistake.
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let into_query = password
        .find('?')
        .is_some_and(|q| password[q..].contains('='));
    let port_then_path = password
        .split_once('/')
        .is_some_and(|(port, _)| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()));
    if user.contains(['/', '?']) || into_query || port_then_path {
        return Err(invalid(
            "an `@` in the path or the query (after `/` or `?`) ends the user info for the \
             PostgreSQL driver, which would then read the rest as the host; write it as %40 \
             (and a `/` or `?` in a password as %2F or %3F)"
                .into(),
        ));
    }
    let mut kept = Vec::new();
    let mut table = Ident::new(DEFAULT_TABLE)?;
    let mut migrate = true;
    let mut end_unknown_sessions = true;
    let mut timeout = DEFAULT_TIMEOUT;
    let mut pool_size = DEFAULT_POOL_SIZE;
    let mut ssl_mode = SslMode::Prefer;
    let mut root_cert = None;
    let (mut ssl_cert, mut ssl_key) = (None, None);
    let mut seen = std::collections::HashSet::new();
    for piece in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = piece.split_once('=').unwrap_or((piece, ""));
        let given = lease_core::adapter::percent_decode(k)
            .ok_or_else(|| invalid("an option name has a malformed percent escape".into()))?;
        let decode = || {
            lease_core::adapter::percent_decode(v).ok_or_else(|| {
                invalid(format!(
                    "option {given}: the value has a malformed percent escape"
                ))
            })
        };
        // The names the other backends use for the same settings are read as libpq's.
        let key = ALIASES
            .iter()
            .find(|(alias, _)| *alias == given)
            .map_or(given.as_str(), |(_, name)| name)
            .to_owned();
        // This crate's options, given twice, are refused rather than the last one silently
        // winning (`sslmode=verify-full&...&sslmode=disable` would drop TLS). The others go to
        // tokio-postgres, where some may repeat (`host` adds hosts).
        if OWN_OPTIONS.contains(&key.as_str()) && !seen.insert(key.clone()) {
            return Err(invalid(if given == key {
                format!("option {key} is given twice")
            } else {
                format!("option {given} is given twice (it is {key} under another name)")
            }));
        }
        match key.as_str() {
            "table" => table = Ident::new(&decode()?)?,
            "migrate" => {
                let v = decode()?;
                migrate = lease_core::adapter::parse_flag(&v).ok_or_else(|| {
                    invalid(format!("migrate={v}: true or false (or 1/0, yes/no)"))
                })?;
            }
            "end_unknown_sessions" => {
                let v = decode()?;
                end_unknown_sessions = lease_core::adapter::parse_flag(&v).ok_or_else(|| {
                    invalid(format!(
                        "end_unknown_sessions={v}: true or false (or 1/0, yes/no)"
                    ))
                })?;
            }
            "timeout_ms" => {
                let v = decode()?;
                timeout =
                    lease_core::adapter::parse_millis(&v, Duration::from_millis(1), MAX_TIMEOUT)
                        .ok_or_else(|| {
                            invalid(format!("timeout_ms={v}: milliseconds in 1..=600000"))
                        })?
            }
            "pool_size" => {
                let v = decode()?;
                pool_size = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_POOL_SIZE).contains(n))
                    .ok_or_else(|| {
                        invalid(format!(
                            "pool_size={v}: a number of connections in 1..={MAX_POOL_SIZE}"
                        ))
                    })?
            }
            "sslmode" => {
                let v = decode()?;
                ssl_mode = SslMode::parse(&v).ok_or_else(|| {
                    invalid(format!(
                        "sslmode={v}: one of disable, prefer, require, verify-ca, verify-full"
                    ))
                })?
            }
            "sslrootcert" => {
                let v = decode()?;
                root_cert = Some(match v.as_str() {
                    "" => return Err(invalid("sslrootcert is empty".into())),
                    "system" => RootCert::System,
                    path => RootCert::File(PathBuf::from(path)),
                })
            }
            "sslcert" | "sslkey" => {
                let v = decode()?;
                if v.is_empty() {
                    return Err(invalid(format!("{key} is empty")));
                }
                let slot = if key == "sslcert" {
                    &mut ssl_cert
                } else {
                    &mut ssl_key
                };
                *slot = Some(PathBuf::from(v));
            }
            _ => kept.push(piece),
        }
    }
    let client_cert = match (ssl_cert, ssl_key) {
        (Some(cert), Some(key)) => Some(ClientCert { cert, key }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(
                "sslcert is given without sslkey: a client certificate needs both \
                 (sslcert=<PEM file>&sslkey=<PEM file of its private key>)"
                    .into(),
            ))
        }
        (None, Some(_)) => {
            return Err(invalid(
                "sslkey is given without sslcert: a client certificate needs both \
                 (sslcert=<PEM file>&sslkey=<PEM file of its private key>)"
                    .into(),
            ))
        }
    };
    if ssl_mode.needs_root() && root_cert.is_none() {
        return Err(invalid(format!(
            "sslmode={ssl_mode} needs sslrootcert=<PEM file of the CA> (or sslrootcert=system)"
        )));
    }
    let stripped = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut config = Config::from_str(&stripped).map_err(|e| {
        // tokio-postgres's Display names only the kind ("invalid connection string"); the
        // reason (an unknown option, a bad port) is its source.
        match std::error::Error::source(&e) {
            Some(reason) => invalid(format!("{e}: {reason}")),
            None => invalid(e.to_string()),
        }
    })?;
    if config.get_user().is_none() {
        config.user("postgres");
    }
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(timeout);
    }
    config.ssl_mode(ssl_mode.wire());
    Ok(Options {
        config,
        table,
        migrate,
        end_unknown_sessions,
        timeout,
        pool_size,
        ssl_mode,
        root_cert,
        client_cert,
        redacted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_covers_user_info_and_query_secrets() {
        for (raw, want) in [
            (
                "postgres://u:s3cret@h:5432/db?table=x",
                "postgres://u:***@h:5432/db?table=x",
            ),
            (
                "postgres://u:p%40ss@h1:1,h2:2/db?password=other&sslmode=require&SSLPASSWORD=k3y",
                "postgres://u:***@h1:1,h2:2/db?password=***&sslmode=require&SSLPASSWORD=***",
            ),
            ("postgres://u@h/db", "postgres://u@h/db"),
            ("postgresql://u:@h", "postgresql://u:***@h"),
            // tokio-postgres reads a raw `/` or `?` in a password: it is redacted whole.
            ("postgres://app:Ab/9x@db/app", "postgres://app:***@db/app"),
            (
                "postgres://app:Ab/9x?y@db/app?pool_size=0",
                "postgres://app:***@db/app?pool_size=0",
            ),
            // A raw `@` further on hides more, never less.
            (
                "postgres://u:pw@h/db?application_name=a@b",
                "postgres://u:***@b",
            ),
            // An `@` in a query value (an Azure-style `user@server`): later secrets stay hidden.
            (
                "postgres://db:5432/app?user=alice@srv&password=s3cret&pool_size=0",
                "postgres://db:***@srv&password=***&pool_size=0",
            ),
            // Not a URL (a libpq keyword string): nothing of it is shown.
            (
                "host=db user=app password=s3cret",
                "(not a URL; not shown, as it may hold a secret)",
            ),
        ] {
            assert_eq!(redact_url(raw), want);
        }
        assert_eq!(
            scrub("postgres://u:p%40ss@h/db", "bad p@ss and p%40ss".into()),
            "bad *** and ***"
        );
        assert_eq!(
            scrub(
                "postgres://u:Ab/9x?y@h/db?pool_size=0",
                "bad Ab/9x?y".into()
            ),
            "bad ***"
        );
        // tokio-postgres ends the user info at this `@`, so the host it reports holds the rest.
        let raw = "postgres://db:5432/app?user=alice@srv&password=s3cret&pool_size=0";
        let m = scrub(raw, "no such host srv&password=s3cret&pool_size=0".into());
        assert!(!m.contains("s3cret"), "{m}");
        let e = parse(raw).err().expect("refused").to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    /// An `@` written raw in the path or the query is refused before anything is sent: the
    /// driver would end the user info there, drop this crate's options (`sslmode` among them)
    /// and send the text before it, password included, as a user name to the host after it.
    /// Written as `%40`, it is the value it was meant to be.
    #[test]
    fn an_at_sign_in_the_path_or_query_is_refused() {
        for raw in [
            "postgres://db.internal/app?sslmode=verify-full&sslrootcert=/ca.pem&password=s3cret&user=alice@corp",
            "postgres://db.internal:5432/app?sslmode=verify-full&password=s3cret&user=alice@corp",
            "postgres://db.internal/app@corp",
            "postgres://db.internal/app?application_name=a@b",
            "postgres://db:5432/app@corp?user=x&password=s3cret",
        ] {
            let e = parse(raw).err().expect(raw).to_string();
            assert!(e.contains("%40"), "{raw}: {e}");
            assert!(!e.contains("s3cret"), "{raw}: {e}");
        }
        let o = parse(
            "postgres://db.internal/app?sslmode=verify-full&sslrootcert=/ca.pem&user=alice%40corp",
        )
        .unwrap();
        assert_eq!(o.config.get_hosts().len(), 1);
        assert_eq!(o.config.get_user(), Some("alice@corp"));
        assert_eq!(o.ssl_mode, SslMode::VerifyFull);
        // A password holding a raw `?` (no option after it) is still read whole, as below.
        assert!(parse("postgres://u:Ab/9x?y@h/db").is_ok());
    }

    /// An option of this crate given twice is refused, naming it, rather than the last one
    /// winning (here it would have dropped TLS).
    #[test]
    fn an_option_given_twice_is_refused() {
        for raw in [
            "postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem&sslmode=disable",
            "postgres://h/db?timeout_ms=100&timeout_ms=600000",
            "postgres://h/db?table=a&t%61ble=b",
        ] {
            let e = parse(raw).err().expect(raw).to_string();
            assert!(e.contains("is given twice"), "{raw}: {e}");
        }
        assert!(parse("postgres://h/db?sslmode=require&timeout_ms=100").is_ok());
        let e = parse("postgres://h/db?timeout_ms=100&request_timeout_ms=200")
            .err()
            .expect("both names")
            .to_string();
        assert!(e.contains("request_timeout_ms is given twice"), "{e}");
    }

    /// The other backends' names for the same settings work here too.
    #[test]
    fn the_common_option_names_are_read_as_libpqs() {
        let o = parse("postgres://h/db?request_timeout_ms=1234&migrate=no&end_unknown_sessions=0")
            .unwrap();
        assert_eq!(o.timeout, Duration::from_millis(1234));
        assert!(!o.migrate && !o.end_unknown_sessions);
        // Not `tls_ca_file`: it would read as verified TLS while `sslmode=prefer` ignores it.
        let e = parse("postgres://h/db?tls_ca_file=/ca.pem")
            .err()
            .expect("refused");
        assert!(e.to_string().contains("tls_ca_file"), "{e}");
    }

    /// The query starts after the user info, as tokio-postgres reads it: a password with a raw
    /// `/` or `?` is the password, not the start of a path or of options.
    #[test]
    fn a_password_with_a_slash_or_question_mark_is_read_whole() {
        let o = parse("postgres://u:Ab/9x?y@h:6432/db?table=t1&application_name=f").unwrap();
        assert_eq!(o.config.get_password(), Some(&b"Ab/9x?y"[..]));
        assert_eq!(o.config.get_ports(), &[6432]);
        assert_eq!(o.config.get_application_name(), Some("f"));
        assert_eq!(o.table, Ident::new("t1").unwrap());
        assert!(!o.redacted.contains("Ab/9x"), "{}", o.redacted);
    }

    #[test]
    fn own_options_are_stripped_and_the_rest_parsed_by_tokio_postgres() {
        let o = parse(
            "postgres://al%69ce:pw@db.example:6432/my%20db?application_name=fence&table=t1\
             &timeout_ms=1500&pool_size=4&sslmode=verify-full&sslrootcert=/ca.pem&migrate=false\
             &end_unknown_sessions=false",
        )
        .unwrap();
        assert_eq!(o.config.get_user(), Some("alice"));
        assert_eq!(o.config.get_password(), Some(&b"pw"[..]));
        assert_eq!(o.config.get_dbname(), Some("my db"));
        assert_eq!(o.config.get_ports(), &[6432]);
        assert_eq!(o.config.get_application_name(), Some("fence"));
        assert_eq!(
            o.config.get_connect_timeout(),
            Some(&Duration::from_millis(1500))
        );
        assert_eq!(
            o.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(o.table, Ident::new("t1").unwrap());
        assert!(!o.migrate);
        assert!(!o.end_unknown_sessions);
        assert_eq!(o.timeout, Duration::from_millis(1500));
        assert_eq!(o.pool_size, 4);
        assert_eq!(o.ssl_mode, SslMode::VerifyFull);
        assert_eq!(o.root_cert, Some(RootCert::File("/ca.pem".into())));
        assert_eq!(o.client_cert, None);
        let c = parse("postgres://h/db?sslmode=require&sslcert=/c%20.pem&sslkey=/k.pem").unwrap();
        assert_eq!(
            c.client_cert,
            Some(ClientCert {
                cert: "/c .pem".into(),
                key: "/k.pem".into()
            })
        );
        // Defaults: user postgres, prefer, pool 16, the default timeout as connect timeout.
        let d = parse("postgres://h/db").unwrap();
        assert_eq!(d.config.get_user(), Some("postgres"));
        assert!(d.end_unknown_sessions);
        assert_eq!(d.ssl_mode, SslMode::Prefer);
        assert_eq!(d.pool_size, DEFAULT_POOL_SIZE);
        assert_eq!(d.config.get_connect_timeout(), Some(&DEFAULT_TIMEOUT));
        // Several hosts, as tokio-postgres reads them.
        let m = parse("postgres://u@h1:1,h2:2/db?target_session_attrs=read-write").unwrap();
        assert_eq!(m.config.get_ports(), &[1, 2]);
    }

    #[test]
    fn bad_options_are_invalid_input_naming_the_option_without_the_secret() {
        for (url, needle) in [
            ("redis://u:s3cret@h/db", "scheme"),
            ("postgres://u:s3cret@h/db?pool_size=0", "pool_size"),
            ("postgres://u:s3cret@h/db?pool_size=100000", "pool_size"),
            ("postgres://u:s3cret@h/db?timeout_ms=0", "timeout_ms"),
            ("postgres://u:s3cret@h/db?sslmode=verify", "sslmode"),
            (
                "postgres://u:s3cret@h/db?sslmode=verify-full",
                "sslrootcert",
            ),
            ("postgres://u:s3cret@h/db?sslmode=verify-ca", "sslrootcert"),
            ("postgres://u:s3cret@h/db?migrate=maybe", "migrate"),
            (
                "postgres://u:s3cret@h/db?end_unknown_sessions=maybe",
                "end_unknown_sessions",
            ),
            ("postgres://u:s3cret@h/db?sslcert=/c.pem", "without sslkey"),
            ("postgres://u:s3cret@h/db?sslkey=/k.pem", "without sslcert"),
            (
                "postgres://u:s3cret@h/db?sslcert=&sslkey=/k.pem",
                "sslcert is empty",
            ),
            ("postgres://u:s3cret@h/db?frobnicate=1", "frobnicate"),
            ("postgres://u:s3cret@h:notaport/db", "port"),
            (
                "postgres://u@h/db?password=s3cret&frobnicate=1",
                "frobnicate",
            ),
        ] {
            let e = match parse(url) {
                Err(e) => e,
                Ok(_) => panic!("{url} parsed"),
            };
            let (shown, debug) = (e.to_string(), format!("{e:?}"));
            assert!(matches!(e, Error::InvalidInput(_)), "{url}: {debug}");
            assert!(shown.contains(needle), "{url}: {shown}");
            assert!(
                !shown.contains("s3cret") && !debug.contains("s3cret"),
                "{url}: {debug}"
            );
        }
    }
}
