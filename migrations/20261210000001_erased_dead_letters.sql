-- When `events erase` removed a dead letter's bytes: it is kept (its place on the topic, its
-- reason) but can never be replayed.
ALTER TABLE dead_letters ADD COLUMN payload_erased_at TIMESTAMPTZ;

-- A dead letter's identity must outlive its bytes: were it recomputed from the erased value, a
-- redelivery of the same message would be stored again with its bytes, undoing the erasure.
-- The hash an erasure keeps stands for the bytes it removed.
ALTER TABLE dead_letters ADD COLUMN erased_sha256 BYTEA;
ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_message_key;
ALTER TABLE dead_letters DROP COLUMN message_sha256;
ALTER TABLE dead_letters
    ADD COLUMN message_sha256 BYTEA NOT NULL GENERATED ALWAYS AS (
        coalesce(erased_sha256,
                 sha256(int4send(coalesce(length(raw_key), -1)) || coalesce(raw_key, ''::bytea)
                        || coalesce(raw_value, ''::bytea)))) STORED;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_message_key
    UNIQUE (kafka_topic, kafka_partition, kafka_offset, message_sha256, route_key);
