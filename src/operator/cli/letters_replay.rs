//! `dead-letters replay`: produce dead letters' raw bytes again, one by id or in bulk.

use super::super::render;
use super::super::status::KafkaTarget;
use super::{LetterSelect, OperatorArgs, DEFAULT_RETRY_LIMIT};
use crate::args::KafkaOptions;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct LetterReplayArgs {
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
    pub kafka: KafkaOptions,
    /// Produce to this topic instead of the one it came from.
    #[arg(long)]
    topic: Option<String>,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl LetterReplayArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let kafka = KafkaTarget {
            brokers: self.brokers.clone(),
            topic: String::new(),
            group: String::new(),
            options: self.kafka.kafka_options.clone(),
        };
        let desk = match self.dry_run {
            true => self.op.desk(registry).await?,
            false => {
                self.op
                    .desk_with(registry, Some(kafka), self.topic.clone())
                    .await?
            }
        };
        let ids = match self.id {
            Some(id) => vec![id],
            None => {
                desk.letters_to_replay(&self.select.search(self.limit))
                    .await?
            }
        };
        if self.dry_run {
            for id in &ids {
                println!("dead_letter:{id}: would be replayed");
            }
            println!(
                "{} dead letters would be replayed (dry run: nothing changed)",
                ids.len()
            );
            return Ok(());
        }
        let done = desk
            .replay_letters(&ids, &self.op.act(&self.reason))
            .await?;
        render::print(self.op.json, &done.changes, |c| render::changes(c));
        for (id, why) in &done.refused {
            eprintln!("dead_letter:{id}: not replayed: {why}");
        }
        anyhow::ensure!(
            done.refused.is_empty(),
            "{} of {} dead letters were not replayed",
            done.refused.len(),
            ids.len()
        );
        Ok(())
    }
}
