-- The deferral policy in force for an event (its first wait, the cap of its waits, its
-- deadline), stored when its claim is first settled 'deferred' or 'failed': the background
-- task and an operator's retry follow the same one, whatever the process that asks was started
-- with. Humantime text: {"backoff": "10s", "max_backoff": "10m", "deadline": "1day"}.
ALTER TABLE processed_events ADD COLUMN defer_policy JSONB;
