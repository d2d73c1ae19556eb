//! Messages of Debezium's outbox event router, as it writes them by default, read into events.
//!
//! - The event id is the `id` header: the identity, keyed `outbox:{id}`.
//! - The Kafka key is the aggregate id: the route key, so one aggregate's events share a shard.
//! - The value is the payload: a JSON object (`expand.json.payload`), a JSON string holding
//!   JSON (a text payload column), or either inside the JsonConverter's
//!   `{"schema": …, "payload": …}` wrapper.
//! - The event type is in the header the router is told to place it in
//!   (`table.fields.additional.placement=type:header:eventType`).
//!
//! A header or key may arrive as plain UTF-8 (the string converter) or as a JSON string (the
//! JSON converter); both read the same. A null value is a tombstone, skipped.

use super::{has_control, Input, Message, Reading};
use crate::envelope::{Attributes, Event, Malformed, Parts};
use serde_json::value::RawValue;
use std::collections::BTreeMap;

/// The header the router writes the event id to.
const ID_HEADER: &str = "id";

/// The event key of the outbox event `id`.
pub fn outbox_key(id: &str) -> String {
    format!("outbox:{id}")
}

fn invalid(why: impl Into<String>) -> Malformed {
    Malformed::Outbox(why.into())
}

/// Reads an outbox message; a tombstone is skipped.
pub(super) fn read(input: &Input, message: &Message<'_>) -> Result<Reading, Malformed> {
    let source = input.source_of(message.topic);
    let Some(value) = message.value else {
        return Ok(Reading::Skipped { source });
    };
    let id = message
        .headers
        .last(ID_HEADER)
        .ok_or_else(|| invalid("it has no id header (the event id, the message's identity)"))?;
    let id = text("the id header", id)?;
    if id.is_empty() {
        return Err(invalid("its id header is empty"));
    }
    let mut parts = Parts::new(outbox_key(&id), source, payload(value)?);
    parts.route = match message.key {
        Some(key) => Some(text("the key (the aggregate id)", key)?).filter(|k| !k.is_empty()),
        None => None,
    };
    parts.event_type = match message.headers.last(&input.type_header) {
        Some(t) => Some(text("the event type header", t)?),
        None => None,
    };
    let attributes = attributes(message);
    let event = Event::from_parts(parts).map_err(|e| invalid(super::as_event(&e)))?;
    Ok(Reading::Event(Box::new(event.with_attributes(attributes))))
}

/// A header's or key's text: plain UTF-8, or a JSON string (the JSON converter's), or a string
/// inside the JsonConverter's schema wrapper.
fn text(what: &str, bytes: &[u8]) -> Result<String, Malformed> {
    let plain = std::str::from_utf8(bytes).map_err(|_| invalid(format!("{what} is not UTF-8")))?;
    // The JSON converter's null (a null id or key column): no value.
    if plain.trim() == "null" {
        return Ok(String::new());
    }
    let read = match plain.trim_start().as_bytes().first() {
        Some(b'"') => serde_json::from_str::<String>(plain).ok(),
        // The wrapper's payload: a string's text, a number's (a bigint id) as written.
        Some(b'{') => unwrap(plain).and_then(|inner| match inner.get().as_bytes().first() {
            Some(b'"') => serde_json::from_str(inner.get()).ok(),
            Some(b'{' | b'[') | None => None,
            Some(_) => Some(inner.get().to_owned()),
        }),
        _ => None,
    };
    let text = read.unwrap_or_else(|| plain.to_owned());
    if has_control(&text) {
        return Err(invalid(format!("{what} holds a control character")));
    }
    Ok(text)
}

/// The JsonConverter's `{"schema": …, "payload": …}` wrapper's payload, if `json` is one: two
/// members, the schema a Connect schema (an object with a `type`) or null.
fn unwrap(json: &str) -> Option<Box<RawValue>> {
    #[derive(serde::Deserialize)]
    struct ConnectSchema {
        #[serde(rename = "type")]
        _type: String,
    }
    let mut members: BTreeMap<String, Box<RawValue>> = serde_json::from_str(json).ok()?;
    let schema_like = members.get("schema").is_some_and(|s| {
        s.get() == "null" || serde_json::from_str::<ConnectSchema>(s.get()).is_ok()
    });
    (members.len() == 2 && schema_like)
        .then(|| members.remove("payload"))
        .flatten()
}

/// The message's value as the event's payload.
fn payload(value: &[u8]) -> Result<Box<RawValue>, Malformed> {
    let json = std::str::from_utf8(value)
        .ok()
        .and_then(|text| RawValue::from_string(text.to_owned()).ok())
        .ok_or_else(|| {
            invalid("the value is not JSON (an object, a string holding JSON, or the JSON converter's schema and payload)")
        })?;
    let inner = unwrap(json.get()).unwrap_or(json);
    // A text payload column: a JSON string whose content is the JSON document.
    if inner.get().starts_with('"') {
        if let Ok(text) = serde_json::from_str::<String>(inner.get()) {
            if let Ok(document) = RawValue::from_string(text) {
                return Ok(document);
            }
        }
    }
    Ok(inner)
}

