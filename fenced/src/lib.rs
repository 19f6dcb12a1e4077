#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]

use std::sync::Arc;

pub use lease_core::*;

/// The workspace's root README, so that its Rust examples compile and run as doctests of this
/// crate (`cargo test -p fenced --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct RootReadme;

/// Every URL scheme this workspace ships, with the cargo feature of `fenced` that enables it.
pub const SCHEMES: &[(&str, &str)] = &[
    ("redis", "redis"),
    ("rediss", "redis"),
    ("redis+sentinel", "redis"),
    ("etcd", "etcd"),
    ("etcds", "etcd"),
    ("zk", "zookeeper"),
    ("consul", "consul"),
    ("consuls", "consul"),
    ("postgres", "postgres"),
    ("postgresql", "postgres"),
];

/// A registry with every backend enabled by this build's cargo features registered (and
/// `memory://`, always).
pub fn registry() -> Registry {
    #[allow(unused_mut)]
    let mut r = Registry::new();
    #[cfg(feature = "redis")]
    adapter_redis::register(&mut r);
    #[cfg(feature = "etcd")]
    adapter_etcd::register(&mut r);
    #[cfg(feature = "zookeeper")]
    adapter_zookeeper::register(&mut r);
    #[cfg(feature = "consul")]
    adapter_consul::register(&mut r);
    #[cfg(feature = "postgres")]
    r.register_fence_fn(&["postgres", "postgresql"], |url| async move {
        // The text as written: the parsed URL carries only the first host of a list.
        fence_postgres::PgFence::connect(url.expose_str()).await
    });
    r
}

/// Each backend feature, and whether this build has it.
const ENABLED: &[(&str, bool)] = &[
    ("redis", cfg!(feature = "redis")),
    ("etcd", cfg!(feature = "etcd")),
    ("zookeeper", cfg!(feature = "zookeeper")),
    ("consul", cfg!(feature = "consul")),
    ("postgres", cfg!(feature = "postgres")),
];

/// The schemes of [`SCHEMES`] that name a fence only: `connect` cannot reach them with any
/// feature.
const FENCE_ONLY: &[&str] = &["postgres", "postgresql"];
/// The schemes of [`SCHEMES`] that name a coordinator only: `connect_fence` cannot reach them
/// with any feature.
const COORDINATOR_ONLY: &[&str] = &["zk", "consul", "consuls"];

/// What a URL is asked to connect to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Coordinator,
    Fence,
}

/// The cargo feature that enables `url`'s scheme for `role`, when this build was made without
/// it. `None` for a scheme that does not serve `role` at all: the registry's error then says
/// so, since no feature would help.
fn disabled_feature(url: &str, role: Role) -> Option<&'static str> {
    let scheme = scheme_of(url)?;
    let other_role_only = match role {
        Role::Coordinator => FENCE_ONLY,
        Role::Fence => COORDINATOR_ONLY,
    };
    if other_role_only.contains(&scheme.as_str()) {
        return None;
    }
    let (_, feature) = SCHEMES.iter().find(|(s, _)| *s == scheme)?;
    let enabled = ENABLED
        .iter()
        .find(|(f, _)| f == feature)
        .is_none_or(|(_, on)| *on);
    (!enabled).then_some(*feature)
}

/// The `backend` of the errors this crate makes itself ([`Error::Unsupported`] for a scheme
/// whose cargo feature is off), all of them before anything is sent; a backend's own errors name
/// that backend instead.
pub const BACKEND: &str = "fenced";

/// The scheme of `url` as the registry's URL parser reads it, lower-cased: leading spaces and
/// control characters, and every tab and newline, are not part of the URL; the scheme is what
/// stands before the first `:` (`etcd:h:2379` too) when it is a valid scheme.
fn scheme_of(url: &str) -> Option<String> {
    let cleaned: String = url
        .trim_start_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .take_while(|c| *c != ':')
        .collect();
    let valid = cleaned.starts_with(|c: char| c.is_ascii_alphabetic())
        && cleaned
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then(|| cleaned.to_ascii_lowercase())
}

fn feature_error(feature: &'static str, url: &str) -> Error {
    let scheme = scheme_of(url).unwrap_or_default();
    Error::Unsupported {
        backend: BACKEND,
        what: format!(
            "{scheme}:// URLs: this build of `fenced` was made without its cargo feature \"{feature}\" \
             (enable it, or \"full\" for every backend)"
        ),
    }
}

/// Connects to the coordinator named by `url` (see the table above), instrumented.
///
/// # Errors
/// `Unsupported` naming the cargo feature when the scheme's backend was not compiled in; the
/// registry's errors otherwise (`InvalidInput` for an unknown scheme or a malformed URL).
pub async fn connect(url: &str) -> Result<Arc<dyn Coordinator>> {
    if let Some(feature) = disabled_feature(url, Role::Coordinator) {
        return Err(feature_error(feature, url));
    }
    registry().connect(url).await
}

