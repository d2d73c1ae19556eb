//! `GET /events/{key}`: one event's story. The read model's moments
//! ([`crate::operator::story::Moment`]) on one timeline, and the actions its state allows.

use super::auth::{Role, User};
use super::layout::{document, event_path, maybe_when, pretty, when};
use super::problem::{ForUser, PageError};
use super::visibility::error_text;
use super::State;
use crate::claims::conflicts::ConflictRow;
use crate::claims::dead_letters::DeadLetterRow;
use crate::claims::ClaimStatus;
use crate::operator::events::EventDetail;
use crate::operator::story::{short, Moment};
use crate::outbox::{AttemptRow, OperationRow, OutboxState};
use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use maud::{html, Markup, Render};

pub(crate) async fn story(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
) -> Result<Response, PageError> {
    let story = state.desk.story(&key).await.map_err(|e| match e {
        crate::operator::OperatorError::NoSuchEvent(_) => {
            PageError::not_found("No such event", format!("No event has the key {key:?}."))
        }
        e => PageError::from(e).titled("Unavailable"),
    });
    let story = story.for_user(&user)?;
    let sees = user.sees_payloads(&state);
    let detail = &story.detail;
    let body = html! {
        main {
            h1 { "Event " code id="event-key" { (key) } }
            (summary(detail))
            (actions_of(&user, &key, detail))
            h2 { "Story" }
            ol class="timeline" id="timeline" {
                @for moment in &story.moments { (Shown { moment, sees }) }
            }
            (payload(detail, sees))
        }
    };
    Ok(document(&format!("Event {key}"), Some(&user), body).into_response())
}

/// The event's source, type, claim and operations at a glance.
fn summary(d: &EventDetail) -> Markup {
    let claim = &d.claim;
    html! {
        dl {
            dt { "source" } dd { (claim.source) }
            dt { "type" } dd { (claim.event_type.clone().unwrap_or_default()) }
            dt { "claim" } dd id="claim-status" class=(format!("state {}", claim.status)) { (claim.status) }
            dt { "operations" } dd id="operation-states" {
                @for op in &d.operations { span class=(format!("state {}", op.state)) { (short(&op.operation_key)) "=" (op.state) } " " }
            }
            @if let Some(tp) = &claim.traceparent { dt { "trace" } dd { code { (tp) } } }
        }
    }
}

fn payload(d: &EventDetail, sees: bool) -> Markup {
    html! {
        @if sees {
            @if let Some(payload) = &d.claim.payload {
                h2 { "Payload" }
                pre id="payload" { (pretty(payload.get())) }
            }
        } @else {
            p class="hidden" { "Payloads are shown to operators only." }
        }
    }
}

/// A moment as the timeline shows it to a user who sees payloads or not.
struct Shown<'a> {
    moment: &'a Moment,
    sees: bool,
}

impl Render for Shown<'_> {
    fn render(&self) -> Markup {
        let m = self.moment;
        html! {
            li class=(if m.bad() { "bad" } else { "" }) {
                (when(m.at())) span class="what" { (m.what()) }
                div class="detail" { (self.detail()) }
            }
        }
    }
}

