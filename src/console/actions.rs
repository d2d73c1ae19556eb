//! The actions: retry, resolve, replay a dead letter, replay dead letters or events in bulk,
//! and replay the topic by time. Each is a `POST` with the session's CSRF token and a reason,
//! for operators only, and runs the command line's own function with the user as the actor.

use super::auth::{Role, User};
use super::dead_letters::LettersQuery;
use super::form::Fields;
use super::pages::{self, document, event_path, problem, EventsQuery};
use super::{State, BULK_LIMIT};
use crate::operator::events::{self, Resolution, Retry};
use crate::operator::{Act, Change, OperatorError};
use axum::extract::{Path, Query};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{html, Markup};

/// The checks every action makes, in order: an operator (403), the session's CSRF token (403),
/// a reason (400). The answer is what the audit row records.
// The refusal is the answer itself, sent once; boxing it would only move it.
#[allow(clippy::result_large_err)]
fn authorize(state: &State, user: &User, fields: &Fields) -> Result<Act, Response> {
    if user.role != Role::Operator {
        return Err(problem(
            StatusCode::FORBIDDEN,
            user,
            "Not allowed",
            "Only an operator acts; a viewer reads.",
        ));
    }
    if !user.csrf_ok(state, fields.get("csrf_token")) {
        return Err(problem(
            StatusCode::FORBIDDEN,
            user,
            "Refused",
            "The form's CSRF token is missing or not this session's: reload the page and try again.",
        ));
    }
    let Some(reason) = fields.get("reason") else {
        return Err(problem(
            StatusCode::BAD_REQUEST,
            user,
            "A reason is needed",
            "Every action says why, for the audit table.",
        ));
    };
    Ok(Act::new(&user.name, reason))
}

/// The status of an operator function's refusal.
fn refused(user: &User, e: &OperatorError) -> Response {
    let status = match e {
        OperatorError::NoSuchEvent(_) | OperatorError::NoSuchDeadLetter(_) => StatusCode::NOT_FOUND,
        OperatorError::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
        OperatorError::Unexpected(_) => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::CONFLICT,
    };
    problem(status, user, "Not done", &format!("{e:#}"))
}

/// `POST /events/{key}/retry`.
pub(crate) async fn retry(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let retry = Retry {
        operation: fields.get("operation").map(Into::into),
        effect: None,
        accept_duplicate_risk: fields.get("accept_duplicate_risk") == Some("yes"),
    };
    let pool = match state.pool_for(&key).await {
        Ok(pool) => pool,
        Err(e) => return refused(&user, &crate::operator::OperatorError::Unexpected(e)),
    };
    match events::retry(&pool, &state.registry, &key, &retry, &act).await {
        Ok(_) => Redirect::to(&event_path(&key)).into_response(),
        Err(e) => refused(&user, &e),
    }
}

/// `POST /events/{key}/resolve`, with `as` done or dead.
pub(crate) async fn resolve(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let to = match fields.get("as") {
        Some("done") => Resolution::Done,
        Some("dead") => Resolution::Dead,
        _ => {
            return problem(
                StatusCode::BAD_REQUEST,
                &user,
                "Resolve as what?",
                "`as` is done or dead.",
            )
        }
    };
    let pool = match state.pool_for(&key).await {
        Ok(pool) => pool,
        Err(e) => return refused(&user, &crate::operator::OperatorError::Unexpected(e)),
    };
    match events::resolve(&pool, &key, fields.get("operation"), to, &act).await {
        Ok(_) => Redirect::to(&event_path(&key)).into_response(),
        Err(e) => refused(&user, &e),
    }
}

/// What a retry would change for one event of a search: its failed, uncertain or dead
/// operations go back to pending; a failed or deferred local effect runs again.
fn would_change(e: &events::EventSummary) -> Vec<String> {
    let claim = e.claim.clone().unwrap_or_default();
    let ops: Vec<(&str, &str)> = e
        .operations
        .as_deref()
        .unwrap_or_default()
        .split(", ")
        .filter_map(|op| op.split_once('='))
        .collect();
    if ops.is_empty() {
        return match claim.as_str() {
            "failed" | "deferred" => vec![format!("claim {claim}: its effect runs again now")],
            _ => vec![],
        };
    }
    ops.into_iter()
        .filter(|(_, state)| matches!(*state, "failed" | "uncertain" | "dead"))
        .map(|(op, state)| format!("operation {op}: {state} → pending"))
        .collect()
}

