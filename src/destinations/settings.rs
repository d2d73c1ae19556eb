//! `[dispatch.destinations]`: the limits of each destination, keyed by its origin.
//!
//! ```toml
//! [dispatch.destinations.default]      # every origin without a section of its own
//! max_concurrency = 16
//!
//! [dispatch.destinations."https://api.stripe.com"]
//! max_concurrency = 4        # requests in flight to this origin, across every dispatcher
//! rate_per_sec = 25          # requests started per second, across every dispatcher
//! breaker_failures = 5       # retryable failures in a row that open the circuit breaker
//! breaker_open = "30s"       # how long it stays open before one probe request goes
//! idempotency_header = "Idempotency-Key"
//! idempotency_window = "24h" # how long it honours a key ("forever" when unknown)
//! ```
//!
//! An origin's section inherits what it leaves out from `default`. Every dispatcher process
//! must run with the same sections: the limits are counted in PostgreSQL (on the first
//! database, over every shard's leases), but each process applies the numbers its own file
//! gives.

use super::Limits;
use crate::outbox::{self, IdempotencyWindow};
use anyhow::{bail, Context as _};
use reqwest::header::HeaderName;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The idempotency key's header unless a destination names another.
pub const DEFAULT_IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// How long the providers the docs cover honour an idempotency key, when their section does not
/// say: Stripe removes keys once they are at least 24 hours old. Every other origin, unless
/// configured: forever.
pub const KNOWN_WINDOWS: &[(&str, Duration)] =
    &[("https://api.stripe.com", Duration::from_secs(24 * 3600))];

/// One destination's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    pub limits: Limits,
    /// The header that carries the operation key.
    pub idempotency_header: HeaderName,
    /// How long it honours an idempotency key, when its own section says
    /// ([`Destinations::window`] decides for an origin).
    pub idempotency_window: Option<IdempotencyWindow>,
}

impl Default for Destination {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            idempotency_header: HeaderName::from_static("idempotency-key"),
            idempotency_window: None,
        }
    }
}

/// Every destination's settings: one per configured origin, and the default for the rest.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Destinations {
    pub default: Destination,
    pub by_origin: BTreeMap<String, Destination>,
}

impl Destinations {
    /// The settings of `origin`.
    pub fn of(&self, origin: &str) -> &Destination {
        self.by_origin.get(origin).unwrap_or(&self.default)
    }

    /// The metric label of `origin`: itself when it has a section, else `default`, so the
    /// labels stay as few as the sections.
    pub fn label<'a>(&'a self, origin: &'a str) -> &'a str {
        if self.by_origin.contains_key(origin) {
            origin
        } else {
            "default"
        }
    }

    /// How long `origin` honours an idempotency key: its own section's window, else the
    /// provider's known one ([`KNOWN_WINDOWS`]), else the `default` section's, else forever.
    pub fn window(&self, origin: &str) -> IdempotencyWindow {
        let own = self
            .by_origin
            .get(origin)
            .and_then(|d| d.idempotency_window);
        let known = KNOWN_WINDOWS
            .iter()
            .find(|(o, _)| *o == origin)
            .map(|(_, w)| IdempotencyWindow(Some(*w)));
        own.or(known)
            .or(self.default.idempotency_window)
            .unwrap_or_default()
    }
}

/// One destination as the file writes it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DestinationFile {
    max_concurrency: Option<u32>,
    rate_per_sec: Option<f64>,
    breaker_failures: Option<u32>,
    #[serde(default, with = "humantime_serde_text")]
    breaker_open: Option<Duration>,
    idempotency_header: Option<String>,
    /// A duration, or "forever".
    idempotency_window: Option<String>,
}

mod humantime_serde_text {
    use serde::Deserialize as _;
    use std::time::Duration;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        let text = String::deserialize(d)?;
        humantime::parse_duration(&text)
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("{text:?} is not a duration: {e}")))
    }
}

