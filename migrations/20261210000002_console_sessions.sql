-- The console's sessions, kept on the server so that logging out, or a changed password_hash,
-- ends them at once: the cookie names a session by a random token, and only the token's
-- SHA-256 is stored.
CREATE TABLE console_sessions (
    id          BYTEA       PRIMARY KEY,
    user_name   TEXT        NOT NULL,
    -- The SHA-256 of the password_hash the user logged in with: another hash ends the session.
    credential  BYTEA       NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    expires_at  TIMESTAMPTZ NOT NULL,
    revoked_at  TIMESTAMPTZ
);
CREATE INDEX console_sessions_expires_at ON console_sessions (expires_at);
