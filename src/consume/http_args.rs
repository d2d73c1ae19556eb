//! The built-in `http` effect's flags: its target, reconcile URL, attempts, and the obligation
//! its operations are keyed by.

use crate::effect::obligation::{check_pointer, OperationKeys};
use crate::effect::HttpOutbox;
use clap::Args;

/// Sends of an outbox operation before it is dead (`--max-attempts`).
pub const DEFAULT_MAX_ATTEMPTS: i32 = 10;

/// The `http` effect's flags.
#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "Effects")]
pub struct HttpEffectArgs {
    /// With --effect http: where each event is POSTed (by `replayproof dispatch`).
    #[arg(long, env = "REPLAYPROOF_TARGET_URL", value_parser = crate::dispatch::outbound::check_url)]
    pub target_url: Option<String>,

    /// With --effect http: a URL template, `{key}` replaced by the operation key, that answers
    /// 2xx when the downstream already has the operation and 404 when it does not. Used to
    /// settle uncertain outcomes without resending.
    #[arg(long, env = "REPLAYPROOF_RECONCILE_URL", value_parser = crate::dispatch::outbound::check_url)]
    pub reconcile_url: Option<String>,

    /// With --effect http: attempts before an operation is dead.
    #[arg(long, env = "REPLAYPROOF_MAX_ATTEMPTS", default_value_t = DEFAULT_MAX_ATTEMPTS, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,

    /// With --effect http: a JSON pointer into the payload to the business obligation each
    /// event fulfils (an order id: /data/object/metadata/order_id). The operation is then keyed
    /// `{source}:{obligation}#deliver`: a later event naming the same obligation sends nothing
    /// and is recorded as fulfilled by the first. A source's own `operation_key` in
    /// [[ingest.sources]] wins; with several databases every source must be routed by it.
    #[arg(long, env = "REPLAYPROOF_OPERATION_KEY", value_name = "POINTER", value_parser = check_pointer)]
    pub operation_key: Option<String>,
}

impl HttpEffectArgs {
    /// The outbox effect's settings, when a target is given.
    pub fn outbox(&self) -> Option<HttpOutbox> {
        self.target_url.clone().map(|target_url| HttpOutbox {
            target_url,
            reconcile_url: self.reconcile_url.clone(),
            max_attempts: self.max_attempts,
            operation_keys: OperationKeys {
                default: self.operation_key.clone(),
                ..OperationKeys::default()
            },
        })
    }

    /// The outbox effect's settings with the obligations of `file`'s `[[ingest.sources]]`,
    /// refused when `sharded` and a source naming one is not routed by it.
    pub fn outbox_for(
        &self,
        file: Option<&crate::config::ConfigFile>,
        sharded: bool,
    ) -> anyhow::Result<Option<HttpOutbox>> {
        let Some(outbox) = self.outbox() else {
            return Ok(None);
        };
        let sources = match file {
            Some(file) => crate::ingest::config::FileConfig::from_config(file)?.sources,
            None => Vec::new(),
        };
        let operation_keys =
            OperationKeys::resolve(self.operation_key.as_deref(), &sources, sharded)?;
        Ok(Some(HttpOutbox {
            operation_keys,
            ..outbox
        }))
    }
}