/// `GET /events/retry?…`: the events of a search a bulk retry would take, and what it would
/// change for each; the form sends exactly those keys.
pub(crate) async fn bulk_retry_preview(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Query(query): Query<EventsQuery>,
) -> Response {
    if user.role != Role::Operator {
        return problem(
            StatusCode::FORBIDDEN,
            &user,
            "Not allowed",
            "Only an operator acts.",
        );
    }
    let search = match query.search(BULK_LIMIT) {
        Ok(search) => search,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &user, "Bad search", &e),
    };
    let found = match events::search_over(&state.databases(), &search).await {
        Ok(found) => found,
        Err(e) => return refused(&user, &e),
    };
    let plan: Vec<(String, Vec<String>)> = found
        .events
        .iter()
        .filter_map(|e| {
            let changes = would_change(e);
            (!changes.is_empty()).then(|| (e.event_key.clone().unwrap_or_default(), changes))
        })
        .collect();
    let body = html! {
        main {
            h1 { "Retry in bulk: preview" }
            p { "Search: " code { (query.query_string()) } }
            @if plan.is_empty() { p id="none" { "No event of this search can be retried." } }
            @else {
                p id="count" { (plan.len()) " event(s) would change:" }
                @if found.next.is_some() { p class="problem" { "Only the newest " (BULK_LIMIT) " events of the search are taken; retry again for the rest." } }
                form method="post" action="/events/retry" {
                    input type="hidden" name="csrf_token" value=(user.csrf);
                    table id="preview" {
                        thead { tr { th { "event" } th { "what changes" } } }
                        tbody {
                            @for (key, changes) in &plan {
                                tr {
                                    td { input type="hidden" name="keys" value=(key); a href=(event_path(key)) { (key) } }
                                    td { @for c in changes { div { (c) } } }
                                }
                            }
                        }
                    }
                    p { label { "Reason " input name="reason" id="bulk-reason" required; } " "
                        button type="submit" id="confirm" { "Retry these " (plan.len()) } }
                }
            }
        }
    };
    document("Retry in bulk", Some(&user), body).into_response()
}

/// `POST /events/retry`: retries exactly the `keys` the preview listed, one by one.
pub(crate) async fn bulk_retry(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let keys = fields.all("keys");
    if keys.len() as i64 > BULK_LIMIT {
        return problem(
            StatusCode::BAD_REQUEST,
            &user,
            "Too many",
            &format!("At most {BULK_LIMIT} events at once."),
        );
    }
    let mut changes = Vec::new();
    let mut not_done = Vec::new();
    for key in keys {
        let retried = match state.pool_for(key).await {
            Ok(pool) => events::retry(&pool, &state.registry, key, &Retry::default(), &act)
                .await
                .map_err(|e| format!("{e:#}")),
            Err(e) => Err(format!("{e:#}")),
        };
        match retried {
            Ok(c) => changes.extend(c),
            Err(e) => not_done.push((key.to_owned(), e)),
        }
    }
    result_page(&user, "Retried", &changes, &not_done)
}

fn changes_table(changes: &[Change]) -> Markup {
    html! {
        table id="changes" {
            thead { tr { th { "target" } th { "before" } th { "after" } } }
            tbody { @for c in changes { tr { td { (c.target) } td { (c.before) } td { (c.after) } } } }
        }
    }
}

