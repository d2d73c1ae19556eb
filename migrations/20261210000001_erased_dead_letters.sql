-- When `events erase` removed a dead letter's bytes: it is kept (its place on the topic, its
-- reason) but can never be replayed.
ALTER TABLE dead_letters ADD COLUMN payload_erased_at TIMESTAMPTZ;
