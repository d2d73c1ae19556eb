//! replayproof's Kafka clients: the default topic, one config builder, one durable producer,
//! and the properties nobody may override.
//!
//! `--kafka-option` passes any librdkafka property through, which is how TLS, SASL and tuning
//! reach the clients. The few properties the delivery promises rest on are guarded: an option
//! that would change one is refused, with the promise it would break, before any client is
//! created. librdkafka accepts many spellings of one property (a `topic.` prefix, aliases such
//! as `acks` for `request.required.acks`, value synonyms such as `largest` for `latest`), and
//! rust-rdkafka applies a config's properties in no fixed order, so a spelling check cannot be
//! trusted. Every option is instead tried on a scratch librdkafka configuration that already
//! holds replayproof's values, and refused when librdkafka reads a guarded property differently
//! afterwards. The same test decides which of replayproof's tuning defaults an option
//! overrides, and the finished configuration is read back once more before it is used.

use anyhow::Context as _;
use rdkafka::config::NativeClientConfig;
use std::ffi::CString;

/// The topic ingest writes the envelopes to and consume reads, unless `--topic` says otherwise.
pub const DEFAULT_TOPIC: &str = "webhooks";

/// Which client the options are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `consume`: reads the topic and commits offsets only after its transactions.
    Consumer,
    /// The tools that put records back on a topic (the dead-letter replay, the development
    /// stack): `acks=all` and idempotence guarded.
    Producer,
    /// `ingest`: `acks=all` guarded. Idempotence is a tuning default (off), not a guard: every
    /// record carries its event's dedupe key, so the duplicate a producer retry may write is the
    /// replay the consumers absorb, and librdkafka's idempotent producer sends one request at a
    /// time per partition and busy-polls while it waits (see `ingest::IngestSettings`).
    Ingress,
    /// A client that only reads metadata and a group's committed offsets (`status`).
    Reader,
}

/// Where librdkafka keeps a property: the client's configuration or the default topic
/// configuration (`auto.offset.reset`, `request.required.acks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    Global,
    Topic,
}

/// A property the delivery promises rest on.
#[derive(Debug, Clone)]
struct Guard {
    scope: Scope,
    /// librdkafka's own name for it.
    name: &'static str,
    /// What replayproof sets; None for a property left at librdkafka's default (a deprecated
    /// one, which only the user could change).
    value: Option<String>,
    /// The promise it keeps, for the refusal.
    why: &'static str,
    /// What to do instead, when the setting has a flag of its own.
    instead: &'static str,
}

impl Guard {
    fn new(scope: Scope, name: &'static str, value: &str, why: &'static str) -> Self {
        Self {
            scope,
            name,
            value: Some(value.into()),
            why,
            instead: "remove the option",
        }
    }

    /// A property left at librdkafka's default, which no option may change.
    fn default(scope: Scope, name: &'static str, why: &'static str) -> Self {
        Self {
            value: None,
            ..Self::new(scope, name, "", why)
        }
    }

    fn instead(mut self, instead: &'static str) -> Self {
        self.instead = instead;
        self
    }

    /// The key that sets it: a topic property is spelled with librdkafka's `topic.` prefix, so
    /// it reaches the default topic configuration even where a global property has its name.
    fn key(&self) -> String {
        match self.scope {
            Scope::Global => self.name.into(),
            Scope::Topic => format!("topic.{}", self.name),
        }
    }
}

/// What `role`'s client must keep, whatever the options say.
fn guards(role: Role, brokers: &str, group: Option<&str>) -> Vec<Guard> {
    let mut guards = vec![Guard::new(
        Scope::Global,
        "bootstrap.servers",
        brokers,
        "the brokers are named once",
    )
    .instead("use --brokers (or [kafka] brokers)")];
    if let Some(group) = group {
        guards.push(
            Guard::new(Scope::Global, "group.id", group, "the group is named once")
                .instead("use --group (or [kafka] group)"),
        );
    }
    match role {
        Role::Consumer => guards.extend(consumer_guards()),
        Role::Producer => guards.extend(producer_guards()),
        Role::Ingress => guards.push(acks_guard()),
        Role::Reader => {}
    }
    guards
}

