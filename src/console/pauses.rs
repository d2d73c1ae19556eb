//! The overview's pauses: the paused destinations and sources, each with a resume form, and a
//! form to pause one. Each action is a `POST` through [`authorize`] (an operator, the session's CSRF token, a
//! reason) that runs the desk's own pause or resume with the user as the actor, then goes back
//! to the overview.

use super::actions::authorize;
use super::auth::{Role, User};
use super::form::Fields;
use super::layout::maybe_when;
use super::problem::{ForUser, PageError};
use super::State;
use crate::destinations::DestinationRow;
use crate::sources::SourcePause;
use axum::response::{IntoResponse, Redirect, Response};
use maud::{html, Markup};

/// The paused destinations, with a resume form each for an operator, and the pause form.
pub(crate) fn destinations(user: &User, rows: &[DestinationRow]) -> Markup {
    let paused: Vec<&DestinationRow> = rows.iter().filter(|d| d.pause.is_some()).collect();
    html! {
        section id="destination-pauses" {
            h2 { "Paused destinations" }
            @if paused.is_empty() { p { "No destination is paused." } }
            @else {
                table id="paused-destinations" {
                    thead { tr { th { "origin" } th { "by" } th { "why" } th { "until" } th { "backlog" } th {} } }
                    tbody { @for d in paused { (paused_row(user, d)) } }
                }
            }
            @if user.role == Role::Operator { (pause_form(user)) }
        }
    }
}

fn paused_row(user: &User, d: &DestinationRow) -> Markup {
    let Some(p) = &d.pause else { return html! {} };
    html! {
        tr {
            td { (d.origin) } td { (p.by) } td { (p.reason) } td { (maybe_when(p.until)) } td class="n" { (d.backlog) }
            td { @if user.role == Role::Operator {
                form class="action" method="post" action="/destinations/resume" {
                    input type="hidden" name="csrf_token" value=(user.csrf);
                    input type="hidden" name="origin" value=(d.origin);
                    input name="reason" placeholder="reason" required;
                    button type="submit" { "Resume" }
                }
            } }
        }
    }
}

fn pause_form(user: &User) -> Markup {
    html! {
        form class="action" method="post" action="/destinations/pause" id="pause-destination" {
            input type="hidden" name="csrf_token" value=(user.csrf);
            label { "Origin " input name="origin" placeholder="https://api.example.com" required; }
            label { "Reason " input name="reason" required; }
            label { "For " input name="until" placeholder="until resumed, or 30m, 2h"; }
            button type="submit" { "Pause" }
        }
    }
}

/// `POST /destinations/pause`: `origin`, `reason`, and `until` (a duration) when it ends by
/// itself.
pub(crate) async fn pause_destination(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let origin = required(&user, &fields, "origin")?;
    let until = match fields.get("until") {
        None => None,
        Some(text) => Some(
            crate::args::wait(std::time::Duration::from_secs(1))(text)
                .map_err(|e| PageError::bad_request("Pause for how long?", e))
                .for_user(&user)?,
        ),
    };
    state
        .desk
        .pause_destination(origin, until, &act)
        .await
        .for_user(&user)?;
    Ok(Redirect::to("/").into_response())
}

/// `POST /destinations/resume`: `origin` and `reason`.
pub(crate) async fn resume_destination(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let origin = required(&user, &fields, "origin")?;
    state
        .desk
        .resume_destination(origin, &act)
        .await
        .for_user(&user)?;
    Ok(Redirect::to("/").into_response())
}

/// The field `name`, refused (400) when it is missing.
fn required<'a>(user: &User, fields: &'a Fields, name: &str) -> Result<&'a str, PageError> {
    fields
        .get(name)
        .ok_or_else(|| PageError::bad_request("Missing", format!("The form needs `{name}`.")))
        .for_user(user)
}

/// The paused sources, with a resume form each for an operator, and the pause form.
pub(crate) fn sources(user: &User, paused: &[SourcePause]) -> Markup {
    html! {
        section id="source-pauses" {
            h2 { "Paused sources" }
            @if paused.is_empty() { p { "No source is paused." } }
            @else {
                p { "Ingest accepts their deliveries; their events are held until resumed." }
                table id="paused-sources" {
                    thead { tr { th { "source" } th { "by" } th { "why" } th { "since" } th {} } }
                    tbody { @for p in paused { (paused_source(user, p)) } }
                }
            }
            @if user.role == Role::Operator { (source_form(user)) }
        }
    }
}

fn paused_source(user: &User, p: &SourcePause) -> Markup {
    html! {
        tr {
            td { (p.source) } td { (p.by) } td { (p.reason) } td { (maybe_when(Some(p.at))) }
            td { @if user.role == Role::Operator {
                form class="action" method="post" action="/sources/resume" {
                    input type="hidden" name="csrf_token" value=(user.csrf);
                    input type="hidden" name="source" value=(p.source);
                    input name="reason" placeholder="reason" required;
                    button type="submit" { "Resume" }
                }
            } }
        }
    }
}

fn source_form(user: &User) -> Markup {
    html! {
        form class="action" method="post" action="/sources/pause" id="pause-source" {
            input type="hidden" name="csrf_token" value=(user.csrf);
            label { "Source " input name="source" placeholder="stripe" required; }
            label { "Reason " input name="reason" required; }
            button type="submit" { "Pause" }
        }
    }
}

/// `POST /sources/pause`: `source` and `reason`.
pub(crate) async fn pause_source(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let source = required(&user, &fields, "source")?;
    state
        .desk
        .pause_source(source, &act)
        .await
        .for_user(&user)?;
    Ok(Redirect::to("/").into_response())
}

/// `POST /sources/resume`: `source` and `reason`.
pub(crate) async fn resume_source(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    let source = required(&user, &fields, "source")?;
    state
        .desk
        .resume_source(source, &act)
        .await
        .for_user(&user)?;
    Ok(Redirect::to("/").into_response())
}
