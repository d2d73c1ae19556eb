//! `events resolve KEY --as done|dead`: settle an event's operations (or failed claim) by hand.

use super::super::events::Resolution;
use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The event's key.
    key: String,
    /// What the operations (or the failed claim) become.
    #[arg(long = "as", value_enum)]
    to: Resolution,
    /// Only this operation of the event.
    #[arg(long)]
    operation: Option<String>,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl ResolveArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        desk.pool_for(&self.key).await?;
        let act = self.op.act(&self.reason);
        let changes = desk
            .resolve(&self.key, self.operation.as_deref(), self.to, &act)
            .await?;
        render::print(self.op.json, &changes, |c| render::changes(c));
        Ok(())
    }
}
