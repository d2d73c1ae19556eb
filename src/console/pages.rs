//! The pages that read: the overview, events, dead letters and expired replays; the layout every
//! page shares, and the headers every answer carries.

use super::auth::{Role, User};
use super::{State, PAGE_ROWS};
use crate::operator::events::{self, Cursor, Search, SearchState};
use axum::extract::Query;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::Deserialize;
use std::collections::HashMap;
use std::time::Instant;

/// What stays as is in a path segment: the unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b':');

/// The path of an event's story.
pub(crate) fn event_path(key: &str) -> String {
    format!("/events/{}", utf8_percent_encode(key, SEGMENT))
}

/// A query string's value.
pub(crate) fn q(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

const STYLESHEET: &str = include_str!("console.css");

/// `GET /static/console.css`: the one stylesheet, public like the login page.
pub(crate) async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// Headers on every answer: no script, no framing, no caching of pages, no referrer.
pub(crate) async fn headers(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// A whole page: the navigation, who is logged in, and `body`.
pub(crate) fn document(title: &str, user: Option<&User>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · replayproof" }
                link rel="stylesheet" href="/static/console.css";
            }
            body {
                @if let Some(user) = user {
                    header {
                        nav {
                            a class="brand" href="/" { "replayproof" }
                            a href="/" { "Overview" }
                            a href="/events" { "Events" }
                            a href="/dead-letters" { "Dead letters" }
                            @if user.role == Role::Operator { a href="/replay" { "Replay by time" } }
                        }
                        form class="who" method="post" action="/logout" {
                            input type="hidden" name="csrf_token" value=(user.csrf);
                            span id="user" { (user.name) " (" (user.role.as_str()) ")" }
                            button type="submit" { "Log out" }
                        }
                    }
                }
                (body)
            }
        }
    }
}

/// A page that only says something.
pub(crate) fn message(title: &str, text: &str) -> Markup {
    document(
        title,
        None,
        html! { main { h1 { (title) } p class="problem" { (text) } } },
    )
}

/// An answer with `status` and a page saying why.
pub(crate) fn problem(status: StatusCode, user: &User, title: &str, text: &str) -> Response {
    let body = html! { main { h1 { (title) } p class="problem" role="alert" { (text) } } };
    (status, document(title, Some(user), body)).into_response()
}

/// 503 titled `title`: the database (or the broker) did not answer; `error` says how.
pub(crate) fn unavailable(user: &User, title: &str, error: &dyn std::fmt::Display) -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        user,
        title,
        &error.to_string(),
    )
}

/// Any other path: not found, for a logged-in user only.
pub(crate) async fn not_found(user: User) -> Response {
    problem(
        StatusCode::NOT_FOUND,
        &user,
        "Not found",
        "No page has this address.",
    )
}

fn time(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => {
            html! { time datetime=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S%.3f UTC")) } }
        }
        None => html! { "–" },
    }
}

pub(crate) fn when(at: DateTime<Utc>) -> Markup {
    time(Some(at))
}

pub(crate) fn maybe_when(at: Option<DateTime<Utc>>) -> Markup {
    time(at)
}

/// A moment from a form: RFC 3339, a browser's `datetime-local` (read as UTC), or a duration
/// ago (`40m`).
pub(crate) fn parse_when(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if let Ok(local) = chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M") {
        return Ok(local.and_utc());
    }
    if let Ok(local) = chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S") {
        return Ok(local.and_utc());
    }
    crate::args::parse_moment(text)
}

/// The last committed offsets read, to tell the group's throughput.
pub(crate) struct Sample {
    at: Instant,
    committed: HashMap<i32, i64>,
}

