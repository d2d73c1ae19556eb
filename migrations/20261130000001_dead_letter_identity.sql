-- A dead letter is identified by its place on the topic and by its bytes: after a log
-- truncation or a recreated topic, a different bad message at a reused offset is kept too,
-- while a redelivery of the same message is still stored once.
ALTER TABLE dead_letters
    ADD COLUMN message_sha256 BYTEA NOT NULL GENERATED ALWAYS AS (
        sha256(int4send(coalesce(length(raw_key), -1)) || coalesce(raw_key, ''::bytea)
               || coalesce(raw_value, ''::bytea))) STORED;

ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_kafka_topic_kafka_partition_kafka_offset_key;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_message_key
    UNIQUE (kafka_topic, kafka_partition, kafka_offset, message_sha256);
