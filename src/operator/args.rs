//! The operator commands' flags, and how each runs: `events`, `dead-letters` and `status`.

use super::events::{self, EventFilter, Resolution, Retry, RetryFilter, StateName};
use super::{dead_letters, expired, render, status, Act};
use crate::args::{DatabaseArgs, KafkaOptions};
use crate::effect::Registry;
use clap::{Args, Subcommand};
use std::time::Duration;

// `status` defaults to the topic and group `consume` defaults to.
use crate::consume::{DEFAULT_GROUP, DEFAULT_TOPIC};

#[derive(Debug, Clone, Args)]
pub struct OperatorArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Who is acting, for the audit table. [default: $USER]
    #[arg(long, env = "REPLAYPROOF_ACTOR")]
    pub actor: Option<String>,

    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

impl OperatorArgs {
    fn actor(&self) -> String {
        self.actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into())
    }

    fn act(&self, reason: &str) -> Act {
        Act::new(&self.actor(), reason)
    }

    fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        self.database.pool(2)
    }
}

/// Rows a list shows unless `--limit` says otherwise.
pub const DEFAULT_LIST_LIMIT: i64 = 50;
/// Events one bulk retry takes at most, unless `--limit` says otherwise.
pub const DEFAULT_RETRY_LIMIT: i64 = 1000;

