//! `GET /`: the overview, the numbers behind the alerts, each linking to the list behind it,
//! and the paused destinations and sources with their actions ([`super::pauses`]).

use super::auth::User;
use super::charts;
use super::layout::{document, q, refreshing};
use super::problem::{ForUser, PageError};
use super::State;
use crate::operator::counts::Count;
use crate::operator::status::{OpenBreaker, PartitionLag, Status};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use std::collections::HashMap;
use std::time::Instant;

/// The last committed offsets read, to tell the group's throughput.
pub(crate) struct Sample {
    at: Instant,
    committed: HashMap<i32, i64>,
}

/// `?refresh=off` stops the overview's reloading by itself.
#[derive(Debug, serde::Deserialize)]
pub(crate) struct Refresh {
    refresh: Option<String>,
}

/// How often the overview reloads by itself, unless paused.
const REFRESH_EVERY: u32 = 30;

/// What the overview shows, read in one go.
struct Seen {
    status: Status,
    destinations: Vec<crate::destinations::DestinationRow>,
    sources: Vec<crate::sources::SourcePause>,
    minutes: Vec<crate::activity::Minute>,
}

async fn seen(state: &State) -> Result<Seen, PageError> {
    let titled =
        |e: crate::operator::OperatorError| PageError::from(e).titled("Overview unavailable");
    let now = chrono::Utc::now();
    Ok(Seen {
        status: state
            .desk
            .status()
            .await
            .map_err(|e| PageError::from(e).titled("Overview unavailable"))?,
        destinations: state.desk.destinations().await.map_err(titled)?,
        sources: state.desk.paused_sources().await.map_err(titled)?,
        minutes: state
            .desk
            .activity(charts::start(now))
            .await
            .map_err(titled)?,
    })
}

/// `GET /`: the group's lag, claims, outbox, what needs an operator, open breakers, the last
/// hour's charts and the pauses; reloaded every 30 s unless `?refresh=off`.
pub(crate) async fn overview(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    axum::extract::Query(refresh): axum::extract::Query<Refresh>,
) -> Result<Response, PageError> {
    let seen = seen(&state).await.for_user(&user)?;
    let status = &seen.status;
    let rates = throughput(&state, &status.lag);
    let paused = refresh.refresh.as_deref() == Some("off");
    let body = html! {
        main {
            h1 { "Overview" }
            p class="refresh" {
                @if paused { "Not refreshing. " a href="/" { "Refresh every " (REFRESH_EVERY) " s" } }
                @else { "Refreshes every " (REFRESH_EVERY) " s. " a href="/?refresh=off" { "Pause refreshing" } }
            }
            (group(status, &rates))
            div class="grid" {
                (claims(status))
                (outbox(status))
                (attention(status))
                (destinations(&status.open_breakers))
                (output(&status.output))
            }
            (charts::last_hour(&seen.minutes, chrono::Utc::now()))
            (super::pauses::destinations(&user, &seen.destinations))
            (super::pauses::sources(&user, &seen.sources))
        }
    };
    let page = match paused {
        true => document("Overview", Some(&user), body),
        false => refreshing("Overview", &user, REFRESH_EVERY, body),
    };
    Ok(page.into_response())
}

/// The consumer group's lag and throughput per partition.
fn group(status: &Status, rates: &HashMap<i32, f64>) -> Markup {
    html! {
        section {
            h2 { "Consumer group" }
            @if status.lag.is_empty() {
                p { "No broker configured: start the console with --brokers to see the group's lag." }
            } @else {
                p { "Topic " code { (status.topic.clone().unwrap_or_default()) } ", group " code { (status.group.clone().unwrap_or_default()) } }
                table id="lag" {
                    thead { tr { th { "partition" } th { "committed" } th { "end" } th { "lag" } th { "throughput" } } }
                    tbody { @for p in &status.lag { (lag_row(p, rates)) } }
                }
            }
        }
    }
}

