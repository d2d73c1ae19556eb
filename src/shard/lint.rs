//! The schema's rules for sharding, checked over `pg_catalog`: on every table distributed by
//! `route_key` (replayproof's own, and the effect tables an application names), every primary
//! key, unique index and foreign key includes `route_key`, and the key columns compare byte
//! by byte (`COLLATE "C"`), so that a row's shard and its uniqueness never depend on anything
//! but its route key and the bytes of its keys.

use crate::db::Db;

/// One rule a table breaks.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Finding {
    /// The table, schema-qualified.
    pub table: String,
    /// What is wrong and how to put it right.
    pub problem: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.table, self.problem)
    }
}

/// The columns that must compare byte by byte wherever they appear.
const KEY_COLUMNS: &[&str] = &["event_key", "route_key"];

/// The findings on replayproof's distributed tables in the session's schema, then on `extra`
/// (an application's effect tables, `schema.table` or a name on the search path).
pub async fn check(pool: &Db, extra: &[String]) -> anyhow::Result<Vec<Finding>> {
    let schema: String = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(pool)
        .await?;
    let mut tables: Vec<String> = super::citus::DISTRIBUTED
        .iter()
        .map(|t| format!("{schema}.{t}"))
        .collect();
    tables.extend(extra.iter().cloned());
    let mut findings = Vec::new();
    for table in &tables {
        findings.extend(check_table(pool, table).await?);
    }
    Ok(findings)
}

/// The findings on one table.
async fn check_table(pool: &Db, table: &str) -> anyhow::Result<Vec<Finding>> {
    let problems = match unshardable(pool, table).await? {
        Some(problem) => vec![problem],
        None => key_problems(pool, table).await?,
    };
    Ok(problems
        .into_iter()
        .map(|problem| Finding {
            table: table.to_owned(),
            problem,
        })
        .collect())
}

/// Why the table cannot be sharded at all: there is no such table, or it has no `route_key`.
async fn unshardable(pool: &Db, table: &str) -> sqlx::Result<Option<String>> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(pool)
        .await?;
    if !exists {
        return Ok(Some("no such table".into()));
    }
    let has_route: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
         AND attname = 'route_key' AND NOT attisdropped)",
    )
    .bind(table)
    .fetch_one(pool)
    .await?;
    Ok((!has_route).then(|| {
        "has no route_key column: add `route_key TEXT COLLATE \"C\" NOT NULL`, written \
         from Event::route_key in the effect"
            .into()
    }))
}

/// What keeps a table with a `route_key` from holding its keys shard by shard: unique indexes
/// and foreign keys without it, and key columns not compared byte by byte.
async fn key_problems(pool: &Db, table: &str) -> sqlx::Result<Vec<String>> {
    let mut problems = Vec::new();
    for index in unique_without_route(pool, table).await? {
        problems.push(format!(
            "the unique index {index} does not include route_key: Citus refuses it, and on \
             separate databases it could not hold across shards"
        ));
    }
    for key in foreign_keys_without_route(pool, table).await? {
        problems.push(format!(
            "the foreign key {key} does not match on route_key: both ends must be co-located \
             by it"
        ));
    }
    for (column, collation) in not_c_collated(pool, table).await? {
        problems.push(format!(
            "the key column {column} compares by collation {collation}: declare it COLLATE \
             \"C\" so that keys are compared and hashed byte by byte"
        ));
    }
    Ok(problems)
}

/// The table's unique indexes (its primary key included) that leave out `route_key`.
async fn unique_without_route(pool: &Db, table: &str) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        r#"SELECT i.relname::text FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
           WHERE x.indrelid = to_regclass($1) AND x.indisunique
             AND NOT EXISTS (SELECT 1 FROM pg_attribute a
                             WHERE a.attrelid = x.indrelid AND a.attname = 'route_key'
                               AND a.attnum = ANY (x.indkey))
           ORDER BY 1"#,
    )
    .bind(table)
    .fetch_all(pool)
    .await
}

/// The table's foreign keys that do not pair its `route_key` with the referenced table's.
async fn foreign_keys_without_route(pool: &Db, table: &str) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        r#"SELECT c.conname::text FROM pg_constraint c
           WHERE c.conrelid = to_regclass($1) AND c.contype = 'f'
             AND NOT EXISTS (
                 SELECT 1 FROM unnest(c.conkey, c.confkey) AS k(mine, theirs)
                 JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.mine
                 JOIN pg_attribute b ON b.attrelid = c.confrelid AND b.attnum = k.theirs
                 WHERE a.attname = 'route_key' AND b.attname = 'route_key')
           ORDER BY 1"#,
    )
    .bind(table)
    .fetch_all(pool)
    .await
}

/// The table's key columns ([`KEY_COLUMNS`]) whose collation is not `"C"`.
async fn not_c_collated(pool: &Db, table: &str) -> sqlx::Result<Vec<(String, String)>> {
    sqlx::query_as(
        r#"SELECT a.attname::text, coalesce(co.collname, 'none')::text
           FROM pg_attribute a LEFT JOIN pg_collation co ON co.oid = a.attcollation
           WHERE a.attrelid = to_regclass($1) AND a.attname = ANY ($2) AND NOT a.attisdropped
             AND coalesce(co.collname, '') <> 'C'
           ORDER BY 1"#,
    )
    .bind(table)
    .bind(KEY_COLUMNS)
    .fetch_all(pool)
    .await
}
