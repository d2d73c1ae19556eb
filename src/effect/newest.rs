//! Newest state wins: for effects that keep the latest state of an object (a subscription's
//! status, an order's state) while the sender delivers its events in any order.
//!
//! Each event carries the provider's own version of the object: Stripe's event `created`
//! (seconds), Shopify's `updated_at`, a sequence number in the payload. [`newest`] records, in
//! the effect's transaction, the highest version applied per object (table `object_versions`)
//! and says which events are newer than it; the effect writes the state of those alone, so an
//! older event arriving late changes nothing. Two events of one object racing on two
//! partitions wait on the object's row: the later commit compares with the earlier one's
//! version.
//!
//! Equal versions keep the first one applied: choose a version fine enough to order the events
//! that matter (seconds are coarse when an object changes twice in a second; refetch the object
//! through the outbox when order within a second matters).
//!
//! ```no_run
//! use replayproof::effect::newest::{self, Candidate};
//! use replayproof::effect::{Effect, EffectError, Tx};
//! use replayproof::envelope::Event;
//!
//! struct SubscriptionStatus;
//!
//! #[async_trait::async_trait]
//! impl Effect for SubscriptionStatus {
//!     fn name(&self) -> &'static str {
//!         "subscriptions"
//!     }
//!
//!     async fn apply(&self, tx: &mut Tx<'_>, event: &Event) -> Result<(), EffectError> {
//!         let object = &event.payload()?["data"]["object"];
//!         let id = object["id"]
//!             .as_str()
//!             .ok_or_else(|| EffectError::permanent(anyhow::anyhow!("no id")))?;
//!         let version = newest::version(event, "/created").map_err(EffectError::Permanent)?;
//!         let candidate = Candidate::new("subscription", id, version, event);
//!         if newest::is_newest(tx, &candidate).await? {
//!             sqlx::query(
//!                 "INSERT INTO subscriptions (id, status) VALUES ($1, $2)
//!                  ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status",
//!             )
//!             .bind(id)
//!             .bind(object["status"].as_str())
//!             .execute(&mut **tx)
//!             .await?;
//!         }
//!         Ok(())
//!     }
//! }
//! ```

use crate::envelope::Event;
use anyhow::Context as _;
use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};

/// One event's claim to be the newest state of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate<'a> {
    /// The kind of object (`subscription`, `order`): versions compare within a kind and id.
    pub kind: &'a str,
    /// The object's id at its provider.
    pub object_id: &'a str,
    /// The provider's version of the object in this event; higher is newer.
    pub version: i64,
    /// The event's key, recorded with the version that won.
    pub event_key: &'a str,
    /// The route the version is kept under: the event's tenant route key, or '' for an event
    /// routed by its own key (see [`crate::envelope::Event::tenant_route`]).
    pub route: &'a str,
}

impl<'a> Candidate<'a> {
    /// `event`'s claim that it holds `version` of the object `kind`/`object_id`.
    pub fn new(kind: &'a str, object_id: &'a str, version: i64, event: &'a Event) -> Self {
        Self {
            kind,
            object_id,
            version,
            event_key: event.key.as_str(),
            route: event.tenant_route().unwrap_or(""),
        }
    }
}

/// The version at `pointer` in the event's payload (a JSON pointer such as `/created` or
/// `/data/object/updated_at`): an integer as it is, a string of digits as its number, an
/// RFC 3339 time as microseconds since 1970.
pub fn version(event: &Event, pointer: &str) -> anyhow::Result<i64> {
    let value = event
        .payload()?
        .pointer(pointer)
        .with_context(|| format!("the payload has no version at {pointer}"))?;
    version_of(value).with_context(|| format!("the version at {pointer} is not usable: {value}"))
}

fn version_of(value: &serde_json::Value) -> anyhow::Result<i64> {
    match value {
        serde_json::Value::Number(n) => n.as_i64().context("not an integer"),
        serde_json::Value::String(s) => match s.parse::<i64>() {
            Ok(n) => Ok(n),
            Err(_) => Ok(chrono::DateTime::parse_from_rfc3339(s)
                .context("neither an integer nor an RFC 3339 time")?
                .timestamp_micros()),
        },
        _ => anyhow::bail!("neither a number nor a string"),
    }
}

