//! `destinations resume ORIGIN --reason R`: the dispatchers send to the destination again, its
//! waiting operations first by when they were due.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DestinationResumeArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The destination's origin, or any URL of it.
    origin: String,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl DestinationResumeArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let act = self.op.act(&self.reason);
        let change = desk.resume_destination(&self.origin, &act).await?;
        render::print(self.op.json, &[change], |c| render::changes(c));
        Ok(())
    }
}
