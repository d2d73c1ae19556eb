//! The read model's event search: `events list` and the console's events page. Every field of
//! a [`Search`] narrows it; pages are cut by keyset on `(claimed_at, event_key)`, so a deep page
//! costs what the first does, over one database or several.

use super::OperatorError;
use crate::claims::ClaimStatus;
use crate::db::Db;
use crate::outbox::OutboxState;
use chrono::{DateTime, Utc};
use serde::Serialize;

/// A state `--state` names: a claim status or an operation state (`done`, `failed` and `dead`
/// are both, and parse as the claim's). An event is in it when its claim or any of its
/// operations is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateName {
    /// A claim status (also an operation state when the names agree).
    Claim(ClaimStatus),
    /// An operation state no claim has (`pending`, `retryable`, `uncertain`, …).
    Operation(OutboxState),
}

impl StateName {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim(status) => status.as_str(),
            Self::Operation(state) => state.as_str(),
        }
    }

    /// A state a bulk retry takes: `failed`, `uncertain`, `dead` or `deferred` (applied now
    /// rather than when due).
    pub fn retryable(s: &str) -> Result<Self, String> {
        let name: Self = s.parse()?;
        let by_hand = name
            .as_str()
            .parse::<OutboxState>()
            .is_ok_and(OutboxState::is_retryable_by_hand);
        match name {
            _ if by_hand => Ok(name),
            Self::Claim(ClaimStatus::Deferred) => Ok(name),
            _ => Err(format!(
                "a retry takes failed, uncertain, dead or deferred, not {s}"
            )),
        }
    }
}

impl std::str::FromStr for StateName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let claim = ClaimStatus::ALL.into_iter().find(|c| c.as_str() == s);
        let operation = OutboxState::ALL.into_iter().find(|o| o.as_str() == s);
        match (claim, operation) {
            (Some(status), _) => Ok(Self::Claim(status)),
            (None, Some(state)) => Ok(Self::Operation(state)),
            (None, None) => Err(format!("{s:?} is not a claim status or an operation state")),
        }
    }
}

/// Filters for `events list`.
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    pub state: Option<StateName>,
    pub source: Option<String>,
    /// Only events claimed at least this long ago.
    pub older_than: Option<std::time::Duration>,
    pub limit: i64,
}

/// An event in a list: its claim and its operations' states.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct EventSummary {
    pub event_key: Option<String>,
    pub source: Option<String>,
    #[serde(rename = "type")]
    pub event_type: Option<String>,
    pub claim: Option<String>,
    pub operations: Option<String>,
    pub attempts: Option<i32>,
    pub claimed_at: Option<DateTime<Utc>>,
}

/// The newest events matching `f`: [`search`] with an age for its upper bound.
pub async fn list(pool: &Db, f: &EventFilter) -> Result<Vec<EventSummary>, OperatorError> {
    let until = match f.older_than {
        Some(age) => {
            Some(Utc::now() - chrono::Duration::from_std(age).map_err(anyhow::Error::from)?)
        }
        None => None,
    };
    let found = search(
        pool,
        &Search {
            state: f.state.map(SearchState::State),
            source: f.source.clone(),
            until,
            limit: f.limit,
            ..Search::default()
        },
    )
    .await?;
    Ok(found.events)
}

/// What `events list --since/--until/--type/--after`, and the console's events page, look for.
/// Every field narrows the search; an empty search is every event, newest first.
#[derive(Debug, Clone, Default)]
pub struct Search {
    /// An event key: exact, or a prefix when it ends with `*` (`stripe:evt_1*`).
    pub key: Option<String>,
    pub source: Option<String>,
    pub event_type: Option<String>,
    /// A claim status or an operation state, or [`Search::CONFLICT`].
    pub state: Option<SearchState>,
    /// Only events claimed at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only events claimed before this time.
    pub until: Option<DateTime<Utc>>,
    /// The page after this one.
    pub after: Option<Cursor>,
    pub limit: i64,
}

