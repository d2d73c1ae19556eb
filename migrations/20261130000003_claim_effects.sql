-- The effects a failed claim's consumer was configured with, so that `events retry` runs the
-- same ones again (a chain of a ledger row and an outbox operation, with its target) without
-- the operator naming them. NULL for effects that cannot be rebuilt by name (library effects).
ALTER TABLE processed_events ADD COLUMN effect_spec JSONB;
