//! `replayproof prune`'s flags, the retention flags `consume --prune-interval` shares, and how
//! the configuration's sources give each its kind and retention.

use super::round::{Pruner, Round, TopicRetention};
use super::{Lifetimes, SourceRetention};
use crate::args::{DatabaseArgs, KafkaArgs};
use crate::config::ConfigFile;
use crate::ingest::config::FileConfig;
use clap::Args;
use std::time::Duration;

/// How long each table keeps its rows; the `[retention]` section of the file.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Retention")]
pub struct RetentionArgs {
    /// How long the claims of a source with no retention of its own are kept (a source sets
    /// its own with `retention` in its [[ingest.sources]] entry, or --source-retention).
    #[arg(long, env = "REPLAYPROOF_DEFAULT_RETENTION", value_name = "DURATION", default_value = "35days", value_parser = crate::args::lifetime())]
    pub default_retention: Duration,

    /// One source's retention, SOURCE=DURATION; repeatable, over its [[ingest.sources]] entry.
    #[arg(long, env = "REPLAYPROOF_SOURCE_RETENTION", value_name = "SOURCE=DURATION", value_delimiter = ',', value_parser = source_retention)]
    pub source_retention: Vec<(String, Duration)>,

    /// How long settled payloads are kept (the ledger's, done operations' bodies, resolved
    /// expired replays'); after it only the key, the payload's hash and the status remain.
    #[arg(long, env = "REPLAYPROOF_PAYLOAD_RETENTION", value_name = "DURATION", default_value = "7days", value_parser = crate::args::lifetime())]
    pub payload_retention: Duration,

    /// How long dead letters an operator replayed are kept (the others stay until replayed).
    #[arg(long, env = "REPLAYPROOF_DEAD_LETTER_RETENTION", value_name = "DURATION", default_value = "30days", value_parser = crate::args::lifetime())]
    pub dead_letter_retention: Duration,

    /// How long key conflicts are kept after their payload was last seen.
    #[arg(long, env = "REPLAYPROOF_CONFLICT_RETENTION", value_name = "DURATION", default_value = "30days", value_parser = crate::args::lifetime())]
    pub conflict_retention: Duration,

    /// How long the attempts of done or dead operations are kept; also how long an idle
    /// destination's shared limits are (closed breaker, nothing to send, not leased since).
    #[arg(long, env = "REPLAYPROOF_ATTEMPT_RETENTION", value_name = "DURATION", default_value = "30days", value_parser = crate::args::lifetime())]
    pub attempt_retention: Duration,

    /// How long the replay guard's fingerprints are kept: at least every source's replay window.
    #[arg(long, env = "REPLAYPROOF_FINGERPRINT_RETENTION", value_name = "DURATION", default_value = "8days", value_parser = crate::args::lifetime())]
    pub fingerprint_retention: Duration,

    /// How long operator audit rows are kept.
    #[arg(long, env = "REPLAYPROOF_AUDIT_RETENTION", value_name = "DURATION", default_value = "365days", value_parser = crate::args::lifetime())]
    pub audit_retention: Duration,

    /// How long expired replays an operator applied or dropped are kept.
    #[arg(long, env = "REPLAYPROOF_EXPIRED_REPLAY_RETENTION", value_name = "DURATION", default_value = "30days", value_parser = crate::args::lifetime())]
    pub expired_replay_retention: Duration,

    /// Prune under a retention below its kind's floor (the longest redelivery its provider
    /// documents, with a margin). Each round that does writes an audit row.
    #[arg(long, env = "REPLAYPROOF_ALLOW_BELOW_FLOOR")]
    pub allow_below_floor: bool,

    /// Prune under a retention shorter than the topic keeps its messages, though a new group or
    /// an offset reset would replay events whose keys are gone. Audited.
    #[arg(long, env = "REPLAYPROOF_ALLOW_BELOW_TOPIC_RETENTION")]
    pub allow_below_topic_retention: bool,

