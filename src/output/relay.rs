//! The relay: produces the enqueued output records, each once in its topic, with an idempotent
//! producer (`acks=all`) and no Kafka transactions.
//!
//! - A record's partition is fixed before its first send ([`super::partitioner`]) and stored.
//! - One relay owns an output partition at a time (a lease with a fencing epoch), sends its
//!   records in enqueue order, and records each acknowledged offset.
//! - Before a send, the partition is marked in doubt; the mark is cleared with the send's
//!   acknowledgements. A partition found in doubt (its owner died between the ack and the
//!   update, or a send timed out) is first read back from the offset it was known settled at:
//!   every record found there by its record id is marked sent, and only the rest is sent.
//! - A partition count other than the one its records were partitioned over, a missing topic,
//!   or records gone from the log stop the partition with the reason, never a guess.

use super::readback::{self, Unreadable};
use super::store::{self, Found, Lease, Pending};
use super::OutputMetrics;
use crate::kafka::{client_config, Role};
use crate::telemetry::Health;
use anyhow::Context as _;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer as _};
use sqlx::PgPool;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a relay's lease on an output partition lasts (`--relay-lease`).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// How long a send may wait for its acknowledgement (`--relay-send-timeout`,
/// librdkafka's `message.timeout.ms`).
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// Records of one partition sent at once (`--relay-batch-size`).
pub const DEFAULT_BATCH: i64 = 2_000;
/// The relay loop's heartbeat, as `/healthz` names it.
const LOOP: &str = "output relay";

/// How a relay leases and sends.
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Names this relay in the partitions' leases.
    pub worker: String,
    pub brokers: String,
    /// librdkafka properties, as `--kafka-option` gives them.
    pub kafka_options: Vec<(String, String)>,
    /// How long a lease keeps other relays off a partition: more than two send timeouts, so
    /// every send of an owner ends, acknowledged or expired, before its lease does.
    pub lease: Duration,
    pub send_timeout: Duration,
    pub batch_size: i64,
    /// The pause when nothing was sent.
    pub poll_interval: Duration,
}

impl RelaySettings {
    /// The defaults, for `worker` on `brokers`.
    pub fn new(worker: &str, brokers: &str) -> Self {
        Self {
            worker: worker.into(),
            brokers: brokers.into(),
            kafka_options: Vec::new(),
            lease: DEFAULT_LEASE,
            send_timeout: DEFAULT_SEND_TIMEOUT,
            batch_size: DEFAULT_BATCH,
            poll_interval: Duration::from_millis(200),
        }
    }
}

/// A partition this relay owns, and when its read-back may start.
struct Owned {
    lease: Lease,
    /// After an unknown outcome of its own: a send timeout later, so that nothing it sent is
    /// still on its way when it reads back.
    readback_after: Option<Instant>,
}

/// What one turn of a partition came to.
enum Turn {
    /// Sent or confirmed this many records; the lease is kept.
    Worked(u64),
    /// Nothing pending: the lease is given up.
    Idle,
    /// Another relay took the lease over, or the partition stopped.
    Gone,
}

/// The relay of one database's output records.
pub struct Relay {
    settings: RelaySettings,
    pool: PgPool,
    producer: FutureProducer,
    /// The read-back consumer's configuration.
    reader: rdkafka::ClientConfig,
    metrics: OutputMetrics,
    /// The databases whose backlogs this relay reports as gauges.
    gauges: Vec<PgPool>,
    health: Health,
}

