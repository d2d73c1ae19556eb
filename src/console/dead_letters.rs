//! The dead-letter pages: the list, searched by time and reason, and one letter with its raw
//! bytes.

use super::auth::{Role, User};
use super::form::{given, parse_when, query_of};
use super::layout::{document, maybe_when, when};
use super::problem::{ForUser, PageError};
use super::visibility::error_text;
use super::{State, PAGE_ROWS};
use crate::claims::dead_letters::{DeadLetterRow, RawLetter};
use axum::extract::{Path, Query};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};
use serde::Deserialize;

/// The query of `GET /dead-letters`.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct LettersQuery {
    #[serde(default)]
    pub since: Option<String>,
    #[serde(default)]
    pub reason_like: Option<String>,
    #[serde(default)]
    pub not_replayed: Option<String>,
    #[serde(default)]
    pub before: Option<i64>,
}

impl LettersQuery {
    pub(crate) fn search(
        &self,
        limit: i64,
    ) -> Result<crate::claims::dead_letters::LetterSearch, String> {
        Ok(crate::claims::dead_letters::LetterSearch {
            since: given(&self.since).map(parse_when).transpose()?,
            reason_like: given(&self.reason_like).map(Into::into),
            not_replayed: given(&self.not_replayed).is_some(),
            before_id: self.before,
            limit,
        })
    }

    pub(crate) fn query_string(&self) -> String {
        query_of(&[
            ("since", &self.since),
            ("reason_like", &self.reason_like),
            ("not_replayed", &self.not_replayed),
        ])
    }
}

/// `GET /dead-letters`: newest first, a page at a time.
pub(crate) async fn dead_letters(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Query(query): Query<LettersQuery>,
) -> Result<Response, PageError> {
    let sees = user.sees_payloads(&state);
    // Matching reasons would tell what a hidden reason holds.
    if !sees && given(&query.reason_like).is_some() {
        let why = "Reasons, and searching them, are for operators only.";
        return Err(PageError::new(StatusCode::FORBIDDEN, "Hidden", why)).for_user(&user);
    }
    let search = query
        .search(PAGE_ROWS)
        .map_err(|e| PageError::bad_request("Bad search", e))
        .for_user(&user)?;
    let letters = state
        .desk
        .letters(&search)
        .await
        .map_err(|e| PageError::from(e).titled("Search failed"))
        .for_user(&user)?;
    let this = query.query_string();
    let body = html! {
        main {
            h1 { "Dead letters" }
            (letters_form(&query))
            (letters_table(&letters, sees))
            (next_page(&letters, &this))
            @if user.role == Role::Operator {
                p { a id="bulk-replay" href=(format!("/dead-letters/replay?{this}")) { "Replay every letter of this search never replayed…" } " (a preview first)" }
            }
        }
    };
    Ok(document("Dead letters", Some(&user), body).into_response())
}

fn letters_form(query: &LettersQuery) -> Markup {
    let value = |v: &Option<String>| v.clone().unwrap_or_default();
    html! {
        form class="search" method="get" action="/dead-letters" {
            label { "Since " input name="since" value=(value(&query.since)) placeholder="2h or 2026-12-02T10:00:00Z"; }
            label { "Reason like " input name="reason_like" value=(value(&query.reason_like)) placeholder="%not JSON%"; }
            label { input type="checkbox" name="not_replayed" value="1" checked[given(&query.not_replayed).is_some()]; " never replayed" }
            button type="submit" { "Search" }
        }
    }
}

/// The link to the next page, when this one is full.
fn next_page(letters: &[DeadLetterRow], this: &str) -> Markup {
    let joiner = if this.is_empty() { "" } else { "&" };
    html! {
        p class="pages" {
            @if letters.len() as i64 == PAGE_ROWS {
                @if let Some(last) = letters.last() {
                    a id="next" href=(format!("/dead-letters?{this}{joiner}before={}", last.id)) { "older »" }
                }
            }
        }
    }
}

