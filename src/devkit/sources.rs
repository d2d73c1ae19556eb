//! Webhook sources with known development secrets, for `dev` and `demo`.

use crate::ingest::config::{FileConfig, Kind, Source, SourceConfig};
use std::collections::HashMap;

/// A source whose secret comes from a variable, or a fixed development value without it.
#[derive(Debug, Clone, Copy)]
pub struct DevSource {
    pub name: &'static str,
    pub kind: Kind,
    pub secret_env: &'static str,
    pub fallback: &'static str,
}

/// `dev`'s sources: one of each provider.
pub const DEV_SOURCES: &[DevSource] = &[
    DevSource {
        name: "stripe",
        kind: Kind::Stripe,
        secret_env: "STRIPE_WEBHOOK_SECRET",
        fallback: "whsec_dev-secret-for-replayproof",
    },
    DevSource {
        name: "github",
        kind: Kind::Github,
        secret_env: "GITHUB_WEBHOOK_SECRET",
        fallback: "dev-secret-for-replayproof",
    },
    DevSource {
        name: "svix",
        kind: Kind::StandardWebhooks,
        secret_env: "SVIX_WEBHOOK_SECRET",
        fallback: "whsec_ZGV2LXNlY3JldC1mb3ItcmVwbGF5cHJvb2Y=",
    },
    DevSource {
        name: "shopify",
        kind: Kind::Shopify,
        secret_env: "SHOPIFY_WEBHOOK_SECRET",
        fallback: "dev-secret-for-replayproof",
    },
    DevSource {
        name: "slack",
        kind: Kind::Slack,
        secret_env: "SLACK_SIGNING_SECRET",
        fallback: "dev-secret-for-replayproof",
    },
];

/// The sources, each secret looked up with `lookup` (by its variable's name) or its fallback;
/// and for each a line saying which secret is in use and where it came from.
pub fn build(
    defs: &[DevSource],
    lookup: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<(HashMap<String, Source>, Vec<String>)> {
    let mut described = Vec::new();
    let mut secrets = HashMap::new();
    for def in defs {
        let (value, from) = match lookup(def.secret_env) {
            Some(v) if !v.is_empty() => (v, format!("from {}", def.secret_env)),
            _ => (
                def.fallback.to_owned(),
                format!("set {} to change it", def.secret_env),
            ),
        };
        described.push(format!("{}: {value} ({from})", def.name));
        secrets.insert(def.secret_env, value);
    }
    let file = FileConfig {
        sources: defs
            .iter()
            .map(|d| SourceConfig::new(d.name, d.kind, d.secret_env))
            .collect(),
    };
    let sources = file.sources_with(|v| secrets.get(v).cloned())?;
    Ok((sources, described))
}

/// `dev`'s sources, with their secrets from the environment where set.
pub fn dev_sources() -> anyhow::Result<(HashMap<String, Source>, Vec<String>)> {
    build(DEV_SOURCES, |var| std::env::var(var).ok())
}