    /// The topic's retention, when the broker cannot say (no DescribeConfigs rights, or a
    /// broker without it); read from the broker's retention.ms otherwise. "forever" for -1.
    #[arg(long, env = "REPLAYPROOF_TOPIC_RETENTION", value_name = "DURATION", value_parser = topic_retention)]
    pub topic_retention: Option<Stated>,

    /// The topic's segment.ms, with --topic-retention: records are deleted a whole segment at
    /// a time, so each stays readable up to retention.ms plus segment.ms. Kafka's default
    /// unless given.
    #[arg(long, env = "REPLAYPROOF_TOPIC_SEGMENT", value_name = "DURATION", value_parser = crate::args::lifetime(), default_value = crate::args::text(super::KAFKA_DEFAULT_SEGMENT))]
    pub topic_segment: Duration,

    /// Rows one statement deletes at most, so no lock is held for long.
    #[arg(long, env = "REPLAYPROOF_PRUNE_BATCH", default_value_t = super::prune::DEFAULT_BATCH, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub prune_batch: i64,
}

impl crate::args::ToArgs for RetentionArgs {
    fn to_args(&self) -> Vec<String> {
        let show = crate::args::duration_text;
        let mut args = Vec::new();
        let mut flag = |name: &str, value: String| args.extend([format!("--{name}"), value]);
        flag("default-retention", show(self.default_retention));
        for (source, d) in &self.source_retention {
            flag("source-retention", format!("{source}={}", show(*d)));
        }
        flag("payload-retention", show(self.payload_retention));
        flag("dead-letter-retention", show(self.dead_letter_retention));
        flag("conflict-retention", show(self.conflict_retention));
        flag("attempt-retention", show(self.attempt_retention));
        flag("fingerprint-retention", show(self.fingerprint_retention));
        flag("audit-retention", show(self.audit_retention));
        flag(
            "expired-replay-retention",
            show(self.expired_replay_retention),
        );
        if let Some(Stated(stated)) = self.topic_retention {
            flag("topic-retention", stated.map_or("forever".into(), show));
        }
        flag("topic-segment", show(self.topic_segment));
        flag("prune-batch", self.prune_batch.to_string());
        if self.allow_below_floor {
            args.push("--allow-below-floor".into());
        }
        if self.allow_below_topic_retention {
            args.push("--allow-below-topic-retention".into());
        }
        args
    }
}

/// A topic retention stated on the command line; None: forever.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stated(pub Option<Duration>);

fn topic_retention(text: &str) -> Result<Stated, String> {
    match text {
        "forever" | "-1" => Ok(Stated(None)),
        _ => crate::args::lifetime()(text).map(|d| Stated(Some(d))),
    }
}

fn source_retention(text: &str) -> Result<(String, Duration), String> {
    let (source, duration) = text
        .split_once('=')
        .ok_or("expected SOURCE=DURATION, such as stripe=35days")?;
    Ok((source.trim().to_owned(), crate::args::lifetime()(duration)?))
}

impl RetentionArgs {
    /// The lifetimes, each source's kind and retention from the file's sources, over them the
    /// flags'.
    pub fn lifetimes(&self, file: Option<&ConfigFile>) -> anyhow::Result<Lifetimes> {
        let mut sources = std::collections::BTreeMap::new();
        if let Some(file) = file {
            for s in FileConfig::from_config(file)?.sources {
                let retention = SourceRetention {
                    kind: Some(s.kind),
                    retention: s.retention,
                    replay_window: s.effective_replay_window(),
                };
                sources.insert(s.name.clone(), retention);
            }
        }
        for (name, retention) in &self.source_retention {
            let entry = sources.entry(name.clone()).or_insert(SourceRetention {
                kind: None,
                retention: None,
                replay_window: None,
            });
            entry.retention = Some(*retention);
        }
        Ok(Lifetimes {
            default: self.default_retention,
            sources,
            payload: self.payload_retention,
            dead_letter: self.dead_letter_retention,
            conflict: self.conflict_retention,
            attempt: self.attempt_retention,
            fingerprint: self.fingerprint_retention,
            audit: self.audit_retention,
            expired_replay: self.expired_replay_retention,
        })
    }

