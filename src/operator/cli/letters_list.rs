//! `dead-letters list`: dead letters, newest first, a page at a time.

use super::super::render;
use super::{OperatorArgs, DEFAULT_LIST_LIMIT};
use crate::claims::dead_letters::LetterSearch;
use crate::effect::Registry;
use clap::Args;

/// Which dead letters a list or a bulk replay takes.
#[derive(Debug, Clone, Args)]
pub struct LetterSelect {
    /// Only those stored at or after this moment: an RFC 3339 time or a duration ago (2h).
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only those whose reason is LIKE this pattern (%not JSON%).
    #[arg(long, value_name = "PATTERN")]
    pub reason_like: Option<String>,
}

impl LetterSelect {
    pub(super) fn search(&self, limit: i64) -> LetterSearch {
        LetterSearch {
            since: self.since,
            reason_like: self.reason_like.clone(),
            limit,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct LetterListArgs {
    #[command(flatten)]
    op: OperatorArgs,
    #[command(flatten)]
    select: LetterSelect,
    /// Only those never replayed.
    #[arg(long)]
    not_replayed: bool,
    /// The page after this id: the last id of the previous page.
    #[arg(long, value_name = "ID")]
    before: Option<i64>,
    /// The most rows shown.
    #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
    limit: i64,
}

impl LetterListArgs {
    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let search = LetterSearch {
            not_replayed: self.not_replayed,
            before_id: self.before,
            ..self.select.search(self.limit)
        };
        let letters = self.op.desk(registry).await?.letters(&search).await?;
        render::print(self.op.json, &letters, |l| render::rows(l));
        if letters.len() as i64 == self.limit {
            if let Some(last) = letters.last() {
                eprintln!("next page: --before {}", last.id);
            }
        }
        Ok(())
    }
}
