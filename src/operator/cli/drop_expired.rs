//! `events drop-expired KEY`: drop an expired replay, never applied, audited.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DropExpiredArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The key of the expired replay, as `events expired` shows it.
    key: String,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl DropExpiredArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        desk.pool_for(&self.key).await?;
        let changes = desk
            .drop_expired(&self.key, &self.op.act(&self.reason))
            .await?;
        render::print(self.op.json, &changes, |c| render::changes(c));
        Ok(())
    }
}
