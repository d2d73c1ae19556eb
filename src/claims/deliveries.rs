//! Every redelivery visible: each batch's deliveries of keys already claimed are recorded in
//! `redeliveries`, in the batch's own transaction, and read through the `claim_deliveries` view
//! (`deliveries`, `last_seen_at`). Those of the keys the claim statement finds claimed are one
//! row written by that statement ([`super::claim`]); the rest (copies of a key within the batch,
//! keys a racing transaction claimed first) one more row, written here.

use super::Origin;
use sqlx::PgConnection;

/// Records the deliveries in `seen` (event key, offset), every one a delivery of a key already
/// claimed, as one row: nothing of their claims is written. A message read again (the group
/// restarted before committing its offset, a replay by time) is recorded again and counted
/// once: the view counts distinct positions. Returns how many were recorded.
pub async fn record(
    conn: &mut PgConnection,
    origin: Origin<'_>,
    seen: &[(&str, i64)],
) -> sqlx::Result<u64> {
    if seen.is_empty() {
        return Ok(0);
    }
    let keys: Vec<&str> = seen.iter().map(|(k, _)| *k).collect();
    let offsets: Vec<i64> = seen.iter().map(|(_, o)| *o).collect();
    sqlx::query!(
        r#"INSERT INTO redeliveries (kafka_topic, kafka_partition, event_keys, kafka_offsets)
           VALUES ($1, $2, $3::text[], $4::int8[])"#,
        origin.topic,
        origin.partition,
        &keys as _,
        &offsets,
    )
    .execute(conn)
    .await?;
    Ok(seen.len() as u64)
}

/// Takes out of `redeliveries` the keys of the claims `condition` selects (SQL over
/// `processed_events`, built by the caller from numbers only), with their offsets; a row left
/// empty goes. Used when those claims leave this database carrying their counts.
pub async fn forget_where(conn: &mut PgConnection, condition: &str) -> sqlx::Result<()> {
    let sql = format!(
        "WITH moved AS (SELECT DISTINCT event_key FROM processed_events WHERE {condition}),
         kept AS (
             SELECT r.id, bool_or(g.event_key IS NOT NULL) AS touched,
                    array_agg(u.k ORDER BY u.n) FILTER (WHERE g.event_key IS NULL) AS keys,
                    array_agg(u.o ORDER BY u.n) FILTER (WHERE g.event_key IS NULL) AS offsets
             FROM redeliveries r
             CROSS JOIN LATERAL unnest(r.event_keys, r.kafka_offsets) WITH ORDINALITY AS u(k, o, n)
             LEFT JOIN moved g ON g.event_key = u.k
             GROUP BY r.id),
         gone AS (DELETE FROM redeliveries r USING kept
                  WHERE r.id = kept.id AND kept.touched AND kept.keys IS NULL)
         UPDATE redeliveries r SET event_keys = kept.keys, kafka_offsets = kept.offsets
         FROM kept WHERE r.id = kept.id AND kept.touched AND kept.keys IS NOT NULL"
    );
    sqlx::query(&sql).execute(conn).await?;
    Ok(())
}

/// The `SELECT` list and the `FROM` that read `cols` of `table`: the claims with their
/// deliveries as this database counts them (those recorded in `redeliveries` included), what a
/// copy of them to another database must carry; any other table as stored.
pub fn counted_read(table: &str, cols: &str) -> (String, String) {
    if table != "processed_events" {
        return (cols.into(), table.into());
    }
    let select = cols.split(", ").map(|c| match c {
        "deliveries" | "last_seen_at" => format!("d.{c}"),
        "event_key" | "route_key" => c.to_owned(),
        _ => format!("processed_events.{c}"),
    });
    let from = "processed_events JOIN claim_deliveries d USING (event_key, route_key)";
    (select.collect::<Vec<_>>().join(", "), from.into())
}
