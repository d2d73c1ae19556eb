//! An effect for tests of the deferral machinery, compiled in only with the `failpoints`
//! feature (as the test binaries are built) and registered as `ledger-after`.

use super::{Deferred, Effect, EffectError, Ledger, Tx};
use crate::envelope::Event;
use async_trait::async_trait;

/// A `ledger` row, deferred while the event named in the payload's `after` field has no
/// `done` claim. The row has no guard of its own, so counting rows per key counts how many
/// times a deferred event was applied.
#[derive(Debug, Default, Clone, Copy)]
pub struct LedgerAfter;

#[async_trait]
impl Effect for LedgerAfter {
    fn name(&self) -> &'static str {
        "ledger-after"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        if let Some(after) = event.payload()?.get("after").and_then(|a| a.as_str()) {
            let done: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM processed_events \
                 WHERE event_key = $1 AND status = 'done')",
            )
            .bind(after)
            .fetch_one(&mut **tx)
            .await?;
            if !done {
                return Err(Deferred::new(format!("{after} is not applied yet")).into());
            }
        }
        Ledger.apply(tx, event).await
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({ "effect": "ledger-after" }))
    }
}
