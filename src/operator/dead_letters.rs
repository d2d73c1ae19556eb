//! `dead-letters list`, `show` and `replay`.
//!
//! A replay takes the letter's bytes, produces them, then marks the letter replayed: no row lock
//! is held while Kafka is waited on. Two operators replaying the same letter at once both
//! produce it; the consumer treats the second copy as the redelivery it is.

use super::{Act, Change, OperatorError};
use crate::claims::dead_letters::{self, DeadLetterRow, RawLetter};
use sqlx::PgPool;
use std::future::Future;

/// The newest dead letters first.
pub async fn list(pool: &PgPool, limit: i64) -> Result<Vec<DeadLetterRow>, OperatorError> {
    Ok(dead_letters::list(pool, limit).await?)
}

/// One dead letter with its raw key and value.
pub async fn show(pool: &PgPool, id: i64) -> Result<DeadLetterRow, OperatorError> {
    dead_letters::find(pool, id)
        .await?
        .ok_or(OperatorError::NoSuchDeadLetter(id))
}

/// Produces a dead letter again with `produce` (which answers the topic it produced to), then
/// marks it replayed with its audit row. If producing fails, nothing is marked.
pub async fn replay<F, Fut>(
    pool: &PgPool,
    id: i64,
    act: &Act,
    produce: F,
) -> Result<Vec<Change>, OperatorError>
where
    F: FnOnce(RawLetter) -> Fut,
    Fut: Future<Output = anyhow::Result<String>>,
{
    let letter = dead_letters::take(pool, id)
        .await?
        .ok_or(OperatorError::NoSuchDeadLetter(id))?;
    let before = if letter.replayed { "replayed" } else { "dead" };
    let to = produce(letter).await?;
    let target = format!("dead_letter:{id}");
    let mut tx = pool.begin().await?;
    if !dead_letters::mark_replayed(&mut tx, id).await? {
        return Err(OperatorError::NoSuchDeadLetter(id));
    }
    let audited = Change::new(&target, before, format!("replayed to {to}"));
    crate::audit::record(&mut tx, act.audit("replay", &audited)).await?;
    tx.commit().await?;
    Ok(vec![Change::new(&target, before, "replayed")])
}