/// Connects to the fence named by `url`, instrumented.
///
/// # Errors
/// As [`connect`].
pub async fn connect_fence(url: &str) -> Result<Arc<dyn Fence>> {
    if let Some(feature) = disabled_feature(url, Role::Fence) {
        return Err(feature_error(feature, url));
    }
    registry().connect_fence(url).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_needs_no_feature() {
        let c = connect("memory://").await.unwrap();
        assert_eq!(c.capabilities().backend, "memory");
        connect_fence("memory://").await.unwrap();
    }

    /// Runs when the facade is built without its etcd feature (`cargo test -p fenced`, as the
    /// test script does): the error names the feature and never the URL's password.
    #[cfg(not(feature = "etcd"))]
    #[tokio::test]
    async fn a_scheme_whose_feature_is_off_is_unsupported_naming_the_feature() {
        // With leading blanks too, which the URL parser skips.
        for url in [
            "etcd://user:s3cret@127.0.0.1:2379",
            " \tetcd://user:s3cret@127.0.0.1:2379",
            // Tabs and newlines anywhere are dropped by the URL parser; `//` is optional.
            "et\tcd://user:s3cret@127.0.0.1:2379",
            "ETCD:user:s3cret@127.0.0.1:2379",
        ] {
            let e = connect(url).await.unwrap_err();
            let shown = e.to_string();
            assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
            assert!(
                shown.contains("\"etcd\"")
                    && shown.contains("etcd://")
                    && !shown.contains("s3cret"),
                "{shown}"
            );
        }
    }

    /// A scheme that names only the other kind of backend is not a missing feature: turning one
    /// on would not help. The registry's own error (`InvalidInput`, listing the schemes) says so.
    #[cfg(not(feature = "full"))]
    #[tokio::test]
    async fn a_scheme_of_the_other_kind_is_not_blamed_on_a_feature() {
        for e in [
            connect("postgres://h/db").await.unwrap_err(),
            connect_fence("zk://h:2181").await.unwrap_err(),
            connect_fence("consul://h:8500").await.unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
            assert!(!e.to_string().contains("feature"), "{e}");
        }
    }

    #[tokio::test]
    async fn the_registry_refuses_a_scheme_of_the_other_kind() {
        // Whatever the features, the registry has no such factory.
        let e = registry().connect("postgres://h/db").await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
        let e = registry().connect_fence("zk://h:2181").await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{e:?}");
    }

    /// Every backend's config takes the common options through the same builder methods, with
    /// the same contracts, as through its URL.
    #[cfg(feature = "full")]
    #[test]
    fn every_backend_config_has_the_common_builder_under_the_same_names() {
        use std::time::Duration;
        macro_rules! same_builder {
            ($config:ty, $url:expr) => {{
                let floor = Token::new(41).unwrap();
                let owner = OwnerId::new("worker-7").unwrap();
                let built = <$config>::from_url($url)
                    .unwrap()
                    .with_key_prefix("app")
                    .unwrap()
                    .with_token_floor(floor)
                    .unwrap()
                    .with_request_timeout(Duration::from_millis(1500))
                    .unwrap()
                    .with_connect_timeout(Duration::from_millis(2500))
                    .unwrap()
                    .with_owner(owner.clone());
                let parsed = <$config>::from_url(&format!(
                    "{}?key_prefix=app&token_floor=41&request_timeout_ms=1500\
                     &connect_timeout_ms=2500&owner=worker-7",
                    $url
                ))
                .unwrap();
                for c in [&built, &parsed] {
                    assert_eq!(c.key_prefix(), "app", "{}", $url);
                    assert_eq!(c.token_floor(), Some(floor), "{}", $url);
                    assert_eq!(c.request_timeout(), Duration::from_millis(1500), "{}", $url);
                    assert_eq!(c.connect_timeout(), Duration::from_millis(2500), "{}", $url);
                    assert_eq!(c.owner(), Some(&owner), "{}", $url);
                }
                let fresh = || <$config>::from_url($url).unwrap();
                for (e, field) in [
                    (fresh().with_key_prefix("").unwrap_err(), "key_prefix"),
                    (
                        fresh().with_token_floor(Token::MAX).unwrap_err(),
                        "token_floor",
                    ),
                    (
                        fresh().with_request_timeout(Duration::ZERO).unwrap_err(),
                        "request_timeout",
                    ),
                    (
                        fresh()
                            .with_connect_timeout(Duration::from_secs(601))
                            .unwrap_err(),
                        "connect_timeout",
                    ),
                ] {
                    assert!(
                        matches!(e, Error::InvalidInput(InvalidInput::OutOfRange { field: f, .. }) if f == field),
                        "{}: {e:?}",
                        $url
                    );
                }
            }};
        }
        same_builder!(adapter_redis::RedisConfig, "redis://127.0.0.1:6379");
        same_builder!(adapter_etcd::EtcdConfig, "etcd://127.0.0.1:2379");
        same_builder!(adapter_zookeeper::ZkConfig, "zk://127.0.0.1:2181");
        same_builder!(adapter_consul::ConsulConfig, "consul://127.0.0.1:8500");
    }

    #[cfg(feature = "full")]
    #[tokio::test]
    async fn every_listed_scheme_is_registered_with_every_feature() {
        let r = registry();
        let coordinators = r.connect("nope://h").await.unwrap_err().to_string();
        let fences = r.connect_fence("nope://h").await.unwrap_err().to_string();
        for (scheme, _) in SCHEMES {
            let listed = format!("{scheme},");
            let last = format!("{scheme})");
            assert!(
                [&coordinators, &fences]
                    .iter()
                    .any(|m| m.contains(&listed) || m.contains(&last)),
                "{scheme} is not registered: {coordinators} / {fences}"
            );
            for role in [Role::Coordinator, Role::Fence] {
                assert_eq!(disabled_feature(&format!("{scheme}://h"), role), None);
            }
        }
    }
}
