//! `events erase`: which databases an erasure runs on, and what it reports. What is erased,
//! and where, is [`crate::retention::erase`]'s.

use super::super::render;
use super::OperatorArgs;
use crate::effect::Registry;
use crate::retention::erase::{self, Erased};
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct EraseArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// The event whose payloads go.
    #[arg(long, required_unless_present = "source", conflicts_with = "source")]
    key: Option<String>,
    /// Every event of this source whose stored payload matches --match.
    #[arg(long, requires = "matching")]
    source: Option<String>,
    /// FIELD=VALUE, FIELD a dotted path into the payload (customer, data.object.customer).
    #[arg(long = "match", id = "matching", value_name = "FIELD=VALUE", value_parser = crate::args::parse_key_value, requires = "source")]
    matching: Option<(String, String)>,
    /// Why, for the audit table.
    #[arg(long)]
    reason: String,
}

impl EraseArgs {
    /// One key, or the events of a source whose payload matches.
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        // Each database erases the keys it holds; dead letters are on the first, whatever --shard.
        let act = self.op.act(&self.reason);
        let desk = self.op.desk(registry).await?;
        let first = desk.first();
        let erased = match (self.key, self.source, self.matching) {
            (Some(key), _, _) => {
                let pool = desk.holding(&key).await?;
                erase::erase_key(pool.as_ref(), first, &key, &act).await?
            }
            (None, Some(source), Some((field, value))) => {
                let databases = desk.databases();
                erase::erase_matching(first, databases, &source, &field, &value, &act).await?
            }
            _ => anyhow::bail!("give --key, or --source with --match"),
        };
        render::print(self.op.json, &erased, report);
        anyhow::ensure!(
            erased.refused.is_empty() && erased.unsearched.is_empty(),
            "{} event(s) were not erased, {} place(s) could not be searched",
            erased.refused.len(),
            erased.unsearched.len()
        );
        Ok(())
    }
}

/// An erasure as text: a line a key, dead letter and place not searched, then the counts.
fn report(e: &Erased) -> String {
    let mut out = String::new();
    for key in &e.erased {
        out.push_str(&format!("{key}: payloads erased\n"));
    }
    for (key, why) in &e.refused {
        out.push_str(&format!("{key}: refused: {why}\n"));
    }
    for id in &e.dead_letters {
        out.push_str(&format!("dead letter {id}: bytes erased\n"));
    }
    for blind in &e.unsearched {
        out.push_str(&format!("not searched: {blind}\n"));
    }
    out.push_str(&format!(
        "{} erased, {} refused, {} dead letter(s) erased\n",
        e.erased.len(),
        e.refused.len(),
        e.dead_letters.len()
    ));
    out
}
