//! The envelope: the contract between any ingress and the consumers.
//!
//! The Kafka message key is the dedupe key; the value is a JSON object
//! `{"key", "source", "type"?, "received_at"?, "occurred_at"?, "payload", "unhashed"?,
//! "replay_window_secs"?}`.
//! Everything is parsed here, at the boundary, into an [`Event`] that cannot be wrong; past
//! this module nobody checks again.

#![warn(missing_docs)]

use chrono::{DateTime, Datelike as _, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

mod attributes;
mod canonical;
mod key;
mod storable;
pub use attributes::Attributes;
use canonical::write_canonical_text;
pub(crate) use canonical::{Members, Text};
pub use key::{EventKey, MAX_KEY_BYTES};
pub(crate) use storable::nests_deeper_than;
use storable::{check_fields, EARLIEST_STORABLE_YEAR};
pub use storable::{check_storable, MAX_NESTING};

/// Why a message is not a valid envelope. Each becomes the `reason` of a dead letter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// A Kafka message without a value (a tombstone).
    #[error("the message has no value")]
    NoValue,
    /// The value is not JSON, or not an envelope; with the parser's message.
    #[error("the value is not a JSON envelope: {0}")]
    NotJson(String),
    /// The envelope's key is empty.
    #[error("the envelope has an empty key")]
    EmptyKey,
    /// The envelope's key is longer than 512 bytes; with its length.
    #[error("the envelope key is {0} bytes, more than the 512 allowed")]
    KeyTooLong(usize),
    /// The envelope's key holds a control character (a line break, a tab, a NUL), which no
    /// HTTP header can carry.
    #[error(
        "the envelope key holds a control character (such as a line break), which an \
             Idempotency-Key header cannot carry"
    )]
    KeyControlCharacter,
    /// The payload nests arrays and objects deeper than [`MAX_NESTING`] levels: far deeper
    /// than any real document, and too deep to read back without risking the stack.
    #[error("the payload nests arrays and objects more than {MAX_NESTING} levels deep")]
    TooDeep,
    /// The Kafka message key and the envelope's key differ.
    #[error("the Kafka message key does not match the envelope key")]
    KeyMismatch,
    /// A field PostgreSQL would refuse (a `\u0000`, a lone surrogate, a number out of range).
    #[error("PostgreSQL cannot store the envelope: {0}")]
    Unstorable(&'static str),
    /// The envelope's route key is empty, too long or holds a control character.
    #[error("the envelope's route key is refused: {0}")]
    Route(String),
    /// Not a valid CloudEvent (`consume --input cloudevents`); with what is wrong.
    #[error("not a valid CloudEvent: {0}")]
    CloudEvent(String),
    /// Not a Debezium outbox message (`consume --input debezium-outbox`); with what is wrong.
    #[error("not a Debezium outbox message: {0}")]
    Outbox(String),
}

impl Malformed {
    /// A route key refused for the reason a key would be.
    fn route(e: Malformed) -> Self {
        Self::Route(e.to_string().replace("envelope key", "route key"))
    }
}

/// The envelope as written on the topic, for producers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    /// The dedupe key: the event's identity at its source, never the moment it arrived;
    /// checked when the envelope is made, so a producer cannot write an invalid one.
    pub key: EventKey,
    /// The source's name (`stripe`, `github`, a name of the operator's choosing).
    pub source: String,
    /// The event's type at its source (`invoice.paid`), if it has one.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// When the ingress received the event, if it says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received_at: Option<DateTime<Utc>>,
    /// When the event happened at its source, for kinds whose deliveries say so (Stripe's body
    /// `created`, Shopify's `X-Shopify-Triggered-At`, Slack's body `event_time`): the same on
    /// every delivery of the event, unlike `received_at`. An event older than its source's
    /// prune horizon whose key is unknown is an expired replay, not applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurred_at: Option<DateTime<Utc>>,
    /// The event as the source sent it: its JSON text, kept as it arrived (numbers exact, keys
    /// in their order). `serde_json::value::to_raw_value(&json!(…))` makes one from a value.
    pub payload: Box<RawValue>,
    /// Top-level payload fields the sender changes between deliveries of one event (Stripe's
    /// `pending_webhooks`): left out of the payload hash, so a redelivery is a replay and not a
    /// key conflict. They are still stored with the payload.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unhashed: Vec<String>,
    /// Set by sources whose signature covers only the body while the key comes from an
    /// unsigned header: the same payload under another key within this many seconds is a
    /// replayed capture, recorded as a key conflict and not applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_window_secs: Option<u64>,
    /// The ingress request that carried it: the provider's delivery id where it sends one
    /// (GitHub's `X-GitHub-Delivery`, Shopify's `X-Shopify-Webhook-Id`), else one the ingress
    /// made. Different for each delivery of one event; `events show` names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The route key, when the source routes by a tenant field rather than by the event key:
    /// the claim lives on the shard of this key ([`crate::shard`]), together with the other
    /// events of the tenant. Absent, the route key is the event key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<EventKey>,
}

