//! One parser for the query options of a backend URL, with one set of common options.
//!
//! Every adapter reads its URL through [`UrlOptions::parse`], so the same name means the same thing
//! on every backend and a bad value gets the same error everywhere: `InvalidInput::Url` naming the
//! URL (secrets redacted) and the option, its value (`***` for a secret) and what was expected.
//! Nothing is sent before the whole URL has parsed.
//!
//! Names and values are percent-decoded as the user name and the path are (RFC 3986): `%2B` and
//! `+` are both a plus sign, `%20` a space, and an escape that is malformed or decodes to bytes
//! that are not UTF-8 is refused. The values of unknown options, like those of secret ones, are
//! never shown in an error (a misspelt `passwd=` may hold a password).
//!
//! The common options, accepted by every adapter:
//!
//! | option | meaning |
//! |---|---|
//! | `key_prefix` | where the adapter keeps its keys (checked by the adapter's own rule) |
//! | `token_floor` | every token issued is above this value (raise it after a restore) |
//! | `request_timeout_ms` | bound on each request's response, in 1..=600000 ms |
//! | `connect_timeout_ms` | bound on opening a connection or session, in 1..=600000 ms |
//! | `owner` | the owner label leases carry unless their options name another |

use std::str::FromStr;
use std::time::Duration;

use crate::connect::{is_secret_param, BackendUrl};
use crate::error::InvalidInput;
use crate::options::OwnerId;
use crate::token::Token;

/// The names of the options every adapter accepts (see the module docs).
pub const COMMON_OPTIONS: &[&str] = &[
    "key_prefix",
    "token_floor",
    "request_timeout_ms",
    "connect_timeout_ms",
    "owner",
];

/// What a token floor may be: any token but the largest, which no token can be above.
const TOKEN_FLOOR_RANGE: &str = "an integer in 0..=9223372036854775806";

/// The largest `request_timeout_ms` or `connect_timeout_ms` accepted (10 minutes).
pub const MAX_URL_TIMEOUT: Duration = Duration::from_secs(600);

/// Checks a request or connect timeout set through an adapter's builder against the same range
/// as the URL options (1 ms to [`MAX_URL_TIMEOUT`]); otherwise `InvalidInput::OutOfRange` naming
/// `field`.
pub fn timeout_in_range(field: &'static str, d: Duration) -> Result<Duration, InvalidInput> {
    crate::options::duration_in_range(
        field,
        d,
        Duration::from_millis(1),
        MAX_URL_TIMEOUT,
        "1 ms to 600 s",
    )
}

/// What an adapter accepts besides the common options.
#[derive(Debug, Clone, Copy)]
pub struct OptionSpec {
    /// The backend's own option names.
    pub backend: &'static [&'static str],
    /// Names among `backend` whose values are secrets: errors show them as `***`.
    pub secret: &'static [&'static str],
    /// The backend's rule for `key_prefix`: `Err(expected)` describes what a valid prefix is.
    pub key_prefix: fn(&str) -> Result<(), &'static str>,
}

/// The common options as given in the URL (`None`: not given, the adapter's default applies).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommonOptions {
    /// `key_prefix`, checked by [`OptionSpec::key_prefix`].
    pub key_prefix: Option<String>,
    /// `token_floor`, in `0..Token::MAX`.
    pub token_floor: Option<Token>,
    /// `request_timeout_ms`.
    pub request_timeout: Option<Duration>,
    /// `connect_timeout_ms`.
    pub connect_timeout: Option<Duration>,
    /// `owner`, a valid [`OwnerId`].
    pub owner: Option<OwnerId>,
}

impl CommonOptions {
    /// Sets `key_prefix` when `rule` (an [`OptionSpec::key_prefix`]) accepts it; otherwise
    /// `InvalidInput::OutOfRange` naming the prefix and what the rule expects, and nothing
    /// changes.
    pub fn set_key_prefix(
        &mut self,
        prefix: String,
        rule: fn(&str) -> Result<(), &'static str>,
    ) -> Result<(), InvalidInput> {
        rule(&prefix).map_err(|expected| InvalidInput::OutOfRange {
            field: "key_prefix",
            value: format!("{prefix:?}"),
            expected,
        })?;
        self.key_prefix = Some(prefix);
        Ok(())
    }

