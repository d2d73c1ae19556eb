-- Which buckets this database holds (docs/scaling.md): written by `migrate` (or by the first
-- replayproof process that finds none), checked by every process and command that touches
-- claims before it uses the database, and changed only by `shards move`, in its own commits.
-- A list of databases given in another order, shortened or with another bucket count is then
-- refused instead of claiming keys in the wrong database.
CREATE TABLE shard_layout (
    -- One row.
    singleton   BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    -- How many buckets route keys hash into, fixed for the life of the data.
    buckets     INTEGER     NOT NULL CHECK (buckets > 0),
    -- Grows by one at every change of what the database holds.
    epoch       BIGINT      NOT NULL DEFAULT 1,
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The bucket ranges this database holds (`held`), or has in transit during a `shards move`:
-- `leaving` on the source from before the copy until its delete, `arriving` on the target
-- from the copy until the source's delete is done. Only `held` buckets may be claimed,
-- leased or applied here; a database with a range in transit is refused by every process.
CREATE TABLE shard_ranges (
    first_bucket INTEGER NOT NULL PRIMARY KEY CHECK (first_bucket >= 0),
    last_bucket  INTEGER NOT NULL CHECK (last_bucket >= first_bucket),
    state        TEXT    NOT NULL CHECK (state IN ('held', 'leaving', 'arriving'))
);
