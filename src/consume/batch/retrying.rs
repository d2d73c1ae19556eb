//! How a failing effect is tried again: the attempts and their backoff, and the events a lane
//! holds, outside any transaction, until their next attempt is due.

use super::failures::Again;
use super::{Attempts, RawMessage};
use std::time::Duration;

/// The most attempts `--effect-attempts` allows: with the capped backoff, an event's retries
/// end within seconds, well inside a batch's timeout.
pub const MAX_EFFECT_ATTEMPTS: u32 = 10;
/// The longest wait between two attempts at a failing event's effect.
pub const MAX_EFFECT_BACKOFF: Duration = Duration::from_secs(2);

/// How effects are retried when they fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EffectRetry {
    /// Attempts per event before it is recorded as failed; taken between 1 and
    /// [`MAX_EFFECT_ATTEMPTS`].
    pub attempts: u32,
    /// The wait before the second attempt; doubled for each further one, up to
    /// [`MAX_EFFECT_BACKOFF`]. No transaction is open while waiting.
    pub backoff: Duration,
}

impl Default for EffectRetry {
    fn default() -> Self {
        Self {
            attempts: 3,
            backoff: Duration::from_millis(50),
        }
    }
}

impl EffectRetry {
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts.clamp(1, MAX_EFFECT_ATTEMPTS)
    }

    /// The wait after the failed attempt number `attempt` (from 1).
    pub(crate) fn delay(&self, attempt: u32) -> Duration {
        let doubled = self.backoff.saturating_mul(
            1u32.checked_shl(attempt.saturating_sub(1))
                .unwrap_or(u32::MAX),
        );
        doubled.min(MAX_EFFECT_BACKOFF)
    }
}

/// Events whose effect failed and that wait, outside any transaction, for another attempt; a
/// lane keeps one and hands it to every [`super::BatchProcessor::process_pass`], so that later batches
/// go on meanwhile. Its first offset is where the partition's committed offset must stop.
#[derive(Debug, Default)]
pub struct Retrying {
    /// In offset order.
    pub(super) held: Vec<Held>,
    /// Passes still to run with the effect in a savepoint, after one where an effect failed.
    pub(super) guarded: u32,
}

/// After an effect fails, this many passes run with the effect in a savepoint, so that a run of
/// failures costs no reruns; otherwise the effect runs without one, saving two round trips per
/// batch, and a failure reruns its batch once with savepoints.
pub(super) const GUARDED_PASSES: u32 = 8;

/// An event waiting in a lane for another attempt at its effect.
#[derive(Debug)]
pub(super) struct Held {
    pub(super) message: RawMessage,
    /// Attempts made so far.
    pub(super) attempts: u32,
    pub(super) due: tokio::time::Instant,
}

impl Retrying {
    /// Whether no event waits for another attempt.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// When the next attempt is due.
    pub fn next_due(&self) -> Option<tokio::time::Instant> {
        self.held.iter().map(|h| h.due).min()
    }

    /// The offset of the first event still unsettled.
    pub fn first_offset(&self) -> Option<i64> {
        self.held.first().map(|h| h.message.offset)
    }

    /// What the waiting events take in memory, as the lane's budget counts messages.
    pub fn bytes(&self) -> usize {
        self.held.iter().map(|h| h.message.queued_bytes()).sum()
    }
}

impl Retrying {
    /// After a pass: the due events it tried (`attempts`) leave, and `again` comes back.
    pub(super) fn replace_tried(&mut self, attempts: &Attempts, again: Vec<Held>) {
        if !again.is_empty() {
            tracing::debug!(
                events = again.len(),
                "Effects failed; their events are tried again in a later transaction."
            );
        }
        self.held
            .retain(|h| !attempts.contains_key(&h.message.offset));
        self.held.extend(again);
        self.held.sort_by_key(|h| h.message.offset);
    }
}

impl Held {
    /// The events of `part` to try again, with one more attempt, due after the wait the rule
    /// gave them.
    pub(super) fn again(
        part: &[&RawMessage],
        attempts: &Attempts,
        again: &[Again],
        now: tokio::time::Instant,
    ) -> Vec<Held> {
        part.iter()
            .filter_map(|m| {
                let wait = again.iter().find(|a| a.offset == m.offset)?.after;
                Some(Held {
                    message: (*m).clone(),
                    attempts: attempts.get(&m.offset).copied().unwrap_or(0) + 1,
                    due: now + wait,
                })
            })
            .collect()
    }
}
