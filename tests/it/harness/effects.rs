//! Effects the tests share.

use replayproof::effect::{Effect, EffectError, Ledger, Tx};
use replayproof::envelope::Event;

/// The ledger and one outbox operation per event.
pub struct LedgerAndOutbox;

#[replayproof::async_trait]
impl Effect for LedgerAndOutbox {
    fn name(&self) -> &'static str {
        "ledger-and-outbox"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        Ledger.apply_batch(tx, events).await?;
        let outbox = replayproof::effect::HttpOutbox {
            target_url: "http://127.0.0.1:9/ops".into(),
            reconcile_url: None,
            max_attempts: 3,
            operation_keys: Default::default(),
        };
        outbox.apply_batch(tx, events).await
    }
}
