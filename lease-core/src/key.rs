//! Validated names: lock keys and protected-resource ids.
//!
//! Both follow one set of rules, checked before anything is sent to a backend:
//!
//! - 1 to [`MAX_NAME_BYTES`] bytes of UTF-8;
//! - no control characters (U+0000..U+001F, U+007F..U+009F), and no invisible formatting or
//!   line-separating ones (Unicode Cf, Zl, Zp: U+202E RIGHT-TO-LEFT OVERRIDE, U+200B ZERO WIDTH
//!   SPACE, U+2028 LINE SEPARATOR, ...), so that a key printed in a log or an operator's
//!   listing shows every character it has. Keys are compared byte for byte and not normalized:
//!   `é` as one code point (NFC) and as `e` plus a combining accent (NFD) are two keys that
//!   print alike, as are look-alike letters of two scripts. Normalize keys before naming them
//!   if your sources may differ;
//! - `/` separates segments: no leading or trailing `/`, no empty segment (`//`), no `.` or `..`
//!   segment, so that a key maps onto a ZooKeeper path or an etcd prefix without escaping or
//!   aliasing another key.
//!
//! Any other Unicode is allowed: `orders/42`, `tenant-7/Ünïcødé/job`.

use std::fmt;
use std::str::FromStr;

use crate::error::InvalidInput;

/// The longest key or resource id, in bytes of UTF-8.
///
/// 256 bytes leaves room for every adapter's own prefix and suffix inside the backends' own limits
/// (ZooKeeper paths, Redis keys in a Cluster hash tag, Consul KV keys).
pub const MAX_NAME_BYTES: usize = 256;

/// Whether `c` is a control character or an invisible formatting or line-separating one (no
/// ASCII character is, except the controls).
fn hidden(c: char) -> bool {
    use unicode_properties::{GeneralCategory, UnicodeGeneralCategory};
    c.is_control()
        || (!c.is_ascii()
            && matches!(
                c.general_category(),
                GeneralCategory::Format
                    | GeneralCategory::LineSeparator
                    | GeneralCategory::ParagraphSeparator
            ))
}

fn validate_name(what: &'static str, value: &str) -> Result<(), InvalidInput> {
    if value.is_empty() {
        return Err(InvalidInput::Empty { what });
    }
    if value.len() > MAX_NAME_BYTES {
        let mut end = 64;
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        return Err(InvalidInput::TooLong {
            what,
            value: format!("{}...", &value[..end]),
            len: value.len(),
            max: MAX_NAME_BYTES,
        });
    }
    if let Some((index, ch)) = value.char_indices().find(|&(_, c)| hidden(c)) {
        return Err(InvalidInput::ControlCharacter {
            what,
            value: value.to_owned(),
            ch,
            index,
        });
    }
    let problem = if value.starts_with('/') {
        Some("it starts with '/'")
    } else if value.ends_with('/') {
        Some("it ends with '/'")
    } else if value.contains("//") {
        Some("it contains an empty segment ('//')")
    } else if value.split('/').any(|s| s == "..") {
        Some("it contains a '..' segment")
    } else if value.split('/').any(|s| s == ".") {
        Some("it contains a '.' segment")
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(InvalidInput::PathEscape {
            what,
            value: value.to_owned(),
            problem,
        });
    }
    Ok(())
}

fn validate_bytes<'a>(what: &'static str, bytes: &'a [u8]) -> Result<&'a str, InvalidInput> {
    let s = std::str::from_utf8(bytes).map_err(|e| InvalidInput::NotUtf8 {
        what,
        index: e.valid_up_to(),
    })?;
    validate_name(what, s)?;
    Ok(s)
}

