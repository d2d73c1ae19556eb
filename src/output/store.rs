//! The output tables: `output_records` (what to produce, and what is known of each) and
//! `output_partitions` (which relay owns a partition, under what epoch, and where a read-back
//! starts). Every write of a partition's owner presents its epoch: a relay whose lease was
//! taken over changes nothing.

use super::{Confirmation, OutputRecord};
use crate::db::Db;
use crate::envelope::Event;
use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use std::time::Duration;

/// Inserts records in the caller's transaction, in the order given; a record already
/// enqueued (the same event and name) is kept as it is.
pub(super) async fn insert(
    conn: &mut PgConnection,
    records: &[(&Event, &OutputRecord)],
) -> sqlx::Result<()> {
    if records.is_empty() {
        return Ok(());
    }
    let routes: Vec<&str> = records.iter().map(|(e, _)| e.route_key()).collect();
    let events: Vec<&str> = records.iter().map(|(e, _)| e.key.as_str()).collect();
    let names: Vec<&str> = records.iter().map(|(_, r)| r.name.as_str()).collect();
    let ids: Vec<String> = records
        .iter()
        .map(|(e, r)| super::record_id(e.key.as_str(), &r.name))
        .collect();
    let topics: Vec<&str> = records.iter().map(|(_, r)| r.topic.as_str()).collect();
    let keys: Vec<Option<&[u8]>> = records.iter().map(|(_, r)| r.key.as_deref()).collect();
    let values: Vec<Option<&[u8]>> = records.iter().map(|(_, r)| r.value.as_deref()).collect();
    let headers: Vec<serde_json::Value> = records
        .iter()
        .map(|(_, r)| serde_json::json!(r.headers))
        .collect();
    sqlx::query(
        "INSERT INTO output_records
             (route_key, event_key, name, record_id, topic, record_key, value, headers)
         SELECT rk, ek, nm, ri, tp, k, v, h
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                     $6::bytea[], $7::bytea[], $8::jsonb[]) WITH ORDINALITY
              AS u(rk, ek, nm, ri, tp, k, v, h, n)
         ORDER BY n
         ON CONFLICT (route_key, event_key, name) DO NOTHING",
    )
    .bind(&routes)
    .bind(&events)
    .bind(&names)
    .bind(&ids)
    .bind(&topics)
    .bind(&keys)
    .bind(&values)
    .bind(&headers)
    .execute(conn)
    .await?;
    Ok(())
}

/// The topics with records not yet given a partition: one probe of the unassigned index per
/// topic (a skip scan), however many records wait.
pub async fn unassigned_topics(pool: &Db) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "WITH RECURSIVE t(topic) AS (
             (SELECT topic FROM output_records WHERE kafka_partition IS NULL
              ORDER BY topic LIMIT 1)
             UNION ALL
             SELECT (SELECT r.topic FROM output_records r
                     WHERE r.kafka_partition IS NULL AND r.topic > t.topic
                     ORDER BY r.topic LIMIT 1)
             FROM t WHERE t.topic IS NOT NULL)
         SELECT topic FROM t WHERE topic IS NOT NULL",
    )
    .fetch_all(pool)
    .await
}

/// The partition count the topic's records were partitioned over, if any were.
pub async fn known_count(pool: &Db, topic: &str) -> sqlx::Result<Option<i32>> {
    sqlx::query_scalar("SELECT max(partition_count) FROM output_partitions WHERE topic = $1")
        .bind(topic)
        .fetch_one(pool)
        .await
}

