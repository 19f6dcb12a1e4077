//! Choosing a backend from a URL: [`BackendUrl`] (secrets redacted) and the [`Registry`].

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::coordinator::Coordinator;
use crate::error::{InvalidInput, Result};
use crate::fence::Fence;
use crate::instrument::Instrumented;
use crate::memory::{MemoryCoordinator, MemoryFence};

/// A parsed backend URL such as `redis://user:pw@127.0.0.1:6379` or `memory://`.
///
/// `Debug` and `Display` show the password as `***`; only [`BackendUrl::expose`] gives the raw URL.
#[derive(Clone, PartialEq, Eq)]
pub struct BackendUrl {
    url: url::Url,
}

impl BackendUrl {
    /// Parses `s`. Errors name the URL with any password redacted.
    pub fn parse(s: &str) -> Result<Self, InvalidInput> {
        let url = url::Url::parse(s).map_err(|e| InvalidInput::Url {
            url: redact_unparsed(s),
            problem: e.to_string(),
        })?;
        Ok(BackendUrl { url })
    }

    /// The scheme (`redis`, `etcd`, `memory`, ...).
    pub fn scheme(&self) -> &str {
        self.url.scheme()
    }

    /// The URL with its secrets. Pass it only to the client library; never log it.
    pub fn expose(&self) -> &url::Url {
        &self.url
    }

    /// The URL with the password replaced by `***`.
    pub fn redacted(&self) -> String {
        let mut u = self.url.clone();
        if u.password().is_some() {
            let _ = u.set_password(Some("***"));
        }
        let mut pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let secret = is_secret_param(&k);
                (
                    k.into_owned(),
                    if secret { "***".into() } else { v.into_owned() },
                )
            })
            .collect();
        if !pairs.is_empty() {
            u.query_pairs_mut().clear().extend_pairs(pairs.drain(..));
        }
        u.to_string()
    }

    /// An `InvalidInput::Url` naming this URL (redacted).
    pub fn invalid(&self, problem: impl Into<String>) -> InvalidInput {
        InvalidInput::Url {
            url: self.redacted(),
            problem: problem.into(),
        }
    }
}

/// Whether a query parameter carries a secret (its value is shown as `***`). `digest` is
/// ZooKeeper's `user:password`.
fn is_secret_param(key: &str) -> bool {
    matches!(
        key.to_ascii_lowercase().as_str(),
        "password" | "token" | "secret" | "auth" | "acl_token" | "digest"
    )
}

/// Redacts `user:password@` and secret query values in a string that did not parse as a URL.
fn redact_unparsed(s: &str) -> String {
    let Some(scheme_end) = s.find("://") else {
        return s.chars().take(128).collect();
    };
    let rest = &s[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let shown = match rest[..authority_end].rfind('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}://{}:***{}", &s[..scheme_end], user, &rest[at..])
        }
        None => s.to_owned(),
    };
    let shown = match shown.split_once('?') {
        Some((head, query)) => {
            let pairs: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_secret_param(k) => format!("{k}=***"),
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{head}?{}", pairs.join("&"))
        }
        None => shown,
    };
    shown.chars().take(256).collect()
}

impl fmt::Debug for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BackendUrl({})", self.redacted())
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Makes a coordinator from a URL.
pub type CoordinatorFactory =
    Arc<dyn Fn(BackendUrl) -> BoxFuture<'static, Result<Arc<dyn Coordinator>>> + Send + Sync>;
/// Makes a fence from a URL.
pub type FenceFactory =
    Arc<dyn Fn(BackendUrl) -> BoxFuture<'static, Result<Arc<dyn Fence>>> + Send + Sync>;

/// Maps URL schemes to backends, so that library code picks a backend from configuration.
///
/// lease-core knows only `memory://`; each adapter crate registers its own scheme(s). Handles made
/// by [`Registry::connect`] and [`Registry::connect_fence`] are always [`Instrumented`].
#[derive(Clone)]
pub struct Registry {
    coordinators: HashMap<String, CoordinatorFactory>,
    fences: HashMap<String, FenceFactory>,
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut c: Vec<_> = self.coordinators.keys().collect();
        let mut fe: Vec<_> = self.fences.keys().collect();
        c.sort();
        fe.sort();
        f.debug_struct("Registry")
            .field("coordinators", &c)
            .field("fences", &fe)
            .finish()
    }
}

