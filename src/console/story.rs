//! `GET /events/{key}`: one event's story. Everything known about it on one timeline, and the
//! actions its state allows.

use super::auth::{Role, User};
use super::pages::{self, document, maybe_when, problem, unavailable, when};
use super::visibility::error_text;
use super::State;
use crate::claims::ClaimStatus;
use crate::operator::events::{self, EventDetail};
use crate::operator::OperatorError;
use crate::outbox::OutboxState;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{html, Markup};

/// One moment of the story.
struct Entry {
    at: DateTime<Utc>,
    /// Keeps entries of one moment in the order they happen.
    order: u8,
    what: String,
    bad: bool,
    detail: Markup,
}

pub(crate) async fn story(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(key): Path<String>,
) -> Response {
    let pool = match state.pool_for(&key).await {
        Ok(pool) => pool,
        Err(e) => {
            return problem(
                StatusCode::SERVICE_UNAVAILABLE,
                &user,
                "Unavailable",
                &format!("{e:#}"),
            )
        }
    };
    let detail = match events::show(&pool, &key).await {
        Ok(detail) => detail,
        Err(OperatorError::NoSuchEvent(_)) => {
            return problem(
                StatusCode::NOT_FOUND,
                &user,
                "No such event",
                &format!("No event has the key {key:?}."),
            )
        }
        Err(e) => return unavailable(&user, "Unavailable", &e),
    };
    let letters: Vec<String> = detail
        .dead_letters
        .iter()
        .map(|l| format!("dead_letter:{}", l.id))
        .collect();
    let actions = crate::audit::of_event(&pool, &key, &letters)
        .await
        .unwrap_or_default();
    let sees = user.sees_payloads(&state);
    let mut entries = timeline(&detail, sees);
    for a in &actions {
        entries.push(Entry {
            at: a.at,
            order: 9,
            what: format!("operator {}: {}", a.action, a.actor),
            bad: false,
            detail: html! {
                span class="audit" { (a.target) ": " (a.state_before.clone().unwrap_or_default()) " → " (a.state_after.clone().unwrap_or_default()) }
                @if let Some(reason) = &a.reason { " · " q { (reason) } }
            },
        });
    }
    entries.sort_by_key(|e| (e.at, e.order));
    let claim = &detail.claim;
    let body = html! {
        main {
            h1 { "Event " code id="event-key" { (key) } }
            dl {
                dt { "source" } dd { (claim.source) }
                dt { "type" } dd { (claim.event_type.clone().unwrap_or_default()) }
                dt { "claim" } dd id="claim-status" class=(format!("state {}", claim.status)) { (claim.status) }
                dt { "operations" } dd id="operation-states" {
                    @for op in &detail.operations { span class=(format!("state {}", op.state)) { (short(&op.operation_key)) "=" (op.state) } " " }
                }
                @if let Some(tp) = &claim.traceparent { dt { "trace" } dd { code { (tp) } } }
            }
            (actions_of(&user, &key, &detail))
            h2 { "Story" }
            ol class="timeline" id="timeline" {
                @for e in &entries {
                    li class=(if e.bad { "bad" } else { "" }) {
                        (when(e.at)) span class="what" { (e.what) }
                        div class="detail" { (e.detail) }
                    }
                }
            }
            @if sees {
                @if let Some(payload) = &claim.payload {
                    h2 { "Payload" }
                    pre id="payload" { (pages::pretty(payload.get())) }
                }
            } @else {
                p class="hidden" { "Payloads are shown to operators only." }
            }
        }
    };
    document(&format!("Event {key}"), Some(&user), body).into_response()
}

/// The operation's name, from its key (`key#name`).
fn short(operation_key: &str) -> &str {
    operation_key
        .rsplit_once('#')
        .map(|(_, n)| n)
        .unwrap_or(operation_key)
}