    /// The pruner these flags describe, for the claims of `topic`.
    pub fn pruner(
        &self,
        pool: crate::db::Db,
        file: Option<&ConfigFile>,
        kafka: &KafkaArgs,
        topic: &str,
        actor: String,
    ) -> anyhow::Result<Pruner> {
        let topic_retention = match self.topic_retention {
            Some(Stated(stated)) => TopicRetention::Stated(match stated {
                Some(retention) => super::TopicKeeps::For {
                    retention,
                    segment: self.topic_segment,
                },
                None => super::TopicKeeps::Forever { compacted: false },
            }),
            None => TopicRetention::Broker {
                config: crate::kafka::client_config(
                    crate::kafka::Role::Reader,
                    &kafka.brokers,
                    None,
                    &[],
                    &kafka.options.kafka_options,
                )?,
                topic: topic.into(),
            },
        };
        Ok(Pruner {
            pool,
            lifetimes: self.lifetimes(file)?,
            topic: topic.into(),
            topic_retention,
            allow_below_floor: self.allow_below_floor,
            allow_below_topic_retention: self.allow_below_topic_retention,
            batch: self.prune_batch,
            actor,
        })
    }
}

/// `replayproof prune`: one round, or with --dry-run what it would delete.
#[derive(Debug, Clone, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// The brokers, for the topic's retention.ms.
    #[command(flatten)]
    pub kafka: KafkaArgs,

    /// The topic the claims' events are read from.
    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = crate::kafka::DEFAULT_TOPIC)]
    pub topic: String,

    #[command(flatten)]
    pub retention: RetentionArgs,

    /// Print what would be deleted, by source and table, and delete nothing.
    #[arg(long)]
    pub dry_run: bool,

    /// Who prunes, for the audit rows. [default: $USER]
    #[arg(long, env = "REPLAYPROOF_ACTOR")]
    pub actor: Option<String>,

    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl PruneArgs {
    pub async fn run(&self, file: Option<&ConfigFile>) -> anyhow::Result<()> {
        let actor = self
            .actor
            .clone()
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "prune".into());
        // Each database prunes its own rows by the same rules: a shard at a time.
        let shards = self.database.open_shards(2).await?;
        let several = shards.databases().count() > 1;
        for (shard, pool) in shards.databases() {
            let pruner = self.retention.pruner(
                pool.clone(),
                file,
                &self.kafka,
                &self.topic,
                actor.clone(),
            )?;
            let round = pruner.round(self.dry_run).await?;
            if several && !self.json {
                println!("shard {shard}:");
            }
            if self.json {
                let json = serde_json::to_string_pretty(&round.pruned.rows)?;
                println!("{json}");
            } else {
                print!("{}", text(&round));
            }
        }
        Ok(())
    }
}

/// A round for people: each source's retention, then the rows by source and table.
pub fn text(round: &Round) -> String {
    let mut out = String::new();
    for d in &round.decided {
        let kind = d.kind.map_or("unknown", |k| k.as_str());
        let floor = d
            .floor
            .map_or("none".into(), |f| humantime::format_duration(f).to_string());
        out.push_str(&format!(
            "{}: kind {kind}, retention {}, floor {floor}{}\n",
            d.source,
            humantime::format_duration(d.retention),
            if d.below_floor() {
                " (below the floor: allowed)"
            } else {
                ""
            }
        ));
    }
    let verb = if round.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    if round.pruned.rows.is_empty() {
        out.push_str(&format!("Nothing to prune; prune {verb} no rows.\n"));
    }
    for (source, table, n) in &round.pruned.rows {
        out.push_str(&format!("{verb} {n} {table} rows (source {source})\n"));
    }
    out
}