impl Envelope {
    /// The bytes to write as the Kafka message value.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Sized once for the payload and the fields around it: a large body is not copied over
        // and over as the buffer grows.
        let mut bytes = Vec::with_capacity(self.payload.get().len() + 512);
        serde_json::to_writer(&mut bytes, self).expect("an envelope always serialises");
        bytes
    }

    /// Whether a consumer will take this envelope: nothing PostgreSQL would refuse
    /// ([`check_storable`]); its keys are valid by their type.
    pub fn check_storable(&self) -> Result<(), Malformed> {
        check_storable(
            self.key.as_str(),
            &self.source,
            self.event_type.as_deref(),
            self.received_at,
            &self.payload,
        )
    }
}

/// A valid event, with the SHA-256 of its payload for telling replays from key conflicts.
#[derive(Debug, Clone)]
pub struct Event {
    /// The dedupe key.
    pub key: EventKey,
    /// The source's name.
    pub source: String,
    /// The event's type at its source, if it has one.
    pub event_type: Option<String>,
    /// When the ingress received the event, if it says.
    pub received_at: Option<DateTime<Utc>>,
    /// When the event happened at its source, if its kind says (see [`Envelope::occurred_at`]).
    pub occurred_at: Option<DateTime<Utc>>,
    /// The payload's JSON text as it arrived, stored and sent as is: the payload is never
    /// serialised again.
    pub payload_json: Box<RawValue>,
    /// SHA-256 of the payload's canonical form: the same for every delivery of one event.
    pub payload_sha256: [u8; 32],
    /// The replay guard's window, for sources that sign only the body; see [`Envelope`].
    pub replay_window_secs: Option<u64>,
    /// The ingress request that carried this delivery, if the envelope names it.
    pub request_id: Option<String>,
    /// The W3C `traceparent` of the event's trace: the message's header, or the consumer's
    /// span of the event when traces are exported. Outbox operations carry it on.
    pub traceparent: Option<String>,
    /// The route key when it is not the event key ([`Event::route_key`]).
    route: Option<EventKey>,
    /// The event's span while it is applied, when traces are exported ([`Event::span`]).
    span: Option<tracing::Span>,
    /// What the message said of the event beyond the envelope's fields: a CloudEvent's
    /// attributes and extensions, a Debezium outbox message's headers ([`Event::attribute`]).
    attributes: Option<Box<Attributes>>,
    /// The payload as a JSON value, built the first time [`Event::payload`] asks for it: the
    /// built-in effects store and send the text and never need it.
    payload: std::sync::OnceLock<Result<serde_json::Value, Malformed>>,
    /// How the effect keyed each of its operations the last time it applied the event
    /// ([`Event::note_keyed`]), counted once the event's transaction commits.
    keyed: KeyedNotes,
}

/// How an effect keyed one operation of an event: the `replayproof_consume_operation_keys_total`
/// counter's `key` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OperationKeyed {
    /// By the obligation its event names: this event holds it.
    Obligation,
    /// Its obligation is held by an earlier event: nothing was enqueued.
    Fulfilled,
    /// The source names an obligation but this event's field is missing or unusable: keyed by
    /// the event.
    Fallback,
}

impl OperationKeyed {
    /// Every value, in label order.
    pub const ALL: [Self; 3] = [Self::Obligation, Self::Fulfilled, Self::Fallback];

    /// The `key` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Obligation => "obligation",
            Self::Fulfilled => "fulfilled",
            Self::Fallback => "fallback",
        }
    }
}

/// An event's notes of how its operations were keyed, by operation name; a later application
/// (a batch tried again in parts) replaces an earlier one's.
#[derive(Debug, Default)]
struct KeyedNotes(std::sync::Mutex<std::collections::BTreeMap<String, OperationKeyed>>);

impl Clone for KeyedNotes {
    fn clone(&self) -> Self {
        Self(std::sync::Mutex::new(self.notes()))
    }
}

impl KeyedNotes {
    fn notes(&self) -> std::collections::BTreeMap<String, OperationKeyed> {
        self.0.lock().map(|n| n.clone()).unwrap_or_default()
    }

    /// How each operation was keyed, by operation name, without copying the names.
    fn values(&self) -> Vec<OperationKeyed> {
        self.0
            .lock()
            .map(|n| n.values().copied().collect())
            .unwrap_or_default()
    }
}

/// The envelope as read: `payload` is required, though it may be `null`.
#[derive(Deserialize)]
struct Wire {
    key: String,
    source: String,
    #[serde(rename = "type", default)]
    event_type: Option<String>,
    #[serde(default)]
    received_at: Option<DateTime<Utc>>,
    #[serde(default)]
    occurred_at: Option<DateTime<Utc>>,
    payload: Box<RawValue>,
    #[serde(default)]
    unhashed: Vec<String>,
    #[serde(default)]
    replay_window_secs: Option<u64>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    route: Option<String>,
}

/// The longest request id kept; a longer one (or one PostgreSQL cannot store) is dropped, not
/// the event: it only names a delivery.
pub const MAX_REQUEST_ID_BYTES: usize = 200;

