//! What became of one consumed event: the outcomes the events counter labels.

/// What became of one consumed event, as `replayproof_consume_events_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Claimed here, its effect committed.
    Applied,
    /// A replay of a key claimed before with the same payload.
    Duplicate,
    /// A key claimed before with another payload.
    Conflict,
    /// Not an envelope, or a value PostgreSQL refused.
    DeadLetter,
    /// Its effect failed every attempt.
    Failed,
    /// Its effect said "not yet".
    Deferred,
    /// Its key unknown and older than its source's prune horizon.
    ExpiredReplay,
    /// A message that carries no event, passed over: a Debezium tombstone.
    Skipped,
}

impl Outcome {
    /// Every outcome, in the order of [`super::BatchReport::by_source`]'s counts.
    pub const ALL: [Outcome; 8] = [
        Outcome::Applied,
        Outcome::Duplicate,
        Outcome::Conflict,
        Outcome::DeadLetter,
        Outcome::Failed,
        Outcome::Deferred,
        Outcome::ExpiredReplay,
        Outcome::Skipped,
    ];

    /// The `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Duplicate => "duplicate",
            Outcome::Conflict => "conflict",
            Outcome::DeadLetter => "dead_letter",
            Outcome::Failed => "failed",
            Outcome::Deferred => "deferred",
            Outcome::ExpiredReplay => "expired_replay",
            Outcome::Skipped => "skipped",
        }
    }
}
