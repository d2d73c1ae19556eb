//! Effects by name: the built-in `ledger` and `http`, and whatever an application registers,
//! so that `consume --effect` and an operator's retry can build any of them.

use super::{Chain, DeferPolicy, Effect, EffectError, HttpOutbox, KafkaOutput, Ledger, Tx};
use crate::envelope::Event;
use anyhow::Context as _;
use async_trait::async_trait;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The name of the built-in outbox effect, built from its settings rather than registered.
const HTTP: &str = "http";
/// The name of the built-in Kafka output effect, built from `--output-topic`.
const KAFKA: &str = "kafka";

/// The settings of the built-in effects that have some: `http`'s and `kafka`'s.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuiltIns<'a> {
    /// The `http` effect, when `--target-url` is given.
    pub http: Option<&'a HttpOutbox>,
    /// The `kafka` effect, when `--output-topic` is given.
    pub kafka: Option<&'a KafkaOutput>,
}

/// The setting a built-in effect cannot be built without (its file key), and what is said
/// when it is missing.
pub fn built_in_needs(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        HTTP => Some(("target_url", "--effect http needs --target-url")),
        KAFKA => Some(("output_topic", "--effect kafka needs --output-topic")),
        _ => None,
    }
}

/// The effects `--effect` can name.
#[derive(Clone)]
pub struct Registry {
    named: BTreeMap<String, Arc<dyn Effect>>,
}

impl Default for Registry {
    /// The built-in effects: `ledger`, and `http` (built from `--target-url`).
    fn default() -> Self {
        let mut named: BTreeMap<String, Arc<dyn Effect>> = BTreeMap::new();
        named.insert("ledger".into(), Arc::new(Ledger));
        #[cfg(feature = "failpoints")]
        named.insert("ledger-after".into(), Arc::new(super::testing::LedgerAfter));
        Self { named }
    }
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Registry {
    /// Registers `effect` under `name`, replacing a built-in of that name.
    pub fn with(mut self, name: &str, effect: impl Effect) -> Self {
        let named = Named {
            name: name.to_owned(),
            inner: Arc::new(effect),
        };
        self.named.insert(name.to_owned(), Arc::new(named));
        self
    }

    /// Every name `--effect` accepts.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.named.keys().cloned().collect();
        names.extend([HTTP.into(), KAFKA.into()]);
        names.sort();
        names
    }

    /// Builds the named effects, chained in order when there are several; `http` needs its
    /// settings, and `kafka` is refused ([`Registry::build_with`] gives it its topic).
    pub fn build(
        &self,
        names: &[String],
        http: Option<&HttpOutbox>,
    ) -> anyhow::Result<Arc<dyn Effect>> {
        let built_ins = BuiltIns { http, kafka: None };
        self.build_with(names, built_ins)
    }

    /// Builds the named effects, chained in order when there are several; `http` and `kafka`
    /// need their settings.
    pub fn build_with(
        &self,
        names: &[String],
        built_ins: BuiltIns<'_>,
    ) -> anyhow::Result<Arc<dyn Effect>> {
        let mut built = names
            .iter()
            .map(|name| self.build_one(name, built_ins))
            .collect::<anyhow::Result<Vec<_>>>()?;
        anyhow::ensure!(!built.is_empty(), "no effect given");
        Ok(if built.len() == 1 {
            built.remove(0)
        } else {
            Arc::new(Chain(built))
        })
    }

    fn build_one(&self, name: &str, built_ins: BuiltIns<'_>) -> anyhow::Result<Arc<dyn Effect>> {
        let missing = || built_in_needs(name).map_or_else(String::new, |(_, why)| why.into());
        if name == HTTP {
            let http = built_ins.http.with_context(missing)?;
            return Ok(Arc::new(http.clone()));
        }
        if name == KAFKA {
            let kafka = built_ins.kafka.with_context(missing)?;
            return Ok(Arc::new(kafka.clone()));
        }
        self.named.get(name).cloned().with_context(|| {
            format!(
                "no effect is called {name:?}; the effects are {}",
                self.names().join(", ")
            )
        })
    }

    /// Builds an effect again from its [`Effect::spec`].
    pub fn from_spec(&self, spec: &serde_json::Value) -> anyhow::Result<Arc<dyn Effect>> {
        let name = spec.get("effect").and_then(serde_json::Value::as_str);
        match name {
            Some(HTTP) => Ok(Arc::new(HttpOutbox::from_spec(spec)?)),
            Some(KAFKA) => Ok(Arc::new(KafkaOutput::from_spec(spec)?)),
            Some("chain") => {
                let parts = spec
                    .get("of")
                    .and_then(serde_json::Value::as_array)
                    .context("a chain spec lists its effects under `of`")?;
                let parts = parts.iter().map(|p| self.from_spec(p));
                Ok(Arc::new(Chain(parts.collect::<anyhow::Result<_>>()?)))
            }
            Some(name) => self.build_one(name, BuiltIns::default()),
            None => anyhow::bail!("not an effect spec: {spec}"),
        }
    }
}

/// A registered effect, recorded on failed claims by its name unless it has a spec of its own.
struct Named {
    name: String,
    inner: Arc<dyn Effect>,
}

#[async_trait]
impl Effect for Named {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
        self.inner.apply(tx, event).await
    }

    async fn apply_batch(&self, tx: &mut Tx<'_>, events: &[&Event]) -> Result<(), EffectError> {
        self.inner.apply_batch(tx, events).await
    }

    fn spec(&self) -> Option<serde_json::Value> {
        self.inner
            .spec()
            .or_else(|| Some(serde_json::json!({ "effect": self.name })))
    }

    fn defer_policy(&self) -> Option<DeferPolicy> {
        self.inner.defer_policy()
    }
}
