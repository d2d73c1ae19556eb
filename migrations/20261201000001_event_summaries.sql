-- One row per claimed event with its operations' states, for the operator's lists.
CREATE VIEW event_summaries AS
SELECT p.event_key,
       p.source,
       p.event_type,
       p.status AS claim,
       (SELECT string_agg(o.operation || '=' || o.state, ', ' ORDER BY o.operation)
          FROM outbox o WHERE o.event_key = p.event_key) AS operations,
       (SELECT coalesce(array_agg(o.state), '{}')
          FROM outbox o WHERE o.event_key = p.event_key) AS operation_states,
       p.attempts,
       p.claimed_at
FROM processed_events p;
