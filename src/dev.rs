//! `replayproof dev`: ingest, consume and dispatch in one process for local development, on the
//! embedded broker and database unless real ones are configured.

use crate::consume::{self, BatchProcessor, ConsumerSettings, EffectRetry};
use crate::dispatch::{DispatchMetrics, DispatchSettings, Dispatcher};
use crate::effect::{BuiltinEffect, HttpOutbox};
use crate::ingest::config::{FileConfig, Source};
use crate::ingest::{self, IngestSettings};
use crate::stack::Stack;
use crate::telemetry::ConsumeMetrics;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// The built-in development sources, each secret from its variable or a fixed development value.
const DEV_SOURCES: &[(&str, &str, &str, &str)] = &[
    (
        "stripe",
        "stripe",
        "STRIPE_WEBHOOK_SECRET",
        "whsec_dev-secret-for-replayproof",
    ),
    (
        "github",
        "github",
        "GITHUB_WEBHOOK_SECRET",
        "dev-secret-for-replayproof",
    ),
    (
        "svix",
        "standard-webhooks",
        "SVIX_WEBHOOK_SECRET",
        "whsec_ZGV2LXNlY3JldC1mb3ItcmVwbGF5cHJvb2Y=",
    ),
    (
        "shopify",
        "shopify",
        "SHOPIFY_WEBHOOK_SECRET",
        "dev-secret-for-replayproof",
    ),
    (
        "slack",
        "slack",
        "SLACK_SIGNING_SECRET",
        "dev-secret-for-replayproof",
    ),
];

/// The development sources, and for each the secret in use and where it came from.
pub fn dev_sources() -> anyhow::Result<(HashMap<String, Source>, Vec<String>)> {
    let mut toml = String::new();
    let mut described = Vec::new();
    let mut env = HashMap::new();
    for (name, kind, var, fallback) in DEV_SOURCES {
        toml += &format!(
            "[[sources]]\nname = \"{name}\"\nkind = \"{kind}\"\nsecrets_env = [\"{var}\"]\n"
        );
        let (value, from) = match std::env::var(var) {
            Ok(v) if !v.is_empty() => (v, format!("from {var}")),
            _ => (fallback.to_string(), format!("set {var} to change it")),
        };
        described.push(format!("{name}: {value} ({from})"));
        env.insert(var.to_string(), value);
    }
    let file: FileConfig = toml::from_str(&toml)?;
    Ok((file.sources_with(|v| env.get(v).cloned())?, described))
}

/// What `dev` runs.
pub struct DevOptions {
    pub brokers: Option<String>,
    pub database_url: Option<crate::db::DatabaseUrl>,
    pub config: Option<std::path::PathBuf>,
    pub listen: SocketAddr,
    pub topic: String,
    pub partitions: i32,
    pub target_url: Option<String>,
}

pub async fn run(opts: DevOptions) -> anyhow::Result<()> {
    let shutdown = crate::shutdown::on_signal();
    let stack = Stack::start(
        opts.brokers.clone(),
        opts.database_url.clone(),
        &opts.topic,
        opts.partitions,
    )
    .await?;
    let (sources, secrets) = match &opts.config {
        Some(path) => (
            FileConfig::load(path)?.sources()?,
            vec![format!("from {}", path.display())],
        ),
        None => dev_sources()?,
    };
    let mut names: Vec<&String> = sources.keys().collect();
    names.sort();
    let names: Vec<String> = names.into_iter().cloned().collect();
    let ingest_settings = IngestSettings::new(opts.listen, &stack.brokers, &stack.topic);
    let ingress = ingest::start(
        ingest_settings,
        sources,
        prometheus::Registry::new(),
        shutdown.clone(),
    )
    .await?;

    let effects = match opts.target_url {
        Some(_) => vec![BuiltinEffect::Ledger, BuiltinEffect::Http],
        None => vec![BuiltinEffect::Ledger],
    };
    let http = opts.target_url.clone().map(|target_url| HttpOutbox {
        target_url,
        reconcile_url: None,
        max_attempts: 10,
    });
    let processor = BatchProcessor {
        pool: stack.pool.clone(),
        effect: BuiltinEffect::build_all(&effects, http)?,
        retry: EffectRetry::default(),
    };
    let settings = ConsumerSettings {
        log_events: true,
        kafka_options: vec![("session.timeout.ms".into(), "6000".into())],
        ..ConsumerSettings::new(&stack.brokers, &stack.topic, "replayproof-dev")
    };
    let metrics = ConsumeMetrics::new(&prometheus::Registry::new())?;
    let consumer = tokio::spawn(consume::run(settings, processor, metrics, shutdown.clone()));
    let dispatcher = match &opts.target_url {
        Some(_) => {
            let metrics = DispatchMetrics::new(&prometheus::Registry::new())?;
            let settings = DispatchSettings {
                poll_interval: Duration::from_millis(200),
                ..DispatchSettings::new("dev")
            };
            let d = Dispatcher::new(settings, stack.pool.clone(), metrics)?;
            let stop = shutdown.clone();
            Some(tokio::spawn(async move { d.run(stop).await }))
        }
        None => None,
    };

    let base = format!("http://{}", ingress.addr);
    let mut banner = String::from("\nreplayproof dev is running.\n");
    banner += &format!(
        "  Kafka:       {} ({}; topic {})\n",
        stack.brokers,
        if stack.embedded_kafka {
            "in-process mock cluster"
        } else {
            "configured"
        },
        stack.topic
    );
    banner += &format!(
        "  PostgreSQL:  {} ({})\n",
        if stack.embedded_postgres {
            stack.database_url.as_str()
        } else {
            "DATABASE_URL"
        },
        if stack.embedded_postgres {
            "throwaway cluster, removed on exit"
        } else {
            "configured"
        }
    );
    for name in &names {
        banner += &format!("  Webhooks:    POST {base}/webhooks/{name}\n");
    }
    banner += &format!("  Stripe CLI:  stripe listen --forward-to {base}/webhooks/stripe\n");
    banner +=
        "               (then set STRIPE_WEBHOOK_SECRET to the secret it prints and restart)\n";
    for s in &secrets {
        banner += &format!("  Secret:      {s}\n");
    }
    if let Some(url) = &opts.target_url {
        banner += &format!("  Outbox:      each event is also POSTed to {url}\n");
    }
    banner += "  Ctrl-C stops everything.\n";
    eprintln!("{banner}");

    ingress.stopped().await?;
    consumer.await??;
    if let Some(d) = dispatcher {
        d.await??;
    }
    drop(stack);
    tracing::info!("Stopped.");
    Ok(())
}
