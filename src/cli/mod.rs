//! The command line: which command runs which role. Each role owns its flags (`args.rs` in its
//! module); this file only routes, and lets an application register its own effects.
//! `config_check` is `replayproof config check`, which parses every command of this command
//! line as it would start.

mod config_check;
mod file_keys;

pub(crate) use file_keys::file_keys;

use crate::args::KafkaOptions;
use crate::config::{ConfigFile, Env, LayerError};
use crate::consume::args::ConsumeArgs;
use crate::dispatch::args::DispatchArgs;
use crate::effect::{Effect, Registry};
use crate::ingest::args::IngestArgs;
use crate::operator::cli::{
    DeadLettersCommand, DestinationsCommand, EventsCommand, SourcesCommand, StatusArgs,
};
use clap::{Parser, Subcommand};
use std::ffi::OsString;

/// Makes webhook redeliveries harmless: one visible effect per event, whatever is redelivered.
#[derive(Debug, Parser)]
#[command(name = "replayproof", version, about, long_about = None)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,

    /// The configuration file every command reads (see replayproof.example.toml): sections
    /// [kafka], [database], [consume], [dispatch], [ingest], [retention] and [console]. A flag, then its environment
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
    let layered = crate::config::layered(Args::command(), &file_keys(), argv, env)?;
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
    /// Apply the database migrations on every database and exit; --citus also distributes the
    /// tables on a Citus coordinator.
    Migrate(crate::shard::args::MigrateArgs),
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
    /// Pause and resume destinations, and list them with their breakers and backlogs.
    #[command(subcommand)]
    Destinations(DestinationsCommand),
    /// Pause and resume sources: a paused source's events are held until it is resumed.
    #[command(subcommand)]
    Sources(SourcesCommand),
    /// One screen for an operator: lag, claims, the outbox and dead letters.
    Status(StatusArgs),
    /// The operator's console in a browser: every event's story, the overview, and retry,
    /// resolve and replay behind a login (`[console]` in the configuration file).
    Console(crate::console::args::ConsoleArgs),
    /// Read a window of the topic again, outside the live group, through the claim path: only
    /// events with no claim are applied; --dry-run counts them.
    Replay(crate::operator::cli::ReplayArgs),
    /// Check the shards' schema against the sharding rules, or locate a route key's shard.
    #[command(subcommand)]
    Shards(crate::shard::args::ShardsCommand),
    /// Delete settled claims older than their source's retention, with their operations, and
    /// the other tables' rows past their lifetimes; --dry-run prints what would go.
    Prune(crate::retention::args::PruneArgs),
    /// Check the configuration file and print the settings every command would run with,
    /// secrets redacted.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Exit 0 when the URL answers 2xx: a health check for images without curl.
    Probe {
        /// The URL to ask, for example http://127.0.0.1:9464/readyz.
        url: String,
    },
    /// Print the completion script of a shell for this command line, for example
    /// `replayproof completions bash > /etc/bash_completion.d/replayproof`.
    Completions {
        /// The shell the script is for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the manual pages, replayproof(1) and one for each command
    /// (replayproof-consume(1), replayproof-events-retry(1), …), into a directory; without
    /// --out-dir, print replayproof(1) to stdout.
    Man {
        /// The directory the pages are written into, for example /usr/local/share/man/man1.
        #[arg(long, value_name = "DIR")]
        out_dir: Option<std::path::PathBuf>,
    },
    /// The whole promise end to end with no services: a storm of signed webhooks, a consumer
    /// killed mid-stream, a flaky downstream, and a report that every event had one effect.
    #[cfg(feature = "devkit")]
    Demo(crate::devkit::demo::DemoArgs),
    /// Ingest, consume and dispatch in one process for local development, on an embedded
    /// broker and database unless real ones are configured, applying this binary's effects
    /// (--effect) after its migrations.
    #[cfg(feature = "devkit")]
    Dev(crate::devkit::dev::DevArgs),
}

