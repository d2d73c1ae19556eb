//! `sources list`: the paused sources, who paused each, when and why.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use crate::sources::SourcePause;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct SourceListArgs {
    #[command(flatten)]
    op: OperatorArgs,
}

/// One paused source as a table's row.
#[derive(serde::Serialize)]
struct Line<'a> {
    source: &'a str,
    state: String,
    since: String,
}

impl<'a> From<&'a SourcePause> for Line<'a> {
    fn from(p: &'a SourcePause) -> Self {
        Self {
            source: &p.source,
            state: format!("paused by {}: {}", p.by, p.reason),
            since: p.at.to_rfc3339(),
        }
    }
}

impl SourceListArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let paused = desk.paused_sources().await?;
        render::print(self.op.json, &paused, |p| match p.is_empty() {
            true => "No source is paused.".into(),
            false => render::rows(&p.iter().map(Line::from).collect::<Vec<_>>()),
        });
        Ok(())
    }
}