/// What `state` narrows a search to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchState {
    /// The claim is in it, or one of its operations is.
    State(StateName),
    /// Events with a key conflict recorded.
    Conflict,
}

impl std::str::FromStr for SearchState {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            Search::CONFLICT => Ok(Self::Conflict),
            _ => s
                .parse()
                .map(Self::State)
                .map_err(|e| format!("{e}, or {}", Search::CONFLICT)),
        }
    }
}

impl SearchState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::State(s) => s.as_str(),
            Self::Conflict => Search::CONFLICT,
        }
    }
}

impl Search {
    /// The `state` of events with a key conflict.
    pub const CONFLICT: &'static str = "conflict";
}

/// Where a page of a search ended: the last event's claim time and key. Written as one opaque
/// URL-safe word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub claimed_at: DateTime<Utc>,
    pub key: String,
}

impl std::fmt::Display for Cursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use base64::Engine as _;
        let micros = self.claimed_at.timestamp_micros();
        let text = format!("{micros}:{}", self.key);
        f.write_str(&base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(text))
    }
}

impl std::str::FromStr for Cursor {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        use base64::Engine as _;
        let bad = || format!("{s:?} is not a cursor a list printed");
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .map_err(|_| bad())?;
        let text = String::from_utf8(bytes).map_err(|_| bad())?;
        let (micros, key) = text.split_once(':').ok_or_else(bad)?;
        let micros: i64 = micros.parse().map_err(|_| bad())?;
        let claimed_at = DateTime::from_timestamp_micros(micros).ok_or_else(bad)?;
        Ok(Self {
            claimed_at,
            key: key.into(),
        })
    }
}

/// One page of a search, and the cursor of the next when there is one.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub events: Vec<EventSummary>,
    #[serde(serialize_with = "display_opt")]
    pub next: Option<Cursor>,
}

impl Page {
    /// The page of `events` (newest first, at most one more than `limit`): the first `limit`,
    /// and the cursor after the last of them when more follow (an event beyond `limit`, or
    /// `more` said by a database whose own page was cut).
    pub fn cut(mut events: Vec<EventSummary>, limit: usize, more: bool) -> Self {
        let cut = events.len() > limit || (more && !events.is_empty());
        events.truncate(limit);
        let next = cut.then(|| events.last()).flatten().and_then(|e| {
            Some(Cursor {
                claimed_at: e.claimed_at?,
                key: e.event_key.clone()?,
            })
        });
        Self { events, next }
    }
}

fn display_opt<S: serde::Serializer>(c: &Option<Cursor>, s: S) -> Result<S::Ok, S::Error> {
    match c {
        Some(c) => s.collect_str(c),
        None => s.serialize_none(),
    }
}

/// The char after every other: a key prefix `p` is every key in `[p, p || LAST)`, compared byte
/// by byte (the key columns are `COLLATE "C"`).
const LAST_CHAR: char = '\u{10FFFF}';

