//! Business operation keys for the built-in `http` effect: where each source's events name the
//! obligation their operation fulfils (`consume --operation-key`, `[consume] operation_key`,
//! `[[ingest.sources]] operation_key`), and the rule that, over several databases, a source is
//! routed by that same field.

use crate::envelope::Event;
use crate::ingest::signature::{route_of, KeyFrom};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Where events name the obligation their operations fulfil: a JSON pointer into the payload,
/// per source or for every source. Empty: every operation is keyed by its event.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationKeys {
    /// The pointer for every source without one of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
    /// Each source's own pointer.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, String>,
    /// With several databases: an event names its obligation only when it was routed by it
    /// (its route key is the obligation), so that it is claimed where the obligation is held;
    /// any other event (an envelope without its route, an older producer) is keyed by event.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub routed: bool,
}

/// The obligation an event names, as [`crate::outbox::NewOperation::obligation`] takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Obligation {
    /// Its source names none: keyed by the event.
    None,
    /// Its source names one, and the event's field is missing or cannot be a key: keyed by
    /// the event, counted.
    Missing,
    /// The obligation's value.
    Named(String),
}

impl OperationKeys {
    /// Whether any source names an obligation.
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.sources.is_empty()
    }

    /// The pointer of `source`, if it names one.
    pub fn pointer(&self, source: &str) -> Option<&str> {
        self.sources
            .get(source)
            .or(self.default.as_ref())
            .map(String::as_str)
    }

    /// The obligation `event` names: a non-empty string or an integer at its source's pointer
    /// that a header can carry (it is sent as the idempotency key).
    pub fn of(&self, event: &Event) -> Obligation {
        let Some(pointer) = self.pointer(&event.source) else {
            return Obligation::None;
        };
        let at = KeyFrom::JsonPointer(pointer.to_owned());
        let value = route_of(&at, &http::HeaderMap::new(), &event.payload_json);
        match value {
            Some(value) if self.routed && event.tenant_route() != Some(value.as_str()) => {
                Obligation::Missing
            }
            Some(value) if usable(&event.source, &value) => Obligation::Named(value),
            _ => Obligation::Missing,
        }
    }

    /// The pointers in force: each source's own (`[[ingest.sources]] operation_key`) over
    /// `default` (`--operation-key`). With several databases the obligation must be held where
    /// every event naming it is claimed, so each source must be routed by the same pointer
    /// (`route_from = { json_pointer = ... }`); a source the file does not list gets none, and
    /// its events are keyed by event.
    pub fn resolve(
        default: Option<&str>,
        sources: &[crate::ingest::config::SourceConfig],
        sharded: bool,
    ) -> anyhow::Result<Self> {
        let mut keys = Self {
            default: default.map(str::to_owned),
            sources: BTreeMap::new(),
            routed: sharded,
        };
        for source in sources {
            if let Some(pointer) = &source.operation_key {
                check_pointer(pointer).map_err(|e| {
                    anyhow::anyhow!("[[ingest.sources]] {:?}: operation_key: {e}", source.name)
                })?;
                keys.sources.insert(source.name.clone(), pointer.clone());
            }
        }
        if !sharded {
            return Ok(keys);
        }
        let default = keys.default.take();
        for source in sources {
            let Some(pointer) = keys.sources.get(&source.name).or(default.as_ref()) else {
                continue;
            };
            let routed =
                matches!(&source.route_from, Some(KeyFrom::JsonPointer(p)) if p == pointer);
            anyhow::ensure!(
                routed,
                "source {:?} names its obligation at {pointer:?}, but with several databases \
                 its events must also be routed by it (route_from = {{ json_pointer = \
                 {pointer:?} }}), or two events of one obligation could be claimed on two \
                 databases and both sent",
                source.name
            );
            keys.sources.insert(source.name.clone(), pointer.clone());
        }
        Ok(keys)
    }
}

/// Whether an obligation's key can be sent as a header and stored as a key: visible ASCII only
/// (a header carries nothing else plainly), and short enough.
fn usable(source: &str, value: &str) -> bool {
    value.chars().all(|c| c.is_ascii_graphic())
        && source.len() + value.len() < crate::envelope::MAX_KEY_BYTES
}

