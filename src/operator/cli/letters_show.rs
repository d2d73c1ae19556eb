//! `dead-letters show ID`: one dead letter with its raw key and value.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct LetterShowArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The dead letter's id, as `dead-letters list` shows it.
    id: i64,
}

impl LetterShowArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let letter = self.op.desk(registry).await?.letter(self.id).await?;
        render::print(self.op.json, &letter, render::row);
        Ok(())
    }
}
