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

    /// Where to serve Prometheus `/metrics` (the process's own), `/livez` and `/readyz`, apart
    /// from the pages; none unless given.
    #[arg(long, env = "REPLAYPROOF_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,

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

    /// The effects a replay by time applies: `consume --effect`, read from `[consume]` as
    /// `consume` reads it; a console whose chain differs from `[consume]`'s refuses to start.
    #[arg(long = "effect", env = "REPLAYPROOF_EFFECT", value_delimiter = ',', default_value = crate::consume::args::DEFAULT_EFFECT)]
    pub effects: Vec<String>,

    /// The `http` effect's target, as `consume`'s (and from `[consume]`).
    #[command(flatten)]
    pub http: crate::consume::args::HttpEffectArgs,

    /// The `kafka` effect's output topic, as `consume`'s (and from `[consume]`).
    #[command(flatten)]
    pub output: crate::consume::kafka_args::KafkaEffectArgs,

    /// Tries of a failing effect in a replay by time, as `consume --effect-attempts`.
    #[arg(long, env = "REPLAYPROOF_EFFECT_ATTEMPTS", default_value_t = crate::consume::args::DEFAULT_EFFECT_ATTEMPTS, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub effect_attempts: u32,

    /// How an event deferred in a replay by time waits, as `consume`'s `--defer-*`.
    #[command(flatten)]
    pub defer: crate::consume::defer_args::DeferArgs,

    /// How a replay by time reads the topic, as `consume --input` (and from `[consume]`).
    #[command(flatten)]
    pub input: crate::consume::input_args::InputArgs,
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
        let process = crate::shutdown::Process::start("console", self.metrics_addr).await?;
        let settings = self.settings(file)?;
        // With several databases, the console spans them all unless --shard names one; either
        // way each database must hold the buckets the list gives it.
        let shards = match self.database.shard {
            Some(_) => crate::shard::Shards::from(self.database.open_pool(8).await?),
            None => self.database.open_shards(8).await?,
        };
        super::run(settings, shards, registry.clone(), process.shutdown).await
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
        settings.http = self.http.outbox_for(file, self.database.is_sharded())?;
        settings.kafka_output = self.output.output();
        settings.effect_retry = crate::consume::EffectRetry {
            attempts: self.effect_attempts,
            ..Default::default()
        };
        settings.defer = self.defer.settings()?;
        settings.input = self.input.input()?;
        if let Some(file) = file {
            self.same_effects_as_consume(file)?;
        }
        Ok(settings)
    }

    /// Refuses effects other than those `[consume]` names: a replay by time claims each
    /// missing event, so an event replayed without one of consume's effects would never get it.
    fn same_effects_as_consume(&self, file: &crate::config::ConfigFile) -> anyhow::Result<()> {
        let consume = file.section("consume");
        if let Some(effect) = consume.get("effect") {
            let theirs: Vec<String> = match effect {
                toml::Value::Array(list) => list.iter().map(plain).collect(),
                other => plain(other).split(',').map(str::to_owned).collect(),
            };
            let theirs: Vec<&str> = theirs.iter().map(|e| e.trim()).collect();
            anyhow::ensure!(
                theirs == self.effects,
                "the console's --effect {} differs from [consume] effect {}: a replay by time \
                 would claim events without the effects consume applies",
                self.effects.join(","),
                theirs.join(",")
            );
        }
        let target = consume.get("target_url").map(plain);
        anyhow::ensure!(
            target.is_none() || target == self.http.target_url,
            "the console's --target-url differs from [consume] target_url: a replay by time \
             would send events elsewhere than consume does"
        );
        Ok(())
    }
}

/// A file's value as text: a string without its quotes.
fn plain(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
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

#[cfg(test)]
mod tests {
    use crate::cli::{parse, Command};
    use std::collections::BTreeMap;
    use std::time::Duration;

    /// The console's settings from a file whose `[consume]` applies a ledger row and an
    /// outbox operation, with `flags` after `console --config FILE`.
    fn settings(flags: &[&str]) -> anyhow::Result<super::ConsoleSettings> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("replayproof.toml");
        let hash = crate::console::hash_password_with(
            "pw",
            argon2::Params::new(1024, 1, 1, None).unwrap(),
        )
        .unwrap();
        let text = format!(
            "[database]\nurl = \"postgres://u@db/x\"\n\n[consume]\neffect = \"ledger,http\"\n\
             target_url = \"http://downstream:8080/ops\"\neffect_attempts = 7\n\
             defer_deadline = \"72h\"\n\n[console]\nsession_key = \"{}\"\n\n\
             [[console.users]]\nname = \"ann\"\nrole = \"operator\"\npassword_hash = \"{hash}\"\n",
            "k".repeat(40)
        );
        std::fs::write(&path, text).unwrap();
        let mut argv = vec!["replayproof".into(), "console".into(), "--config".into()];
        argv.push(path.into_os_string());
        argv.extend(flags.iter().map(Into::into));
        let args = parse(argv, &BTreeMap::<String, String>::new()).unwrap();
        let Command::Console(console) = &args.command else {
            panic!("not the console")
        };
        console.settings(args.file.as_ref())
    }

    #[test]
    fn a_replay_by_time_applies_the_effects_and_settings_of_consume() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.effects, ["ledger", "http"]);
        let http = s.http.expect("the http effect's target");
        assert_eq!(http.target_url, "http://downstream:8080/ops");
        assert_eq!(s.effect_retry.attempts, 7);
        assert_eq!(s.defer.default.deadline, Duration::from_secs(72 * 3600));
    }

    #[test]
    fn a_console_applying_other_effects_than_consume_is_refused() {
        let other = settings(&["--effect", "ledger"]).err().expect("refused");
        assert!(
            format!("{other:#}").contains("[consume] effect"),
            "{other:#}"
        );
        let target = ["--target-url", "http://elsewhere:8080/ops"];
        let elsewhere = settings(&target).err().expect("refused");
        assert!(
            format!("{elsewhere:#}").contains("[consume] target_url"),
            "{elsewhere:#}"
        );
    }
}