/// Whether `candidate` is newer than every version of its object applied before; if so its
/// version is recorded, in the caller's transaction. See [`newest`].
pub async fn is_newest(tx: &mut PgConnection, candidate: &Candidate<'_>) -> sqlx::Result<bool> {
    Ok(newest(tx, std::slice::from_ref(candidate)).await?[0])
}

/// For each candidate, whether it is the newest of its object: newer than every version applied
/// before and than the other candidates of the same object here. The winners' versions are
/// recorded in one statement, in the caller's transaction, so they commit or roll back with the
/// effect. Objects are locked in a fixed order, so two batches never deadlock on them.
pub async fn newest(
    tx: &mut PgConnection,
    candidates: &[Candidate<'_>],
) -> sqlx::Result<Vec<bool>> {
    let offered = best_per_object(candidates);
    let won = record_versions(tx, candidates, &offered).await?;
    let won: HashSet<(&str, &str, &str)> = won
        .iter()
        .map(|(k, i, r)| (k.as_str(), i.as_str(), r.as_str()))
        .collect();
    let winners: HashSet<usize> = offered
        .into_iter()
        .filter(|&i| {
            let c = &candidates[i];
            won.contains(&(c.kind, c.object_id, c.route))
        })
        .collect();
    Ok((0..candidates.len())
        .map(|i| winners.contains(&i))
        .collect())
}

/// The candidate with the highest version of each object (the first of equals), in the order
/// objects are locked in.
fn best_per_object(candidates: &[Candidate<'_>]) -> Vec<usize> {
    let mut best: HashMap<(&str, &str, &str), usize> = HashMap::new();
    for (i, c) in candidates.iter().enumerate() {
        best.entry((c.kind, c.object_id, c.route))
            .and_modify(|b| {
                if c.version > candidates[*b].version {
                    *b = i;
                }
            })
            .or_insert(i);
    }
    let mut offered: Vec<usize> = best.into_values().collect();
    offered.sort_by_key(|&i| {
        (
            candidates[i].kind,
            candidates[i].object_id,
            candidates[i].route,
        )
    });
    offered
}

/// Records the `offered` candidates' versions where each is newer than its object's, in one
/// statement; the objects (kind, id, route key) whose version it recorded.
async fn record_versions(
    tx: &mut PgConnection,
    candidates: &[Candidate<'_>],
    offered: &[usize],
) -> sqlx::Result<Vec<(String, String, String)>> {
    let kinds: Vec<&str> = offered.iter().map(|&i| candidates[i].kind).collect();
    let ids: Vec<&str> = offered.iter().map(|&i| candidates[i].object_id).collect();
    let versions: Vec<i64> = offered.iter().map(|&i| candidates[i].version).collect();
    let keys: Vec<&str> = offered.iter().map(|&i| candidates[i].event_key).collect();
    let routes: Vec<&str> = offered.iter().map(|&i| candidates[i].route).collect();
    sqlx::query_as(
        r#"INSERT INTO object_versions AS o (kind, object_id, version, event_key, route_key)
           SELECT k, i, v, e, rk
           FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[])
               AS u(k, i, v, e, rk)
           ORDER BY k COLLATE "C", i COLLATE "C", rk COLLATE "C"
           ON CONFLICT (kind, object_id, route_key) DO UPDATE
               SET version = EXCLUDED.version, event_key = EXCLUDED.event_key, updated_at = now()
               WHERE o.version < EXCLUDED.version
           RETURNING kind, object_id, route_key"#,
    )
    .bind(&kinds)
    .bind(&ids)
    .bind(&versions)
    .bind(&keys)
    .bind(&routes)
    .fetch_all(tx)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_version_is_an_integer_a_string_of_digits_or_a_time() {
        assert_eq!(version_of(&json!(1700000000)).unwrap(), 1700000000);
        assert_eq!(version_of(&json!("42")).unwrap(), 42);
        assert_eq!(
            version_of(&json!("2026-11-30T10:00:00.123456Z")).unwrap(),
            1796032800123456
        );
        assert!(version_of(&json!(1.5)).is_err());
        assert!(version_of(&json!("yesterday")).is_err());
        assert!(version_of(&json!(null)).is_err());
    }
}