/// What keeps a consumer's offsets behind its transactions.
fn consumer_guards() -> [Guard; 6] {
    use Scope::{Global, Topic};
    let broker = "offsets are committed to the group on the broker";
    [
        Guard::new(
            Global,
            "enable.auto.commit",
            "false",
            "offsets are committed only after the batch's transaction commits",
        ),
        Guard::new(
            Global,
            "enable.auto.offset.store",
            "false",
            "offsets are stored only after the batch's transaction commits",
        ),
        Guard::new(
            Topic,
            "auto.offset.reset",
            "earliest",
            "a new group reads the topic from its start, so nothing is skipped",
        ),
        Guard::new(
            Global,
            "isolation.level",
            "read_committed",
            "only committed records are read: an aborted record was never acknowledged",
        ),
        Guard::default(Global, "offset.store.method", broker),
        Guard::default(Topic, "offset.store.method", broker),
    ]
}

/// What makes a producer's acknowledgement mean the record is durable.
fn acks_guard() -> Guard {
    Guard::new(
        Scope::Topic,
        "request.required.acks",
        "all",
        "a record counts as written (a 2xx answered, an output record sent) only once every \
         in-sync replica has it (acks=all)",
    )
}

/// What makes a producer's acknowledgement mean the record is durable, once.
fn producer_guards() -> [Guard; 2] {
    [
        acks_guard(),
        Guard::new(
            Scope::Global,
            "enable.idempotence",
            "true",
            "a producer retry never writes a record twice or out of order",
        ),
    ]
}

/// A client config for `role`: replayproof's `tuning` defaults, then the user's `options` (each
/// replacing the defaults it overrides, under whatever name), then the guarded properties, set
/// last. An option that would change a guarded property, or that librdkafka refuses, is an
/// error naming it; so is a finished config that librdkafka reads differently from what was
/// meant. Every replayproof client is built here.
pub fn client_config(
    role: Role,
    brokers: &str,
    group: Option<&str>,
    tuning: &[(&str, String)],
    options: &[(String, String)],
) -> anyhow::Result<rdkafka::ClientConfig> {
    let guards = guards(role, brokers, group);
    check(&guards, options)?;
    let mut config = rdkafka::ClientConfig::new();
    for (k, v) in tuning {
        if !overridden(k, v, options)? {
            config.set(*k, v);
        }
    }
    for (k, v) in options {
        config.set(k.trim(), v);
    }
    for g in &guards {
        if let Some(value) = &g.value {
            config.set(g.key(), value);
        }
    }
    verify(&config, &guards)?;
    Ok(config)
}

/// Refuses any option that librdkafka refuses, or that changes a guarded property when applied
/// after replayproof's values.
fn check(guards: &[Guard], options: &[(String, String)]) -> anyhow::Result<()> {
    for (key, value) in options {
        let key = key.trim();
        let mut scratch = Scratch::new()?;
        scratch.apply(guards)?;
        let before = scratch.read(guards)?;
        scratch.set(key, value).map_err(|e| {
            anyhow::anyhow!(
                "--kafka-option {key}: librdkafka refuses it: {}",
                e.redact(key, value)
            )
        })?;
        let after = scratch.read(guards)?;
        for ((guard, was), is) in guards.iter().zip(&before).zip(&after) {
            if was != is {
                anyhow::bail!(
                    "--kafka-option {key}={value} is refused: it sets {} ({} in librdkafka's \
                     reading), which replayproof keeps at {} because {}; {}",
                    guard.name,
                    is,
                    was,
                    guard.why,
                    guard.instead
                );
            }
        }
    }
    Ok(())
}

