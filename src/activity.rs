//! What the consumers did, minute by minute: events applied, duplicates suppressed, dead
//! letters, and each partition's lag, for the console's charts of the last hour. All SQL for
//! `activity_minutes` (on the first database) is here.
//!
//! A consumer counts into its [`Activity`] as its batches commit and as librdkafka reports lag,
//! and [`Activity::run`] adds the counts to the table every [`FLUSH_EVERY`], out of the
//! batches' transactions: a chart costs the claims nothing. The counts are a picture, not a
//! ledger: a consumer killed loses at most its last few seconds of counts, and a batch read
//! again after a crash counts again (its events as duplicates).

use crate::db::Db;
use chrono::{DateTime, DurationRound, Utc};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The partition the deferred applier's events count under: it reads no partition.
pub const DEFERRED_APPLIER: i32 = -1;
/// How often a consumer adds its counts to the table.
pub const FLUSH_EVERY: Duration = Duration::from_secs(5);
/// How long rows are kept.
const KEPT: chrono::Duration = chrono::Duration::days(1);

/// One partition's minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counts {
    pub applied: i64,
    pub suppressed: i64,
    pub dead_letters: i64,
    /// The last lag read in the minute, if any was.
    pub lag: Option<i64>,
}

impl Counts {
    fn add(&mut self, other: Counts) {
        self.applied += other.applied;
        self.suppressed += other.suppressed;
        self.dead_letters += other.dead_letters;
        self.lag = other.lag.or(self.lag);
    }
}

/// A consumer's counts not yet written, by partition and minute; cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Activity(Arc<Mutex<Pending>>);

/// Counts by partition and minute.
type Pending = BTreeMap<(i32, DateTime<Utc>), Counts>;

/// The minute `at` falls in.
fn minute_of(at: DateTime<Utc>) -> DateTime<Utc> {
    at.duration_trunc(chrono::Duration::minutes(1))
        .unwrap_or(at)
}

impl Activity {
    fn add(&self, partition: i32, counts: Counts) {
        let minute = minute_of(Utc::now());
        let mut pending = self.0.lock().expect("activity lock");
        pending.entry((partition, minute)).or_default().add(counts);
    }

    /// A batch of `partition` committed.
    pub fn batch(&self, partition: i32, applied: usize, suppressed: usize, dead_letters: usize) {
        let counts = Counts {
            applied: applied as i64,
            suppressed: suppressed as i64,
            dead_letters: dead_letters as i64,
            lag: None,
        };
        self.add(partition, counts);
    }

    /// `partition`'s lag was read.
    pub fn lag(&self, partition: i32, lag: i64) {
        let counts = Counts {
            lag: Some(lag),
            ..Counts::default()
        };
        self.add(partition, counts);
    }

    fn take(&self) -> Pending {
        std::mem::take(&mut *self.0.lock().expect("activity lock"))
    }

    /// Adds the counts to `topic`'s rows on `first`, in one statement; kept for the next try
    /// when it fails.
    pub async fn flush(&self, first: &Db, topic: &str) -> sqlx::Result<()> {
        let taken = self.take();
        if taken.is_empty() {
            return Ok(());
        }
        match write(first, topic, &taken).await {
            Ok(()) => Ok(()),
            Err(e) => {
                for ((partition, minute), counts) in taken {
                    let mut pending = self.0.lock().expect("activity lock");
                    let kept = pending.entry((partition, minute)).or_default();
                    let newer = *kept;
                    *kept = counts;
                    kept.add(newer);
                }
                Err(e)
            }
        }
    }

    /// Flushes every [`FLUSH_EVERY`] until `stop`, then once more.
    pub async fn run(self, first: Db, topic: String, stop: CancellationToken) {
        loop {
            let stopped = tokio::select! {
                _ = stop.cancelled() => true,
                _ = tokio::time::sleep(FLUSH_EVERY) => false,
            };
            if let Err(e) = self.flush(&first, &topic).await {
                tracing::debug!(error = %e, "Could not write the consumer's activity; kept for the next try.");
            }
            if stopped {
                return;
            }
        }
    }
}

