//! What erasure searches beyond the stored JSON payloads: operations' bodies (bytes, JSON for
//! the `http` effect), dead letters' bytes (an envelope, or anything a producer wrote), and
//! what it cannot search at all: settled events whose payload replayproof no longer keeps.

use crate::db::Db;
use serde_json::Value;

/// Whether `document` holds `value` at `path`, as PostgreSQL's `#>>` reads it: a string as
/// itself, any other value as its JSON text.
pub fn holds(document: &Value, path: &[&str], value: &str) -> bool {
    let mut at = document;
    for step in path {
        at = match at {
            Value::Object(members) => match members.get(*step) {
                Some(next) => next,
                None => return false,
            },
            Value::Array(items) => match step.parse::<usize>().ok().and_then(|i| items.get(i)) {
                Some(next) => next,
                None => return false,
            },
            _ => return false,
        };
    }
    match at {
        Value::String(text) => text == value,
        Value::Null => false,
        other => serde_json::to_string(other).is_ok_and(|text| text == value),
    }
}

/// The keys of `source` whose operations' bodies, read as JSON, hold `value` at `path`: in the
/// body itself (an application's own request), or in its `payload` (the `http` effect sends
/// the event's envelope).
pub async fn matching_bodies(
    pool: &Db,
    source: &str,
    path: &[&str],
    value: &str,
) -> sqlx::Result<Vec<String>> {
    let bodies = sqlx::query!(
        r#"SELECT DISTINCT o.event_key, o.payload FROM outbox o
           JOIN processed_events p ON p.event_key = o.event_key
           WHERE p.source = $1 AND o.payload_erased_at IS NULL"#,
        source
    )
    .fetch_all(pool)
    .await?;
    Ok(bodies
        .into_iter()
        .filter(|b| {
            serde_json::from_slice::<Value>(&b.payload)
                .is_ok_and(|v| holds(&v, path, value) || holds(&v["payload"], path, value))
        })
        .map(|b| b.event_key)
        .collect())
}

/// The shortest value looked for in a dead letter's raw bytes: a shorter one would match
/// unrelated letters, whose erasure cannot be undone.
pub const MIN_RAW_MATCH: usize = 4;

/// The dead letters, not yet erased, that may carry the data subject's `value`: an envelope of
/// `source` holding it at `path` in its payload; anything else (not JSON, or JSON that is no
/// envelope) wherever its bytes contain it. With a value shorter than [`MIN_RAW_MATCH`], the
/// letters that are no envelope are not searched: the second number, how many.
pub async fn matching_dead_letters(
    pool: &Db,
    source: &str,
    path: &[&str],
    value: &str,
) -> sqlx::Result<(Vec<i64>, usize)> {
    let letters = sqlx::query!(
        r#"SELECT id, raw_value AS "value!" FROM dead_letters
           WHERE payload_erased_at IS NULL AND raw_value IS NOT NULL ORDER BY id"#
    )
    .fetch_all(pool)
    .await?;
    let needle = value.as_bytes();
    let (mut ids, mut unsearched) = (Vec::new(), 0);
    for letter in letters {
        let envelope = serde_json::from_slice::<Value>(&letter.value)
            .ok()
            .filter(|v| v["source"].is_string() && v.get("payload").is_some());
        let matched = match envelope {
            Some(envelope) => {
                envelope["source"] == source && holds(&envelope["payload"], path, value)
            }
            None if needle.len() < MIN_RAW_MATCH => {
                unsearched += 1;
                false
            }
            None => letter.value.windows(needle.len()).any(|w| w == needle),
        };
        if matched {
            ids.push(letter.id);
        }
    }
    Ok((ids, unsearched))
}

/// The dead letters of `key` (their Kafka key), not yet erased.
pub async fn dead_letters_of(pool: &Db, key: &str) -> sqlx::Result<Vec<i64>> {
    sqlx::query_scalar!(
        "SELECT id FROM dead_letters WHERE raw_key = convert_to($1, 'UTF8') \
         AND payload_erased_at IS NULL ORDER BY id",
        key
    )
    .fetch_all(pool)
    .await
}

/// Erases the bytes of the dead letters `ids`, keeping their place, reason and identity (the
/// hash of the bytes, so a redelivery of the message is still the stored letter); how many.
pub async fn erase_dead_letters(pool: &Db, ids: &[i64]) -> sqlx::Result<u64> {
    let done = sqlx::query!(
        "UPDATE dead_letters SET erased_sha256 = message_sha256, raw_value = NULL, raw_headers = NULL, \
         payload_erased_at = now() WHERE id = ANY($1) AND payload_erased_at IS NULL",
        ids
    )
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// The settled events of `source` of which nothing searchable is kept (a done claim keeps only
/// its hash, an application's own tables are not searched, prune erased the rest):
/// an erasure by field cannot tell whether they concerned the data subject.
pub async fn unsearchable(pool: &Db, source: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM processed_events p
           WHERE p.source = $1 AND p.payload IS NULL AND p.payload_erased_at IS NULL
             AND NOT EXISTS (SELECT 1 FROM ledger l WHERE l.event_key = p.event_key
                             AND l.payload_erased_at IS NULL)
             AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.event_key = p.event_key
                             AND o.payload_erased_at IS NULL)"#,
        source
    )
    .fetch_one(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::holds;
    use serde_json::json;

    #[test]
    fn a_field_is_read_as_postgresql_reads_it() {
        let doc = json!({"data": {"object": {"customer": "cus_1", "n": 42, "tags": ["a", "b"]}}});
        assert!(holds(&doc, &["data", "object", "customer"], "cus_1"));
        assert!(holds(&doc, &["data", "object", "n"], "42"));
        assert!(holds(&doc, &["data", "object", "tags", "1"], "b"));
        assert!(!holds(&doc, &["data", "object", "customer"], "cus_2"));
        assert!(!holds(&doc, &["data", "missing"], "cus_1"));
        assert!(!holds(&json!({"a": null}), &["a"], "null"));
    }
}
