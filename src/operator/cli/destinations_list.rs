//! `destinations list`: every known destination with its pause, breaker, requests in flight and
//! backlog.

use super::super::render;
use super::OperatorArgs;
use crate::destinations::DestinationRow;
use crate::effect::Registry;
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DestinationListArgs {
    #[command(flatten)]
    op: OperatorArgs,
}

/// One destination as a table's row.
#[derive(serde::Serialize)]
struct Line<'a> {
    origin: &'a str,
    state: String,
    breaker: &'static str,
    in_flight: i64,
    backlog: i64,
}

impl<'a> From<&'a DestinationRow> for Line<'a> {
    fn from(d: &'a DestinationRow) -> Self {
        let state = match &d.pause {
            None => "running".into(),
            Some(p) => {
                let until = p.until.map(|u| format!(" until {}", u.to_rfc3339()));
                format!(
                    "paused by {}{}: {}",
                    p.by,
                    until.unwrap_or_default(),
                    p.reason
                )
            }
        };
        Self {
            origin: &d.origin,
            state,
            breaker: d.breaker.as_str(),
            in_flight: d.in_flight,
            backlog: d.backlog,
        }
    }
}

impl DestinationListArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let desk = self.op.desk(registry).await?;
        let destinations = desk.destinations().await?;
        render::print(self.op.json, &destinations, |d| {
            render::rows(&d.iter().map(Line::from).collect::<Vec<_>>())
        });
        Ok(())
    }
}
