//! What a message said of its event beyond the envelope's fields: a CloudEvent's attributes and
//! extensions, a Debezium outbox message's headers. Kept with the event, as text, for effects.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// An event's attributes by name, each as text (a CloudEvent's canonical string encoding).
/// Stored with a claim that keeps its payload, so an effect reads the same on a retry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Attributes(BTreeMap<String, String>);

impl Attributes {
    /// No attributes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `name` to `value`, replacing what it had.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.0.insert(name.into(), value.into());
    }

    /// The value of `name`, if the event has it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each name and value, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The attributes as stored (a JSON object of strings); None when there are none.
    pub fn to_json(&self) -> Option<serde_json::Value> {
        (!self.is_empty()).then(|| serde_json::to_value(&self.0).expect("strings serialise"))
    }

    /// The attributes stored as [`Attributes::to_json`] wrote them; anything else is none.
    pub fn from_json(value: Option<&serde_json::Value>) -> Self {
        value
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default()
    }
}
