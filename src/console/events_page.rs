//! `GET /events`: a search of the events, newest first, a page at a time.

use super::auth::{Role, User};
use super::form::{given, parse_when, query_of};
use super::layout::{document, event_path, maybe_when};
use super::problem::{ForUser, PageError};
use super::{State, PAGE_ROWS};
use crate::operator::search::{Cursor, EventSummary, Page, Search, SearchState};
use axum::extract::Query;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use serde::Deserialize;

/// The query of `GET /events`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct EventsQuery {
    #[serde(default)]
    pub q: Option<String>,
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default, rename = "type")]
    pub event_type: Option<String>,
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub since: Option<String>,
    #[serde(default)]
    pub until: Option<String>,
    #[serde(default)]
    pub after: Option<String>,
}

impl EventsQuery {
    /// The search it asks for, or what is wrong with it.
    pub(crate) fn search(&self, limit: i64) -> Result<Search, String> {
        Ok(Search {
            key: given(&self.q).map(Into::into),
            source: given(&self.source).map(Into::into),
            event_type: given(&self.event_type).map(Into::into),
            state: given(&self.state)
                .map(|s| s.parse::<SearchState>())
                .transpose()?,
            since: given(&self.since).map(parse_when).transpose()?,
            until: given(&self.until).map(parse_when).transpose()?,
            after: given(&self.after)
                .map(|a| a.parse::<Cursor>())
                .transpose()?,
            limit,
        })
    }

    /// The query string of this search, without the cursor.
    pub(crate) fn query_string(&self) -> String {
        query_of(&[
            ("q", &self.q),
            ("source", &self.source),
            ("type", &self.event_type),
            ("state", &self.state),
            ("since", &self.since),
            ("until", &self.until),
        ])
    }
}

/// The states a search can ask for.
pub(crate) const STATES: &[&str] = &[
    "in_progress",
    "done",
    "failed",
    "deferred",
    "dead",
    "pending",
    "retryable",
    "uncertain",
    "conflict",
];

fn search_form(query: &EventsQuery) -> Markup {
    let value = |v: &Option<String>| v.clone().unwrap_or_default();
    html! {
        form class="search" method="get" action="/events" {
            label { "Key " input name="q" id="q" value=(value(&query.q)) placeholder="stripe:evt_1… (ends with * for a prefix)"; }
            label { "Source " input name="source" value=(value(&query.source)); }
            label { "Type " input name="type" value=(value(&query.event_type)); }
            label { "State "
                select name="state" id="state" {
                    option value="" { "any" }
                    @for s in STATES { option value=(s) selected[query.state.as_deref() == Some(*s)] { (s) } }
                }
            }
            label { "Since " input name="since" value=(value(&query.since)) placeholder="2026-12-02T10:00:00Z or 40m"; }
            label { "Until " input name="until" value=(value(&query.until)); }
            button type="submit" id="search" { "Search" }
        }
    }
}

/// `GET /events`: a search, newest first, a page at a time.
pub(crate) async fn events(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Query(query): Query<EventsQuery>,
) -> Result<Response, PageError> {
    let search = query
        .search(PAGE_ROWS)
        .map_err(|e| PageError::bad_request("Bad search", e))
        .for_user(&user)?;
    let page = state
        .desk
        .search(&search)
        .await
        .map_err(|e| PageError::from(e).titled("Search failed"))
        .for_user(&user)?;
    let this = query.query_string();
    let retryable = matches!(
        given(&query.state),
        Some("failed" | "uncertain" | "dead" | "deferred")
    );
    let body = html! {
        main {
            h1 { "Events" }
            (search_form(&query))
            @if page.events.is_empty() { p id="none" { "No event matches." } }
            @else { (events_table(&page.events)) }
            (pages(&search, &page, &this))
            @if user.role == Role::Operator && retryable {
                p { a id="bulk-retry" href=(format!("/events/retry?{this}")) { "Retry every event of this search…" } " (a preview first)" }
            }
        }
    };
    Ok(document("Events", Some(&user), body).into_response())
}

fn events_table(events: &[EventSummary]) -> Markup {
    html! {
        table id="events" {
            thead { tr { th { "key" } th { "source" } th { "type" } th { "claim" } th { "operations" } th { "attempts" } th { "claimed" } } }
            tbody {
                @for e in events {
                    @let key = e.event_key.clone().unwrap_or_default();
                    @let claim = e.claim.clone().unwrap_or_default();
                    tr {
                        td { a class="key" href=(event_path(&key)) { (key) } }
                        td { (e.source.clone().unwrap_or_default()) }
                        td { (e.event_type.clone().unwrap_or_default()) }
                        td class=(format!("state {claim}")) { (claim) }
                        td { (e.operations.clone().unwrap_or_default()) }
                        td class="n" { (e.attempts.unwrap_or(0)) }
                        td { (maybe_when(e.claimed_at)) }
                    }
                }
            }
        }
    }
}

/// The links to the newest page and to the next.
fn pages(search: &Search, page: &Page, this: &str) -> Markup {
    let joiner = if this.is_empty() { "" } else { "&" };
    html! {
        p class="pages" {
            @if search.after.is_some() { a href=(format!("/events?{this}")) { "« newest" } " " }
            @if let Some(next) = &page.next { a id="next" href=(format!("/events?{this}{joiner}after={next}")) { "older »" } }
        }
    }
}
