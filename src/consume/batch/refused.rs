//! Values PostgreSQL refuses (a data error, SQLSTATE classes 22 and 23): the batch is committed
//! part by part, halving a refused part, until each refused message is found and dead-lettered
//! with PostgreSQL's own message.

use super::{
    plan::Read, BatchError, BatchProcessor, BatchReport, DeadLettered, Pass, RawMessage, Run,
    RunError,
};
use crate::claims::dead_letters::{self, DeadLetter};
use crate::claims::Origin;
use std::collections::VecDeque;

impl BatchProcessor {
    /// Commits a refused batch part by part, in offset order: a part PostgreSQL refuses is
    /// halved, and a single refused message becomes a dead letter with PostgreSQL's message.
    /// Any other error stops the split; the parts that committed replay harmlessly.
    pub(super) async fn split_out_refused(
        &self,
        origin: Origin<'_>,
        messages: &[&Read<'_>],
        refusal: sqlx::Error,
        run: &Run<'_>,
    ) -> Result<Pass, BatchError> {
        let mut done = Pass::default();
        let mut parts = VecDeque::from([(messages, Some(refusal))]);
        while let Some((part, refusal)) = parts.pop_front() {
            let refusal = match refusal {
                Some(e) => e,
                None => match self.run_and_commit(origin, part, run).await {
                    Ok(pass) => {
                        done.merge(pass);
                        continue;
                    }
                    Err(RunError::Database(e)) if crate::db::is_data_error(&e) => e,
                    Err(e) => return Err(e.into()),
                },
            };
            match part {
                [read] => {
                    let letter = self
                        .dead_letter_refused(origin, read.message, &refusal)
                        .await?;
                    done.report.merge(letter);
                }
                _ => {
                    let (left, right) = part.split_at(part.len() / 2);
                    parts.push_front((right, None));
                    parts.push_front((left, None));
                }
            }
        }
        Ok(done)
    }

    /// Dead-letters one message whose rows PostgreSQL refused, with PostgreSQL's own message.
    async fn dead_letter_refused(
        &self,
        origin: Origin<'_>,
        message: &RawMessage,
        refusal: &sqlx::Error,
    ) -> Result<BatchReport, BatchError> {
        let reason = match refusal {
            sqlx::Error::Database(db) => format!(
                "PostgreSQL refused the event: {} (SQLSTATE {})",
                db.message(),
                db.code().as_deref().unwrap_or("?")
            ),
            e => format!("PostgreSQL refused the event: {e}"),
        };
        let letter = DeadLetter {
            offset: message.offset,
            key: message.key.as_deref(),
            value: message.value.as_deref(),
            headers: &message.headers,
            reason: reason.replace('\0', ""),
        };
        // Every dead letter is on the first shard (the only one, unless there are several).
        let mut tx = self.shards.first().begin().await?;
        dead_letters::insert(&mut tx, origin, std::slice::from_ref(&letter)).await?;
        tx.commit().await?;
        Ok(BatchReport {
            dead_letters: vec![DeadLettered::from(&letter)],
            ..BatchReport::default()
        })
    }
}
