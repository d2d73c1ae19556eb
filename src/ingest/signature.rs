//! Webhook signature schemes: verifying the sender and deriving the event's identity.
//!
//! Every check runs over the raw request bytes. Signatures are compared with `Mac::verify_slice`,
//! which is constant-time and checks the length, so an empty or truncated signature never
//! passes. Several secrets may be valid at once (rotation): any of them verifying is enough.

use crate::envelope::{nests_deeper_than, Members, Text, MAX_NESTING};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use http::HeaderMap;
use serde::Deserialize;
use serde_json::value::RawValue;
use sha2::Sha256;
use std::fmt;

type HmacSha256 = Hmac<Sha256>;

/// A signing secret. It never prints.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl Secret {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// How a generic `hmac` source encodes its signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    Hex,
    Base64,
}

/// Where a generic `hmac` source's event id comes from.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyFrom {
    /// A request header.
    Header(String),
    /// A JSON pointer into the body, for example `/id`.
    JsonPointer(String),
}

/// A sender's signature scheme, with what it needs to verify a request.
#[derive(Debug, Clone)]
pub enum Scheme {
    Stripe,
    Github,
    StandardWebhooks,
    Shopify,
    Slack,
    Hmac {
        header: String,
        prefix: String,
        encoding: Encoding,
        key_from: KeyFrom,
    },
}

impl Scheme {
    /// Top-level payload fields the provider changes between deliveries of one event, left out
    /// of the payload hash so a redelivery is a replay, not a key conflict. Stripe counts the
    /// endpoints still to be notified in `pending_webhooks`, and some API versions rewrite
    /// `request`; the other providers resend the same body (their retry counters travel in
    /// headers: `X-Slack-Retry-Num`, `webhook-timestamp`).
    pub fn unhashed_fields(&self) -> &'static [&'static str] {
        match self {
            Self::Stripe => &["pending_webhooks", "request"],
            _ => &[],
        }
    }

    /// For schemes that sign only the body while the key comes from an unsigned header, the
    /// provider's redelivery window: a captured request resent under a new id within it is a
    /// replay, not a new event. GitHub lets deliveries be redelivered for 3 days; Shopify
    /// retries 8 times over 4 hours (since 2024-09-10), given 2 days for resends by hand and
    /// clock trouble; a generic sender gets 3 days. Schemes that sign the id (Stripe's
    /// body `id`, Standard Webhooks, Slack) need no guard.
    pub fn default_replay_window_secs(&self) -> Option<u64> {
        const DAY: u64 = 24 * 3600;
        match self {
            Self::Github => Some(3 * DAY),
            Self::Shopify => Some(2 * DAY),
            Self::Hmac {
                key_from: KeyFrom::Header(_),
                ..
            } => Some(3 * DAY),
            _ => None,
        }
    }
}

/// Why a request is refused. Callers answer with the status only: the detail is for logs and
/// never says which part of a signature failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// Missing, malformed or wrong signature, or a timestamp outside the tolerance: 401.
    #[error("unauthorized: {0}")]
    Unauthorized(&'static str),
    /// The event's identity cannot be read: 400.
    #[error("bad request: {0}")]
    BadRequest(String),
}

use Rejection::{BadRequest, Unauthorized};

/// What a verified request is.
#[derive(Debug, Clone)]
pub enum Verified {
    /// An event to produce.
    Event(Identity),
    /// Slack's `url_verification`: answer the challenge, produce nothing.
    Challenge(String),
}

/// A verified event's identity and content.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The stable id within the source, before namespacing by the source's name.
    pub id: String,
    pub event_type: Option<String>,
    /// The body as it arrived when it is JSON (numbers exact, keys in their order), otherwise a
    /// JSON string of its text.
    pub payload: Box<RawValue>,
    /// When the event happened at its source, for kinds whose deliveries carry it unchanged
    /// from one delivery to the next: Stripe's body `created`, Shopify's
    /// `X-Shopify-Triggered-At`, Slack's body `event_time`. GitHub's deliveries and Standard
    /// Webhooks' carry none (`webhook-timestamp` is the attempt's).
    pub occurred_at: Option<DateTime<Utc>>,
}

