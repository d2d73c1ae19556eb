-- Deferred claims: an effect answered "not yet" (the event refers to something that has not
-- arrived). The claim is committed in state 'deferred' with its payload, the time its effect is
-- due again and the deadline after which it is settled 'failed' for an operator. The consumer's
-- background task applies due claims, each in its own transaction with the move to 'done'.
ALTER TABLE processed_events DROP CONSTRAINT processed_events_status_check;
ALTER TABLE processed_events ADD CONSTRAINT processed_events_status_check CHECK (status IN
    ('in_progress', 'done', 'failed', 'deferred', 'pending', 'retryable', 'uncertain', 'dead'));

ALTER TABLE processed_events ADD COLUMN due_at TIMESTAMPTZ;
ALTER TABLE processed_events ADD COLUMN deadline_at TIMESTAMPTZ;
-- Why the effect deferred, the last time it did.
ALTER TABLE processed_events ADD COLUMN deferred_reason TEXT;
ALTER TABLE processed_events ADD CONSTRAINT processed_events_deferred_due_check
    CHECK (status <> 'deferred' OR (due_at IS NOT NULL AND deadline_at IS NOT NULL AND payload IS NOT NULL));

-- What the background task asks for: the due claims of one topic, soonest first.
CREATE INDEX processed_events_due_idx ON processed_events (kafka_topic, due_at)
    WHERE status = 'deferred';

-- The newest version of each object applied so far, for effects that keep an object's latest
-- state (`replayproof::effect::newest`): an event older than what was applied changes nothing.
CREATE TABLE object_versions (
    kind        TEXT        COLLATE "C" NOT NULL,
    object_id   TEXT        COLLATE "C" NOT NULL,
    version     BIGINT      NOT NULL,
    event_key   TEXT        COLLATE "C" NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (kind, object_id)
);
