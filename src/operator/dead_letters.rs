//! `dead-letters list`, `show` and `replay`.
//!
//! A replay takes the letter's bytes, produces them, then marks the letter replayed: no row lock
//! is held while Kafka is waited on. Two operators replaying the same letter at once both
//! produce it; the consumer treats the second copy as the redelivery it is.

use super::{Act, Change, OperatorError};
use crate::claims::dead_letters::{self, DeadLetterRow, LetterSearch, RawLetter};
use crate::db::Db;
use std::future::Future;

/// Puts dead letters back on a topic: their own, or the one given.
pub struct LetterProducer {
    producer: rdkafka::producer::FutureProducer,
    topic: Option<String>,
}

impl LetterProducer {
    /// A producer to `brokers` with the librdkafka `options`; `topic` replaces each letter's own.
    pub fn new(
        brokers: &str,
        options: &[(String, String)],
        topic: Option<String>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            producer: crate::kafka::producer(brokers, options)?,
            topic,
        })
    }

    /// Produces `letter`'s bytes and answers the topic it went to, once the broker acknowledged.
    pub async fn produce(&self, letter: RawLetter) -> anyhow::Result<String> {
        let topic = self.topic.clone().unwrap_or(letter.topic);
        let (key, value) = (letter.key.as_deref(), letter.value.as_deref());
        let headers =
            crate::inputs::Headers::from_stored(letter.headers.as_deref().unwrap_or_default());
        crate::kafka::produce_raw(&self.producer, &topic, key, value, &headers).await?;
        Ok(topic)
    }
}

/// The dead letters a bulk replay takes: never replayed, matching `search`, newest first.
pub async fn to_replay(
    pool: &Db,
    search: &LetterSearch,
) -> Result<Vec<DeadLetterRow>, OperatorError> {
    let search = LetterSearch {
        not_replayed: true,
        ..search.clone()
    };
    Ok(dead_letters::search(pool, &search).await?)
}

/// What a bulk replay did: the changes, and the letters it could not replay with why.
#[derive(Debug, Default, serde::Serialize)]
pub struct Replayed {
    pub changes: Vec<Change>,
    pub refused: Vec<(i64, String)>,
}

/// Replays each of `ids` as [`replay`] does, one at a time, each audited; one that fails is
/// reported and the rest go on.
pub async fn replay_many(pool: &Db, ids: &[i64], act: &Act, producer: &LetterProducer) -> Replayed {
    let mut done = Replayed::default();
    for &id in ids {
        match replay(pool, id, act, |letter| producer.produce(letter)).await {
            Ok(changes) => done.changes.extend(changes),
            Err(e) => done.refused.push((id, format!("{e:#}"))),
        }
    }
    done
}

/// The newest dead letters first.
pub async fn list(pool: &Db, limit: i64) -> Result<Vec<DeadLetterRow>, OperatorError> {
    Ok(dead_letters::list(pool, limit).await?)
}

/// One dead letter with its raw key and value.
pub async fn show(pool: &Db, id: i64) -> Result<DeadLetterRow, OperatorError> {
    dead_letters::find(pool, id)
        .await?
        .ok_or(OperatorError::NoSuchDeadLetter(id))
}

/// Produces a dead letter again with `produce` (which answers the topic it produced to), then
/// marks it replayed with its audit row. If producing fails, nothing is marked.
pub async fn replay<F, Fut>(
    pool: &Db,
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
    if letter.erased {
        return Err(OperatorError::LetterErased(id));
    }
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
