//! Enqueuing operations in the consume transaction, and the claims of the business obligations
//! some of them fulfil (`operation_obligations`, `fulfilled_operations`).
//!
//! An operation keyed by an obligation ([`NewOperation::obligation`]) is claimed in
//! `operation_obligations` before it is enqueued: the first event naming the obligation claims
//! it and enqueues the operation; a later one (in this batch, another partition's transaction,
//! or an earlier batch) finds it claimed, enqueues nothing, and is recorded in
//! `fulfilled_operations` as fulfilled by the event that holds it. Two transactions claiming one
//! obligation at once are ordered by its primary key: the second waits for the first, and
//! claims it only if the first rolled back.

use super::{origin, NewOperation};
use sqlx::PgConnection;
use std::collections::{HashMap, HashSet};

/// What enqueuing did: the operations whose obligation another event already holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Enqueued {
    /// Each operation that was not enqueued because its obligation is fulfilled by another
    /// event's operation.
    pub fulfilled: Vec<Fulfilled>,
}

/// An operation of one event that another event's operation fulfils.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fulfilled {
    /// The event that named the obligation again.
    pub event_key: String,
    /// The operation's name.
    pub operation: String,
    /// The obligation's operation key.
    pub operation_key: String,
    /// The event whose operation it is.
    pub by: String,
}

/// Enqueues an operation in the caller's transaction. Enqueuing one twice keeps the first.
pub async fn enqueue(conn: &mut PgConnection, op: &NewOperation<'_>) -> sqlx::Result<Enqueued> {
    enqueue_all(conn, std::slice::from_ref(op)).await
}

/// Enqueues operations in the caller's transaction, in one statement, in operation-key order
/// (so two transactions enqueuing overlapping operations never deadlock). Enqueuing one twice
/// keeps the first. Operations keyed by an obligation are claimed first: those whose obligation
/// another event holds are not enqueued, and are recorded as fulfilled by it.
pub async fn enqueue_all(
    conn: &mut PgConnection,
    ops: &[NewOperation<'_>],
) -> sqlx::Result<Enqueued> {
    if let Some(refusal) = ops.iter().find_map(|op| op.refusal()) {
        return Err(sqlx::Error::InvalidArgument(refusal));
    }
    let fulfilled = claim_obligations(conn, ops).await?;
    let held_elsewhere: HashSet<(&str, &str)> = fulfilled
        .iter()
        .map(|f| (f.event_key.as_str(), f.operation.as_str()))
        .collect();
    let kept: Vec<&NewOperation<'_>> = ops
        .iter()
        .filter(|op| !held_elsewhere.contains(&(op.event_key, op.operation)))
        .collect();
    insert(conn, &kept).await?;
    Ok(Enqueued { fulfilled })
}

/// The scope an obligation is unique in: '' for an event routed by its own key (one per
/// database), its route key otherwise (one per tenant, on the tenant's shard).
fn scope<'o>(op: &NewOperation<'o>) -> &'o str {
    match op.route_key == op.event_key {
        true => "",
        false => op.route_key,
    }
}