    /// Sets `token_floor` unless it is `Token::MAX` (no token can be above it; the URL option
    /// refuses it too): then `InvalidInput::OutOfRange` naming the value, and nothing changes.
    pub fn set_token_floor(&mut self, floor: Token) -> Result<(), InvalidInput> {
        if floor >= Token::MAX {
            return Err(InvalidInput::OutOfRange {
                field: "token_floor",
                value: floor.to_string(),
                expected: TOKEN_FLOOR_RANGE,
            });
        }
        self.token_floor = Some(floor);
        Ok(())
    }
}

/// Writes the builder methods and getters of the common options ([`COMMON_OPTIONS`]) on an
/// adapter's config type, so that every backend's config has them under the same names with
/// the same contracts: `with_key_prefix`, `with_token_floor`, `with_request_timeout`,
/// `with_connect_timeout`, `with_owner`, and `key_prefix`, `token_floor`, `request_timeout`,
/// `connect_timeout`, `owner`.
///
/// The config keeps the options in a [`CommonOptions`] field (as [`UrlOptions::parse`] returns
/// them); what the URL and the builder leave unset takes the defaults given here. The timeout
/// defaults are functions of the config, so that one may follow another setting (ZooKeeper's
/// follows the session timeout).
///
/// ```
/// use std::time::Duration;
/// use lease_core::adapter::{CommonOptions, OptionSpec};
///
/// const OPTIONS: OptionSpec = OptionSpec {
///     backend: &[],
///     secret: &[],
///     key_prefix: |p| if p.is_empty() { Err("a non-empty prefix") } else { Ok(()) },
/// };
///
/// /// A backend's config.
/// #[derive(Debug, Default)]
/// pub struct MyConfig {
///     common: CommonOptions,
/// }
///
/// lease_core::common_config!(MyConfig {
///     common: common,
///     key_prefix: (OPTIONS.key_prefix, "fenced"),
///     request_timeout: |_| Duration::from_secs(2),
///     connect_timeout: |c: &MyConfig| c.request_timeout() * 2,
/// });
///
/// let c = MyConfig::default().with_request_timeout(Duration::from_millis(300))?;
/// assert!(MyConfig::default().with_token_floor(lease_core::Token::MAX).is_err());
/// assert_eq!(c.key_prefix(), "fenced");
/// assert_eq!(c.connect_timeout(), Duration::from_millis(600));
/// assert!(c.with_key_prefix("").is_err());
/// # Ok::<(), lease_core::Error>(())
/// ```
#[macro_export]
macro_rules! common_config {
    ($ty:ty {
        common: $field:ident,
        key_prefix: ($rule:expr, $default_prefix:expr),
        request_timeout: $request:expr,
        connect_timeout: $connect:expr $(,)?
    }) => {
        impl $ty {
            /// Sets the key prefix, where every key of this adapter lives (the `key_prefix`
            /// option; its rule is in the type docs).
            ///
            /// # Errors
            /// `InvalidInput::OutOfRange` naming the prefix when this backend's rule refuses
            /// it.
            pub fn with_key_prefix(
                mut self,
                prefix: impl ::core::convert::Into<::std::string::String>,
            ) -> $crate::Result<Self> {
                self.$field.set_key_prefix(prefix.into(), $rule)?;
                Ok(self)
            }

            /// Every token issued is above `floor` (the `token_floor` option: raise it after a
            /// restore from a backup or a move to new servers).
            ///
            /// # Errors
            /// `InvalidInput::OutOfRange` for `Token::MAX`, which no token can be above.
            pub fn with_token_floor(mut self, floor: $crate::Token) -> $crate::Result<Self> {
                self.$field.set_token_floor(floor)?;
                Ok(self)
            }

            /// Sets the bound on each request's response (the `request_timeout_ms` option).
            ///
            /// # Errors
            /// `InvalidInput::OutOfRange` outside 1 ms to 600 s.
            pub fn with_request_timeout(
                mut self,
                timeout: ::std::time::Duration,
            ) -> $crate::Result<Self> {
                self.$field.request_timeout = Some($crate::adapter::timeout_in_range(
                    "request_timeout",
                    timeout,
                )?);
                Ok(self)
            }

            /// Sets the bound on opening a connection or session (the `connect_timeout_ms`
            /// option).
            ///
            /// # Errors
            /// `InvalidInput::OutOfRange` outside 1 ms to 600 s.
            pub fn with_connect_timeout(
                mut self,
                timeout: ::std::time::Duration,
            ) -> $crate::Result<Self> {
                self.$field.connect_timeout = Some($crate::adapter::timeout_in_range(
                    "connect_timeout",
                    timeout,
                )?);
                Ok(self)
            }

            /// Sets the owner label leases carry unless their options name another (the
            /// `owner` option; default: this process's `host/pid`).
            pub fn with_owner(mut self, owner: $crate::OwnerId) -> Self {
                self.$field.owner = Some(owner);
                self
            }

            /// The key prefix.
            pub fn key_prefix(&self) -> &str {
                self.$field.key_prefix.as_deref().unwrap_or($default_prefix)
            }

            /// The token floor, if set.
            pub fn token_floor(&self) -> ::core::option::Option<$crate::Token> {
                self.$field.token_floor
            }

            /// The bound on each request's response.
            pub fn request_timeout(&self) -> ::std::time::Duration {
                match self.$field.request_timeout {
                    Some(timeout) => timeout,
                    None => ($request)(self),
                }
            }

            /// The bound on opening a connection or session.
            pub fn connect_timeout(&self) -> ::std::time::Duration {
                match self.$field.connect_timeout {
                    Some(timeout) => timeout,
                    None => ($connect)(self),
                }
            }

            /// The owner label set for this coordinator's leases, if any.
            pub fn owner(&self) -> ::core::option::Option<&$crate::OwnerId> {
                self.$field.owner.as_ref()
            }
        }
    };
}

