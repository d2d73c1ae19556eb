//! The consumer's watchdog: what the lanes, the poll loop and each partition report, judged
//! every second against `--unhealthy-after` and `--stall-exit` for `/livez` and `/readyz`, and
//! a probe that asks PostgreSQL whether it answers.
//!
//! A lane is only *stuck* for the time the database answers: while PostgreSQL is down for
//! everyone, every member's batches wait, and restarting them mends nothing. So a lane waiting
//! for the database makes the member not ready; a lane that has not committed for
//! `--unhealthy-after` while the database answers makes it not live; and only one stuck that
//! way for `--stall-exit` makes the process exit.

use super::ConsumerSettings;
use crate::telemetry::{Health, Probe};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Kafka errors closer together than this make one streak.
const ERROR_STREAK_GAP: Duration = Duration::from_secs(10);

/// What the lanes and the poll loop tell the watchdog, and how the process is stopped when
/// something cannot go on.
pub(super) struct Vitals {
    /// Stops the poll loop: cancelled on shutdown or on a fatal problem.
    pub(super) stop: CancellationToken,
    pub(super) epoch: Instant,
    pub(super) fatal: Mutex<Option<String>>,
    /// Per running lane (by id): its partition, and when its unfinished batch started (ms
    /// since `epoch`, 0 when it has none).
    pub(super) busy: Mutex<HashMap<u64, (i32, Arc<AtomicU64>)>>,
    /// Kafka errors of the consumer as a whole: when the current streak started and when the
    /// last one came.
    pub(super) errors: Mutex<Option<ErrorStreak>>,
    /// Each assigned partition's own errors and progress: a message of one partition says
    /// nothing of another.
    pub(super) partitions: Mutex<HashMap<i32, PartitionVitals>>,
    /// Since when PostgreSQL has answered every probe; None while it does not.
    pub(super) database_answering: Mutex<Option<Instant>>,
}

/// How one assigned partition is doing, as its fetches and the statistics tell.
#[derive(Debug, Clone)]
pub(super) struct PartitionVitals {
    /// The partition's own fetch errors, cleared by its next message.
    pub(super) errors: Option<ErrorStreak>,
    /// When a message of the partition last reached its lane (or, before any, when it was
    /// assigned).
    pub(super) advanced: Instant,
    /// Messages on the broker after the last one handed over, from the statistics.
    pub(super) behind: i64,
    /// Whether its lane holds its whole byte budget: then the partition waits for the lane, and
    /// a lane that does not commit is reported as such.
    pub(super) lane_full: bool,
}

impl PartitionVitals {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            errors: None,
            advanced: now,
            behind: 0,
            lane_full: false,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct ErrorStreak {
    pub(super) since: Instant,
    pub(super) last: Instant,
    pub(super) error: String,
}

impl ErrorStreak {
    /// Adds an error to the streak in `slot`, or starts one when the last error is old.
    fn extend(slot: &mut Option<ErrorStreak>, error: String) {
        let now = Instant::now();
        match slot.as_mut() {
            Some(streak) if now - streak.last < ERROR_STREAK_GAP => {
                streak.last = now;
                streak.error = error;
            }
            _ => {
                *slot = Some(ErrorStreak {
                    since: now,
                    last: now,
                    error,
                })
            }
        }
    }

    /// The streak's sentence, when it still repeats and has lasted `limit`.
    fn lasting(&self, now: Instant, limit: Duration) -> Option<String> {
        let repeating = now.saturating_duration_since(self.last) < ERROR_STREAK_GAP;
        let lasting = now.saturating_duration_since(self.since);
        (repeating && lasting >= limit).then(|| {
            format!(
                "Kafka has reported errors for {} s without a message: {}",
                lasting.as_secs(),
                self.error
            )
        })
    }
}

impl Vitals {
    pub(super) fn new(stop: CancellationToken) -> Self {
        Self {
            stop,
            epoch: Instant::now(),
            fatal: Mutex::new(None),
            busy: Mutex::new(HashMap::new()),
            errors: Mutex::new(None),
            partitions: Mutex::new(HashMap::new()),
            database_answering: Mutex::new(None),
        }
    }

    /// Records what the database probe found.
    fn database_answered(&self, answered: bool) {
        let mut since = self.database_answering.lock().expect("database lock");
        if !answered {
            *since = None;
        } else if since.is_none() {
            *since = Some(Instant::now());
        }
    }

