//! The operator commands' flags, and how each runs: `events`, `dead-letters` and `status`.

use super::events::{self, Cursor, Resolution, Search, SearchState};
pub use super::retry_args::RetryArgs;
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

    pub(super) fn act(&self, reason: &str) -> Act {
        Act::new(&self.actor(), reason)
    }

    pub(super) async fn pool(&self) -> anyhow::Result<sqlx::PgPool> {
        self.database.open_pool(2).await
    }

    /// The database holding `key`, whichever shard it is.
    pub(super) async fn pool_for(&self, key: &str) -> anyhow::Result<sqlx::PgPool> {
        self.database.pool_for_key(key, 2).await
    }

    /// The first database: with several shards, the one that holds every dead letter.
    pub(super) async fn first(&self) -> anyhow::Result<sqlx::PgPool> {
        Ok(self.database.open_shards(2).await?.first().clone())
    }

    /// Every database a listing reads: each shard, or only the one `--shard` names.
    pub(super) async fn databases(&self) -> anyhow::Result<Vec<sqlx::PgPool>> {
        if self.database.shard.is_some() {
            return Ok(vec![self.pool().await?]);
        }
        let shards = self.database.open_shards(2).await?;
        Ok(shards.databases().map(|(_, p)| p.clone()).collect())
    }
}

/// Rows a list shows unless `--limit` says otherwise.
pub const DEFAULT_LIST_LIMIT: i64 = 50;
/// Events one bulk retry takes at most, unless `--limit` says otherwise.
pub const DEFAULT_RETRY_LIMIT: i64 = 1000;