/// The backend-specific options of a URL, left after the common ones were read.
///
/// Each accessor takes an option out (so it is read once) and returns `Ok(None)` when the URL
/// does not give it. Names are checked at [`UrlOptions::parse`]: an unknown or repeated name is
/// refused there, listing the known ones. Its `Debug` shows the URL redacted and each option
/// left with its value, `***` for a secret.
pub struct UrlOptions<'u> {
    url: &'u BackendUrl,
    spec: OptionSpec,
    pairs: Vec<(String, String)>,
}

impl std::fmt::Debug for UrlOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let left: Vec<(&str, &str)> = self
            .pairs
            .iter()
            .map(|(name, value)| {
                let secret = self.spec.secret.contains(&name.as_str())
                    || crate::connect::is_secret_param(name);
                (name.as_str(), if secret { "***" } else { value.as_str() })
            })
            .collect();
        f.debug_struct("UrlOptions")
            .field("url", &self.url.redacted_hiding(self.spec.secret))
            .field("left", &left)
            .finish()
    }
}

impl<'u> UrlOptions<'u> {
    /// Reads `url`'s query: refuses a fragment (`#...`, which no backend reads) and unknown and
    /// repeated names, parses the common options and keeps the backend's own for its accessors.
    pub fn parse(
        url: &'u BackendUrl,
        spec: OptionSpec,
    ) -> Result<(CommonOptions, UrlOptions<'u>), InvalidInput> {
        if url.expose().fragment().is_some() {
            return Err(invalid(
                url,
                &spec,
                "URL fragments are not supported".to_owned(),
            ));
        }
        let mut pairs: Vec<(String, String)> = Vec::new();
        for (name, value) in url.query_pairs()? {
            let known =
                COMMON_OPTIONS.contains(&name.as_str()) || spec.backend.contains(&name.as_str());
            if !known {
                let names: Vec<&str> = COMMON_OPTIONS.iter().chain(spec.backend).copied().collect();
                return Err(invalid(
                    url,
                    &spec,
                    format!("unknown option {name:?} (known: {})", names.join(", ")),
                ));
            }
            if pairs.iter().any(|(n, _)| *n == name) {
                return Err(invalid(
                    url,
                    &spec,
                    format!("option {name:?} is given twice"),
                ));
            }
            pairs.push((name, value));
        }
        let mut options = UrlOptions { url, spec, pairs };
        let common = CommonOptions {
            key_prefix: options.value("key_prefix", "a valid key prefix", |p| {
                (spec.key_prefix)(p).map(|()| p.to_owned())
            })?,
            token_floor: options.value("token_floor", TOKEN_FLOOR_RANGE, |v| {
                v.parse::<Token>()
                    .ok()
                    .filter(|t| *t < Token::MAX)
                    .ok_or(TOKEN_FLOOR_RANGE)
            })?,
            request_timeout: options.millis(
                "request_timeout_ms",
                Duration::from_millis(1),
                MAX_URL_TIMEOUT,
            )?,
            connect_timeout: options.millis(
                "connect_timeout_ms",
                Duration::from_millis(1),
                MAX_URL_TIMEOUT,
            )?,
            owner: options.value(
                "owner",
                "a non-empty label without control characters",
                |v| OwnerId::new(v).map_err(|_| "a non-empty label without control characters"),
            )?,
        };
        Ok((common, options))
    }

