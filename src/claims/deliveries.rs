//! Every redelivery visible: each batch's deliveries of keys already claimed are recorded in
//! one row of `redeliveries`, in the batch's own transaction, and read through the
//! `claim_deliveries` view (`deliveries`, `last_seen_at`).

use super::Origin;
use sqlx::PgConnection;

/// Records the deliveries in `seen` (event key, offset), every one a delivery of a key already
/// claimed, as one row: a probe found the keys, and nothing of their claims is written. A
/// message read again (the group restarted before committing its offset, a replay by time) is
/// recorded again and counted once: the view counts distinct positions. Returns how many were
/// recorded.
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