#[derive(Debug, Clone, Subcommand)]
pub enum EventsCommand {
    /// List events, newest first, a page at a time: the next page is `--after` the cursor
    /// printed under this one.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        /// A claim status (done, failed) or an operation state (pending, in_progress,
        /// retryable, uncertain, done, failed, dead), or `conflict` for events with a key
        /// conflict.
        #[arg(long)]
        state: Option<SearchState>,
        /// Only events of this source.
        #[arg(long)]
        source: Option<String>,
        /// Only events of this type (payment_intent.succeeded).
        #[arg(long = "type", value_name = "TYPE")]
        event_type: Option<String>,
        /// Only this key, or the keys starting with it when it ends with `*` (stripe:evt_1*).
        #[arg(long)]
        key: Option<String>,
        /// Only events claimed at or after this moment: an RFC 3339 time or a duration ago
        /// (2026-12-02T10:00:00Z, 40m).
        #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// Only events claimed before this moment, as --since.
        #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// The page after this cursor, as the previous page printed it.
        #[arg(long, value_name = "CURSOR")]
        after: Option<Cursor>,
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

impl EventsCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List {
                op,
                state,
                source,
                event_type,
                key,
                since,
                until,
                after,
                older_than,
                older_than_secs,
                limit,
            } => {
                let older_than = older_than.or(older_than_secs.map(Duration::from_secs));
                let aged = older_than.map(|age| {
                    chrono::Utc::now() - chrono::Duration::from_std(age).unwrap_or_default()
                });
                let search = Search {
                    key,
                    source,
                    event_type,
                    state,
                    since,
                    until: [until, aged].into_iter().flatten().min(),
                    after,
                    limit,
                };
                let page = events::search_over(&op.databases().await?, &search).await?;
                render::print(op.json, &page.events, |e| render::rows(e));
                // On stderr, so that the JSON and the table stay the list alone.
                if let Some(next) = &page.next {
                    eprintln!("next page: --after {next}");
                }
            }
            Self::Show { op, key } => {
                let detail = events::show(&op.pool_for(&key).await?, &key).await?;
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
                let pool = op.pool_for(&key).await?;
                let changes = events::resolve(&pool, &key, operation.as_deref(), to, &act).await?;
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
                let rows = crate::retention::expired::list_over(&op.databases().await?, all, limit)
                    .await?;
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
                let pool = op.pool_for(&key).await?;
                let changes = expired::apply(&pool, registry, &key, given, &act).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
            Self::DropExpired { op, key, reason } => {
                let pool = op.pool_for(&key).await?;
                let changes = expired::drop(&pool, &key, &op.act(&reason)).await?;
                render::print(op.json, &changes, |c| render::changes(c));
            }
            Self::Erase {
                op,
                key,
                source,
                matching,
                reason,
            } => super::erasure::run(op, key, source, matching, &reason).await?,
            _ => unreachable!("the other commands run in EventsCommand::run"),
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    List {
        #[command(flatten)]
        op: OperatorArgs,
        #[command(flatten)]
        select: LetterSelect,
        /// Only those never replayed.
        #[arg(long)]
        not_replayed: bool,
        /// The page after this id: the last id of the previous page.
        #[arg(long, value_name = "ID")]
        before: Option<i64>,
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
    /// Produce dead letters' raw bytes again, to their topic or another: one by id, or in bulk
    /// every letter never replayed that --all, --since or --reason-like selects.
    Replay {
        #[command(flatten)]
        op: OperatorArgs,
        /// The dead letter's id, as `dead-letters list` shows it.
        #[arg(required_unless_present_any = ["all", "since", "reason_like"], conflicts_with_all = ["all", "since", "reason_like"])]
        id: Option<i64>,
        /// Bulk: every dead letter never replayed.
        #[arg(long, conflicts_with_all = ["since", "reason_like"])]
        all: bool,
        #[command(flatten)]
        select: LetterSelect,
        /// Bulk: at most this many letters.
        #[arg(long, default_value_t = DEFAULT_RETRY_LIMIT)]
        limit: i64,
        /// Bulk: list the letters that would be replayed, and change nothing.
        #[arg(long)]
        dry_run: bool,
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

/// Which dead letters a list or a bulk replay takes.
#[derive(Debug, Clone, Args)]
pub struct LetterSelect {
    /// Only those stored at or after this moment: an RFC 3339 time or a duration ago (2h).
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only those whose reason is LIKE this pattern (%not JSON%).
    #[arg(long, value_name = "PATTERN")]
    pub reason_like: Option<String>,
}

impl LetterSelect {
    fn search(&self, limit: i64) -> crate::claims::dead_letters::LetterSearch {
        crate::claims::dead_letters::LetterSearch {
            since: self.since,
            reason_like: self.reason_like.clone(),
            limit,
            ..Default::default()
        }
    }
}

impl DeadLettersCommand {
    pub async fn run(self) -> anyhow::Result<()> {
        match self {
            Self::List {
                op,
                select,
                not_replayed,
                before,
                limit,
            } => {
                let search = crate::claims::dead_letters::LetterSearch {
                    not_replayed,
                    before_id: before,
                    ..select.search(limit)
                };
                let letters =
                    crate::claims::dead_letters::search(&op.first().await?, &search).await?;
                render::print(op.json, &letters, |l| render::rows(l));
                if letters.len() as i64 == limit {
                    if let Some(last) = letters.last() {
                        eprintln!("next page: --before {}", last.id);
                    }
                }
            }
            Self::Show { op, id } => {
                let letter = dead_letters::show(&op.first().await?, id).await?;
                render::print(op.json, &letter, render::row);
            }
            Self::Replay {
                op,
                id,
                select,
                limit,
                dry_run,
                brokers,
                kafka,
                topic,
                reason,
                all: _,
            } => {
                let pool = op.first().await?;
                let ids = match id {
                    Some(id) => vec![id],
                    None => dead_letters::to_replay(&pool, &select.search(limit))
                        .await?
                        .into_iter()
                        .map(|l| l.id)
                        .collect(),
                };
                if dry_run {
                    for id in &ids {
                        println!("dead_letter:{id}: would be replayed");
                    }
                    println!(
                        "{} dead letters would be replayed (dry run: nothing changed)",
                        ids.len()
                    );
                    return Ok(());
                }
                let producer =
                    dead_letters::LetterProducer::new(&brokers, &kafka.kafka_options, topic)?;
                let act = op.act(&reason);
                let done = dead_letters::replay_many(&pool, &ids, &act, &producer).await;
                render::print(op.json, &done.changes, |c| render::changes(c));
                for (id, why) in &done.refused {
                    eprintln!("dead_letter:{id}: not replayed: {why}");
                }
                anyhow::ensure!(
                    done.refused.is_empty(),
                    "{} of {} dead letters were not replayed",
                    done.refused.len(),
                    ids.len()
                );
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

    /// Show the screen again every INTERVAL (2s unless given) until interrupted.
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s", value_parser = crate::args::wait(Duration::from_millis(100)))]
    pub watch: Option<Duration>,
}

impl StatusArgs {
    pub async fn run(self) -> anyhow::Result<()> {
        let shards = self.database.open_shards(2).await?;
        let pools: Vec<sqlx::PgPool> = shards.databases().map(|(_, p)| p.clone()).collect();
        let pool = &pools[..];
        let kafka = self.brokers.clone().map(|brokers| status::KafkaTarget {
            brokers,
            topic: self.topic.clone(),
            group: self.group.clone(),
            options: self.kafka.kafka_options.clone(),
        });
        let Some(every) = self.watch else {
            let status = status::gather(pool, kafka).await?;
            render::print(self.json, &status, render::status);
            return Ok(());
        };
        let stop = crate::shutdown::on_signal();
        loop {
            let shown = match status::gather(pool, kafka.clone()).await {
                Ok(status) if self.json => serde_json::to_string(&status)?,
                Ok(status) => render::status(&status),
                // A watch outlives a database restart: the error is the screen until it ends.
                Err(e) => format!("status unavailable: {e:#}\n"),
            };
            if self.json {
                println!("{shown}");
            } else {
                let at = chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC");
                // Clear the terminal and home the cursor, then the screen.
                print!(
                    "\x1b[2J\x1b[H{at} (every {})\n\n{shown}",
                    humantime::format_duration(every)
                );
            }
            use std::io::Write as _;
            std::io::stdout().flush()?;
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = tokio::time::sleep(every) => {}
            }
        }
    }
}

/// `replayproof replay`: read a window of the topic again through the claim path.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The brokers, topic, database and effects, as `consume` has them (and from the same
    /// `[kafka]`, `[database]` and `[consume]` settings): the window is applied as `consume` applies.
    #[command(flatten)]
    pub consume: crate::consume::args::ConsumeArgs,

    /// The window's start: an RFC 3339 time or a duration ago (2026-12-02T10:00:00Z, 3h).
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    pub since: chrono::DateTime<chrono::Utc>,

    /// The window's end, not included, as --since; the partitions' ends when not given.
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,

    /// Only this partition.
    #[arg(long)]
    pub partition: Option<i32>,

    /// Read and count what would be applied; change nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Replay a window that starts before the topic's retained data or before the claims'
    /// retention, which is refused otherwise.
    #[arg(long)]
    pub force: bool,

    /// Who is acting, for the audit table. [default: $USER]
    #[arg(long, env = "REPLAYPROOF_ACTOR")]
    pub actor: Option<String>,

    /// Why, for the audit table.
    #[arg(long, default_value = "replay by time")]
    pub reason: String,

    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

impl ReplayArgs {
    pub async fn run(
        self,
        registry: &Registry,
        file: Option<&crate::config::ConfigFile>,
    ) -> anyhow::Result<()> {
        let consume = &self.consume;
        let shards = consume.database.open_shards(4).await?;
        // The first database keeps the audit; the window is applied over every shard.
        let pool = shards.first().clone();
        let processor = consume.processor(shards, registry, file)?;
        let window = super::replay::Window {
            brokers: consume.kafka.brokers.clone(),
            topic: consume.topic.clone(),
            options: consume.kafka.options.kafka_options.clone(),
            since: self.since,
            until: self.until,
            partition: self.partition,
            dry_run: self.dry_run,
            force: self.force,
        };
        let actor = self
            .actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into());
        let act = Act::new(&actor, &self.reason);
        let report = super::replay::replay(&pool, &processor, &window, &act).await?;
        render::print(self.json, &report, |r| {
            let mut out = String::new();
            for p in &r.partitions {
                out.push_str(&format!(
                    "partition {}: offsets {} to {}\n",
                    p.partition, p.from, p.to
                ));
            }
            let would = if r.dry_run {
                " (dry run: nothing changed)"
            } else {
                ""
            };
            out.push_str(&format!(
                "read {}, already applied {}, newly applied {}, dead-lettered {}, conflicts {}, failed {}, deferred {}, expired replays {}{would}\n",
                r.read, r.already_applied, r.newly_applied, r.dead_lettered, r.conflicts, r.failed, r.deferred, r.expired
            ));
            out
        });
        Ok(())
    }
}
