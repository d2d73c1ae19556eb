//! `sources resume NAME --reason R`: the consumers apply the source's events again, and its
//! held events, each once, as the deferred applier takes them.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SourceResumeArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The source's name, as its events carry it.
    source: String,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl SourceResumeArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let act = self.op.act(&self.reason);
        let change = desk.resume_source(&self.source, &act).await?;
        render::print(self.op.json, &[change], |c| render::changes(c));
        Ok(())
    }
}
