//! The layout every page shares: the document around a page's body, times, paths, and the
//! headers every answer carries.

use super::auth::{Role, User};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// What stays as is in a path segment: the unreserved characters.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~')
    .remove(b':');

/// The path of an event's story.
pub(crate) fn event_path(key: &str) -> String {
    format!("/events/{}", utf8_percent_encode(key, SEGMENT))
}

/// A query string's value.
pub(crate) fn q(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

const STYLESHEET: &str = include_str!("console.css");

/// `GET /static/console.css`: the one stylesheet, public like the login page.
pub(crate) async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// Headers on every answer: no script, no framing, no caching of pages, no referrer.
pub(crate) async fn headers(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// A whole page: the navigation, who is logged in, and `body`.
pub(crate) fn document(title: &str, user: Option<&User>, body: Markup) -> Markup {
    page(title, user, None, body)
}

/// [`document`], reloaded by the browser every `every` seconds (a `<meta http-equiv="refresh">`:
/// no script).
pub(crate) fn refreshing(title: &str, user: &User, every: u32, body: Markup) -> Markup {
    page(title, Some(user), Some(every), body)
}

fn page(title: &str, user: Option<&User>, refresh: Option<u32>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if let Some(every) = refresh { meta http-equiv="refresh" content=(every); }
                title { (title) " · replayproof" }
                link rel="stylesheet" href="/static/console.css";
            }
            body {
                @if let Some(user) = user { (navigation(user)) }
                (body)
            }
        }
    }
}

/// The pages a user can go to, and who is logged in.
fn navigation(user: &User) -> Markup {
    html! {
        header {
            nav {
                a class="brand" href="/" { "replayproof" }
                a href="/" { "Overview" }
                a href="/events" { "Events" }
                a href="/dead-letters" { "Dead letters" }
                @if user.role == Role::Operator { a href="/replay" { "Replay by time" } }
            }
            form class="who" method="post" action="/logout" {
                input type="hidden" name="csrf_token" value=(user.csrf);
                span id="user" { (user.name) " (" (user.role.as_str()) ")" }
                button type="submit" { "Log out" }
            }
        }
    }
}

fn time(at: Option<DateTime<Utc>>) -> Markup {
    match at {
        Some(at) => {
            html! { time datetime=(at.to_rfc3339()) { (at.format("%Y-%m-%d %H:%M:%S%.3f UTC")) } }
        }
        None => html! { "–" },
    }
}

pub(crate) fn when(at: DateTime<Utc>) -> Markup {
    time(Some(at))
}

pub(crate) fn maybe_when(at: Option<DateTime<Utc>>) -> Markup {
    time(at)
}

/// Pretty JSON of a stored payload, for a page.
pub(crate) fn pretty(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json)
        .and_then(|v| serde_json::to_string_pretty(&v))
        .unwrap_or_else(|_| json.to_owned())
}