fn result_page(
    user: &User,
    title: &str,
    changes: &[Change],
    not_done: &[(String, String)],
) -> Response {
    let body = html! {
        main {
            h1 { (title) }
            p id="summary" { (changes.len()) " change(s), " (not_done.len()) " refused" }
            @if !changes.is_empty() { (changes_table(changes)) }
            @if !not_done.is_empty() {
                h2 { "Refused" }
                ul id="refused" { @for (what, why) in not_done { li { (what) ": " (why) } } }
            }
        }
    };
    document(title, Some(user), body).into_response()
}

/// `POST /dead-letters/{id}/replay`.
pub(crate) async fn replay_letter(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(id): Path<i64>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let Some(producer) = &state.producer else {
        return no_brokers(&user);
    };
    let done = crate::operator::dead_letters::replay_many(&state.pool, &[id], &act, producer).await;
    match done.refused.first() {
        None => Redirect::to(&format!("/dead-letters/{id}")).into_response(),
        Some((_, why)) if why.starts_with("no dead letter") => {
            problem(StatusCode::NOT_FOUND, &user, "Not found", why)
        }
        Some((_, why)) => problem(StatusCode::SERVICE_UNAVAILABLE, &user, "Not replayed", why),
    }
}

fn no_brokers(user: &User) -> Response {
    problem(
        StatusCode::CONFLICT,
        user,
        "No broker",
        "The console was started without --brokers: it cannot put anything on the topic.",
    )
}

/// `GET /dead-letters/replay?…`: the never-replayed letters a bulk replay would take.
pub(crate) async fn bulk_replay_preview(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Query(query): Query<LettersQuery>,
) -> Response {
    if user.role != Role::Operator {
        return problem(
            StatusCode::FORBIDDEN,
            &user,
            "Not allowed",
            "Only an operator acts.",
        );
    }
    let search = match query.search(BULK_LIMIT) {
        Ok(search) => search,
        Err(e) => return problem(StatusCode::BAD_REQUEST, &user, "Bad search", &e),
    };
    let letters = match crate::operator::dead_letters::to_replay(&state.pool, &search).await {
        Ok(letters) => letters,
        Err(e) => return refused(&user, &e),
    };
    let body = html! {
        main {
            h1 { "Replay dead letters: preview" }
            @if letters.is_empty() { p id="none" { "No dead letter of this search waits for a replay." } }
            @else {
                p id="count" { (letters.len()) " dead letter(s) would be produced again to their topics:" }
                form method="post" action="/dead-letters/replay" {
                    input type="hidden" name="csrf_token" value=(user.csrf);
                    table id="preview" {
                        thead { tr { th { "id" } th { "message" } th { "reason" } } }
                        tbody {
                            @for l in &letters {
                                tr {
                                    td { input type="hidden" name="ids" value=(l.id); a href=(format!("/dead-letters/{}", l.id)) { (l.id) } }
                                    td { (l.topic) "/" (l.partition) "@" (l.offset) }
                                    td { (l.reason) }
                                }
                            }
                        }
                    }
                    p { label { "Reason " input name="reason" id="bulk-reason" required; } " "
                        button type="submit" id="confirm" { "Replay these " (letters.len()) } }
                }
            }
        }
    };
    document("Replay dead letters", Some(&user), body).into_response()
}

/// `POST /dead-letters/replay`: replays exactly the `ids` the preview listed.
pub(crate) async fn bulk_replay(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let ids: Result<Vec<i64>, _> = fields.all("ids").iter().map(|i| i.parse::<i64>()).collect();
    let Ok(ids) = ids else {
        return problem(
            StatusCode::BAD_REQUEST,
            &user,
            "Bad ids",
            "Every id is a number.",
        );
    };
    if ids.len() as i64 > BULK_LIMIT {
        return problem(
            StatusCode::BAD_REQUEST,
            &user,
            "Too many",
            &format!("At most {BULK_LIMIT} letters at once."),
        );
    }
    let Some(producer) = &state.producer else {
        return no_brokers(&user);
    };
    let done = crate::operator::dead_letters::replay_many(&state.pool, &ids, &act, producer).await;
    let refused: Vec<(String, String)> = done
        .refused
        .iter()
        .map(|(id, why)| (format!("dead_letter:{id}"), why.clone()))
        .collect();
    result_page(&user, "Replayed", &done.changes, &refused)
}