/// One page of dead letters, their reasons shown as payloads are.
fn letters_table(letters: &[DeadLetterRow], sees: bool) -> Markup {
    html! {
        @if letters.is_empty() { p id="none" { "No dead letter matches." } }
        @else {
            table id="dead-letters" {
                thead { tr { th { "id" } th { "stored" } th { "message" } th { "reason" } th { "replayed" } } }
                tbody {
                    @for l in letters {
                        tr {
                            td { a href=(format!("/dead-letters/{}", l.id)) { (l.id) } }
                            td { (when(l.created_at)) }
                            td { (l.topic) "/" (l.partition) "@" (l.offset) }
                            td { (error_text(sees, &l.reason)) }
                            td { (maybe_when(l.replayed_at)) }
                        }
                    }
                }
            }
        }
    }
}

/// Bytes as text where they are text, escapes elsewhere.
fn as_text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Bytes as a hex dump: offset, sixteen bytes, and their printable characters.
pub(crate) fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
        let text: String = chunk
            .iter()
            .map(|&b| {
                if (0x20..0x7f).contains(&b) {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        out.push_str(&format!("{:08x}  {:<47}  {text}\n", i * 16, hex.join(" ")));
    }
    out
}

/// `GET /dead-letters/{id}`: one letter, its raw key and value as text and hex.
pub(crate) async fn dead_letter(
    user: User,
    axum::extract::State(state): axum::extract::State<State>,
    Path(id): Path<i64>,
) -> Result<Response, PageError> {
    let letter = state.desk.letter(id).await.for_user(&user)?;
    let raw = state.desk.raw_letter(id).await.ok().flatten();
    let sees = user.sees_payloads(&state);
    let body = html! {
        main {
            h1 { "Dead letter " (id) }
            dl {
                dt { "stored" } dd { (when(letter.created_at)) }
                dt { "message" } dd { (letter.topic) " partition " (letter.partition) " offset " (letter.offset) }
                dt { "reason" } dd id="reason" { (error_text(sees, &letter.reason)) }
                dt { "replayed" } dd { (maybe_when(letter.replayed_at)) }
            }
            @if let Some(raw) = &raw {
                @if sees { (raw_bytes(raw)) } @else { p class="hidden" { "Raw bytes are shown to operators only." } }
            }
            @if user.role == Role::Operator {
                form class="action" method="post" action=(format!("/dead-letters/{id}/replay")) {
                    input type="hidden" name="csrf_token" value=(user.csrf);
                    label { "Reason " input name="reason" id="reason-input" required; }
                    button type="submit" id="replay" { @if letter.replayed_at.is_some() { "Replay again" } @else { "Replay" } }
                }
            }
        }
    };
    Ok(document(&format!("Dead letter {id}"), Some(&user), body).into_response())
}

/// A letter's raw key and value, each as text and as hex, and its headers.
fn raw_bytes(raw: &RawLetter) -> Markup {
    let headers = crate::inputs::Headers::from_stored(raw.headers.as_deref().unwrap_or_default());
    html! {
        @if !headers.is_empty() {
            h2 { "Headers" }
            table id="raw-headers" {
                @for (name, value) in headers.iter() {
                    tr { th { (name) } td { (value.map_or_else(|| "null".to_owned(), as_text)) } }
                }
            }
        }
        @for (name, bytes) in [("key", &raw.key), ("value", &raw.value)] {
            h2 { "Raw " (name) }
            @match bytes {
                None => p { "none" },
                Some(bytes) => {
                    details open {
                        summary { "text (" (bytes.len()) " bytes)" }
                        pre class="raw" id=(format!("raw-{name}-text")) { (as_text(bytes)) }
                    }
                    details {
                        summary { "hex" }
                        pre class="raw" id=(format!("raw-{name}-hex")) { (hex_dump(bytes)) }
                    }
                }
            }
        }
    }
}
