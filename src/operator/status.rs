//! `replayproof status`: one screen for an operator. Lag per partition of the group, claims by
//! status, deferred events (the oldest, the next due), the outbox by state, the oldest due
//! operation, dead letters, key conflicts and expired replays. The big tables are never counted
//! whole: done claims and operations, dead letters and key conflicts are counted exactly below
//! [`EXACT_BELOW`] rows and estimated from the tables' statistics past it (`~` in the text), or
//! said not analysed yet ([`super::counts`]).

pub use super::counts::EXACT_BELOW;
use super::counts::{Count, Counted};
use crate::db::Db;
use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;
use std::time::Duration;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PartitionLag {
    pub partition: i32,
    /// The group's committed offset; None when it has committed none.
    pub committed: Option<i64>,
    /// The partition's end.
    pub high_watermark: i64,
    pub lag: i64,
}

#[derive(Debug, Clone, Serialize, Default, PartialEq)]
pub struct Status {
    pub topic: Option<String>,
    pub group: Option<String>,
    pub lag: Vec<PartitionLag>,
    pub claims: Vec<(String, Count)>,
    /// Claims whose effect deferred, waiting to be applied.
    pub deferred: i64,
    /// Seconds since the oldest deferred claim was first deferred.
    pub oldest_deferred_seconds: f64,
    /// Seconds until the next deferred claim is due (negative: overdue).
    pub next_deferred_due_seconds: Option<f64>,
    pub outbox: Vec<(String, Count)>,
    pub oldest_due_seconds: f64,
    pub expired_leases: i64,
    pub dead_letters: Count,
    pub dead_letters_not_replayed: i64,
    pub key_conflicts: Count,
    /// Expired replays waiting for an operator (arrived after their key could be pruned).
    pub expired_replays: i64,
    /// Seconds since the oldest of them was caught.
    pub oldest_expired_replay_seconds: f64,
    /// The destinations whose breaker is not closed.
    pub open_breakers: Vec<OpenBreaker>,
    /// The Kafka output's backlog per output partition (every database's rows), with the
    /// partitions whose relay stopped.
    pub output: Vec<crate::output::store::Backlog>,
}

/// A destination whose circuit breaker is not closed.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct OpenBreaker {
    /// The destination's origin, any credential in it redacted.
    pub origin: String,
    /// `open` or `half_open`.
    pub breaker: String,
    /// Its requests in flight, from every dispatcher.
    pub in_flight: i64,
}

/// Where to read the group's lag from.
#[derive(Debug, Clone)]
pub struct KafkaTarget {
    pub brokers: String,
    pub topic: String,
    pub group: String,
    pub options: Vec<(String, String)>,
}

/// Reads the screen's numbers from PostgreSQL and, given a target, the group's lag from Kafka.
/// Reads the screen's numbers from every database (the shards, or the one database) and adds
/// them up, and, given a target, the group's lag from Kafka.
pub async fn gather(pools: &[Db], kafka: Option<KafkaTarget>) -> anyhow::Result<Status> {
    let mut status = Status::default();
    for pool in pools {
        status.add(of_database(pool).await?);
    }
    status.open_breakers = open_breakers(pools).await?;
    for pool in pools {
        status
            .output
            .extend(crate::output::store::backlog(pool).await?);
    }
    if let Some(target) = kafka {
        status.topic = Some(target.topic.clone());
        status.group = Some(target.group.clone());
        status.lag = tokio::task::spawn_blocking(move || lag(&target)).await??;
    }
    Ok(status)
}

impl Status {
    /// Adds another database's numbers: counts add up, the oldest ages and the soonest due
    /// time win.
    fn add(&mut self, other: Status) {
        fn add_counts(mine: &mut Vec<(String, Count)>, theirs: Vec<(String, Count)>) {
            for (name, n) in theirs {
                match mine.iter_mut().find(|(m, _)| *m == name) {
                    Some((_, count)) => *count = *count + n,
                    None => mine.push((name, n)),
                }
            }
            mine.sort_by(|a, b| a.0.cmp(&b.0));
        }
        add_counts(&mut self.claims, other.claims);
        add_counts(&mut self.outbox, other.outbox);
        self.deferred += other.deferred;
        self.oldest_deferred_seconds = self
            .oldest_deferred_seconds
            .max(other.oldest_deferred_seconds);
        self.next_deferred_due_seconds = match (
            self.next_deferred_due_seconds,
            other.next_deferred_due_seconds,
        ) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.oldest_due_seconds = self.oldest_due_seconds.max(other.oldest_due_seconds);
        self.expired_leases += other.expired_leases;
        self.dead_letters = self.dead_letters + other.dead_letters;
        self.dead_letters_not_replayed += other.dead_letters_not_replayed;
        self.key_conflicts = self.key_conflicts + other.key_conflicts;
        self.expired_replays += other.expired_replays;
        self.oldest_expired_replay_seconds = self
            .oldest_expired_replay_seconds
            .max(other.oldest_expired_replay_seconds);
    }
}