    /// The URL the options came from.
    pub fn url(&self) -> &'u BackendUrl {
        self.url
    }

    /// Takes the raw value of `name`.
    pub fn take(&mut self, name: &str) -> Option<String> {
        debug_assert!(
            COMMON_OPTIONS.contains(&name) || self.spec.backend.contains(&name),
            "option {name:?} is not in the adapter's OptionSpec"
        );
        let i = self.pairs.iter().position(|(n, _)| n == name)?;
        Some(self.pairs.remove(i).1)
    }

    /// Takes `name` and converts it with `parse`; `Err(expected)` from `parse` becomes the
    /// option's error (`expected` describes a valid value; `fallback` is used when `parse`
    /// returns the empty string).
    pub fn value<T>(
        &mut self,
        name: &str,
        fallback: &'static str,
        parse: impl FnOnce(&str) -> Result<T, &'static str>,
    ) -> Result<Option<T>, InvalidInput> {
        let Some(raw) = self.take(name) else {
            return Ok(None);
        };
        parse(&raw).map(Some).map_err(|expected| {
            let expected = if expected.is_empty() {
                fallback
            } else {
                expected
            };
            self.bad(name, &raw, expected)
        })
    }

    /// Takes `name` as whole milliseconds in `min..=max`.
    pub fn millis(
        &mut self,
        name: &str,
        min: Duration,
        max: Duration,
    ) -> Result<Option<Duration>, InvalidInput> {
        let Some(raw) = self.take(name) else {
            return Ok(None);
        };
        raw.parse::<u64>()
            .ok()
            .map(Duration::from_millis)
            .filter(|d| (min..=max).contains(d))
            .map(Some)
            .ok_or_else(|| {
                let expected = format!("milliseconds in {}..={}", min.as_millis(), max.as_millis());
                self.bad(name, &raw, &expected)
            })
    }

    /// Takes `name` as a flag ([`parse_flag`]).
    pub fn flag(&mut self, name: &str) -> Result<Option<bool>, InvalidInput> {
        self.value(name, "true or false", |v| {
            parse_flag(v).ok_or("true or false")
        })
    }

    /// Takes `name` and parses it with [`FromStr`].
    pub fn parsed<T: FromStr>(
        &mut self,
        name: &str,
        expected: &'static str,
    ) -> Result<Option<T>, InvalidInput> {
        self.value(name, expected, |v| v.parse().map_err(|_| expected))
    }

    /// Takes `name` as a non-empty file path.
    pub fn path(&mut self, name: &str) -> Result<Option<std::path::PathBuf>, InvalidInput> {
        self.value(name, "a file path", |v| {
            if v.is_empty() {
                Err("a file path")
            } else {
                Ok(std::path::PathBuf::from(v))
            }
        })
    }

    /// Whether the URL gives `name` (without taking it).
    pub fn has(&self, name: &str) -> bool {
        self.pairs.iter().any(|(n, _)| n == name)
    }

    /// The error for option `name` with value `value`: the URL (redacted), the option, its value
    /// (`***` when the option is a secret) and what was expected.
    pub fn bad(&self, name: &str, value: &str, expected: &str) -> InvalidInput {
        let secret = self.spec.secret.contains(&name) || is_secret_param(name);
        let shown = if secret {
            "\"***\"".to_owned()
        } else {
            format!("{value:?}")
        };
        invalid(
            self.url,
            &self.spec,
            format!("{name}={shown}: expected {expected}"),
        )
    }

    /// An `InvalidInput::Url` naming the URL with every secret hidden.
    pub fn invalid(&self, problem: impl Into<String>) -> InvalidInput {
        invalid(self.url, &self.spec, problem.into())
    }
}

