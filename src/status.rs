//! `replayproof status`: one screen for an operator. Lag per partition of the group, claims by
//! status, the outbox by state, the oldest due operation, dead letters and key conflicts.

use anyhow::Context as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use sqlx::PgPool;
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
    pub claims: Vec<(String, i64)>,
    pub outbox: Vec<(String, i64)>,
    pub oldest_due_seconds: f64,
    pub expired_leases: i64,
    pub dead_letters: i64,
    pub dead_letters_not_replayed: i64,
    pub key_conflicts: i64,
}

/// Where to read the group's lag from.
#[derive(Debug, Clone)]
pub struct KafkaTarget {
    pub brokers: String,
    pub topic: String,
    pub group: String,
    pub options: Vec<(String, String)>,
}

pub async fn gather(pool: &PgPool, kafka: Option<KafkaTarget>) -> anyhow::Result<Status> {
    let claims = sqlx::query_as(
        "SELECT status, count(*) FROM processed_events GROUP BY status ORDER BY status",
    )
    .fetch_all(pool)
    .await?;
    let gauges = crate::outbox::gauges(pool).await?;
    let (dead_letters, not_replayed, conflicts): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM dead_letters), \
                (SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL), \
                (SELECT count(*) FROM key_conflicts)",
    )
    .fetch_one(pool)
    .await?;
    let mut status = Status {
        claims,
        outbox: gauges.by_state,
        oldest_due_seconds: gauges.oldest_due_seconds,
        expired_leases: gauges.expired_leases,
        dead_letters,
        dead_letters_not_replayed: not_replayed,
        key_conflicts: conflicts,
        ..Status::default()
    };
    if let Some(target) = kafka {
        status.topic = Some(target.topic.clone());
        status.group = Some(target.group.clone());
        status.lag = tokio::task::spawn_blocking(move || lag(&target)).await??;
    }
    Ok(status)
}

fn lag(target: &KafkaTarget) -> anyhow::Result<Vec<PartitionLag>> {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &target.brokers)
        .set("group.id", &target.group)
        .set("enable.auto.commit", "false");
    for (k, v) in &target.options {
        config.set(k, v);
    }
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

/// The screen, as text.
pub fn render(s: &Status) -> String {
    let mut out = String::new();
    if let (Some(topic), Some(group)) = (&s.topic, &s.group) {
        let total: i64 = s.lag.iter().map(|l| l.lag).sum();
        out += &format!("Kafka: topic {topic}, group {group}, total lag {total}\n");
        out += "  partition  committed  end  lag\n";
        for l in &s.lag {
            let committed = l.committed.map_or("-".into(), |c| c.to_string());
            out += &format!(
                "  {:>9}  {:>9}  {:>3}  {:>3}\n",
                l.partition, committed, l.high_watermark, l.lag
            );
        }
    }
    let counts = |rows: &[(String, i64)]| {
        if rows.is_empty() {
            "none".to_owned()
        } else {
            rows.iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    out += &format!("Claims: {}\n", counts(&s.claims));
    out += &format!("Outbox: {}\n", counts(&s.outbox));
    out += &format!(
        "Oldest due operation: {:.0} s; expired leases: {}\n",
        s.oldest_due_seconds, s.expired_leases
    );
    out += &format!(
        "Dead letters: {} ({} not replayed); key conflicts: {}\n",
        s.dead_letters, s.dead_letters_not_replayed, s.key_conflicts
    );
    out
}
