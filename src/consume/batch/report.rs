//! What a batch did: its report, event by event and by source, and what each of its passes
//! committed and leaves to try again.

use super::failures::Again;
use super::Outcome;
use crate::claims::dead_letters;
use std::collections::BTreeMap;

/// The log target of the line logged for each applied event, after its batch committed. Off
/// unless asked for (`RUST_LOG=replayproof::applied=debug`); `dev` turns it on.
pub const APPLIED_LOG: &str = "replayproof::applied";

/// What a committed batch did, event by event.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchReport {
    /// Events claimed here whose effect committed.
    pub applied: usize,
    /// Replays: the key was claimed before with the same payload, or repeated in this batch.
    pub duplicates: usize,
    /// The key was claimed before with a different payload; recorded in `key_conflicts`.
    pub conflicts: usize,
    /// Messages that are not envelopes, or whose values PostgreSQL refused; recorded in
    /// `dead_letters`.
    pub dead_letters: Vec<DeadLettered>,
    /// Claimed events whose effect failed every attempt; recorded as `failed` claims.
    pub failed: usize,
    /// Claimed events whose effect said "not yet"; recorded as `deferred` claims, applied again
    /// when due.
    pub deferred: usize,
    /// Effect attempts that failed, including those retried successfully (deferrals are not
    /// failures).
    pub effect_errors: usize,
    /// Events whose key is unknown and that are older than their source's prune horizon:
    /// recorded in `expired_replays`, not applied.
    pub expired: usize,
    /// Messages that carry no event (Debezium's tombstones), passed over.
    pub skipped: usize,
    /// The same events by source, for the events counter's labels; a dead letter, which may
    /// not be an envelope at all, counts under the source `unknown`. The counts are in the
    /// order of [`Outcome::ALL`].
    pub by_source: BTreeMap<String, [usize; Outcome::ALL.len()]>,
    /// Operations of the applied events by source and how they were keyed, when their source
    /// names an obligation.
    pub keyed: BTreeMap<(String, crate::envelope::OperationKeyed), usize>,
}

/// The source label of what has no source.
pub const UNKNOWN_SOURCE: &str = "unknown";

impl BatchReport {
    /// Adds the report of a later part of the same batch.
    pub(super) fn merge(&mut self, other: BatchReport) {
        self.applied += other.applied;
        self.duplicates += other.duplicates;
        self.conflicts += other.conflicts;
        self.dead_letters.extend(other.dead_letters);
        self.failed += other.failed;
        self.deferred += other.deferred;
        self.effect_errors += other.effect_errors;
        self.expired += other.expired;
        self.skipped += other.skipped;
        for (keyed, n) in other.keyed {
            *self.keyed.entry(keyed).or_default() += n;
        }
        for (source, counts) in other.by_source {
            let mine = self.by_source.entry(source).or_default();
            for (n, more) in mine.iter_mut().zip(counts) {
                *n += more;
            }
        }
    }

    /// Counts one event of `source`, in its total and by source.
    pub(super) fn tally(&mut self, source: &str, outcome: Outcome) {
        let total = match outcome {
            Outcome::Applied => Some(&mut self.applied),
            Outcome::Duplicate => Some(&mut self.duplicates),
            Outcome::Conflict => Some(&mut self.conflicts),
            // Listed one by one in `dead_letters`.
            Outcome::DeadLetter => None,
            Outcome::Failed => Some(&mut self.failed),
            Outcome::Deferred => Some(&mut self.deferred),
            Outcome::ExpiredReplay => Some(&mut self.expired),
            Outcome::Skipped => Some(&mut self.skipped),
        };
        if let Some(total) = total {
            *total += 1;
        }
        let counts = match self.by_source.get_mut(source) {
            Some(counts) => counts,
            None => self.by_source.entry(source.to_owned()).or_default(),
        };
        counts[outcome as usize] += 1;
    }
}

/// A message of the batch that became a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLettered {
    /// The message's offset.
    pub offset: i64,
    /// Why it is not an event that can be applied.
    pub reason: String,
}

impl From<&dead_letters::DeadLetter<'_>> for DeadLettered {
    fn from(letter: &dead_letters::DeadLetter<'_>) -> Self {
        Self {
            offset: letter.offset,
            reason: letter.reason.clone(),
        }
    }
}

/// What one pass over (part of) a batch committed, the events whose effect failed and are to be
/// tried again in a later transaction, and (while [`APPLIED_LOG`] is enabled) the events applied.
#[derive(Default)]
pub(super) struct Pass {
    pub(super) report: BatchReport,
    pub(super) again: Vec<Again>,
    pub(super) applied: Vec<Applied>,
    /// With several shards, the part's dead letters: written to the first shard once every
    /// part committed, so that every dead letter is in one place.
    pub(super) dead_later: Vec<DeadLettered>,
}

/// An applied event, for the [`APPLIED_LOG`] line logged once its transaction committed.
pub(super) struct Applied {
    pub(super) key: String,
    pub(super) event_type: Option<String>,
}

impl Pass {
    pub(super) fn reporting(report: BatchReport) -> Self {
        Self {
            report,
            ..Self::default()
        }
    }

    pub(super) fn merge(&mut self, other: Pass) {
        self.report.merge(other.report);
        self.again.extend(other.again);
        self.applied.extend(other.applied);
        self.dead_later.extend(other.dead_later);
    }

    /// Logs each applied event, once its transaction committed.
    pub(super) fn log_applied(&self, partition: i32) {
        for Applied { key, event_type } in &self.applied {
            let event_type = event_type.as_deref().unwrap_or("-");
            tracing::debug!(target: APPLIED_LOG, partition, key, event_type, "Applied an event.");
        }
    }
}
