//! The deferral flags (`--defer-*`): how an event an effect deferred waits before it is applied
//! again. `consume` and the console's replay by time read them alike, from `[consume]`.

use super::args::parse_duration;
use super::settle::DeferSettings;
use crate::effect::DeferPolicy;
use clap::Args;
use std::time::Duration;

/// How deferred events wait, as `consume` applies them.
#[derive(Debug, Clone, Args)]
pub struct DeferArgs {
    /// After an effect first says "not yet" (defers its event), how long until it is applied
    /// again; doubled after each further deferral (for example 30s, 5m).
    #[arg(help_heading = "Deferral", long, env = "REPLAYPROOF_DEFER_BACKOFF", default_value = "10s", value_parser = parse_duration)]
    pub defer_backoff: Duration,

    /// The longest wait between two attempts at a deferred event.
    #[arg(help_heading = "Deferral", long, env = "REPLAYPROOF_DEFER_MAX_BACKOFF", default_value = "10m", value_parser = parse_duration)]
    pub defer_max_backoff: Duration,

    /// How long after its first deferral an event may still be deferred; then it is settled
    /// failed with its reason, for an operator.
    #[arg(help_heading = "Deferral", long, env = "REPLAYPROOF_DEFER_DEADLINE", default_value = "24h", value_parser = parse_duration)]
    pub defer_deadline: Duration,

    /// The deferral policy of one source, over the effect's own and the defaults:
    /// SOURCE=DEADLINE, optionally followed by ,BACKOFF and ,MAX_BACKOFF; for example
    /// stripe=72h or github=1h,5s,1m. Repeatable.
    #[arg(
        help_heading = "Deferral",
        long = "defer-source",
        env = "REPLAYPROOF_DEFER_SOURCES",
        value_delimiter = ';',
        value_name = "SOURCE=DEADLINE[,BACKOFF[,MAX]]"
    )]
    pub defer_sources: Vec<String>,

    /// How often due deferred events are looked for.
    /// A duration such as 250ms, 30s or 5m; `--defer-poll-ms` (milliseconds) is its old spelling.
    #[arg(help_heading = "Deferral", long, env = "REPLAYPROOF_DEFER_POLL", value_name = "DURATION", default_value = crate::args::text(super::DEFAULT_DEFER_POLL), value_parser = crate::args::wait(Duration::from_millis(1)), conflicts_with = "defer_poll_ms")]
    pub defer_poll: Duration,

    /// The old spelling of `--defer-poll`, in milliseconds.
    #[arg(help_heading = "Deferral", long, env = "REPLAYPROOF_DEFER_POLL_MS", value_parser = crate::args::ms(1), hide = true)]
    pub defer_poll_ms: Option<u64>,
}

impl DeferArgs {
    /// The deferral settings these flags give.
    pub fn settings(&self) -> anyhow::Result<DeferSettings> {
        let default = DeferPolicy {
            backoff: self.defer_backoff,
            max_backoff: self.defer_max_backoff,
            deadline: self.defer_deadline,
        };
        let sources = self
            .defer_sources
            .iter()
            .map(|s| super::args::parse_defer_source(s, default).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<_>>()?;
        Ok(DeferSettings {
            default,
            sources,
            poll_interval: crate::args::or_old_ms(self.defer_poll, self.defer_poll_ms),
        })
    }
}
