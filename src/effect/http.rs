//! The built-in `http` effect: an outbox operation per event, delivered later by `dispatch`.

use super::obligation::{Obligation, OperationKeys};
use super::{Effect, EffectError, Tx};
use crate::envelope::{Event, OperationKeyed};
use anyhow::Context as _;
use async_trait::async_trait;

/// The built-in outbox effect: one `deliver` operation per event, a POST of the event's
/// envelope to a fixed URL, enqueued with the claim and sent later by `replayproof dispatch`.
/// Keyed by its event, or by the obligation the event names when its source has an
/// `operation_key` ([`OperationKeys`]): then a later event naming the same obligation enqueues
/// nothing.
#[derive(Debug, Clone)]
pub struct HttpOutbox {
    /// Where each event's envelope is POSTed.
    pub target_url: String,
    /// A URL template with `{key}` where the operation key goes; a GET answering 2xx means the
    /// downstream already has the operation, 404 that it does not.
    pub reconcile_url: Option<String>,
    /// Attempts before an operation is `dead`.
    pub max_attempts: i32,
    /// Where each source's events name the obligation they fulfil.
    pub operation_keys: OperationKeys,
}

/// The name of the `http` effect's one operation per event.
const DELIVER: &str = "deliver";

#[async_trait]
impl Effect for HttpOutbox {
    fn name(&self) -> &'static str {
        "http"
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.apply_batch(tx, &[event]).await
    }

    /// One statement for the whole batch; each request body is the event's envelope, its
    /// payload copied as it arrived.
    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        let named: Vec<Obligation> = events.iter().map(|e| self.operation_keys.of(e)).collect();
        let ops: Vec<_> = events
            .iter()
            .zip(&named)
            .map(|(event, obligation)| self.operation(event, obligation))
            .collect();
        let enqueued = crate::outbox::enqueue_all(tx, &ops).await?;
        let fulfilled: std::collections::HashSet<&str> = enqueued
            .fulfilled
            .iter()
            .map(|f| f.event_key.as_str())
            .collect();
        for (event, obligation) in events.iter().zip(&named) {
            let keyed = match obligation {
                Obligation::None => continue,
                Obligation::Missing => OperationKeyed::Fallback,
                Obligation::Named(_) if fulfilled.contains(event.key.as_str()) => {
                    OperationKeyed::Fulfilled
                }
                Obligation::Named(_) => OperationKeyed::Obligation,
            };
            event.note_keyed(DELIVER, keyed);
        }
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "effect": "http",
            "target_url": self.target_url,
            "reconcile_url": self.reconcile_url,
            "max_attempts": self.max_attempts,
            "operation_keys": self.operation_keys,
        }))
    }
}

impl HttpOutbox {
    /// Builds the effect again from its [`Effect::spec`].
    pub fn from_spec(spec: &serde_json::Value) -> anyhow::Result<Self> {
        let field = |name: &str| spec.get(name).and_then(serde_json::Value::as_str);
        Ok(Self {
            target_url: field("target_url")
                .context("an http effect spec names its target_url")?
                .to_owned(),
            reconcile_url: field("reconcile_url").map(str::to_owned),
            max_attempts: spec
                .get("max_attempts")
                .and_then(serde_json::Value::as_i64)
                .and_then(|n| i32::try_from(n).ok())
                .context("an http effect spec names its max_attempts")?,
            operation_keys: match spec.get("operation_keys") {
                Some(keys) => serde_json::from_value(keys.clone())
                    .context("an http effect spec's operation_keys")?,
                None => OperationKeys::default(),
            },
        })
    }

    /// The `deliver` operation of `event`: keyed by the obligation it names, if any.
    fn operation<'e>(
        &'e self,
        event: &'e Event,
        obligation: &Obligation,
    ) -> crate::outbox::NewOperation<'e> {
        let op = crate::outbox::NewOperation {
            reconcile_url: self.reconcile_url.clone(),
            max_attempts: self.max_attempts,
            ..crate::outbox::NewOperation::of_event(
                event,
                DELIVER,
                &self.target_url,
                event.envelope_bytes(),
            )
        };
        match obligation {
            Obligation::Named(obligation) => op.obligation(&event.source, obligation),
            Obligation::None | Obligation::Missing => op,
        }
    }
}
