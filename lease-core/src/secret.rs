//! [`Secret`]: a credential that never shows in `Debug` or `Display`.

use std::fmt;

/// A credential a config or a client holds (a password, an ACL token): its `Debug` and
/// `Display` print `***`, so a type holding one can derive `Debug` and a field added later
/// cannot leak it by being forgotten in a hand-written impl. Only [`Secret::expose`] gives the
/// value, for the one place that hands it to the backend's client.
///
/// ```
/// use lease_core::adapter::Secret;
///
/// #[derive(Debug)]
/// struct Login {
///     user: String,
///     password: Secret,
/// }
///
/// let login = Login { user: "alice".into(), password: Secret::new("hunter2") };
/// assert_eq!(format!("{login:?}"), r#"Login { user: "alice", password: *** }"#);
/// assert_eq!(login.password.to_string(), "***");
/// assert_eq!(login.password.expose(), "hunter2");
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself: only for handing it to the backend.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}