impl Shown<'_> {
    fn detail(&self) -> Markup {
        let sees = self.sees;
        match self.moment {
            Moment::Received {
                source,
                event_type,
                request_id,
                ..
            } => html! {
                "from " (source)
                @if let Some(t) = event_type { ", type " (t) }
                @if let Some(id) = request_id { ", request " code { (id) } }
            },
            Moment::Message { key, position, .. } => html! {
                "key " code { (key) } " at " code { (position) } " (topic/partition@offset)"
            },
            Moment::Claimed {
                attempts,
                settled_at,
                last_error,
                ..
            } => html! {
                (attempts) " effect attempt(s)"
                @if let Some(at) = settled_at { ", settled " (when(*at)) }
                @if let Some(e) = last_error { div class="problem" { "last error: " (error_text(sees, e)) } }
            },
            Moment::Redelivered { at, first, .. } => html! {
                span class="deliveries" { "first delivered " (when(*first)) ", last " (when(*at)) }
            },
            Moment::Deferred {
                reason,
                due,
                deadline,
                ..
            } => html! {
                @if let Some(r) = reason { "not yet: " (error_text(sees, r)) }
                @if let Some(due) = due { "; due again " (when(*due)) }
                @if let Some(deadline) = deadline { "; fails after " (when(*deadline)) }
            },
            Moment::Ledger(row) => html! {
                "row " (row.id) @if sees { details { summary { "payload" } pre { (pretty(row.payload.get())) } } }
            },
            Moment::Operation { operation, .. } => operation_detail(operation),
            Moment::Fulfilled(f) => html! {
                "Nothing was enqueued: the obligation " code { (f.operation_key) } " is held by "
                a href=(event_path(&f.fulfilled_by)) class="fulfilled-by" { (f.fulfilled_by) }
            },
            Moment::Attempt(a) => attempt_detail(a, sees),
            Moment::Conflict { conflict, kept } => conflict_detail(conflict, kept.as_deref(), sees),
            Moment::DeadLetter(letter) => letter_detail(letter, sees),
            Moment::Operator(a) => html! {
                span class="audit" { (a.target) ": " (a.state_before.clone().unwrap_or_default()) " → " (a.state_after.clone().unwrap_or_default()) }
                @if let Some(reason) = &a.reason { " · " q { (reason) } }
            },
        }
    }
}

/// Another payload under the event's key, beside the kept one where it is stored.
fn conflict_detail(c: &ConflictRow, kept: Option<&str>, sees: bool) -> Markup {
    html! {
        "Kafka message " code { (c.message) } " (topic/partition@offset), payload sha256 "
        code { (c.payload_sha256) } ", last seen " (when(c.last_seen_at))
        @if let Some(r) = &c.reason { " · " (r) }
        @if sees {
            @match kept {
                Some(kept) => (diff(kept, c.payload.get())),
                None => p class="hidden" { "The kept payload is not stored (a settled claim keeps only its hash)." },
            }
        }
    }
}

fn letter_detail(l: &DeadLetterRow, sees: bool) -> Markup {
    html! {
        a href=(format!("/dead-letters/{}", l.id)) { "dead letter " (l.id) } ": " (error_text(sees, &l.reason))
        " at " code { (l.topic) "/" (l.partition) "@" (l.offset) }
        @if let Some(at) = l.replayed_at { ", replayed " (maybe_when(Some(at))) }
    }
}

/// An outbox operation as it stands.
fn operation_detail(op: &OperationRow) -> Markup {
    let due = matches!(
        op.state,
        OutboxState::Pending | OutboxState::Retryable | OutboxState::Uncertain
    );
    html! {
        (op.request) " " code { (op.destination) }
        @if let Some(c) = &op.credential { " with credential " (c) }
        ", idempotency key " code { (op.operation_key) }
        ", attempts " (op.attempts)
        @if due { ", due " (when(op.next_attempt_at)) }
        @if let Some(lease) = op.lease_expires_at { ", leased until " (when(lease)) }
        @if let Some(at) = op.completed_at { ", settled " (when(at)) }
        @if let Some(until) = op.idempotent_until { ", its key honoured downstream until " (when(until)) }
        @if let Some(at) = op.held_at { div class="problem" id="held" { "Held since " (when(at)) ": past the idempotency window, so a dispatcher will not send it again (the downstream could apply it twice). Check the downstream, then resolve it, or retry it accepting the risk." } }
    }
}

/// One attempt or reconciliation of an operation.
fn attempt_detail(a: &AttemptRow, sees: bool) -> Markup {
    html! {
        "worker " code { (a.worker) } ", fencing token " (a.fencing_token)
        ", status " (a.status_code.map(|s| s.to_string()).unwrap_or_else(|| "no answer".into()))
        ", " (a.duration_ms) " ms"
        @if !a.applied { ", lease taken over: changed nothing" }
        @if let Some(e) = &a.error { div class="problem" { (error_text(sees, e)) } }
        @if let Some(r) = &a.response_excerpt { @if sees { details { summary { "response" } pre { (r) } } } }
    }
}

