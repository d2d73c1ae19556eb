//! The ingress configuration: the `[ingest]` section of the configuration file, with its
//! sources, whose secrets come from the environment.
//!
//! ```toml
//! [[ingest.sources]]
//! name = "stripe"                 # the URL segment: POST /webhooks/stripe
//! kind = "stripe"                 # stripe | github | standard-webhooks | shopify | slack | hmac
//! secrets_env = ["STRIPE_WEBHOOK_SECRET", "STRIPE_WEBHOOK_SECRET_PREVIOUS"]
//! tolerance = "5m"               # for schemes that sign a timestamp (old: tolerance_secs = 300)
//! ```

use super::signature::{Encoding, KeyFrom, Scheme, Secret};

/// The shortest secret accepted, in bytes (after base64 decoding for Standard Webhooks).
pub const MIN_SECRET_BYTES: usize = 16;
use anyhow::{bail, Context as _};
use base64::Engine as _;
use serde::Deserialize;
use std::collections::HashMap;

/// The keys of the file read here rather than by a flag, as (section, key).
pub const FILE_TABLES: &[(&str, &str)] = &[("ingest", "sources")];

/// The sources as the file writes them. Ingest's other settings (`listen`, `max_body_bytes`,
/// `produce_timeout_ms`, the brokers and the topic) are flags, layered from the file with the
/// others ([`crate::config`]); only the sources are read here.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    pub sources: Vec<SourceConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Stripe,
    Github,
    StandardWebhooks,
    Shopify,
    Slack,
    Hmac,
}

/// One source as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    pub name: String,
    pub kind: Kind,
    /// Names of environment variables holding the secrets; several during a rotation.
    pub secrets_env: Vec<String>,
    /// For schemes that sign a timestamp: how far it may be from now (`"5m"`); 5 minutes when
    /// unset.
    #[serde(default, deserialize_with = "humantime_text")]
    pub tolerance: Option<std::time::Duration>,
    /// The old spelling of `tolerance`, in seconds.
    #[serde(default = "default_tolerance")]
    pub tolerance_secs: i64,
    /// `hmac` only: the header carrying the signature.
    pub signature_header: Option<String>,
    /// `hmac` only: text before the signature, such as `sha256=`.
    pub signature_prefix: Option<String>,
    /// `hmac` only: `hex` (default) or `base64`.
    pub encoding: Option<Encoding>,
    /// `hmac` only: `{ header = "X-Event-Id" }` or `{ json_pointer = "/id" }`.
    pub key_from: Option<KeyFrom>,
    /// Routes the source's events by a tenant field instead of by the event key, so a
    /// tenant's claims and effects share one shard (docs/scaling.md): `{ json_pointer =
    /// "/account" }` or `{ header = "X-Shopify-Shop-Domain" }`. Fixed for the life of the data:
    /// changing it sends redeliveries of old events to another shard.
    pub route_from: Option<KeyFrom>,
    /// For kinds that sign only the body while the key comes from an unsigned header (github,
    /// shopify, hmac keyed by a header): how long the same signed body under another id is
    /// taken for a replayed capture and recorded as a key conflict instead of applied. Defaults
    /// to the provider's redelivery window (`"72h"`); 0 turns the guard off.
    #[serde(default, deserialize_with = "humantime_text")]
    pub replay_window: Option<std::time::Duration>,
    /// The old spelling of `replay_window`, in seconds.
    pub replay_window_secs: Option<u64>,
    /// How long this source's claims are kept (`"35d"`); `[retention] default_retention` when
    /// unset, and required for kind = "hmac". Checked by prune against the kind's floor.
    #[serde(default, deserialize_with = "humantime_text")]
    pub retention: Option<std::time::Duration>,
    /// The JSON pointer to the business obligation this source's events fulfil (an order id:
    /// `"/data/object/metadata/order_id"`), read by `consume`'s `http` effect over
    /// `[consume] operation_key` (docs/outbox.md, "Obligations").
    pub operation_key: Option<String>,
}

/// A duration written as humantime text (`"5m"`, `"72h"`), or absent.
fn humantime_text<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<std::time::Duration>, D::Error> {
    let text = String::deserialize(d)?;
    humantime::parse_duration(&text)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{e} (a duration such as 30s or 5m)")))
}

fn default_tolerance() -> i64 {
    300
}

impl SourceConfig {
    /// A source of `kind` whose secret is in the variable `secret_env`, with every other
    /// setting at its default.
    pub fn new(name: &str, kind: Kind, secret_env: &str) -> Self {
        Self {
            name: name.into(),
            kind,
            secrets_env: vec![secret_env.into()],
            tolerance: None,
            tolerance_secs: default_tolerance(),
            signature_header: None,
            signature_prefix: None,
            encoding: None,
            key_from: None,
            route_from: None,
            replay_window: None,
            replay_window_secs: None,
            retention: None,
            operation_key: None,
        }
    }

