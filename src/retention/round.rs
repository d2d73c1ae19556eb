//! One prune round, as `replayproof prune` and `consume --prune-interval` run it: decide each
//! source's retention, check it against its kind's floor and the topic's retention, then prune
//! (or, dry, count what would go).

use super::prune::{self, Pruned};
use super::{Decided, Lifetimes, Refusal};
use crate::db::Db;
use std::time::Duration;

/// How the topic's own retention is known.
#[derive(Debug, Clone)]
pub enum TopicRetention {
    /// Stated by the operator (`--topic-retention`, `--topic-segment`).
    Stated(super::TopicKeeps),
    /// Read from the broker (`retention.ms`, `segment.ms` and `cleanup.policy` of the topic).
    Broker {
        config: rdkafka::ClientConfig,
        topic: String,
    },
}

/// Everything a round needs.
#[derive(Debug, Clone)]
pub struct Pruner {
    pub pool: Db,
    pub lifetimes: Lifetimes,
    /// The topic the claims' events were read from.
    pub topic: String,
    pub topic_retention: TopicRetention,
    /// Prune under a retention below its kind's floor (audited every round).
    pub allow_below_floor: bool,
    /// Prune under a retention shorter than the topic's (audited every round).
    pub allow_below_topic_retention: bool,
    /// Rows one statement deletes at most.
    pub batch: i64,
    /// Who prunes, for the audit rows.
    pub actor: String,
}

/// Why a round did nothing.
#[derive(Debug, thiserror::Error)]
pub enum RoundError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error("the database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("{0:#}")]
    Unexpected(#[from] anyhow::Error),
}

/// What a round decided and did.
#[derive(Debug, Clone)]
pub struct Round {
    pub decided: Vec<Decided>,
    pub pruned: Pruned,
    pub dry_run: bool,
}

impl Pruner {
    /// Decides, checks and prunes; `dry_run` only counts.
    #[tracing::instrument(name = "prune", skip_all, fields(dry_run))]
    pub async fn round(&self, dry_run: bool) -> Result<Round, RoundError> {
        let seen = prune::sources(&self.pool).await?;
        let decided = self.lifetimes.decide(&seen, self.allow_below_floor)?;
        let below_topic = self.check_topic(&decided).await?;
        if dry_run {
            let pruned = prune::dry_run(&self.pool, &decided, &self.lifetimes).await?;
            return Ok(Round {
                decided,
                pruned,
                dry_run,
            });
        }
        self.audit_overrides(&decided, below_topic).await?;
        let mut pruned = Pruned::default();
        for d in &decided {
            prune::prune_source(&self.pool, d, self.batch, &mut pruned).await?;
        }
        let lifetimes = &self.lifetimes;
        prune::prune_by_age(&self.pool, &decided, lifetimes, self.batch, &mut pruned).await?;
        Ok(Round {
            decided,
            pruned,
            dry_run,
        })
    }

    /// Refuses a retention shorter than the topic's, unless allowed; returns whether one was.
    async fn check_topic(&self, decided: &[Decided]) -> Result<bool, RoundError> {
        let keeps = match &self.topic_retention {
            TopicRetention::Stated(stated) => *stated,
            TopicRetention::Broker { config, topic } => read_retention(config, topic).await?,
        };
        match super::check_topic(decided, &self.topic, keeps) {
            Ok(()) => Ok(false),
            Err(_) if self.allow_below_topic_retention => Ok(true),
            Err(refusal) => Err(refusal.into()),
        }
    }

    /// One audit row per override in force this round.
    async fn audit_overrides(&self, decided: &[Decided], below_topic: bool) -> sqlx::Result<()> {
        let mut conn = self.pool.begin().await?;
        for d in decided.iter().filter(|d| d.below_floor()) {
            let reason = format!(
                "--allow-below-floor: retention {} below the {} floor",
                humantime::format_duration(d.retention),
                humantime::format_duration(d.floor.unwrap_or_default())
            );
            self.audit(&mut conn, "prune.below_floor", &d.source, &reason)
                .await?;
        }
        if below_topic {
            let reason = "--allow-below-topic-retention: claims may go before the topic's messages";
            self.audit(
                &mut conn,
                "prune.below_topic_retention",
                &self.topic,
                reason,
            )
            .await?;
        }
        conn.commit().await
    }

    async fn audit(
        &self,
        conn: &mut sqlx::PgConnection,
        action: &str,
        target: &str,
        reason: &str,
    ) -> sqlx::Result<()> {
        let action = crate::audit::Action {
            actor: &self.actor,
            action,
            target,
            reason,
            before: "",
            after: "",
        };
        crate::audit::record(conn, action).await
    }
}

/// How long the topic keeps its records, from the broker's `retention.ms`, `segment.ms`
/// (Kafka's default when the broker does not say) and `cleanup.policy`.
async fn read_retention(
    config: &rdkafka::ClientConfig,
    topic: &str,
) -> anyhow::Result<super::TopicKeeps> {
    use anyhow::Context as _;
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        config.create().context("creating a Kafka admin client")?;
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let resource = ResourceSpecifier::Topic(topic);
    let results = admin
        .describe_configs([&resource], &options)
        .await
        .with_context(|| format!("reading the retention.ms of the topic {topic} from the broker (state it with --topic-retention when the broker cannot say)"))?;
    let config = results
        .into_iter()
        .next()
        .context("the broker returned no configuration")?
        .map_err(|code| anyhow::anyhow!("the broker refused to describe {topic}: {code}"))?;
    let value = |name: &str| config.get(name).and_then(|e| e.value.clone());
    let ms = |name: &str, text: String| -> anyhow::Result<i64> {
        text.parse()
            .with_context(|| format!("{name} of {topic} is {text:?}"))
    };
    let retention = value("retention.ms")
        .with_context(|| format!("the broker did not say the retention.ms of {topic}"))?;
    let retention = ms("retention.ms", retention)?;
    let segment = match value("segment.ms") {
        Some(text) => Duration::from_millis(ms("segment.ms", text)?.max(0) as u64),
        None => super::KAFKA_DEFAULT_SEGMENT,
    };
    let compacted = value("cleanup.policy").is_some_and(|p| p.contains("compact"));
    Ok(topic_keeps(retention, segment, compacted))
}

/// What a topic's settings mean for how long it keeps records.
fn topic_keeps(retention_ms: i64, segment: Duration, compacted: bool) -> super::TopicKeeps {
    match u64::try_from(retention_ms) {
        Ok(ms) if !compacted => super::TopicKeeps::For {
            retention: Duration::from_millis(ms),
            segment,
        },
        _ => super::TopicKeeps::Forever { compacted },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retention::TopicKeeps;

    #[test]
    fn a_compacted_or_unbounded_topic_keeps_records_for_ever() {
        let week = Duration::from_secs(7 * 24 * 3600);
        assert_eq!(
            topic_keeps(86_400_000, week, false),
            TopicKeeps::For {
                retention: Duration::from_secs(86_400),
                segment: week
            }
        );
        assert_eq!(
            topic_keeps(-1, week, false),
            TopicKeeps::Forever { compacted: false }
        );
        assert_eq!(
            topic_keeps(86_400_000, week, true),
            TopicKeeps::Forever { compacted: true }
        );
    }
}
