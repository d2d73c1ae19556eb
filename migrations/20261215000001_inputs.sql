-- Every header of a dead-lettered message, name and value in turn (a null value as NULL): a
-- CloudEvent in binary mode carries its attributes there, an outbox message its event id, so a
-- replay must write them again.
ALTER TABLE dead_letters ADD COLUMN raw_headers BYTEA[];

-- What a message said of its event beyond the envelope (a CloudEvent's attributes, an outbox
-- message's headers), kept wherever the event's payload is kept, so an effect tried again reads
-- the same.
ALTER TABLE processed_events ADD COLUMN attributes JSONB;
ALTER TABLE expired_replays ADD COLUMN attributes JSONB;
