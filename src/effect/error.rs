//! An effect's answer when it did not apply: one typed value whose meaning is decided here, once.

use super::Deferred;
use crate::envelope::Malformed;

/// Why an effect did not apply its event, and so what happens to the event's claim (the rule is
/// [`crate::consume::settle`]).
///
/// `?` keeps working in an effect: an [`anyhow::Error`] or a [`sqlx::Error`] becomes
/// [`EffectError::Transient`] when a database error in it says nothing about the event
/// ([`crate::db::is_transient`]: a lost connection, a timeout, a deadlock, a full disk, a
/// read-only database, a missing table or privilege), and [`EffectError::Failed`] otherwise; an
/// unreadable payload ([`Malformed`]) is [`EffectError::Permanent`]; a [`Deferred`] is
/// [`EffectError::NotYet`].
#[derive(Debug, thiserror::Error)]
pub enum EffectError {
    /// Not yet: the event refers to something that has not arrived. The claim is committed
    /// `deferred` with the payload and applied again when due.
    #[error(transparent)]
    NotYet(#[from] Deferred),
    /// Will fail the same way every time: the event is settled `failed` at once.
    #[error("{0:#}")]
    Permanent(anyhow::Error),
    /// Says nothing about the event: the batch rolls back and is retried; nothing settles.
    #[error("{0:#}")]
    Transient(anyhow::Error),
    /// Probably fails the same way again: the event alone is retried a few times, then settled
    /// `failed` with the error for an operator.
    #[error("{0:#}")]
    Failed(anyhow::Error),
}

/// How an effect's error is handled; [`EffectError::kind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Says nothing about the event: roll the batch back and retry it later, settling nothing.
    Transient,
    /// Probably fails the same way again: retry the event a few times, then settle it `failed`.
    Deterministic,
    /// Will fail the same way every time: settle the event `failed` at once.
    Permanent,
    /// Not yet ([`Deferred`]): settle the claim `deferred` and apply the event again when due.
    Deferred,
}

impl EffectError {
    /// A permanent failure: the event is settled `failed` without retries.
    pub fn permanent(error: impl Into<anyhow::Error>) -> Self {
        Self::Permanent(error.into())
    }

    /// A transient failure: the batch rolls back and is retried, nothing settles.
    pub fn transient(error: impl Into<anyhow::Error>) -> Self {
        Self::Transient(error.into())
    }

    /// What the answer means for the event.
    pub fn kind(&self) -> FailureKind {
        match self {
            Self::NotYet(_) => FailureKind::Deferred,
            Self::Permanent(_) => FailureKind::Permanent,
            Self::Transient(_) => FailureKind::Transient,
            Self::Failed(_) => FailureKind::Deterministic,
        }
    }

    /// Whether the whole batch should roll back and run again, settling nothing.
    pub fn is_transient(&self) -> bool {
        self.kind() == FailureKind::Transient
    }
}

impl From<anyhow::Error> for EffectError {
    fn from(error: anyhow::Error) -> Self {
        match crate::db::database_error(&error) {
            Some(db) if crate::db::is_transient(db) => Self::Transient(error),
            _ => Self::Failed(error),
        }
    }
}

impl From<sqlx::Error> for EffectError {
    fn from(error: sqlx::Error) -> Self {
        match crate::db::is_transient(&error) {
            true => Self::Transient(error.into()),
            false => Self::Failed(error.into()),
        }
    }
}

/// A payload that cannot be read now never will be.
impl From<Malformed> for EffectError {
    fn from(error: Malformed) -> Self {
        Self::Permanent(error.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn database(code: &'static str) -> sqlx::Error {
        #[derive(Debug)]
        struct Coded(&'static str);
        impl std::fmt::Display for Coded {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "SQLSTATE {}", self.0)
            }
        }
        impl std::error::Error for Coded {}
        impl sqlx::error::DatabaseError for Coded {
            fn message(&self) -> &str {
                self.0
            }
            fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
                Some(self.0.into())
            }
            fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
                self
            }
            fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
                self
            }
            fn kind(&self) -> sqlx::error::ErrorKind {
                sqlx::error::ErrorKind::Other
            }
        }
        sqlx::Error::Database(Box::new(Coded(code)))
    }

    #[test]
    fn the_sqlstate_decides_whether_a_database_error_is_transient_wrapped_or_not() {
        let kind = |e: EffectError| e.kind();
        assert_eq!(kind(database("40P01").into()), FailureKind::Transient);
        assert_eq!(kind(database("23505").into()), FailureKind::Deterministic);
        let wrapped = anyhow::Error::from(database("57014")).context("writing the order");
        assert_eq!(kind(wrapped.into()), FailureKind::Transient);
        let wrapped = anyhow::Error::from(database("23514")).context("writing the order");
        assert_eq!(kind(wrapped.into()), FailureKind::Deterministic);
        assert_eq!(
            kind(anyhow::anyhow!("no").into()),
            FailureKind::Deterministic
        );
    }

    #[test]
    fn each_answer_has_one_meaning_and_keeps_its_text() {
        let not_yet: EffectError = Deferred::new("order 42 has not arrived").into();
        assert_eq!(not_yet.kind(), FailureKind::Deferred);
        assert_eq!(not_yet.to_string(), "deferred: order 42 has not arrived");
        let permanent = EffectError::permanent(anyhow::anyhow!("inner").context("outer"));
        assert_eq!(permanent.kind(), FailureKind::Permanent);
        assert_eq!(permanent.to_string(), "outer: inner");
        assert!(EffectError::transient(anyhow::anyhow!("x")).is_transient());
        let malformed: EffectError = Malformed::TooDeep.into();
        assert_eq!(malformed.kind(), FailureKind::Permanent);
    }
}
