//! The operator's commands, one file each: `events …`, `dead-letters …`, `destinations …`,
//! `sources …`, `status` and `replay`.
//! Each command's flags are its own; its `run` builds the [`Desk`] and makes one call on it.

mod apply_expired;
mod destinations_list;
mod destinations_pause;
mod destinations_resume;
mod drop_expired;
mod erase;
mod expired;
mod letters_list;
mod letters_replay;
mod letters_show;
mod list;
mod replay;
mod resolve;
mod retry;
mod show;
mod sources_list;
mod sources_pause;
mod sources_resume;
mod status;

pub use apply_expired::ApplyExpiredArgs;
pub use destinations_list::DestinationListArgs;
pub use destinations_pause::DestinationPauseArgs;
pub use destinations_resume::DestinationResumeArgs;
pub use drop_expired::DropExpiredArgs;
pub use erase::EraseArgs;
pub use expired::ExpiredArgs;
pub use letters_list::{LetterListArgs, LetterSelect};
pub use letters_replay::LetterReplayArgs;
pub use letters_show::LetterShowArgs;
pub use list::ListArgs;
pub use replay::ReplayArgs;
pub use resolve::ResolveArgs;
pub use retry::RetryArgs;
pub use show::ShowArgs;
pub use sources_list::SourceListArgs;
pub use sources_pause::SourcePauseArgs;
pub use sources_resume::SourceResumeArgs;
pub use status::StatusArgs;

use super::{Act, Desk, DeskSettings};
use crate::args::DatabaseArgs;
use crate::effect::Registry;
use clap::{Args, Subcommand};

/// What every operator command takes: the database, who acts, and the output's form.
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

/// The actor `--actor` names, or `$USER`, or `operator`.
pub(crate) fn actor(given: Option<&str>) -> String {
    given
        .map(Into::into)
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "operator".into())
}

impl OperatorArgs {
    pub(crate) fn act(&self, reason: &str) -> Act {
        Act::new(&actor(self.actor.as_deref()), reason)
    }

    /// The desk over the databases these flags name, with `registry`'s effects and no broker.
    pub(crate) async fn desk(&self, registry: &Registry) -> anyhow::Result<Desk> {
        self.desk_with(registry, None, None).await
    }

    /// The desk, with the brokers dead letters are produced through (and the topic they go to
    /// instead of their own).
    pub(crate) async fn desk_with(
        &self,
        registry: &Registry,
        kafka: Option<super::status::KafkaTarget>,
        letters_to: Option<String>,
    ) -> anyhow::Result<Desk> {
        let shards = self.database.open_shards(2).await?;
        let only = match self.database.shard {
            Some(_) => Some(self.database.open_pool(2).await?),
            None => None,
        };
        Desk::build(DeskSettings {
            shards,
            only,
            registry: registry.clone(),
            kafka,
            letters_to,
            replay: None,
        })
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
    List(ListArgs),
    /// Everything about one event: its claim, effect rows, operations, every attempt, dead
    /// letters and key conflicts.
    Show(ShowArgs),
    /// Send a failed, uncertain or dead operation again with the same idempotency key, or run a
    /// failed local effect again from its stored payload.
    Retry(RetryArgs),
    /// Settle an event's operations (or failed claim) by hand.
    Resolve(ResolveArgs),
    /// List expired replays: events that arrived after their key could have been pruned, kept
    /// unapplied for an operator.
    Expired(ExpiredArgs),
    /// Apply an expired replay once: claim its key and run its effect, audited.
    ApplyExpired(ApplyExpiredArgs),
    /// Drop an expired replay: never applied, audited.
    DropExpired(DropExpiredArgs),
    /// Erase the payloads of settled events (one key, or a data subject's events of a source),
    /// keeping the key, the hash and the status so a redelivery is still a replay. Audited;
    /// refused for events that are not settled.
    Erase(EraseArgs),
}

impl EventsCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List(args) => args.run(registry).await,
            Self::Show(args) => args.run(registry).await,
            Self::Retry(args) => args.run(registry).await,
            Self::Resolve(args) => args.run(registry).await,
            Self::Expired(args) => args.run(registry).await,
            Self::ApplyExpired(args) => args.run(registry).await,
            Self::DropExpired(args) => args.run(registry).await,
            Self::Erase(args) => args.run(registry).await,
        }
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum DeadLettersCommand {
    /// List dead letters, newest first.
    List(LetterListArgs),
    /// One dead letter with its raw key and value.
    Show(LetterShowArgs),
    /// Produce dead letters' raw bytes again, to their topic or another: one by id, or in bulk
    /// every letter never replayed that --all, --since or --reason-like selects.
    Replay(LetterReplayArgs),
}

impl DeadLettersCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List(args) => args.run(registry).await,
            Self::Show(args) => args.run(registry).await,
            Self::Replay(args) => args.run(registry).await,
        }
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum DestinationsCommand {
    /// Every known destination: its pause, circuit breaker, requests in flight and backlog.
    List(DestinationListArgs),
    /// Send nothing to a destination until it is resumed (or --until has passed): its
    /// operations wait without spending attempts. Audited.
    Pause(DestinationPauseArgs),
    /// Send to a paused destination again. Audited.
    Resume(DestinationResumeArgs),
}

impl DestinationsCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List(args) => args.run(registry).await,
            Self::Pause(args) => args.run(registry).await,
            Self::Resume(args) => args.run(registry).await,
        }
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum SourcesCommand {
    /// The paused sources: who paused each, when and why.
    List(SourceListArgs),
    /// Hold a source's events: ingest keeps accepting its deliveries, the consumers claim its
    /// events and defer them, their effect not run, until it is resumed. Audited.
    Pause(SourcePauseArgs),
    /// Apply a paused source's events again, the held ones each once. Audited.
    Resume(SourceResumeArgs),
}

impl SourcesCommand {
    pub async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        match self {
            Self::List(args) => args.run(registry).await,
            Self::Pause(args) => args.run(registry).await,
            Self::Resume(args) => args.run(registry).await,
        }
    }
}