/// The message's headers that read as text, by name: what an effect may want of them
/// (the id, the type, the router's other placements).
fn attributes(message: &Message<'_>) -> Attributes {
    let mut attributes = Attributes::new();
    for (name, value) in message.headers.iter() {
        if let Some(text) = value.and_then(|v| text(name, v).ok()) {
            if !name.contains('\0') {
                attributes.insert(name, text);
            }
        }
    }
    attributes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::{Format, Headers};

    fn read(
        key: Option<&str>,
        value: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Result<Reading, Malformed> {
        let headers: Headers = headers.iter().copied().collect();
        let input = Input::of(Format::DebeziumOutbox);
        super::read(
            &input,
            &Message {
                topic: "outbox.event.orders",
                key: key.map(str::as_bytes),
                value: value.map(str::as_bytes),
                headers: &headers,
            },
        )
    }

    fn event(reading: Result<Reading, Malformed>) -> Event {
        match reading.unwrap() {
            Reading::Event(event) => *event,
            Reading::Skipped { .. } => panic!("skipped"),
        }
    }

    #[test]
    fn the_three_value_shapes_give_one_payload_and_hash() {
        let id = [
            ("id", "4b1f0c1e-1c1a-4f3e-9a55-0d5c2b2f7d10"),
            ("eventType", "OrderCreated"),
        ];
        let object = event(read(Some("42"), Some(r#"{"order":42}"#), &id));
        let string = event(read(Some("\"42\""), Some(r#""{\"order\":42}""#), &id));
        let wrapped = event(read(
            Some(r#"{"schema":{"type":"string"},"payload":"42"}"#),
            Some(r#"{"schema":{"type":"string","optional":true},"payload":"{\"order\":42}"}"#),
            &[
                ("id", "\"4b1f0c1e-1c1a-4f3e-9a55-0d5c2b2f7d10\""),
                ("eventType", "OrderCreated"),
            ],
        ));
        for e in [&object, &string, &wrapped] {
            assert_eq!(
                e.key.as_str(),
                "outbox:4b1f0c1e-1c1a-4f3e-9a55-0d5c2b2f7d10"
            );
            assert_eq!(e.route_key(), "42");
            assert_eq!(e.event_type.as_deref(), Some("OrderCreated"));
            assert_eq!(e.source, "outbox.event.orders");
            assert_eq!(e.payload_json.get(), r#"{"order":42}"#);
            assert_eq!(e.payload_sha256, object.payload_sha256);
        }
        assert_eq!(
            wrapped.attribute("id"),
            Some("4b1f0c1e-1c1a-4f3e-9a55-0d5c2b2f7d10")
        );
    }

    #[test]
    fn a_tombstone_is_skipped_and_a_message_without_an_id_is_malformed() {
        assert!(matches!(
            read(Some("42"), None, &[]).unwrap(),
            Reading::Skipped { source } if source == "outbox.event.orders"
        ));
        let missing = read(Some("42"), Some("{}"), &[("eventType", "X")]).unwrap_err();
        assert!(missing.to_string().contains("no id header"), "{missing}");
        assert!(matches!(
            read(None, Some("not json"), &[("id", "1")]),
            Err(Malformed::Outbox(_))
        ));
        // A bigint id in the JSON converter's wrapper is its number.
        let wrapped = event(read(
            None,
            Some("{}"),
            &[(
                "id",
                r#"{"schema":{"type":"int64","optional":false},"payload":42}"#,
            )],
        ));
        assert_eq!(wrapped.key.as_str(), "outbox:42");
        // A payload that merely has `schema` and `payload` members is a payload.
        let own = event(read(
            None,
            Some(r#"{"schema":{"v":2},"payload":1}"#),
            &[("id", "7")],
        ));
        assert_eq!(own.payload_json.get(), r#"{"schema":{"v":2},"payload":1}"#);
        // The JSON converter's null id is no id; its null key no route.
        let null = read(Some("null"), Some("{}"), &[("id", "null")]).unwrap_err();
        assert!(null.to_string().contains("id header is empty"), "{null}");
        let unrouted = event(read(Some("null"), Some("{}"), &[("id", "5")]));
        assert_eq!(unrouted.route_key(), "outbox:5");
        // The envelope's checks speak of the event.
        let long = read(None, Some("{}"), &[("id", &"i".repeat(600))]).unwrap_err();
        assert!(
            long.to_string().contains("the event key is 607 bytes"),
            "{long}"
        );
        // A text column holding plain text is kept as the JSON string it arrived as.
        let text = event(read(None, Some(r#""hello""#), &[("id", "1")]));
        assert_eq!(text.payload_json.get(), r#""hello""#);
        assert_eq!(text.route_key(), "outbox:1");
    }
}