/// Gives up to `limit` of `topic`'s unpartitioned records, oldest first, their partition over
/// `count` partitions (murmur2 of the key, else of the record id), and makes sure the topic's
/// partitions have their rows. Returns how many it partitioned. One relay at a time partitions
/// a topic's records (a transaction lock on the topic), so the records given a partition are
/// always the oldest: a record is never sent before an older one of its partition.
pub async fn assign(pool: &Db, topic: &str, count: i32, limit: i64) -> sqlx::Result<u64> {
    let mut tx = pool.begin().await?;
    // Committed without waiting for the WAL flush: if this commit were lost, the records would
    // be partitioned again over the same count, and nothing is sent before a later commit that
    // flushes it (begin_send's, synchronous).
    sqlx::query(
        "SELECT pg_advisory_xact_lock(hashtextextended('replayproof-output:' || $1, 0)),
                set_config('synchronous_commit', 'off', true)",
    )
    .bind(topic)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO output_partitions (topic, kafka_partition, partition_count)
         SELECT $1, p, $2 FROM generate_series(0, $2 - 1) AS p
         ON CONFLICT DO NOTHING",
    )
    .bind(topic)
    .bind(count)
    .execute(&mut *tx)
    .await?;
    let rows: Vec<(i64, Option<Vec<u8>>, String)> = sqlx::query_as(
        "SELECT id, record_key, record_id FROM output_records
         WHERE topic = $1 AND kafka_partition IS NULL
         ORDER BY id LIMIT $2",
    )
    .bind(topic)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    let partitions: Vec<i32> = rows
        .iter()
        .map(|(_, key, id)| {
            let key = key.as_deref().unwrap_or(id.as_bytes());
            super::partitioner::partition_of(key, count)
        })
        .collect();
    let done = sqlx::query(
        "UPDATE output_records r SET kafka_partition = u.p, partition_count = $3
         FROM unnest($1::bigint[], $2::int[]) AS u(id, p)
         WHERE r.id = u.id AND r.topic = $4 AND r.id = ANY($1) AND r.kafka_partition IS NULL",
    )
    // Planned with its arrays, as `record` is.
    .persistent(false)
    .bind(&ids)
    .bind(&partitions)
    .bind(count)
    .bind(topic)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    tx.commit().await?;
    Ok(done)
}

/// Stops every partition of `topic` (`partition` None) or one of them, with why.
pub async fn stop(pool: &Db, topic: &str, partition: Option<i32>, why: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE output_partitions SET stopped = $3, stopped_at = now(), owner = NULL,
                lease_until = NULL
         WHERE topic = $1 AND ($2::int IS NULL OR kafka_partition = $2) AND stopped IS NULL",
    )
    .bind(topic)
    .bind(partition)
    .bind(why)
    .execute(pool)
    .await?;
    Ok(())
}

/// Stops the partition of `lease`, if `owner` still holds it under its epoch: a relay whose
/// lease was taken over stops nothing.
pub async fn stop_owned(pool: &Db, lease: &Lease, owner: &str, why: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE output_partitions SET stopped = $5, stopped_at = now(), owner = NULL,
                lease_until = NULL
         WHERE topic = $1 AND kafka_partition = $2 AND owner = $3 AND epoch = $4
           AND stopped IS NULL",
    )
    .bind(&lease.topic)
    .bind(lease.partition)
    .bind(owner)
    .bind(lease.epoch)
    .bind(why)
    .execute(pool)
    .await?;
    Ok(())
}

/// A partition owned by one relay under one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub topic: String,
    pub partition: i32,
    pub epoch: i64,
    /// The partition count its records were partitioned over.
    pub partition_count: i32,
    /// A send of an earlier owner (or of this one) may have an unknown outcome.
    pub in_doubt: bool,
    /// Where a read-back starts; None before the partition's first send.
    pub readback_from: Option<i64>,
    /// The partition row's own token: with `--kafka-transactions`, part of its producer's
    /// transactional id, so two databases relaying to one topic never fence each other.
    pub token: String,
}

/// The partitions with pending records and no live owner: candidates for a lease.
pub async fn unowned(pool: &Db) -> sqlx::Result<Vec<(String, i32)>> {
    sqlx::query_as(
        "SELECT p.topic, p.kafka_partition FROM output_partitions p
         WHERE p.stopped IS NULL AND (p.owner IS NULL OR p.lease_until < now())
           AND EXISTS (SELECT 1 FROM output_records r
                       WHERE r.topic = p.topic AND r.kafka_partition = p.kafka_partition
                         AND r.state = 'pending')
         ORDER BY p.topic, p.kafka_partition",
    )
    .fetch_all(pool)
    .await
}

