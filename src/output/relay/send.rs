//! One batch of a partition: handed to the producer, its outcomes waited for, its
//! transaction ended (with `--kafka-transactions`), and what is known recorded.

use super::{Owned, Relay, Turn};
use crate::output::produce::{self, Handed};
use crate::output::store::{self, Found, Pending, Settled};
use crate::output::{transactions, Confirmation};
use anyhow::Context as _;
use rdkafka::producer::{FutureProducer, Producer as _};
use std::time::Instant;

/// What became of a batch handed to the producer.
#[derive(Default)]
struct Outcomes {
    /// Each acknowledged record's row id and offset.
    acked: Vec<(i64, i64)>,
    /// Records whose outcome is unknown.
    unknown: u64,
    /// Why a record was refused for good, if one was.
    refusal: Option<String>,
    /// The records the broker refused for good, each a delivery's error: known not written.
    refused_by_broker: Vec<(usize, rdkafka::error::KafkaError)>,
}

impl Relay {
    /// Sends `records` in order and records their acknowledgements; an unknown outcome leaves
    /// the partition in doubt, read back a send timeout later. A record the producer or the
    /// broker refuses for good (too large, invalid) stops the partition with the reason: the
    /// records after it wait rather than overtake it for ever.
    pub(super) async fn send(
        &self,
        owned: &mut Owned,
        records: &[Pending],
    ) -> anyhow::Result<Turn> {
        let producer = owned.fenced.clone();
        if let Some(p) = &producer {
            if let Err(e) = p.begin_transaction() {
                owned.fenced = None;
                return Err(e).context("beginning an output transaction");
            }
        }
        crate::stallpoint!("relay::before_produce");
        let at = (owned.lease.topic.as_str(), owned.lease.partition);
        let handed = produce::hand(producer.as_ref().unwrap_or(&self.producer), at, records);
        let mut out = outcomes(at.0, records, handed).await;
        self.name_the_refused(owned, records, &mut out);
        crate::crashpoint!("relay::after_ack");
        let by = match &producer {
            Some(p) => {
                self.end_transaction(owned, p, &mut out).await;
                Confirmation::Transaction
            }
            None => Confirmation::Ack,
        };
        let turn = self.settle(owned, &out, by).await?;
        if let Some(why) = out.refusal {
            self.stop(&owned.lease, &why).await?;
            return Ok(Turn::Gone);
        }
        Ok(turn)
    }

    /// Names the record the broker refused, when it refused one alone; when it refused several
    /// together (one request larger than the topic takes), sends them one a turn next, so that
    /// the one it refuses alone is named and the others are sent.
    fn name_the_refused(&self, owned: &mut Owned, records: &[Pending], out: &mut Outcomes) {
        match out.refused_by_broker.as_slice() {
            [] => {}
            [(i, e)] => {
                let why = produce::refused(&records[*i], e);
                out.refusal.get_or_insert(why);
            }
            [.., (last, e)] if out.refusal.is_none() => {
                let (topic, partition) = (&owned.lease.topic, owned.lease.partition);
                let n = out.refused_by_broker.len();
                tracing::warn!(topic = %topic, partition, refused = n, error = %e,
                    "The broker refused several output records together; sending them one at a \
                     time to find the one it refuses.");
                owned.one_by_one_through = Some(records[*last].id);
            }
            [..] => {}
        }
    }

    /// Ends a batch's transaction: committed when every record was acknowledged, aborted
    /// otherwise (none of its records is then in the topic). An outcome it does not know makes
    /// every record of the batch unknown, and the producer is fenced again before the
    /// partition is read back.
    async fn end_transaction(&self, owned: &mut Owned, p: &FutureProducer, out: &mut Outcomes) {
        let timeout = self.settings.send_timeout;
        let clean = out.unknown == 0 && out.refusal.is_none() && out.refused_by_broker.is_empty();
        let ended = match clean {
            true => transactions::commit(p, timeout).await,
            false => transactions::abort(p, timeout).await.map(|()| false),
        };
        crate::crashpoint!("relay::after_commit");
        match ended {
            Ok(true) => {}
            Ok(false) => {
                *out = Outcomes {
                    refusal: out.refusal.take(),
                    ..Outcomes::default()
                }
            }
            Err(e) => {
                let (topic, partition) = (&owned.lease.topic, owned.lease.partition);
                tracing::warn!(topic = %topic, partition, error = format!("{e:#}"),
                    "An output transaction's outcome is unknown.");
                out.unknown += out.acked.len() as u64;
                out.acked.clear();
                owned.fenced = None;
            }
        }
    }

    /// Records a batch's acknowledgements (confirmed `by` the ack or the transaction's
    /// commit); the partition stays in doubt while some records' outcomes are unknown.
    async fn settle(
        &self,
        owned: &mut Owned,
        out: &Outcomes,
        by: Confirmation,
    ) -> anyhow::Result<Turn> {
        let labels = [owned.lease.topic.as_str()];
        let acked = out.acked.len() as u64;
        self.metrics
            .produced
            .with_label_values(&labels)
            .inc_by(acked);
        let settled = match out.unknown {
            0 => out
                .acked
                .iter()
                .map(|a| a.1 + 1)
                .max()
                .or(owned.lease.readback_from),
            _ => None,
        };
        let (pool, worker) = (&self.pool, &self.settings.worker);
        let found = Found::Acked(&out.acked, by);
        let doubt = settled.map_or(Settled::InDoubt, Settled::At);
        let recorded = store::record(pool, &owned.lease, worker, found, doubt).await?;
        crate::crashpoint!("relay::after_update");
        if recorded.is_none() {
            return Ok(Turn::Gone);
        }
        if out.unknown > 0 {
            self.metrics
                .unknown_outcomes
                .with_label_values(&labels)
                .inc_by(out.unknown);
            owned.readback_after = Some(Instant::now() + self.settings.send_timeout);
        } else {
            owned.lease.in_doubt = false;
            owned.lease.readback_from = settled;
        }
        Ok(Turn::Worked(acked))
    }
}

/// Waits for each handed record's outcome: acknowledged, refused for good, or unknown.
async fn outcomes(topic: &str, records: &[Pending], handed: Vec<Handed>) -> Outcomes {
    let mut out = Outcomes::default();
    for (i, (record, handed)) in records.iter().zip(handed).enumerate() {
        let error = match handed {
            Handed::Queued(delivery) => match delivery.await {
                Ok(Ok(d)) => {
                    out.acked.push((record.id, d.offset));
                    continue;
                }
                Ok(Err((e, _))) => e,
                Err(_) => {
                    out.unknown += 1;
                    continue;
                }
            },
            Handed::Refused(e) => {
                out.refusal = Some(produce::refused(record, &e));
                continue;
            }
            // Never handed to the producer: known not sent.
            Handed::NotSent => continue,
        };
        if produce::refused_for_good(&error) {
            out.refused_by_broker.push((i, error));
        } else {
            tracing::warn!(topic = %topic, record = %record.record_id, error = %error,
                "An output record's send has an unknown outcome.");
            out.unknown += 1;
        }
    }
    out
}