/// Whether one of `options` changes the property replayproof's default `key=value` sets, under
/// any of its names: the default then gives way to it.
fn overridden(key: &str, value: &str, options: &[(String, String)]) -> anyhow::Result<bool> {
    for (k, v) in options {
        let mut scratch = Scratch::new()?;
        if scratch.set(key, value).is_err() {
            return Ok(false);
        }
        let before = scratch.get(Scope::Global, key)?;
        // Refused options were refused by `check` already.
        let _ = scratch.set(k.trim(), v);
        if scratch.get(Scope::Global, key)? != before {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Reads the finished config back as librdkafka will apply it (in the config's own order, the
/// order every client built from it uses) and checks every guarded property.
fn verify(config: &rdkafka::ClientConfig, guards: &[Guard]) -> anyhow::Result<()> {
    let native = config
        .create_native_config()
        .context("the Kafka client configuration")?;
    let mut expected = Scratch::new()?;
    expected.apply(guards)?;
    let want = expected.read(guards)?;
    let have = read(&native, guards)?;
    for ((guard, want), have) in guards.iter().zip(want).zip(have) {
        anyhow::ensure!(
            want == have,
            "the Kafka client would run with {} = {have}, not {want}; an option overrides it \
             ({})",
            guard.name,
            guard.why
        );
    }
    Ok(())
}

/// A librdkafka configuration to try options on.
struct Scratch(NativeClientConfig);

/// Why librdkafka refused a property.
struct Refused(String);

impl Refused {
    /// librdkafka's message, without the value when the property holds a secret.
    fn redact(&self, key: &str, value: &str) -> String {
        if crate::secrets::is_secret_property(key) && !value.is_empty() {
            self.0.replace(value, "<redacted>")
        } else {
            self.0.clone()
        }
    }
}

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        let native = rdkafka::ClientConfig::new()
            .create_native_config()
            .context("creating a librdkafka configuration")?;
        Ok(Self(native))
    }

    fn apply(&mut self, guards: &[Guard]) -> anyhow::Result<()> {
        for g in guards {
            if let Some(value) = &g.value {
                self.set(&g.key(), value)
                    .map_err(|e| anyhow::anyhow!("setting {}: {}", g.name, e.0))?;
            }
        }
        Ok(())
    }

    fn set(&mut self, key: &str, value: &str) -> Result<(), Refused> {
        use rdkafka::bindings as rd;
        let (Ok(k), Ok(v)) = (CString::new(key), CString::new(value)) else {
            return Err(Refused("the key or value holds a NUL byte".into()));
        };
        let mut err = [0 as std::ffi::c_char; 512];
        // SAFETY: the configuration is live and ours; both strings are NUL-terminated and
        // outlive the call, and librdkafka writes at most `err.len()` bytes, NUL-terminated.
        let res = unsafe {
            rd::rd_kafka_conf_set(
                self.0.ptr(),
                k.as_ptr(),
                v.as_ptr(),
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if res == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
            return Ok(());
        }
        // SAFETY: librdkafka left a NUL-terminated message in the buffer.
        let message = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        Err(Refused(message.to_string_lossy().trim().to_owned()))
    }

    fn get(&self, scope: Scope, key: &str) -> anyhow::Result<String> {
        get(&self.0, scope, key)
    }

    fn read(&self, guards: &[Guard]) -> anyhow::Result<Vec<String>> {
        read(&self.0, guards)
    }
}

fn read(conf: &NativeClientConfig, guards: &[Guard]) -> anyhow::Result<Vec<String>> {
    guards.iter().map(|g| get(conf, g.scope, g.name)).collect()
}

/// librdkafka's reading of `key`: a global property, or (also when `key` names no global one)
/// the default topic configuration's, or librdkafka's default when none was created.
fn get(conf: &NativeClientConfig, scope: Scope, key: &str) -> anyhow::Result<String> {
    use rdkafka::bindings as rd;
    if scope == Scope::Global {
        if let Ok(value) = conf.get(key) {
            return Ok(value);
        }
    }
    let name = CString::new(key.strip_prefix("topic.").unwrap_or(key))?;
    // SAFETY: the default topic configuration belongs to `conf`, which outlives this call; a
    // fresh one is created and destroyed here when there is none. The buffer is sized by the
    // first call and filled, NUL-terminated, by the second.
    unsafe {
        let mut topic = rd::rd_kafka_conf_get_default_topic_conf(conf.ptr());
        let fresh = topic.is_null();
        if fresh {
            topic = rd::rd_kafka_topic_conf_new();
        }
        let mut size = 0usize;
        let mut res =
            rd::rd_kafka_topic_conf_get(topic, name.as_ptr(), std::ptr::null_mut(), &mut size);
        let mut buf = vec![0u8; size.max(1)];
        if res == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK {
            res = rd::rd_kafka_topic_conf_get(
                topic,
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                &mut size,
            );
        }
        if fresh {
            rd::rd_kafka_topic_conf_destroy(topic);
        }
        anyhow::ensure!(
            res == rd::rd_kafka_conf_res_t::RD_KAFKA_CONF_OK,
            "librdkafka has no property {key}"
        );
        Ok(String::from_utf8_lossy(&buf)
            .trim_end_matches('\0')
            .to_owned())
    }
}

/// The settings of a producer that never loses or duplicates an acknowledged record (`acks=all`
/// and idempotence are its guarded properties), with its client id.
pub fn producer_tuning(client_id: &str) -> Vec<(&'static str, String)> {
    vec![("client.id", client_id.into())]
}

/// A durable producer for tools that put records back on a topic: the dead-letter replay and
/// the development stack.
pub fn producer(
    brokers: &str,
    options: &[(String, String)],
) -> anyhow::Result<rdkafka::producer::FutureProducer> {
    let tuning = producer_tuning("replayproof-tools");
    let config = client_config(Role::Producer, brokers, None, &tuning, options)?;
    config.create().context("creating the Kafka producer")
}

/// Produces one raw record and waits for the broker's acknowledgement.
pub async fn produce_raw(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
    headers: &crate::inputs::Headers,
) -> anyhow::Result<()> {
    let mut record = rdkafka::producer::FutureRecord::<[u8], [u8]>::to(topic);
    if !headers.is_empty() {
        let mut owned = rdkafka::message::OwnedHeaders::new();
        for (name, value) in headers.iter() {
            owned = owned.insert(rdkafka::message::Header { key: name, value });
        }
        record = record.headers(owned);
    }
    if let Some(k) = key {
        record = record.key(k);
    }
    if let Some(v) = value {
        record = record.payload(v);
    }
    producer
        .send(record, std::time::Duration::from_secs(10))
        .await
        .map_err(|(e, _)| anyhow::Error::new(e).context(format!("producing to {topic}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn consumer(pairs: &[(&str, &str)]) -> anyhow::Result<rdkafka::ClientConfig> {
        client_config(Role::Consumer, "b:9092", Some("g"), &[], &options(pairs))
    }

    fn producer_config(pairs: &[(&str, &str)]) -> anyhow::Result<rdkafka::ClientConfig> {
        client_config(Role::Producer, "b:9092", None, &[], &options(pairs))
    }

    #[test]
    fn every_spelling_that_moves_or_skips_offsets_is_refused_for_the_consumer() {
        for (key, value) in [
            ("auto.offset.reset", "latest"),
            ("topic.auto.offset.reset", "latest"),
            ("auto.offset.reset", "largest"),
            ("topic.auto.offset.reset", "end"),
            ("auto.offset.reset", "error"),
            ("enable.auto.commit", "true"),
            ("enable.auto.commit", "1"),
            ("enable.auto.commit", "T"),
            (" enable.auto.commit ", "true"),
            ("enable.auto.offset.store", "true"),
            ("isolation.level", "read_uncommitted"),
            ("offset.store.method", "file"),
            ("topic.offset.store.method", "file"),
            ("group.id", "another"),
            ("bootstrap.servers", "elsewhere:9092"),
            ("metadata.broker.list", "elsewhere:9092"),
        ] {
            let err = consumer(&[(key, value)]).unwrap_err().to_string();
            assert!(err.contains("refused"), "{key}={value}: {err}");
        }
    }

    #[test]
    fn options_that_keep_the_guarded_values_or_touch_nothing_guarded_pass() {
        consumer(&[
            ("auto.offset.reset", "earliest"),
            ("topic.auto.offset.reset", "smallest"),
            ("enable.auto.commit", "false"),
            ("isolation.level", "read_committed"),
            ("session.timeout.ms", "6000"),
            ("security.protocol", "ssl"),
            ("topic.metadata.refresh.interval.ms", "2000"),
        ])
        .unwrap();
        producer_config(&[("acks", "-1"), ("topic.acks", "all"), ("linger.ms", "10")]).unwrap();
    }

    #[test]
    fn every_spelling_that_weakens_durability_is_refused_for_the_producer() {
        for (key, value) in [
            ("acks", "1"),
            ("acks", "0"),
            ("topic.acks", "1"),
            ("request.required.acks", "1"),
            ("topic.request.required.acks", "0"),
            ("enable.idempotence", "false"),
        ] {
            let err = producer_config(&[(key, value)]).unwrap_err().to_string();
            assert!(err.contains("refused"), "{key}={value}: {err}");
        }
    }

    #[test]
    fn the_ingress_keeps_acks_all_and_leaves_idempotence_to_the_operator() {
        let ingress = |pairs: &[(&str, &str)]| {
            client_config(Role::Ingress, "b:9092", None, &[], &options(pairs))
        };
        for (key, value) in [("acks", "1"), ("topic.request.required.acks", "0")] {
            let err = ingress(&[(key, value)]).unwrap_err().to_string();
            assert!(err.contains("refused"), "{key}={value}: {err}");
        }
        let on = ingress(&[("enable.idempotence", "true")]).unwrap();
        assert_eq!(on.get("enable.idempotence"), Some("true"));
        let settings = crate::ingest::IngestSettings::new(
            "127.0.0.1:0".parse().unwrap(),
            "b:9092",
            "webhooks",
        );
        let config = settings.producer_config().unwrap();
        assert_eq!(config.get("enable.idempotence"), Some("false"));
        assert_eq!(config.get("topic.request.required.acks"), Some("all"));
        // The tools' producer still guards idempotence.
        assert!(producer_config(&[("enable.idempotence", "false")]).is_err());
    }

    #[test]
    fn unknown_or_invalid_options_are_refused_at_once_without_printing_a_secret() {
        let err = consumer(&[("no.such.property", "1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("no.such.property"), "{err}");
        let err = consumer(&[("session.timeout.ms", "soon")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("session.timeout.ms"), "{err}");
        // A mistyped secret property: named, its value never printed.
        let err = consumer(&[("sasl.pasword", "hunter2-secret")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("sasl.pasword"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_guarded_values_are_what_the_finished_config_holds_in_any_order() {
        // rust-rdkafka applies a config's properties in its map's order, which changes from one
        // config to the next: build many and read each back as librdkafka applies it.
        for _ in 0..50 {
            let config = consumer(&[
                ("topic.auto.offset.reset", "earliest"),
                ("auto.offset.reset", "smallest"),
            ])
            .unwrap();
            let native = config.create_native_config().unwrap();
            assert_eq!(
                get(&native, Scope::Topic, "auto.offset.reset").unwrap(),
                "smallest"
            );
            assert_eq!(native.get("enable.auto.commit").unwrap(), "false");
            assert_eq!(native.get("enable.auto.offset.store").unwrap(), "false");
            assert_eq!(native.get("isolation.level").unwrap(), "read_committed");
            assert_eq!(native.get("group.id").unwrap(), "g");
        }
    }

    #[test]
    fn an_option_replaces_the_default_it_overrides_under_any_name() {
        let tuning = [
            ("queue.buffering.max.ms", "2".to_owned()),
            ("client.id", "replayproof".to_owned()),
        ];
        for _ in 0..20 {
            let config = client_config(
                Role::Producer,
                "b:9092",
                None,
                &tuning,
                &options(&[("linger.ms", "250")]),
            )
            .unwrap();
            let native = config.create_native_config().unwrap();
            assert_eq!(native.get("queue.buffering.max.ms").unwrap(), "250");
            assert_eq!(native.get("client.id").unwrap(), "replayproof");
        }
    }
}
