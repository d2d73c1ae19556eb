//! CloudEvents 1.0 in Kafka's protocol binding, both content modes, read into events.
//!
//! - Binary mode: the attributes in `ce_*` headers, `content-type` as `datacontenttype`, the
//!   value as the data (a null value is an event without data).
//! - Structured mode: `content-type: application/cloudevents+json`, the whole event as the
//!   value, its data in `data` or `data_base64`.
//!
//! The identity is (`source`, `id`), as the specification defines it ([`cloudevent_key`]); the
//! Kafka message key only chose the partition. JSON data is the payload byte for byte; other
//! data is kept with its content type: `{"datacontenttype": …, "data_base64": …}`.

use super::{has_control, is_json, media_type, Input, Message};
use crate::envelope::{Attributes, Event, Malformed, Parts, MAX_KEY_BYTES};
use base64::Engine as _;
use serde::Serialize;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The structured mode's content type (JSON event format).
const STRUCTURED: &str = "application/cloudevents+json";
/// The one version read.
const SPECVERSION: &str = "1.0";
/// The attributes every CloudEvent has, non-empty.
const REQUIRED: [&str; 4] = ["specversion", "id", "source", "type"];
/// The context attributes the specification types as strings (URI, timestamp, string).
const STRINGS: [&str; 8] = [
    "specversion",
    "id",
    "source",
    "type",
    "datacontenttype",
    "dataschema",
    "subject",
    "time",
];
/// The prefix of an attribute's header in binary mode.
const HEADER_PREFIX: &str = "ce_";

/// The event key of the CloudEvent (`source`, `id`): `ce:{source's length in bytes}:{source}:{id}`.
/// The length says where the source ends, so no two pairs give one key, whatever `:`, `/` or
/// escapes they hold. A pair too long for a key (512 bytes) is keyed by `ce-sha256:` and the
/// SHA-256 of that same text in hex: a prefix no readable key has.
pub fn cloudevent_key(source: &str, id: &str) -> String {
    let readable = format!("ce:{}:{source}:{id}", source.len());
    match readable.len() <= MAX_KEY_BYTES {
        true => readable,
        false => format!("ce-sha256:{}", hex::encode(Sha256::digest(readable))),
    }
}

fn invalid(why: impl Into<String>) -> Malformed {
    Malformed::CloudEvent(why.into())
}

/// Reads a CloudEvent in either content mode.
pub(super) fn read(input: &Input, message: &Message<'_>) -> Result<Event, Malformed> {
    let content_type = match message.headers.last_ignoring_case("content-type") {
        Some(bytes) => Some(utf8("content-type", bytes)?.to_owned()),
        None => None,
    };
    let essence = content_type.as_deref().map(media_type);
    let binary = message
        .headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("ce_specversion"));
    let (attributes, payload) = match essence.as_deref() {
        Some(STRUCTURED) => structured(message.value)?,
        Some(other) if other.starts_with("application/cloudevents") => {
            return Err(invalid(format!(
                "the content type {other} is not read: only {STRUCTURED} (structured mode) or binary mode"
            )))
        }
        _ if binary => binary_mode(message, content_type.as_deref())?,
        _ => {
            return Err(invalid(format!(
                "neither a ce_specversion header (binary mode) nor the content type {STRUCTURED} (structured mode)"
            )))
        }
    };
    event(input, message.topic, attributes, payload)
}

fn utf8<'a>(name: &str, bytes: &'a [u8]) -> Result<&'a str, Malformed> {
    std::str::from_utf8(bytes).map_err(|_| invalid(format!("the header {name} is not UTF-8")))
}

/// Binary mode: the `ce_*` headers (a null header is an absent attribute) and the value.
fn binary_mode(
    message: &Message<'_>,
    content_type: Option<&str>,
) -> Result<(Attributes, Box<RawValue>), Malformed> {
    let mut attributes = Attributes::new();
    for (name, value) in message.headers.iter() {
        let (Some(prefix), Some(value)) = (name.get(..HEADER_PREFIX.len()), value) else {
            continue;
        };
        if prefix.eq_ignore_ascii_case(HEADER_PREFIX) {
            let attribute = name[HEADER_PREFIX.len()..].to_ascii_lowercase();
            attributes.insert(attribute, utf8(name, value)?);
        }
    }
    if let Some(content_type) = content_type {
        attributes.insert("datacontenttype", content_type);
    }
    Ok((attributes, binary_data(message.value, content_type)?))
}

