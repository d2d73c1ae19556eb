-- The console and `events list` page by keyset, newest first, over every event.
CREATE INDEX processed_events_claimed_idx ON processed_events (claimed_at, event_key);

-- An event's story finds the operator actions on its key and on its operations (key#operation),
-- compared byte by byte whatever the database's collation.
CREATE INDEX operator_actions_target_idx ON operator_actions (target text_pattern_ops, at);

-- An event's story finds its dead letters by their raw key. A hash index, so that no key is
-- too long to index and a dead letter is never refused for its key's size.
CREATE INDEX dead_letters_raw_key_idx ON dead_letters USING hash (raw_key);

-- Each attempt keeps the start of the downstream's answer, as the operation's last one does.
ALTER TABLE outbox_attempts ADD COLUMN response_excerpt TEXT;