impl Command {
    /// The command's name, as its traces name the service (`replayproof-ingest`).
    fn name(&self) -> &'static str {
        match self {
            Self::Migrate(_) => "migrate",
            Self::Consume(_) => "consume",
            Self::Ingest(_) => "ingest",
            Self::Dispatch(_) => "dispatch",
            Self::Events(_) => "events",
            Self::DeadLetters(_) => "dead-letters",
            Self::Destinations(_) => "destinations",
            Self::Sources(_) => "sources",
            Self::Status(_) => "status",
            Self::Console(_) => "console",
            Self::Replay(_) => "replay",
            Self::Prune(_) => "prune",
            Self::Shards(_) => "shards",
            Self::Config(_) => "config",
            Self::Probe { .. } => "probe",
            Self::Completions { .. } => "completions",
            Self::Man { .. } => "man",
            #[cfg(feature = "devkit")]
            Self::Demo(_) => "demo",
            #[cfg(feature = "devkit")]
            Self::Dev(_) => "dev",
        }
    }

    /// The librdkafka properties of the commands that have them.
    fn kafka_options(&mut self) -> Option<&mut KafkaOptions> {
        match self {
            Self::Consume(args) => Some(&mut args.kafka.options),
            Self::Ingest(args) => Some(&mut args.kafka),
            Self::Status(args) => Some(&mut args.kafka),
            Self::Console(args) => Some(&mut args.kafka),
            Self::Replay(args) => Some(&mut args.consume.kafka.options),
            Self::Prune(args) => Some(&mut args.kafka.options),
            // The output relay's producer and read-back reader.
            Self::Dispatch(args) => Some(&mut args.relay.options),
            Self::DeadLetters(DeadLettersCommand::Replay(args)) => Some(&mut args.kafka),
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
                eprintln!("error: {}", crate::secrets::scrub(&e.to_string()));
                std::process::ExitCode::from(2)
            }
        }
    }

    /// Runs a parsed command line to completion.
    pub async fn execute(&self, args: Args) -> anyhow::Result<()> {
        match args.command {
            Command::Migrate(args) => args.run(&self.migrations).await,
            Command::Shards(command) => command.run().await,
            Command::Consume(consume) => consume.run(&self.effects, args.file.as_ref()).await,
            Command::Ingest(ingest) => ingest.run(args.file.as_ref()).await,
            Command::Dispatch(dispatch) => dispatch.run(args.file.as_ref()).await,
            Command::Events(command) => command.run(&self.effects).await,
            Command::DeadLetters(command) => command.run(&self.effects).await,
            Command::Destinations(command) => command.run(&self.effects).await,
            Command::Sources(command) => command.run(&self.effects).await,
            Command::Status(args) => args.run(&self.effects).await,
            Command::Console(console) => console.run(&self.effects, args.file.as_ref()).await,
            Command::Replay(replay) => replay.run(&self.effects, args.file.as_ref()).await,
            Command::Prune(prune) => prune.run(args.file.as_ref()).await,
            Command::Config(ConfigCommand::Check { no_connect }) => {
                use clap::CommandFactory as _;
                let env = &crate::config::ProcessEnv;
                let file = args.file.as_ref();
                let mut report = config_check::check(&Args::command(), file, env)?;
                if !no_connect {
                    report.problems += config_check::connect(file, env, &mut report.text).await;
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
            Command::Completions { shell } => {
                let mut script = Vec::new();
                completions(shell, &program_name(), &mut script);
                to_stdout(&script)
            }
            Command::Man { out_dir } => man(out_dir.as_deref()),
            #[cfg(feature = "devkit")]
            Command::Demo(args) => args.run().await,
            #[cfg(feature = "devkit")]
            Command::Dev(dev) => {
                let file = args.file.as_ref();
                crate::devkit::dev::run(dev, file, &self.effects, &self.migrations).await
            }
        }
    }
}

/// The completion script of `shell` for the whole command line, for the program `name`.
pub fn completions(shell: clap_complete::Shell, name: &str, out: &mut dyn std::io::Write) {
    use clap::CommandFactory as _;
    clap_complete::generate(shell, &mut Args::command(), name, out);
}

/// The name this binary was run as (`replayproof`, or an application's own built on [`Cli`]).
fn program_name() -> String {
    std::env::args_os()
        .next()
        .as_deref()
        .and_then(|path| std::path::Path::new(path).file_name())
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "replayproof".into())
}

/// Writes the manual pages into `out_dir`, or replayproof(1) to stdout.
pub fn man(out_dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use clap::CommandFactory as _;
    let command = Args::command();
    match out_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(command, dir)
                .with_context(|| format!("writing the manual pages into {}", dir.display()))
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(command).render(&mut page)?;
            to_stdout(&page).context("writing the manual page to stdout")
        }
    }
}

/// Writes `text` to stdout; a reader that went away (`| head -1`) ends it quietly.
fn to_stdout(text: &[u8]) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        written => Ok(written?),
    }
}

