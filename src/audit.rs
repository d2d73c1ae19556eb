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
