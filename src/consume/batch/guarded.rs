//! The guarded application of a batch's effect: after a savepoint, in parts, a failing part
//! rolled back to it and halved until the events that fail alone are found.

use super::{BatchProcessor, RunError};
use crate::effect::{Effect, EffectError};
use crate::envelope::Event;
use sqlx::{Postgres, Transaction};

/// A guarded pass applies its events in parts of at most this many, each after its savepoint:
/// a part that fails undoes only its own work before it is halved, where a whole batch of 500
/// would write and undo 500 effects (with 2 KiB payloads, that undone work costs more than the
/// round trips the extra parts take).
const GUARDED_PART: usize = 128;

/// A claimed event whose effect did not apply, with its answer.
pub(super) struct EffectFailure<'e> {
    pub(super) offset: i64,
    pub(super) event: &'e Event,
    pub(super) error: EffectError,
}

/// The savepoint a guarded pass applies parts of its batch after, one at a time. It is taken
/// once; a failed attempt rolls back to it, which keeps it; the work of a successful attempt is
/// released into the transaction, and the savepoint taken again, in the same round trip as the
/// next attempt needs anyway. An attempt costs two round trips, not three.
pub(super) struct Savepoint {
    /// The work since the savepoint applied and is to be kept.
    holds_work: bool,
}

impl Savepoint {
    const TAKE: &'static str = "SAVEPOINT replayproof_part";
    const KEEP_AND_TAKE: &'static str =
        "RELEASE SAVEPOINT replayproof_part; SAVEPOINT replayproof_part";
    const UNDO: &'static str = "ROLLBACK TO SAVEPOINT replayproof_part";

    pub(super) async fn establish(
        tx: &mut Transaction<'static, Postgres>,
    ) -> Result<Self, RunError> {
        sqlx::Executor::execute(&mut **tx, Self::TAKE).await?;
        Ok(Self { holds_work: false })
    }

    /// Applies `part`: None when it applied, or the error it failed with (its work undone). A
    /// transient failure ends the run. Work kept is never undone by a later attempt; it commits
    /// with the transaction (the savepoint needs no release for that).
    pub(super) async fn attempt(
        &mut self,
        tx: &mut Transaction<'static, Postgres>,
        effect: &dyn Effect,
        part: &[(i64, &Event)],
    ) -> Result<Option<EffectError>, RunError> {
        if std::mem::take(&mut self.holds_work) {
            // Text without parameters goes as one simple query: both statements, one round trip.
            sqlx::Executor::execute(&mut **tx, Self::KEEP_AND_TAKE).await?;
        }
        let batch: Vec<&Event> = part.iter().map(|(_, e)| *e).collect();
        match effect.apply_batch(tx, &batch).await {
            Ok(()) => {
                self.holds_work = true;
                Ok(None)
            }
            Err(error) => {
                sqlx::Executor::execute(&mut **tx, Self::UNDO).await?;
                match error.is_transient() {
                    true => Err(RunError::Transient(error)),
                    false => Ok(Some(error)),
                }
            }
        }
    }
}

impl BatchProcessor {
    /// Applies the effect to the claimed events with one call per batch. Guarded, it runs in a
    /// savepoint, and when it fails the part is split in halves, each applied after a savepoint,
    /// until the events that fail alone are found; they are returned with their
    /// errors and everything else stays applied. Unguarded, a failure ends the
    /// run ([`RunError::Unguarded`]). A transient failure ends the run either way.
    pub(super) async fn apply_splitting<'e>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        events: &[(i64, &'e Event)],
        guarded: bool,
    ) -> Result<Vec<EffectFailure<'e>>, RunError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        if !guarded {
            let batch: Vec<&Event> = events.iter().map(|(_, e)| *e).collect();
            return match self.effect.apply_batch(tx, &batch).await {
                Ok(()) => Ok(Vec::new()),
                Err(e) if e.is_transient() => Err(RunError::Transient(e)),
                Err(_) => Err(RunError::Unguarded),
            };
        }
        let mut failures = Vec::new();
        let mut savepoint = Savepoint::establish(tx).await?;
        // Each part with whether it is known to fail: a failing part whose left half applies
        // holds its failure in the right half, which is then split without being tried whole.
        // Parts start at most GUARDED_PART events long, so a failure undoes little work. Popped
        // from the end: pushed last to first.
        let mut parts: Vec<_> = events
            .chunks(GUARDED_PART)
            .rev()
            .map(|p| (p, false))
            .collect();
        while let Some((part, known_to_fail)) = parts.pop() {
            let (tried, rest) = match part {
                [] => continue,
                [_, _, ..] if known_to_fail => part.split_at(part.len() / 2),
                _ => (part, &part[part.len()..]),
            };
            match savepoint.attempt(tx, &*self.effect, tried).await? {
                None => parts.push((rest, true)),
                Some(error) => {
                    parts.push((rest, false));
                    match tried {
                        [(offset, event)] => failures.push(EffectFailure {
                            offset: *offset,
                            event,
                            error,
                        }),
                        _ => parts.push((tried, true)),
                    }
                }
            }
        }
        Ok(failures)
    }
}
