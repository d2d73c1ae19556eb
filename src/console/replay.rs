//! `GET` and `POST /replay`: a replay by time, as `replayproof replay` runs it.

use super::actions::{authorize, no_brokers};
use super::auth::User;
use super::bulk::operator_only;
use super::form::{parse_when, Fields};
use super::layout::document;
use super::problem::{ForUser, PageError};
use super::State;
use crate::operator::replay::{ReplayReport, Window};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{html, Markup};

fn replay_form_body(user: &User, fields: Option<&Fields>) -> Markup {
    let value = |name: &str| {
        fields
            .and_then(|f| f.get(name))
            .unwrap_or_default()
            .to_owned()
    };
    let dry_run = fields.is_none_or(|f| f.get("dry_run").is_some());
    html! {
        form method="post" action="/replay" {
            input type="hidden" name="csrf_token" value=(user.csrf);
            p { label { "Since " input name="since" id="since" required value=(value("since")) placeholder="2026-12-02T10:00:00Z or 40m"; } }
            p { label { "Until " input name="until" id="until" value=(value("until")) placeholder="empty: up to now"; } }
            p { label { "Partition " input name="partition" id="partition" value=(value("partition")) placeholder="every partition"; } }
            p { label { input type="checkbox" name="dry_run" value="1" checked[dry_run]; " dry run: count only" } }
            p { label { "Reason " input name="reason" id="replay-reason" required value=(value("reason")); } }
            button type="submit" id="run-replay" { "Replay" }
        }
    }
}

/// `GET /replay`: the form of a replay by time.
pub(crate) async fn replay_form(user: User) -> Result<Response, PageError> {
    operator_only(&user)?;
    let body = html! {
        main {
            h1 { "Replay by time" }
            p { "Reads the topic again from a moment, outside the live group, through the claim path: events already claimed change nothing, and only those with no claim are applied." }
            (replay_form_body(&user, None))
        }
    };
    Ok(document("Replay by time", Some(&user), body).into_response())
}

/// The window the form asks for, or what is wrong with it.
fn window_of(state: &State, fields: &Fields) -> Result<Window, PageError> {
    let kafka = state.desk.kafka().ok_or_else(no_brokers)?;
    let moment = |name: &str| -> Result<Option<DateTime<Utc>>, PageError> {
        let parsed = fields.get(name).map(parse_when).transpose();
        parsed.map_err(|e| PageError::bad_request("Bad moment", e))
    };
    let (since, until) = (moment("since")?, moment("until")?);
    let since = since
        .ok_or_else(|| PageError::bad_request("Since when?", "The window needs its start."))?;
    let partition = fields.get("partition").map(str::parse::<i32>).transpose();
    let partition = partition
        .map_err(|_| PageError::bad_request("Bad partition", "A partition is a number."))?;
    Ok(Window {
        brokers: kafka.brokers.clone(),
        topic: kafka.topic.clone(),
        options: kafka.options.clone(),
        since,
        until,
        partition,
        dry_run: fields.get("dry_run").is_some(),
        force: false,
    })
}

/// `POST /replay`: a replay by time, as `replayproof replay` runs it.
pub(crate) async fn replay_topic(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    fields: Fields,
) -> Result<Response, PageError> {
    let act = authorize(&state, &user, &fields)?;
    if state.desk.processor().is_none() {
        return Err(no_brokers()).for_user(&user);
    }
    let window = window_of(&state, &fields).for_user(&user)?;
    let report = state
        .desk
        .replay_window(&window, &act)
        .await
        .for_user(&user)?;
    let body = html! {
        main {
            h1 { "Replay by time" @if report.dry_run { " (dry run)" } }
            (report_table(&report))
            @if report.dry_run { h2 { "Run it" } (replay_form_body(&user, Some(&fields))) }
        }
    };
    Ok(document("Replay by time", Some(&user), body).into_response())
}

fn report_table(report: &ReplayReport) -> Markup {
    let counts = [
        ("read", report.read),
        ("already applied", report.already_applied),
        ("newly applied", report.newly_applied),
        ("dead-lettered", report.dead_lettered),
        ("conflicts", report.conflicts),
        ("failed", report.failed),
        ("deferred", report.deferred),
        ("expired replays", report.expired),
    ];
    html! {
        table id="replay-report" {
            @for (name, n) in counts { tr { td { (name) } td class="n" { (n) } } }
        }
        h2 { "Partitions" }
        table { @for p in &report.partitions { tr { td { (p.partition) } td { "offsets " (p.from) " to " (p.to) } } } }
    }
}