/// The data of a binary-mode message as the payload.
fn binary_data(
    value: Option<&[u8]>,
    content_type: Option<&str>,
) -> Result<Box<RawValue>, Malformed> {
    // No value, or an empty one (as the SDKs write an event without data, whatever its
    // content type): no data.
    let Some(bytes) = value.filter(|v| !v.is_empty()) else {
        return Ok(null());
    };
    let as_json = || {
        let text = std::str::from_utf8(bytes).ok()?;
        RawValue::from_string(text.to_owned()).ok()
    };
    match content_type {
        Some(ct) if is_json(ct) => as_json().ok_or_else(|| {
            invalid(format!(
                "the data is not JSON, though its content type is {ct}"
            ))
        }),
        // No content type: JSON when it reads as JSON, as the JSON event format assumes.
        None => Ok(as_json().unwrap_or_else(|| encoded(None, bytes))),
        Some(ct) => Ok(encoded(Some(ct), bytes)),
    }
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".to_owned()).expect("null is JSON")
}

/// Data that is not JSON, kept with its content type: `{"datacontenttype", "data_base64"}`,
/// whichever mode carried it.
fn encoded(content_type: Option<&str>, bytes: &[u8]) -> Box<RawValue> {
    #[derive(Serialize)]
    struct Encoded<'a> {
        #[serde(skip_serializing_if = "Option::is_none")]
        datacontenttype: Option<&'a str>,
        data_base64: String,
    }
    let data_base64 = base64::engine::general_purpose::STANDARD.encode(bytes);
    serde_json::value::to_raw_value(&Encoded {
        datacontenttype: content_type,
        data_base64,
    })
    .expect("strings serialise")
}

/// Structured mode: the value is the whole event in the JSON format.
fn structured(value: Option<&[u8]>) -> Result<(Attributes, Box<RawValue>), Malformed> {
    let value = value.ok_or_else(|| invalid("a structured-mode message has no value"))?;
    let members: BTreeMap<String, Box<RawValue>> = serde_json::from_slice(value)
        .map_err(|e| invalid(format!("the value is not a JSON object: {e}")))?;
    let mut attributes = Attributes::new();
    let (mut data, mut data_base64) = (None, None);
    for (name, raw) in members {
        match name.as_str() {
            "data" => data = Some(raw),
            "data_base64" => data_base64 = Some(raw).filter(|raw| raw.get() != "null"),
            _ => {
                if let Some(text) = attribute_text(&name, &raw)? {
                    attributes.insert(name, text);
                }
            }
        }
    }
    let payload = structured_data(attributes.get("datacontenttype"), data, data_base64)?;
    Ok((attributes, payload))
}

/// An attribute of the JSON format as text (its canonical string encoding); None for a null,
/// which the format reads as absent.
fn attribute_text(name: &str, raw: &RawValue) -> Result<Option<String>, Malformed> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(invalid(format!(
            "the attribute name {name:?} is not lower-case letters and digits"
        )));
    }
    match serde_json::from_str(raw.get()) {
        Ok(serde_json::Value::Null) => Ok(None),
        Ok(serde_json::Value::String(text)) => Ok(Some(text)),
        Ok(_) if STRINGS.contains(&name) => {
            Err(invalid(format!("the attribute {name} is not a string")))
        }
        Ok(serde_json::Value::Bool(b)) => Ok(Some(b.to_string())),
        // The number's text as it arrived.
        Ok(serde_json::Value::Number(_)) => Ok(Some(raw.get().to_owned())),
        // A string serde_json cannot read (a lone surrogate escape), a number beyond its range.
        Err(e) => Err(invalid(format!("the attribute {name} cannot be read: {e}"))),
        Ok(_) => Err(invalid(format!(
            "the attribute {name} is an object or an array; attributes are strings, numbers or booleans"
        ))),
    }
}