/// A page of events matching `search`, newest claim first, by keyset on
/// `(claimed_at, event_key)`: a deep page costs what the first does.
pub async fn search(pool: &Db, search: &Search) -> Result<Page, OperatorError> {
    let limit = search.limit.max(1);
    // A narrow state or key prefix is looked up by its own index first, and its few events
    // ordered by time here: walking the time index for a few rare events scattered over
    // millions would read most of it, which is what PostgreSQL's plan for `ORDER BY … LIMIT`
    // would do.
    let mut narrow = None;
    for candidates in [Candidates::of_state(search), Candidates::of_prefix(search)]
        .into_iter()
        .flatten()
    {
        if let Some(keys) = candidates.few(pool).await? {
            // Keys found by their state are in it: the condition need not be checked again.
            let by_state = !matches!(candidates, Candidates::Prefix(_));
            narrow = Some((keys, by_state));
            break;
        }
    }
    let events: Vec<EventSummary> = match narrow {
        Some((keys, by_state)) => {
            let mut q = sqlx::QueryBuilder::new(
                "SELECT p.event_key, p.claimed_at FROM processed_events p WHERE p.event_key = ANY(",
            );
            q.push_bind(keys).push(")");
            push_filters(&mut q, search, by_state);
            let mut found: Vec<(String, DateTime<Utc>)> =
                q.build_query_as().fetch_all(pool).await?;
            found.sort_by(|a, b| (b.1, &b.0).cmp(&(a.1, &a.0)));
            found.truncate(limit as usize + 1);
            let page: Vec<String> = found.into_iter().map(|(k, _)| k).collect();
            let mut q = summaries();
            q.push(" AND p.event_key = ANY(").push_bind(page).push(")");
            q.push(" ORDER BY p.claimed_at DESC, p.event_key DESC");
            q.build_query_as().fetch_all(pool).await?
        }
        None => {
            let mut q = summaries();
            push_filters(&mut q, search, false);
            q.push(" ORDER BY p.claimed_at DESC, p.event_key DESC LIMIT ")
                .push_bind(limit + 1);
            q.build_query_as().fetch_all(pool).await?
        }
    };
    Ok(Page::cut(events, limit as usize, false))
}

/// [`search`] over several databases (the shards): each is searched from the same cursor, and
/// their pages merged in the one order, newest first, so the pages and their cursors are those
/// one database holding every event would give.
pub async fn search_over(pools: &[Db], search: &Search) -> Result<Page, OperatorError> {
    if let [pool] = pools {
        return self::search(pool, search).await;
    }
    let limit = search.limit.max(1) as usize;
    let (mut events, mut more) = (Vec::new(), false);
    for pool in pools {
        let page = self::search(pool, search).await?;
        more |= page.next.is_some();
        events.extend(page.events);
    }
    events.sort_by(|a, b| (b.claimed_at, &b.event_key).cmp(&(a.claimed_at, &a.event_key)));
    Ok(Page::cut(events, limit, more))
}

/// The events' summaries, to be narrowed by `AND …`.
fn summaries() -> sqlx::QueryBuilder<'static, sqlx::Postgres> {
    sqlx::QueryBuilder::new(
        "SELECT p.event_key, p.source, p.event_type, p.status AS claim, \
         (SELECT string_agg(o.operation || '=' || o.state, ', ' ORDER BY o.operation) \
            FROM outbox o WHERE o.event_key = p.event_key) AS operations, \
         p.attempts, p.claimed_at FROM processed_events p WHERE true",
    )
}

/// Every condition of `search`, as `AND …` on `processed_events p`; its state's unless
/// `state_checked`.
fn push_filters(
    q: &mut sqlx::QueryBuilder<'_, sqlx::Postgres>,
    search: &Search,
    state_checked: bool,
) {
    match search.key.as_deref() {
        Some(key) if key.ends_with('*') => {
            let prefix = key.trim_end_matches('*');
            q.push(" AND p.event_key >= ").push_bind(prefix.to_owned());
            q.push(" AND p.event_key < ")
                .push_bind(format!("{prefix}{LAST_CHAR}"));
        }
        Some(key) => {
            q.push(" AND p.event_key = ").push_bind(key.to_owned());
        }
        None => {}
    }
    if let Some(source) = &search.source {
        q.push(" AND p.source = ").push_bind(source.clone());
    }
    if let Some(event_type) = &search.event_type {
        q.push(" AND p.event_type = ").push_bind(event_type.clone());
    }
    match search.state.filter(|_| !state_checked) {
        Some(SearchState::State(StateName::Claim(status))) => {
            let name = status.as_str();
            q.push(" AND (p.status = ").push_bind(name);
            if name.parse::<OutboxState>().is_ok() {
                q.push(" OR EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key AND o.state = ")
                    .push_bind(name)
                    .push(")");
            }
            q.push(")");
        }
        Some(SearchState::State(StateName::Operation(state))) => {
            q.push(" AND EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key AND o.state = ")
                .push_bind(state.as_str())
                .push(")");
        }
        Some(SearchState::Conflict) => {
            q.push(" AND EXISTS (SELECT 1 FROM key_conflicts k WHERE k.event_key = p.event_key)");
        }
        None => {}
    }
    if let Some(since) = search.since {
        q.push(" AND p.claimed_at >= ").push_bind(since);
    }
    if let Some(until) = search.until {
        q.push(" AND p.claimed_at < ").push_bind(until);
    }
    if let Some(after) = &search.after {
        q.push(" AND (p.claimed_at, p.event_key) < (")
            .push_bind(after.claimed_at)
            .push(", ")
            .push_bind(after.key.clone())
            .push(")");
    }
}

