//! `events apply-expired` and `events drop-expired`: an operator's decision on an expired
//! replay (an event that arrived after its key could have been pruned). Applying it claims its
//! key and runs its effect once, in one transaction, as a retry of a failed claim does; dropping
//! it settles it without an effect. Both are audited.

use super::events::run_again;
use super::{Act, Change, OperatorError};
use crate::claims::{self, Failure, Origin};
use crate::db::Db;
use crate::effect::{DeferPolicy, Effect, Registry};
use crate::envelope::{Event, EventKey};
use crate::retention::expired::{self, Locked};
use std::sync::Arc;

/// Applies the expired replay of `key` once: claims the key (failing if something claimed it
/// since) and runs the effect it was caught with, or `given`.
pub async fn apply(
    pool: &Db,
    registry: &Registry,
    key: &str,
    given: Option<Arc<dyn Effect>>,
    act: &Act,
) -> Result<Vec<Change>, OperatorError> {
    let mut tx = pool.begin().await?;
    let open = expired::lock_open(&mut tx, key).await?;
    let first = open
        .first()
        .ok_or_else(|| OperatorError::NoExpiredReplay(key.into()))?;
    let event = event_of(first)?;
    let origin = Origin {
        topic: &first.kafka_topic,
        partition: first.kafka_partition,
    };
    if claims::claim(&mut tx, origin, &[(first.kafka_offset, &event)])
        .await?
        .keys
        .is_empty()
    {
        return Err(OperatorError::ClaimedSince(key.into()));
    }
    let failure = Failure {
        event: &event,
        attempts: 0,
        error: "an expired replay, applied by an operator".into(),
        policy: DeferPolicy::default(),
    };
    claims::fail(&mut tx, &[failure], first.effect_spec.as_ref()).await?;
    let claim = claims::lock(&mut tx, key)
        .await?
        .ok_or_else(|| OperatorError::NoSuchEvent(key.into()))?;
    let ran = run_again(&mut tx, registry, key, &claim, given, act, "apply-expired").await?;
    let ids: Vec<i64> = open.iter().map(|o| o.id).collect();
    expired::resolve(&mut tx, &ids, "applied").await?;
    tx.commit().await?;
    ran.answer(key)
}

/// Drops the expired replays of `key`: no effect, audited.
pub async fn drop(pool: &Db, key: &str, act: &Act) -> Result<Vec<Change>, OperatorError> {
    let mut tx = pool.begin().await?;
    let open = expired::lock_open(&mut tx, key).await?;
    if open.is_empty() {
        return Err(OperatorError::NoExpiredReplay(key.into()));
    }
    let ids: Vec<i64> = open.iter().map(|o| o.id).collect();
    expired::resolve(&mut tx, &ids, "dropped").await?;
    let change = Change::new(key, "expired", "dropped");
    crate::audit::record(&mut tx, act.audit("drop-expired", &change)).await?;
    tx.commit().await?;
    Ok(vec![change])
}

fn event_of(row: &Locked) -> Result<Event, OperatorError> {
    let payload = row
        .payload
        .as_ref()
        .map(|json| json.0.clone())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "the expired replay of {} no longer keeps its payload",
                row.event_key
            )
        })?;
    let hash: [u8; 32] = row
        .payload_sha256
        .as_slice()
        .try_into()
        .map_err(|_| anyhow::anyhow!("a stored payload hash is not 32 bytes"))?;
    let key = EventKey::try_from(row.event_key.clone()).map_err(anyhow::Error::from)?;
    Event::stored(
        key,
        row.source.clone(),
        row.event_type.clone(),
        row.received_at,
        payload,
        hash,
    )
    .routed(&row.route_key)
    .map(|event| {
        event.with_attributes(crate::envelope::Attributes::from_json(
            row.attributes.as_ref(),
        ))
    })
    .map_err(|e| anyhow::anyhow!(e).into())
}