    /// The replay guard's window in force for this source (see [`SourceConfig::replay_window`]),
    /// None when it has none or its settings are incomplete.
    pub fn effective_replay_window(&self) -> Option<std::time::Duration> {
        let default = self.scheme().ok()?.default_replay_window_secs()?;
        let secs = match (self.replay_window, self.replay_window_secs) {
            (Some(w), _) => w.as_secs(),
            (None, Some(secs)) => secs,
            (None, None) => default,
        };
        (secs > 0).then(|| std::time::Duration::from_secs(secs))
    }
}

/// A source ready to verify requests.
#[derive(Debug, Clone)]
pub struct Source {
    pub name: String,
    pub scheme: Scheme,
    pub secrets: Vec<Secret>,
    pub tolerance_secs: i64,
    /// The replay guard's window (see [`SourceConfig::replay_window_secs`]); None when off.
    pub replay_window_secs: Option<u64>,
    /// Where the route key is read, when the source routes by a tenant field.
    pub route_from: Option<KeyFrom>,
}

impl FileConfig {
    /// The sources of the configuration file at `path` (see [`crate::config`]).
    #[cfg(feature = "cli")]
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        let file = crate::config::ConfigFile::load(path, &crate::config::ProcessEnv)?;
        Self::from_config(&file)
    }

    /// The sources of the file's `[ingest]` section.
    #[cfg(feature = "cli")]
    pub fn from_config(file: &crate::config::ConfigFile) -> anyhow::Result<Self> {
        let mut table = toml::Table::new();
        if let Some(sources) = file.section("ingest").get("sources") {
            table.insert("sources".into(), sources.clone());
        }
        toml::Value::Table(table)
            .try_into()
            .with_context(|| format!("{}: [ingest]", file.path.display()))
    }

    /// Resolves every source, reading secrets from the environment.
    pub fn sources(&self) -> anyhow::Result<HashMap<String, Source>> {
        self.sources_with(|name| std::env::var(name).ok())
    }

    /// Resolves every source with `env` as the environment.
    pub fn sources_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<HashMap<String, Source>> {
        let mut sources = HashMap::new();
        for s in &self.sources {
            let source = s
                .resolve(&env)
                .with_context(|| format!("source {:?}", s.name))?;
            if sources.insert(s.name.clone(), source).is_some() {
                bail!("two sources are named {:?}", s.name);
            }
        }
        Ok(sources)
    }
}

impl SourceConfig {
    /// The source's name is letters, digits, '-' and '_', and not one whose keys
    /// (`{name}:{id}`) could be another input's ([`crate::inputs::RESERVED_KEY_PREFIXES`]).
    fn check_name(&self) -> anyhow::Result<()> {
        let valid_name = !self.name.is_empty()
            && self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        anyhow::ensure!(valid_name, "a source name is letters, digits, '-' and '_'");
        anyhow::ensure!(
            !crate::inputs::RESERVED_KEY_PREFIXES.contains(&format!("{}:", self.name).as_str()),
            "the source name {:?} is reserved: the keys of the CloudEvents and Debezium outbox \
             inputs begin with it, and an event key of this source could be one of theirs",
            self.name
        );
        Ok(())
    }

    fn resolve(&self, env: &impl Fn(&str) -> Option<String>) -> anyhow::Result<Source> {
        self.check_name()?;
        anyhow::ensure!(
            !self.secrets_env.is_empty(),
            "secrets_env names no variable"
        );
        anyhow::ensure!(self.tolerance_secs >= 0, "tolerance_secs is negative");
        anyhow::ensure!(
            self.tolerance.is_none() || self.tolerance_secs == default_tolerance(),
            "give tolerance or its old spelling tolerance_secs, not both"
        );
        anyhow::ensure!(
            self.replay_window.is_none() || self.replay_window_secs.is_none(),
            "give replay_window or its old spelling replay_window_secs, not both"
        );
        let tolerance_secs = match self.tolerance {
            Some(t) => i64::try_from(t.as_secs()).context("tolerance is too long")?,
            None => self.tolerance_secs,
        };
        let replay_window = self.replay_window.map(|w| w.as_secs());
        let secrets = self
            .secrets_env
            .iter()
            .map(|var| {
                let value = env(var).filter(|v| !v.is_empty());
                let value =
                    value.with_context(|| format!("environment variable {var} is not set"))?;
                self.secret(&value)
                    .with_context(|| format!("environment variable {var}"))
            })
            .collect::<anyhow::Result<_>>()?;
        let scheme = self.scheme()?;
        let replay_window_secs = match (
            replay_window.or(self.replay_window_secs),
            scheme.default_replay_window_secs(),
        ) {
            (_, None) => None,
            (Some(0), Some(_)) => None,
            (Some(secs), Some(_)) => Some(secs),
            (None, default) => default,
        };
        Ok(Source {
            name: self.name.clone(),
            scheme,
            secrets,
            tolerance_secs,
            replay_window_secs,
            route_from: self.route_from.clone(),
        })
    }

