//! `events expired`: the expired replays waiting for an operator.

use super::super::render;
use super::{OperatorArgs, DEFAULT_LIST_LIMIT};
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ExpiredArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// Also those already applied or dropped.
    #[arg(long)]
    all: bool,
    /// The most rows shown.
    #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
    limit: i64,
}

impl ExpiredArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let rows = desk.expired(self.all, self.limit).await?;
        render::print(self.op.json, &rows, |r| render::rows(r));
        Ok(())
    }
}
