-- The business boundary: operations keyed by the obligation they fulfil, and the downstream's
-- idempotency window (docs/outbox.md, "Obligations" and "The idempotency window").

-- An obligation's operation, claimed by the first event that names it, in that event's
-- transaction: operation_key is `{source}:{obligation}#{operation}`. route_key is '' for a source
-- routed by event key (one obligation per database) and the route key otherwise; with several
-- databases the source must be routed by the obligation's own field, so every event naming it is
-- claimed on the database that holds it. The row goes with its event's claim when prune deletes
-- it.
CREATE TABLE operation_obligations (
    operation_key    TEXT        COLLATE "C" NOT NULL,
    route_key        TEXT        COLLATE "C" NOT NULL,
    -- The event whose operation it is, and that event's claim's route key.
    event_key        TEXT        COLLATE "C" NOT NULL,
    event_route_key  TEXT        COLLATE "C" NOT NULL,
    claimed_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (operation_key, route_key)
);
CREATE INDEX operation_obligations_event_idx ON operation_obligations (event_key);

-- A later event naming an obligation already claimed: it enqueued nothing, and names the event
-- whose operation fulfils it.
CREATE TABLE fulfilled_operations (
    event_key        TEXT        COLLATE "C" NOT NULL,
    route_key        TEXT        COLLATE "C" NOT NULL,
    operation        TEXT        NOT NULL,
    operation_key    TEXT        NOT NULL,
    fulfilled_by     TEXT        COLLATE "C" NOT NULL,
    recorded_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (event_key, operation, route_key),
    FOREIGN KEY (event_key, route_key)
        REFERENCES processed_events (event_key, route_key) ON DELETE CASCADE
);

-- The idempotency window: when the first attempt whose outcome is unknown started (the request
-- may have been applied), until when the downstream honours the key for it (NULL: forever, or
-- not yet known), and when the dispatcher stopped sending it because the window had passed.
-- A held operation is `uncertain` and waits for an operator.
ALTER TABLE outbox ADD COLUMN maybe_applied_at TIMESTAMPTZ;
ALTER TABLE outbox ADD COLUMN idempotent_until TIMESTAMPTZ;
ALTER TABLE outbox ADD COLUMN held_at TIMESTAMPTZ;

-- Operations that may have been applied before this migration: their window runs from their
-- first attempt without an answer (a lease still held counts from its start).
UPDATE outbox o SET maybe_applied_at = coalesce(
        (SELECT min(a.started_at) FROM outbox_attempts a
         WHERE a.outbox_id = o.id AND a.route_key = o.route_key
           AND a.outcome IN ('uncertain', 'reconcile_unknown')),
        CASE WHEN o.state IN ('in_progress', 'uncertain') THEN o.updated_at END)
    WHERE o.state <> 'done';

-- Held operations are never due: the indexes the dispatcher leases through leave them out, so
-- a long outage's held backlog costs its scans nothing.
DROP INDEX outbox_due_idx;
CREATE INDEX outbox_due_idx ON outbox (next_attempt_at)
    WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL;
DROP INDEX outbox_origin_due_idx;
CREATE INDEX outbox_origin_due_idx ON outbox (origin, next_attempt_at)
    WHERE state IN ('pending', 'retryable', 'uncertain') AND held_at IS NULL;
CREATE INDEX outbox_held_idx ON outbox (held_at) WHERE held_at IS NOT NULL;
