//! `GET /expired`: expired replays waiting for an operator.

use super::auth::User;
use super::layout::{document, when};
use super::problem::{ForUser, PageError};
use super::{State, PAGE_ROWS};
use axum::response::{IntoResponse, Response};
use maud::html;

/// `GET /expired`: events that arrived after their key could have been pruned, kept unapplied.
pub(crate) async fn expired(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
) -> Result<Response, PageError> {
    let rows = state.desk.expired(false, PAGE_ROWS).await.for_user(&user)?;
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
    Ok(document("Expired replays", Some(&user), body).into_response())
}
