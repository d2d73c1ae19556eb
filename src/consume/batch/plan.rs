//! A batch sorted out before any database work: the envelopes by first copy of each key and later
//! copies, and the messages that are not envelopes.

use super::guarded::EffectFailure;
use super::RawMessage;
use crate::claims::dead_letters::DeadLetter;
use crate::claims::Origin;
use crate::effect::{Deferred, EffectError};
use crate::envelope::Event;
use crate::shard::Shards;
use crate::sources::Paused;
use std::collections::{BTreeMap, HashSet};

/// The batch, sorted out before any database work.
pub(super) struct Plan<'m> {
    /// Where the messages were read.
    pub(super) origin: Origin<'m>,
    /// The first copy of each key, in offset order.
    pub(super) firsts: Vec<(i64, Event)>,
    /// Later copies of a key within this batch.
    pub(super) copies: Vec<(i64, Event)>,
    pub(super) dead: Vec<DeadLetter<'m>>,
    /// The sources paused when the pass began.
    paused: Paused,
}

impl<'m> Plan<'m> {
    pub(super) fn new(origin: Origin<'m>, messages: &[&'m RawMessage]) -> Self {
        let mut plan = Plan {
            origin,
            firsts: Vec::with_capacity(messages.len()),
            copies: Vec::new(),
            dead: Vec::new(),
            paused: Paused::none(),
        };
        let mut events = Vec::with_capacity(messages.len());
        for m in messages {
            match Event::parse(m.key.as_deref(), m.value.as_deref()) {
                // Each event's span, when traces are exported, is open while the batch runs.
                Ok(event) => events.push((m.offset, event.in_trace(m.traceparent.as_deref()))),
                Err(reason) => plan.dead.push(DeadLetter {
                    offset: m.offset,
                    key: m.key.as_deref(),
                    value: m.value.as_deref(),
                    reason: reason.to_string(),
                }),
            }
        }
        let first: Vec<bool> = {
            let mut seen = HashSet::with_capacity(events.len());
            events
                .iter()
                .map(|(_, e)| seen.insert(e.key.as_str()))
                .collect()
        };
        for ((offset, event), first) in events.into_iter().zip(first) {
            match first {
                true => plan.firsts.push((offset, event)),
                false => plan.copies.push((offset, event)),
            }
        }
        plan
    }

    /// The plan, holding the events of the `paused` sources.
    pub(super) fn holding(self, paused: &Paused) -> Self {
        Self {
            paused: paused.clone(),
            ..self
        }
    }

    /// Takes the events of paused sources out of `claimed`: each is deferred, due at once,
    /// its effect not run; the deferred applier leaves it waiting until its source resumes.
    pub(super) fn hold<'e>(&self, claimed: &mut Vec<(i64, &'e Event)>) -> Vec<EffectFailure<'e>> {
        if self.paused.is_empty() {
            return Vec::new();
        }
        let now = chrono::Utc::now();
        let mut held = Vec::new();
        claimed.retain(|(offset, event)| match self.paused.reason(&event.source) {
            None => true,
            Some(reason) => {
                let not_yet = Deferred::new(reason).until(now);
                held.push(EffectFailure {
                    offset: *offset,
                    event,
                    error: EffectError::NotYet(not_yet),
                });
                false
            }
        });
        held
    }
}

/// The messages grouped by the shard of their route key, in offset order within each group and
/// the groups in shard order. A message with no usable route (no key anywhere, not an
/// envelope) goes to the first shard, where it becomes a dead letter.
pub(super) fn by_shard<'m>(
    shards: &Shards,
    messages: &[&'m RawMessage],
) -> Vec<(usize, Vec<&'m RawMessage>)> {
    let mut groups: BTreeMap<usize, Vec<&'m RawMessage>> = BTreeMap::new();
    for &m in messages {
        let shard = route_of(m).map_or(0, |route| shards.shard(&route));
        groups.entry(shard).or_default().push(m);
    }
    groups.into_iter().collect()
}

/// The route key of a message exactly as [`Event::route_key`] reads it, from what
/// [`Event::parse`] reads (an escaped member name, or a message key other than the envelope's,
/// routes as the event does); None for what is not an event.
fn route_of(m: &RawMessage) -> Option<String> {
    let event = Event::parse(m.key.as_deref(), m.value.as_deref()).ok()?;
    Some(event.route_key().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::Layout;

    fn message(key: &str, value: &str) -> RawMessage {
        RawMessage {
            offset: 0,
            key: Some(key.as_bytes().to_vec()),
            value: Some(value.as_bytes().to_vec()),
            traceparent: None,
        }
    }

    #[test]
    fn a_message_routes_as_its_event_reads_its_route_even_through_an_escaped_name() {
        let layout = Layout::new(1024, 4).unwrap();
        let tenant = (0..)
            .map(|n| format!("tenant-{n}"))
            .find(|t| layout.shard(t) != layout.shard("evt-1"))
            .unwrap();
        let plain = crate::envelope::Envelope {
            route: Some(tenant.as_str().try_into().unwrap()),
            key: "evt-1".try_into().unwrap(),
            source: "test".into(),
            event_type: None,
            received_at: None,
            occurred_at: None,
            payload: serde_json::value::to_raw_value(&serde_json::json!({})).unwrap(),
            unhashed: Vec::new(),
            replay_window_secs: None,
            request_id: None,
        }
        .to_bytes();
        let plain = String::from_utf8(plain).unwrap();
        let escaped = plain.replace(r#""route""#, r#""rou\u0074e""#);
        assert!(escaped.contains(r#"rou\u0074e"#));
        for value in [plain, escaped] {
            let m = message("evt-1", &value);
            let event = Event::parse(m.key.as_deref(), m.value.as_deref()).unwrap();
            assert_eq!(event.route_key(), tenant);
            assert_eq!(route_of(&m).as_deref(), Some(tenant.as_str()), "{value}");
        }
    }
}
