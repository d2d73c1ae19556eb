//! `migrate --citus`: replayproof's tables distributed on a Citus coordinator, by `route_key`
//! and co-located with the claims, so that a claim, its conflicts, its outbox operations and
//! their attempts share one shard and commit in one single-shard transaction, which Citus
//! routes to one worker without two-phase commit.
//!
//! The tables that belong to no event (the operator's audit, the prune horizons, the
//! destinations' breakers) become reference tables, copied to every worker.

use crate::db::Db;
use anyhow::Context as _;

/// The distributed tables, referenced before referencing (Citus distributes a table's foreign
/// keys' targets first), each co-located with `processed_events`.
pub const DISTRIBUTED: &[&str] = &[
    "processed_events",
    "key_conflicts",
    "delivery_fingerprints",
    "expired_replays",
    "outbox",
    "outbox_attempts",
    "ledger",
    "object_versions",
    "dead_letters",
    "operation_obligations",
    "fulfilled_operations",
    "output_records",
];

/// The tables with no route key: small, written rarely, read with the claims.
pub const REFERENCE: &[&str] = &[
    "operator_actions",
    "prune_horizons",
    "outbox_destinations",
    "console_sessions",
    "source_pauses",
    "activity_minutes",
    "output_partitions",
    // A batch's redeliveries span route keys: one row per batch of them, read with any claim.
    "redeliveries",
];

/// The tables each database keeps of itself, never distributed: which buckets it holds
/// ([`super::holdings`]); on a Citus coordinator, local tables of the coordinator.
pub const LOCAL: &[&str] = &["shard_layout", "shard_ranges"];

/// The statements, in order, that distribute the migrated tables over `shard_count` shards.
pub fn statements(shard_count: usize) -> Vec<String> {
    let mut sql = Vec::new();
    for (i, table) in DISTRIBUTED.iter().enumerate() {
        sql.push(match i {
            0 => format!(
                "SELECT create_distributed_table('{table}', 'route_key', \
                 colocate_with => 'none', shard_count => {shard_count})"
            ),
            _ => format!(
                "SELECT create_distributed_table('{table}', 'route_key', \
                 colocate_with => '{}')",
                DISTRIBUTED[0]
            ),
        });
    }
    for table in REFERENCE {
        sql.push(format!("SELECT create_reference_table('{table}')"));
    }
    sql
}

/// Distributes the tables of a migrated database on a Citus coordinator; tables already
/// distributed are left as they are, so it can run again. Refused, with why, where the Citus
/// extension is not installed.
pub async fn distribute(pool: &Db, shard_count: usize) -> anyhow::Result<()> {
    let version: Option<String> =
        sqlx::query_scalar("SELECT extversion FROM pg_extension WHERE extname = 'citus'")
            .fetch_optional(pool)
            .await
            .context("looking for the Citus extension")?;
    let Some(version) = version else {
        anyhow::bail!(
            "the citus extension is not installed in this database: migrate --citus runs on a \
             Citus coordinator (CREATE EXTENSION citus), or leave out --citus for plain \
             PostgreSQL shards"
        );
    };
    tracing::info!(citus = version, shard_count, "Distributing the tables.");
    let tables = DISTRIBUTED.iter().chain(REFERENCE);
    for (table, statement) in tables.zip(statements(shard_count)) {
        let known: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = to_regclass($1))",
        )
        .bind(table)
        .fetch_one(pool)
        .await
        .with_context(|| format!("reading Citus's metadata of {table}"))?;
        if !known {
            sqlx::query(&statement)
                .execute(pool)
                .await
                .with_context(|| format!("distributing {table}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claims_are_distributed_first_and_everything_else_colocated_with_them() {
        let sql = statements(32);
        assert_eq!(sql.len(), DISTRIBUTED.len() + REFERENCE.len());
        assert!(sql[0].contains("'processed_events', 'route_key'"));
        assert!(sql[0].contains("shard_count => 32"));
        for statement in &sql[1..DISTRIBUTED.len()] {
            assert!(statement.contains("colocate_with => 'processed_events'"));
        }
        // Foreign keys: outbox → processed_events, outbox_attempts → outbox.
        let at = |t: &str| DISTRIBUTED.iter().position(|x| *x == t).unwrap();
        assert!(at("processed_events") < at("outbox"));
        assert!(at("outbox") < at("outbox_attempts"));
    }
}
