//! The operator path: inspect events, operations and dead letters, move them between the states
//! that allow it, and see the whole system on one screen.
//!
//! One [`Desk`] assembles the operator's world; the command line ([`cli`], a file per command)
//! and the console hold a desk and call it. The read model owns the SQL the operator reads:
//! the event search ([`search`], keyset pages), an event's story ([`story`], typed moments) and
//! the status screen ([`status`]). Every change is one transaction with its audit row
//! ([`crate::audit`]); the SQL of a change lives with the table's owner ([`crate::claims`],
//! [`crate::outbox`], [`crate::effect::ledger`]).

mod bulk_retry;
#[cfg(feature = "cli")]
pub mod cli;
pub mod counts;
pub mod dead_letters;
mod desk;
pub mod events;
pub mod expired;
#[cfg(feature = "cli")]
pub mod render;
pub mod replay;
mod retry;
pub mod search;
pub mod status;
pub mod story;

pub use desk::{Desk, DeskSettings, ReplayEffects};

pub use crate::audit::{Act, Change};

/// Why an operator's request was refused or failed. Each refusal changes nothing.
#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("no event has the key {0:?}")]
    NoSuchEvent(String),
    #[error("no dead letter has the id {0}")]
    NoSuchDeadLetter(i64),
    #[error("dead letter {0} can never be replayed: its bytes were erased (events erase)")]
    LetterErased(i64),
    #[error("{0} is done; a done operation is not sent again")]
    AlreadyDone(String),
    #[error("{0} can never be sent again: its body was erased (events erase); it stays as it is")]
    BodyErased(String),
    #[error("{0} is past its destination's idempotency window after an attempt whose outcome is unknown: sent again, the downstream could apply it twice; reconcile it with the downstream, or send it with --accept-duplicate-risk (audited)")]
    PastWindow(String),
    #[error("{target} is {state}: it is already on its way")]
    OnItsWay { target: String, state: String },
    #[error("{0} is being sent right now; resolve it when its lease has ended")]
    LeaseLive(String),
    #[error("{key} is {status}: only a failed or deferred effect or a failed, uncertain or dead operation is retried")]
    NotRetryable { key: String, status: String },
    #[error("{0} has nothing to resolve: its claim and operations are settled")]
    NothingToResolve(String),
    #[error("{key} failed with the effects {recorded}; --effect would run {given} instead and skip some: retry without --effect")]
    OtherEffects {
        key: String,
        recorded: Box<serde_json::Value>,
        given: Box<serde_json::Value>,
    },
    #[error("the effects {0} failed with are not recorded (a library effect): pass --effect")]
    EffectNotRecorded(String),
    #[error("the effect failed again for {key}: {error:#}")]
    EffectFailed { key: String, error: anyhow::Error },
    #[error("{key} is still not ready: {reason}; it stays deferred, due again at {due}")]
    StillDeferred {
        key: String,
        reason: String,
        due: chrono::DateTime<chrono::Utc>,
    },
    #[error("{0} has no expired replay waiting for an operator")]
    NoExpiredReplay(String),
    #[error("{0} was claimed since it was caught as an expired replay: it already had its effect; drop the expired replay instead")]
    ClaimedSince(String),
    #[error("{0} is not paused")]
    NotPaused(String),
    #[error("{0:?} is not a source name: name it as its events carry it, such as stripe")]
    NotASource(String),
    #[error("{0} is not a destination: name its origin, such as https://api.stripe.com")]
    NotAnOrigin(String),
    #[error("the database: {0}")]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Unexpected(#[from] anyhow::Error),
}
