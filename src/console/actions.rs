//! The actions on one event or one dead letter: retry, resolve, replay. Each is a `POST` with
//! the session's CSRF token and a reason, for operators only, and runs the desk's own function
//! with the user as the actor. The bulk actions are [`super::bulk`]'s; the replay by time is
//! [`super::replay`]'s.

use super::auth::{Role, User};
use super::bulk::{self, Preview, Row};
use super::dead_letters::LettersQuery;
use super::events_page::EventsQuery;
use super::form::Fields;
use super::layout::event_path;
use super::problem::{ForUser, PageError};
use super::{State, BULK_LIMIT};
use crate::operator::events::{Resolution, Retry};
use crate::operator::search::EventSummary;
use crate::operator::Act;
use axum::extract::{Path, Query};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use maud::html;

/// The checks every action makes, in order: an operator (403), the session's CSRF token (403),
/// a reason (400). The answer is what the audit row records.
pub(crate) fn authorize(state: &State, user: &User, fields: &Fields) -> Result<Act, PageError> {
    let refuse =
        |status, title: &str, text: &str| Err(PageError::new(status, title, text)).for_user(user);
    if user.role != Role::Operator {
        return refuse(
            StatusCode::FORBIDDEN,
            "Not allowed",
            "Only an operator acts; a viewer reads.",
        );
    }
    if !user.csrf_ok(state, fields.get("csrf_token")) {
        return refuse(
            StatusCode::FORBIDDEN,
            "Refused",
            "The form's CSRF token is missing or not this session's: reload the page and try again.",
        );
    }
    let Some(reason) = fields.get("reason") else {
        return refuse(
            StatusCode::BAD_REQUEST,
            "A reason is needed",
            "Every action says why, for the audit table.",
        );
    };
    Ok(Act::new(&user.name, reason))
}

/// `POST /events/{key}/retry`.
pub(crate) async fn retry(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let retry = Retry {
        operation: fields.get("operation").map(Into::into),
        effect: None,
        accept_duplicate_risk: fields.get("accept_duplicate_risk") == Some("yes"),
    };
    state.desk.retry(&key, &retry, &act).await.for_user(&user)?;
    Ok(Redirect::to(&event_path(&key)).into_response())
}

/// `POST /events/{key}/resolve`, with `as` done or dead.
pub(crate) async fn resolve(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let to = match fields.get("as") {
        Some("done") => Resolution::Done,
        Some("dead") => Resolution::Dead,
        _ => {
            let e = PageError::bad_request("Resolve as what?", "`as` is done or dead.");
            return Err(e).for_user(&user);
        }
    };
    let operation = fields.get("operation");
    state
        .desk
        .resolve(&key, operation, to, &act)
        .await
        .for_user(&user)?;
    Ok(Redirect::to(&event_path(&key)).into_response())
}

/// What a retry would change for one event of a search: its failed, uncertain or dead
/// operations go back to pending; a failed or deferred local effect runs again.
fn would_change(e: &EventSummary) -> Vec<String> {
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
) -> Result<Response, PageError> {
    bulk::operator_only(&user)?;
    let search = query
        .search(BULK_LIMIT)
        .map_err(|e| PageError::bad_request("Bad search", e))
        .for_user(&user)?;
    let found = state.desk.search(&search).await.for_user(&user)?;
    let rows: Vec<Row> = found.events.iter().filter_map(retry_row).collect();
    let cut = found.next.is_some();
    let preview = Preview {
        title: "Retry in bulk",
        action: "/events/retry",
        field: "keys",
        headers: &["event", "what changes"],
        count: format!("{} event(s) would change:", rows.len()),
        confirm: format!("Retry these {}", rows.len()),
        rows,
        none: "No event of this search can be retried.",
        note: Some(html! {
            p { "Search: " code { (query.query_string()) } }
            @if cut { p class="problem" { "Only the newest " (BULK_LIMIT) " events of the search are taken; retry again for the rest." } }
        }),
    };
    Ok(preview.page(&user))
}