impl Relay {
    /// Checks the settings and builds the producer.
    pub fn build(
        settings: RelaySettings,
        pool: PgPool,
        metrics: OutputMetrics,
        health: Health,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            settings.lease > settings.send_timeout * 2,
            "the relay lease ({:?}) must be longer than two send timeouts ({:?} each): every \
             send of a relay must end before another may take its partition over",
            settings.lease,
            settings.send_timeout
        );
        refuse_timeouts(&settings.kafka_options)?;
        let tuning = tuning(&settings);
        let config = client_config(
            Role::Producer,
            &settings.brokers,
            None,
            &tuning,
            &settings.kafka_options,
        )?;
        let producer = config.create().context("creating the relay's producer")?;
        let reader = client_config(
            Role::Reader,
            &settings.brokers,
            None,
            &reader_tuning(),
            &settings.kafka_options,
        )?;
        Ok(Self {
            gauges: vec![pool.clone()],
            settings,
            pool,
            producer,
            reader,
            metrics,
            health,
        })
    }

    /// Reports the gauges of `databases` (the first shard's relay reports every database's).
    pub fn reporting(mut self, databases: Vec<PgPool>) -> Self {
        self.gauges = databases;
        self
    }

    /// Relays until `shutdown`, then gives its leases up.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        tracing::info!(worker = %self.settings.worker, "Relaying output records.");
        let mut owned: BTreeMap<(String, i32), Owned> = BTreeMap::new();
        let mut last_gauges: Option<Instant> = None;
        while !shutdown.is_cancelled() {
            let stuck_after = self.settings.lease + self.settings.poll_interval * 4;
            self.health.beat(LOOP, stuck_after);
            if last_gauges.is_none_or(|t| t.elapsed() >= Duration::from_secs(2)) {
                if let Err(e) = self.metrics.refresh(&self.gauges).await {
                    tracing::warn!(error = %e, "Could not read the output backlog.");
                }
                last_gauges = Some(Instant::now());
            }
            let worked = match self.round(&mut owned).await {
                Ok(worked) => worked,
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "An output relay round failed.");
                    false
                }
            };
            if !worked {
                tokio::select! {
                    () = tokio::time::sleep(self.settings.poll_interval) => {}
                    () = shutdown.cancelled() => {}
                }
            }
        }
        for owned in owned.values() {
            store::release(&self.pool, &owned.lease, &self.settings.worker).await?;
        }
        Ok(())
    }

    /// One round: partitions the new records, takes the free partitions, checks every owned
    /// partition's topic, and gives each a turn. True when something was sent or confirmed.
    async fn round(&self, owned: &mut BTreeMap<(String, i32), Owned>) -> anyhow::Result<bool> {
        let mut topics: Vec<String> = store::unassigned_topics(&self.pool).await?;
        topics.extend(owned.keys().map(|(t, _)| t.clone()));
        let free = store::unowned(&self.pool).await?;
        topics.extend(free.iter().map(|(t, _)| t.clone()));
        topics.sort();
        topics.dedup();
        let counts = self.partition_counts(&topics).await;
        let assigned = self.assign(&counts).await?;
        self.take(owned, free).await?;
        self.check_counts(owned, &counts).await?;
        let turns = futures_util::future::join_all(owned.values_mut().map(|o| self.turn(o))).await;
        let mut worked = assigned > 0;
        let keys: Vec<(String, i32)> = owned.keys().cloned().collect();
        for (key, turn) in keys.into_iter().zip(turns) {
            match turn {
                Ok(Turn::Worked(n)) => worked |= n > 0,
                Ok(Turn::Idle) => {
                    if let Some(idle) = owned.remove(&key) {
                        store::release(&self.pool, &idle.lease, &self.settings.worker).await?;
                    }
                }
                Ok(Turn::Gone) => drop(owned.remove(&key)),
                Err(e) => {
                    tracing::warn!(topic = %key.0, partition = key.1, error = format!("{e:#}"),
                        "An output partition's turn failed; it is tried again.");
                }
            }
        }
        Ok(worked)
    }

    /// Each topic's partition count from the broker's metadata, or why there is none.
    async fn partition_counts(&self, topics: &[String]) -> HashMap<String, Result<i32, String>> {
        let mut counts = HashMap::new();
        for topic in topics {
            let producer = self.producer.clone();
            let name = topic.clone();
            let count = tokio::task::spawn_blocking(move || {
                let md = producer
                    .client()
                    .fetch_metadata(Some(&name), Duration::from_secs(10))
                    .map_err(|e| format!("reading the metadata of {name}: {e}"))?;
                match md.topics().first() {
                    Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
                        Ok(i32::try_from(t.partitions().len()).unwrap_or(i32::MAX))
                    }
                    _ => Err(format!("the output topic {name} does not exist")),
                }
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
            counts.insert(topic.clone(), count);
        }
        counts
    }

    /// Gives the new records of each topic their partition; returns how many it partitioned.
    async fn assign(&self, counts: &HashMap<String, Result<i32, String>>) -> anyhow::Result<u64> {
        let mut assigned = 0;
        for topic in store::unassigned_topics(&self.pool).await? {
            let count = match counts.get(&topic) {
                Some(Ok(count)) => *count,
                Some(Err(why)) => {
                    tracing::error!(topic = %topic, "{why}: its records wait, unpartitioned.");
                    continue;
                }
                None => continue,
            };
            if let Some(known) = store::known_count(&self.pool, &topic).await? {
                if known != count {
                    let why = changed(known, count);
                    tracing::error!(topic = %topic, "{why}");
                    store::stop(&self.pool, &topic, None, &why).await?;
                    continue;
                }
            }
            let n = store::assign(&self.pool, &topic, count, self.settings.batch_size).await?;
            self.metrics
                .enqueued
                .with_label_values(&[topic.as_str()])
                .inc_by(n);
            assigned += n;
        }
        Ok(assigned)
    }

    /// Takes the lease of each free partition it can.
    async fn take(
        &self,
        owned: &mut BTreeMap<(String, i32), Owned>,
        free: Vec<(String, i32)>,
    ) -> anyhow::Result<()> {
        for (topic, partition) in free {
            if owned.contains_key(&(topic.clone(), partition)) {
                continue;
            }
            let at = (topic.as_str(), partition);
            let lease = self.settings.lease;
            if let Some(lease) =
                store::acquire(&self.pool, at, &self.settings.worker, lease).await?
            {
                tracing::info!(topic = %topic, partition, epoch = lease.epoch, in_doubt = lease.in_doubt,
                    "Took an output partition over.");
                let owned_now = Owned {
                    lease,
                    readback_after: None,
                };
                owned.insert((topic, partition), owned_now);
            }
        }
        Ok(())
    }

    /// Stops each owned partition whose topic is gone or has another partition count.
    async fn check_counts(
        &self,
        owned: &mut BTreeMap<(String, i32), Owned>,
        counts: &HashMap<String, Result<i32, String>>,
    ) -> anyhow::Result<()> {
        let mut stopped = Vec::new();
        for (key, o) in owned.iter() {
            let why = match counts.get(&key.0) {
                Some(Ok(count)) if *count == o.lease.partition_count => continue,
                Some(Ok(count)) => changed(o.lease.partition_count, *count),
                Some(Err(why)) if why.contains("does not exist") => why.clone(),
                // The broker could not be asked: nothing is sent this round.
                Some(Err(_)) | None => continue,
            };
            tracing::error!(topic = %key.0, partition = key.1, "Stopping the output partition: {why}");
            store::stop(&self.pool, &key.0, Some(key.1), &why).await?;
            stopped.push(key.clone());
        }
        for key in stopped {
            owned.remove(&key);
        }
        Ok(())
    }

    /// One turn of an owned partition: its read-back when in doubt, else one batch.
    async fn turn(&self, owned: &mut Owned) -> anyhow::Result<Turn> {
        if owned.lease.in_doubt {
            if owned.readback_after.is_some_and(|t| Instant::now() < t) {
                return Ok(Turn::Worked(0));
            }
            return self.read_back(owned).await;
        }
        let records = store::pending(&self.pool, &owned.lease, self.settings.batch_size).await?;
        if records.is_empty() {
            return Ok(Turn::Idle);
        }
        let from = match owned.lease.readback_from {
            Some(from) => from,
            None => self.log_end(&owned.lease).await?,
        };
        let (worker, length) = (&self.settings.worker, self.settings.lease);
        if !store::begin_send(&self.pool, &owned.lease, worker, length, from).await? {
            return Ok(Turn::Gone);
        }
        owned.lease.in_doubt = true;
        owned.lease.readback_from = Some(from);
        self.send(owned, &records).await
    }

    /// Sends `records` in order and records their acknowledgements; an unknown outcome leaves
    /// the partition in doubt, read back a send timeout later.
    async fn send(&self, owned: &mut Owned, records: &[Pending]) -> anyhow::Result<Turn> {
        let topic = owned.lease.topic.clone();
        let deliveries = self.produce(&topic, owned.lease.partition, records);
        let mut acked: Vec<(i64, i64)> = Vec::with_capacity(records.len());
        let mut unknown = 0u64;
        for (record, delivery) in records.iter().zip(deliveries) {
            match delivery {
                Some(delivery) => match delivery.await {
                    Ok(Ok(d)) => acked.push((record.id, d.offset)),
                    Ok(Err((e, _))) => {
                        tracing::warn!(topic = %topic, record = %record.record_id, error = %e,
                            "An output record's send has an unknown outcome.");
                        unknown += 1;
                    }
                    Err(_) => unknown += 1,
                },
                // Not handed to the producer (its queue is full): not sent.
                None => unknown += 1,
            }
        }
        crate::crashpoint!("relay::after_ack");
        let labels = [topic.as_str()];
        self.metrics
            .produced
            .with_label_values(&labels)
            .inc_by(acked.len() as u64);
        let settled = match unknown {
            0 => acked.iter().map(|a| a.1 + 1).max(),
            _ => None,
        };
        let (pool, worker) = (&self.pool, &self.settings.worker);
        let recorded =
            store::record(pool, &owned.lease, worker, Found::Acked(&acked), settled).await?;
        crate::crashpoint!("relay::after_update");
        if recorded.is_none() {
            return Ok(Turn::Gone);
        }
        if unknown > 0 {
            self.metrics
                .unknown_outcomes
                .with_label_values(&labels)
                .inc_by(unknown);
            owned.readback_after = Some(Instant::now() + self.settings.send_timeout);
        } else {
            owned.lease.in_doubt = false;
            owned.lease.readback_from = settled;
        }
        Ok(Turn::Worked(acked.len() as u64))
    }

    /// Hands `records` to the producer, in order; None for each it would not take.
    fn produce(
        &self,
        topic: &str,
        partition: i32,
        records: &[Pending],
    ) -> Vec<Option<DeliveryFuture>> {
        let mut refused = false;
        records
            .iter()
            .map(|r| {
                if refused {
                    return None;
                }
                let mut headers = OwnedHeaders::new_with_capacity(r.headers.0.len() + 1);
                for (name, value) in &r.headers.0 {
                    headers = headers.insert(Header {
                        key: name,
                        value: Some(value.as_bytes()),
                    });
                }
                headers = headers.insert(Header {
                    key: super::RECORD_ID_HEADER,
                    value: Some(r.record_id.as_bytes()),
                });
                let mut record = FutureRecord::<[u8], [u8]>::to(topic)
                    .partition(partition)
                    .headers(headers);
                if let Some(key) = &r.record_key {
                    record = record.key(key.as_slice());
                }
                if let Some(value) = &r.value {
                    record = record.payload(value.as_slice());
                }
                let sent = self.producer.send_result(record).ok();
                refused = sent.is_none();
                sent
            })
            .collect()
    }

    /// Reads an in-doubt partition back and marks what it finds sent.
    async fn read_back(&self, owned: &mut Owned) -> anyhow::Result<Turn> {
        let lease = owned.lease.clone();
        let from = lease.readback_from.unwrap_or(0);
        let (reader, limit) = (self.reader.clone(), self.settings.lease / 2);
        let at = (lease.topic.clone(), lease.partition);
        let back = tokio::task::spawn_blocking(move || {
            readback::read_back(&reader, (&at.0, at.1), from, limit)
        })
        .await?;
        let back = match back {
            Ok(back) => back,
            Err(gone @ (Unreadable::Truncated { .. } | Unreadable::Rewound { .. })) => {
                let why = gone.to_string();
                tracing::error!(topic = %lease.topic, partition = lease.partition, "Stopping the output partition: {why}");
                store::stop(&self.pool, &lease.topic, Some(lease.partition), &why).await?;
                return Ok(Turn::Gone);
            }
            Err(Unreadable::Kafka(e)) => return Err(e),
        };
        let (pool, worker) = (&self.pool, &self.settings.worker);
        let found = Found::ReadBack(&back.found);
        let Some(marked) = store::record(pool, &lease, worker, found, Some(back.end)).await? else {
            return Ok(Turn::Gone);
        };
        tracing::info!(topic = %lease.topic, partition = lease.partition, from, to = back.end,
            confirmed = marked, "Read an output partition back.");
        self.metrics
            .confirmed_by_readback
            .with_label_values(&[lease.topic.as_str()])
            .inc_by(marked);
        owned.lease.in_doubt = false;
        owned.lease.readback_from = Some(back.end);
        owned.readback_after = None;
        Ok(Turn::Worked(marked.max(1)))
    }

    /// The partition's log end: where a read-back of its first send starts.
    async fn log_end(&self, lease: &Lease) -> anyhow::Result<i64> {
        let producer = self.producer.clone();
        let (topic, partition) = (lease.topic.clone(), lease.partition);
        let (_, high) = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_watermarks(&topic, partition, Duration::from_secs(10))
        })
        .await?
        .context("reading the output partition's offsets")?;
        Ok(high)
    }
}

