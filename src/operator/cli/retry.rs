//! `events retry`'s flags and how it runs: one event, or every event a filter takes, each
//! retried in its own database.

use super::super::events::{Retry, RetryFilter};
use super::super::render;
use super::super::search::StateName;
use super::super::{Act, Desk};
use super::{OperatorArgs, DEFAULT_RETRY_LIMIT};
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct RetryArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The event to retry; without it, every event matching --state (and --source, --since).
    #[arg(required_unless_present = "state")]
    key: Option<String>,
    /// Only this operation of the event.
    #[arg(long)]
    operation: Option<String>,
    /// The effect to run again for a failed local effect, by its name as for `consume
    /// --effect`, instead of the effects recorded on its claim.
    #[arg(long)]
    effect: Option<String>,
    /// Bulk: retry every event whose claim or an operation is in this state.
    #[arg(long, value_parser = StateName::retryable, conflicts_with = "key")]
    state: Option<StateName>,
    /// Bulk: only events of this source.
    #[arg(long, requires = "state")]
    source: Option<String>,
    /// Bulk: only events claimed at or after this time (RFC 3339).
    #[arg(long, requires = "state")]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Bulk: at most this many events.
    #[arg(long, default_value_t = DEFAULT_RETRY_LIMIT, requires = "state")]
    limit: i64,
    /// Bulk: list the events that would be retried, and change nothing.
    #[arg(long, requires = "state")]
    dry_run: bool,
    /// Send operations past their destination's idempotency window too: the downstream no
    /// longer knows their key and could apply them twice. Recorded in the audit row.
    #[arg(long)]
    accept_duplicate_risk: bool,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl RetryArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let effect = self
            .effect
            .as_ref()
            .map(|name| registry.build(std::slice::from_ref(name), None));
        let retry = Retry {
            operation: self.operation.clone(),
            effect: effect.transpose()?,
            accept_duplicate_risk: self.accept_duplicate_risk,
        };
        let act = self.op.act(&self.reason);
        let desk = self.op.desk(registry).await?;
        let Some(state) = self.state else {
            let key = self.key.as_deref().unwrap_or_default();
            desk.pool_for(key).await?;
            let changes = desk.retry(key, &retry, &act).await?;
            render::print(self.op.json, &changes, |c| render::changes(c));
            return Ok(());
        };
        let filter = RetryFilter {
            state,
            source: self.source.clone(),
            since: self.since,
            limit: self.limit,
        };
        self.bulk(&desk, &filter, &retry, &act).await
    }

    /// Every shard's events of `filter`, each retried in its own database, or listed when
    /// this is a dry run.
    async fn bulk(
        &self,
        desk: &Desk,
        filter: &RetryFilter,
        retry: &Retry,
        act: &Act,
    ) -> anyhow::Result<()> {
        let keys = desk.to_retry(filter).await?;
        if self.dry_run {
            for (_, key) in &keys {
                println!("{key}: would be retried");
            }
            println!(
                "{} events would be retried (dry run: nothing changed)",
                keys.len()
            );
            return Ok(());
        }
        let mut failures = 0;
        for (pool, key) in &keys {
            match desk.retry_in(pool, key, retry, act).await {
                Ok(changes) => render::print(self.op.json, &changes, |c| render::changes(c)),
                Err(e) => {
                    failures += 1;
                    eprintln!("{key}: not retried: {e:#}");
                }
            }
        }
        anyhow::ensure!(
            failures == 0,
            "{failures} of {} events were not retried",
            keys.len()
        );
        Ok(())
    }
}
