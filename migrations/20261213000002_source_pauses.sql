-- An operator's pause of a source (docs/operations.md, "Pausing a source"), on the first
-- database: while a row is here the consumers hold the source's events (claimed, deferred,
-- never applied) and the deferred applier leaves them waiting; once it is deleted they are
-- applied, each once. Set and cleared by `sources pause` and `sources resume`, each in one
-- transaction with its audit row. Ingest does not read it: deliveries keep being accepted.
CREATE TABLE source_pauses (
    source      TEXT        COLLATE "C" PRIMARY KEY,
    paused_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    paused_by   TEXT        NOT NULL,
    reason      TEXT        NOT NULL
);
