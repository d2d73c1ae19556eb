-- Claims: one row per event key, inserted in the same transaction as the event's effect.
-- A row that exists is an event whose fate is settled (done, failed, or handed to the outbox);
-- a replay finds it and does nothing.
CREATE TABLE processed_events (
    event_key        TEXT        PRIMARY KEY CHECK (octet_length(event_key) BETWEEN 1 AND 512),
    source           TEXT        NOT NULL,
    event_type       TEXT,
    -- 'done': the effect lives in this database and committed with the claim.
    -- 'failed': the effect kept failing; the payload is kept so an operator can retry it.
    -- 'pending', 'in_progress', 'retryable', 'uncertain', 'dead': reserved for effects that
    -- leave the database and are settled later through the outbox.
    status           TEXT        NOT NULL CHECK (status IN
                         ('in_progress', 'done', 'failed', 'pending', 'retryable', 'uncertain', 'dead')),
    payload_sha256   BYTEA       NOT NULL CHECK (octet_length(payload_sha256) = 32),
    payload          JSONB       NOT NULL,
    received_at      TIMESTAMPTZ,
    kafka_topic      TEXT        NOT NULL,
    kafka_partition  INTEGER     NOT NULL,
    kafka_offset     BIGINT      NOT NULL,
    attempts         INTEGER     NOT NULL DEFAULT 0,
    last_error       TEXT,
    claimed_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at     TIMESTAMPTZ
);

CREATE INDEX processed_events_status_idx ON processed_events (status, claimed_at);

-- Same key, different payload: the first payload is kept in processed_events, every other
-- payload seen under that key is recorded here, once per distinct payload.
CREATE TABLE key_conflicts (
    event_key        TEXT        NOT NULL,
    payload_sha256   BYTEA       NOT NULL,
    payload          JSONB       NOT NULL,
    source           TEXT        NOT NULL,
    kafka_topic      TEXT        NOT NULL,
    kafka_partition  INTEGER     NOT NULL,
    kafka_offset     BIGINT      NOT NULL,
    first_seen_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    times_seen       BIGINT      NOT NULL DEFAULT 1,
    PRIMARY KEY (event_key, payload_sha256)
);

-- Messages that could not be read as an envelope, kept byte for byte with the reason.
CREATE TABLE dead_letters (
    id               BIGSERIAL   PRIMARY KEY,
    kafka_topic      TEXT        NOT NULL,
    kafka_partition  INTEGER     NOT NULL,
    kafka_offset     BIGINT      NOT NULL,
    raw_key          BYTEA,
    raw_value        BYTEA,
    reason           TEXT        NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (kafka_topic, kafka_partition, kafka_offset)
);

-- The built-in demo effect. Deliberately no unique constraint on event_key: only the claim
-- stands between a replay and a second row, so counting rows per key tests the claim.
CREATE TABLE ledger (
    id               BIGSERIAL   PRIMARY KEY,
    event_key        TEXT        NOT NULL,
    source           TEXT        NOT NULL,
    event_type       TEXT,
    payload          JSONB       NOT NULL,
    applied_at       TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE INDEX ledger_event_key_idx ON ledger (event_key);
