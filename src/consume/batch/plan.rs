//! A batch sorted out before any database work: the envelopes by first copy of each key and later
//! copies, and the messages that are not envelopes.

use super::guarded::EffectFailure;
use super::RawMessage;
use crate::claims::dead_letters::DeadLetter;
use crate::claims::Origin;
use crate::effect::{Deferred, EffectError};
use crate::envelope::Event;
use crate::inputs::{Input, Message, Reading};
use crate::shard::Shards;
use crate::sources::Paused;
use std::collections::{BTreeMap, HashSet};

/// The batch, sorted out before any database work.
pub(super) struct Plan<'m> {
    /// Where the messages were read.
    pub(super) origin: Origin<'m>,
    /// The first copy of each key, in offset order.
    pub(super) firsts: Vec<(i64, &'m Event)>,
    /// Later copies of a key within this batch.
    pub(super) copies: Vec<(i64, &'m Event)>,
    pub(super) dead: Vec<DeadLetter<'m>>,
    /// The source of each message that carries no event (a tombstone), passed over.
    pub(super) skipped: Vec<String>,
}

impl<'m> Plan<'m> {
    /// The plan of `reads`, borrowing their events: a plan made again for part of them (a
    /// refused message split out) reads nothing again and copies nothing.
    pub(super) fn new(origin: Origin<'m>, reads: &[&'m Read<'m>]) -> Self {
        let mut plan = Plan {
            origin,
            firsts: Vec::with_capacity(reads.len()),
            copies: Vec::new(),
            dead: Vec::new(),
            skipped: Vec::new(),
        };
        let mut events = Vec::with_capacity(reads.len());
        for Read { message: m, event } in reads.iter().copied() {
            match event {
                Parsed::Event(event) => events.push((m.offset, &**event)),
                Parsed::Skipped(source) => plan.skipped.push(source.clone()),
                Parsed::Malformed(reason) => plan.dead.push(DeadLetter {
                    offset: m.offset,
                    key: m.key.as_deref(),
                    value: m.value.as_deref(),
                    headers: &m.headers,
                    reason: reason.clone(),
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
}

/// Takes the events of the `paused` sources out of `claimed`: each is deferred, due at once,
/// its effect not run; the deferred applier leaves it waiting until its source resumes.
pub(super) fn hold<'e>(
    paused: &Paused,
    claimed: &mut Vec<(i64, &'e Event)>,
) -> Vec<EffectFailure<'e>> {
    if paused.is_empty() {
        return Vec::new();
    }
    let now = chrono::Utc::now();
    let mut held = Vec::new();
    claimed.retain(|(offset, event)| match paused.reason(&event.source) {
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

/// A message of a pass with what the input read from it: each message is read once a pass,
/// and both the split by shard and the plan take its event from here.
pub(super) struct Read<'m> {
    pub(super) message: &'m RawMessage,
    event: Parsed,
}

/// What a message is.
enum Parsed {
    Event(Box<Event>),
    /// Passed over (a tombstone), counted under this source.
    Skipped(String),
    /// A dead letter, for this reason.
    Malformed(String),
}

impl<'m> Read<'m> {
    /// Each of `messages` of `topic`, read as `input` says.
    pub(super) fn all(input: &Input, topic: &str, messages: &[&'m RawMessage]) -> Vec<Self> {
        messages
            .iter()
            .map(|&message| Read {
                message,
                event: match input.read(&message.as_input(topic)) {
                    // Each event's span, when traces are exported, is open while the pass runs.
                    Ok(Reading::Event(event)) => {
                        Parsed::Event(Box::new(event.in_trace(message.traceparent.as_deref())))
                    }
                    Ok(Reading::Skipped { source }) => Parsed::Skipped(source),
                    Err(reason) => Parsed::Malformed(reason.to_string()),
                },
            })
            .collect()
    }

    /// The route key of its event ([`Event::route_key`]); None for what is not an event.
    fn route(&self) -> Option<&str> {
        match &self.event {
            Parsed::Event(event) => Some(event.route_key()),
            _ => None,
        }
    }
}

impl RawMessage {
    /// The message as an input reads it.
    pub fn as_input<'a>(&'a self, topic: &'a str) -> Message<'a> {
        Message {
            topic,
            key: self.key.as_deref(),
            value: self.value.as_deref(),
            headers: &self.headers,
        }
    }
}

/// The messages grouped by the shard of their route key, in offset order within each group and
/// the groups in shard order. A message with no usable route (no key anywhere, not an
/// envelope) goes to the first shard, where it becomes a dead letter.
pub(super) fn by_shard<'r, 'm>(
    shards: &Shards,
    reads: &[&'r Read<'m>],
) -> Vec<(usize, Vec<&'r Read<'m>>)> {
    let mut groups: BTreeMap<usize, Vec<&'r Read<'m>>> = BTreeMap::new();
    for &r in reads {
        let shard = r.route().map_or(0, |route| shards.shard(route));
        groups.entry(shard).or_default().push(r);
    }
    groups.into_iter().collect()
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
            headers: Default::default(),
        }
    }

    #[test]
    fn a_message_is_read_once_and_routes_as_its_event_even_through_an_escaped_name() {
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
            let read = Read::all(&Input::default(), "t", &[&m]);
            assert_eq!(read[0].route(), Some(tenant.as_str()), "{value}");
            let plan = Plan::new(
                Origin {
                    topic: "t",
                    partition: 0,
                },
                &[&read[0]],
            );
            assert_eq!(
                plan.firsts[0].1.route_key(),
                tenant,
                "the plan's event is the read one"
            );
        }
        let junk = message("evt-1", "not json");
        let read = Read::all(&Input::default(), "t", &[&junk]);
        assert_eq!(read[0].route(), None);
        let plan = Plan::new(
            Origin {
                topic: "t",
                partition: 0,
            },
            &[&read[0]],
        );
        assert_eq!(plan.dead.len(), 1);
    }
}
