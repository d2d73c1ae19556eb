//! `replayproof status`: the whole system on one screen, once or every `--watch` interval.

use super::super::render;
use super::super::status::KafkaTarget;
use super::super::{Desk, DeskSettings};
use crate::args::{DatabaseArgs, KafkaOptions};
use crate::effect::Registry;
use clap::Args;
use std::time::Duration;

// `status` defaults to the topic and group `consume` defaults to.
use crate::consume::{DEFAULT_GROUP, DEFAULT_TOPIC};

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
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let kafka = self.brokers.clone().map(|brokers| KafkaTarget {
            brokers,
            topic: self.topic.clone(),
            group: self.group.clone(),
            options: self.kafka.kafka_options.clone(),
        });
        let desk = Desk::build(DeskSettings {
            shards: self.database.open_shards(2).await?,
            only: None,
            registry: registry.clone(),
            kafka,
            letters_to: None,
            replay: None,
        })?;
        let Some(every) = self.watch else {
            let status = desk.status().await?;
            render::print(self.json, &status, render::status);
            return Ok(());
        };
        self.watch(&desk, every).await
    }

    /// The screen again every `every`, until a signal.
    async fn watch(&self, desk: &Desk, every: Duration) -> anyhow::Result<()> {
        let stop = crate::shutdown::on_signal();
        loop {
            let shown = match desk.status().await {
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
