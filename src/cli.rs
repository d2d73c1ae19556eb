//! The command line: which command runs which role. Each role owns its flags (`args.rs` in its
//! module); this file only routes, and lets an application register its own effects.

use crate::args::{DatabaseArgs, KafkaOptions};
use crate::config::{ConfigFile, Env, LayerError};
use crate::consume::args::ConsumeArgs;
use crate::dispatch::args::DispatchArgs;
use crate::effect::{Effect, Registry};
use crate::ingest::args::IngestArgs;
use crate::operator::args::{DeadLettersCommand, EventsCommand, StatusArgs};
use clap::{Parser, Subcommand};
use std::ffi::OsString;

/// Makes webhook redeliveries harmless: one visible effect per event, whatever is redelivered.
#[derive(Debug, Parser)]
#[command(name = "replayproof", version, about, long_about = None)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,

    /// The configuration file every command reads (see replayproof.example.toml): sections
    /// [kafka], [database], [consume], [dispatch], [ingest] and [retention]. A flag, then its environment
    /// variable, then the file, then the default.
    #[allow(rustdoc::broken_intra_doc_links)] // The brackets name the file's sections.
    #[arg(long, global = true, env = crate::config::CONFIG_ENV, value_name = "FILE")]
    pub config: Option<std::path::PathBuf>,

    /// How log lines are written to stderr: text (coloured only on a terminal) or json (one
    /// object a line).
    #[arg(long, global = true, env = "REPLAYPROOF_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// The configuration file the command line was read over, as [`parse`] read it.
    #[arg(skip)]
    pub file: Option<ConfigFile>,
}

/// The command line as the process runs it: read over the configuration file and the
/// environment in one parse ([`crate::config::layered`]), with the librdkafka properties of
/// the file and then of `REPLAYPROOF_KAFKA_*` put before the command's own `--kafka-option`s.
pub fn parse(argv: Vec<OsString>, env: &dyn Env) -> Result<Args, LayerError> {
    use clap::{CommandFactory as _, FromArgMatches as _};
    let layered = crate::config::layered(Args::command(), argv, env)?;
    let mut args = Args::from_arg_matches(&layered.matches)?;
    if let Some(options) = args.command.kafka_options() {
        options.kafka_options.splice(0..0, layered.properties);
    }
    args.file = layered.file;
    Ok(args)
}

pub use crate::telemetry::LogFormat;

/// Parsed once per process, so the size of its largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the database migrations and exit.
    Migrate(DatabaseArgs),
    /// Join the consumer group and apply each event of the topic exactly once.
    Consume(ConsumeArgs),
    /// Receive signed webhooks over HTTP and write them to the topic.
    Ingest(IngestArgs),
    /// Deliver the outbox's operations under a lease, with idempotency keys.
    Dispatch(DispatchArgs),
    /// Inspect events and their operations, and retry or resolve them.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Inspect and replay messages that were not valid envelopes.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLettersCommand),
    /// One screen for an operator: lag, claims, the outbox and dead letters.
    Status(StatusArgs),
    /// Delete settled claims older than their source's retention, with their operations, and
    /// the other tables' rows past their lifetimes; --dry-run prints what would go.
    Prune(crate::retention::args::PruneArgs),
    /// Check the configuration file and print the settings every command would run with,
    /// secrets redacted.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Exit 0 when the URL answers 2xx: a health check for images without curl.
    Probe {
        /// For example http://127.0.0.1:9464/healthz.
        url: String,
    },
    /// The whole promise end to end with no services: a storm of signed webhooks, a consumer
    /// killed mid-stream, a flaky downstream, and a report that every event had one effect.
    #[cfg(feature = "devkit")]
    Demo(crate::devkit::demo::DemoArgs),
    /// Ingest, consume and dispatch in one process for local development, on an embedded
    /// broker and database unless real ones are configured.
    #[cfg(feature = "devkit")]
    Dev(crate::devkit::dev::DevArgs),
}