#[derive(Debug, Clone, Subcommand)]
pub enum EventsCommand {
    /// List events, newest first.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        /// A claim status (done, failed) or an operation state (pending, in_progress,
        /// retryable, uncertain, done, failed, dead).
        #[arg(long)]
        state: Option<StateName>,
        /// Only events of this source.
        #[arg(long)]
        source: Option<String>,
        /// Only events claimed at least this long ago: a duration such as 30m, 2h or 3days
        /// (`--older-than-secs` is its old spelling, in seconds).
        #[arg(long, value_name = "DURATION", value_parser = crate::args::age(), conflicts_with = "older_than_secs")]
        older_than: Option<Duration>,
        /// The old spelling of `--older-than`, in seconds.
        #[arg(long, value_parser = crate::args::age_secs(), hide = true)]
        older_than_secs: Option<u64>,
        /// The most rows shown.
        #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
        limit: i64,
    },
    /// Everything about one event: its claim, effect rows, operations, every attempt, dead
    /// letters and key conflicts.
    Show {
        #[command(flatten)]
        op: OperatorArgs,
        /// The event's key, as `events list` shows it (stripe:evt_…).
        key: String,
    },
    /// Send a failed, uncertain or dead operation again with the same idempotency key, or run a
    /// failed local effect again from its stored payload.
    Retry(RetryArgs),
    /// Settle an event's operations (or failed claim) by hand.
    Resolve {
        #[command(flatten)]
        op: OperatorArgs,
        /// The event's key.
        key: String,
        /// What the operations (or the failed claim) become.
        #[arg(long = "as", value_enum)]
        to: Resolution,
        /// Only this operation of the event.
        #[arg(long)]
        operation: Option<String>,
        /// Why, for the audit table.
        #[arg(long)]
        reason: String,
    },
    /// List expired replays: events that arrived after their key could have been pruned, kept
    /// unapplied for an operator.
    Expired {
        #[command(flatten)]
        op: OperatorArgs,
        /// Also those already applied or dropped.
        #[arg(long)]
        all: bool,
        /// The most rows shown.
        #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
        limit: i64,
    },
    /// Apply an expired replay once: claim its key and run its effect, audited.
    ApplyExpired {
        #[command(flatten)]
        op: OperatorArgs,
        /// The key of the expired replay, as `events expired` shows it.
        key: String,
        /// The effect to run, by name as for `consume --effect`, instead of the one recorded.
        #[arg(long)]
        effect: Option<String>,
        /// Why, for the audit table.
        #[arg(long)]
        reason: String,
    },
    /// Drop an expired replay: never applied, audited.
    DropExpired {
        #[command(flatten)]
        op: OperatorArgs,
        /// The key of the expired replay, as `events expired` shows it.
        key: String,
        /// Why, for the audit table.
        #[arg(long)]
        reason: String,
    },
    /// Erase the payloads of settled events (one key, or a data subject's events of a source),
    /// keeping the key, the hash and the status so a redelivery is still a replay. Audited;
    /// refused for events that are not settled.
    Erase {
        #[command(flatten)]
        op: OperatorArgs,
        /// The event whose payloads go.
        #[arg(long, required_unless_present = "source", conflicts_with = "source")]
        key: Option<String>,
        /// Every event of this source whose stored payload matches --match.
        #[arg(long, requires = "matching")]
        source: Option<String>,
        /// FIELD=VALUE, FIELD a dotted path into the payload (customer, data.object.customer).
        #[arg(long = "match", id = "matching", value_name = "FIELD=VALUE", value_parser = crate::args::parse_key_value, requires = "source")]
        matching: Option<(String, String)>,
        /// Why, for the audit table.
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Clone, Args)]
pub struct RetryArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The event to retry; without it, every event matching --state (and --source, --since).
    #[arg(required_unless_present = "state")]
    key: Option<String>,
    /// Only this operation of the event.
    #[arg(long)]
    operation: Option<String>,
    /// The effect to run again for a failed local effect, by its name as for `consume
    /// --effect`, instead of the effects recorded on its claim.
    #[arg(long)]
    effect: Option<String>,
    /// Bulk: retry every event whose claim or an operation is in this state.
    #[arg(long, value_parser = StateName::retryable, conflicts_with = "key")]
    state: Option<StateName>,
    /// Bulk: only events of this source.
    #[arg(long, requires = "state")]
    source: Option<String>,
    /// Bulk: only events claimed at or after this time (RFC 3339).
    #[arg(long, requires = "state")]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Bulk: at most this many events.
    #[arg(long, default_value_t = DEFAULT_RETRY_LIMIT, requires = "state")]
    limit: i64,
    /// Bulk: list the events that would be retried, and change nothing.
    #[arg(long, requires = "state")]
    dry_run: bool,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl EventsCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List {
                op,
                state,
                source,
                older_than,
                older_than_secs,
                limit,
            } => {
                let filter = EventFilter {
                    state,
                    source,
                    older_than: older_than.or(older_than_secs.map(Duration::from_secs)),
                    limit,
                };
                let events = events::list(&op.pool()?, &filter).await?;
                render::print(op.json, &events, |e| render::rows(e));
            }
            Self::Show { op, key } => {
                let detail = events::show(&op.pool()?, &key).await?;
                render::print(op.json, &detail, render::event_detail);
            }
            Self::Retry(args) => args.run(registry).await?,
            Self::Resolve {
                op,
                key,
                to,
                operation,
                reason,
            } => {
                let act = op.act(&reason);
                let changes =
                    events::resolve(&op.pool()?, &key, operation.as_deref(), to, &act).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
            other => other.run_retention(registry).await?,
        }
        Ok(())
    }

    /// The commands on expired replays and erasure.
    async fn run_retention(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::Expired { op, all, limit } => {
                let rows = crate::retention::expired::list(&op.pool()?, all, limit).await?;
                render::print(op.json, &rows, |r| render::rows(r));
            }
            Self::ApplyExpired {
                op,
                key,
                effect,
                reason,
            } => {
                let given = effect
                    .map(|name| registry.build(std::slice::from_ref(&name), None))
                    .transpose()?;
                let act = op.act(&reason);
                let changes = expired::apply(&op.pool()?, registry, &key, given, &act).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
            Self::DropExpired { op, key, reason } => {
                let changes = expired::drop(&op.pool()?, &key, &op.act(&reason)).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
            Self::Erase {
                op,
                key,
                source,
                matching,
                reason,
            } => erase(op, key, source, matching, &reason).await?,
            _ => unreachable!("the other commands run in EventsCommand::run"),
        }
        Ok(())
    }
}

/// `events erase`: one key, or the events of a source whose payload matches.
async fn erase(
    op: OperatorArgs,
    key: Option<String>,
    source: Option<String>,
    matching: Option<(String, String)>,
    reason: &str,
) -> anyhow::Result<()> {
    use crate::retention::erase;
    let pool = op.pool()?;
    let keys = match (key, source, matching) {
        (Some(key), _, _) => vec![key],
        (None, Some(source), Some((field, value))) => {
            erase::matching(&pool, &source, &field, &value).await?
        }
        _ => anyhow::bail!("give --key, or --source with --match"),
    };
    let erased = erase::erase(&pool, &keys, &op.act(reason)).await?;
    render::print(op.json, &erased, |e| {
        let mut out = String::new();
        for key in &e.erased {
            out.push_str(&format!("{key}: payloads erased\n"));
        }
        for (key, why) in &e.refused {
            out.push_str(&format!("{key}: refused: {why}\n"));
        }
        out.push_str(&format!(
            "{} erased, {} refused\n",
            e.erased.len(),
            e.refused.len()
        ));
        out
    });
    anyhow::ensure!(
        erased.refused.is_empty(),
        "{} event(s) were not erased",
        erased.refused.len()
    );
    Ok(())
}

