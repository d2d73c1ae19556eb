//! `[dispatch.destinations]` and `[dispatch.credentials]`: the limits of each destination,
//! keyed by its origin, and the named credentials an operation may ask for.
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
//!
//! [dispatch.credentials.stripe_live]
//! headers = { Authorization = "Bearer ${STRIPE_LIVE_KEY}" }
//! ```
//!
//! An origin's section inherits what it leaves out from `default`. Every dispatcher process
//! must run with the same sections: the limits are counted in PostgreSQL, but each process
//! applies the numbers its own file gives.

use super::outbound::Header;
use crate::outbox::{self, Limits};
use anyhow::{bail, Context as _};
use reqwest::header::HeaderName;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// The idempotency key's header unless a destination names another.
pub const DEFAULT_IDEMPOTENCY_HEADER: &str = "Idempotency-Key";

/// One destination's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    pub limits: Limits,
    /// The header that carries the operation key.
    pub idempotency_header: HeaderName,
}

impl Default for Destination {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            idempotency_header: HeaderName::from_static("idempotency-key"),
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
    /// The limits each of `shards` dispatch loops may use so that together they stay within
    /// the configured ones: every database keeps its own count of a destination's requests, so
    /// each loop gets a share of the rate and of the concurrency. A concurrency limit below the
    /// number of shards cannot be shared and is refused.
    pub fn per_shard(&self, shards: usize) -> anyhow::Result<Self> {
        let split = |destination: &Destination, name: &str| -> anyhow::Result<Destination> {
            let mut limits = destination.limits.clone();
            if let Some(c) = limits.max_concurrency {
                anyhow::ensure!(
                    c as usize >= shards,
                    "the concurrency limit of {name} ({c}) is below the number of shards \
                     ({shards}): each shard's dispatch loop needs at least one request"
                );
                limits.max_concurrency = Some(c / shards as u32);
            }
            limits.rate_per_sec = limits.rate_per_sec.map(|r| r / shards as f64);
            Ok(Destination {
                limits,
                idempotency_header: destination.idempotency_header.clone(),
            })
        };
        Ok(Self {
            default: split(&self.default, "the default destination")?,
            by_origin: self
                .by_origin
                .iter()
                .map(|(origin, d)| Ok((origin.clone(), split(d, origin)?)))
                .collect::<anyhow::Result<_>>()?,
        })
    }

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
}

/// The named credentials: headers added to the requests of the operations that name them.
#[derive(Debug, Clone, Default)]
pub struct Credentials(pub BTreeMap<String, Vec<Header>>);

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
}

/// One credential as the file writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialFile {
    headers: BTreeMap<String, String>,
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
                    !super::outbound::RESERVED.contains(&name.as_str())
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
        })
    }
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

impl Credentials {
    /// Reads `[dispatch.credentials]`: `NAME = { headers = { Header = "value" } }`, the values
    /// already read from the environment (`${VAR}`) and kept secret.
    pub fn from_table(table: Option<&toml::Value>) -> anyhow::Result<Self> {
        let Some(table) = table else {
            return Ok(Self::default());
        };
        let entries: BTreeMap<String, toml::Value> = table
            .clone()
            .try_into()
            .context("[dispatch.credentials] holds one table per credential")?;
        let mut credentials = BTreeMap::new();
        for (name, value) in entries {
            let file: CredentialFile = value
                .try_into()
                .with_context(|| format!("[dispatch.credentials.{name}]"))?;
            let headers = file
                .headers
                .iter()
                .map(|(header, value)| Header::secret(header, value))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| anyhow::anyhow!("[dispatch.credentials.{name}]: {e}"))?;
            anyhow::ensure!(
                !headers.is_empty(),
                "[dispatch.credentials.{name}] has no headers"
            );
            credentials.insert(name, headers);
        }
        Ok(Self(credentials))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn destinations(text: &str) -> anyhow::Result<Destinations> {
        let table: toml::Table = toml::from_str(text).unwrap();
        Destinations::from_table(table.get("destinations"))
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

    #[test]
    fn credentials_are_secret_headers() {
        let table: toml::Table = toml::from_str(
            "[credentials.stripe_live]\nheaders = { Authorization = \"Bearer sk_live_abcdef123456\" }\n",
        )
        .unwrap();
        let c = Credentials::from_table(table.get("credentials")).unwrap();
        let h = &c.0["stripe_live"][0];
        assert_eq!(h.name.as_str(), "authorization");
        assert!(h.value.is_sensitive());
        assert!(!format!("{c:?}").contains("sk_live"));
        let bad: toml::Table =
            toml::from_str("[credentials.x]\nheaders = { Content-Type = \"a\" }\n").unwrap();
        assert!(Credentials::from_table(bad.get("credentials")).is_err());
    }

    #[test]
    fn shards_share_each_destinations_limits_and_a_limit_too_small_to_share_is_refused() {
        let d = destinations(
            r#"
            [destinations.default]
            max_concurrency = 16
            [destinations."https://api.stripe.com"]
            max_concurrency = 4
            rate_per_sec = 25
            "#,
        )
        .unwrap();
        let quarter = d.per_shard(4).unwrap();
        assert_eq!(quarter.default.limits.max_concurrency, Some(4));
        let stripe = &quarter.of("https://api.stripe.com").limits;
        assert_eq!(stripe.max_concurrency, Some(1));
        assert_eq!(stripe.rate_per_sec, Some(6.25));
        assert_eq!(
            d.per_shard(1).unwrap().of("https://api.stripe.com").limits,
            d.of("https://api.stripe.com").limits
        );
        let err = d.per_shard(8).unwrap_err().to_string();
        assert!(err.contains("below the number of shards (8)"), "{err}");
    }
}
