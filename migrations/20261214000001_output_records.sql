-- Records for Kafka output topics (docs/kafka-output.md): enqueued in the consume transaction
-- with the claim, produced afterwards by the relay in `replayproof dispatch --brokers`.
CREATE TABLE output_records (
    -- Enqueue order: a partition's records are sent in this order.
    id               BIGSERIAL   NOT NULL,
    route_key        TEXT        COLLATE "C" NOT NULL,
    event_key        TEXT        COLLATE "C" NOT NULL,
    -- The record's name among its event's records ('kafka' for the built-in effect).
    name             TEXT        NOT NULL,
    -- event_key '#' name: the `replayproof-record-id` header the read-back finds it by (among
    -- the partition's pending records: no index of its own, which every write would pay for).
    record_id        TEXT        COLLATE "C" NOT NULL,
    topic            TEXT        NOT NULL,
    record_key       BYTEA,
    value            BYTEA,
    -- The headers in order, as [[name, value], ...]; the record id is added when sent.
    headers          JSONB       NOT NULL DEFAULT '[]',
    -- Fixed once, before the first send: murmur2 of the key over the topic's partition count.
    kafka_partition  INTEGER,
    partition_count  INTEGER,
    -- pending: not known to be in the topic. sent: in the topic at kafka_offset.
    state            TEXT        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent')),
    kafka_offset     BIGINT,
    -- How it is known to be in the topic: the broker's ack, the read-back of a partition
    -- after an unknown outcome, or a committed Kafka transaction.
    confirmed_by     TEXT        CHECK (confirmed_by IN ('ack', 'read-back', 'transaction')),
    enqueued_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    sent_at          TIMESTAMPTZ,
    -- route_key in every unique key, as the distributed tables keep it (docs/scaling.md).
    PRIMARY KEY (route_key, id),
    UNIQUE (route_key, event_key, name)
);

CREATE INDEX output_records_unassigned_idx ON output_records (topic, id)
    WHERE kafka_partition IS NULL;
CREATE INDEX output_records_pending_idx ON output_records (topic, kafka_partition, id)
    WHERE state = 'pending';
CREATE INDEX output_records_sent_idx ON output_records (sent_at) WHERE state = 'sent';

-- One row per output partition: the relay that owns it (a lease with a fencing epoch) and
-- where a read-back after an unknown outcome starts.
CREATE TABLE output_partitions (
    topic            TEXT        NOT NULL,
    kafka_partition  INTEGER     NOT NULL,
    -- The topic's partition count when its records were first partitioned; another count
    -- stops the partition's relay.
    partition_count  INTEGER     NOT NULL,
    owner            TEXT,
    -- Raised at every lease; the owner's writes present it.
    epoch            BIGINT      NOT NULL DEFAULT 0,
    lease_until      TIMESTAMPTZ,
    -- True from before a send until its outcome is recorded: the next owner reads back first.
    in_doubt         BOOLEAN     NOT NULL DEFAULT false,
    -- No record of this database sent before this offset is pending an outcome.
    readback_from    BIGINT,
    -- Why the relay stopped this partition (a changed partition count, a missing topic).
    stopped          TEXT,
    stopped_at       TIMESTAMPTZ,
    last_sent_at     TIMESTAMPTZ,
    -- The row's own token: with --kafka-transactions, part of the partition's transactional
    -- id, so relays of two databases writing to one topic never fence each other.
    producer_token   TEXT        NOT NULL DEFAULT md5(random()::text || clock_timestamp()::text),
    PRIMARY KEY (topic, kafka_partition)
);
