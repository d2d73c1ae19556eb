//! `replayproof replay`: read a window of the topic again through the claim path.

use super::super::render;
use super::super::replay::{ReplayReport, Window};
use super::super::status::KafkaTarget;
use super::super::{Act, Desk, DeskSettings, ReplayEffects};
use crate::effect::Registry;
use clap::Args;

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
        let http = consume.http.outbox_for(file, shards.len() > 1)?;
        let replay = ReplayEffects {
            effects: consume.effects.clone(),
            http,
            kafka: consume.output.output(),
            retry: crate::consume::EffectRetry {
                attempts: consume.effect_attempts,
                ..crate::consume::EffectRetry::default()
            },
            defer: consume.defer_settings()?,
            input: consume.input.input()?,
        };
        let kafka = KafkaTarget {
            brokers: consume.kafka.brokers.clone(),
            topic: consume.topic.clone(),
            group: String::new(),
            options: consume.kafka.options.kafka_options.clone(),
        };
        let desk = Desk::build(DeskSettings {
            shards,
            only: None,
            registry: registry.clone(),
            kafka: Some(kafka),
            letters_to: None,
            replay: Some(replay),
        })?;
        let window = Window {
            brokers: consume.kafka.brokers.clone(),
            topic: consume.topic.clone(),
            options: consume.kafka.options.kafka_options.clone(),
            since: self.since,
            until: self.until,
            partition: self.partition,
            dry_run: self.dry_run,
            force: self.force,
        };
        let act = Act::new(&super::actor(self.actor.as_deref()), &self.reason);
        let report = desk.replay_window(&window, &act).await?;
        render::print(self.json, &report, report_text);
        Ok(())
    }
}

/// A replay's report as text: each partition's range, then the counts.
fn report_text(r: &ReplayReport) -> String {
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
                "read {}, already applied {}, newly applied {}, dead-lettered {}, conflicts {}, failed {}, deferred {}, expired replays {}, skipped {}{would}\n",
                r.read, r.already_applied, r.newly_applied, r.dead_lettered, r.conflicts, r.failed, r.deferred, r.expired, r.skipped
            ));
    out
}