fn replay_form_body(user: &User, fields: Option<&Fields>) -> Markup {
    let value = |name: &str| {
        fields
            .and_then(|f| f.get(name))
            .unwrap_or_default()
            .to_owned()
    };
    html! {
        form method="post" action="/replay" {
            input type="hidden" name="csrf_token" value=(user.csrf);
            p { label { "Since " input name="since" id="since" required value=(value("since")) placeholder="2026-12-02T10:00:00Z or 40m"; } }
            p { label { "Until " input name="until" id="until" value=(value("until")) placeholder="empty: up to now"; } }
            p { label { "Partition " input name="partition" id="partition" value=(value("partition")) placeholder="every partition"; } }
            p { label { input type="checkbox" name="dry_run" value="1" checked[fields.is_none_or(|f| f.get("dry_run").is_some())]; " dry run: count only" } }
            p { label { "Reason " input name="reason" id="replay-reason" required value=(value("reason")); } }
            button type="submit" id="run-replay" { "Replay" }
        }
    }
}

/// `GET /replay`: the form of a replay by time.
pub(crate) async fn replay_form(user: User) -> Response {
    if user.role != Role::Operator {
        return problem(
            StatusCode::FORBIDDEN,
            &user,
            "Not allowed",
            "Only an operator acts.",
        );
    }
    let body = html! {
        main {
            h1 { "Replay by time" }
            p { "Reads the topic again from a moment, outside the live group, through the claim path: events already claimed change nothing, and only those with no claim are applied." }
            (replay_form_body(&user, None))
        }
    };
    document("Replay by time", Some(&user), body).into_response()
}

/// `POST /replay`: a replay by time, as `replayproof replay` runs it.
pub(crate) async fn replay_topic(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Response {
    let act = match authorize(&state, &user, &fields) {
        Ok(act) => act,
        Err(response) => return response,
    };
    let (Some(kafka), Some(processor)) = (&state.settings.kafka, &state.processor) else {
        return no_brokers(&user);
    };
    let moment = |name: &str| fields.get(name).map(pages::parse_when).transpose();
    let (since, until) = match (moment("since"), moment("until")) {
        (Ok(Some(since)), Ok(until)) => (since, until),
        (Ok(None), _) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &user,
                "Since when?",
                "The window needs its start.",
            )
        }
        (Err(e), _) | (_, Err(e)) => {
            return problem(StatusCode::BAD_REQUEST, &user, "Bad moment", &e)
        }
    };
    let partition = match fields.get("partition").map(str::parse::<i32>).transpose() {
        Ok(p) => p,
        Err(_) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &user,
                "Bad partition",
                "A partition is a number.",
            )
        }
    };
    let window = crate::operator::replay::Window {
        brokers: kafka.brokers.clone(),
        topic: kafka.topic.clone(),
        options: kafka.options.clone(),
        since,
        until,
        partition,
        dry_run: fields.get("dry_run").is_some(),
        force: false,
    };
    let report = match crate::operator::replay::replay(&state.pool, processor, &window, &act).await
    {
        Ok(report) => report,
        Err(e) => return refused(&user, &e),
    };
    let body = html! {
        main {
            h1 { "Replay by time" @if report.dry_run { " (dry run)" } }
            table id="replay-report" {
                @for (name, n) in [("read", report.read), ("already applied", report.already_applied), ("newly applied", report.newly_applied),
                                   ("dead-lettered", report.dead_lettered), ("conflicts", report.conflicts), ("failed", report.failed),
                                   ("deferred", report.deferred), ("expired replays", report.expired)] {
                    tr { td { (name) } td class="n" { (n) } }
                }
            }
            h2 { "Partitions" }
            table { @for p in &report.partitions { tr { td { (p.partition) } td { "offsets " (p.from) " to " (p.to) } } } }
            @if report.dry_run { h2 { "Run it" } (replay_form_body(&user, Some(&fields))) }
        }
    };
    document("Replay by time", Some(&user), body).into_response()
}
