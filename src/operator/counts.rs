//! Counts an operator can trust: a table is counted exactly while it holds fewer than
//! [`EXACT_BELOW`] of the rows asked for, and only a bigger one is estimated from its
//! statistics, or said not analysed yet when PostgreSQL has gathered none. A small install never
//! sees `none` or `~0` beside rows that are there.

use crate::db::Db;
use serde::Serialize;

/// Below this many rows a figure is counted, not estimated.
pub const EXACT_BELOW: i64 = 10_000;

/// A figure of the status screen, and how it was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    Exact(i64),
    /// From the table's statistics: too many rows to count on every screen.
    Estimate(i64),
    /// At least this many, and the table was never analysed: no estimate yet.
    NotAnalysed(i64),
}

impl Count {
    /// The figure (a lower bound when not analysed).
    pub fn n(self) -> i64 {
        match self {
            Self::Exact(n) | Self::Estimate(n) | Self::NotAnalysed(n) => n,
        }
    }

    pub fn is_exact(self) -> bool {
        matches!(self, Self::Exact(_))
    }
}

/// Two databases' figures together: exact only when both are.
impl std::ops::Add for Count {
    type Output = Self;

    fn add(self, other: Self) -> Self {
        let n = self.n() + other.n();
        match (self, other) {
            (Self::NotAnalysed(_), _) | (_, Self::NotAnalysed(_)) => Self::NotAnalysed(n),
            (Self::Exact(_), Self::Exact(_)) => Self::Exact(n),
            _ => Self::Estimate(n),
        }
    }
}

impl Default for Count {
    fn default() -> Self {
        Self::Exact(0)
    }
}

impl std::fmt::Display for Count {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Exact(n) => write!(f, "{n}"),
            Self::Estimate(n) => write!(f, "~{n}"),
            Self::NotAnalysed(n) => write!(f, "over {n} (not analysed yet)"),
        }
    }
}

/// As its figure: `--json` keeps its numbers.
impl Serialize for Count {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i64(self.n())
    }
}

/// What a figure counts: rows of a table, some of them.
#[derive(Debug, Clone, Copy)]
pub enum Counted {
    DoneClaims,
    DoneOperations,
    DeadLetters,
    KeyConflicts,
}

impl Counted {
    /// The table, and which of its rows.
    fn rows(self) -> (&'static str, &'static str) {
        match self {
            Self::DoneClaims => ("processed_events", "status = 'done'"),
            Self::DoneOperations => ("outbox", "state = 'done'"),
            Self::DeadLetters => ("dead_letters", "true"),
            Self::KeyConflicts => ("key_conflicts", "true"),
        }
    }

    /// Its figure in `pool`: counted up to [`EXACT_BELOW`], past it estimated from the table's
    /// statistics less `others` (the table's rows not counted here, counted elsewhere).
    pub async fn in_database(self, pool: &Db, others: i64) -> sqlx::Result<Count> {
        let (table, rows) = self.rows();
        // The table and condition are this enum's constants, never input.
        let capped: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM (SELECT 1 FROM {table} WHERE {rows} LIMIT $1) AS c"
        ))
        .bind(EXACT_BELOW + 1)
        .fetch_one(pool)
        .await?;
        if capped <= EXACT_BELOW {
            return Ok(Count::Exact(capped));
        }
        let tuples: Option<f32> =
            sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)")
                .bind(table)
                .fetch_optional(pool)
                .await?;
        Ok(match tuples {
            Some(t) if t >= 0.0 => Count::Estimate((t as i64 - others).max(capped)),
            _ => Count::NotAnalysed(EXACT_BELOW),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_is_exact_only_when_every_part_is() {
        let (e, s, n) = (
            Count::Exact(2),
            Count::Estimate(20_000),
            Count::NotAnalysed(10_000),
        );
        assert_eq!(e + Count::Exact(3), Count::Exact(5));
        assert_eq!(e + s, Count::Estimate(20_002));
        assert_eq!(s + n, Count::NotAnalysed(30_000));
        assert_eq!(e.to_string(), "2");
        assert_eq!(s.to_string(), "~20000");
        assert_eq!(n.to_string(), "over 10000 (not analysed yet)");
    }
}
