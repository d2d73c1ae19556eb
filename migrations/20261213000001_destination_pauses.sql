-- An operator's pause of a destination (docs/operations.md, "Pausing a destination"): while it
-- holds (operator_paused_at is set and operator_pause_until, when set, is not past) no dispatcher
-- leases anything for the origin; its operations stay due and spend no attempt. Set and cleared
-- by `destinations pause` and `destinations resume`, each in one transaction with its audit row.
-- Distinct from paused_until, which is a 429's wait.
ALTER TABLE outbox_destinations
    ADD COLUMN operator_paused_at    TIMESTAMPTZ,
    ADD COLUMN operator_paused_by    TEXT,
    ADD COLUMN operator_pause_reason TEXT,
    ADD COLUMN operator_pause_until  TIMESTAMPTZ;
