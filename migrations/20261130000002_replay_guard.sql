-- The replay guard for sources that sign only the body while the event's id comes from an
-- unsigned header (GitHub, Shopify, hmac keyed by a header): the first key each signed body was
-- delivered under. The same body under another key within the source's window is a replayed
-- capture: recorded in key_conflicts with the reason, never applied.
CREATE TABLE delivery_fingerprints (
    source          TEXT        NOT NULL,
    payload_sha256  BYTEA       NOT NULL,
    event_key       TEXT        NOT NULL,
    first_seen_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (source, payload_sha256)
);

-- Why a conflict was recorded when it is not a plain reuse of a claimed key.
ALTER TABLE key_conflicts ADD COLUMN reason TEXT;
