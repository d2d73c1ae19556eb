//! A batch sorted out before any database work: the envelopes by first copy of each key and later
//! copies, and the messages that are not envelopes.

use super::RawMessage;
use crate::claims::dead_letters::DeadLetter;
use crate::claims::Origin;
use crate::envelope::Event;
use std::collections::HashSet;

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
