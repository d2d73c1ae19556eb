-- The transactional outbox: operations on other systems, enqueued in the consume transaction
-- and delivered afterwards by `replayproof dispatch` under a lease.
CREATE SEQUENCE outbox_fencing_token;

CREATE TABLE outbox (
    id                BIGSERIAL   PRIMARY KEY,
    -- The event key plus the operation name; sent downstream as the Idempotency-Key on every
    -- attempt, so a downstream that honours it applies the operation once.
    operation_key     TEXT        NOT NULL UNIQUE,
    event_key         TEXT        NOT NULL REFERENCES processed_events (event_key),
    operation         TEXT        NOT NULL,
    destination       TEXT        NOT NULL,
    -- The exact request body, sent byte for byte on every attempt.
    payload           BYTEA       NOT NULL,
    reconcile_url     TEXT,
    -- pending: never tried. in_progress: leased to a dispatcher until lease_expires_at.
    -- retryable: failed in a way worth retrying at next_attempt_at. uncertain: the request may
    -- have been applied (timeout, cut connection); retried with the same key or reconciled.
    -- done: acknowledged. failed: refused (4xx), kept for an operator. dead: out of attempts.
    state             TEXT        NOT NULL DEFAULT 'pending' CHECK (state IN
                          ('pending', 'in_progress', 'retryable', 'uncertain', 'done', 'failed', 'dead')),
    attempts          INTEGER     NOT NULL DEFAULT 0,
    max_attempts      INTEGER     NOT NULL DEFAULT 10 CHECK (max_attempts > 0),
    next_attempt_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    lease_expires_at  TIMESTAMPTZ,
    -- A fresh value from outbox_fencing_token at every lease; completions must present it.
    fencing_token     BIGINT      NOT NULL DEFAULT 0,
    leased_by         TEXT,
    last_status       INTEGER,
    last_error        TEXT,
    last_response     TEXT,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at      TIMESTAMPTZ
);

CREATE INDEX outbox_due_idx ON outbox (next_attempt_at)
    WHERE state IN ('pending', 'retryable', 'uncertain');
CREATE INDEX outbox_lease_idx ON outbox (lease_expires_at) WHERE state = 'in_progress';
CREATE INDEX outbox_event_key_idx ON outbox (event_key);

-- Every attempt of every operation, whatever happened to its lease.
CREATE TABLE outbox_attempts (
    id                BIGSERIAL   PRIMARY KEY,
    outbox_id         BIGINT      NOT NULL REFERENCES outbox (id),
    fencing_token     BIGINT      NOT NULL,
    worker            TEXT        NOT NULL,
    kind              TEXT        NOT NULL CHECK (kind IN ('deliver', 'reconcile')),
    idempotency_key   TEXT        NOT NULL,
    payload_sha256    BYTEA       NOT NULL,
    started_at        TIMESTAMPTZ NOT NULL,
    duration_ms       INTEGER     NOT NULL,
    status_code       INTEGER,
    error             TEXT,
    outcome           TEXT        NOT NULL,
    -- False when the lease had been taken over: the attempt changed nothing.
    applied           BOOLEAN     NOT NULL
);

CREATE INDEX outbox_attempts_outbox_idx ON outbox_attempts (outbox_id, id);

-- Dead letters an operator replayed.
ALTER TABLE dead_letters ADD COLUMN replayed_at TIMESTAMPTZ;

-- Every operator action, with the state before and after.
CREATE TABLE operator_actions (
    id                BIGSERIAL   PRIMARY KEY,
    actor             TEXT        NOT NULL,
    at                TIMESTAMPTZ NOT NULL DEFAULT now(),
    action            TEXT        NOT NULL,
    target            TEXT        NOT NULL,
    reason            TEXT,
    state_before      TEXT,
    state_after       TEXT
);