    fn database_answering_since(&self) -> Option<Instant> {
        *self.database_answering.lock().expect("database lock")
    }

    /// Milliseconds since the epoch, never 0 (which means idle).
    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Stops the process's consumer on a problem it cannot get past by itself.
    pub(super) fn fail(&self, reason: String) {
        tracing::error!(reason, "Stopping the consumer: it cannot go on by itself.");
        self.fatal.lock().expect("fatal lock").get_or_insert(reason);
        self.stop.cancel();
    }

    pub(super) fn fatal(&self) -> Option<String> {
        self.fatal.lock().expect("fatal lock").clone()
    }

    pub(super) fn kafka_error(&self, error: String) {
        ErrorStreak::extend(&mut self.errors.lock().expect("errors lock"), error);
    }

    pub(super) fn kafka_message(&self) {
        *self.errors.lock().expect("errors lock") = None;
    }

    /// An error from one partition's fetches: its own streak, which only its own messages end.
    pub(super) fn partition_error(&self, partition: i32, error: String) {
        let mut partitions = self.partitions.lock().expect("partitions lock");
        let vitals = partitions
            .entry(partition)
            .or_insert_with(|| PartitionVitals::new(Instant::now()));
        ErrorStreak::extend(&mut vitals.errors, error);
    }

    /// A message of `partition` reached its lane.
    pub(super) fn partition_advanced(&self, partition: i32) {
        let mut partitions = self.partitions.lock().expect("partitions lock");
        let now = Instant::now();
        let vitals = partitions
            .entry(partition)
            .or_insert_with(|| PartitionVitals::new(now));
        vitals.errors = None;
        vitals.advanced = now;
    }

    pub(super) fn assigned(&self, partition: i32) {
        self.partitions
            .lock()
            .expect("partitions lock")
            .insert(partition, PartitionVitals::new(Instant::now()));
    }

    pub(super) fn revoked(&self, partition: i32) {
        self.partitions
            .lock()
            .expect("partitions lock")
            .remove(&partition);
    }

