//! `events apply-expired KEY`: apply an expired replay once, audited.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ApplyExpiredArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The key of the expired replay, as `events expired` shows it.
    key: String,
    /// The effect to run, by name as for `consume --effect`, instead of the one recorded.
    #[arg(long)]
    effect: Option<String>,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl ApplyExpiredArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let given = self
            .effect
            .map(|name| registry.build(std::slice::from_ref(&name), None))
            .transpose()?;
        let desk = self.op.desk(registry).await?;
        desk.pool_for(&self.key).await?;
        let act = self.op.act(&self.reason);
        let changes = desk.apply_expired(&self.key, given, &act).await?;
        render::print(self.op.json, &changes, |c| render::changes(c));
        Ok(())
    }
}