/// Takes the partition's lease if it is free or expired, under a new epoch.
pub async fn acquire(
    pool: &Db,
    (topic, partition): (&str, i32),
    owner: &str,
    lease: Duration,
) -> sqlx::Result<Option<Lease>> {
    let row: Option<(i64, i32, bool, Option<i64>, String)> = sqlx::query_as(
        "UPDATE output_partitions
         SET owner = $3, epoch = epoch + 1, lease_until = now() + $4 * interval '1 millisecond'
         WHERE topic = $1 AND kafka_partition = $2 AND stopped IS NULL
           AND (owner IS NULL OR lease_until < now())
         RETURNING epoch, partition_count, in_doubt, readback_from, producer_token",
    )
    .bind(topic)
    .bind(partition)
    .bind(owner)
    .bind(millis(lease))
    .fetch_optional(pool)
    .await?;
    Ok(row.map(
        |(epoch, partition_count, in_doubt, readback_from, token)| Lease {
            topic: topic.to_owned(),
            partition,
            epoch,
            partition_count,
            in_doubt,
            readback_from,
            token,
        },
    ))
}

/// Renews the lease for one more send and marks the partition in doubt until the send's
/// outcome is recorded; `from` is where its read-back would start. False when the lease was
/// taken over, or the partition is not in the state `lease` holds.
pub async fn begin_send(
    pool: &Db,
    lease: &Lease,
    owner: &str,
    length: Duration,
    from: i64,
) -> sqlx::Result<bool> {
    // Only from the state the relay holds (nothing in doubt, the read-back start it knows): a
    // commit of `record` lost with the database (it does not wait for the WAL flush) leaves
    // another state here, and the relay then takes the partition over again from what is.
    let renewed = sqlx::query(
        "UPDATE output_partitions
         SET in_doubt = true, readback_from = $5,
             lease_until = now() + $6 * interval '1 millisecond'
         WHERE topic = $1 AND kafka_partition = $2 AND owner = $3 AND epoch = $4
           AND stopped IS NULL AND NOT in_doubt AND readback_from IS NOT DISTINCT FROM $7",
    )
    .bind(&lease.topic)
    .bind(lease.partition)
    .bind(owner)
    .bind(lease.epoch)
    .bind(from)
    .bind(millis(length))
    .bind(lease.readback_from)
    .execute(pool)
    .await?;
    Ok(renewed.rows_affected() == 1)
}

/// Gives the lease up; a partition in doubt stays in doubt for its next owner.
pub async fn release(pool: &Db, lease: &Lease, owner: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE output_partitions SET owner = NULL, lease_until = NULL
         WHERE topic = $1 AND kafka_partition = $2 AND owner = $3 AND epoch = $4",
    )
    .bind(&lease.topic)
    .bind(lease.partition)
    .bind(owner)
    .bind(lease.epoch)
    .execute(pool)
    .await?;
    Ok(())
}

/// A record waiting to be produced.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Pending {
    pub id: i64,
    pub record_id: String,
    pub record_key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: sqlx::types::Json<Vec<(String, String)>>,
}

