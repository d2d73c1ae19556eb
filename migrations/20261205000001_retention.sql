-- Retention: claims are kept as long as their source's senders redeliver, then pruned
-- (`replayproof prune`), with what hangs off them.

-- A pruned claim takes its outbox operations and their attempts with it. Prune only ever
-- deletes a claim whose operations are all settled.
ALTER TABLE outbox DROP CONSTRAINT outbox_event_key_fkey;
ALTER TABLE outbox ADD CONSTRAINT outbox_event_key_fkey
    FOREIGN KEY (event_key) REFERENCES processed_events (event_key) ON DELETE CASCADE;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_outbox_id_fkey;
ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_outbox_id_fkey
    FOREIGN KEY (outbox_id) REFERENCES outbox (id) ON DELETE CASCADE;

-- What prune looks for: the oldest claims of one source.
CREATE INDEX processed_events_age_idx ON processed_events (source, claimed_at);
-- The other tables are pruned by age.
CREATE INDEX key_conflicts_age_idx ON key_conflicts (last_seen_at);
CREATE INDEX delivery_fingerprints_age_idx ON delivery_fingerprints (first_seen_at);
CREATE INDEX dead_letters_age_idx ON dead_letters (created_at);
CREATE INDEX operator_actions_age_idx ON operator_actions (at);
CREATE INDEX outbox_attempts_age_idx ON outbox_attempts (started_at);
CREATE INDEX ledger_age_idx ON ledger (applied_at);
-- Operations that are not done, counted exactly by the gauges (the done ones are estimated).
CREATE INDEX outbox_unsettled_idx ON outbox (state) WHERE state <> 'done';
CREATE INDEX dead_letters_not_replayed_idx ON dead_letters (created_at) WHERE replayed_at IS NULL;

-- When a payload was erased (payload retention or `events erase`): the key, the hash and the
-- status stay, so dedupe still holds.
ALTER TABLE processed_events ADD COLUMN payload_erased_at TIMESTAMPTZ;
ALTER TABLE outbox ADD COLUMN payload_erased_at TIMESTAMPTZ;
ALTER TABLE ledger ADD COLUMN payload_erased_at TIMESTAMPTZ;
ALTER TABLE key_conflicts ADD COLUMN payload_erased_at TIMESTAMPTZ;

-- How far each source's claims have been pruned: every claim of the source claimed before
-- `pruned_before` may be gone. Prune moves it forward (never back) before it deletes anything,
-- under an exclusive advisory lock that every consuming transaction holds shared while it
-- decides whether an event is an expired replay (see `claim_horizons`).
CREATE TABLE prune_horizons (
    source          TEXT        PRIMARY KEY,
    pruned_before   TIMESTAMPTZ NOT NULL,
    -- How far a sender's clock may run ahead of the database's: an event that happened before
    -- pruned_before plus this may have had its claim pruned. A fraction of short retentions.
    clock_margin    INTERVAL    NOT NULL DEFAULT '5 minutes',
    updated_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The horizons of `sources` (with their clock margins), each read after taking its advisory lock shared for the rest of the
-- caller's transaction: prune cannot move a horizon the transaction has read until it ends.
-- Locks are taken in one order (the sources sorted), and a function's statements each read a
-- fresh snapshot, so the horizon read is the one in force once the lock is held.
CREATE FUNCTION claim_horizons(sources TEXT[])
RETURNS TABLE (source TEXT, expired_before TIMESTAMPTZ)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtext('replayproof.prune'), hashtext(s))
    FROM (SELECT DISTINCT unnest(sources) COLLATE "C" AS s ORDER BY 1) AS sorted;
    RETURN QUERY
        SELECT h.source, h.pruned_before + h.clock_margin
        FROM prune_horizons h WHERE h.source = ANY(sources);
END
$$;

-- Events that arrived after their key could have been pruned: the key is unknown and the event
-- is older than its source's prune horizon. Not applied: kept for an operator to apply or drop.
CREATE TABLE expired_replays (
    id               BIGSERIAL   PRIMARY KEY,
    event_key        TEXT        COLLATE "C" NOT NULL,
    source           TEXT        NOT NULL,
    event_type       TEXT,
    occurred_at      TIMESTAMPTZ NOT NULL,
    received_at      TIMESTAMPTZ,
    -- The source's prune horizon when the event was caught.
    pruned_before    TIMESTAMPTZ NOT NULL,
    payload_sha256   BYTEA       NOT NULL CHECK (octet_length(payload_sha256) = 32),
    payload          JSONB,
    effect_spec      JSONB,
    kafka_topic      TEXT        NOT NULL,
    kafka_partition  INTEGER     NOT NULL,
    kafka_offset     BIGINT      NOT NULL,
    first_seen_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    times_seen       BIGINT      NOT NULL DEFAULT 1,
    -- NULL until an operator applies it (its claim is then made) or drops it.
    resolution       TEXT        CHECK (resolution IN ('applied', 'dropped')),
    resolved_at      TIMESTAMPTZ,
    UNIQUE (event_key, payload_sha256)
);

CREATE INDEX expired_replays_open_idx ON expired_replays (first_seen_at) WHERE resolution IS NULL;