impl Command {
    /// The librdkafka properties of the commands that have them.
    fn kafka_options(&mut self) -> Option<&mut KafkaOptions> {
        match self {
            Self::Consume(args) => Some(&mut args.kafka.options),
            Self::Ingest(args) => Some(&mut args.kafka),
            Self::Status(args) => Some(&mut args.kafka),
            Self::Prune(args) => Some(&mut args.kafka.options),
            Self::DeadLetters(DeadLettersCommand::Replay { kafka, .. }) => Some(kafka),
            _ => None,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Read the file (--config or REPLAYPROOF_CONFIG), replace its ${VARIABLES}, check every
    /// setting, and print the effective settings with where each came from. Exits non-zero
    /// when the file or a setting is wrong.
    ///
    /// Then it connects as the commands would: each database answers and has every migration
    /// applied, each broker answers (with TLS and SASL as configured) and has the topic, the
    /// consumer's target URL resolves. It reports every problem, not the first, and exits
    /// non-zero when any command would not be ready.
    Check {
        /// Only the static check: read and parse, connect to nothing.
        #[arg(long)]
        no_connect: bool,
    },
}

/// The whole command line, with an application's own effects registered by name:
/// `replayproof::Cli::new().with_effect("orders", Orders).run()` is a complete `main`, whose
/// `consume --effect orders` and `events retry --effect orders` apply `Orders`.
#[derive(Default)]
pub struct Cli {
    effects: Registry,
    migrations: Vec<&'static str>,
}

impl Cli {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `effect` under `name` for `--effect`.
    pub fn with_effect(mut self, name: &str, effect: impl Effect) -> Self {
        self.effects = self.effects.with(name, effect);
        self
    }

    /// SQL that `migrate` runs after replayproof's own migrations, such as `CREATE TABLE IF
    /// NOT EXISTS` for an effect's tables; it must be safe to run again.
    pub fn with_migration(mut self, sql: &'static str) -> Self {
        self.migrations.push(sql);
        self
    }

    /// Parses the process's arguments, runs the command, and returns the exit code.
    pub fn run(self) -> std::process::ExitCode {
        let argv = std::env::args_os().collect();
        match parse(argv, &crate::config::ProcessEnv) {
            Ok(args) => main_with(self, args),
            // Help and the version go to stdout, as clap prints them.
            Err(LayerError::Clap(e)) if !e.use_stderr() => e.exit(),
            Err(LayerError::Clap(e)) => {
                // clap echoes a refused value verbatim, and a refused value may be a secret.
                eprint!("{}", crate::config::render_clap_error(&e));
                std::process::ExitCode::from(e.exit_code().clamp(0, 255) as u8)
            }
            Err(e @ LayerError::Config(_)) => {
                eprintln!("replayproof: {e}");
                std::process::ExitCode::from(2)
            }
        }
    }

    /// Runs a parsed command line to completion.
    pub async fn execute(&self, args: Args) -> anyhow::Result<()> {
        match args.command {
            Command::Migrate(args) => {
                crate::db::migrate_with(&args.pool(1)?, &self.migrations).await?;
                tracing::info!(schema = %args.session.schema, "Migrations applied.");
                Ok(())
            }
            Command::Consume(consume) => consume.run(&self.effects, args.file.as_ref()).await,
            Command::Ingest(ingest) => ingest.run(args.file.as_ref()).await,
            Command::Dispatch(args) => args.run().await,
            Command::Events(command) => command.run(&self.effects).await,
            Command::DeadLetters(command) => command.run().await,
            Command::Status(args) => args.run().await,
            Command::Prune(prune) => prune.run(args.file.as_ref()).await,
            Command::Config(ConfigCommand::Check { no_connect }) => {
                use clap::CommandFactory as _;
                let env = &crate::config::ProcessEnv;
                let file = args.file.as_ref();
                let mut report = crate::config_check::check(&Args::command(), file, env)?;
                if !no_connect {
                    report.problems +=
                        crate::config_check::connect(file, env, &mut report.text).await;
                }
                print!("{}", crate::secrets::scrub(&report.text));
                anyhow::ensure!(
                    report.problems == 0,
                    "the configuration has {} problem(s)",
                    report.problems
                );
                Ok(())
            }
            Command::Probe { url } => crate::telemetry::probe(&url).await,
            #[cfg(feature = "devkit")]
            Command::Demo(args) => args.run().await,
            #[cfg(feature = "devkit")]
            Command::Dev(dev) => {
                crate::devkit::dev::run(dev, args.file.as_ref(), &self.effects).await
            }
        }
    }
}

/// Sets up logging and the runtime, runs the command and turns its result into an exit code.
fn main_with(cli: Cli, args: Args) -> std::process::ExitCode {
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    match &args.command {
        // The demo speaks through its progress bars and report; only problems are logged.
        #[cfg(feature = "devkit")]
        Command::Demo(_) => crate::telemetry::init_logging_with("warn", args.log_format),
        #[cfg(feature = "devkit")]
        Command::Dev(_) => {
            crate::telemetry::init_logging_with(crate::devkit::dev::LOG_FILTER, args.log_format)
        }
        _ => crate::telemetry::init_logging(args.log_format),
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("replayproof: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(cli.execute(args));
    // A worker thread stuck in a call that never returns must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "replayproof stopped on an error.");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    /// Every flag of every command, with the command's path.
    fn flags() -> Vec<(Vec<String>, clap::Arg)> {
        let mut out = Vec::new();
        let mut stack = vec![(Vec::new(), Args::command())];
        while let Some((path, cmd)) = stack.pop() {
            for arg in cmd.get_arguments() {
                out.push((path.clone(), arg.clone()));
            }
            for sub in cmd.get_subcommands() {
                let mut p = path.clone();
                p.push(sub.get_name().to_owned());
                stack.push((p, sub.clone()));
            }
        }
        out
    }

    #[test]
    fn every_duration_flag_refuses_an_absurd_value_with_a_clear_error() {
        let humantime = ["defer-backoff", "defer-max-backoff", "defer-deadline"];
        let mut checked = 0;
        for (path, arg) in flags() {
            let Some(long) = arg.get_long() else { continue };
            let spelled_as_duration = arg
                .get_value_names()
                .is_some_and(|names| names.iter().any(|n| n == "DURATION"));
            let absurd = if humantime.contains(&long) || spelled_as_duration {
                "1000000000h"
            } else if long.ends_with("-ms") || long.ends_with("-secs") {
                "18446744073709551615"
            } else {
                continue;
            };
            let mut argv = vec!["replayproof".to_owned()];
            argv.extend(path.iter().cloned());
            argv.extend([format!("--{long}"), absurd.to_owned()]);
            let error = Args::command()
                .try_get_matches_from(&argv)
                .expect_err("refused");
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{argv:?}: {error}"
            );
            checked += 1;
        }
        assert!(checked >= 45, "only {checked} duration flags found");
    }

    #[test]
    fn a_refused_value_of_a_secret_flag_is_never_echoed() {
        let secret = "postgres://u:hunter2-secret@db/x?sslmode=nonsense";
        let error = Args::command()
            .try_get_matches_from(["replayproof", "migrate", "--database-url", secret])
            .expect_err("refused");
        let text = crate::config::render_clap_error(&error);
        assert!(text.contains("--database-url"), "{text}");
        assert!(!text.contains("hunter2-secret"), "{text}");
        // Other flags still show the value they refused, which helps find the typo.
        let error = Args::command()
            .try_get_matches_from(["replayproof", "dispatch", "--lease-secs", "soon"])
            .expect_err("refused");
        assert!(crate::config::render_clap_error(&error).contains("soon"));
    }
}
