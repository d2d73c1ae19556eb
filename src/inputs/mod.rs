//! What the consumer reads from its topic (`consume --input`): replayproof's own envelope,
//! CloudEvents in Kafka's protocol binding, or the messages of Debezium's outbox event router.
//! Each is read here, at the boundary, into an [`Event`] whose key is the format's own identity
//! (never the Kafka message key, which both other formats use only to choose a partition).
//! Everything past this module sees events, whatever wrote them.

mod cloudevents;
mod debezium;
mod headers;

pub use cloudevents::cloudevent_key;
pub use headers::Headers;

use crate::envelope::{Event, Malformed};

/// The beginnings of the event keys the CloudEvents and outbox inputs make: no other producer's
/// key may begin so (the ingress refuses a source of these names), so no two formats' events
/// can share a key in one database.
pub const RESERVED_KEY_PREFIXES: [&str; 3] = ["ce:", "ce-sha256:", "outbox:"];

/// The message formats a consumer reads (`--input`, `[consume] input`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Format {
    /// replayproof's envelope, as the ingress writes it: the Kafka key is the event key.
    #[default]
    Envelope,
    /// CloudEvents 1.0 in the Kafka protocol binding, binary or structured mode.
    #[cfg_attr(feature = "cli", value(name = "cloudevents"))]
    CloudEvents,
    /// Debezium's outbox event router, with its defaults: the event id in the `id` header.
    DebeziumOutbox,
}

impl Format {
    /// The name `--input` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Envelope => "envelope",
            Self::CloudEvents => "cloudevents",
            Self::DebeziumOutbox => "debezium-outbox",
        }
    }
}

/// The header Debezium's outbox router is told to put the event type in
/// (`table.fields.additional.placement=type:header:eventType`), unless `--outbox-type-header`
/// names another.
pub const DEFAULT_OUTBOX_TYPE_HEADER: &str = "eventType";

/// How the consumer reads its topic's messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// The messages' format.
    pub format: Format,
    /// The source name the events of a CloudEvents or outbox topic are recorded under (the
    /// name `sources pause`, retention and the metrics use); the topic's name when not given.
    /// A CloudEvent's own `source` is part of its key and kept as its attribute.
    pub source_name: Option<String>,
    /// The CloudEvents extension whose value is the route key (`partitionkey`), so one
    /// tenant's events share a shard; the event key when not given or absent.
    pub route_attribute: Option<String>,
    /// The header an outbox message carries its event type in.
    pub type_header: String,
}

impl Default for Input {
    fn default() -> Self {
        Self {
            format: Format::Envelope,
            source_name: None,
            route_attribute: None,
            type_header: DEFAULT_OUTBOX_TYPE_HEADER.to_owned(),
        }
    }
}

/// A Kafka message as an input reads it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// The topic it was read from: the default source name.
    pub topic: &'a str,
    pub key: Option<&'a [u8]>,
    pub value: Option<&'a [u8]>,
    pub headers: &'a Headers,
}

/// What a message is, read.
#[derive(Debug)]
pub enum Reading {
    /// An event to claim and apply.
    Event(Box<Event>),
    /// A message that carries no event and is passed over, counted as `skipped` under its
    /// source: a Debezium tombstone (a null value, written for log compaction).
    Skipped { source: String },
}

impl Input {
    /// An input of `format` with the defaults.
    pub fn of(format: Format) -> Self {
        Self {
            format,
            ..Self::default()
        }
    }

    /// Reads `message` in this input's format. An error is the dead letter's reason.
    pub fn read(&self, message: &Message<'_>) -> Result<Reading, Malformed> {
        match self.format {
            Format::Envelope => Event::parse(message.key, message.value)
                .map(|event| Reading::Event(Box::new(event))),
            Format::CloudEvents => {
                cloudevents::read(self, message).map(|event| Reading::Event(Box::new(event)))
            }
            Format::DebeziumOutbox => debezium::read(self, message),
        }
    }

    /// The source name of events read from `topic`.
    fn source_of(&self, topic: &str) -> String {
        self.source_name.clone().unwrap_or_else(|| topic.to_owned())
    }
}

/// A route key read from an attribute, spelled one way whichever mode or SDK wrote it: a
/// boolean in lower case (`True`, as Python's SDK writes one in binary mode, is `true`), an
/// integral number written with a fraction or an exponent as a plain integer (`7.0`, `7e0` are
/// `7`); anything else as it is. None for an empty value: the event routes by its own key.
fn route_text(value: &str) -> Option<String> {
    if value.is_empty() {
        return None;
    }
    if value.eq_ignore_ascii_case("true") || value.eq_ignore_ascii_case("false") {
        return Some(value.to_ascii_lowercase());
    }
    let spelled_as_float = value.contains(['.', 'e', 'E']);
    match value.parse::<f64>() {
        Ok(n) if spelled_as_float && n.fract() == 0.0 && n.abs() < 9.0e15 => {
            Some(format!("{}", n as i64))
        }
        _ => Some(value.to_owned()),
    }
}

/// A reason of the envelope's checks, said of the event a CloudEvent or an outbox message
/// makes: `the event key is 600 bytes`, not `the envelope key`.
fn as_event(reason: &Malformed) -> String {
    reason.to_string().replace("envelope", "event")
}

/// Whether `text` holds a character no CloudEvents string and no HTTP header may carry (the
/// control characters, a NUL among them), which PostgreSQL's `jsonb` would refuse too.
fn has_control(text: &str) -> bool {
    text.chars().any(char::is_control)
}

/// A media type's essence, lower-cased, without its parameters: `application/json`.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// Whether a content type is JSON: `application/json`, `text/json` or any `+json` type.
fn is_json(content_type: &str) -> bool {
    let essence = media_type(content_type);
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_reads_the_same_whichever_way_a_mode_spelled_it() {
        for (a, b) in [
            ("True", "true"),
            ("FALSE", "false"),
            ("7.0", "7"),
            ("7e0", "7"),
            ("-2.00", "-2"),
        ] {
            assert_eq!(route_text(a), route_text(b), "{a} and {b}");
        }
        for kept in ["007", "7.5", "tenant-7", "1e400", "NaN"] {
            assert_eq!(route_text(kept).as_deref(), Some(kept));
        }
        assert_eq!(route_text(""), None);
    }
}
