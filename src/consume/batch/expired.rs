//! Expired replays: events whose key is unknown and that happened before their source's prune
//! horizon, so their claim may have been pruned. They are recorded, not applied (see
//! [`crate::retention::expired`] for why none slips between this check and the claim).

use super::{BatchProcessor, BatchReport, Outcome, RunError};
use crate::claims::Origin;
use crate::envelope::Event;
use crate::retention::expired::{self, Caught};
use sqlx::{Postgres, Transaction};

impl BatchProcessor {
    /// Takes the expired replays out of `firsts`, records them, and counts them in `report`.
    pub(super) async fn sort_out_expired(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        origin: Origin<'_>,
        firsts: &mut Vec<(i64, &Event)>,
        report: &mut BatchReport,
    ) -> Result<(), RunError> {
        let mut sources: Vec<&str> = firsts
            .iter()
            .filter(|(_, e)| e.occurred_at.is_some())
            .map(|(_, e)| e.source.as_str())
            .collect();
        if sources.is_empty() {
            return Ok(());
        }
        sources.sort_unstable();
        sources.dedup();
        let horizons = expired::horizons(tx, &sources).await?;
        let older = |e: &Event| {
            let before = horizons.get(&e.source)?;
            e.occurred_at.filter(|at| at < before).map(|_| *before)
        };
        let candidates: Vec<(&str, &str)> = firsts
            .iter()
            .filter(|(_, e)| older(e).is_some())
            .map(|(_, e)| (e.key.as_str(), e.route_key()))
            .collect();
        if candidates.is_empty() {
            return Ok(());
        }
        let known = expired::lock_known(tx, &candidates).await?;
        let mut caught = Vec::new();
        firsts.retain(|(offset, e)| match older(e) {
            Some(expired_before) if !known.contains(e.key.as_str()) => {
                caught.push(Caught {
                    offset: *offset,
                    event: e,
                    expired_before,
                });
                false
            }
            _ => true,
        });
        if !caught.is_empty() {
            expired::record(tx, origin, &caught, self.effect.spec().as_ref()).await?;
        }
        for c in &caught {
            report.tally(&c.event.source, Outcome::ExpiredReplay);
        }
        Ok(())
    }
}