impl DestinationFile {
    /// These settings over `base`: what is left out is `base`'s.
    fn over(self, base: &Destination) -> anyhow::Result<Destination> {
        anyhow::ensure!(
            self.max_concurrency != Some(0),
            "max_concurrency must be at least 1"
        );
        anyhow::ensure!(
            self.rate_per_sec
                .is_none_or(|r| r.is_finite() && r > 0.0 && r <= 1_000_000.0),
            "rate_per_sec must be above 0"
        );
        anyhow::ensure!(
            self.breaker_failures != Some(0),
            "breaker_failures must be at least 1"
        );
        anyhow::ensure!(
            self.breaker_open
                .is_none_or(|d| d >= Duration::from_millis(1)),
            "breaker_open must be at least 1ms"
        );
        let idempotency_header = match self.idempotency_header {
            Some(name) => {
                let name = HeaderName::try_from(name.trim()).map_err(|_| {
                    anyhow::anyhow!("idempotency_header {name:?} is not a header name")
                })?;
                anyhow::ensure!(
                    !crate::outbox::RESERVED_HEADERS.contains(&name.as_str())
                        || name.as_str() == "idempotency-key",
                    "idempotency_header cannot be {name}: replayproof sets it otherwise"
                );
                name
            }
            None => base.idempotency_header.clone(),
        };
        Ok(Destination {
            limits: Limits {
                max_concurrency: self.max_concurrency.or(base.limits.max_concurrency),
                rate_per_sec: self.rate_per_sec.or(base.limits.rate_per_sec),
                breaker_failures: self.breaker_failures.or(base.limits.breaker_failures),
                breaker_open: self.breaker_open.unwrap_or(base.limits.breaker_open),
            },
            idempotency_header,
            idempotency_window: self.idempotency_window.as_deref().map(window).transpose()?,
        })
    }
}

/// An `idempotency_window`: a duration of at least a second, or "forever".
fn window(text: &str) -> anyhow::Result<IdempotencyWindow> {
    if text.trim() == "forever" {
        return Ok(IdempotencyWindow(None));
    }
    let window = humantime::parse_duration(text.trim())
        .with_context(|| format!("idempotency_window {text:?} is a duration or \"forever\""))?;
    anyhow::ensure!(
        window >= Duration::from_secs(1),
        "idempotency_window must be at least 1s"
    );
    Ok(IdempotencyWindow(Some(window)))
}

impl Destinations {
    /// Reads `[dispatch.destinations]` (the table under it), `default` first.
    pub fn from_table(table: Option<&toml::Value>) -> anyhow::Result<Self> {
        let Some(table) = table else {
            return Ok(Self::default());
        };
        let mut sections: BTreeMap<String, toml::Value> = table
            .clone()
            .try_into()
            .context("[dispatch.destinations] holds one table per destination")?;
        let read = |name: &str, value: toml::Value, base: &Destination| {
            value
                .try_into::<DestinationFile>()
                .map_err(anyhow::Error::from)
                .and_then(|file| file.over(base))
                .with_context(|| format!("[dispatch.destinations.{name:?}]"))
        };
        let default = match sections.remove("default") {
            Some(value) => read("default", value, &Destination::default())?,
            None => Destination::default(),
        };
        let mut by_origin = BTreeMap::new();
        for (key, value) in sections {
            let origin = origin_key(&key)?;
            let destination = read(&key, value, &default)?;
            if by_origin.insert(origin.clone(), destination).is_some() {
                bail!("[dispatch.destinations] names the origin {origin} twice");
            }
        }
        Ok(Self { default, by_origin })
    }
}