/// The most events a narrow search looks up by its own index before ordering them by time.
const FEW: i64 = 5000;

/// The keys a search's state or key prefix selects, by their own index.
enum Candidates {
    /// Events whose claim or an operation is in a state other than `done`.
    State(&'static str, bool, bool),
    Conflict,
    Prefix(String),
}

impl Candidates {
    fn of_state(search: &Search) -> Option<Self> {
        match search.state? {
            // Nearly every event is done: the time index finds them at once.
            SearchState::State(s) if s.as_str() == "done" => None,
            SearchState::State(StateName::Claim(status)) => {
                let name = status.as_str();
                Some(Self::State(name, true, name.parse::<OutboxState>().is_ok()))
            }
            SearchState::State(StateName::Operation(state)) => {
                Some(Self::State(state.as_str(), false, true))
            }
            SearchState::Conflict => Some(Self::Conflict),
        }
    }

    fn of_prefix(search: &Search) -> Option<Self> {
        let key = search.key.as_deref()?;
        key.strip_suffix('*')
            .map(|p| Self::Prefix(p.trim_end_matches('*').to_owned()))
    }

    fn push(&self, q: &mut sqlx::QueryBuilder<'_, sqlx::Postgres>) {
        match self {
            Self::State(name, claims, operations) => {
                if *claims {
                    q.push("SELECT event_key FROM processed_events WHERE status = ")
                        .push_bind(*name);
                }
                if *claims && *operations {
                    q.push(" UNION ");
                }
                if *operations {
                    q.push("SELECT event_key FROM outbox WHERE state = ")
                        .push_bind(*name);
                }
            }
            Self::Conflict => {
                q.push("SELECT DISTINCT event_key FROM key_conflicts");
            }
            Self::Prefix(prefix) => {
                q.push("SELECT event_key FROM processed_events WHERE event_key >= ")
                    .push_bind(prefix.clone())
                    .push(" AND event_key < ")
                    .push_bind(format!("{prefix}{LAST_CHAR}"));
            }
        }
    }

    /// The keys, when there are at most [`FEW`]; read no further than that.
    async fn few(&self, pool: &Db) -> sqlx::Result<Option<Vec<String>>> {
        let mut q = sqlx::QueryBuilder::new("SELECT event_key FROM (");
        self.push(&mut q);
        q.push(" LIMIT ").push_bind(FEW + 1).push(") AS c");
        let keys: Vec<String> = q.build_query_scalar().fetch_all(pool).await?;
        Ok((keys.len() as i64 <= FEW).then_some(keys))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_name_is_a_claim_status_or_an_operation_state() {
        for name in [
            "in_progress",
            "done",
            "deferred",
            "failed",
            "dead",
            "pending",
            "uncertain",
        ] {
            assert_eq!(name.parse::<StateName>().unwrap().as_str(), name);
        }
        assert!("bogus".parse::<StateName>().is_err());
        assert!("Done".parse::<StateName>().is_err());
    }

    #[test]
    fn a_bulk_retry_takes_only_states_an_operator_may_retry() {
        for name in ["failed", "uncertain", "dead", "deferred"] {
            assert!(StateName::retryable(name).is_ok(), "{name}");
        }
        for name in ["done", "pending", "in_progress", "retryable", "bogus"] {
            assert!(StateName::retryable(name).is_err(), "{name}");
        }
    }
}