/// A JSON pointer (RFC 6901): empty, or starting with `/`.
pub fn check_pointer(text: &str) -> Result<String, String> {
    match text.is_empty() || text.starts_with('/') {
        true => Ok(text.to_owned()),
        false => Err(format!(
            "{text:?} is not a JSON pointer; it starts with / (for example \
             /data/object/metadata/order_id)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ingest::config::{Kind, SourceConfig};

    fn event(source: &str, payload: &str) -> Event {
        let wire = serde_json::json!({
            "key": "evt_1", "source": source,
            "payload": serde_json::from_str::<serde_json::Value>(payload).unwrap(),
        });
        Event::parse(None, Some(wire.to_string().as_bytes())).unwrap()
    }

    #[test]
    fn an_event_names_its_obligation_or_falls_back() {
        let keys = OperationKeys {
            default: Some("/order".into()),
            sources: [("github".to_owned(), "/repository/id".to_owned())].into(),
            routed: false,
        };
        let named = |s: &str| Obligation::Named(s.to_owned());
        assert_eq!(
            keys.of(&event("stripe", r#"{"order":"o_1"}"#)),
            named("o_1")
        );
        assert_eq!(keys.of(&event("stripe", r#"{"order":42}"#)), named("42"));
        assert_eq!(
            keys.of(&event("github", r#"{"repository":{"id":7}}"#)),
            named("7")
        );
        for missing in [
            r#"{}"#,
            r#"{"order":""}"#,
            r#"{"order":null}"#,
            r#"{"order":"a\nb"}"#,
            r#"{"order":"caf\u00e9"}"#,
        ] {
            assert_eq!(keys.of(&event("stripe", missing)), Obligation::Missing);
        }
        assert_eq!(
            OperationKeys::default().of(&event("stripe", r#"{"order":"o_1"}"#)),
            Obligation::None
        );
    }

    #[test]
    fn with_several_databases_only_an_event_routed_by_its_obligation_names_it() {
        let keys = OperationKeys {
            sources: [("stripe".to_owned(), "/order".to_owned())].into(),
            routed: true,
            ..OperationKeys::default()
        };
        let routed = |route: Option<&str>| {
            let mut wire = serde_json::json!({
                "key": "evt_1", "source": "stripe", "payload": {"order": "o_1"},
            });
            if let Some(route) = route {
                wire["route"] = route.into();
            }
            Event::parse(None, Some(wire.to_string().as_bytes())).unwrap()
        };
        assert_eq!(
            keys.of(&routed(Some("o_1"))),
            Obligation::Named("o_1".into())
        );
        assert_eq!(keys.of(&routed(None)), Obligation::Missing);
        assert_eq!(keys.of(&routed(Some("acct_9"))), Obligation::Missing);
    }

    #[test]
    fn with_several_databases_a_source_is_routed_by_its_obligation() {
        let mut stripe = SourceConfig::new("stripe", Kind::Stripe, "S");
        let refused = OperationKeys::resolve(Some("/order"), std::slice::from_ref(&stripe), true);
        assert!(refused.unwrap_err().to_string().contains("route_from"));
        stripe.route_from = Some(KeyFrom::JsonPointer("/account".into()));
        assert!(
            OperationKeys::resolve(Some("/order"), std::slice::from_ref(&stripe), true).is_err()
        );
        stripe.route_from = Some(KeyFrom::JsonPointer("/order".into()));
        let keys = OperationKeys::resolve(Some("/order"), &[stripe], true).unwrap();
        // Only the sources checked name one; an unlisted source is keyed by event.
        assert_eq!(keys.pointer("stripe"), Some("/order"));
        assert_eq!(keys.pointer("other"), None);
        // One database: no routing needed, the default applies to every source.
        let one = OperationKeys::resolve(Some("/order"), &[], false).unwrap();
        assert_eq!(one.pointer("other"), Some("/order"));
        assert!(check_pointer("order").is_err());
    }
}
