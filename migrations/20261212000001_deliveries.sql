-- Every redelivery visible (docs/operations.md, "Redeliveries"): how many times a claimed key was
-- delivered to the consumer group, and when and where it was last seen. A message counts once:
-- one read again (the group restarted before committing its offset, a replay by time) is at or
-- before the last position counted on its partition, and is not counted twice. Counted in the
-- claim's own statement, so a duplicate costs no extra round trip.
ALTER TABLE processed_events
    ADD COLUMN deliveries          INTEGER     NOT NULL DEFAULT 1,
    ADD COLUMN last_seen_at        TIMESTAMPTZ,
    ADD COLUMN last_seen_partition INTEGER,
    ADD COLUMN last_seen_offset    BIGINT;