fn storable_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_REQUEST_ID_BYTES && !id.contains('\0')
}

/// An event's fields as a message gave them, before they are checked: what every input
/// ([`crate::inputs`]) reads a message into.
#[derive(Debug)]
pub struct Parts {
    /// The dedupe key, unchecked.
    pub key: String,
    /// The source's name.
    pub source: String,
    /// The event's type at its source, if it has one.
    pub event_type: Option<String>,
    /// When the ingress received the event, if it says.
    pub received_at: Option<DateTime<Utc>>,
    /// When the event happened at its source, if it says.
    pub occurred_at: Option<DateTime<Utc>>,
    /// The payload's JSON text.
    pub payload: Box<RawValue>,
    /// Top-level payload fields left out of its hash.
    pub unhashed: Vec<String>,
    /// The replay guard's window, for sources that sign only the body.
    pub replay_window_secs: Option<u64>,
    /// The request that carried the delivery.
    pub request_id: Option<String>,
    /// The route key, unchecked, when the event routes by another key than its own.
    pub route: Option<String>,
}

impl Parts {
    /// The parts of an event keyed `key` from `source` with this payload, nothing else said.
    pub fn new(key: String, source: String, payload: Box<RawValue>) -> Self {
        Self {
            key,
            source,
            event_type: None,
            received_at: None,
            occurred_at: None,
            payload,
            unhashed: Vec::new(),
            replay_window_secs: None,
            request_id: None,
            route: None,
        }
    }
}