/// A request as the schemes see it.
pub struct Request<'a> {
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    /// Now, in Unix seconds.
    pub now: i64,
}

fn not_json(e: serde_json::Error) -> Rejection {
    BadRequest(format!("the body is not JSON: {e}"))
}

impl Request<'_> {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body's JSON text, checked to be JSON.
    fn json_text(&self) -> Result<&RawValue, Rejection> {
        serde_json::from_slice(self.body).map_err(not_json)
    }

    /// The body's text when it is JSON a consumer can read back (nested at most
    /// [`MAX_NESTING`] deep), otherwise a JSON string of its text: never parsed into a value and
    /// written again, so what is produced is what the sender signed.
    fn payload(&self) -> Box<RawValue> {
        match self.json_text() {
            Ok(json) => self.payload_of(json),
            Err(_) => self.as_string(),
        }
    }

    /// [`Request::payload`] for a body already read as `json`.
    fn payload_of(&self, json: &RawValue) -> Box<RawValue> {
        if nests_deeper_than(json.get(), MAX_NESTING) {
            self.as_string()
        } else {
            json.to_owned()
        }
    }

    fn as_string(&self) -> Box<RawValue> {
        serde_json::value::to_raw_value(&String::from_utf8_lossy(self.body))
            .expect("a string always serialises")
    }
}

/// A JSON body's top-level members, read once without building a value for any of them (a
/// body that is JSON but not an object has none). A key given twice means its last value, as a
/// parsed value would.
struct Top<'a>(Vec<(std::borrow::Cow<'a, str>, &'a RawValue)>);

impl<'a> Top<'a> {
    fn of(json: &'a RawValue) -> Self {
        match json.get().as_bytes().first() {
            Some(b'{') => Self(
                serde_json::from_str::<Members>(json.get())
                    .map(|Members(m)| m)
                    .unwrap_or_default(),
            ),
            _ => Self(Vec::new()),
        }
    }

    fn get(&self, field: &str) -> Option<&'a RawValue> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == field)
            .map(|(_, v)| *v)
    }

    /// The non-empty string at `field`.
    fn string(&self, field: &str) -> Option<String> {
        let Text(text) = serde_json::from_str(self.get(field)?.get()).ok()?;
        Some(text.into_owned()).filter(|s| !s.is_empty())
    }

    /// A time within the years a sender could mean (1970 to 9999), from Unix seconds at
    /// `field`.
    fn unix_time(&self, field: &str) -> Option<DateTime<Utc>> {
        let secs: i64 = serde_json::from_str(self.get(field)?.get()).ok()?;
        DateTime::from_timestamp(secs, 0).filter(plausible)
    }

    /// [`Top::unix_time`], or an RFC 3339 text at `field` (Stripe's v2 events write `created`
    /// so).
    fn time(&self, field: &str) -> Option<DateTime<Utc>> {
        self.unix_time(field)
            .or_else(|| rfc3339(self.string(field).as_deref()))
    }
}

impl Scheme {
    /// Whether this scheme's deliveries carry the time of the event itself (Stripe's body
    /// `created`, Shopify's `X-Shopify-Triggered-At`, Slack's body `event_time`), by which a
    /// late redelivery of a pruned key is caught.
    pub fn carries_event_time(&self) -> bool {
        matches!(self, Self::Stripe | Self::Shopify | Self::Slack)
    }

    /// Verifies the request with any of `secrets`, then reads the event's identity.
    pub fn verify(
        &self,
        secrets: &[Secret],
        tolerance: i64,
        req: &Request<'_>,
    ) -> Result<Verified, Rejection> {
        match self {
            Self::Stripe => stripe(secrets, tolerance, req),
            Self::Github => github(secrets, req),
            Self::StandardWebhooks => standard_webhooks(secrets, tolerance, req),
            Self::Shopify => shopify(secrets, req),
            Self::Slack => slack(secrets, tolerance, req),
            Self::Hmac {
                header,
                prefix,
                encoding,
                key_from,
            } => generic(secrets, header, prefix, *encoding, key_from, req),
        }
    }
}