/// A preview's row for an event a retry would change.
fn retry_row(e: &EventSummary) -> Option<Row> {
    let changes = would_change(e);
    let key = e.event_key.clone().unwrap_or_default();
    (!changes.is_empty()).then(|| Row {
        cells: vec![
            html! { a href=(event_path(&key)) { (key) } },
            html! { @for c in &changes { div { (c) } } },
        ],
        value: key,
    })
}

/// `POST /events/retry`: retries exactly the `keys` the preview listed, one by one.
pub(crate) async fn bulk_retry(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let (act, keys) = bulk::confirmed::<String>(&state, &user, &fields, "keys", "event")?;
    let mut changes = Vec::new();
    let mut not_done = Vec::new();
    for key in keys {
        match state.desk.retry(&key, &Retry::default(), &act).await {
            Ok(c) => changes.extend(c),
            Err(e) => not_done.push((key, format!("{e:#}"))),
        }
    }
    Ok(bulk::result_page(&user, "Retried", &changes, &not_done))
}

/// `POST /dead-letters/{id}/replay`.
pub(crate) async fn replay_letter(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(id): Path<i64>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let done = replayed(&state, &[id], &act).await.for_user(&user)?;
    let refused = match done.refused.first() {
        None => return Ok(Redirect::to(&format!("/dead-letters/{id}")).into_response()),
        Some((_, why)) if why.starts_with("no dead letter") => {
            PageError::not_found("Not found", why)
        }
        Some((_, why)) => PageError::unavailable("Not replayed", why),
    };
    Err(refused).for_user(&user)
}

/// The dead letters `ids` produced again; refused when the console has no brokers.
async fn replayed(
    state: &State,
    ids: &[i64],
    act: &Act,
) -> Result<crate::operator::dead_letters::Replayed, PageError> {
    if state.desk.producer().is_none() {
        return Err(no_brokers());
    }
    Ok(state.desk.replay_letters(ids, act).await?)
}

/// 409: the console was started without brokers.
pub(crate) fn no_brokers() -> PageError {
    PageError::new(
        StatusCode::CONFLICT,
        "No broker",
        "The console was started without --brokers: it cannot put anything on the topic.",
    )
}

/// `GET /dead-letters/replay?…`: the never-replayed letters a bulk replay would take.
pub(crate) async fn bulk_replay_preview(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Query(query): Query<LettersQuery>,
) -> Result<Response, PageError> {
    bulk::operator_only(&user)?;
    let search = query
        .search(BULK_LIMIT)
        .map_err(|e| PageError::bad_request("Bad search", e))
        .for_user(&user)?;
    let search = crate::claims::dead_letters::LetterSearch {
        not_replayed: true,
        ..search
    };
    let letters = state.desk.letters(&search).await.for_user(&user)?;
    let rows: Vec<Row> = letters
        .iter()
        .map(|l| Row {
            value: l.id.to_string(),
            cells: vec![
                html! { a href=(format!("/dead-letters/{}", l.id)) { (l.id) } },
                html! { (l.topic) "/" (l.partition) "@" (l.offset) },
                html! { (l.reason) },
            ],
        })
        .collect();
    let preview = Preview {
        title: "Replay dead letters",
        action: "/dead-letters/replay",
        field: "ids",
        headers: &["id", "message", "reason"],
        count: format!(
            "{} dead letter(s) would be produced again to their topics:",
            rows.len()
        ),
        confirm: format!("Replay these {}", rows.len()),
        rows,
        none: "No dead letter of this search waits for a replay.",
        note: None,
    };
    Ok(preview.page(&user))
}

/// `POST /dead-letters/replay`: replays exactly the `ids` the preview listed.
pub(crate) async fn bulk_replay(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let (act, ids) = bulk::confirmed::<i64>(&state, &user, &fields, "ids", "letter")?;
    let done = replayed(&state, &ids, &act).await.for_user(&user)?;
    let refused: Vec<(String, String)> = done
        .refused
        .iter()
        .map(|(id, why)| (format!("dead_letter:{id}"), why.clone()))
        .collect();
    Ok(bulk::result_page(
        &user,
        "Replayed",
        &done.changes,
        &refused,
    ))
}
