-- What the consumers did, minute by minute and partition by partition, on the first database:
-- events applied, duplicates suppressed, dead letters, and the partition's lag (the last
-- reading of the minute). Each consumer adds its counts every few seconds, out of its batches'
-- transactions; the console's overview draws the last hour from it. Rows older than a day are
-- deleted by the consumers' own writes.
CREATE TABLE activity_minutes (
    topic         TEXT        COLLATE "C" NOT NULL,
    partition     INT         NOT NULL,
    minute        TIMESTAMPTZ NOT NULL,
    applied       BIGINT      NOT NULL DEFAULT 0,
    suppressed    BIGINT      NOT NULL DEFAULT 0,
    dead_letters  BIGINT      NOT NULL DEFAULT 0,
    lag           BIGINT,
    PRIMARY KEY (topic, minute, partition)
);