/// The payload of a structured event: its `data` when it is JSON, else the data kept with its
/// content type; `null` for an event without data.
fn structured_data(
    content_type: Option<&str>,
    data: Option<Box<RawValue>>,
    data_base64: Option<Box<RawValue>>,
) -> Result<Box<RawValue>, Malformed> {
    // A null `data` is no data, as an absent one.
    let data = data.filter(|raw| raw.get() != "null");
    match (data, data_base64) {
        (Some(_), Some(_)) => Err(invalid("the event has both data and data_base64")),
        // The bytes binary mode would carry, read as binary mode reads them: the event reads
        // the same in both modes.
        (None, Some(raw)) => {
            let text: String = serde_json::from_str(raw.get())
                .map_err(|_| invalid("data_base64 is not a string"))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .map_err(|e| invalid(format!("data_base64 is not base64: {e}")))?;
            binary_data(Some(&bytes), content_type)
        }
        // Data of another type in `data` is its text, the bytes binary mode would carry.
        (Some(raw), None) => match content_type {
            Some(ct) if !is_json(ct) => {
                let text = serde_json::from_str::<String>(raw.get())
                    .unwrap_or_else(|_| raw.get().to_owned());
                binary_data(Some(text.as_bytes()), Some(ct))
            }
            _ => Ok(raw),
        },
        (None, None) => Ok(null()),
    }
}

