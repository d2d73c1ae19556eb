//! The one page error: what went wrong, with its status, rendered as a page in the layout.
//! Handlers return `Result<Response, PageError>` and use `?`; [`ForUser::for_user`] keeps the
//! logged-in user's navigation on the page.

use super::auth::User;
use super::layout::document;
use crate::operator::OperatorError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::html;

/// A page saying why a request could not be answered (boxed: it travels in every `Err`).
#[derive(Debug)]
pub(crate) struct PageError(Box<Problem>);

#[derive(Debug)]
struct Problem {
    status: StatusCode,
    title: String,
    text: String,
    /// Whose navigation the page carries; None: a page without it.
    user: Option<User>,
}

impl PageError {
    pub(crate) fn new(status: StatusCode, title: &str, text: impl std::fmt::Display) -> Self {
        Self(Box::new(Problem {
            status,
            title: title.into(),
            text: text.to_string(),
            user: None,
        }))
    }

    /// The same page, with `user`'s navigation.
    fn of(mut self, user: &User) -> Self {
        self.0.user = Some(user.clone());
        self
    }

    /// 400: what the request asked for makes no sense.
    pub(crate) fn bad_request(title: &str, text: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::BAD_REQUEST, title, text)
    }

    /// 404.
    pub(crate) fn not_found(title: &str, text: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::NOT_FOUND, title, text)
    }

    /// 503: the database (or the broker) did not answer; `error` says how.
    pub(crate) fn unavailable(title: &str, error: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, title, error)
    }

    /// The same page, titled `title`.
    pub(crate) fn titled(mut self, title: &str) -> Self {
        self.0.title = title.into();
        self
    }
}

impl From<OperatorError> for PageError {
    fn from(e: OperatorError) -> Self {
        let status = match &e {
            OperatorError::NoSuchEvent(_)
            | OperatorError::NoSuchDeadLetter(_)
            | OperatorError::NoExpiredReplay(_) => StatusCode::NOT_FOUND,
            OperatorError::NotAnOrigin(_) | OperatorError::NotASource(_) => StatusCode::BAD_REQUEST,
            OperatorError::Database(_) => StatusCode::SERVICE_UNAVAILABLE,
            OperatorError::Unexpected(_) => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::CONFLICT,
        };
        let title = match status {
            StatusCode::NOT_FOUND => "Not found",
            StatusCode::SERVICE_UNAVAILABLE => "Unavailable",
            _ => "Not done",
        };
        Self::new(status, title, format!("{e:#}"))
    }
}

impl From<anyhow::Error> for PageError {
    fn from(e: anyhow::Error) -> Self {
        Self::unavailable("Unavailable", format!("{e:#}"))
    }
}

impl From<sqlx::Error> for PageError {
    fn from(e: sqlx::Error) -> Self {
        Self::unavailable("Unavailable", e)
    }
}

/// A failure turned into a page with the user's navigation.
pub(crate) trait ForUser<T> {
    fn for_user(self, user: &User) -> Result<T, PageError>;
}

impl<T, E: Into<PageError>> ForUser<T> for Result<T, E> {
    fn for_user(self, user: &User) -> Result<T, PageError> {
        self.map_err(|e| e.into().of(user))
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let p = self.0;
        let body = html! { main { h1 { (p.title) } p class="problem" role="alert" { (p.text) } } };
        (p.status, document(&p.title, p.user.as_ref(), body)).into_response()
    }
}

/// Any other path: not found, for a logged-in user only.
pub(crate) async fn not_found(user: User) -> PageError {
    PageError::not_found("Not found", "No page has this address.").of(&user)
}
