//! Replays and captures: events whose key was claimed before (a duplicate, or a key conflict when
//! the payload differs), and signed bodies delivered again under another key within their replay
//! window.

use super::plan::Plan;
use super::{BatchProcessor, BatchReport, Outcome, RunError};
use crate::claims::{self, conflicts};
use crate::envelope::Event;
use sqlx::{Postgres, Transaction};
use std::collections::{HashMap, HashSet};

/// The claims found for keys of a batch: each key's route and payload hash.
pub(super) type Stored = HashMap<String, (String, Vec<u8>)>;

impl BatchProcessor {
    /// Takes out of `firsts` the replayed captures: guarded events whose signed body was first
    /// delivered under another key within the window. They are returned with the reason.
    pub(super) async fn sort_out_captures<'e>(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        firsts: &mut Vec<(i64, &'e Event)>,
    ) -> Result<Vec<conflicts::Conflict<'e>>, RunError> {
        let guarded: Vec<(i64, &Event)> = firsts
            .iter()
            .filter(|(_, e)| e.replay_window_secs.is_some())
            .copied()
            .collect();
        if guarded.is_empty() {
            return Ok(Vec::new());
        }
        let seen = conflicts::fingerprints(tx, &guarded).await?;
        let mut replays = Vec::new();
        firsts.retain(|(offset, e)| {
            let Some(window) = e.replay_window_secs else {
                return true;
            };
            let fingerprint = (e.source.clone(), e.payload_sha256.to_vec());
            match seen.get(&fingerprint) {
                Some((first_key, age)) if first_key != e.key.as_str() && *age <= window as f64 => {
                    replays.push((
                        *offset,
                        *e,
                        Some(format!(
                            "replayed capture: the same signed body was delivered as {first_key} \
                             {age:.0} s earlier (replay window {window} s)"
                        )),
                    ));
                    false
                }
                _ => true,
            }
        });
        Ok(replays)
    }

    /// Counts replays and records key conflicts: every event the claim statement was given
    /// (`asked`: the plan's firsts but for the captures and expired replays, already counted)
    /// that was not claimed here, and every later copy in the batch, is compared with the claim
    /// that won its key, by route and payload. `stored` holds the claims the claim statement
    /// found; a key claimed meanwhile by another transaction is looked up here.
    pub(super) async fn sort_out_replays(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        (plan, asked): (&Plan<'_>, &[(i64, &Event)]),
        claimed: &HashSet<String>,
        mut stored: Stored,
        report: &mut BatchReport,
    ) -> Result<(), RunError> {
        let raced: Vec<&str> = asked
            .iter()
            .map(|(_, e)| e.key.as_str())
            .filter(|k| !claimed.contains(*k) && !stored.contains_key(*k))
            .collect();
        let recorded = recorded_by_claim(asked, &stored);
        if !raced.is_empty() {
            stored.extend(claims::stored_hashes(tx, &raced).await?);
        }
        // The claim each loser is compared with: one made in this batch for a later copy of
        // its key, or the one stored before for a key not claimed here.
        let copied: HashSet<&str> = plan.copies.iter().map(|(_, e)| e.key.as_str()).collect();
        let mut winners: HashMap<&str, (&str, &[u8])> = asked
            .iter()
            .filter(|(_, e)| copied.contains(e.key.as_str()) && claimed.contains(e.key.as_str()))
            .map(|(_, e)| (e.key.as_str(), (e.route_key(), &e.payload_sha256[..])))
            .collect();
        winners.extend(
            stored
                .iter()
                .map(|(k, (r, h))| (k.as_str(), (r.as_str(), h.as_slice()))),
        );
        let losers = asked
            .iter()
            .filter(|(_, e)| !claimed.contains(e.key.as_str()))
            .chain(plan.copies.iter());
        let mut conflicts = Vec::new();
        // Every delivery of a claimed key, recorded for the claim that won it: the claim
        // statement recorded those of the keys it found, the rest are recorded here.
        let mut seen = Vec::new();
        for &(offset, event) in losers {
            let winner = winners.get(event.key.as_str()).copied();
            if winner.is_some() && !recorded.contains(&(offset, event.key.as_str())) {
                seen.push((event.key.as_str(), offset));
            }
            let outcome = compared(event, winner);
            report.tally(&event.source, outcome.0);
            if outcome.0 == Outcome::Conflict {
                conflicts.push((offset, event, outcome.1));
            }
        }
        if !conflicts.is_empty() {
            conflicts::record(tx, plan.origin, &conflicts).await?;
        }
        claims::deliveries::record(tx, plan.origin, &seen).await?;
        Ok(())
    }
}

/// The deliveries the claim statement recorded itself: those it was given (`asked`) whose key
/// it found claimed (`stored` before the keys raced are added to it).
fn recorded_by_claim<'m>(asked: &[(i64, &'m Event)], stored: &Stored) -> HashSet<(i64, &'m str)> {
    asked
        .iter()
        .filter(|(_, e)| stored.contains_key(e.key.as_str()))
        .map(|(offset, e)| (*offset, e.key.as_str()))
        .collect()
}

/// What an event not claimed here is, next to the claim that won its key: a duplicate, a key
/// conflict (another payload), or a key conflict because it came under another route (one event
/// never has two claims, whatever route a delivery names).
fn compared(event: &Event, winner: Option<(&str, &[u8])>) -> (Outcome, Option<String>) {
    match winner {
        Some((route, _)) if route != event.route_key() => (
            Outcome::Conflict,
            Some(format!(
                "route changed: the event is claimed under the route {route:?}, and this                  delivery names {:?}",
                event.route_key()
            )),
        ),
        Some((_, hash)) if hash[..] != event.payload_sha256[..] => (Outcome::Conflict, None),
        _ => (Outcome::Duplicate, None),
    }
}