/// `GET /`: the numbers behind the alerts, each linking to the list behind it.
pub(crate) async fn overview(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
) -> Response {
    let status =
        match crate::operator::status::gather(&state.databases(), state.settings.kafka.clone())
            .await
        {
            Ok(status) => status,
            Err(e) => {
                return problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &user,
                    "Overview unavailable",
                    &format!("{e:#}"),
                )
            }
        };
    let home = crate::destinations::LimitsHome::over(&state.databases(), 0);
    let breakers = crate::destinations::destination_gauges(&home)
        .await
        .unwrap_or_default();
    let rates = throughput(&state, &status.lag);
    let body = html! {
        main {
            h1 { "Overview" }
            section {
                h2 { "Consumer group" }
                @if status.lag.is_empty() {
                    p { "No broker configured: start the console with --brokers to see the group's lag." }
                } @else {
                    p { "Topic " code { (status.topic.clone().unwrap_or_default()) } ", group " code { (status.group.clone().unwrap_or_default()) } }
                    table id="lag" {
                        thead { tr { th { "partition" } th { "committed" } th { "end" } th { "lag" } th { "throughput" } } }
                        tbody {
                            @for p in &status.lag {
                                tr {
                                    td { (p.partition) }
                                    td { (p.committed.map(|c| c.to_string()).unwrap_or_else(|| "none".into())) }
                                    td { (p.high_watermark) }
                                    td class=(if p.lag > 0 { "warn" } else { "" }) { (p.lag) }
                                    td { (rates.get(&p.partition).map(|r| format!("{r:.1}/s")).unwrap_or_else(|| "–".into())) }
                                }
                            }
                        }
                    }
                }
            }
            div class="grid" {
                section {
                    h2 { "Claims" }
                    @if status.claims.is_empty() {
                        p { "No claim waits for anything. Done claims are estimated from the table's statistics, once PostgreSQL has analysed it." }
                    }
                    table id="claims" {
                        @for (status_name, n) in &status.claims {
                            tr { td { a href=(format!("/events?state={}", q(status_name))) { (status_name) } } td class="n" { (n) } }
                        }
                    }
                    p { "Deferred: " a href="/events?state=deferred" { (status.deferred) }
                        @if let Some(due) = status.next_deferred_due_seconds { ", next due in " (format!("{due:.0}s")) } }
                }
                section {
                    h2 { "Outbox" }
                    table id="outbox" {
                        @for (state_name, n) in &status.outbox {
                            tr { td { a href=(format!("/events?state={}", q(state_name))) { (state_name) } } td class="n" { (n) } }
                        }
                    }
                    p { "Oldest due operation: " (format!("{:.0}s", status.oldest_due_seconds)) " · "
                        a href="/events?state=in_progress" { "expired leases: " (status.expired_leases) } }
                }
                section {
                    h2 { "Needs an operator" }
                    table id="attention" {
                        tr { td { a href="/dead-letters?not_replayed=1" { "dead letters not replayed" } } td class="n" { (status.dead_letters_not_replayed) } }
                        tr { td { a href="/dead-letters" { "dead letters (estimate)" } } td class="n" { "~" (status.dead_letters) } }
                        tr { td { a href="/events?state=conflict" { "key conflicts (estimate)" } } td class="n" { "~" (status.key_conflicts) } }
                        tr { td { a href="/expired" { "expired replays" } } td class="n" { (status.expired_replays) } }
                        tr { td { a href="/events?state=failed" { "failed claims" } } td class="n" { (status.claims.iter().find(|(s, _)| s == "failed").map(|(_, n)| *n).unwrap_or(0)) } }
                    }
                }
                section {
                    h2 { "Destinations" }
                    @let open: Vec<_> = breakers.iter().filter(|b| b.breaker.as_str() != "closed").collect();
                    @if open.is_empty() { p { "Every circuit breaker is closed." } }
                    @else {
                        table id="breakers" {
                            @for b in open { tr { td { (crate::secrets::redact_url(&b.origin)) } td class="warn" { (b.breaker.as_str()) } td { (b.in_flight) " in flight" } } }
                        }
                    }
                }
            }
        }
    };
    document("Overview", Some(&user), body).into_response()
}