/// A destination's key: `default`, or an origin written as a URL with nothing after the host
/// and port (`https://api.stripe.com`, `http://10.0.0.7:8080`).
fn origin_key(key: &str) -> anyhow::Result<String> {
    let url = reqwest::Url::parse(key).with_context(|| {
        format!(
            "[dispatch.destinations.{key:?}]: a destination is `default` or an origin such as \
             \"https://api.stripe.com\""
        )
    })?;
    anyhow::ensure!(
        matches!(url.scheme(), "http" | "https")
            && url.host_str().is_some()
            && url.path() == "/"
            && !key.trim_end_matches('/').contains(['?', '#'])
            && url.username().is_empty(),
        "[dispatch.destinations.{key:?}]: name an origin only (scheme, host and port), without \
         a path, query or user"
    );
    Ok(outbox::origin(key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn destinations(text: &str) -> anyhow::Result<Destinations> {
        let table: toml::Table = toml::from_str(text).unwrap();
        Destinations::from_table(table.get("destinations"))
    }

    #[test]
    fn a_window_is_its_own_sections_else_the_providers_else_the_defaults_else_forever() {
        let hours = |h: u64| IdempotencyWindow(Some(Duration::from_secs(h * 3600)));
        let none = destinations("").unwrap();
        assert_eq!(none.window("https://api.stripe.com"), hours(24), "Stripe's");
        assert_eq!(none.window("https://example.com"), IdempotencyWindow(None));
        let d = destinations(
            r#"
            [destinations.default]
            idempotency_window = "2h"
            [destinations."https://api.stripe.com"]
            max_concurrency = 4
            [destinations."https://a.example"]
            idempotency_window = "forever"
            [destinations."https://b.example"]
            idempotency_window = "7days"
            "#,
        )
        .unwrap();
        assert_eq!(
            d.window("https://api.stripe.com"),
            hours(24),
            "a section without one"
        );
        assert_eq!(d.window("https://a.example"), IdempotencyWindow(None));
        assert_eq!(d.window("https://b.example"), hours(7 * 24));
        assert_eq!(d.window("https://c.example"), hours(2), "the default's");
        for bad in ["soon", "0s"] {
            let text = format!("[destinations.default]\nidempotency_window = \"{bad}\"");
            assert!(destinations(&text).is_err(), "{bad}");
        }
    }

    #[test]
    fn origins_inherit_the_default_and_are_keyed_as_origins() {
        let d = destinations(
            r#"
            [destinations.default]
            max_concurrency = 16
            breaker_failures = 5
            [destinations."https://API.stripe.com:443"]
            max_concurrency = 4
            rate_per_sec = 25
            breaker_open = "30s"
            idempotency_header = "X-Request-Key"
            "#,
        )
        .unwrap();
        let stripe = d.of("https://api.stripe.com");
        assert_eq!(stripe.limits.max_concurrency, Some(4));
        assert_eq!(stripe.limits.rate_per_sec, Some(25.0));
        assert_eq!(stripe.limits.breaker_failures, Some(5), "from default");
        assert_eq!(stripe.limits.breaker_open, Duration::from_secs(30));
        assert_eq!(stripe.idempotency_header.as_str(), "x-request-key");
        let other = d.of("https://example.com");
        assert_eq!(other.limits.max_concurrency, Some(16));
        assert_eq!(other.idempotency_header.as_str(), "idempotency-key");
        assert_eq!(d.label("https://api.stripe.com"), "https://api.stripe.com");
        assert_eq!(d.label("https://example.com"), "default");
    }

    #[test]
    fn a_path_a_typo_or_a_zero_limit_is_refused_by_name() {
        for (text, says) in [
            (
                "[destinations.\"https://a.com/v1\"]\nmax_concurrency = 1",
                "origin only",
            ),
            (
                "[destinations.stripe]\nmax_concurrency = 1",
                "an origin such as",
            ),
            (
                "[destinations.default]\nmax_concurency = 1",
                "max_concurency",
            ),
            ("[destinations.default]\nmax_concurrency = 0", "at least 1"),
            ("[destinations.default]\nrate_per_sec = 0", "above 0"),
            (
                "[destinations.default]\nbreaker_open = \"soon\"",
                "not a duration",
            ),
            (
                "[destinations.default]\nidempotency_header = \"Host\"",
                "cannot be host",
            ),
        ] {
            let err = format!("{:#}", destinations(text).unwrap_err());
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