impl RetryArgs {
    async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let pool = self.op.pool()?;
        let effect = self
            .effect
            .as_ref()
            .map(|name| registry.build(std::slice::from_ref(name), None));
        let retry = Retry {
            operation: self.operation.clone(),
            effect: effect.transpose()?,
        };
        let act = self.op.act(&self.reason);
        let Some(state) = self.state else {
            let key = self.key.as_deref().unwrap_or_default();
            let changes = events::retry(&pool, registry, key, &retry, &act).await?;
            render::print(self.op.json, &changes, |c| render::changes(c));
            return Ok(());
        };
        let filter = RetryFilter {
            state,
            source: self.source.clone(),
            since: self.since,
            limit: self.limit,
        };
        let keys = events::to_retry(&pool, &filter).await?;
        if self.dry_run {
            for key in &keys {
                println!("{key}: would be retried");
            }
            println!(
                "{} events would be retried (dry run: nothing changed)",
                keys.len()
            );
            return Ok(());
        }
        let mut failures = 0;
        for key in &keys {
            match events::retry(&pool, registry, key, &retry, &act).await {
                Ok(changes) => render::print(self.op.json, &changes, |c| render::changes(c)),
                Err(e) => {
                    failures += 1;
                    eprintln!("{key}: not retried: {e:#}");
                }
            }
        }
        anyhow::ensure!(
            failures == 0,
            "{failures} of {} events were not retried",
            keys.len()
        );
        Ok(())
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        /// The most rows shown.
        #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
        limit: i64,
    },
    /// One dead letter with its raw key and value.
    Show {
        #[command(flatten)]
        op: OperatorArgs,
        /// The dead letter's id, as `dead-letters list` shows it.
        id: i64,
    },
    /// Produce a dead letter's raw bytes again, to its topic or another.
    Replay {
        #[command(flatten)]
        op: OperatorArgs,
        /// The dead letter's id, as `dead-letters list` shows it.
        id: i64,
        /// Kafka bootstrap servers.
        #[arg(long, env = "REPLAYPROOF_BROKERS")]
        brokers: String,
        #[command(flatten)]
        kafka: KafkaOptions,
        /// Produce to this topic instead of the one it came from.
        #[arg(long)]
        topic: Option<String>,
        /// Why, for the audit table.
        #[arg(long)]
        reason: String,
    },
}

impl DeadLettersCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::List { op, limit } => {
                let letters = dead_letters::list(&op.pool()?, limit).await?;
                render::print(op.json, &letters, |l| render::rows(l));
            }
            Self::Show { op, id } => {
                let letter = dead_letters::show(&op.pool()?, id).await?;
                render::print(op.json, &letter, render::row);
            }
            Self::Replay {
                op,
                id,
                brokers,
                kafka,
                topic,
                reason,
            } => {
                let producer = crate::kafka::producer(&brokers, &kafka.kafka_options)?;
                let produce = |letter: crate::claims::dead_letters::RawLetter| async move {
                    let topic = topic.unwrap_or(letter.topic);
                    let (key, value) = (letter.key.as_deref(), letter.value.as_deref());
                    crate::kafka::produce_raw(&producer, &topic, key, value).await?;
                    Ok(topic)
                };
                let act = op.act(&reason);
                let changes = dead_letters::replay(&op.pool()?, id, &act, produce).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Kafka bootstrap servers; without them the lag is not shown.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    #[command(flatten)]
    pub kafka: KafkaOptions,

    /// The topic whose lag is shown, as `consume --topic`.
    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = DEFAULT_TOPIC)]
    pub topic: String,

    /// The consumer group whose committed offsets give the lag, as `consume --group`.
    #[arg(long, env = "REPLAYPROOF_GROUP", default_value = DEFAULT_GROUP)]
    pub group: String,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl StatusArgs {
    pub async fn run(self) -> anyhow::Result<()> {
        let pool = self.database.pool(2)?;
        let kafka = self.brokers.clone().map(|brokers| status::KafkaTarget {
            brokers,
            topic: self.topic.clone(),
            group: self.group.clone(),
            options: self.kafka.kafka_options.clone(),
        });
        let status = status::gather(&pool, kafka).await?;
        render::print(self.json, &status, render::status);
        Ok(())
    }
}
