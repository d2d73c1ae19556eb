//! Every redelivery visible: each delivery of a key already claimed is counted on its claim
//! (`deliveries`, `last_seen_at`), in the batch's own transaction.

use super::Origin;
use sqlx::PgConnection;

/// Counts the deliveries in `seen` (event key, the route of its stored claim, offset), every
/// one a delivery of a key already claimed, on the claims: `deliveries` grows by each and
/// `last_seen_at` moves to now. A message read again (the group restarted before committing its
/// offset, a replay by time) is at or before the last position counted on its partition and is
/// not counted twice. One statement for a whole batch; the claims are locked in key order, as
/// [`super::claim`] inserts them, so two batches counting the same keys wait on each other but never
/// deadlock. A copy inserted by a transaction not yet committed is not seen, and not counted.
pub async fn count(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    seen: &[(&str, &str, i64)],
) -> sqlx::Result<u64> {
    if seen.is_empty() {
        return Ok(0);
    }
    let keys: Vec<&str> = seen.iter().map(|(k, _, _)| *k).collect();
    let routes: Vec<&str> = seen.iter().map(|(_, r, _)| *r).collect();
    let offsets: Vec<i64> = seen.iter().map(|(_, _, o)| *o).collect();
    let done = sqlx::query!(
        r#"WITH u AS (SELECT * FROM unnest($1::text[], $2::text[], $3::int8[]) AS u(k, r, o)),
           locked AS MATERIALIZED (
               SELECT x.event_key, x.route_key,
                      coalesce(x.last_seen_partition, x.kafka_partition) AS partition,
                      coalesce(x.last_seen_offset, x.kafka_offset) AS last
               FROM processed_events x
               WHERE (x.event_key, x.route_key) IN (SELECT k, r FROM u)
               ORDER BY x.event_key COLLATE "C", x.route_key COLLATE "C"
               FOR UPDATE),
           d AS (SELECT l.event_key, l.route_key, count(*)::int4 AS n, max(u.o) AS last
                 FROM u JOIN locked l ON l.event_key = u.k AND l.route_key = u.r
                 WHERE NOT (l.partition = $4 AND u.o <= l.last)
                 GROUP BY l.event_key, l.route_key)
           UPDATE processed_events p
           SET deliveries = p.deliveries + d.n, last_seen_at = now(),
               last_seen_partition = $4, last_seen_offset = d.last
           FROM d WHERE p.event_key = d.event_key AND p.route_key = d.route_key"#,
        &keys as _,
        &routes as _,
        &offsets,
        origin.partition,
    )
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}
