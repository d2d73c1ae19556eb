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
//!   records gone from the log, or a record the broker refuses stop the partition with the
//!   reason, never a guess.
//! - With `--kafka-transactions` (`output::transactions`) each batch is a Kafka transaction
//!   of the partition's own producer, fenced by every new owner before it reads back.

use super::readback::{self, Unreadable};
use super::settings::{reader_tuning, RelaySettings};
use super::store::{self, Found, Lease, Settled};
use super::{transactions, OutputMetrics};
use crate::db::Db;
use crate::kafka::{client_config, Role};
use crate::telemetry::Health;
use anyhow::Context as _;
use rdkafka::producer::{FutureProducer, Producer as _};
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

mod assign;
mod send;

/// The relay loop's heartbeat, as `/healthz` names it.
const LOOP: &str = "output relay";

/// A partition this relay owns, and when its read-back may start.
struct Owned {
    lease: Lease,
    /// After an unknown outcome of its own: a send timeout later, so that nothing it sent is
    /// still on its way when it reads back.
    readback_after: Option<Instant>,
    /// With `--kafka-transactions`: the partition's own producer, fenced. None until its first
    /// turn and after any outcome it does not know, so that the next turn fences again.
    fenced: Option<FutureProducer>,
    /// After the broker refused several records of one batch together (a batch larger than
    /// the topic takes): up to this row id, records are sent one a turn, so that a record the
    /// broker refuses alone is the one named, and the others are sent.
    one_by_one_through: Option<i64>,
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
    pool: Db,
    producer: FutureProducer,
    /// With `--kafka-transactions`: the configuration each partition's producer is made of.
    transactional: Option<rdkafka::ClientConfig>,
    /// The read-back consumer's configuration.
    reader: rdkafka::ClientConfig,
    metrics: OutputMetrics,
    /// The databases whose backlogs this relay reports as gauges.
    gauges: Vec<Db>,
    /// What was last said of each topic whose records cannot be partitioned: said once, not
    /// every round.
    said: std::sync::Mutex<HashMap<String, String>>,
    health: Health,
}

impl Relay {
    /// Checks the settings and builds the producer.
    pub fn build(
        settings: RelaySettings,
        pool: Db,
        metrics: OutputMetrics,
        health: Health,
    ) -> anyhow::Result<Self> {
        settings.check()?;
        let tuning = settings.tuning();
        let config = client_config(
            Role::Producer,
            &settings.brokers,
            None,
            &tuning,
            &settings.kafka_options,
        )?;
        let producer = config.create().context("creating the relay's producer")?;
        let transactional = settings.transactions.then(|| config.clone());
        let reader = client_config(
            Role::Reader,
            &settings.brokers,
            None,
            &reader_tuning(settings.transactions),
            &settings.kafka_options,
        )?;
        Ok(Self {
            gauges: vec![pool.clone()],
            said: std::sync::Mutex::default(),
            settings,
            pool,
            producer,
            transactional,
            reader,
            metrics,
            health,
        })
    }

    /// Reports the gauges of `databases` (the first shard's relay reports every database's).
    pub fn reporting(mut self, databases: Vec<Db>) -> Self {
        self.gauges = databases;
        self
    }

