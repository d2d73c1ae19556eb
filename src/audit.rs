//! All SQL for `operator_actions`: every operator change, who made it, why, and the state
//! before and after, written in the same transaction as the change.

use sqlx::PgConnection;

/// One operator change to record.
#[derive(Debug, Clone, Copy)]
pub struct Action<'a> {
    pub actor: &'a str,
    /// `retry`, `resolve` or `replay`.
    pub action: &'a str,
    pub target: &'a str,
    pub reason: &'a str,
    pub before: &'a str,
    pub after: &'a str,
}

/// Records `action` in the caller's transaction.
pub async fn record(conn: &mut PgConnection, action: Action<'_>) -> sqlx::Result<()> {
    sqlx::query!(
        "INSERT INTO operator_actions (actor, action, target, reason, state_before, state_after) \
         VALUES ($1, $2, $3, $4, $5, $6)",
        action.actor,
        action.action,
        action.target,
        action.reason,
        action.before,
        action.after,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// One recorded operator change, as an event's story shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ActionRow {
    pub id: i64,
    pub actor: String,
    pub at: chrono::DateTime<chrono::Utc>,
    pub action: String,
    pub target: String,
    pub reason: Option<String>,
    pub state_before: Option<String>,
    pub state_after: Option<String>,
}

/// The changes made to the event `key`, to its operations (`key#operation`) and to the
/// `others` targets (its dead letters, `dead_letter:ID`), oldest first.
pub async fn of_event(
    pool: &sqlx::PgPool,
    key: &str,
    others: &[String],
) -> sqlx::Result<Vec<ActionRow>> {
    // The operation keys are `key#…`: every target from `key#` up to `key$`, byte by byte.
    let (from, to) = (format!("{key}#"), format!("{key}$"));
    sqlx::query_as!(
        ActionRow,
        r#"SELECT id, actor, at, action, target, reason, state_before, state_after
           FROM operator_actions
           WHERE target = $1 OR (target ~>=~ $2 AND target ~<~ $3) OR target = ANY($4)
           ORDER BY at, id"#,
        key,
        from,
        to,
        others,
    )
    .fetch_all(pool)
    .await
}
