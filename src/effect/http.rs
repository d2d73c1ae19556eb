//! The built-in `http` effect: an outbox operation per event, delivered later by `dispatch`.

use super::{Effect, EffectError, Tx};
use crate::envelope::Event;
use anyhow::Context as _;
use async_trait::async_trait;

/// The built-in outbox effect: one `deliver` operation per event, a POST of the event's
/// envelope to a fixed URL, enqueued with the claim and sent later by `replayproof dispatch`.
#[derive(Debug, Clone)]
pub struct HttpOutbox {
    /// Where each event's envelope is POSTed.
    pub target_url: String,
    /// A URL template with `{key}` where the operation key goes; a GET answering 2xx means the
    /// downstream already has the operation, 404 that it does not.
    pub reconcile_url: Option<String>,
    /// Attempts before an operation is `dead`.
    pub max_attempts: i32,
}

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
        let ops: Vec<_> = events
            .iter()
            .map(|event| crate::outbox::NewOperation {
                reconcile_url: self.reconcile_url.clone(),
                max_attempts: self.max_attempts,
                ..crate::outbox::NewOperation::of_event(
                    event,
                    "deliver",
                    &self.target_url,
                    event.envelope_bytes(),
                )
            })
            .collect();
        crate::outbox::enqueue_all(tx, &ops).await?;
        Ok(())
    }

    fn spec(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "effect": "http",
            "target_url": self.target_url,
            "reconcile_url": self.reconcile_url,
            "max_attempts": self.max_attempts,
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
        })
    }
}