/// Why a topic's partition count is not the one its records were partitioned over.
fn changed(known: i32, now: i32) -> String {
    format!(
        "the output topic's partition count changed from {known} to {now}: records keyed to a \
         partition of {known} would land elsewhere, so the relay stops rather than guess \
         (docs/kafka-output.md, \"When the relay stops\")"
    )
}

/// The relay producer's defaults besides the guarded `acks=all` and idempotence.
fn tuning(settings: &RelaySettings) -> Vec<(&'static str, String)> {
    let mut tuning = crate::kafka::producer_tuning("replayproof-relay");
    tuning.push((
        "message.timeout.ms",
        settings.send_timeout.as_millis().to_string(),
    ));
    tuning.push(("allow.auto.create.topics", "false".into()));
    tuning.push(("linger.ms", "5".into()));
    tuning
}

/// The read-back consumer's settings: a group librdkafka needs to assign partitions, never
/// joined and never committed to.
fn reader_tuning() -> Vec<(&'static str, String)> {
    vec![
        ("client.id", "replayproof-relay-readback".into()),
        ("group.id", "replayproof-relay-readback".into()),
        ("enable.auto.commit", "false".into()),
        ("enable.auto.offset.store", "false".into()),
    ]
}

/// Refuses options that set the send timeout, which the lease is checked against.
fn refuse_timeouts(options: &[(String, String)]) -> anyhow::Result<()> {
    for (key, _) in options {
        let key = key.trim().trim_start_matches("topic.");
        if matches!(key, "message.timeout.ms" | "delivery.timeout.ms") {
            anyhow::bail!(
                "--kafka-option {key} is refused for the relay: its lease is checked against the \
                 send timeout; give --relay-send-timeout instead"
            );
        }
    }
    Ok(())
}
