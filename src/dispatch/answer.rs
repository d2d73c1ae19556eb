//! What a downstream answered, read into an attempt's outcome and the row's next state: the
//! status, a capped excerpt of the body, `Retry-After`, and the errors of a request that got
//! no answer.

use super::Dispatcher;
use crate::destinations::Verdict;
use crate::outbox::{self, Leased, OutboxState, Outcome, Settlement};
use std::time::{Duration, Instant};

impl Dispatcher {
    pub(super) async fn classify_response(
        &self,
        row: &Leased,
        response: reqwest::Response,
    ) -> (Outcome, Settlement, Verdict) {
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_retry_after);
        let location = location(&response);
        let body = excerpt(response).await;
        let code = Some(i32::from(status));
        let verdict = self.verdict(status, retry_after);
        let refusal = super::window::key_refusal(status, &body);
        let (outcome, settlement) = match (status, refusal) {
            (400..=499, Some(refusal)) => self.refused_key(row, refusal, code, body),
            (200..=299, _) => (Outcome::Done, settled(OutboxState::Done, code, None)),
            (300..=399, _) => (
                Outcome::Redirected,
                Settlement {
                    response: Some(body),
                    ..settled(
                        OutboxState::Failed,
                        code,
                        Some(format!(
                            "redirected to {location}; redirects are not followed, so nothing \
                             was delivered"
                        )),
                    )
                },
            ),
            (400 | 401 | 403 | 404 | 410 | 422, _) => (
                Outcome::Failed,
                Settlement {
                    response: Some(body),
                    ..settled(OutboxState::Failed, code, None)
                },
            ),
            _ => {
                let state = row.unless_out_of_attempts(OutboxState::Retryable);
                (
                    Outcome::Retryable,
                    Settlement {
                        next_attempt_at: Some(self.next_attempt(row, retry_after)),
                        response: Some(body),
                        ..settled(state, code, None)
                    },
                )
            }
        };
        (outcome, settlement, verdict)
    }

    /// What an answer with `status` says of its destination, for the breaker and the pause.
    fn verdict(&self, status: u16, retry_after: Option<Duration>) -> Verdict {
        match status {
            429 => Verdict::SlowDown(
                retry_after
                    .unwrap_or(self.settings.backoff_base)
                    .min(MAX_RETRY_AFTER),
            ),
            500..=599 => Verdict::Failing,
            _ => Verdict::Answering,
        }
    }

    pub(super) fn classify_error(
        &self,
        row: &Leased,
        e: &reqwest::Error,
    ) -> (Outcome, Settlement, Verdict) {
        // A request that could not be built (a key or header HTTP cannot carry, a URL it cannot
        // reach) never left, and never will: a permanent failure, not an unknown outcome.
        if e.is_builder() {
            let error = format!(
                "the request could not be built, so nothing was sent: {}",
                describe(e)
            );
            return (
                Outcome::Unsendable,
                settled(OutboxState::Failed, None, Some(error)),
                Verdict::Unknown,
            );
        }
        // A refused connection sent nothing; anything after the request left may have been
        // applied downstream.
        let (outcome, state) = if e.is_connect() {
            (Outcome::Refused, OutboxState::Retryable)
        } else {
            (Outcome::Uncertain, OutboxState::Uncertain)
        };
        let state = row.unless_out_of_attempts(state);
        (
            outcome,
            Settlement {
                next_attempt_at: Some(self.next_attempt(row, None)),
                ..settled(state, None, Some(describe(e)))
            },
            Verdict::Failing,
        )
    }

    pub(super) fn next_attempt(
        &self,
        row: &Leased,
        retry_after: Option<Duration>,
    ) -> chrono::DateTime<chrono::Utc> {
        let exp = self
            .settings
            .backoff_base
            .saturating_mul(1 << row.attempts.clamp(1, 20).saturating_sub(1));
        let backoff = exp.min(self.settings.backoff_max);
        let jitter = backoff.mul_f64(fastrand::f64() * 0.25);
        let asked = retry_after.unwrap_or(Duration::ZERO).min(MAX_RETRY_AFTER);
        let delay = asked.max(backoff + jitter);
        let now = chrono::Utc::now();
        chrono::Duration::from_std(delay)
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .unwrap_or(now + chrono::Duration::seconds(MAX_RETRY_AFTER.as_secs() as i64))
    }
}

/// The most of a downstream's answer read to keep its excerpt; the excerpt itself is at most
/// [`outbox::RESPONSE_EXCERPT_CHARS`] characters.
const EXCERPT_BYTES: usize = 4 * outbox::RESPONSE_EXCERPT_CHARS;
/// The most of the rest read and thrown away so the connection can serve the next request;
/// past it the connection is closed instead, so an answer of any size costs little memory.
const DRAIN_BYTES: usize = 64 * 1024;

/// The start of a downstream's answer, read without holding the rest in memory.
pub(super) async fn excerpt(mut response: reqwest::Response) -> String {
    let mut body = Vec::with_capacity(1024);
    while body.len() < EXCERPT_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = EXCERPT_BYTES - body.len();
                body.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            _ => break,
        }
    }
    let mut drained = 0;
    while drained < DRAIN_BYTES {
        match response.chunk().await {
            Ok(Some(chunk)) => drained += chunk.len(),
            _ => break,
        }
    }
    outbox::storable_text(
        &String::from_utf8_lossy(&body),
        outbox::RESPONSE_EXCERPT_CHARS,
    )
}

/// Where a redirect points, for the operator: redirects are recorded, never followed. A token in
/// it is redacted.
pub(super) fn location(response: &reqwest::Response) -> String {
    response.headers().get("location").map_or_else(
        || "(no Location)".to_owned(),
        |v| crate::secrets::redact_url(&String::from_utf8_lossy(v.as_bytes())),
    )
}

/// A request's error with its causes ([`error_chain`]) and its URL redacted: a target URL may
/// carry its credential in its path or query.
pub(super) fn describe(error: &reqwest::Error) -> String {
    let mut text = error_chain(error);
    if let Some(url) = error.url() {
        text = text.replace(url.as_str(), &crate::secrets::redact_url(url.as_str()));
    }
    crate::secrets::scrub(&text).into_owned()
}

/// Whether a request may start: it must be able to time out before the lease runs out.
pub(super) fn may_start_request(
    lease_deadline: Instant,
    now: Instant,
    request_timeout: Duration,
) -> bool {
    lease_deadline.saturating_duration_since(now) > request_timeout
}

/// The longest `Retry-After` honoured; a downstream asking for more is asked again after this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// A `Retry-After` value: delay seconds or an HTTP date. Anything else is ignored.
pub(super) fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let wait = at.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(wait.to_std().unwrap_or(Duration::ZERO))
}

pub(super) fn settled(
    state: OutboxState,
    status: Option<i32>,
    error: Option<String>,
) -> Settlement {
    Settlement {
        state,
        next_attempt_at: None,
        status,
        error,
        response: None,
        maybe_applied_since: None,
        idempotent_until: None,
        held: false,
    }
}

/// An error with its causes, outermost first: reqwest's own message ("error sending request")
/// says nothing of a refused certificate or a reset connection, its sources do.
pub(super) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}
