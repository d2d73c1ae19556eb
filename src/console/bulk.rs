//! The one skeleton of the bulk actions: a `GET` previews exactly what a search selects, with
//! what would change for each, and its form sends exactly those rows back; the `POST` takes
//! those rows (never the search again), at most [`BULK_LIMIT`], and shows what changed and
//! what was refused. Retrying events and replaying dead letters both go through it.

use super::actions::authorize;
use super::auth::{Role, User};
use super::form::Fields;
use super::layout::document;
use super::problem::{ForUser, PageError};
use super::{State, BULK_LIMIT};
use crate::operator::{Act, Change};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};

/// One row of a preview: the value its form sends, and its cells.
pub(crate) struct Row {
    pub value: String,
    pub cells: Vec<Markup>,
}

/// What a bulk action's preview shows.
pub(crate) struct Preview<'a> {
    pub title: &'a str,
    /// Where the form posts.
    pub action: &'a str,
    /// The name of the field each row sends (`keys`, `ids`).
    pub field: &'a str,
    pub headers: &'a [&'a str],
    pub rows: Vec<Row>,
    /// Said when no row is taken.
    pub none: &'a str,
    /// Said above the rows: how many, and what happens to them.
    pub count: String,
    /// A note under the count (the search was cut at the limit).
    pub note: Option<Markup>,
    /// The confirm button's text.
    pub confirm: String,
}

/// Only an operator previews a bulk action.
pub(crate) fn operator_only(user: &User) -> Result<(), PageError> {
    match user.role {
        Role::Operator => Ok(()),
        _ => Err(PageError::new(
            StatusCode::FORBIDDEN,
            "Not allowed",
            "Only an operator acts.",
        ))
        .for_user(user),
    }
}

impl Preview<'_> {
    /// The preview page, its form carrying every row's value.
    pub(crate) fn page(self, user: &User) -> Response {
        let body = html! {
            main {
                h1 { (self.title) ": preview" }
                @if self.rows.is_empty() { p id="none" { (self.none) } }
                @else {
                    p id="count" { (self.count) }
                    @if let Some(note) = &self.note { (note) }
                    (self.form(user))
                }
            }
        };
        document(self.title, Some(user), body).into_response()
    }

    fn form(&self, user: &User) -> Markup {
        html! {
            form method="post" action=(self.action) {
                input type="hidden" name="csrf_token" value=(user.csrf);
                table id="preview" {
                    thead { tr { @for h in self.headers { th { (h) } } } }
                    tbody { @for row in &self.rows { (self.row(row)) } }
                }
                p { label { "Reason " input name="reason" id="bulk-reason" required; } " "
                    button type="submit" id="confirm" { (self.confirm) } }
            }
        }
    }

    fn row(&self, row: &Row) -> Markup {
        html! {
            tr {
                @for (i, cell) in row.cells.iter().enumerate() {
                    td { @if i == 0 { input type="hidden" name=(self.field) value=(row.value); } (cell) }
                }
            }
        }
    }
}

/// The confirmed rows of a bulk action's `POST`: authorized as every action is, each value of
/// `field` parsed, at most [`BULK_LIMIT`] of them.
pub(crate) fn confirmed<T: std::str::FromStr>(
    state: &State,
    user: &User,
    fields: &Fields,
    field: &str,
    what: &str,
) -> Result<(Act, Vec<T>), PageError> {
    let act = authorize(state, user, fields)?;
    let values: Result<Vec<T>, _> = fields.all(field).iter().map(|v| v.parse::<T>()).collect();
    let bad = |title: &str, text: String| Err(PageError::bad_request(title, text)).for_user(user);
    let Ok(values) = values else {
        return bad(
            "Bad rows",
            format!("Every {what} of the form is one the preview listed."),
        );
    };
    if values.len() as i64 > BULK_LIMIT {
        return bad("Too many", format!("At most {BULK_LIMIT} {what}s at once."));
    }
    Ok((act, values))
}

/// What a bulk action did: every change, and each row refused with why.
pub(crate) fn result_page(
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

fn changes_table(changes: &[Change]) -> Markup {
    html! {
        table id="changes" {
            thead { tr { th { "target" } th { "before" } th { "after" } } }
            tbody { @for c in changes { tr { td { (c.target) } td { (c.before) } td { (c.after) } } } }
        }
    }
}