/// The event the attributes describe, checked as the specification requires.
fn event(
    input: &Input,
    topic: &str,
    attributes: Attributes,
    payload: Box<RawValue>,
) -> Result<Event, Malformed> {
    for name in REQUIRED {
        if attributes.get(name).unwrap_or_default().is_empty() {
            return Err(invalid(format!(
                "the required attribute {name} is missing or empty"
            )));
        }
    }
    let specversion = attributes.get("specversion").unwrap_or_default();
    if specversion != SPECVERSION {
        return Err(invalid(format!(
            "specversion {specversion:?} is not read: only {SPECVERSION}"
        )));
    }
    if let Some((name, _)) = attributes.iter().find(|(_, value)| has_control(value)) {
        return Err(invalid(format!(
            "the attribute {name} holds a control character"
        )));
    }
    let source = attributes.get("source").unwrap_or_default();
    if source.chars().any(char::is_whitespace) {
        return Err(invalid(
            "the source is not a URI-reference: it holds white space",
        ));
    }
    let occurred_at = match attributes.get("time") {
        Some(time) => Some(
            chrono::DateTime::parse_from_rfc3339(time)
                .map_err(|e| {
                    invalid(format!(
                        "the time {time:?} is not an RFC 3339 timestamp: {e}"
                    ))
                })?
                .to_utc(),
        ),
        None => None,
    };
    let id = attributes.get("id").unwrap_or_default();
    let mut parts = Parts::new(cloudevent_key(source, id), input.source_of(topic), payload);
    parts.event_type = attributes.get("type").map(str::to_owned);
    parts.occurred_at = occurred_at;
    parts.route = input
        .route_attribute
        .as_deref()
        .and_then(|name| attributes.get(name))
        .and_then(super::route_text);
    let event = Event::from_parts(parts).map_err(|e| invalid(super::as_event(&e)))?;
    Ok(event.with_attributes(attributes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::{Format, Headers};

    fn read_with(
        input: &Input,
        headers: &[(&str, &str)],
        value: Option<&str>,
    ) -> Result<Event, Malformed> {
        let headers: Headers = headers.iter().copied().collect();
        let message = Message {
            topic: "orders",
            key: Some(b"any partition key"),
            value: value.map(str::as_bytes),
            headers: &headers,
        };
        super::read(input, &message)
    }

    fn read(headers: &[(&str, &str)], value: Option<&str>) -> Result<Event, Malformed> {
        read_with(&Input::of(Format::CloudEvents), headers, value)
    }

    const BINARY: [(&str, &str); 4] = [
        ("ce_specversion", "1.0"),
        ("ce_id", "A-1"),
        ("ce_source", "/shop/orders"),
        ("ce_type", "order.created"),
    ];

    #[test]
    fn the_key_is_injective_in_source_and_id_whatever_they_hold() {
        let pairs = [
            ("a:b", "c"),
            ("a", "b:c"),
            ("a:b:", ""),
            ("a/", "b"),
            ("a", "/b"),
        ];
        let keys: std::collections::HashSet<String> =
            pairs.iter().map(|(s, i)| cloudevent_key(s, i)).collect();
        assert_eq!(keys.len(), pairs.len());
        assert_eq!(cloudevent_key("/shop", "1"), "ce:5:/shop:1");
        let long = cloudevent_key(&"s".repeat(600), "1");
        assert!(long.starts_with("ce-sha256:") && long.len() == 74, "{long}");
        assert_ne!(long, cloudevent_key(&"s".repeat(601), "1"));
    }

    #[test]
    fn binary_and_structured_modes_read_as_one_event() {
        let binary = {
            let mut h = BINARY.to_vec();
            h.extend([
                ("content-type", "application/json"),
                ("ce_tenant", "t-9"),
                ("ce_time", "2026-12-01T10:00:00Z"),
            ]);
            read(&h, Some(r#"{ "total": 10.50 }"#)).unwrap()
        };
        let structured = read(
            &[("content-type", "application/cloudevents+json; charset=utf-8")],
            Some(r#"{"specversion":"1.0","id":"A-1","source":"/shop/orders","type":"order.created",
                    "datacontenttype":"application/json","tenant":"t-9","time":"2026-12-01T10:00:00Z",
                    "data":{"total":10.50}}"#),
        )
        .unwrap();
        for e in [&binary, &structured] {
            assert_eq!(e.key.as_str(), "ce:12:/shop/orders:A-1");
            assert_eq!(e.source, "orders", "the topic names the source");
            assert_eq!(e.event_type.as_deref(), Some("order.created"));
            assert_eq!(e.attribute("tenant"), Some("t-9"));
            assert_eq!(e.attribute("source"), Some("/shop/orders"));
            assert!(e.occurred_at.is_some());
        }
        assert_eq!(
            binary.payload_json.get(),
            r#"{ "total": 10.50 }"#,
            "byte for byte"
        );
        assert_eq!(binary.payload_sha256, structured.payload_sha256);
    }

    #[test]
    fn data_that_is_not_json_is_kept_with_its_content_type_and_no_data_is_null() {
        let mut h = BINARY.to_vec();
        h.push(("content-type", "text/plain"));
        let text = read(&h, Some("hello")).unwrap();
        assert_eq!(
            text.payload_json.get(),
            r#"{"datacontenttype":"text/plain","data_base64":"aGVsbG8="}"#
        );
        let typed = read(
            &[("content-type", "application/cloudevents+json")],
            Some(r#"{"specversion":"1.0","id":"A-1","source":"/shop/orders","type":"t","datacontenttype":"text/plain","data":"hello"}"#),
        )
        .unwrap();
        assert_eq!(
            typed.payload_sha256, text.payload_sha256,
            "the same in both modes"
        );
        for value in [None, Some("")] {
            let none = read(&BINARY, value).unwrap();
            assert_eq!(none.payload_json.get(), "null");
            let mut typed = BINARY.to_vec();
            typed.push(("content-type", "application/json"));
            assert_eq!(read(&typed, value).unwrap().payload_json.get(), "null");
        }
        let mut json = BINARY.to_vec();
        json.push(("content-type", "application/json"));
        let binary = read(&json, Some(r#"{"a":1}"#)).unwrap();
        let base64 = read(
            &[("content-type", "application/cloudevents+json")],
            Some(r#"{"specversion":"1.0","id":"A-1","source":"/shop/orders","type":"t","datacontenttype":"application/json","data_base64":"eyJhIjoxfQ=="}"#),
        )
        .unwrap();
        assert_eq!(
            base64.payload_sha256, binary.payload_sha256,
            "JSON bytes in data_base64"
        );
        let encoded = read(
            &[("content-type", "application/cloudevents+json")],
            Some(r#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"image/png","data_base64":"iVBORw=="}"#),
        )
        .unwrap();
        assert_eq!(
            encoded.payload_json.get(),
            r#"{"datacontenttype":"image/png","data_base64":"iVBORw=="}"#
        );
    }

    #[test]
    fn every_malformed_case_names_its_reason() {
        for (headers, value, reason) in malformed() {
            let e = read(&headers, value).unwrap_err();
            assert!(matches!(e, Malformed::CloudEvent(_)), "{e}");
            assert!(e.to_string().contains(reason), "{e} should say {reason}");
        }
    }

    type Case = (
        Vec<(&'static str, &'static str)>,
        Option<&'static str>,
        &'static str,
    );

    /// Messages that are not CloudEvents, each with what its reason must say.
    fn malformed() -> Vec<Case> {
        let structured = [("content-type", "application/cloudevents+json")];
        vec![
            (BINARY[1..].to_vec(), Some("{}"), "neither a ce_specversion"),
            (
                vec![BINARY[0], BINARY[2], BINARY[3]],
                Some("{}"),
                "id is missing",
            ),
            (
                vec![("ce_specversion", "0.3"), BINARY[1], BINARY[2], BINARY[3]],
                None,
                "specversion \"0.3\"",
            ),
            (
                vec![BINARY[0], BINARY[1], ("ce_source", ""), BINARY[3]],
                None,
                "source is missing or empty",
            ),
            (
                [&BINARY[..], &[("ce_time", "yesterday")]].concat(),
                None,
                "RFC 3339",
            ),
            (
                [&BINARY[..], &[("content-type", "application/json")]].concat(),
                Some("{oops"),
                "not JSON",
            ),
            (structured.to_vec(), Some("not json"), "not a JSON object"),
            (
                structured.to_vec(),
                Some(
                    r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":1,"data_base64":"AA=="}"#,
                ),
                "both data",
            ),
            (
                structured.to_vec(),
                Some(r#"{"specversion":"1.0","id":"1","source":"s","type":"t","ext":{"a":1}}"#),
                "object or an array",
            ),
            (
                structured.to_vec(),
                Some(r#"{"specversion":"1.0","id":"1","source":"s","type":7}"#),
                "type is not a string",
            ),
            (
                vec![("content-type", "application/cloudevents-batch+json")],
                Some("[]"),
                "is not read",
            ),
            (
                structured.to_vec(),
                Some(r#"{"specversion":"1.0","id":"1","source":"s","type":"t","ext":"\ud800"}"#),
                "ext cannot be read",
            ),
        ]
    }

    #[test]
    fn a_named_extension_routes_the_event() {
        let input = Input {
            route_attribute: Some("partitionkey".into()),
            source_name: Some("shop".into()),
            ..Input::of(Format::CloudEvents)
        };
        let mut h = BINARY.to_vec();
        h.push(("ce_partitionkey", "tenant-7"));
        let routed = read_with(&input, &h, None).unwrap();
        assert_eq!(
            (routed.route_key(), routed.source.as_str()),
            ("tenant-7", "shop")
        );
        let unrouted = read_with(&input, &BINARY, None).unwrap();
        assert_eq!(unrouted.route_key(), unrouted.key.as_str());
        let mut empty = BINARY.to_vec();
        empty.push(("ce_partitionkey", ""));
        let by_key = read_with(&input, &empty, None).unwrap();
        assert_eq!(
            by_key.route_key(),
            by_key.key.as_str(),
            "an empty value is none"
        );
        // Python's SDK writes a boolean True in binary mode, JSON true in structured mode.
        let flag = Input {
            route_attribute: Some("flag".into()),
            ..Input::of(Format::CloudEvents)
        };
        let mut binary = BINARY.to_vec();
        binary.push(("ce_flag", "True"));
        let structured = read_with(
            &flag,
            &[("content-type", "application/cloudevents+json")],
            Some(r#"{"specversion":"1.0","id":"A-1","source":"/shop/orders","type":"t","flag":true}"#),
        )
        .unwrap();
        assert_eq!(
            read_with(&flag, &binary, None).unwrap().route_key(),
            structured.route_key()
        );
    }
}
