//! The dedupe key, checked once where it is made: an [`EventKey`] is never empty, never too
//! long, and never holds a character an HTTP header cannot carry.

use super::Malformed;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The longest key accepted, in bytes. Keys longer than this are a producer bug, not data.
pub const MAX_KEY_BYTES: usize = 512;

/// A dedupe key: never empty, never longer than [`MAX_KEY_BYTES`] bytes.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct EventKey(String);

impl EventKey {
    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for EventKey {
    type Error = Malformed;

    /// A key travels as a Kafka key, a primary key, and an HTTP header (`Idempotency-Key`,
    /// `webhook-id`): a control character (a line break, a NUL) cannot be sent as a header, so
    /// such a key is refused here rather than failing every delivery later.
    fn try_from(key: String) -> Result<Self, Malformed> {
        match key.len() {
            0 => Err(Malformed::EmptyKey),
            n if n > MAX_KEY_BYTES => Err(Malformed::KeyTooLong(n)),
            _ if key.chars().any(char::is_control) => Err(Malformed::KeyControlCharacter),
            _ => Ok(Self(key)),
        }
    }
}

impl TryFrom<&str> for EventKey {
    type Error = Malformed;

    fn try_from(key: &str) -> Result<Self, Malformed> {
        Self::try_from(key.to_owned())
    }
}

/// Read back as it was written, and checked as any key is.
impl<'de> Deserialize<'de> for EventKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Self::try_from(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

impl From<EventKey> for String {
    fn from(key: EventKey) -> Self {
        key.0
    }
}

impl fmt::Display for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}
