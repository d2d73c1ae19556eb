//! Why a batch, or one run of it, did not commit.

use crate::effect::EffectError;
use std::time::Duration;

/// Why a batch did not commit. Nothing of it committed, or (for an error from COMMIT itself) the
/// outcome is unknown; either way the offset must not move, and a retry is harmless.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// A database error: nothing committed, or the outcome of COMMIT is unknown.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// An effect failed for a reason that says nothing about its event.
    #[error("an effect failed transiently: {0:#}")]
    Transient(anyhow::Error),
    /// One of the batch's transactions ran past its time limit and was abandoned (rolled
    /// back). Applied in smaller parts, each transaction has less to do.
    #[error("a transaction of the batch took longer than {} s; abandoned, it rolled back", .0.as_secs())]
    TimedOut(Duration),
}

/// Why one run of a batch did not commit.
pub(super) enum RunError {
    /// An effect failed transiently: roll back and retry the batch later.
    Transient(EffectError),
    /// An effect failed outside a savepoint: roll back and run the batch again with savepoints.
    Unguarded,
    Database(sqlx::Error),
    /// The transaction ran past its limit: abandoned, it rolls back.
    TimedOut(Duration),
}

impl From<RunError> for BatchError {
    fn from(e: RunError) -> Self {
        match e {
            RunError::Database(e) => Self::Database(e),
            RunError::Transient(e) => Self::Transient(e.into()),
            RunError::TimedOut(limit) => Self::TimedOut(limit),
            // `run_and_commit` always reruns these guarded; never seen here.
            RunError::Unguarded => {
                Self::Transient(anyhow::anyhow!("an effect failed outside a savepoint"))
            }
        }
    }
}

impl From<sqlx::Error> for RunError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}