/// The partition's pending records, in enqueue order.
pub async fn pending(pool: &Db, lease: &Lease, limit: i64) -> sqlx::Result<Vec<Pending>> {
    sqlx::query_as(
        "SELECT id, record_id, record_key, value, headers FROM output_records
         WHERE topic = $1 AND kafka_partition = $2 AND state = 'pending'
         ORDER BY id LIMIT $3",
    )
    .bind(&lease.topic)
    .bind(lease.partition)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// How records were found to be in the topic: by row id (acknowledged sends, or sends of a
/// committed transaction) or by record id (found by a read-back).
pub enum Found<'a> {
    /// Each acknowledged record's row id and offset, and what confirmed it.
    Acked(&'a [(i64, i64)], Confirmation),
    /// Each record id the read-back found, with its offset.
    ReadBack(&'a [(String, i64)]),
}

/// What an update knows of the partition's doubt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// A send's outcome is unknown: the partition stays in doubt, its read-back start as it is.
    InDoubt,
    /// Still in doubt, but read back up to this offset: the read-back goes on from here.
    ReadTo(i64),
    /// Nothing in doubt: every record before this offset is known; a read-back starts here.
    At(i64),
}

impl Settled {
    /// The new read-back start, and whether the partition stays in doubt with it.
    fn columns(self) -> (Option<i64>, bool) {
        match self {
            Self::InDoubt => (None, true),
            Self::ReadTo(at) => (Some(at), true),
            Self::At(at) => (Some(at), false),
        }
    }
}

/// Records what is known under the owner's epoch: the records found, and what is known of
/// the partition's doubt (`settled`). Returns the records it marked sent, or None when the
/// lease was taken over or the partition is not in the state `lease` holds (nothing changed).
///
/// Committed without waiting for the WAL flush: were this commit lost, the partition would
/// still be in doubt (begin_send's synchronous commit), so its next owner reads it back and
/// finds these records; and the next begin_send's commit flushes this one.
pub async fn record(
    pool: &Db,
    lease: &Lease,
    owner: &str,
    found: Found<'_>,
    settled: Settled,
) -> sqlx::Result<Option<u64>> {
    let (sql, confirmation) = match found {
        Found::Acked(_, by) => (record_sql("bigint", "id"), by),
        Found::ReadBack(_) => (record_sql("text", "record_id"), Confirmation::ReadBack),
    };
    let query = sqlx::query_as(&sql)
        // Planned for each call with its arrays (never a generic plan): a generic plan
        // guesses ten elements and joins them by a nested loop, quadratic in the batch.
        .persistent(false)
        .bind(&lease.topic)
        .bind(lease.partition)
        .bind(owner)
        .bind(lease.epoch);
    let query = match found {
        Found::Acked(rows, _) => query
            .bind(rows.iter().map(|r| r.0).collect::<Vec<i64>>())
            .bind(rows.iter().map(|r| r.1).collect::<Vec<i64>>()),
        Found::ReadBack(rows) => query
            .bind(rows.iter().map(|r| r.0.as_str()).collect::<Vec<&str>>())
            .bind(rows.iter().map(|r| r.1).collect::<Vec<i64>>()),
    };
    let (readback_from, in_doubt) = settled.columns();
    let query = query
        .bind(readback_from)
        .bind(confirmation.as_str())
        .bind(in_doubt)
        .bind(lease.readback_from);
    let (fenced, marked): (i64, i64) = match lost_commit() {
        // A commit lost with the database, as a crash before the WAL flush loses it.
        true => {
            let mut tx = pool.begin().await?;
            let counts = query.fetch_one(&mut *tx).await?;
            tx.rollback().await?;
            counts
        }
        false => query.fetch_one(pool).await?,
    };
    Ok((fenced == 1).then_some(u64::try_from(marked).unwrap_or(0)))
}

/// `record`'s statement, its found records keyed by `column` in an array of `by`. `= ANY`
/// makes each row id an index condition of the partition's pending index: a join alone may
/// scan every pending row per id. Record ids (a read-back's, rare) are matched among the
/// partition's pending records.
fn record_sql(by: &str, column: &str) -> String {
    format!(
        "WITH fence AS (
             UPDATE output_partitions
             SET in_doubt = CASE WHEN $7::bigint IS NULL THEN in_doubt ELSE $9 END,
                 readback_from = coalesce($7, readback_from), last_sent_at = now()
             WHERE topic = $1 AND kafka_partition = $2 AND owner = $3 AND epoch = $4
               AND stopped IS NULL AND in_doubt AND readback_from IS NOT DISTINCT FROM $10
               AND set_config('synchronous_commit', 'off', true) = 'off'
             RETURNING 1),
         marked AS (
             UPDATE output_records r
             SET state = 'sent', kafka_offset = u.o, confirmed_by = $8, sent_at = now()
             FROM unnest($5::{by}[], $6::bigint[]) AS u(k, o)
             WHERE r.{column} = u.k AND r.{column} = ANY($5::{by}[])
               AND r.topic = $1 AND r.kafka_partition = $2
               AND r.state = 'pending' AND EXISTS (SELECT 1 FROM fence)
             RETURNING 1)
         SELECT (SELECT count(*) FROM fence), (SELECT count(*) FROM marked)"
    )
}