macro_rules! name_type {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(String);

        impl $name {
            /// Validates `value` (see the module docs for the rules).
            pub fn new(value: impl Into<String>) -> Result<Self, InvalidInput> {
                let value = value.into();
                validate_name($what, &value)?;
                Ok(Self(value))
            }

            /// Validates raw bytes: they must be UTF-8 and follow the same rules.
            pub fn from_bytes(bytes: &[u8]) -> Result<Self, InvalidInput> {
                validate_bytes($what, bytes).map(|s| Self(s.to_owned()))
            }

            /// The validated name.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The name's `/`-separated segments (never empty, never `.` or `..`).
            pub fn segments(&self) -> impl Iterator<Item = &str> {
                self.0.split('/')
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = InvalidInput;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<&str> for $name {
            type Error = InvalidInput;
            fn try_from(s: &str) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidInput;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }
    };
}

name_type!(
    /// The name of a lock, validated (see the module docs).
    ///
    /// Keys order by their bytes; [`crate::acquire_many`] takes several keys in that order.
    LockKey,
    "lock key"
);

name_type!(
    /// The name of a protected resource at a [`crate::Fence`], validated like a [`LockKey`].
    ResourceId,
    "resource id"
);

impl From<&LockKey> for ResourceId {
    /// The resource named like the lock that protects it (a common, not required, convention).
    fn from(key: &LockKey) -> Self {
        ResourceId(key.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_and_unicode_keys() {
        for k in [
            "a",
            "orders/42",
            "tenant-7/Ünïcødé/job",
            "a.b",
            "...",
            "x/.y",
            "日本/語",
        ] {
            LockKey::new(k).unwrap_or_else(|e| panic!("{k:?}: {e}"));
        }
        let max = "k".repeat(MAX_NAME_BYTES);
        assert!(LockKey::new(max).is_ok());
    }

    #[test]
    fn rejects_each_bad_key_with_its_own_error() {
        assert_eq!(
            LockKey::new(""),
            Err(InvalidInput::Empty { what: "lock key" })
        );
        assert!(matches!(
            LockKey::new("k".repeat(MAX_NAME_BYTES + 1)),
            Err(InvalidInput::TooLong {
                len: 257,
                max: 256,
                ..
            })
        ));
        // Multi-byte characters count in bytes, and the message truncates on a char boundary.
        let e = LockKey::new("é".repeat(200)).unwrap_err();
        assert!(matches!(e, InvalidInput::TooLong { len: 400, .. }), "{e}");
        assert!(matches!(
            LockKey::new("a\nb"),
            Err(InvalidInput::ControlCharacter {
                ch: '\n',
                index: 1,
                ..
            })
        ));
        assert!(matches!(
            LockKey::new("a\u{0}"),
            Err(InvalidInput::ControlCharacter { .. })
        ));
        // Invisible formatting and line-separating characters: a bidi override, zero-width
        // characters, a BOM, the line and paragraph separators, a C1 control.
        for ch in [
            '\u{202E}',
            '\u{2066}',
            '\u{200B}',
            '\u{200D}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{2028}',
            '\u{2029}',
            '\u{0085}',
            '\u{E0041}',
        ] {
            let k = format!("orders/{ch}42");
            match LockKey::new(k.clone()) {
                Err(
                    e @ InvalidInput::ControlCharacter {
                        ch: found,
                        index: 7,
                        ..
                    },
                ) => {
                    assert_eq!(found, ch);
                    assert!(e.to_string().contains(&format!("{ch:?}")), "{e}");
                }
                other => panic!("{k:?}: {other:?}"),
            }
        }
        // Visible non-ASCII text, spaces and symbols stay allowed.
        for k in [
            "tenant-7/Ünïcødé/job",
            "注文/42",
            "a b",
            "emoji/🦀",
            "x\u{00A0}y",
        ] {
            assert!(LockKey::new(k).is_ok(), "{k}");
        }
        for (k, needle) in [
            ("/a", "starts"),
            ("a/", "ends"),
            ("a//b", "empty segment"),
            ("..", "'..'"),
            ("a/../b", "'..'"),
            ("a/./b", "'.'"),
            (".", "'.'"),
        ] {
            let e = LockKey::new(k).unwrap_err();
            assert!(
                matches!(e, InvalidInput::PathEscape { .. }) && e.to_string().contains(needle),
                "{k:?}: {e}"
            );
        }
        assert!(matches!(
            LockKey::from_bytes(b"ab\xff"),
            Err(InvalidInput::NotUtf8 { index: 2, .. })
        ));
        assert_eq!(LockKey::from_bytes(b"ok").unwrap().as_str(), "ok");
    }

    #[test]
    fn error_names_the_value_escaped() {
        let e = LockKey::new("evil\r\nINFO forged").unwrap_err().to_string();
        assert!(e.contains(r#""evil\r\nINFO forged""#), "{e}");
        let e = ResourceId::new("").unwrap_err().to_string();
        assert_eq!(e, "resource id is empty");
    }
}