fn timeline(d: &EventDetail, sees: bool) -> Vec<Entry> {
    let claim = &d.claim;
    let mut out = Vec::new();
    out.push(Entry {
        at: claim.received_at.unwrap_or(claim.claimed_at),
        order: 0,
        what: "received".into(),
        bad: false,
        detail: html! {
            "from " (claim.source)
            @if let Some(t) = &claim.event_type { ", type " (t) }
            @if let Some(id) = &claim.request_id { ", request " code { (id) } }
        },
    });
    out.push(Entry {
        at: claim.claimed_at,
        order: 1,
        what: "Kafka message".into(),
        bad: false,
        detail: html! { "key " code { (claim.event_key) } " at " code { (claim.first_seen_at) } " (topic/partition@offset)" },
    });
    let settled_bad = matches!(claim.status, ClaimStatus::Failed | ClaimStatus::Dead);
    out.push(Entry {
        at: claim.claimed_at,
        order: 2,
        what: format!("claimed: {}", claim.status),
        bad: settled_bad,
        detail: html! {
            (claim.attempts) " effect attempt(s)"
            @if let Some(at) = claim.completed_at { ", settled " (when(at)) }
            @if let Some(e) = &claim.last_error { div class="problem" { "last error: " (error_text(sees, e)) } }
        },
    });
    if claim.due_at.is_some() || claim.deferred_reason.is_some() {
        out.push(Entry {
            at: claim.claimed_at,
            order: 3,
            what: "deferred".into(),
            bad: false,
            detail: html! {
                @if let Some(r) = &claim.deferred_reason { "not yet: " (error_text(sees, r)) }
                @if let Some(due) = claim.due_at { "; due again " (when(due)) }
                @if let Some(deadline) = claim.deadline_at { "; fails after " (when(deadline)) }
            },
        });
    }
    for row in &d.ledger {
        out.push(Entry {
            at: row.applied_at,
            order: 4,
            what: "effect: ledger row".into(),
            bad: false,
            detail: html! { "row " (row.id) @if sees { details { summary { "payload" } pre { (pages::pretty(row.payload.get())) } } } },
        });
    }
    out.extend(operations(d));
    out.extend(fulfilled(d));
    for a in &d.attempts {
        let kind = match a.kind.as_str() {
            "reconcile" => "reconciliation",
            _ => "attempt",
        };
        out.push(Entry {
            at: a.started_at,
            order: 6,
            what: format!("{kind} of {}: {}", a.operation, a.outcome.as_str()),
            bad: !matches!(a.outcome.as_str(), "done"),
            detail: html! {
                "worker " code { (a.worker) } ", fencing token " (a.fencing_token)
                ", status " (a.status_code.map(|s| s.to_string()).unwrap_or_else(|| "no answer".into()))
                ", " (a.duration_ms) " ms"
                @if !a.applied { ", lease taken over: changed nothing" }
                @if let Some(e) = &a.error { div class="problem" { (error_text(sees, e)) } }
                @if let Some(r) = &a.response_excerpt { @if sees { details { summary { "response" } pre { (r) } } } }
            },
        });
    }
    let kept = claim
        .payload
        .as_ref()
        .map(|p| p.get().to_owned())
        .or_else(|| d.ledger.first().map(|l| l.payload.get().to_owned()));
    for c in &d.key_conflicts {
        out.push(Entry {
            at: c.first_seen_at,
            order: 7,
            what: format!("key conflict: another payload, seen {} time(s)", c.times_seen),
            bad: true,
            detail: html! {
                "Kafka message " code { (c.message) } " (topic/partition@offset), payload sha256 "
                code { (c.payload_sha256) } ", last seen " (when(c.last_seen_at))
                @if let Some(r) = &c.reason { " · " (r) }
                @if sees {
                    @match &kept {
                        Some(kept) => (diff(kept, c.payload.get())),
                        None => p class="hidden" { "The kept payload is not stored (a settled claim keeps only its hash)." },
                    }
                }
            },
        });
    }
    for l in &d.dead_letters {
        out.push(Entry {
            at: l.created_at,
            order: 8,
            what: "dead letter".into(),
            bad: true,
            detail: html! {
                a href=(format!("/dead-letters/{}", l.id)) { "dead letter " (l.id) } ": " (error_text(sees, &l.reason))
                " at " code { (l.topic) "/" (l.partition) "@" (l.offset) }
                @if let Some(at) = l.replayed_at { ", replayed " (maybe_when(Some(at))) }
            },
        });
    }
    out
}

/// Each outbox operation of the event, as it stands.
fn operations(d: &EventDetail) -> Vec<Entry> {
    let claim = &d.claim;
    let mut out = Vec::new();
    for op in &d.operations {
        let name = short(&op.operation_key);
        let bad = matches!(
            op.state,
            OutboxState::Failed | OutboxState::Dead | OutboxState::Uncertain
        );
        out.push(Entry {
            at: claim.claimed_at,
            order: 5,
            what: format!("operation {name}: {}", op.state),
            bad,
            detail: html! {
                (op.request) " " code { (op.destination) }
                @if let Some(c) = &op.credential { " with credential " (c) }
                ", idempotency key " code { (op.operation_key) }
                ", attempts " (op.attempts)
                @if matches!(op.state, OutboxState::Pending | OutboxState::Retryable | OutboxState::Uncertain) { ", due " (when(op.next_attempt_at)) }
                @if let Some(lease) = op.lease_expires_at { ", leased until " (when(lease)) }
                @if let Some(at) = op.completed_at { ", settled " (when(at)) }
                @if let Some(until) = op.idempotent_until { ", its key honoured downstream until " (when(until)) }
                @if let Some(at) = op.held_at { div class="problem" id="held" { "Held since " (when(at)) ": past the idempotency window, so a dispatcher will not send it again (the downstream could apply it twice). Check the downstream, then resolve it, or retry it accepting the risk." } }
            },
        });
    }
    out
}

/// The operations another event's operations fulfil: both events named one obligation.
fn fulfilled(d: &EventDetail) -> Vec<Entry> {
    d.fulfilled_by
        .iter()
        .map(|f| Entry {
            at: f.recorded_at,
            order: 5,
            what: format!("operation {}: fulfilled by another event", f.operation),
            bad: false,
            detail: html! {
                "Nothing was enqueued: the obligation " code { (f.operation_key) } " is held by "
                a href=(pages::event_path(&f.fulfilled_by)) class="fulfilled-by" { (f.fulfilled_by) }
            },
        })
        .collect()
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
    let (kept, other) = (pages::pretty(kept), pages::pretty(other));
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
    let path = pages::event_path(key);
    let (retry, resolve) = (retryable(d), resolvable(d));
    html! {
        @if retry || resolve {
            section id="actions" {
                h2 { "Actions" }
                @if retry {
                    form class="action" method="post" action=(format!("{path}/retry")) {
                        input type="hidden" name="csrf_token" value=(user.csrf);
                        label { "Reason " input name="reason" id="retry-reason" required; }
                        @if past_window(d) {
                            label { input type="checkbox" name="accept_duplicate_risk" value="yes" id="accept-duplicate-risk"; " send past the idempotency window (the downstream could apply it twice)" }
                        }
                        button type="submit" id="retry" { "Retry" }
                    }
                }
                @if resolve {
                    form class="action" method="post" action=(format!("{path}/resolve")) {
                        input type="hidden" name="csrf_token" value=(user.csrf);
                        label { "Reason " input name="reason" id="resolve-reason" required; }
                        select name="as" { option value="done" { "done (confirmed elsewhere)" } option value="dead" { "dead (will not happen)" } }
                        button type="submit" id="resolve" { "Resolve" }
                    }
                }
            }
        }
    }
}
