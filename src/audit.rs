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

/// Who asks for a change, and why; both go to the audit row.
#[derive(Debug, Clone)]
pub struct Act {
    pub actor: String,
    pub reason: String,
}

impl Act {
    pub fn new(actor: &str, reason: &str) -> Self {
        Self {
            actor: actor.into(),
            reason: reason.into(),
        }
    }

    /// The audit row of a change `action` made to `target`.
    pub(crate) fn audit<'a>(&'a self, action: &'a str, change: &'a Change) -> Action<'a> {
        Action {
            actor: &self.actor,
            action,
            target: &change.target,
            reason: &self.reason,
            before: &change.before,
            after: &change.after,
        }
    }
}

/// One row an operator change moved: what it was, its state before and after.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Change {
    pub target: String,
    pub before: String,
    pub after: String,
}

impl Change {
    pub(crate) fn new(target: &str, before: impl ToString, after: impl ToString) -> Self {
        Self {
            target: target.into(),
            before: before.to_string(),
            after: after.to_string(),
        }
    }
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
    pool: &crate::db::Db,
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