/// Messages per second each partition's committed offset moved since the last overview.
fn throughput(state: &State, lag: &[crate::operator::status::PartitionLag]) -> HashMap<i32, f64> {
    let now = Instant::now();
    let committed: HashMap<i32, i64> = lag
        .iter()
        .filter_map(|p| Some((p.partition, p.committed?)))
        .collect();
    let mut last = state.throughput.lock().expect("not poisoned");
    let mut rates = HashMap::new();
    if let Some(sample) = last.as_ref() {
        let secs = now.duration_since(sample.at).as_secs_f64();
        if secs > 0.5 {
            for (p, c) in &committed {
                if let Some(before) = sample.committed.get(p) {
                    rates.insert(*p, (c - before).max(0) as f64 / secs);
                }
            }
        }
    }
    *last = Some(Sample { at: now, committed });
    rates
}

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

pub(crate) fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A query string of the fields given, each `name=value`, URL-encoded.
pub(crate) fn query_of(fields: &[(&str, &Option<String>)]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .filter_map(|(name, value)| given(value).map(|v| format!("{name}={}", q(v))))
        .collect();
    parts.join("&")
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
) -> Response {
    let search = match query.search(PAGE_ROWS) {
        Ok(search) => search,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &user, "Bad search", &e),
    };
    let page = match events::search_over(&state.databases(), &search).await {
        Ok(page) => page,
        Err(e) => return unavailable(&user, "Search failed", &e),
    };
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
            @else {
                table id="events" {
                    thead { tr { th { "key" } th { "source" } th { "type" } th { "claim" } th { "operations" } th { "attempts" } th { "claimed" } } }
                    tbody {
                        @for e in &page.events {
                            @let key = e.event_key.clone().unwrap_or_default();
                            tr {
                                td { a class="key" href=(event_path(&key)) { (key) } }
                                td { (e.source.clone().unwrap_or_default()) }
                                td { (e.event_type.clone().unwrap_or_default()) }
                                td class=(format!("state {}", e.claim.clone().unwrap_or_default())) { (e.claim.clone().unwrap_or_default()) }
                                td { (e.operations.clone().unwrap_or_default()) }
                                td class="n" { (e.attempts.unwrap_or(0)) }
                                td { (maybe_when(e.claimed_at)) }
                            }
                        }
                    }
                }
            }
            p class="pages" {
                @if search.after.is_some() { a href=(format!("/events?{this}")) { "« newest" } " " }
                @if let Some(next) = &page.next { a id="next" href=(format!("/events?{this}{}after={}", if this.is_empty() { "" } else { "&" }, next)) { "older »" } }
            }
            @if user.role == Role::Operator && retryable {
                p { a id="bulk-retry" href=(format!("/events/retry?{this}")) { "Retry every event of this search…" } " (a preview first)" }
            }
        }
    };
    document("Events", Some(&user), body).into_response()
}

/// `GET /expired`: expired replays waiting for an operator.
pub(crate) async fn expired(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
) -> Response {
    let rows =
        match crate::retention::expired::list_over(&state.databases(), false, PAGE_ROWS).await {
            Ok(rows) => rows,
            Err(e) => return unavailable(&user, "Unavailable", &e),
        };
    let body = html! {
        main {
            h1 { "Expired replays" }
            p { "Events that arrived after their key could have been pruned, kept unapplied. "
                code { "replayproof events apply-expired KEY" } " or " code { "drop-expired" } " settles one." }
            @if rows.is_empty() { p id="none" { "None waiting." } }
            @else {
                table {
                    thead { tr { th { "key" } th { "source" } th { "type" } th { "occurred" } th { "seen" } } }
                    tbody {
                        @for r in &rows {
                            tr { td { (r.event_key) } td { (r.source) } td { (r.event_type.clone().unwrap_or_default()) } td { (when(r.occurred_at)) } td class="n" { (r.times_seen) } }
                        }
                    }
                }
            }
        }
    };
    document("Expired replays", Some(&user), body).into_response()
}

/// Pretty JSON of a stored payload, for a page.
pub(crate) fn pretty(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| json.to_owned())
}
