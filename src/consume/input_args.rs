//! `--input` and the flags of each input format: how the consumer (and everything that applies
//! as it does: `replay`, the console's replay) reads the topic's messages.

use crate::inputs::{Format, Input, DEFAULT_OUTBOX_TYPE_HEADER};
use clap::Args;

/// How the topic's messages are read ([`crate::inputs`]).
#[derive(Debug, Clone, Args)]
pub struct InputArgs {
    /// The messages' format: envelope (replayproof's own, as the ingress writes it),
    /// cloudevents (CloudEvents 1.0, Kafka binding, binary or structured mode) or
    /// debezium-outbox (Debezium's outbox event router). docs/inputs.md tells each one's
    /// identity.
    #[arg(help_heading = "Input", long = "input", env = "REPLAYPROOF_INPUT", value_enum, default_value_t = Format::Envelope)]
    pub format: Format,

    /// The source name the events of a cloudevents or debezium-outbox topic are recorded
    /// under (what `sources pause`, retention and the metrics name); the topic's name when not
    /// given.
    #[arg(help_heading = "Input", long, env = "REPLAYPROOF_SOURCE_NAME", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub source_name: Option<String>,

    /// cloudevents: the extension attribute whose value is the route key (partitionkey), so
    /// one tenant's events share a shard; the event's own key when absent.
    #[arg(help_heading = "Input", long, env = "REPLAYPROOF_ROUTE_ATTRIBUTE", value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub route_attribute: Option<String>,

    /// debezium-outbox: the header the event type is in, as the router's
    /// `table.fields.additional.placement` (type:header:eventType) puts it.
    #[arg(help_heading = "Input", long, env = "REPLAYPROOF_OUTBOX_TYPE_HEADER", default_value = DEFAULT_OUTBOX_TYPE_HEADER, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub outbox_type_header: String,
}

impl InputArgs {
    /// The input these flags describe; a flag of another format than the one read is refused,
    /// as it would be ignored (a route attribute under `envelope` would route nothing).
    pub fn input(&self) -> anyhow::Result<Input> {
        if self.route_attribute.is_some() && self.format != Format::CloudEvents {
            anyhow::bail!(
                "route_attribute is read only with input = \"cloudevents\", not {:?}",
                self.format.name()
            );
        }
        if self.outbox_type_header != DEFAULT_OUTBOX_TYPE_HEADER
            && self.format != Format::DebeziumOutbox
        {
            anyhow::bail!(
                "outbox_type_header is read only with input = \"debezium-outbox\", not {:?}",
                self.format.name()
            );
        }
        Ok(Input {
            format: self.format,
            source_name: self.source_name.clone(),
            route_attribute: self.route_attribute.clone(),
            type_header: self.outbox_type_header.clone(),
        })
    }
}