fn lag_row(p: &PartitionLag, rates: &HashMap<i32, f64>) -> Markup {
    html! {
        tr {
            td { (p.partition) }
            td { (p.committed.map(|c| c.to_string()).unwrap_or_else(|| "none".into())) }
            td { (p.high_watermark) }
            td class=(if p.lag > 0 { "warn" } else { "" }) { (p.lag) }
            td { (rates.get(&p.partition).map(|r| format!("{r:.1}/s")).unwrap_or_else(|| "–".into())) }
        }
    }
}

/// Rows of counts by state, each linking to the events in it.
fn by_state(id: &str, counts: &[(String, Count)]) -> Markup {
    html! {
        table id=(id) {
            @for (name, n) in counts {
                tr { td { a href=(format!("/events?state={}", q(name))) { (name) } } td class="n" { (n) } }
            }
        }
    }
}

fn claims(status: &Status) -> Markup {
    html! {
        section {
            h2 { "Claims" }
            @if status.claims.is_empty() {
                p { "No claim yet." }
            }
            (by_state("claims", &status.claims))
            p { "Deferred: " a href="/events?state=deferred" { (status.deferred) }
                @if let Some(due) = status.next_deferred_due_seconds { ", next due in " (format!("{due:.0}s")) } }
        }
    }
}

fn outbox(status: &Status) -> Markup {
    html! {
        section {
            h2 { "Outbox" }
            (by_state("outbox", &status.outbox))
            p { "Oldest due operation: " (format!("{:.0}s", status.oldest_due_seconds)) " · "
                a href="/events?state=in_progress" { "expired leases: " (status.expired_leases) } }
        }
    }
}

/// The Kafka output's backlog per output partition, stops first in their own words.
fn output(backlog: &[crate::output::store::Backlog]) -> Markup {
    html! {
        section {
            h2 { "Kafka output" }
            @if backlog.is_empty() {
                p id="output-backlog" { "Nothing waiting to be relayed." }
            } @else {
                table id="output-backlog" {
                    thead { tr { th { "Output topic" } th { "Partition" } th { "Waiting" } th { "Relay" } th { "State" } } }
                    tbody { @for b in backlog { tr {
                        td { code { (b.topic) } }
                        td { (b.partition.map_or("unassigned".into(), |p| p.to_string())) }
                        td { (b.pending) }
                        td { (b.owner.clone().unwrap_or_else(|| "-".into())) }
                        @match (&b.stopped, b.in_doubt) {
                            (Some(why), _) => td class="warn" { "stopped: " (why) },
                            (None, true) => td { "in doubt: read back first" },
                            (None, false) => td { "ok" },
                        }
                    } } }
                }
            }
        }
    }
}

/// What waits for an operator.
fn attention(status: &Status) -> Markup {
    let failed = status
        .claims
        .iter()
        .find(|(s, _)| s == "failed")
        .map(|(_, n)| *n)
        .unwrap_or_default();
    html! {
        section {
            h2 { "Needs an operator" }
            table id="attention" {
                tr { td { a href="/dead-letters?not_replayed=1" { "dead letters not replayed" } } td class="n" { (status.dead_letters_not_replayed) } }
                tr { td { a href="/dead-letters" { "dead letters" } } td class="n" id="dead-letter-count" { (status.dead_letters) } }
                tr { td { a href="/events?state=conflict" { "key conflicts" } } td class="n" id="key-conflict-count" { (status.key_conflicts) } }
                tr { td { a href="/expired" { "expired replays" } } td class="n" { (status.expired_replays) } }
                tr { td { a href="/events?state=failed" { "failed claims" } } td class="n" { (failed) } }
            }
        }
    }
}

/// The destinations whose circuit breaker is not closed.
fn destinations(open: &[OpenBreaker]) -> Markup {
    html! {
        section {
            h2 { "Destinations" }
            @if open.is_empty() { p { "Every circuit breaker is closed." } }
            @else {
                table id="breakers" {
                    @for b in open { tr { td { (b.origin) } td class="warn" { (b.breaker) } td { (b.in_flight) " in flight" } } }
                }
            }
        }
    }
}

/// Messages per second each partition's committed offset moved since the last overview.
fn throughput(state: &State, lag: &[PartitionLag]) -> HashMap<i32, f64> {
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