async fn write(first: &Db, topic: &str, taken: &Pending) -> sqlx::Result<()> {
    let (mut partitions, mut minutes) = (Vec::new(), Vec::new());
    let (mut applied, mut suppressed, mut dead, mut lag) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ((partition, minute), c) in taken {
        partitions.push(*partition);
        minutes.push(*minute);
        applied.push(c.applied);
        suppressed.push(c.suppressed);
        dead.push(c.dead_letters);
        lag.push(c.lag);
    }
    sqlx::query!(
        "INSERT INTO activity_minutes \
             (topic, partition, minute, applied, suppressed, dead_letters, lag) \
         SELECT $1, * FROM UNNEST($2::int4[], $3::timestamptz[], $4::int8[], $5::int8[], \
             $6::int8[], $7::int8[]) \
         ON CONFLICT (topic, minute, partition) DO UPDATE SET \
             applied = activity_minutes.applied + excluded.applied, \
             suppressed = activity_minutes.suppressed + excluded.suppressed, \
             dead_letters = activity_minutes.dead_letters + excluded.dead_letters, \
             lag = coalesce(excluded.lag, activity_minutes.lag)",
        topic,
        &partitions,
        &minutes,
        &applied,
        &suppressed,
        &dead,
        &lag as &[Option<i64>],
    )
    .execute(first)
    .await?;
    let horizon = Utc::now() - KEPT;
    sqlx::query!(
        "DELETE FROM activity_minutes WHERE topic = $1 AND minute < $2",
        topic,
        horizon
    )
    .execute(first)
    .await?;
    Ok(())
}

/// One minute of a topic's activity, as the console draws it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Minute {
    pub minute: DateTime<Utc>,
    /// Summed over the partitions.
    pub total: Counts,
    /// Each partition's lag, the last read in the minute.
    pub lag: BTreeMap<i32, i64>,
}

/// `topic`'s minutes since `since` (None: every topic's), oldest first; minutes nothing was
/// recorded in are absent.
pub async fn since(
    first: &Db,
    topic: Option<&str>,
    since: DateTime<Utc>,
) -> sqlx::Result<Vec<Minute>> {
    let rows = sqlx::query!(
        r#"SELECT minute, partition, applied, suppressed, dead_letters, lag
           FROM activity_minutes WHERE ($1::text IS NULL OR topic = $1) AND minute >= $2
           ORDER BY minute, partition"#,
        topic,
        since
    )
    .fetch_all(first)
    .await?;
    let mut minutes: Vec<Minute> = Vec::new();
    for r in rows {
        if minutes.last().is_none_or(|m| m.minute != r.minute) {
            let (minute, total, lag) = (r.minute, Counts::default(), BTreeMap::new());
            minutes.push(Minute { minute, total, lag });
        }
        let m = minutes.last_mut().expect("pushed");
        let counts = Counts {
            applied: r.applied,
            suppressed: r.suppressed,
            dead_letters: r.dead_letters,
            lag: None,
        };
        m.total.add(counts);
        if let Some(lag) = r.lag {
            *m.lag.entry(r.partition).or_default() += lag;
        }
    }
    Ok(minutes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_keep_the_last_lag() {
        let activity = Activity::default();
        activity.batch(0, 5, 2, 1);
        activity.lag(0, 40);
        activity.batch(0, 1, 0, 0);
        activity.lag(1, 7);
        let taken = activity.take();
        let zero: Vec<_> = taken.iter().filter(|((p, _), _)| *p == 0).collect();
        // Both may straddle a minute; summed over them the counts are the same.
        let applied: i64 = zero.iter().map(|(_, c)| c.applied).sum();
        let suppressed: i64 = zero.iter().map(|(_, c)| c.suppressed).sum();
        assert_eq!((applied, suppressed), (6, 2));
        assert!(zero.iter().any(|(_, c)| c.lag == Some(40)));
        assert!(activity.take().is_empty(), "taken once");
    }
}
