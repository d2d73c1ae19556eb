//! `events list`: a page of the events a search selects, newest first.

use super::super::render;
use super::super::search::{Cursor, Search, SearchState};
use super::{OperatorArgs, DEFAULT_LIST_LIMIT};
use crate::effect::Registry;
use clap::Args;
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct ListArgs {
    #[command(flatten)]
    op: OperatorArgs,
    /// A claim status (done, failed) or an operation state (pending, in_progress,
    /// retryable, uncertain, done, failed, dead), or `conflict` for events with a key
    /// conflict.
    #[arg(long)]
    state: Option<SearchState>,
    /// Only events of this source.
    #[arg(long)]
    source: Option<String>,
    /// Only events of this type (payment_intent.succeeded).
    #[arg(long = "type", value_name = "TYPE")]
    event_type: Option<String>,
    /// Only this key, or the keys starting with it when it ends with `*` (stripe:evt_1*).
    #[arg(long)]
    key: Option<String>,
    /// Only events claimed at or after this moment: an RFC 3339 time or a duration ago
    /// (2026-12-02T10:00:00Z, 40m).
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events claimed before this moment, as --since.
    #[arg(long, value_name = "WHEN", value_parser = crate::args::parse_moment)]
    until: Option<chrono::DateTime<chrono::Utc>>,
    /// The page after this cursor, as the previous page printed it.
    #[arg(long, value_name = "CURSOR")]
    after: Option<Cursor>,
    /// Only events claimed at least this long ago: a duration such as 30m, 2h or 3days
    /// (`--older-than-secs` is its old spelling, in seconds).
    #[arg(long, value_name = "DURATION", value_parser = crate::args::age(), conflicts_with = "older_than_secs")]
    older_than: Option<Duration>,
    /// The old spelling of `--older-than`, in seconds.
    #[arg(long, value_parser = crate::args::age_secs(), hide = true)]
    older_than_secs: Option<u64>,
    /// The most rows shown.
    #[arg(long, default_value_t = DEFAULT_LIST_LIMIT)]
    limit: i64,
}

impl ListArgs {
    /// The search these flags ask for.
    fn search(&self) -> Search {
        let older_than = self
            .older_than
            .or(self.older_than_secs.map(Duration::from_secs));
        let aged = older_than
            .map(|age| chrono::Utc::now() - chrono::Duration::from_std(age).unwrap_or_default());
        Search {
            key: self.key.clone(),
            source: self.source.clone(),
            event_type: self.event_type.clone(),
            state: self.state,
            since: self.since,
            until: [self.until, aged].into_iter().flatten().min(),
            after: self.after.clone(),
            limit: self.limit,
        }
    }

    pub(super) async fn run(self, registry: &Registry) -> anyhow::Result<()> {
        let page = self.op.desk(registry).await?.search(&self.search()).await?;
        render::print(self.op.json, &page.events, |e| render::rows(e));
        // On stderr, so that the JSON and the table stay the list alone.
        if let Some(next) = &page.next {
            eprintln!("next page: --after {next}");
        }
        Ok(())
    }
}
