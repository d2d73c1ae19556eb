//! An action's form, as its fields: repeated names (`keys=…&keys=…`) kept in order; and what a
//! form's or a query's values mean (a moment, a value given or left empty).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};

/// The fields of an `application/x-www-form-urlencoded` body.
#[derive(Debug, Default)]
pub(crate) struct Fields(Vec<(String, String)>);

impl Fields {
    pub(crate) fn parse(body: &[u8]) -> Self {
        Self(url::form_urlencoded::parse(body).into_owned().collect())
    }

    /// The first value of `name`, trimmed, if it is not empty.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every value of `name`.
    pub(crate) fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

impl<S: Send + Sync> FromRequest<S> for Fields {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let form = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
        if !form {
            return Err((
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "an action is a form: application/x-www-form-urlencoded",
            )
                .into_response());
        }
        // axum's default body limit (2 MiB) bounds the read.
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Self::parse(&bytes))
    }
}

/// A moment from a form: RFC 3339, a browser's `datetime-local` (read as UTC), or a duration
/// ago (`40m`).
pub(crate) fn parse_when(text: &str) -> Result<DateTime<Utc>, String> {
    let text = text.trim();
    if let Ok(local) = chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M") {
        return Ok(local.and_utc());
    }
    if let Ok(local) = chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S") {
        return Ok(local.and_utc());
    }
    crate::args::parse_moment(text)
}

/// A query's value, when given and not blank.
pub(crate) fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// A query string of the fields given, each `name=value`, URL-encoded.
pub(crate) fn query_of(fields: &[(&str, &Option<String>)]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .filter_map(|(name, value)| given(value).map(|v| format!("{name}={}", super::layout::q(v))))
        .collect();
    parts.join("&")
}