/// True when any secret's MAC over `parts` equals any of `signatures`.
fn any_valid(secrets: &[Secret], parts: &[&[u8]], signatures: &[Vec<u8>]) -> bool {
    secrets.iter().any(|secret| {
        let mut mac = secret.mac();
        for p in parts {
            mac.update(p);
        }
        signatures
            .iter()
            .any(|sig| mac.clone().verify_slice(sig).is_ok())
    })
}

fn check_timestamp(timestamp: &str, tolerance: i64, now: i64) -> Result<(), Rejection> {
    let t: i64 = timestamp
        .trim()
        .parse()
        .map_err(|_| Unauthorized("malformed timestamp"))?;
    // abs_diff cannot overflow, whatever the sender wrote.
    if now.abs_diff(t) > tolerance.unsigned_abs() {
        return Err(Unauthorized("timestamp outside the tolerance"));
    }
    Ok(())
}

/// A verified event.
fn event(
    id: String,
    event_type: Option<String>,
    payload: Box<RawValue>,
) -> Result<Verified, Rejection> {
    Ok(Verified::Event(Identity {
        id,
        event_type,
        payload,
        occurred_at: None,
    }))
}

/// `verified` with the time its event happened, when the delivery said.
fn occurred(
    verified: Result<Verified, Rejection>,
    at: Option<DateTime<Utc>>,
) -> Result<Verified, Rejection> {
    verified.map(|v| match v {
        Verified::Event(identity) => Verified::Event(Identity {
            occurred_at: at,
            ..identity
        }),
        other => other,
    })
}

/// An RFC 3339 time within the years a sender could mean.
fn rfc3339(text: Option<&str>) -> Option<DateTime<Utc>> {
    let at = DateTime::parse_from_rfc3339(text?.trim()).ok()?;
    Some(at.with_timezone(&Utc)).filter(plausible)
}

fn plausible(at: &DateTime<Utc>) -> bool {
    use chrono::Datelike as _;
    (1970..=9999).contains(&at.year())
}

fn require(ok: bool) -> Result<(), Rejection> {
    if ok {
        Ok(())
    } else {
        Err(Unauthorized("no signature matches"))
    }
}