/// A flag's value, as every backend's URL options read it: `true`/`1`/`yes` or
/// `false`/`0`/`no`, in any case; `None` for anything else.
pub fn parse_flag(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

/// An `InvalidInput::Url` naming `url` with the values of its secret options hidden, and those
/// of unknown options too (a misspelt `passwd=` may well hold a password).
fn invalid(url: &BackendUrl, spec: &OptionSpec, problem: String) -> InvalidInput {
    let shown = |name: &str| {
        (COMMON_OPTIONS.contains(&name) || spec.backend.contains(&name))
            && !spec.secret.contains(&name)
            && !is_secret_param(name)
    };
    InvalidInput::Url {
        url: url.redacted_with(&|name| !shown(name)),
        problem,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: OptionSpec = OptionSpec {
        backend: &["flavour", "secret_thing", "wait_ms", "ca_file"],
        secret: &["secret_thing"],
        key_prefix: |p| {
            if p.is_empty() || p.contains(' ') {
                Err("a non-empty prefix without spaces")
            } else {
                Ok(())
            }
        },
    };

    fn parse(s: &str) -> Result<CommonOptions, String> {
        let url = BackendUrl::parse(s).unwrap();
        UrlOptions::parse(&url, SPEC)
            .map(|(c, _)| c)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn common_options_have_one_meaning() {
        let c = parse(
            "x://u:pw@h:1?key_prefix=app&token_floor=10&request_timeout_ms=500&connect_timeout_ms=700&owner=w1",
        )
        .unwrap();
        assert_eq!(c.key_prefix.as_deref(), Some("app"));
        assert_eq!(c.token_floor, Some(Token::new(10).unwrap()));
        assert_eq!(c.request_timeout, Some(Duration::from_millis(500)));
        assert_eq!(c.connect_timeout, Some(Duration::from_millis(700)));
        assert_eq!(c.owner.as_ref().map(|o| o.as_str()), Some("w1"));
        assert_eq!(parse("x://h:1").unwrap(), CommonOptions::default());
    }

    #[test]
    fn bad_values_name_the_option_the_value_and_the_range_without_secrets() {
        for (url, wanted) in [
            (
                "x://u:pw@h:1?token_floor=-1",
                "token_floor=\"-1\": expected an integer",
            ),
            (
                "x://u:pw@h:1?token_floor=9223372036854775807",
                "expected an integer in 0..=9223372036854775806",
            ),
            (
                "x://u:pw@h:1?request_timeout_ms=0",
                "request_timeout_ms=\"0\": expected milliseconds in 1..=600000",
            ),
            (
                "x://u:pw@h:1?key_prefix=a%20b",
                "key_prefix=\"a b\": expected a non-empty prefix",
            ),
            (
                "x://u:pw@h:1?nope=1",
                "unknown option \"nope\" (known: key_prefix,",
            ),
            (
                "x://u:pw@h:1?owner=a&owner=b",
                "option \"owner\" is given twice",
            ),
            (
                "x://u:pw@h:1?owner=",
                "owner=\"\": expected a non-empty label",
            ),
        ] {
            let e = parse(url).unwrap_err();
            assert!(e.contains(wanted), "{url}: {e}");
            assert!(!e.contains("pw"), "{url}: the password leaked: {e}");
            assert!(e.contains("***"), "{url}: {e}");
        }
    }

    /// Query values are decoded as the user name and the path are: `+` is a plus sign (form
    /// decoding made it a space, so `?key_prefix=svc+locks` and a path `/svc+locks` named two
    /// namespaces), and bytes that are not UTF-8 are refused rather than replaced.
    #[test]
    fn query_values_are_percent_decoded_as_the_rest_of_the_url() {
        let c = parse("x://h:1?key_prefix=svc+locks&owner=a%2Bb%20c").unwrap();
        assert_eq!(c.key_prefix.as_deref(), Some("svc+locks"));
        assert_eq!(c.owner.as_ref().map(|o| o.as_str()), Some("a+b c"));
        for (url, named) in [
            ("x://h:1?key_prefix=%FF", "\"key_prefix\""),
            ("x://h:1?owner=%+1", "\"owner\""),
            ("x://h:1?own%Zr=1", "name"),
        ] {
            let e = parse(url).unwrap_err();
            assert!(
                e.contains("malformed percent escape") && e.contains(named),
                "{url}: {e}"
            );
        }
    }

    /// An unknown option may be a misspelt secret: its value is not shown, nor is a fragment,
    /// which may be the rest of a value holding a `#`.
    #[test]
    fn errors_show_no_value_of_an_unknown_option_nor_a_fragment() {
        let e = parse("x://h:1?passwd=hunter2&flavour=mint").unwrap_err();
        assert!(e.contains("unknown option \"passwd\""), "{e}");
        assert!(!e.contains("hunter2") && e.contains("passwd=***"), "{e}");
        assert!(
            e.contains("flavour=mint"),
            "a known option's value helps: {e}"
        );
        let e = parse("x://h:1/x?secret_thing=alice:pa#ssw0rd").unwrap_err();
        assert!(e.contains("fragments are not supported"), "{e}");
        assert!(!e.contains("pa#") && !e.contains("ssw0rd"), "{e}");
    }

    #[test]
    fn debug_hides_secret_values() {
        let url = BackendUrl::parse("x://u:pw@h:1?flavour=mint&secret_thing=hunter2").unwrap();
        let (_, opts) = UrlOptions::parse(&url, SPEC).unwrap();
        let shown = format!("{opts:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("pw@"),
            "{shown}"
        );
        assert!(
            shown.contains("secret_thing") && shown.contains("mint"),
            "{shown}"
        );
    }

    #[test]
    fn backend_options_are_taken_once_and_secrets_stay_hidden() {
        let url = BackendUrl::parse(
            "x://h:1?flavour=mint&secret_thing=hunter2&wait_ms=20&ca_file=/etc/ca.pem",
        )
        .unwrap();
        let (_, mut o) = UrlOptions::parse(&url, SPEC).unwrap();
        assert!(o.has("flavour"));
        assert_eq!(o.take("flavour").as_deref(), Some("mint"));
        assert_eq!(o.take("flavour"), None);
        assert_eq!(
            o.millis("wait_ms", Duration::from_millis(1), Duration::from_secs(1))
                .unwrap(),
            Some(Duration::from_millis(20))
        );
        assert_eq!(
            o.path("ca_file").unwrap(),
            Some(std::path::PathBuf::from("/etc/ca.pem"))
        );
        let e = o
            .value::<u8>("secret_thing", "a number", |_| Err(""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("secret_thing=\"***\": expected a number"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");

        let url = BackendUrl::parse("x://h:1?flavour=maybe").unwrap();
        let (_, mut o) = UrlOptions::parse(&url, SPEC).unwrap();
        let e = o.flag("flavour").unwrap_err().to_string();
        assert!(
            e.contains("flavour=\"maybe\": expected true or false"),
            "{e}"
        );
    }

    #[test]
    fn a_fragment_is_refused_naming_the_url_without_its_secret() {
        let url = BackendUrl::parse("x://u:pw@h/?secret_thing=s3#insecure").unwrap();
        match UrlOptions::parse(&url, SPEC) {
            Err(InvalidInput::Url { url, problem }) => {
                assert!(problem.contains("fragment"), "{problem}");
                assert!(!url.contains("pw") && !url.contains("s3"), "{url}");
            }
            other => panic!("expected a URL error, got {other:?}"),
        }
    }
}
