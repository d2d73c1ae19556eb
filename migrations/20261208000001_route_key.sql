-- Every row that belongs to an event carries its route key, the column the tables are
-- distributed by when the claims are spread over several databases or Citus shards
-- (docs/scaling.md). Until a source routes by a tenant field it is the event key, which
-- existing rows are given here. Every primary key, unique constraint, foreign key and
-- ON CONFLICT target includes it, as Citus requires of a distributed table's unique keys, so
-- each claim, its conflicts, its outbox operations and their attempts live on one shard and
-- commit in one transaction there.
--
-- This rewrites the tables once; on a large deployment run it in a maintenance window.

DROP VIEW event_summaries;

ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_outbox_id_fkey;
ALTER TABLE outbox DROP CONSTRAINT outbox_event_key_fkey;

-- Claims: (event_key, route_key), so a lookup by event key alone still uses the key.
ALTER TABLE processed_events ADD COLUMN route_key TEXT COLLATE "C";
UPDATE processed_events SET route_key = event_key;
ALTER TABLE processed_events ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE processed_events DROP CONSTRAINT processed_events_pkey;
ALTER TABLE processed_events ADD CONSTRAINT processed_events_pkey PRIMARY KEY (event_key, route_key);

ALTER TABLE key_conflicts ADD COLUMN route_key TEXT COLLATE "C";
UPDATE key_conflicts SET route_key = event_key;
ALTER TABLE key_conflicts ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE key_conflicts DROP CONSTRAINT key_conflicts_pkey;
ALTER TABLE key_conflicts ADD CONSTRAINT key_conflicts_pkey
    PRIMARY KEY (event_key, payload_sha256, route_key);

-- The replay guard finds a signed body delivered again under another key among the bodies of
-- its route: the tenant's for sources that route by tenant, '' for sources routed by event key
-- (every body in a single database; with shards, the bodies each shard saw).
ALTER TABLE delivery_fingerprints ADD COLUMN route_key TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE delivery_fingerprints ALTER COLUMN event_key TYPE TEXT COLLATE "C";
ALTER TABLE delivery_fingerprints DROP CONSTRAINT delivery_fingerprints_pkey;
ALTER TABLE delivery_fingerprints ADD CONSTRAINT delivery_fingerprints_pkey
    PRIMARY KEY (source, payload_sha256, route_key);

ALTER TABLE expired_replays ADD COLUMN route_key TEXT COLLATE "C";
UPDATE expired_replays SET route_key = event_key;
ALTER TABLE expired_replays ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE expired_replays DROP CONSTRAINT expired_replays_pkey;
ALTER TABLE expired_replays ADD CONSTRAINT expired_replays_pkey PRIMARY KEY (id, route_key);
ALTER TABLE expired_replays DROP CONSTRAINT expired_replays_event_key_payload_sha256_key;
ALTER TABLE expired_replays ADD CONSTRAINT expired_replays_event_key
    UNIQUE (event_key, payload_sha256, route_key);

ALTER TABLE outbox ADD COLUMN route_key TEXT COLLATE "C";
UPDATE outbox SET route_key = event_key;
ALTER TABLE outbox ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE outbox DROP CONSTRAINT outbox_pkey;
ALTER TABLE outbox ADD CONSTRAINT outbox_pkey PRIMARY KEY (id, route_key);
ALTER TABLE outbox DROP CONSTRAINT outbox_operation_key_key;
ALTER TABLE outbox ADD CONSTRAINT outbox_operation_key UNIQUE (operation_key, route_key);
ALTER TABLE outbox ADD CONSTRAINT outbox_event_key_fkey FOREIGN KEY (event_key, route_key)
    REFERENCES processed_events (event_key, route_key) ON DELETE CASCADE;

ALTER TABLE outbox_attempts ADD COLUMN route_key TEXT COLLATE "C";
UPDATE outbox_attempts a SET route_key = o.route_key FROM outbox o WHERE o.id = a.outbox_id;
ALTER TABLE outbox_attempts ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_pkey;
ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_pkey PRIMARY KEY (id, route_key);
ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_outbox_id_fkey
    FOREIGN KEY (outbox_id, route_key) REFERENCES outbox (id, route_key) ON DELETE CASCADE;

-- The built-in ledger effect's rows live with their claims.
ALTER TABLE ledger ADD COLUMN route_key TEXT COLLATE "C";
UPDATE ledger SET route_key = event_key;
ALTER TABLE ledger ALTER COLUMN route_key SET NOT NULL;
ALTER TABLE ledger DROP CONSTRAINT ledger_pkey;
ALTER TABLE ledger ADD CONSTRAINT ledger_pkey PRIMARY KEY (id, route_key);

-- The newest-wins effect's versions are kept per route: '' for events of sources that route
-- by event key (one version per object in a single database, as before), the tenant's key for
-- sources that route by tenant (one per object and tenant, on the tenant's shard).
ALTER TABLE object_versions ADD COLUMN route_key TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE object_versions DROP CONSTRAINT object_versions_pkey;
ALTER TABLE object_versions ADD CONSTRAINT object_versions_pkey
    PRIMARY KEY (kind, object_id, route_key);

-- A dead letter has no usable key: its route key is '' and it lives on the first shard (with
-- Citus, on the shard of ''), whatever its raw key.
ALTER TABLE dead_letters ADD COLUMN route_key TEXT COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_pkey;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_pkey PRIMARY KEY (id, route_key);
ALTER TABLE dead_letters DROP CONSTRAINT dead_letters_message_key;
ALTER TABLE dead_letters ADD CONSTRAINT dead_letters_message_key
    UNIQUE (kafka_topic, kafka_partition, kafka_offset, message_sha256, route_key);

-- Lookups by id alone (the operator's, the dispatcher's) keep an index of their own.
CREATE INDEX outbox_id_idx ON outbox (id);
CREATE INDEX dead_letters_id_idx ON dead_letters (id);
CREATE INDEX expired_replays_id_idx ON expired_replays (id);

CREATE VIEW event_summaries AS
SELECT p.event_key,
       p.source,
       p.event_type,
       p.status AS claim,
       (SELECT string_agg(o.operation || '=' || o.state, ', ' ORDER BY o.operation)
          FROM outbox o WHERE o.event_key = p.event_key AND o.route_key = p.route_key) AS operations,
       (SELECT coalesce(array_agg(o.state), '{}')
          FROM outbox o WHERE o.event_key = p.event_key AND o.route_key = p.route_key) AS operation_states,
       p.attempts,
       p.claimed_at,
       p.route_key
FROM processed_events p;