    /// Standard Webhooks secrets are base64 after `whsec_`; every other kind uses the bytes.
    /// A key under [`MIN_SECRET_BYTES`] is refused: `whsec_` alone would be an empty HMAC key,
    /// and a short one can be guessed.
    fn secret(&self, value: &str) -> anyhow::Result<Secret> {
        crate::secrets::register(value);
        let bytes = if self.kind == Kind::StandardWebhooks {
            let encoded = value.strip_prefix("whsec_").unwrap_or(value);
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .context("a Standard Webhooks secret is base64 after whsec_")?
        } else {
            value.as_bytes().to_vec()
        };
        anyhow::ensure!(
            bytes.len() >= MIN_SECRET_BYTES,
            "the secret is {} bytes; at least {MIN_SECRET_BYTES} are required",
            bytes.len()
        );
        Ok(Secret::new(bytes))
    }

    fn scheme(&self) -> anyhow::Result<Scheme> {
        let generic_only = self.signature_header.is_some()
            || self.signature_prefix.is_some()
            || self.encoding.is_some()
            || self.key_from.is_some();
        anyhow::ensure!(
            self.kind == Kind::Hmac || !generic_only,
            "signature_header, signature_prefix, encoding and key_from are for kind = \"hmac\""
        );
        Ok(match self.kind {
            Kind::Stripe => Scheme::Stripe,
            Kind::Github => Scheme::Github,
            Kind::StandardWebhooks => Scheme::StandardWebhooks,
            Kind::Shopify => Scheme::Shopify,
            Kind::Slack => Scheme::Slack,
            Kind::Hmac => Scheme::Hmac {
                header: self
                    .signature_header
                    .clone()
                    .context("kind = \"hmac\" needs signature_header")?,
                prefix: self.signature_prefix.clone().unwrap_or_default(),
                encoding: self.encoding.unwrap_or(Encoding::Hex),
                key_from: self
                    .key_from
                    .clone()
                    .context("kind = \"hmac\" needs key_from")?,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> FileConfig {
        toml::from_str(text).unwrap()
    }

    /// One `[[sources]]` entry reading its secret from `S`, plus any extra lines.
    fn source(name: &str, kind: &str, extra: &str) -> String {
        format!(
            "[[sources]]\nname = \"{name}\"\nkind = \"{kind}\"\nsecrets_env = [\"S\"]\n{extra}\n"
        )
    }

    /// The sources of `text` with every secret set to `secret`.
    fn sources(text: &str, secret: &str) -> anyhow::Result<HashMap<String, Source>> {
        parse(text).sources_with(|_| Some(secret.into()))
    }

    const LONG_ENOUGH: &str = "a-long-enough-secret";

    #[test]
    fn secrets_come_from_the_environment() {
        let config = parse(
            r#"
            [[sources]]
            name = "stripe"
            kind = "stripe"
            secrets_env = ["A", "B"]
            "#,
        );
        let env = |k: &str| (k == "A" || k == "B").then(|| format!("a-long-enough-secret-{k}"));
        let sources = config.sources_with(env).unwrap();
        assert_eq!(sources["stripe"].secrets.len(), 2);
        assert_eq!(sources["stripe"].tolerance_secs, 300);
        let missing = config.sources_with(|_| None).unwrap_err();
        assert!(format!("{missing:#}").contains("A is not set"));
    }

    #[test]
    fn generic_hmac_needs_its_header_and_key() {
        let custom = source(
            "custom",
            "hmac",
            r#"signature_header = "X-Signature"
            signature_prefix = "sha256="
            encoding = "base64"
            key_from = { json_pointer = "/id" }"#,
        );
        let built = sources(&custom, LONG_ENOUGH).unwrap();
        assert!(matches!(
            &built["custom"].scheme,
            Scheme::Hmac {
                encoding: Encoding::Base64,
                ..
            }
        ));
        let incomplete = source("x", "hmac", "");
        assert!(sources(&incomplete, LONG_ENOUGH).is_err());
    }

    #[test]
    fn bad_names_and_duplicates_are_refused() {
        let dup = source("a", "github", "") + &source("a", "github", "");
        assert!(sources(&dup, LONG_ENOUGH).is_err());
        assert!(sources(&source("a/b", "github", ""), LONG_ENOUGH).is_err());
        for reserved in ["ce", "ce-sha256", "outbox"] {
            let refused = sources(&source(reserved, "github", ""), LONG_ENOUGH).unwrap_err();
            assert!(
                format!("{refused:#}").contains("is reserved"),
                "{refused:#}"
            );
        }
        assert!(sources(&source("cloud", "github", ""), LONG_ENOUGH).is_ok());
    }

    #[test]
    fn short_or_empty_secrets_are_refused_at_start() {
        for (kind, secret) in [
            ("standard-webhooks", "whsec_"),
            ("standard-webhooks", "whsec_c2hvcnQ="),
            ("github", "short-secret"),
            ("stripe", "whsec_short"),
        ] {
            let refused = sources(&source("s", kind, ""), secret).unwrap_err();
            assert!(
                format!("{refused:#}").contains("at least 16 are required"),
                "{kind} {secret}: {refused:#}"
            );
        }
        // base64 of 16 bytes passes.
        let ok = sources(
            &source("s", "standard-webhooks", ""),
            "whsec_MDEyMzQ1Njc4OWFiY2RlZg==",
        );
        assert!(ok.is_ok());
    }
}
