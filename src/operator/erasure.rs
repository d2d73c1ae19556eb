//! `events erase`: which databases an erasure runs on, and what it reports. What is erased,
//! and where, is [`crate::retention::erase`]'s.

use super::args::OperatorArgs;
use super::render;
use crate::retention::erase::{self, Erased};

/// `events erase`: one key, or the events of a source whose payload matches.
pub(super) async fn run(
    op: OperatorArgs,
    key: Option<String>,
    source: Option<String>,
    matching: Option<(String, String)>,
    reason: &str,
) -> anyhow::Result<()> {
    // Each database erases the keys it holds; dead letters are on the first, whatever --shard.
    let act = op.act(reason);
    let first = op.first().await?;
    let erased = match (key, source, matching) {
        (Some(key), _, _) => {
            let pool = op.database.pool_holding_key(&key, 2).await?;
            erase::erase_key(pool.as_ref(), &first, &key, &act).await?
        }
        (None, Some(source), Some((field, value))) => {
            let databases = op.databases().await?;
            erase::erase_matching(&first, &databases, &source, &field, &value, &act).await?
        }
        _ => anyhow::bail!("give --key, or --source with --match"),
    };
    render::print(op.json, &erased, report);
    anyhow::ensure!(
        erased.refused.is_empty() && erased.unsearched.is_empty(),
        "{} event(s) were not erased, {} place(s) could not be searched",
        erased.refused.len(),
        erased.unsearched.len()
    );
    Ok(())
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
