//! `sources pause NAME --reason R`: ingest keeps accepting the source's deliveries, and the
//! consumers hold its events (claimed and deferred, their effect not run) until it is resumed.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SourcePauseArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The source's name, as its events carry it (`stripe`).
    source: String,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl SourcePauseArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let act = self.op.act(&self.reason);
        let change = desk.pause_source(&self.source, &act).await?;
        render::print(self.op.json, &[change], |c| render::changes(c));
        if !desk.source_seen(&self.source).await? {
            eprintln!(
                "warning: no event of source {:?} is claimed on any database: if the name is \
                 mistyped, this pause holds nothing (`sources resume` undoes it)",
                self.source.trim()
            );
        }
        Ok(())
    }
}