/// What a command that failed prints: one line, `error:` then the error and its causes, with
/// no secret in it. With `--log-format json` it is one JSON log object instead, for a log
/// pipeline.
pub fn report_error(error: &anyhow::Error, format: LogFormat) {
    match format {
        LogFormat::Json => {
            tracing::error!(error = causes(error), "replayproof stopped on an error.")
        }
        LogFormat::Text => eprintln!("{}", error_line(error)),
    }
}

/// `error: what failed: why: …`, secrets scrubbed.
pub fn error_line(error: &anyhow::Error) -> String {
    format!("error: {}", causes(error))
}

/// The error and its causes on one line, each after a colon, secrets scrubbed. A cause that its
/// error's own message already ends with (sqlx's "error communicating with database: Connection
/// refused", then the I/O error again) is said once.
fn causes(error: &anyhow::Error) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in error.chain() {
        let text = cause.to_string().replace('\n', " ");
        if said.last().is_some_and(|last| last.ends_with(&text)) {
            continue;
        }
        said.push(text);
    }
    crate::secrets::scrub(&said.join(": ")).into_owned()
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
        command => crate::telemetry::init_telemetry(
            "info,sqlx=warn,rdkafka=warn",
            args.log_format,
            &format!("replayproof-{}", command.name()),
        ),
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let log_format = args.log_format;
    let result = runtime.block_on(cli.execute(args));
    crate::trace::shutdown();
    // A worker thread stuck in a call that never returns must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            report_error(&e, log_format);
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

    /// Every command, with its path, the whole tree built as the binary builds it.
    fn commands() -> Vec<(Vec<String>, clap::Command)> {
        let mut root = Args::command();
        root.build();
        let mut out = Vec::new();
        let mut stack = vec![(Vec::new(), root)];
        while let Some((path, cmd)) = stack.pop() {
            for sub in cmd.get_subcommands() {
                let mut p = path.clone();
                p.push(sub.get_name().to_owned());
                stack.push((p, sub.clone()));
            }
            out.push((path, cmd));
        }
        out
    }

    #[test]
    fn every_command_and_every_argument_says_what_it_is_for() {
        let mut missing = Vec::new();
        let mut seen = 0;
        for (path, cmd) in commands() {
            if !path.is_empty() && cmd.get_about().is_none() && !cmd.is_hide_set() {
                missing.push(format!("{path:?}: the command"));
            }
            for arg in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
                seen += 1;
                let help = arg.get_help().or(arg.get_long_help());
                if help.is_none_or(|h| h.to_string().trim().is_empty()) {
                    missing.push(format!("{path:?}: {}", arg.get_id()));
                }
            }
        }
        assert!(seen > 200, "only {seen} arguments found");
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }

    #[test]
    fn consume_groups_its_flags_under_headings() {
        let (_, consume) = commands()
            .into_iter()
            .find(|(path, _)| path == &["consume"])
            .expect("consume");
        let headings = [
            "Kafka",
            "Input",
            "Database",
            "Effects",
            "Batches",
            "Deferral",
            "Retention",
            "Process",
        ];
        let mut used = std::collections::BTreeSet::new();
        for arg in consume.get_arguments().filter(|a| !a.is_hide_set()) {
            let id = arg.get_id().as_str();
            // The global flags, and clap's own --help, stay under the plain "Options".
            if ["config", "log_format", "help"].contains(&id) {
                continue;
            }
            let heading = arg.get_help_heading();
            assert!(
                heading.is_some_and(|h| headings.contains(&h)),
                "--{id} is under {heading:?}"
            );
            used.insert(heading.unwrap());
        }
        assert_eq!(used.len(), headings.len(), "{used:?}");
        // The help shows them in that order, each once.
        let help = consume.clone().render_help().to_string();
        let at: Vec<usize> = headings
            .iter()
            .map(|h| help.find(&format!("\n{h}:\n")).expect(h))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{help}");
    }

    #[test]
    fn an_error_is_one_line_with_its_causes_and_no_secret() {
        crate::secrets::register("hunter2-in-an-error");
        let error = anyhow::anyhow!("connection refused")
            .context("connecting as postgres://app:hunter2-in-an-error@db/x")
            .context("applying the migrations");
        let line = error_line(&error);
        assert_eq!(
            line,
            "error: applying the migrations: connecting as postgres://app:<redacted>@db/x: \
             connection refused"
        );
        let multi = error_line(&anyhow::anyhow!("first\nsecond"));
        assert_eq!(multi.lines().count(), 1, "{multi}");
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let repeated = anyhow::Error::new(sqlx::Error::Io(io)).context("connecting");
        assert_eq!(
            error_line(&repeated),
            "error: connecting: error communicating with database: refused"
        );
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
