//! Fencing tokens.
//!
//! A fencing token is the number an acquisition gets: strictly larger than every token issued
//! before it for the same key. The protected resource keeps the newest token it has accepted and
//! rejects older ones ([`crate::Fence`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::InvalidInput;

/// A value that orders acquisitions of one key and can cross process boundaries.
///
/// # Contract
///
/// - Total order: for two acquisitions of the same key, the later one's token compares greater.
/// - It converts losslessly into the core [`Token`], which fits a signed 64-bit integer column
///   (`BIGINT`), so every fence can store it. Adapters with a native token type (a Raft index, a
///   zxid) implement this trait for it and keep the order when converting.
pub trait FencingToken:
    Copy + Ord + std::hash::Hash + fmt::Debug + fmt::Display + Send + Sync + 'static
{
    /// The core token with the same order.
    fn to_token(self) -> Token;
}

/// The core fencing token: an integer in `0..=i64::MAX`, so it fits a `BIGINT` column.
///
/// Serialises as a plain JSON number; parses from and displays as decimal.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(u64);

impl Token {
    /// The smallest token. No acquisition is ever issued it: the first token of a key is above it,
    /// so a fence that has accepted nothing can be treated as having accepted `Token::ZERO`.
    pub const ZERO: Token = Token(0);
    /// The largest token that fits a signed 64-bit column.
    pub const MAX: Token = Token(i64::MAX as u64);

    /// A token from an unsigned value; values above `i64::MAX` are rejected.
    pub fn new(value: u64) -> Result<Token, InvalidInput> {
        if value > i64::MAX as u64 {
            return Err(InvalidInput::TokenOutOfRange {
                value: value.to_string(),
            });
        }
        Ok(Token(value))
    }

    /// A token from a signed value (a database column, a Redis integer); negatives are rejected.
    pub fn from_i64(value: i64) -> Result<Token, InvalidInput> {
        u64::try_from(value)
            .map(Token)
            .map_err(|_| InvalidInput::TokenOutOfRange {
                value: value.to_string(),
            })
    }

    /// The value as `u64`.
    pub fn get(self) -> u64 {
        self.0
    }

    /// The value as `i64` (always non-negative).
    pub fn to_i64(self) -> i64 {
        self.0 as i64
    }

    /// The next token, or `None` at [`Token::MAX`].
    pub fn next(self) -> Option<Token> {
        if self == Token::MAX {
            None
        } else {
            Some(Token(self.0 + 1))
        }
    }
}

impl FencingToken for Token {
    fn to_token(self) -> Token {
        self
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({})", self.0)
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for Token {
    type Err = InvalidInput;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let v: u64 = s
            .trim()
            .parse()
            .map_err(|_| InvalidInput::TokenOutOfRange {
                value: s.chars().take(32).collect(),
            })?;
        Token::new(v)
    }
}

impl TryFrom<u64> for Token {
    type Error = InvalidInput;
    fn try_from(value: u64) -> Result<Self, Self::Error> {
        Token::new(value)
    }
}

impl TryFrom<i64> for Token {
    type Error = InvalidInput;
    fn try_from(value: i64) -> Result<Self, Self::Error> {
        Token::from_i64(value)
    }
}

impl From<Token> for u64 {
    fn from(t: Token) -> u64 {
        t.0
    }
}

impl From<Token> for i64 {
    fn from(t: Token) -> i64 {
        t.to_i64()
    }
}

impl Serialize for Token {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = u64::deserialize(d)?;
        Token::new(v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_is_bigint() {
        assert!(Token::new(i64::MAX as u64).is_ok());
        assert!(Token::new(i64::MAX as u64 + 1).is_err());
        assert!(Token::from_i64(-1).is_err());
        assert_eq!(Token::from_i64(42).unwrap().to_i64(), 42);
        assert_eq!(Token::MAX.next(), None);
        assert_eq!(Token::ZERO.next(), Some(Token::new(1).unwrap()));
    }

    #[test]
    fn order_parse_and_serde() {
        let a: Token = "5".parse().unwrap();
        let b = Token::new(6).unwrap();
        assert!(a < b);
        assert!("-1".parse::<Token>().is_err());
        assert!("x".parse::<Token>().is_err());
        assert_eq!(serde_json::to_string(&b).unwrap(), "6");
        assert_eq!(serde_json::from_str::<Token>("6").unwrap(), b);
        assert!(serde_json::from_str::<Token>("9223372036854775808").is_err());
        assert_eq!(b.to_string(), "6");
    }
}