impl Default for Registry {
    fn default() -> Self {
        Self::new()
    }
}

impl Registry {
    /// A registry that knows `memory://` (a new in-process coordinator or fence per connect).
    pub fn new() -> Self {
        let mut r = Registry {
            coordinators: HashMap::new(),
            fences: HashMap::new(),
        };
        r.register_coordinator(
            "memory",
            Arc::new(|_url| {
                Box::pin(async { Ok(Arc::new(MemoryCoordinator::new()) as Arc<dyn Coordinator>) })
            }),
        );
        r.register_fence(
            "memory",
            Arc::new(|_url| Box::pin(async { Ok(Arc::new(MemoryFence::new()) as Arc<dyn Fence>) })),
        );
        r
    }

    /// Registers (or replaces) the coordinator for `scheme`.
    pub fn register_coordinator(&mut self, scheme: &str, factory: CoordinatorFactory) {
        self.coordinators
            .insert(scheme.to_ascii_lowercase(), factory);
    }

    /// Registers (or replaces) the fence for `scheme`.
    pub fn register_fence(&mut self, scheme: &str, factory: FenceFactory) {
        self.fences.insert(scheme.to_ascii_lowercase(), factory);
    }

    fn unknown(&self, url: &BackendUrl, what: &str, known: Vec<&String>) -> InvalidInput {
        let mut known: Vec<_> = known.into_iter().map(String::as_str).collect();
        known.sort();
        url.invalid(format!(
            "no {what} is registered for scheme {:?} (known: {})",
            url.scheme(),
            known.join(", ")
        ))
    }

    /// Connects to the coordinator named by `url`, instrumented.
    pub async fn connect(&self, url: &str) -> Result<Arc<dyn Coordinator>> {
        let url = BackendUrl::parse(url)?;
        let factory = self
            .coordinators
            .get(url.scheme())
            .ok_or_else(|| self.unknown(&url, "coordinator", self.coordinators.keys().collect()))?;
        let inner = factory(url).await?;
        Ok(Arc::new(Instrumented::new(inner)))
    }

    /// Connects to the fence named by `url`, instrumented.
    pub async fn connect_fence(&self, url: &str) -> Result<Arc<dyn Fence>> {
        let url = BackendUrl::parse(url)?;
        let factory = self
            .fences
            .get(url.scheme())
            .ok_or_else(|| self.unknown(&url, "fence", self.fences.keys().collect()))?;
        let inner = factory(url).await?;
        Ok(Arc::new(Instrumented::new(inner)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn password_never_shows() {
        let u = BackendUrl::parse("redis://alice:s3cret@127.0.0.1:6379/0?token=abc&db=1").unwrap();
        for shown in [format!("{u}"), format!("{u:?}")] {
            assert!(
                !shown.contains("s3cret") && !shown.contains("abc"),
                "{shown}"
            );
            assert!(shown.contains("alice") && shown.contains("db=1"), "{shown}");
        }
        assert_eq!(u.expose().password(), Some("s3cret"));
    }

    #[test]
    fn unparsable_url_error_is_redacted() {
        let e = BackendUrl::parse("redis://bob:hunter2@[bad")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("hunter2"), "{e}");
        assert!(e.contains("bob:***"), "{e}");
        // A ZooKeeper host list with ports does not parse; its digest must not show either.
        let e = BackendUrl::parse("zk://h1:2181,h2:2182/x?digest=alice:s3cret")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret") && e.contains("digest=***"), "{e}");
        let u = BackendUrl::parse("zk://h/x?digest=alice:s3cret").unwrap();
        assert!(!format!("{u:?} {u}").contains("s3cret"), "{u:?}");
        assert!(BackendUrl::parse("not a url").is_err());
    }

    #[tokio::test]
    async fn unknown_scheme_is_invalid_input_naming_it() {
        let r = Registry::new();
        let e = r.connect("nosuch://x:pw@h").await.unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, crate::Error::InvalidInput(_)), "{s}");
        assert!(
            s.contains("\"nosuch\"") && s.contains("memory") && !s.contains("pw@"),
            "{s}"
        );
        let c = r.connect("memory://").await.unwrap();
        assert_eq!(c.capabilities().backend, "memory");
        assert!(r.connect_fence("memory://").await.is_ok());
    }
}