/// Claims the obligations of `ops` keyed by one, in key order and, for one key, in the order
/// the events were given (the earlier event wins); returns the operations whose obligation is
/// held by another event, recorded as fulfilled by it.
async fn claim_obligations(
    conn: &mut PgConnection,
    ops: &[NewOperation<'_>],
) -> sqlx::Result<Vec<Fulfilled>> {
    let named: Vec<&NewOperation<'_>> = ops.iter().filter(|o| o.obligation.is_some()).collect();
    if named.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<String> = named.iter().map(|o| o.operation_key()).collect();
    let scopes: Vec<&str> = named.iter().map(|o| scope(o)).collect();
    let events: Vec<&str> = named.iter().map(|o| o.event_key).collect();
    let routes: Vec<&str> = named.iter().map(|o| o.route_key).collect();
    sqlx::query!(
        r#"INSERT INTO operation_obligations (operation_key, route_key, event_key, event_route_key)
           SELECT ok, sc, ek, rk
           FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY
                AS u(ok, sc, ek, rk, n)
           ORDER BY ok COLLATE "C", sc COLLATE "C", n
           ON CONFLICT (operation_key, route_key) DO NOTHING"#,
        &keys,
        &scopes as _,
        &events as _,
        &routes as _,
    )
    .execute(&mut *conn)
    .await?;
    // A fresh statement: it sees the claims of transactions this one waited for.
    let holders = sqlx::query!(
        r#"SELECT u.n AS "n!", o.event_key
           FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(ok, sc, n)
           JOIN operation_obligations o ON o.operation_key = u.ok AND o.route_key = u.sc"#,
        &keys,
        &scopes as _,
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut fulfilled = Vec::new();
    for holder in holders {
        let i = usize::try_from(holder.n - 1).unwrap_or(usize::MAX);
        let Some(op) = named.get(i) else { continue };
        if holder.event_key != op.event_key {
            fulfilled.push(Fulfilled {
                event_key: op.event_key.to_owned(),
                operation: op.operation.to_owned(),
                operation_key: keys[i].clone(),
                by: holder.event_key,
            });
        }
    }
    record_fulfilled(conn, ops, &fulfilled).await?;
    Ok(fulfilled)
}

/// Records the operations another event fulfils, with the claims of the events that named them.
async fn record_fulfilled(
    conn: &mut PgConnection,
    ops: &[NewOperation<'_>],
    fulfilled: &[Fulfilled],
) -> sqlx::Result<()> {
    if fulfilled.is_empty() {
        return Ok(());
    }
    let route_keys: HashMap<&str, &str> = ops.iter().map(|o| (o.event_key, o.route_key)).collect();
    let events: Vec<&str> = fulfilled.iter().map(|f| f.event_key.as_str()).collect();
    let routes: Vec<&str> = events
        .iter()
        .map(|e| route_keys.get(e).copied().unwrap_or(e))
        .collect();
    let operations: Vec<&str> = fulfilled.iter().map(|f| f.operation.as_str()).collect();
    let keys: Vec<&str> = fulfilled.iter().map(|f| f.operation_key.as_str()).collect();
    let by: Vec<&str> = fulfilled.iter().map(|f| f.by.as_str()).collect();
    sqlx::query!(
        r#"INSERT INTO fulfilled_operations (event_key, route_key, operation, operation_key,
                                             fulfilled_by)
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
           ORDER BY 1, 3
           ON CONFLICT (event_key, operation, route_key) DO NOTHING"#,
        &events as _,
        &routes as _,
        &operations as _,
        &keys as _,
        &by as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// The outbox rows of `ops`, in one statement, in operation-key order.
async fn insert(conn: &mut PgConnection, ops: &[&NewOperation<'_>]) -> sqlx::Result<()> {
    if ops.is_empty() {
        return Ok(());
    }
    let operation_keys: Vec<String> = ops.iter().map(|o| o.operation_key()).collect();
    let event_keys: Vec<&str> = ops.iter().map(|o| o.event_key).collect();
    let routes: Vec<&str> = ops.iter().map(|o| o.route_key).collect();
    let operations: Vec<&str> = ops.iter().map(|o| o.operation).collect();
    let destinations: Vec<&str> = ops.iter().map(|o| o.destination).collect();
    let origins: Vec<String> = ops.iter().map(|o| origin(o.destination)).collect();
    let methods: Vec<&str> = ops.iter().map(|o| o.method.as_str()).collect();
    let content_types: Vec<&str> = ops.iter().map(|o| o.content_type.as_str()).collect();
    let payloads: Vec<&[u8]> = ops.iter().map(|o| o.payload.as_slice()).collect();
    let headers: Vec<serde_json::Value> =
        ops.iter().map(|o| serde_json::json!(o.headers)).collect();
    let credentials: Vec<Option<&str>> = ops.iter().map(|o| o.credential.as_deref()).collect();
    let reconcile: Vec<Option<&str>> = ops.iter().map(|o| o.reconcile_url.as_deref()).collect();
    let max_attempts: Vec<i32> = ops.iter().map(|o| o.max_attempts).collect();
    let traceparents: Vec<Option<&str>> = ops.iter().map(|o| o.traceparent.as_deref()).collect();
    sqlx::query!(
        r#"INSERT INTO outbox (operation_key, event_key, operation, destination, origin, method,
                content_type, payload, headers, credential, reconcile_url, max_attempts,
                traceparent, route_key)
           SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                                $6::text[], $7::text[], $8::bytea[], $9::jsonb[], $10::text[],
                                $11::text[], $12::int4[], $13::text[], $14::text[])
                AS u(ok, k, op, d, o, m, ct, p, h, c, r, ma, tp, rk)
           ORDER BY ok COLLATE "C", rk COLLATE "C"
           ON CONFLICT (operation_key, route_key) DO NOTHING"#,
        &operation_keys,
        &event_keys as _,
        &operations as _,
        &destinations as _,
        &origins,
        &methods as _,
        &content_types as _,
        &payloads as _,
        &headers,
        &credentials as _,
        &reconcile as _,
        &max_attempts,
        &traceparents as _,
        &routes as _,
    )
    .execute(conn)
    .await?;
    Ok(())
}