/// Warns when output records wait in `databases` and no relay runs (`dispatch` without
/// `--brokers`): nothing else would say so, since the relays report the output's gauges.
pub async fn warn_unrelayed(databases: &[Db]) {
    for pool in databases {
        let waiting: sqlx::Result<bool> = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM output_records WHERE state = 'pending')",
        )
        .fetch_one(pool)
        .await;
        if let Ok(true) = waiting {
            tracing::warn!(
                "Output records wait to be produced, and this dispatch relays none: give it \
                 --brokers (docs/kafka-output.md)."
            );
            return;
        }
    }
}

/// Whether the `relay::lose_record` failpoint asks `record` to lose its commit.
fn lost_commit() -> bool {
    #[cfg(feature = "failpoints")]
    {
        fail::fail_point!("relay::lose_record", |_| true);
    }
    false
}

/// One output partition's backlog, for `status`, the console and the gauges.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Backlog {
    pub topic: String,
    /// None for records not yet given a partition.
    pub partition: Option<i32>,
    /// Records not known to be in the topic.
    pub pending: i64,
    /// When the oldest of them was enqueued.
    pub oldest: Option<DateTime<Utc>>,
    /// The relay that owns the partition, while its lease lasts.
    pub owner: Option<String>,
    /// Why the partition's relay stopped, if it did.
    pub stopped: Option<String>,
    /// Whether a send's outcome is unknown: the next owner reads the partition back first.
    pub in_doubt: bool,
}

/// Every output partition with pending records or a stop, and the unpartitioned records.
pub async fn backlog(pool: &Db) -> sqlx::Result<Vec<Backlog>> {
    sqlx::query_as(
        "WITH waiting AS (
             SELECT topic, kafka_partition, count(*) AS pending, min(enqueued_at) AS oldest
             FROM output_records WHERE state = 'pending' GROUP BY 1, 2)
         SELECT coalesce(w.topic, p.topic) AS topic,
                coalesce(w.kafka_partition, p.kafka_partition) AS partition,
                coalesce(w.pending, 0) AS pending, w.oldest,
                CASE WHEN p.lease_until > now() THEN p.owner END AS owner,
                p.stopped, coalesce(p.in_doubt, false) AS in_doubt
         FROM waiting w
         FULL JOIN output_partitions p
           ON p.topic = w.topic AND p.kafka_partition = w.kafka_partition
         WHERE w.pending IS NOT NULL OR p.stopped IS NOT NULL
         ORDER BY 1, 2 NULLS FIRST",
    )
    .fetch_all(pool)
    .await
}

/// One output record of an event, for `events show`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct EventRecord {
    pub name: String,
    pub topic: String,
    pub partition: Option<i32>,
    pub offset: Option<i64>,
    pub state: String,
    pub confirmed_by: Option<String>,
}

/// The output records of the event `key`, in enqueue order.
pub async fn of_event(pool: &Db, key: &str) -> sqlx::Result<Vec<EventRecord>> {
    sqlx::query_as(
        "SELECT name, topic, kafka_partition AS partition, kafka_offset AS offset, state,
                confirmed_by
         FROM output_records WHERE event_key = $1 ORDER BY id",
    )
    .bind(key)
    .fetch_all(pool)
    .await
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}
