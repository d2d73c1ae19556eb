-- Redeliveries recorded by the batch, not on each claim: a batch's deliveries of keys already
-- claimed are one row here (the keys and their offsets, in step), so a redelivery storm costs a
-- probe of the claims and one small insert per batch instead of an update of every claim. A
-- message counts once however often it is read (a restart before the offset commit, a replay by
-- time): what counts is each distinct (topic, partition, offset), never the claim's own.
CREATE TABLE redeliveries (
    id              BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kafka_topic     TEXT        NOT NULL,
    kafka_partition INTEGER     NOT NULL,
    event_keys      TEXT[]      COLLATE "C" NOT NULL,
    kafka_offsets   BIGINT[]    NOT NULL,
    seen_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (cardinality(event_keys) = cardinality(kafka_offsets) AND cardinality(event_keys) > 0)
);

CREATE INDEX redeliveries_keys_idx ON redeliveries USING gin (event_keys);
CREATE INDEX redeliveries_age_idx ON redeliveries (seen_at);

-- Each claim's deliveries as an operator reads them: those counted on the claim (the claimed
-- delivery, and redeliveries counted before this table, or carried by a shard move or a prune)
-- and the distinct positions recorded here since, with when the key was last seen.
CREATE VIEW claim_deliveries AS
SELECT p.event_key, p.route_key,
       p.deliveries + coalesce(r.n, 0) AS deliveries,
       greatest(coalesce(p.last_seen_at, p.claimed_at), r.last_seen_at) AS last_seen_at
FROM processed_events p
LEFT JOIN LATERAL (
    SELECT count(DISTINCT (x.kafka_topic, x.kafka_partition, u.o))::int4 AS n,
           max(x.seen_at) AS last_seen_at
    FROM redeliveries x, unnest(x.event_keys, x.kafka_offsets) AS u(k, o)
    WHERE x.event_keys @> ARRAY[p.event_key] AND u.k = p.event_key
      AND NOT (x.kafka_topic = p.kafka_topic AND x.kafka_partition = p.kafka_partition
               AND u.o = p.kafka_offset)
      AND NOT (x.kafka_partition IS NOT DISTINCT FROM p.last_seen_partition
               AND u.o <= p.last_seen_offset)
) r ON true;
