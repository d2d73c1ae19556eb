//! `dead-letters show ID`: one dead letter with its raw key, value and headers.

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
        let desk = self.op.desk(registry).await?;
        let letter = desk.letter(self.id).await?;
        let stored = desk.raw_letter(self.id).await?.and_then(|raw| raw.headers);
        let headers = crate::inputs::Headers::from_stored(stored.as_deref().unwrap_or_default());
        let shown = Shown {
            letter,
            headers: headers
                .iter()
                .map(|(name, value)| {
                    (
                        name.to_owned(),
                        value.map(|v| String::from_utf8_lossy(v).into_owned()),
                    )
                })
                .collect(),
        };
        render::print(self.op.json, &shown, render::row);
        Ok(())
    }
}

/// A letter with its headers, name and value (as text; null for a null value) in order: a
/// CloudEvent in binary mode carries its attributes there.
#[derive(serde::Serialize)]
struct Shown {
    #[serde(flatten)]
    letter: crate::claims::dead_letters::DeadLetterRow,
    headers: Vec<(String, Option<String>)>,
}
