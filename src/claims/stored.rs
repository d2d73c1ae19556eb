//! A claim as stored, read back (and locked) to run its effect again: the deferred applier's,
//! an operator's retry.

use super::ClaimStatus;
use crate::db::JsonText;
use crate::effect::DeferPolicy;
use crate::envelope::Event;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;

/// A due deferred claim, locked until the caller's transaction ends; None when it is not
/// deferred and due any more, or another worker holds it (`SKIP LOCKED`): that worker applies
/// it.
pub async fn lock_due(conn: &mut PgConnection, key: &str) -> sqlx::Result<Option<StoredClaim>> {
    sqlx::query_as!(
        StoredClaim,
        r#"SELECT source, event_type, received_at, payload AS "payload: JsonText", payload_sha256,
                  status AS "status: ClaimStatus", effect_spec, attempts, deadline_at, defer_policy,
                  route_key, deferred_reason, attributes
           FROM processed_events
           WHERE event_key = $1 AND status = 'deferred' AND due_at <= now()
           FOR UPDATE SKIP LOCKED"#,
        key
    )
    .fetch_optional(conn)
    .await
}

/// A claim as stored, for running its effect again.
#[derive(Debug)]
pub struct StoredClaim {
    pub source: String,
    pub event_type: Option<String>,
    pub received_at: Option<DateTime<Utc>>,
    /// None on a claim settled `done`, which keeps only the hash.
    pub payload: Option<JsonText>,
    pub payload_sha256: Vec<u8>,
    pub status: ClaimStatus,
    pub effect_spec: Option<serde_json::Value>,
    /// Effect attempts so far (deferrals included).
    pub attempts: i32,
    /// A deferred claim's deadline.
    pub deadline_at: Option<DateTime<Utc>>,
    /// The deferral policy stored when the claim was first deferred or failed.
    pub defer_policy: Option<serde_json::Value>,
    /// The route key the claim was stored by; the event is applied again under it.
    pub route_key: String,
    /// Why a deferred claim waits.
    pub deferred_reason: Option<String>,
    /// What the message said of the event beyond the envelope ([`Event::attributes`]).
    pub attributes: Option<serde_json::Value>,
}

impl StoredClaim {
    /// Whether the claim waits only because its source was paused ([`crate::sources`]): its
    /// effect has not run, so its first deferral by the effect is still to come.
    pub fn held(&self) -> bool {
        self.status == ClaimStatus::Deferred
            && self
                .deferred_reason
                .as_deref()
                .is_some_and(|r| r.starts_with(crate::sources::HELD_REASON))
    }

    /// The deferral policy stored on the claim; None on a claim settled before policies were
    /// stored.
    pub fn defer_policy(&self) -> Option<DeferPolicy> {
        serde_json::from_value(self.defer_policy.clone()?).ok()
    }

    /// The event the claim was made for, as stored.
    pub fn event(&self, key: &str) -> anyhow::Result<Event> {
        use anyhow::Context as _;
        let payload = self
            .payload
            .as_ref()
            .map(|json| json.0.clone())
            .with_context(|| format!("the claim of {key} did not keep its payload"))?;
        Ok(Event::stored(
            crate::envelope::EventKey::try_from(key.to_owned())?,
            self.source.clone(),
            self.event_type.clone(),
            self.received_at,
            payload,
            self.payload_sha256
                .clone()
                .try_into()
                .map_err(|_| anyhow::anyhow!("a stored payload hash is not 32 bytes"))?,
        )
        .routed(&self.route_key)?
        .with_attributes(crate::envelope::Attributes::from_json(
            self.attributes.as_ref(),
        )))
    }
}

/// Reads a claim and locks it until the caller's transaction ends.
pub async fn lock(conn: &mut PgConnection, key: &str) -> sqlx::Result<Option<StoredClaim>> {
    sqlx::query_as!(
        StoredClaim,
        r#"SELECT source, event_type, received_at, payload AS "payload: JsonText", payload_sha256,
                  status AS "status: ClaimStatus", effect_spec, attempts, deadline_at, defer_policy,
                  route_key, deferred_reason, attributes
           FROM processed_events WHERE event_key = $1 FOR UPDATE"#,
        key
    )
    .fetch_optional(conn)
    .await
}