impl Event {
    /// Parses a Kafka message into an event. The message key, when present, must equal the
    /// envelope's key: a disagreement means the record was not written by a correct producer.
    pub fn parse(message_key: Option<&[u8]>, value: Option<&[u8]>) -> Result<Self, Malformed> {
        let value = value.ok_or(Malformed::NoValue)?;
        // serde would read a struct from an array of its fields in order too: an envelope is
        // an object.
        if value.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(Malformed::NotJson("an envelope is a JSON object".into()));
        }
        let wire: Wire =
            serde_json::from_slice(value).map_err(|e| Malformed::NotJson(e.to_string()))?;
        let parts = Parts {
            key: wire.key,
            source: wire.source,
            event_type: wire.event_type,
            received_at: wire.received_at,
            occurred_at: wire.occurred_at,
            payload: wire.payload,
            unhashed: wire.unhashed,
            replay_window_secs: wire.replay_window_secs,
            request_id: wire.request_id,
            route: wire.route,
        };
        let event = Self::from_parts(parts)?;
        if message_key.is_some_and(|k| k != event.key.as_str().as_bytes()) {
            return Err(Malformed::KeyMismatch);
        }
        Ok(event)
    }

    /// The event `parts` describe, checked as an envelope's are: the keys valid, nothing
    /// PostgreSQL would refuse, the payload hashed in its canonical form.
    pub fn from_parts(parts: Parts) -> Result<Self, Malformed> {
        let key = EventKey::try_from(parts.key)?;
        let route = match parts.route {
            Some(route) if route != key.as_str() => {
                Some(EventKey::try_from(route).map_err(Malformed::route)?)
            }
            _ => None,
        };
        check_fields(
            key.as_str(),
            &parts.source,
            parts.event_type.as_deref(),
            parts.received_at,
        )?;
        if parts
            .occurred_at
            .is_some_and(|t| t.year() < EARLIEST_STORABLE_YEAR)
        {
            return Err(Malformed::Unstorable(
                "occurred_at is before 4713 BC, outside PostgreSQL's timestamps",
            ));
        }
        // The canonical form below is written level by level: the depth is bounded first.
        if nests_deeper_than(parts.payload.get(), MAX_NESTING) {
            return Err(Malformed::TooDeep);
        }
        // One walk over the payload's text checks what PostgreSQL would refuse and writes the
        // canonical form to hash, without building a `serde_json::Value`.
        let mut canonical = Vec::with_capacity(parts.payload.get().len());
        write_canonical_text(parts.payload.get(), &parts.unhashed, &mut canonical)?;
        Ok(Self {
            payload_sha256: Sha256::digest(&canonical).into(),
            key,
            source: parts.source,
            event_type: parts.event_type,
            received_at: parts.received_at,
            occurred_at: parts.occurred_at,
            payload_json: parts.payload,
            replay_window_secs: parts.replay_window_secs.filter(|secs| *secs > 0),
            request_id: parts.request_id.filter(|id| storable_request_id(id)),
            traceparent: None,
            route,
            span: None,
            attributes: None,
            payload: std::sync::OnceLock::new(),
            keyed: KeyedNotes::default(),
        })
    }

    /// The event with `attributes` ([`Event::attribute`]); none are kept when it has none.
    pub fn with_attributes(mut self, attributes: Attributes) -> Self {
        self.attributes = (!attributes.is_empty()).then(|| Box::new(attributes));
        self
    }

    /// An attribute the message gave the event: a CloudEvent's attribute or extension by its
    /// name (`source`, `id`, `subject`, `partitionkey`), a Debezium outbox message's header.
    /// An effect reads them here, on the first application and on every retry.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.as_ref()?.get(name)
    }

    /// Every attribute the message gave the event ([`Event::attribute`]); None for an
    /// envelope, which has none.
    pub fn attributes(&self) -> Option<&Attributes> {
        self.attributes.as_deref()
    }

    /// The event in the trace of `traceparent` (the message's header), when it is valid; when
    /// traces are exported, with a span of its own in that trace, which its `traceparent`
    /// then names ([`crate::trace::event_span`]).
    pub fn in_trace(mut self, traceparent: Option<&str>) -> Self {
        let traceparent = traceparent
            .and_then(crate::trace::valid_traceparent)
            .map(str::to_owned);
        (self.span, self.traceparent) = crate::trace::event_span(
            &self.source,
            self.key.as_str(),
            self.request_id.as_deref(),
            traceparent,
        );
        self
    }

    /// The key the event's claim, conflicts and outbox operations are stored and sharded by:
    /// the envelope's `route` when its source routes by a tenant field, else the event key.
    pub fn route_key(&self) -> &str {
        self.route.as_ref().unwrap_or(&self.key).as_str()
    }

    /// Notes how the effect keyed its operation `operation` of this event; counted when the
    /// event's transaction commits with it.
    pub fn note_keyed(&self, operation: &str, keyed: OperationKeyed) {
        if let Ok(mut notes) = self.keyed.0.lock() {
            notes.insert(operation.to_owned(), keyed);
        }
    }

    /// How each operation of the event was keyed, as last noted ([`Event::note_keyed`]).
    pub fn keyed_notes(&self) -> Vec<OperationKeyed> {
        self.keyed.values()
    }

    /// The route key only when it is not the event key: what the newest-wins effect keeps its
    /// versions under ('' for an event routed by its own key).
    pub fn tenant_route(&self) -> Option<&str> {
        self.route.as_ref().map(EventKey::as_str)
    }

    /// The event routed by `route_key` (as stored with its claim).
    pub fn routed(mut self, route_key: &str) -> Result<Self, Malformed> {
        self.route = match route_key == self.key.as_str() {
            true => None,
            false => Some(EventKey::try_from(route_key.to_owned()).map_err(Malformed::route)?),
        };
        Ok(self)
    }

    /// The event's span: an effect applied event by event runs inside it, so its own spans
    /// join the event's trace. `Span::none()` when traces are not exported.
    pub fn span(&self) -> tracing::Span {
        self.span.clone().unwrap_or_else(tracing::Span::none)
    }

    /// An event as it was stored with its claim, for an operator's retry.
    pub fn stored(
        key: EventKey,
        source: String,
        event_type: Option<String>,
        received_at: Option<DateTime<Utc>>,
        payload_json: Box<RawValue>,
        payload_sha256: [u8; 32],
    ) -> Self {
        Self {
            key,
            source,
            event_type,
            received_at,
            occurred_at: None,
            payload_json,
            payload_sha256,
            replay_window_secs: None,
            request_id: None,
            traceparent: None,
            route: None,
            span: None,
            attributes: None,
            payload: std::sync::OnceLock::new(),
            keyed: KeyedNotes::default(),
        }
    }

    /// The payload as a JSON value, parsed from [`Event::payload_json`] on first use, with the
    /// `serde_json` features of the application it runs in: without `arbitrary_precision` a
    /// number past `f64`'s precision is rounded here (never in what is stored or sent, which is
    /// [`Event::payload_json`]). For exact amounts, deserialise `payload_json` into a type of
    /// your own. An event read from a message was checked when it was parsed, so this does not
    /// fail for one; it never panics. Its error, returned with `?` from an effect, settles the
    /// event `failed` at once: a payload that cannot be read now never will be.
    pub fn payload(&self) -> Result<&serde_json::Value, Malformed> {
        self.payload
            .get_or_init(|| {
                if nests_deeper_than(self.payload_json.get(), MAX_NESTING) {
                    return Err(Malformed::TooDeep);
                }
                serde_json::from_str(self.payload_json.get())
                    .map_err(|e| Malformed::NotJson(e.to_string()))
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The envelope to send downstream for this event, its payload copied as it arrived.
    pub fn envelope_bytes(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Outbound<'a> {
            key: &'a str,
            source: &'a str,
            #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
            event_type: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            received_at: Option<DateTime<Utc>>,
            payload: &'a RawValue,
        }
        serde_json::to_vec(&Outbound {
            key: self.key.as_str(),
            source: &self.source,
            event_type: self.event_type.as_deref(),
            received_at: self.received_at,
            payload: &self.payload_json,
        })
        .expect("an envelope always serialises")
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn key_order_and_white_space_never_change_the_payload_hash() {
        let a = parse(r#"{"key":"k","source":"s","payload":{"b":1,"a":{"y":[1,2],"x":"é"}}}"#);
        let b = parse(
            r#"{"key":"k","source":"s","payload":{ "a" : {"x":"\u00e9","y":[1, 2]}, "b":1 }}"#,
        );
        let c = parse(r#"{"key":"k","source":"s","payload":{"a":{"x":"é","y":[2,1]},"b":1}}"#);
        let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
        assert_ne!(a.payload_json.get(), b.payload_json.get());
        assert_eq!(a.payload_sha256, b.payload_sha256);
        assert_ne!(
            a.payload_sha256, c.payload_sha256,
            "array order is meaningful"
        );
    }

    use super::storable::decimal_exponent;
    use super::*;

    /// The canonical form of a payload's text, without the top-level fields in `skip`.
    fn canonical_text(text: &str, skip: &[String]) -> String {
        let mut canonical = Vec::new();
        write_canonical_text(text, skip, &mut canonical).unwrap();
        String::from_utf8(canonical).unwrap()
    }

    #[test]
    fn the_canonical_form_is_compact_sorted_json() {
        let text = r#"{ "b" : [1, {"d":null,"c":"x"}], "a" : 1.50, "skip": 0 }"#;
        assert_eq!(
            canonical_text(text, &["skip".into()]),
            r#"{"a":1.50,"b":[1,{"c":"x","d":null}]}"#
        );
    }

    #[test]
    fn the_payload_text_is_kept_as_it_arrived() {
        let e = parse(r#"{"key":"k","source":"s","payload":{ "z": 1, "a": 10.000 }}"#).unwrap();
        assert_eq!(e.payload_json.get(), r#"{ "z": 1, "a": 10.000 }"#);
        let sent: serde_json::Value = serde_json::from_slice(&e.envelope_bytes()).unwrap();
        assert_eq!(&sent["payload"], e.payload().unwrap());
        assert_eq!(sent["key"], "k");
    }

    fn parse(value: &str) -> Result<Event, Malformed> {
        Event::parse(None, Some(value.as_bytes()))
    }

    #[test]
    fn full_envelope_parses() {
        let e = parse(
            r#"{"key":"stripe:evt_1","source":"stripe","type":"charge.succeeded",
                "received_at":"2026-11-29T10:00:00Z","payload":{"id":"evt_1"}}"#,
        )
        .unwrap();
        assert_eq!(e.key.as_str(), "stripe:evt_1");
        assert_eq!(e.source, "stripe");
        assert_eq!(e.event_type.as_deref(), Some("charge.succeeded"));
        assert!(e.received_at.is_some());
    }

    #[test]
    fn missing_parts_are_malformed() {
        assert!(matches!(parse("not json"), Err(Malformed::NotJson(_))));
        assert!(matches!(
            parse(r#"{"source":"s","payload":1}"#),
            Err(Malformed::NotJson(_))
        ));
        assert!(matches!(
            parse(r#"{"key":"k","payload":1}"#),
            Err(Malformed::NotJson(_))
        ));
        assert!(matches!(
            parse(r#"{"key":"k","source":"s"}"#),
            Err(Malformed::NotJson(_))
        ));
        assert!(matches!(parse(r#"[1,2]"#), Err(Malformed::NotJson(_))));
        assert_eq!(Event::parse(None, None).unwrap_err(), Malformed::NoValue);
    }

    #[test]
    fn null_payload_is_a_payload() {
        assert!(parse(r#"{"key":"k","source":"s","payload":null}"#).is_ok());
    }

    #[test]
    fn key_length_is_bounded() {
        assert_eq!(
            parse(r#"{"key":"","source":"s","payload":1}"#).unwrap_err(),
            Malformed::EmptyKey
        );
        let at_limit = format!(
            r#"{{"key":"{}","source":"s","payload":1}}"#,
            "k".repeat(512)
        );
        assert!(parse(&at_limit).is_ok());
        let over = format!(
            r#"{{"key":"{}","source":"s","payload":1}}"#,
            "k".repeat(513)
        );
        assert_eq!(parse(&over).unwrap_err(), Malformed::KeyTooLong(513));
    }

    #[test]
    fn keys_with_control_characters_are_malformed() {
        for key in [
            "a\\r\\nInjected: 1",
            "tab\\there",
            "bell\\u0007",
            "del\\u007f",
        ] {
            let value = format!(r#"{{"key":"{key}","source":"s","payload":1}}"#);
            assert_eq!(
                parse(&value).unwrap_err(),
                Malformed::KeyControlCharacter,
                "{key}"
            );
        }
        assert!(parse(r#"{"key":"stripe:evt_ü ok","source":"s","payload":1}"#).is_ok());
    }

    /// A payload nested `depth` levels deep: arrays and objects in turn.
    fn nested(depth: usize) -> String {
        let mut text = String::with_capacity(depth * 6);
        for i in 0..depth {
            text.push_str(if i % 2 == 0 { "[" } else { "{\"a\":" });
        }
        text.push('1');
        for i in (0..depth).rev() {
            text.push(if i % 2 == 0 { ']' } else { '}' });
        }
        text
    }

    #[test]
    fn a_payload_nested_200000_levels_deep_is_malformed_without_recursion() {
        let value = format!(
            r#"{{"key":"k","source":"s","payload":{}}}"#,
            nested(200_000)
        );
        assert_eq!(parse(&value).unwrap_err(), Malformed::TooDeep);
        // Brackets inside strings are text, not nesting.
        let text = format!(
            r#"{{"key":"k","source":"s","payload":["{}"]}}"#,
            "[".repeat(500)
        );
        assert!(parse(&text).is_ok());
    }

    /// [`nests_deeper_than`] as a byte-by-byte walk: the reference the fast one must agree with.
    fn nests_deeper_than_bytewise(text: &str, limit: usize) -> bool {
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for &b in text.as_bytes() {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    if depth > limit {
                        return true;
                    }
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        false
    }

    #[test]
    fn nesting_skips_strings_with_their_escapes_as_a_bytewise_walk_does() {
        // Escaped quotes and backslashes inside strings, brackets inside strings, a backslash
        // as the text's last byte, an unterminated string.
        let cases = [
            r#"["\"[[[[", {"a":[1]}]"#,
            r#"["\\", [[1]]]"#,
            r#"{"k\"{":"\\\"[", "x":[[["y"]]]}"#,
            r#"["abc\"#,
            r#"[[["unterminated [[["#,
            r#""\u005b[[""#,
        ];
        for text in cases {
            for limit in 0..5 {
                assert_eq!(
                    nests_deeper_than(text, limit),
                    nests_deeper_than_bytewise(text, limit),
                    "{text} at {limit}"
                );
            }
        }
        // Random texts over the bytes that matter, against the reference.
        let alphabet = b"[]{}\"\\a, ";
        let mut rng = fastrand::Rng::with_seed(27);
        for _ in 0..20_000 {
            let len = rng.usize(0..40);
            let text: String = (0..len)
                .map(|_| alphabet[rng.usize(..alphabet.len())] as char)
                .collect();
            let limit = rng.usize(0..6);
            assert_eq!(
                nests_deeper_than(&text, limit),
                nests_deeper_than_bytewise(&text, limit),
                "{text} at {limit}"
            );
        }
    }

    #[test]
    fn a_payload_at_the_nesting_limit_parses_and_reads_back() {
        let at_limit = format!(
            r#"{{"key":"k","source":"s","payload":{}}}"#,
            nested(MAX_NESTING)
        );
        let event = parse(&at_limit).unwrap();
        assert!(event.payload().is_ok());
        let over = format!(
            r#"{{"key":"k","source":"s","payload":{}}}"#,
            nested(MAX_NESTING + 1)
        );
        assert_eq!(parse(&over).unwrap_err(), Malformed::TooDeep);
    }

    #[test]
    fn payload_returns_an_error_and_never_panics() {
        // An event built around a payload no parser checked.
        let mut event = parse(r#"{"key":"k","source":"s","payload":1}"#).unwrap();
        event.payload_json = RawValue::from_string(nested(5_000)).unwrap();
        assert_eq!(event.payload().unwrap_err(), Malformed::TooDeep);
    }

    #[test]
    fn message_key_must_match_envelope_key() {
        let v = br#"{"key":"a","source":"s","payload":1}"#;
        assert!(Event::parse(Some(b"a"), Some(v)).is_ok());
        assert_eq!(
            Event::parse(Some(b"b"), Some(v)).unwrap_err(),
            Malformed::KeyMismatch
        );
    }

    #[test]
    fn what_postgresql_cannot_store_is_malformed() {
        let unstorable = [
            r#"{"key":"k","source":"s","payload":{"note":"a\u0000b"}}"#,
            r#"{"key":"k","source":"s","payload":[{"\u0000":1}]}"#,
            r#"{"key":"k","source":"s\u0000","payload":1}"#,
            r#"{"key":"k","source":"s","type":"t\u0000","payload":1}"#,
            r#"{"key":"k","source":"s","received_at":"-5000-01-01T00:00:00Z","payload":1}"#,
        ];
        for value in unstorable {
            assert!(
                matches!(parse(value), Err(Malformed::Unstorable(_))),
                "{value}"
            );
        }
        assert!(parse(r#"{"key":"k","source":"s","payload":"\\u0000 is text"}"#).is_ok());
        // A NUL in the key is a control character, which no header can carry either.
        assert_eq!(
            parse(r#"{"key":"k\u0000","source":"s","payload":1}"#).unwrap_err(),
            Malformed::KeyControlCharacter
        );
        // Left out of the hash, or replaced by a later copy of its key: stored all the same.
        assert!(matches!(
            parse(r#"{"key":"k","source":"s","unhashed":["x"],"payload":{"x":"\u0000"}}"#),
            Err(Malformed::Unstorable(_))
        ));
        assert!(matches!(
            parse(r#"{"key":"k","source":"s","payload":{"x":"\u0000","x":1}}"#),
            Err(Malformed::Unstorable(_))
        ));
        assert!(matches!(
            parse(r#"{"key":"k","source":"s","payload":{"n":1e200000}}"#),
            Err(Malformed::Unstorable(_))
        ));
        assert!(parse(r#"{"key":"k","source":"s","payload":{"n":1e400}}"#).is_ok());
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        let value = |rate: &str| {
            format!(
                r#"{{"key":"k","source":"s","payload":{{"amount":123456789012345678901234567890,
                   "rate":{rate},"tiny":1.5e-300}}}}"#
            )
        };
        let e = parse(&value("0.1000000000000000055511151231257827")).unwrap();
        // What is stored and sent is the text as it arrived, whatever serde_json's features.
        let sent = String::from_utf8(e.envelope_bytes()).unwrap();
        for text in [e.payload_json.get(), &sent] {
            assert!(text.contains("123456789012345678901234567890"), "{text}");
            assert!(
                text.contains("0.1000000000000000055511151231257827"),
                "{text}"
            );
            assert!(text.contains("1.5e-300"), "{text}");
        }
        // Two payloads a digit apart past f64's precision are different payloads.
        let other = parse(&value("0.1000000000000000055511151231257828")).unwrap();
        assert_ne!(e.payload_sha256, other.payload_sha256);
        assert_eq!(decimal_exponent("1234.5"), 3);
        assert_eq!(decimal_exponent("-0.01"), -2);
        assert_eq!(decimal_exponent("5e7"), 7);
        assert_eq!(decimal_exponent("0.00E0"), 0);
    }

    /// serde_json is built with the features of whoever depends on it: this crate switches on
    /// none that change how a host application's own types read JSON. With
    /// `arbitrary_precision`, a float inside an untagged or internally tagged enum, or a
    /// flattened struct, is refused ("invalid type: map"); with `preserve_order`, a `Value`'s
    /// keys come out as written instead of sorted.
    #[test]
    fn the_host_applications_serde_json_reads_floats_in_untagged_tagged_and_flattened_types() {
        #[derive(Deserialize, Debug, PartialEq)]
        #[serde(untagged)]
        enum Untagged {
            Amount { amount: f64 },
        }
        #[derive(Deserialize, Debug, PartialEq)]
        #[serde(tag = "kind")]
        enum Tagged {
            Price { price: f64 },
        }
        #[derive(Deserialize, Debug, PartialEq)]
        struct Outer {
            #[serde(flatten)]
            inner: Inner,
        }
        #[derive(Deserialize, Debug, PartialEq)]
        struct Inner {
            rate: f64,
        }
        let untagged: Untagged = serde_json::from_str(r#"{"amount":1.5}"#).unwrap();
        assert_eq!(untagged, Untagged::Amount { amount: 1.5 });
        let tagged: Tagged = serde_json::from_str(r#"{"kind":"Price","price":2.5}"#).unwrap();
        assert_eq!(tagged, Tagged::Price { price: 2.5 });
        let outer: Outer = serde_json::from_str(r#"{"rate":0.25}"#).unwrap();
        assert_eq!(outer.inner.rate, 0.25);
        let value: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":2}"#).unwrap();
        assert_eq!(value.to_string(), r#"{"a":2,"b":1}"#);
    }

    #[test]
    fn unhashed_fields_do_not_change_the_hash() {
        let a = parse(
            r#"{"key":"k","source":"s","unhashed":["pending_webhooks"],
                "payload":{"id":"evt_1","pending_webhooks":1,"amount":5}}"#,
        )
        .unwrap();
        let b = parse(
            r#"{"key":"k","source":"s","unhashed":["pending_webhooks"],
                "payload":{"id":"evt_1","pending_webhooks":3,"amount":5}}"#,
        )
        .unwrap();
        let c = parse(
            r#"{"key":"k","source":"s","unhashed":["pending_webhooks"],
                "payload":{"id":"evt_1","pending_webhooks":3,"amount":6}}"#,
        )
        .unwrap();
        assert_eq!(a.payload_sha256, b.payload_sha256);
        assert_ne!(b.payload_sha256, c.payload_sha256);
        assert_eq!(
            b.payload().unwrap()["pending_webhooks"],
            3,
            "the field is still stored"
        );
    }

    /// A JSON document as a tree, from which both a random text and its expected canonical form
    /// are written: the reference the text canonicaliser is held to, independent of how any
    /// parsed value would read its numbers.
    enum Node {
        /// `true`, `false`, `null`, or a string literal as written.
        Atom(&'static str),
        /// A number as written, and as the canonical form writes it.
        Number(&'static str, &'static str),
        Array(Vec<Node>),
        /// Members as written: keys may repeat, and the last one wins.
        Object(Vec<(&'static str, Node)>),
    }

    /// String literals with escapes, astral characters and keys that repeat once decoded.
    const STRINGS: [&str; 11] = [
        r#""""#,
        r#""plain""#,
        r#""caf\u00e9""#,
        r#""café""#,
        r#""\ud83d\ude00 \"quoted\" \\ \/ \b\f\n\r\t""#,
        r#""\u001f\u007f""#,
        r#""😀""#,
        "\"\u{e000}\"",
        r#""a""#,
        r#""\u0061""#,
        r#""b""#,
    ];

    /// Numbers as written and as canonicalised: the text kept, the exponent written `e` and
    /// signed.
    const NUMBERS: [(&str, &str); 8] = [
        ("0", "0"),
        ("-0", "-0"),
        ("1.50", "1.50"),
        (
            "123456789012345678901234567890",
            "123456789012345678901234567890",
        ),
        ("1e5", "1e+5"),
        ("-2.5E-300", "-2.5e-300"),
        ("1E+2", "1e+2"),
        ("0.000", "0.000"),
    ];

    fn random_node(rng: &mut fastrand::Rng, depth: u32) -> Node {
        let pick = |rng: &mut fastrand::Rng| STRINGS[rng.usize(..STRINGS.len())];
        match rng.u32(..if depth == 0 { 5 } else { 7 }) {
            0 => Node::Atom(["true", "false", "null"][rng.usize(..3)]),
            1 | 2 => {
                let (text, canonical) = NUMBERS[rng.usize(..NUMBERS.len())];
                Node::Number(text, canonical)
            }
            3 | 4 => Node::Atom(pick(rng)),
            5 => Node::Array(
                (0..rng.usize(..4))
                    .map(|_| random_node(rng, depth - 1))
                    .collect(),
            ),
            _ => Node::Object(
                (0..rng.usize(..5))
                    .map(|_| (pick(rng), random_node(rng, depth - 1)))
                    .collect(),
            ),
        }
    }

    impl Node {
        /// The node as JSON text, with random white space between tokens.
        fn text(&self, rng: &mut fastrand::Rng, out: &mut String) {
            let ws = |rng: &mut fastrand::Rng| [" ", "", "\n\t", ""][rng.usize(..4)];
            match self {
                Node::Atom(text) | Node::Number(text, _) => out.push_str(text),
                Node::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        out.push_str(ws(rng));
                        item.text(rng, out);
                    }
                    out.push(']');
                }
                Node::Object(members) => {
                    out.push('{');
                    for (i, (key, value)) in members.iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        out.push_str(ws(rng));
                        out.push_str(key);
                        out.push_str(ws(rng));
                        out.push(':');
                        out.push_str(ws(rng));
                        value.text(rng, out);
                    }
                    out.push_str(ws(rng));
                    out.push('}');
                }
            }
        }

        /// The node's canonical form, the top-level members named in `skip` left out.
        fn canonical(&self, skip: &[String], out: &mut String) {
            let decoded = |literal: &str| serde_json::from_str::<String>(literal).unwrap();
            match self {
                Node::Atom(text) if text.starts_with('"') => {
                    out.push_str(&serde_json::to_string(&decoded(text)).unwrap())
                }
                Node::Atom(text) | Node::Number(_, text) => out.push_str(text),
                Node::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        item.canonical(&[], out);
                    }
                    out.push(']');
                }
                Node::Object(members) => {
                    let mut kept: Vec<(String, &Node)> = Vec::new();
                    for (key, value) in members {
                        let key = decoded(key);
                        kept.retain(|(seen, _)| *seen != key);
                        kept.push((key, value));
                    }
                    kept.retain(|(key, _)| !skip.contains(key));
                    kept.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
                    out.push('{');
                    for (i, (key, value)) in kept.iter().enumerate() {
                        out.push_str(if i > 0 { "," } else { "" });
                        out.push_str(&serde_json::to_string(key).unwrap());
                        out.push(':');
                        value.canonical(&[], out);
                    }
                    out.push('}');
                }
            }
        }
    }

    #[test]
    fn hashing_the_text_gives_the_canonical_form_of_the_document() {
        let mut rng = fastrand::Rng::with_seed(7);
        let skip = ["a".to_owned(), "é".to_owned()];
        for _ in 0..20_000 {
            let node = random_node(&mut rng, 4);
            let mut text = String::new();
            node.text(&mut rng, &mut text);
            for skip in [&skip[..], &[]] {
                let mut expected = String::new();
                node.canonical(skip, &mut expected);
                assert_eq!(canonical_text(&text, skip), expected, "{text}");
            }
        }
    }

    #[test]
    fn strings_and_keys_are_borrowed_unless_escaped() {
        let Text(plain) = serde_json::from_str(r#""abc""#).unwrap();
        assert!(matches!(plain, std::borrow::Cow::Borrowed("abc")));
        let Text(escaped) = serde_json::from_str(r#""a\u0062c""#).unwrap();
        assert_eq!(escaped, "abc");
        let Members(members) = serde_json::from_str(r#"{"k":1}"#).unwrap();
        assert!(matches!(members[0].0, std::borrow::Cow::Borrowed("k")));
    }

    #[test]
    fn a_payload_is_parsed_only_when_asked_for() {
        let e = parse(r#"{"key":"k","source":"s","payload":{"n":1.50,"a":[true]}}"#).unwrap();
        assert!(e.payload.get().is_none());
        assert_eq!(e.payload().unwrap()["n"], 1.5);
        assert_eq!(e.payload().unwrap()["a"][0], true);
    }
}
