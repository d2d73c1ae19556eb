//! The demo's report: what was sent, what was applied, and the verdict.

use super::storm::{event_key, Answers, Delivery};
use super::DemoOptions;
use crate::devkit::downstream::Downstream;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What the run did, as counted from PostgreSQL and the fake downstream.
pub struct Report {
    text: Vec<(String, String)>,
    zero: usize,
    doubled: usize,
    downstream_zero: usize,
    downstream_doubled: usize,
}

/// What the run saw besides the database.
pub struct Run<'a> {
    pub options: &'a DemoOptions,
    pub plan: &'a [Delivery],
    pub answers: &'a Answers,
    pub downstream: &'a Downstream,
    pub elapsed: Duration,
    pub killed: bool,
}

impl Report {
    pub async fn gather(pool: &crate::db::Db, run: Run<'_>) -> anyhow::Result<Self> {
        let rows = crate::effect::ledger::rows_per_key(pool).await?;
        let keys: Vec<String> = (0..run.options.events).map(event_key).collect();
        let effects = run.downstream.effects();
        let (dead_letters, _) = crate::claims::dead_letters::counts(pool).await?;
        let (attempts, reconciled) = crate::outbox::attempt_counts(pool).await?;
        let statuses = run.answers.by_status.lock().expect("answers lock").clone();
        let accepted: u64 = statuses
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum();
        let rejected: Vec<String> = statuses
            .iter()
            .filter(|(s, _)| !(200..300).contains(*s))
            .map(|(s, n)| format!("{n} × {s} {}", reason(*s)))
            .collect();
        let report = Self {
            text: Vec::new(),
            zero: keys.iter().filter(|k| !rows.contains_key(*k)).count(),
            doubled: rows.values().filter(|n| **n > 1).count(),
            downstream_zero: keys.iter().filter(|k| !effects.contains_key(*k)).count(),
            downstream_doubled: effects.values().filter(|n| **n > 1).count(),
        };
        let ledger_rows: i64 = rows.values().sum();
        let retries = run.answers.retries.load(Ordering::Relaxed);
        let rejected = if rejected.is_empty() {
            "none".into()
        } else {
            rejected.join(", ")
        };
        let killed = if run.killed {
            "1 with SIGKILL, restarted"
        } else {
            "no (the storm ended first)"
        };
        let text = vec![
            ("deliveries sent", format!("{} ({retries} retried after 503 or a refused connection)", run.plan.len())),
            ("accepted (2xx)", accepted.to_string()),
            ("rejected", rejected),
            ("distinct events", run.options.events.to_string()),
            ("ledger rows", format!("{ledger_rows} ({} events with none, {} with more than one)", report.zero, report.doubled)),
            ("duplicates suppressed", (accepted as i64 - ledger_rows).max(0).to_string()),
            ("dead letters", format!("{dead_letters} (poison records written straight to the topic)")),
            ("consumer killed", killed.to_owned()),
            (
                "downstream side effects",
                format!(
                    "{} from {attempts} attempts ({} answers arrived too late, {reconciled} settled by reconciliation)",
                    effects.values().sum::<u32>(),
                    run.downstream.slow_answers()
                ),
            ),
            ("time", format!("{:.1} s", run.elapsed.as_secs_f64())),
        ];
        let text = text.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        Ok(Self { text, ..report })
    }

    pub fn passed(&self) -> bool {
        self.zero == 0
            && self.doubled == 0
            && self.downstream_zero == 0
            && self.downstream_doubled == 0
    }

    pub fn render(&self) -> String {
        let mut out = String::from("\nreplayproof demo report\n");
        for (name, value) in &self.text {
            out += &format!("  {name:<24} {value}\n");
        }
        out += &if self.passed() {
            "VERDICT: PASS: every event has exactly one ledger row and exactly one downstream side effect.\n".to_owned()
        } else {
            format!(
                "VERDICT: FAIL: {} events without a ledger row, {} with several; {} without a downstream effect, {} with several.\n",
                self.zero, self.doubled, self.downstream_zero, self.downstream_doubled
            )
        };
        out
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        400 => "bad request (not JSON)",
        401 => "unauthorized (bad signature)",
        413 => "too large",
        _ => "other",
    }
}
