//! The console's sessions, kept on the server (`console_sessions`, on the first database): the
//! signed cookie names a session by a random token, and every request checks its row. Logging
//! out revokes it; a session opened with another `password_hash` than the user's now is over;
//! so is one past its lifetime. Only the token's SHA-256 is stored, so reading the table gives
//! no one a session.

use super::UserConfig;
use crate::db::Db;
use sha2::{Digest, Sha256};

/// The row's id for a token.
fn id_of(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// What a session is bound to of its user: the hash of their `password_hash` (empty without).
fn credential_of(user: &UserConfig) -> Vec<u8> {
    Sha256::digest(user.password_hash.as_deref().unwrap_or_default().as_bytes()).to_vec()
}

/// Opens a session for `user` until `expires` (Unix seconds), with its random `token`; the
/// user's sessions over a day ago are forgotten on the way.
pub(crate) async fn open(
    pool: &Db,
    user: &UserConfig,
    token: &str,
    expires: i64,
) -> sqlx::Result<()> {
    sqlx::query(
        "DELETE FROM console_sessions WHERE user_name = $1 \
         AND coalesce(revoked_at, expires_at) < now() - interval '1 day'",
    )
    .bind(&user.name)
    .execute(pool)
    .await?;
    sqlx::query(
        "INSERT INTO console_sessions (id, user_name, credential, expires_at) \
         VALUES ($1, $2, $3, to_timestamp($4))",
    )
    .bind(id_of(token))
    .bind(&user.name)
    .bind(credential_of(user))
    .bind(expires as f64)
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether the session `token` of `user` is live: not revoked, not expired, opened with the
/// user's `password_hash` of now.
pub(crate) async fn live(pool: &Db, user: &UserConfig, token: &str) -> sqlx::Result<bool> {
    let found: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM console_sessions WHERE id = $1 AND user_name = $2 AND credential = $3 \
         AND revoked_at IS NULL AND expires_at > now()",
    )
    .bind(id_of(token))
    .bind(&user.name)
    .bind(credential_of(user))
    .fetch_optional(pool)
    .await?;
    Ok(found.is_some())
}

/// Ends the session `token`: its cookie, copied or not, opens nothing any more.
pub(crate) async fn revoke(pool: &Db, token: &str) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE console_sessions SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
    )
    .bind(id_of(token))
    .execute(pool)
    .await?;
    Ok(())
}