/// The destinations whose breaker is not closed: the breakers are kept on the first database,
/// the requests in flight counted on every one.
async fn open_breakers(pools: &[Db]) -> sqlx::Result<Vec<OpenBreaker>> {
    let home = crate::destinations::LimitsHome::over(pools, 0);
    let gauges = crate::destinations::destination_gauges(&home).await?;
    Ok(gauges
        .into_iter()
        .filter(|g| g.breaker.as_str() != "closed")
        .map(|g| OpenBreaker {
            origin: crate::secrets::redact_url(&g.origin),
            breaker: g.breaker.as_str().into(),
            in_flight: g.in_flight,
        })
        .collect())
}

/// One database's numbers.
async fn of_database(pool: &Db) -> anyhow::Result<Status> {
    let gauges = crate::outbox::gauges(pool).await?;
    let (_, not_replayed) = crate::claims::dead_letters::counts(pool).await?;
    let (deferred, oldest_deferred, next_due) =
        crate::claims::deferred_overview(pool, None).await?;
    let outbox = gauges.by_state.into_iter().map(|(s, n)| (s.to_string(), n));
    let (expired_replays, oldest_expired_replay_seconds) =
        crate::retention::expired::open_overview(pool).await?;
    let claims = crate::claims::counts(pool).await?;
    let status = Status {
        claims: with_done(pool, claims, Counted::DoneClaims).await?,
        deferred,
        oldest_deferred_seconds: oldest_deferred,
        next_deferred_due_seconds: next_due,
        outbox: with_done(pool, outbox.collect(), Counted::DoneOperations).await?,
        oldest_due_seconds: gauges.oldest_due_seconds,
        expired_leases: gauges.expired_leases,
        dead_letters: Counted::DeadLetters.in_database(pool, 0).await?,
        dead_letters_not_replayed: not_replayed,
        key_conflicts: Counted::KeyConflicts.in_database(pool, 0).await?,
        expired_replays,
        oldest_expired_replay_seconds,
        ..Status::default()
    };
    Ok(status)
}

/// Counts by state: those not done as counted through their index, and the done ones counted
/// (or, past [`EXACT_BELOW`], estimated) as `done`.
async fn with_done(
    pool: &Db,
    by_state: Vec<(String, i64)>,
    done: Counted,
) -> sqlx::Result<Vec<(String, Count)>> {
    let unsettled: Vec<(String, i64)> = by_state.into_iter().filter(|(s, _)| s != "done").collect();
    let others: i64 = unsettled.iter().map(|(_, n)| n).sum();
    let mut counts: Vec<(String, Count)> = unsettled
        .into_iter()
        .map(|(s, n)| (s, Count::Exact(n)))
        .collect();
    let done = done.in_database(pool, others).await?;
    if done.n() > 0 {
        counts.push(("done".into(), done));
    }
    counts.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(counts)
}

fn lag(target: &KafkaTarget) -> anyhow::Result<Vec<PartitionLag>> {
    let settings = [("enable.auto.commit", "false".into())];
    let config = crate::kafka::client_config(
        crate::kafka::Role::Reader,
        &target.brokers,
        Some(&target.group),
        &settings,
        &target.options,
    )?;
    let consumer: BaseConsumer = config.create().context("creating a Kafka client")?;
    let timeout = Duration::from_secs(10);
    let metadata = consumer
        .fetch_metadata(Some(&target.topic), timeout)
        .context("reading the topic's metadata")?;
    let topic = metadata
        .topics()
        .first()
        .context("the broker returned no topic")?;
    anyhow::ensure!(
        topic.error().is_none() && !topic.partitions().is_empty(),
        "the topic {} does not exist",
        target.topic
    );
    let mut tpl = TopicPartitionList::new();
    for p in topic.partitions() {
        tpl.add_partition(&target.topic, p.id());
    }
    let committed = consumer
        .committed_offsets(tpl, timeout)
        .context("reading the group's offsets")?;
    let mut lags = Vec::new();
    for p in topic.partitions() {
        let (_, high) = consumer.fetch_watermarks(&target.topic, p.id(), timeout)?;
        let committed = match committed
            .find_partition(&target.topic, p.id())
            .map(|e| e.offset())
        {
            Some(Offset::Offset(o)) => Some(o),
            _ => None,
        };
        let lag = high - committed.unwrap_or(0);
        lags.push(PartitionLag {
            partition: p.id(),
            committed,
            high_watermark: high,
            lag,
        });
    }
    lags.sort_by_key(|l| l.partition);
    Ok(lags)
}