    /// Relays until `shutdown`, then gives its leases up.
    /// Ends early, with the error, only when the broker refuses `--kafka-transactions` for
    /// good: a setting to change, not a fault to wait out.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        tracing::info!(worker = %self.settings.worker, "Relaying output records.");
        let mut owned: BTreeMap<(String, i32), Owned> = BTreeMap::new();
        let mut last_gauges: Option<Instant> = None;
        let mut ended = Ok(());
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
                Err(e) if e.is::<transactions::Refused>() => {
                    ended = Err(e);
                    break;
                }
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
        ended
    }

    /// One round: partitions the new records, takes the free partitions, checks every owned
    /// partition's topic, and gives each a turn. True when something was sent or confirmed.
    async fn round(&self, owned: &mut BTreeMap<(String, i32), Owned>) -> anyhow::Result<bool> {
        let unassigned = store::unassigned_topics(&self.pool).await?;
        let mut topics = unassigned.clone();
        topics.extend(owned.keys().map(|(t, _)| t.clone()));
        let free = store::unowned(&self.pool).await?;
        topics.extend(free.iter().map(|(t, _)| t.clone()));
        topics.sort();
        topics.dedup();
        let counts = self.partition_counts(&topics).await;
        let assigned = self.assign(&unassigned, &counts).await?;
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
                // Given up too: a lease whose partition is not as this relay holds it (a commit
                // lost with the database) is taken again at once, from what is recorded.
                Ok(Turn::Gone) => {
                    if let Some(gone) = owned.remove(&key) {
                        store::release(&self.pool, &gone.lease, &self.settings.worker).await?;
                    }
                }
                Err(e) if e.is::<transactions::Refused>() => return Err(e),
                Err(e) => {
                    tracing::warn!(topic = %key.0, partition = key.1, error = format!("{e:#}"),
                        "An output partition's turn failed; it is tried again.");
                }
            }
        }
        Ok(worked)
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
                    fenced: None,
                    one_by_one_through: None,
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
                Some(Ok(count)) => assign::changed(o.lease.partition_count, *count),
                Some(Err(why)) if why.contains("does not exist") => why.clone(),
                // The broker could not be asked: nothing is sent this round.
                Some(Err(_)) | None => continue,
            };
            self.stop(&o.lease, &why).await?;
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
            self.fence(owned).await?;
            return self.read_back(owned).await;
        }
        let limit = match owned.one_by_one_through {
            Some(_) => 1,
            None => self.settings.batch_size,
        };
        let records = store::pending(&self.pool, &owned.lease, limit).await?;
        let Some(first) = records.first() else {
            return Ok(Turn::Idle);
        };
        if owned
            .one_by_one_through
            .is_some_and(|through| first.id > through)
        {
            owned.one_by_one_through = None;
        }
        self.fence(owned).await?;
        let Some(from) = self.settled_from(&owned.lease).await? else {
            return Ok(Turn::Gone);
        };
        let (worker, length) = (&self.settings.worker, self.settings.lease);
        if !store::begin_send(&self.pool, &owned.lease, worker, length, from).await? {
            return Ok(Turn::Gone);
        }
        owned.lease.in_doubt = true;
        owned.lease.readback_from = Some(from);
        self.send(owned, &records).await
    }

    /// With `--kafka-transactions`, makes sure the partition has its own producer, fenced:
    /// before its first send and before any read-back, so that nothing an earlier producer of
    /// the partition sent can land afterwards.
    async fn fence(&self, owned: &mut Owned) -> anyhow::Result<()> {
        let Some(config) = &self.transactional else {
            return Ok(());
        };
        if owned.fenced.is_some() {
            return Ok(());
        }
        let lease = &owned.lease;
        let id = transactions::transactional_id(&lease.topic, lease.partition, &lease.token);
        let producer = transactions::fence(config, &id, self.settings.lease / 2).await?;
        owned.fenced = Some(producer);
        Ok(())
    }

    /// Where a read-back of the next send would start: the log's end. Asked before every
    /// batch: a log ending before the offset the partition is known settled at is another
    /// topic of the same name (deleted and created again), whose records are not ours, so the
    /// partition stops (None).
    async fn settled_from(&self, lease: &Lease) -> anyhow::Result<Option<i64>> {
        let end = self.log_end(lease).await?;
        match lease.readback_from {
            Some(from) if end < from => {
                let why = Unreadable::Rewound { from, high: end }.to_string();
                self.stop(lease, &why).await?;
                Ok(None)
            }
            // Nothing in doubt: every record of ours is before the log's end, so a read-back
            // would start there, past whatever other producers wrote meanwhile.
            Some(_) | None => Ok(Some(end)),
        }
    }

    /// Stops the partition of `lease` with why, logged.
    async fn stop(&self, lease: &Lease, why: &str) -> anyhow::Result<()> {
        let (topic, partition) = (&lease.topic, lease.partition);
        tracing::error!(topic = %topic, partition, "Stopping the output partition: {why}");
        store::stop_owned(&self.pool, lease, &self.settings.worker, why).await?;
        Ok(())
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
                self.stop(&lease, &gone.to_string()).await?;
                return Ok(Turn::Gone);
            }
            Err(Unreadable::Kafka(e)) => return Err(e),
        };
        let (pool, worker) = (&self.pool, &self.settings.worker);
        let found = Found::ReadBack(&back.found);
        let doubt = match back.complete {
            true => Settled::At(back.end),
            false => Settled::ReadTo(back.end),
        };
        let Some(marked) = store::record(pool, &lease, worker, found, doubt).await? else {
            return Ok(Turn::Gone);
        };
        tracing::info!(topic = %lease.topic, partition = lease.partition, from, to = back.end,
            confirmed = marked, complete = back.complete, "Read an output partition back.");
        self.metrics
            .confirmed_by_readback
            .with_label_values(&[lease.topic.as_str()])
            .inc_by(marked);
        owned.lease.in_doubt = !back.complete;
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
