//! replayproof's Kafka clients: the default topic, one config builder, one durable producer,
//! and the properties they refuse to have overridden.
//!
//! `--kafka-option` passes any librdkafka property through, which is how TLS, SASL and tuning
//! reach the clients. The few properties the delivery promises rest on are set by replayproof
//! and refused here, with the promise they would break, before any client is created.

/// The topic ingest writes the envelopes to and consume reads, unless `--topic` says otherwise.
pub const DEFAULT_TOPIC: &str = "webhooks";

/// The consumer's guarded properties (with librdkafka's aliases) and why each is guarded.
const CONSUMER_GUARDED: &[(&str, &str)] = &[
    (
        "enable.auto.commit",
        "offsets are committed only after the batch's transaction commits",
    ),
    (
        "auto.commit.enable",
        "offsets are committed only after the batch's transaction commits",
    ),
    (
        "enable.auto.offset.store",
        "offsets are stored only after the batch's transaction commits",
    ),
    ("isolation.level", "only committed records are read"),
    (
        "auto.offset.reset",
        "a new group reads the topic from its start, so nothing is skipped",
    ),
];

/// The ingress producer's guarded properties and why each is guarded.
const PRODUCER_GUARDED: &[(&str, &str)] = &[
    (
        "acks",
        "a 2xx is answered only after every in-sync replica has the record (acks=all)",
    ),
    (
        "request.required.acks",
        "a 2xx is answered only after every in-sync replica has the record (acks=all)",
    ),
    (
        "enable.idempotence",
        "a producer retry never writes a record twice or out of order",
    ),
];

/// Which client the options are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Consumer,
    Producer,
}

/// Refuses any option that would override a guarded property of `role`'s client.
pub fn check_options(role: Role, options: &[(String, String)]) -> anyhow::Result<()> {
    let guarded = match role {
        Role::Consumer => CONSUMER_GUARDED,
        Role::Producer => PRODUCER_GUARDED,
    };
    for (key, _) in options {
        let key = key.trim();
        if let Some((_, why)) = guarded.iter().find(|(k, _)| k.eq_ignore_ascii_case(key)) {
            anyhow::bail!(
                "--kafka-option {key} is refused: replayproof sets it because {why}; \
                 remove the option"
            );
        }
    }
    Ok(())
}

/// A client config for `brokers` with `settings`, then `options` (the user's `--kafka-option`)
/// over them. Every replayproof client is built here.
pub fn client_config(
    brokers: &str,
    settings: &[(&str, String)],
    options: &[(String, String)],
) -> rdkafka::ClientConfig {
    let mut config = rdkafka::ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (k, v) in settings {
        config.set(*k, v);
    }
    for (k, v) in options {
        config.set(k, v);
    }
    config
}

/// The settings of a producer that never loses or duplicates an acknowledged record:
/// `acks=all` and idempotence.
pub fn durable_producer_settings(client_id: &str) -> Vec<(&'static str, String)> {
    vec![
        ("acks", "all".into()),
        ("enable.idempotence", "true".into()),
        ("client.id", client_id.into()),
    ]
}

/// A durable producer (see [`durable_producer_settings`]) for tools that put records back
/// on a topic: the dead-letter replay and the development stack.
pub fn producer(
    brokers: &str,
    options: &[(String, String)],
) -> anyhow::Result<rdkafka::producer::FutureProducer> {
    check_options(Role::Producer, options)?;
    let settings = durable_producer_settings("replayproof-tools");
    anyhow::Context::context(
        client_config(brokers, &settings, options).create(),
        "creating the Kafka producer",
    )
}

/// Produces one raw record and waits for the broker's acknowledgement.
pub async fn produce_raw(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
) -> anyhow::Result<()> {
    let mut record = rdkafka::producer::FutureRecord::<[u8], [u8]>::to(topic);
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

    #[test]
    fn offset_safety_options_are_refused_for_the_consumer() {
        for key in [
            "enable.auto.commit",
            "ENABLE.AUTO.COMMIT",
            "enable.auto.offset.store",
            "isolation.level",
            "auto.offset.reset",
        ] {
            let err = check_options(Role::Consumer, &options(&[(key, "true")])).unwrap_err();
            assert!(err.to_string().contains("refused"), "{key}: {err}");
        }
        check_options(
            Role::Consumer,
            &options(&[("security.protocol", "ssl"), ("acks", "1")]),
        )
        .unwrap();
    }

    #[test]
    fn durability_options_are_refused_for_the_producer() {
        for key in ["acks", "request.required.acks", "enable.idempotence"] {
            assert!(check_options(Role::Producer, &options(&[(key, "0")])).is_err());
        }
        check_options(Role::Producer, &options(&[("linger.ms", "10")])).unwrap();
    }
}
