-- Operations that describe a real request, limits per destination, and trace context.

-- The request: its method, content type, non-secret headers ([[name, value], …]) and the name
-- of a credential the dispatcher's configuration holds (never the secret itself).
ALTER TABLE outbox ADD COLUMN method TEXT NOT NULL DEFAULT 'POST';
ALTER TABLE outbox ADD COLUMN content_type TEXT NOT NULL DEFAULT 'application/json';
ALTER TABLE outbox ADD COLUMN headers JSONB NOT NULL DEFAULT '[]';
ALTER TABLE outbox ADD COLUMN credential TEXT;
-- The W3C traceparent of the event that enqueued it: the dispatcher's request continues it.
ALTER TABLE outbox ADD COLUMN traceparent TEXT;
-- The destination's origin (scheme, host and port; the default port left out): the limits
-- of `[dispatch.destinations]` and the circuit breaker count per origin. Set at enqueue;
-- filled here for the operations still to send (done ones are never leased again).
ALTER TABLE outbox ADD COLUMN origin TEXT;
UPDATE outbox SET origin = coalesce(
        regexp_replace(
            regexp_replace(
                lower(substring(destination FROM '^[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#]*@)?[^/?#]*')),
                '^([a-z][a-z0-9+.-]*://)[^@]*@', '\1'),
            '^(https://[^/]*):443$|^(http://[^/]*):80$', '\1\2'),
        destination)
    WHERE state <> 'done';

-- Due and leased operations by origin: the dispatcher leases per origin, within its limits.
CREATE INDEX outbox_origin_due_idx ON outbox (origin, next_attempt_at)
    WHERE state IN ('pending', 'retryable', 'uncertain');
CREATE INDEX outbox_origin_leased_idx ON outbox (origin, lease_expires_at)
    WHERE state = 'in_progress';

-- Each destination's shared state, so every dispatcher process keeps one set of limits: the
-- row is locked while a dispatcher leases for its origin.
CREATE TABLE outbox_destinations (
    origin                TEXT        PRIMARY KEY,
    -- closed: requests go out. open: none until open_until. half_open: one probe is out until
    -- probe_until; its answer closes the breaker or opens it again.
    breaker               TEXT        NOT NULL DEFAULT 'closed'
                              CHECK (breaker IN ('closed', 'open', 'half_open')),
    -- Retryable failures in a row (5xx, refused, no answer); any other answer resets it.
    consecutive_failures  INTEGER     NOT NULL DEFAULT 0,
    opened_at             TIMESTAMPTZ,
    open_until            TIMESTAMPTZ,
    probe_until           TIMESTAMPTZ,
    -- A 429's Retry-After: nothing starts to this origin before then.
    paused_until          TIMESTAMPTZ,
    -- The rate limit's schedule: the earliest start of the next request.
    next_start_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at            TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Where an event came from: the ingress's request id (the provider's delivery id where it
-- has one) and the W3C traceparent of the request that carried it.
ALTER TABLE processed_events ADD COLUMN request_id TEXT;
ALTER TABLE processed_events ADD COLUMN traceparent TEXT;
