//! A batch sorted out before any database work: the envelopes by first copy of each key and later
//! copies, and the messages that are not envelopes.

use super::RawMessage;
use crate::claims::dead_letters::DeadLetter;
use crate::claims::Origin;
use crate::envelope::Event;
use crate::shard::Shards;
use std::borrow::Cow;
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
}

impl<'m> Plan<'m> {
    pub(super) fn new(origin: Origin<'m>, messages: &[&'m RawMessage]) -> Self {
        let mut plan = Plan {
            origin,
            firsts: Vec::with_capacity(messages.len()),
            copies: Vec::new(),
            dead: Vec::new(),
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

/// The route key of a message as [`Event::route_key`] will read it: the envelope's `route`
/// when it has one, else its key. Without a `"route"` anywhere in the value (every message of
/// a source routed by event key), the message key is the route and nothing is parsed.
fn route_of(m: &RawMessage) -> Option<Cow<'_, str>> {
    let value = m.value.as_deref()?;
    if let Some(key) = &m.key {
        if memchr::memmem::find(value, b"\"route\"").is_none() {
            return std::str::from_utf8(key).ok().map(Cow::Borrowed);
        }
    }
    #[derive(serde::Deserialize)]
    struct Routing<'a> {
        #[serde(borrow)]
        key: Cow<'a, str>,
        #[serde(borrow, default)]
        route: Option<Cow<'a, str>>,
    }
    let routing: Routing<'_> = serde_json::from_slice(value).ok()?;
    Some(routing.route.unwrap_or(routing.key))
}
