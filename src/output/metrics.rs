//! The relay's metrics: records enqueued (given their partition), produced (acknowledged),
//! confirmed by a read-back, and each output partition's backlog, lag and stop.

use super::store::{self, Backlog};
use crate::db::Db;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

/// The relay's metrics; labels are topics and partitions of the output topics.
#[derive(Clone)]
pub struct OutputMetrics {
    /// Records given their output partition, each once.
    pub enqueued: IntCounterVec,
    /// Records the broker acknowledged.
    pub produced: IntCounterVec,
    /// Records found in their partition by a read-back after an unknown outcome.
    pub confirmed_by_readback: IntCounterVec,
    /// Sends whose outcome was not an acknowledgement.
    pub unknown_outcomes: IntCounterVec,
    /// Records not known to be in the topic, per output partition.
    pub backlog: IntGaugeVec,
    /// How long the oldest of them has waited, per output partition.
    pub lag_seconds: IntGaugeVec,
    /// 1 for an output partition whose relay stopped (a changed partition count, a missing
    /// topic, records gone from the log).
    pub stopped: IntGaugeVec,
    /// The (topic, partition) series the gauges show now.
    shown: Arc<Mutex<BTreeSet<(String, String)>>>,
}

impl OutputMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<Self> {
        let counter = |name: &str, help: &str| {
            IntCounterVec::new(Opts::new(name, help), &["topic"]).and_then(|c| {
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            })
        };
        let gauge = |name: &str, help: &str| {
            IntGaugeVec::new(Opts::new(name, help), &["topic", "partition"]).and_then(|g| {
                registry.register(Box::new(g.clone()))?;
                Ok(g)
            })
        };
        Ok(Self {
            enqueued: counter(
                "replayproof_output_records_enqueued_total",
                "Output records given their partition by the relay.",
            )?,
            produced: counter(
                "replayproof_output_records_produced_total",
                "Output records the broker acknowledged.",
            )?,
            confirmed_by_readback: counter(
                "replayproof_output_records_confirmed_by_readback_total",
                "Output records found in their partition by a read-back after an unknown outcome.",
            )?,
            unknown_outcomes: counter(
                "replayproof_output_unknown_outcomes_total",
                "Output sends whose outcome was unknown (a timeout, a cut connection).",
            )?,
            backlog: gauge(
                "replayproof_output_backlog",
                "Output records not known to be in their topic, per partition.",
            )?,
            lag_seconds: gauge(
                "replayproof_output_lag_seconds",
                "How long the oldest output record not known to be in its topic has waited.",
            )?,
            stopped: gauge(
                "replayproof_output_partition_stopped",
                "1 for an output partition whose relay stopped with an error.",
            )?,
            shown: Arc::default(),
        })
    }

    /// Sets the gauges from the backlogs of `databases` (none: this relay reports nothing, a
    /// relay of another database does); a partition with nothing left drops out. Series are set
    /// in place and only the gone ones removed, so a scrape never finds them missing.
    pub async fn refresh(&self, databases: &[Db]) -> sqlx::Result<()> {
        if databases.is_empty() {
            return Ok(());
        }
        let mut rows: Vec<Backlog> = Vec::new();
        for pool in databases {
            rows.extend(store::backlog(pool).await?);
        }
        let now = chrono::Utc::now();
        // (topic, partition) -> (pending, lag, stopped), summed over the databases.
        let mut values: BTreeMap<(String, String), (i64, i64, bool)> = BTreeMap::new();
        for row in rows {
            let partition = row
                .partition
                .map_or_else(|| "unassigned".to_owned(), |p| p.to_string());
            let lag = row.oldest.map_or(0, |t| (now - t).num_seconds().max(0));
            let value = values.entry((row.topic, partition)).or_default();
            value.0 += row.pending;
            value.1 = value.1.max(lag);
            value.2 |= row.stopped.is_some();
        }
        let mut shown = self.shown.lock().unwrap_or_else(|e| e.into_inner());
        for gone in shown.difference(&values.keys().cloned().collect()) {
            let labels = [gone.0.as_str(), gone.1.as_str()];
            for gauge in [&self.backlog, &self.lag_seconds, &self.stopped] {
                let _ = gauge.remove_label_values(&labels);
            }
        }
        for ((topic, partition), (pending, lag, stopped)) in &values {
            let labels = [topic.as_str(), partition.as_str()];
            self.backlog.with_label_values(&labels).set(*pending);
            self.lag_seconds.with_label_values(&labels).set(*lag);
            self.stopped
                .with_label_values(&labels)
                .set(i64::from(*stopped));
        }
        *shown = values.into_keys().collect();
        Ok(())
    }
}