    /// The partition whose unfinished batch is oldest, and how long it has been going.
    pub(super) fn oldest_batch(&self) -> Option<(i32, Duration)> {
        let now = self.now_ms();
        let busy = self.busy.lock().expect("busy lock");
        busy.values()
            .filter_map(|(partition, since)| match since.load(Ordering::Relaxed) {
                0 => None,
                at => Some((*partition, Duration::from_millis(now.saturating_sub(at)))),
            })
            .max_by_key(|(_, age)| *age)
    }
}

/// What the watchdog concluded.
#[derive(Debug, Default, PartialEq, Eq)]
struct Assessment {
    /// A lane without a commit, and whether that makes the member not live (stuck while the
    /// database answers) or only not ready (waiting for the database).
    lanes: Option<(Probe, String)>,
    kafka: Option<String>,
    /// Partitions stuck on their own: fetch errors, or messages waiting that never arrive.
    partitions: Option<String>,
    fatal: Option<String>,
}

/// Judges the vitals against the limits; a pure function, so the thresholds can be tested.
/// `oldest_batch` is the partition whose batch is oldest and how long it has been going;
/// `database` since when PostgreSQL has answered, if it does.
fn assess(
    oldest_batch: Option<(i32, Duration)>,
    database: Option<Instant>,
    errors: Option<&ErrorStreak>,
    now: Instant,
    settings: &ConsumerSettings,
) -> Assessment {
    let mut verdict = Assessment::default();
    if let Some((partition, age)) = oldest_batch {
        // Only the time the database answered counts as stuck.
        let stuck = database.map(|since| age.min(now.saturating_duration_since(since)));
        verdict.lanes = match stuck {
            Some(stuck) if stuck >= settings.unhealthy_after => {
                let said = format!(
                    "partition {partition} has not committed its batch for {} s while the \
                     database answers (is a batch stuck?)",
                    stuck.as_secs()
                );
                if stuck >= settings.stall_exit_after {
                    verdict.fatal = Some(said.clone());
                }
                Some((Probe::Live, said))
            }
            None if age >= settings.unhealthy_after => Some((
                Probe::Ready,
                format!(
                    "partition {partition} has waited {} s for the database to take its batch",
                    age.as_secs()
                ),
            )),
            _ => None,
        };
    }
    verdict.kafka = errors.and_then(|streak| streak.lasting(now, settings.unhealthy_after));
    verdict
}

/// Judges each partition on its own: one whose fetches keep failing, or that is behind and has
/// handed over nothing for the limit while its lane had room. A message of another partition
/// clears neither.
fn assess_partitions(
    partitions: &HashMap<i32, PartitionVitals>,
    now: Instant,
    limit: Duration,
) -> Option<String> {
    let mut stuck: Vec<(i32, String)> = partitions
        .iter()
        .filter_map(|(&partition, v)| {
            if let Some(said) = v.errors.as_ref().and_then(|e| e.lasting(now, limit)) {
                return Some((partition, format!("partition {partition}: {said}")));
            }
            let quiet = now.saturating_duration_since(v.advanced);
            (v.behind > 0 && !v.lane_full && quiet >= limit).then(|| {
                let said = format!(
                    "partition {partition} is {} messages behind and has received none for {} s",
                    v.behind,
                    quiet.as_secs()
                );
                (partition, said)
            })
        })
        .collect();
    stuck.sort();
    (!stuck.is_empty()).then(|| {
        stuck
            .into_iter()
            .map(|(_, said)| said)
            .collect::<Vec<_>>()
            .join("; ")
    })
}

/// Every second: reports stalled lanes and repeating Kafka errors to the probes, and stops the
/// process when a lane has been stuck past the exit limit while the database answers.
pub(super) async fn watch(vitals: Arc<Vitals>, health: Health, settings: ConsumerSettings) {
    while !vitals.stop.is_cancelled() {
        let streak = vitals.errors.lock().expect("errors lock").clone();
        let verdict = assess(
            vitals.oldest_batch(),
            vitals.database_answering_since(),
            streak.as_ref(),
            Instant::now(),
            &settings,
        );
        match verdict.lanes {
            Some((probe, said)) => health.report_as("lanes", probe, Some(said)),
            None => health.report("lanes", None),
        }
        health.report("kafka", verdict.kafka);
        let partitions = vitals.partitions.lock().expect("partitions lock").clone();
        health.report(
            "partitions",
            assess_partitions(&partitions, Instant::now(), settings.unhealthy_after),
        );
        if let Some(reason) = verdict.fatal {
            vitals.fail(reason);
        }
        tokio::select! {
            _ = vitals.stop.cancelled() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// Asks PostgreSQL whether it answers, every few seconds, so that an idle consumer whose
/// database is gone is not ready either, not only one whose batches fail; and so the watchdog
/// knows whether a lane without a commit is stuck or waiting for the database.
pub(super) async fn probe_database(
    pools: Vec<crate::db::Db>,
    health: Health,
    vitals: Arc<Vitals>,
    unhealthy_after: Duration,
) {
    let stop = vitals.stop.clone();
    // A connection of its own: lanes stuck holding every connection of the pool must not look
    // like a database that does not answer.
    // With shards, every database is asked: a batch may need any of them.
    let pools: Vec<crate::db::Db> = pools
        .iter()
        .map(|pool| {
            pool.sibling(
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(Duration::from_secs(5))
                    .connect_lazy_with((*pool.connect_options()).clone()),
            )
        })
        .collect();
    let every = (unhealthy_after / 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let mut failing_since: Option<Instant> = None;
    while !stop.is_cancelled() {
        let asked = futures_util::future::try_join_all(
            pools
                .iter()
                .map(|pool| sqlx::query("SELECT 1").execute(pool)),
        );
        match tokio::time::timeout(every.max(Duration::from_secs(1)), asked).await {
            Ok(Ok(_)) => {
                failing_since = None;
                vitals.database_answered(true);
                health.report("database", None);
            }
            _ => {
                vitals.database_answered(false);
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= unhealthy_after {
                    let problem = format!(
                        "PostgreSQL has not answered for {} s",
                        since.elapsed().as_secs()
                    );
                    health.report("database", Some(problem));
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ConsumerSettings {
        ConsumerSettings {
            unhealthy_after: Duration::from_secs(60),
            stall_exit_after: Duration::from_secs(300),
            ..ConsumerSettings::new("b", "t", "g")
        }
    }

    #[test]
    fn a_lane_without_a_commit_while_the_database_answers_is_not_live_then_fatal() {
        let now = Instant::now();
        let answering = Some(now - Duration::from_secs(3600));
        let at = |secs| {
            assess(
                Some((3, Duration::from_secs(secs))),
                answering,
                None,
                now,
                &limits(),
            )
        };
        assert_eq!(at(59), Assessment::default());
        let stuck = at(61);
        let (probe, said) = stuck.lanes.unwrap();
        assert_eq!(probe, Probe::Live);
        assert!(said.starts_with("partition 3 has not committed"), "{said}");
        assert_eq!(stuck.fatal, None);
        let stalled = at(300);
        assert!(stalled.fatal.is_some() && stalled.lanes.is_some());
    }

    #[test]
    fn a_lane_waiting_for_a_database_that_does_not_answer_is_only_not_ready() {
        let now = Instant::now();
        let waiting = assess(
            Some((1, Duration::from_secs(3600))),
            None,
            None,
            now,
            &limits(),
        );
        let (probe, said) = waiting.lanes.unwrap();
        assert_eq!(probe, Probe::Ready);
        assert!(said.contains("waited 3600 s for the database"), "{said}");
        assert_eq!(
            waiting.fatal, None,
            "a shared outage never stops the process"
        );
    }

    #[test]
    fn only_the_time_since_the_database_came_back_counts_as_stuck() {
        let now = Instant::now();
        let back = |secs| Some(now - Duration::from_secs(secs));
        // A batch that waited out an hour's outage; the database answers again since 10 s.
        let batch = Some((0, Duration::from_secs(3600)));
        let resuming = assess(batch, back(10), None, now, &limits());
        assert_eq!(resuming, Assessment::default());
        let wedged = assess(batch, back(301), None, now, &limits());
        assert!(wedged.fatal.is_some(), "{wedged:?}");
    }

    #[test]
    fn each_partition_is_judged_on_its_own() {
        let now = Instant::now();
        let limit = Duration::from_secs(60);
        let ago = |secs| now - Duration::from_secs(secs);
        let flowing = PartitionVitals {
            advanced: now,
            behind: 10,
            ..PartitionVitals::new(now)
        };
        let failing = PartitionVitals {
            errors: Some(ErrorStreak {
                since: ago(90),
                last: ago(1),
                error: "Broker: Corrupt message".into(),
            }),
            advanced: ago(90),
            ..PartitionVitals::new(now)
        };
        let starved = PartitionVitals {
            advanced: ago(61),
            behind: 7,
            ..PartitionVitals::new(now)
        };
        let waiting_for_its_lane = PartitionVitals {
            lane_full: true,
            ..starved.clone()
        };
        let caught_up = PartitionVitals {
            advanced: ago(3600),
            ..PartitionVitals::new(now)
        };
        let all = HashMap::from([
            (0, flowing),
            (1, failing),
            (2, starved),
            (3, waiting_for_its_lane),
            (4, caught_up),
        ]);
        let said = assess_partitions(&all, now, limit).unwrap();
        assert!(
            said.contains("partition 1: Kafka has reported errors for 90 s"),
            "{said}"
        );
        assert!(said.contains("partition 2 is 7 messages behind"), "{said}");
        for quiet in ["partition 0", "partition 3", "partition 4"] {
            assert!(!said.contains(quiet), "{said}");
        }
        let healthy = HashMap::from([(0, all[&0].clone()), (4, all[&4].clone())]);
        assert_eq!(assess_partitions(&healthy, now, limit), None);
    }

    #[test]
    fn only_a_lasting_streak_of_kafka_errors_is_unhealthy() {
        let now = Instant::now();
        let streak = |since: u64, last: u64| ErrorStreak {
            since: now - Duration::from_secs(since),
            last: now - Duration::from_secs(last),
            error: "Decompression failed".into(),
        };
        let young = streak(30, 0);
        assert_eq!(assess(None, None, Some(&young), now, &limits()).kafka, None);
        let lasting = streak(90, 1);
        let said = assess(None, None, Some(&lasting), now, &limits())
            .kafka
            .unwrap();
        assert!(
            said.contains("90 s") && said.contains("Decompression"),
            "{said}"
        );
        // An old streak that stopped repeating (the broker came back, the topic is idle).
        let over = streak(90, 30);
        assert_eq!(
            assess(None, None, Some(&over), now, &limits()),
            Assessment::default()
        );
    }
}
