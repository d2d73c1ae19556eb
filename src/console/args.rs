//! `replayproof console`'s flags, and `console hash-password`.

use super::{ConsoleFile, ConsoleSettings, DEFAULT_LISTEN};
use crate::args::{DatabaseArgs, KafkaOptions};
use crate::consume::{DEFAULT_GROUP, DEFAULT_TOPIC};
use crate::effect::Registry;
use clap::{Args, Subcommand};
use std::net::SocketAddr;

#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ConsoleArgs {
    #[command(subcommand)]
    pub command: Option<ConsoleCommand>,

    /// Where the console listens; this machine only by default. Users and the session key are
    /// the configuration file's `[console]` section.
    #[arg(long, env = "REPLAYPROOF_CONSOLE_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,

    /// Required unless a subcommand runs (`subcommand_negates_reqs`): `hash-password` needs
    /// no database.
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Kafka bootstrap servers: the group's lag, dead-letter replays and replays by time.
    /// Without them the console shows no lag and replays nothing.
    #[arg(long, env = "REPLAYPROOF_BROKERS")]
    pub brokers: Option<String>,

    #[command(flatten)]
    pub kafka: KafkaOptions,

    /// The topic, as `consume --topic`.
    #[arg(long, env = "REPLAYPROOF_TOPIC", default_value = DEFAULT_TOPIC)]
    pub topic: String,

    /// The consumer group whose lag is shown, as `consume --group`.
    #[arg(long, env = "REPLAYPROOF_GROUP", default_value = DEFAULT_GROUP)]
    pub group: String,

    /// The effects a replay by time applies, as `consume --effect`.
    #[arg(long = "effect", env = "REPLAYPROOF_EFFECT", value_delimiter = ',', default_value = crate::consume::args::DEFAULT_EFFECT)]
    pub effects: Vec<String>,

    /// The `http` effect's target, as `consume`'s.
    #[command(flatten)]
    pub http: crate::consume::args::HttpEffectArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ConsoleCommand {
    /// Read a password from standard input and print its argon2id hash, for a
    /// [[console.users]] entry's password_hash.
    HashPassword,
}

impl ConsoleArgs {
    pub async fn run(
        self,
        registry: &Registry,
        file: Option<&crate::config::ConfigFile>,
    ) -> anyhow::Result<()> {
        if let Some(ConsoleCommand::HashPassword) = self.command {
            return hash_password_from_stdin();
        }
        let settings = self.settings(file)?;
        // With several databases, the console spans them all unless --shard names one; either
        // way each database must hold the buckets the list gives it.
        let shards = match self.database.shard {
            Some(_) => crate::shard::Shards::from(self.database.open_pool(8).await?),
            None => self.database.open_shards(8).await?,
        };
        super::run(settings, shards, registry.clone()).await
    }

    /// The settings from these flags and the file's `[console]` section.
    pub fn settings(
        &self,
        file: Option<&crate::config::ConfigFile>,
    ) -> anyhow::Result<ConsoleSettings> {
        let section = match file {
            Some(file) => ConsoleFile::from_config(file)?,
            None => ConsoleFile::default(),
        };
        let mut settings = ConsoleSettings::new(self.listen, section)?;
        settings.kafka = self
            .brokers
            .clone()
            .map(|brokers| crate::operator::status::KafkaTarget {
                brokers,
                topic: self.topic.clone(),
                group: self.group.clone(),
                options: self.kafka.kafka_options.clone(),
            });
        settings.effects = self.effects.clone();
        settings.http = self.http.outbox();
        Ok(settings)
    }
}

/// `console hash-password`: one line of standard input, without its line ending.
fn hash_password_from_stdin() -> anyhow::Result<()> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let password = line.trim_end_matches(['\r', '\n']);
    anyhow::ensure!(!password.is_empty(), "no password on standard input");
    println!("{}", super::hash_password(password)?);
    Ok(())
}
