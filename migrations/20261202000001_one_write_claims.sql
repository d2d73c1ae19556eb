-- Claims are written once, with their final status. A settled claim keeps only its payload's
-- hash, which tells a replay from a key conflict; the payload itself stays only where something
-- reads it again: failed claims, which `events retry` runs again. (The effect's own rows and the
-- outbox hold what was applied.)
ALTER TABLE processed_events ALTER COLUMN payload DROP NOT NULL;

-- Event keys compare byte by byte, as batches already order them when claiming: cheaper than a
-- locale's rules in every index probe. The view reads the key, so it is made again around it.
DROP VIEW event_summaries;
ALTER TABLE processed_events ALTER COLUMN event_key TYPE TEXT COLLATE "C";
ALTER TABLE outbox ALTER COLUMN event_key TYPE TEXT COLLATE "C";
ALTER TABLE ledger ALTER COLUMN event_key TYPE TEXT COLLATE "C";
ALTER TABLE key_conflicts ALTER COLUMN event_key TYPE TEXT COLLATE "C";
CREATE VIEW event_summaries AS
SELECT p.event_key,
       p.source,
       p.event_type,
       p.status AS claim,
       (SELECT string_agg(o.operation || '=' || o.state, ', ' ORDER BY o.operation)
          FROM outbox o WHERE o.event_key = p.event_key) AS operations,
       (SELECT coalesce(array_agg(o.state), '{}')
          FROM outbox o WHERE o.event_key = p.event_key) AS operation_states,
       p.attempts,
       p.claimed_at
FROM processed_events p;

-- Operators look for claims that are not done; the done ones, nearly all, stay out of the index.
DROP INDEX processed_events_status_idx;
CREATE INDEX processed_events_unsettled_idx ON processed_events (status, claimed_at)
    WHERE status <> 'done';