/// `Stripe-Signature: t=…,v1=…[,v1=…]`: HMAC-SHA256 of `"{t}.{body}"`, hex. `v0` is ignored.
fn stripe(secrets: &[Secret], tolerance: i64, req: &Request<'_>) -> Result<Verified, Rejection> {
    let header = req
        .header("stripe-signature")
        .ok_or(Unauthorized("missing signature"))?;
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for item in header.split(',') {
        match item.trim().split_once('=') {
            Some(("t", t)) => timestamp = Some(t),
            Some(("v1", s)) => signatures.extend(hex::decode(s).ok()),
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(Unauthorized("missing timestamp"))?;
    check_timestamp(timestamp, tolerance, req.now)?;
    require(any_valid(
        secrets,
        &[timestamp.as_bytes(), b".", req.body],
        &signatures,
    ))?;
    let json = req.json_text()?;
    let body = Top::of(json);
    let id = body
        .string("id")
        .ok_or_else(|| BadRequest("the event has no id".into()))?;
    let id = match body.string("account") {
        Some(account) => format!("{account}:{id}"),
        None => id,
    };
    let event_type = body.string("type");
    let created = body.time("created");
    occurred(event(id, event_type, req.payload_of(json)), created)
}

/// `X-Hub-Signature-256: sha256=<hex>` over the body; the id is `X-GitHub-Delivery`, which a
/// redelivery keeps.
fn github(secrets: &[Secret], req: &Request<'_>) -> Result<Verified, Rejection> {
    let header = req
        .header("x-hub-signature-256")
        .ok_or(Unauthorized("missing signature"))?;
    let sig = header
        .strip_prefix("sha256=")
        .and_then(|s| hex::decode(s).ok());
    require(any_valid(secrets, &[req.body], &Vec::from_iter(sig)))?;
    let id = req
        .header("x-github-delivery")
        .filter(|s| !s.is_empty())
        .ok_or_else(|| BadRequest("missing X-GitHub-Delivery".into()))?;
    let event_type = req.header("x-github-event").map(str::to_owned);
    event(id.to_owned(), event_type, req.payload())
}

/// Standard Webhooks (and Svix): `webhook-id`, `webhook-timestamp`, `webhook-signature:
/// v1,<base64> …`, HMAC-SHA256 of `"{id}.{timestamp}.{body}"` with the base64 secret after
/// `whsec_`; also under the `svix-` header names.
fn standard_webhooks(
    secrets: &[Secret],
    tolerance: i64,
    req: &Request<'_>,
) -> Result<Verified, Rejection> {
    let header = |name: &str| {
        req.header(&format!("webhook-{name}"))
            .or_else(|| req.header(&format!("svix-{name}")))
    };
    let id = header("id")
        .filter(|s| !s.is_empty())
        .ok_or(Unauthorized("missing id"))?;
    let timestamp = header("timestamp").ok_or(Unauthorized("missing timestamp"))?;
    let signatures: Vec<Vec<u8>> = header("signature")
        .ok_or(Unauthorized("missing signature"))?
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|s| BASE64.decode(s).ok())
        .collect();
    check_timestamp(timestamp, tolerance, req.now)?;
    require(any_valid(
        secrets,
        &[id.as_bytes(), b".", timestamp.as_bytes(), b".", req.body],
        &signatures,
    ))?;
    let (event_type, payload) = match req.json_text() {
        Ok(json) => (Top::of(json).string("type"), req.payload_of(json)),
        Err(_) => (None, req.as_string()),
    };
    event(id.to_owned(), event_type, payload)
}

/// `X-Shopify-Hmac-Sha256`: HMAC-SHA256 of the body, base64. The id is `X-Shopify-Event-Id`
/// (one event delivered through several subscriptions shares it) qualified by the shop, and
/// falls back to `X-Shopify-Webhook-Id` (one delivery) for senders that do not send it.
fn shopify(secrets: &[Secret], req: &Request<'_>) -> Result<Verified, Rejection> {
    let header = req
        .header("x-shopify-hmac-sha256")
        .ok_or(Unauthorized("missing signature"))?;
    let sig = BASE64.decode(header.trim()).ok();
    require(any_valid(secrets, &[req.body], &Vec::from_iter(sig)))?;
    let shop = req
        .header("x-shopify-shop-domain")
        .unwrap_or("unknown-shop");
    let id = match (
        req.header("x-shopify-event-id"),
        req.header("x-shopify-webhook-id"),
    ) {
        (Some(event), _) if !event.is_empty() => format!("{shop}:{event}"),
        (_, Some(webhook)) if !webhook.is_empty() => format!("{shop}:webhook:{webhook}"),
        _ => {
            return Err(BadRequest(
                "missing X-Shopify-Event-Id and X-Shopify-Webhook-Id".into(),
            ))
        }
    };
    let event_type = req.header("x-shopify-topic").map(str::to_owned);
    let triggered = rfc3339(req.header("x-shopify-triggered-at"));
    occurred(event(id, event_type, req.payload()), triggered)
}

/// `X-Slack-Signature: v0=<hex>` with `X-Slack-Request-Timestamp`: HMAC-SHA256 of
/// `"v0:{timestamp}:{body}"`. The id is `team_id` with `event_id`.
fn slack(secrets: &[Secret], tolerance: i64, req: &Request<'_>) -> Result<Verified, Rejection> {
    let header = req
        .header("x-slack-signature")
        .ok_or(Unauthorized("missing signature"))?;
    let timestamp = req
        .header("x-slack-request-timestamp")
        .ok_or(Unauthorized("missing timestamp"))?;
    let sig = header.strip_prefix("v0=").and_then(|s| hex::decode(s).ok());
    check_timestamp(timestamp, tolerance, req.now)?;
    require(any_valid(
        secrets,
        &[b"v0:", timestamp.as_bytes(), b":", req.body],
        &Vec::from_iter(sig),
    ))?;
    let json = req.json_text()?;
    let body = Top::of(json);
    if body.string("type").as_deref() == Some("url_verification") {
        let challenge = body
            .string("challenge")
            .ok_or_else(|| BadRequest("no challenge".into()))?;
        return Ok(Verified::Challenge(challenge));
    }
    let event_id = body
        .string("event_id")
        .ok_or_else(|| BadRequest("the event has no event_id".into()))?;
    let team = body.string("team_id").unwrap_or_else(|| "no-team".into());
    let event_type = body
        .get("event")
        .and_then(|event| Top::of(event).string("type"))
        .or_else(|| body.string("type"));
    let event_time = body.unix_time("event_time");
    occurred(
        event(
            format!("{team}:{event_id}"),
            event_type,
            req.payload_of(json),
        ),
        event_time,
    )
}

/// A generic HMAC-SHA256 of the body, in a configured header, hex or base64, with an
/// optional prefix; the id from a header or a JSON pointer into the body.
fn generic(
    secrets: &[Secret],
    header: &str,
    prefix: &str,
    encoding: Encoding,
    key_from: &KeyFrom,
    req: &Request<'_>,
) -> Result<Verified, Rejection> {
    let value = req
        .header(header)
        .ok_or(Unauthorized("missing signature"))?;
    let sig = value.strip_prefix(prefix).and_then(|s| match encoding {
        Encoding::Hex => hex::decode(s.trim()).ok(),
        Encoding::Base64 => BASE64.decode(s.trim()).ok(),
    });
    require(any_valid(secrets, &[req.body], &Vec::from_iter(sig)))?;
    let (id, payload) = match key_from {
        KeyFrom::Header(name) => {
            let id = req.header(name).filter(|s| !s.is_empty());
            (
                id.map(str::to_owned)
                    .ok_or_else(|| BadRequest(format!("missing {name}")))?,
                req.payload(),
            )
        }
        KeyFrom::JsonPointer(pointer) => {
            let body = req.json_text()?;
            let id = raw_at(body, pointer)
                .and_then(id_of)
                .ok_or_else(|| BadRequest(format!("the body has no id at {pointer}")))?;
            (id, body.to_owned())
        }
    };
    event(id, None, payload)
}

/// The JSON text at `pointer` (RFC 6901) inside `json`, read one level at a time without
/// building a value, so a number comes back exactly as it was written. A key given twice
/// means its last value, as a parsed value would.
fn raw_at<'a>(json: &'a RawValue, pointer: &str) -> Option<&'a RawValue> {
    let mut at = json;
    if pointer.is_empty() {
        return Some(at);
    }
    for token in pointer.strip_prefix('/')?.split('/') {
        let token = token.replace("~1", "/").replace("~0", "~");
        at = match at.get().as_bytes().first()? {
            b'{' => {
                let Members(members) = serde_json::from_str(at.get()).ok()?;
                members.into_iter().rev().find(|(key, _)| *key == token)?.1
            }
            b'[' => {
                let items: Vec<&RawValue> = serde_json::from_str(at.get()).ok()?;
                *items.get(token.parse::<usize>().ok()?)?
            }
            _ => return None,
        };
    }
    Some(at)
}

/// An id from its JSON text: a non-empty string, or a number as written.
/// The route key a source's `route_from` names in a verified request: a header, or a string or
/// integer at a JSON pointer into the payload. None when absent or empty: the event is then
/// routed by its own key, the same way on every delivery.
pub fn route_of(
    route_from: &KeyFrom,
    headers: &http::HeaderMap,
    payload: &RawValue,
) -> Option<String> {
    match route_from {
        KeyFrom::Header(name) => headers
            .get(name.as_str())
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map(str::to_owned),
        KeyFrom::JsonPointer(pointer) => raw_at(payload, pointer).and_then(id_of),
    }
}

fn id_of(json: &RawValue) -> Option<String> {
    match json.get().as_bytes().first()? {
        b'"' => {
            let Text(id) = serde_json::from_str(json.get()).ok()?;
            Some(id.into_owned()).filter(|id| !id.is_empty())
        }
        b'-' | b'0'..=b'9' => Some(json.get().to_owned()),
        _ => None,
    }
}