/// Whether one of the event's operations is past its idempotency window: a retry must accept
/// the risk of a second application.
fn past_window(d: &EventDetail) -> bool {
    let now = chrono::Utc::now();
    d.operations.iter().any(|o| {
        o.state.is_retryable_by_hand()
            && (o.held_at.is_some() || o.idempotent_until.is_some_and(|u| u <= now))
    })
}

/// The kept payload and a conflicting one side by side, line by line.
fn diff(kept: &str, other: &str) -> Markup {
    let (kept, other) = (pretty(kept), pretty(other));
    let diff = similar::TextDiff::from_lines(&kept, &other);
    html! {
        table class="diff" {
            thead { tr { th { "kept (first)" } th { "conflicting" } } }
            tbody {
                @for change in diff.iter_all_changes() {
                    @let line = change.value().trim_end_matches('\n');
                    @match change.tag() {
                        similar::ChangeTag::Equal => tr { td { (line) } td { (line) } },
                        similar::ChangeTag::Delete => tr { td class="del" { (line) } td {} },
                        similar::ChangeTag::Insert => tr { td {} td class="ins" { (line) } },
                    }
                }
            }
        }
    }
}

/// Whether an operator may retry the event: a failed or deferred claim with no operations, or
/// an operation failed, uncertain or dead.
pub(crate) fn retryable(d: &EventDetail) -> bool {
    if d.operations.is_empty() {
        return matches!(d.claim.status, ClaimStatus::Failed | ClaimStatus::Deferred);
    }
    d.operations.iter().any(|o| o.state.is_retryable_by_hand())
}

/// Whether an operator may resolve it: a failed or deferred claim, or an operation not done
/// and not under a live lease.
pub(crate) fn resolvable(d: &EventDetail) -> bool {
    let claim = matches!(d.claim.status, ClaimStatus::Failed | ClaimStatus::Deferred);
    let ops = d.operations.iter().any(|o| {
        o.state != OutboxState::Done
            && !(o.state == OutboxState::InProgress
                && o.lease_expires_at.is_some_and(|l| l > Utc::now()))
    });
    claim || ops
}

fn actions_of(user: &User, key: &str, d: &EventDetail) -> Markup {
    if user.role != Role::Operator {
        return html! {};
    }
    let path = event_path(key);
    let (retry, resolve) = (retryable(d), resolvable(d));
    html! {
        @if retry || resolve {
            section id="actions" {
                h2 { "Actions" }
                @if retry { (retry_form(user, &path, past_window(d))) }
                @if resolve { (resolve_form(user, &path)) }
            }
        }
    }
}

fn retry_form(user: &User, path: &str, past_window: bool) -> Markup {
    html! {
        form class="action" method="post" action=(format!("{path}/retry")) {
            input type="hidden" name="csrf_token" value=(user.csrf);
            label { "Reason " input name="reason" id="retry-reason" required; }
            @if past_window {
                label { input type="checkbox" name="accept_duplicate_risk" value="yes" id="accept-duplicate-risk"; " send past the idempotency window (the downstream could apply it twice)" }
            }
            button type="submit" id="retry" { "Retry" }
        }
    }
}

fn resolve_form(user: &User, path: &str) -> Markup {
    html! {
        form class="action" method="post" action=(format!("{path}/resolve")) {
            input type="hidden" name="csrf_token" value=(user.csrf);
            label { "Reason " input name="reason" id="resolve-reason" required; }
            select name="as" { option value="done" { "done (confirmed elsewhere)" } option value="dead" { "dead (will not happen)" } }
            button type="submit" id="resolve" { "Resolve" }
        }
    }
}
