//! `destinations pause ORIGIN --reason R [--until DURATION]`: no dispatcher sends to the
//! destination until it is resumed (or the duration has passed); its operations wait, spending
//! no attempt.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use clap::Args;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct DestinationPauseArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The destination's origin (`https://api.stripe.com`), or any URL of it.
    origin: String,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
    /// The pause ends by itself after this long (`30m`, `2h`); without it, at `resume`.
    #[arg(long, value_name = "DURATION", value_parser = crate::args::wait(Duration::from_secs(1)))]
    until: Option<Duration>,
}

impl DestinationPauseArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let act = self.op.act(&self.reason);
        let change = desk
            .pause_destination(&self.origin, self.until, &act)
            .await?;
        render::print(self.op.json, &[change], |c| render::changes(c));
        Ok(())
    }
}
