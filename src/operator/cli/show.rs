//! `events show KEY`: everything known about one event.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The event's key, as `events list` shows it (stripe:evt_…).
    key: String,
}

impl ShowArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        // Refused when no shard holds it, before the detail is looked for.
        desk.pool_for(&self.key).await?;
        let detail = desk.show(&self.key).await?;
        render::print(self.op.json, &detail, render::event_detail);
        Ok(())
    }
}
