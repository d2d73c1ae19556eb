//! The consumer's settings, their defaults, and its librdkafka client configuration.

use rdkafka::config::ClientConfig;
use std::time::Duration;

pub use crate::kafka::DEFAULT_TOPIC;
/// The consumer group (`--group`).
pub const DEFAULT_GROUP: &str = "replayproof";
/// Messages claimed in one transaction at most (`--batch-size`): enough to amortise a
/// commit, few enough that a failing batch reruns quickly.
pub const DEFAULT_BATCH_SIZE: u32 = 500;
/// How long a partial batch waits for more messages (`--linger-ms`).
pub const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// How often settled offsets go to Kafka (`--commit-interval-ms`); a crash in between only
/// replays claims that are already done.
pub const DEFAULT_COMMIT_INTERVAL: Duration = Duration::from_millis(200);
/// How long a stop waits for the batch in flight (`--shutdown-grace-secs`).
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// Bytes of messages queued for one partition's lane, beyond the batch in flight, before the
/// poll loop stops taking that partition's messages out of librdkafka (`--max-lane-bytes`).
pub const DEFAULT_MAX_LANE_BYTES: usize = 2 << 20;
/// What librdkafka pre-fetches per partition, in KiB (`queued.max.messages.kbytes`; each
/// partition has its own queue here). With the lane's budget and the batch in flight, this
/// bounds the consumer's memory per partition whatever the backlog on the topic.
pub const QUEUED_MAX_KBYTES: u32 = 1024;
/// The most one fetch response may carry (`fetch.max.bytes`). librdkafka hands messages out
/// without copying them, so one message still queued keeps its whole response in memory: with
/// 16 partitions and 4 MiB responses, responses held for a message or two came to 140 MiB
/// (heaptrack, `cargo bench --bench consume` memory run). 1 MiB keeps that small and costs no
/// speed on a local network.
pub const FETCH_MAX_BYTES: u32 = 1 << 20;
/// The most one fetch response carries for one partition (`max.partition.fetch.bytes`): a
/// quarter of [`FETCH_MAX_BYTES`], so one response serves several partitions and a partition
/// whose lane is full holds a small piece of it.
pub const PARTITION_FETCH_MAX_BYTES: u32 = FETCH_MAX_BYTES / 4;
/// The ceiling of the wait between reruns of a batch that hit a transient error
/// (`--max-retry-backoff-ms`).
pub const DEFAULT_MAX_RETRY_BACKOFF: Duration = Duration::from_millis(5_000);
/// A batch transaction longer than this is abandoned and rerun (`--batch-timeout-secs`).
pub const DEFAULT_BATCH_TIMEOUT: Duration = Duration::from_secs(60);
/// `/healthz` fails after this long without progress (`--unhealthy-after-secs`).
pub const DEFAULT_UNHEALTHY_AFTER: Duration = Duration::from_secs(60);
/// The process exits after this long without progress, so a supervisor restarts it
/// (`--stall-exit-secs`).
pub const DEFAULT_STALL_EXIT: Duration = Duration::from_secs(300);

/// How the group spreads partitions over its members (`--assignor`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
pub enum Assignor {
    /// Eager: every rebalance takes all partitions from every member and hands them out again.
    #[default]
    Roundrobin,
    /// Incremental: a rebalance moves only the partitions that change owner; the others keep
    /// being applied while it runs.
    CooperativeSticky,
}

impl Assignor {
    /// librdkafka's `partition.assignment.strategy`.
    pub fn strategy(self) -> &'static str {
        match self {
            Self::Roundrobin => "roundrobin",
            Self::CooperativeSticky => "cooperative-sticky",
        }
    }
}

/// How the consumer reads, batches and commits.
#[derive(Debug, Clone)]
pub struct ConsumerSettings {
    /// The bootstrap servers, `host:port` separated by commas.
    pub brokers: String,
    /// The topic the envelopes are read from.
    pub topic: String,
    /// The consumer group; members of one group share the topic's partitions.
    pub group: String,
    /// Passed to librdkafka last, so they override everything set here.
    pub kafka_options: Vec<(String, String)>,
    /// Every member of a group must use the same.
    pub assignor: Assignor,
    /// Static membership (`group.instance.id`): a member that restarts under the same id within
    /// the session timeout gets its partitions back without a rebalance. Unique per member.
    pub instance_id: Option<String>,
    /// The most messages in one transaction.
    pub batch_size: usize,
    /// How long a lane waits to fill a batch once it has a first message.
    pub linger: Duration,
    /// Bytes of messages queued for one lane before the poll loop leaves its partition's
    /// messages in librdkafka's queue (never a pause: librdkafka drops a paused partition's
    /// pre-fetched messages and fetches them again).
    pub max_lane_bytes: usize,
    /// How often stored offsets are committed; revokes and shutdown commit at once.
    pub commit_interval: Duration,
    /// How long in-flight batches may take to finish on revoke or shutdown.
    pub shutdown_grace: Duration,
    /// The longest pause between retries of a batch that failed on a database error.
    pub max_retry_backoff: Duration,
    /// The longest one attempt at a batch may take; past it the attempt is abandoned (its
    /// transaction rolls back) and retried, so a hung connection cannot hold a lane forever.
    pub batch_timeout: Duration,
    /// A lane that has not committed its batch for this long (the database unreachable, a batch
    /// stuck), or Kafka reporting errors this long without a message, makes `/healthz` fail.
    pub unhealthy_after: Duration,
    /// A lane that has not committed its batch for this long stops the process with an error,
    /// so that the group hands its partitions to a member that can make progress.
    pub stall_exit_after: Duration,
}

impl ConsumerSettings {
    /// The longest a stop takes from SIGTERM to exit: the lanes' batches within the grace,
    /// then the deferred event being applied within the same grace, then the final offset
    /// commit and leaving the group (bounded by librdkafka's own timeouts, a few seconds). A
    /// deployment's grace period (Kubernetes' `terminationGracePeriodSeconds`) must be longer.
    pub fn worst_case_stop(&self) -> Duration {
        self.shutdown_grace * 2 + Duration::from_secs(10)
    }

    /// Settings with the defaults of the command line.
    pub fn new(brokers: &str, topic: &str, group: &str) -> Self {
        Self {
            brokers: brokers.into(),
            topic: topic.into(),
            group: group.into(),
            kafka_options: Vec::new(),
            assignor: Assignor::default(),
            instance_id: None,
            batch_size: DEFAULT_BATCH_SIZE as usize,
            linger: DEFAULT_LINGER,
            max_lane_bytes: DEFAULT_MAX_LANE_BYTES,
            commit_interval: DEFAULT_COMMIT_INTERVAL,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            max_retry_backoff: DEFAULT_MAX_RETRY_BACKOFF,
            batch_timeout: DEFAULT_BATCH_TIMEOUT,
            unhealthy_after: DEFAULT_UNHEALTHY_AFTER,
            stall_exit_after: DEFAULT_STALL_EXIT,
        }
    }

    /// The consumer's librdkafka configuration: replayproof's tuning, the user's options over
    /// it, and the guarded properties (no auto-commit, no automatic offset store, a new group
    /// from the earliest offset, committed records only) set last ([`crate::kafka`]).
    pub(super) fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let mut tuning = vec![
            (
                "partition.assignment.strategy",
                self.assignor.strategy().into(),
            ),
            ("client.id", "replayproof-consume".into()),
            ("queued.max.messages.kbytes", QUEUED_MAX_KBYTES.to_string()),
            ("fetch.max.bytes", FETCH_MAX_BYTES.to_string()),
            (
                "max.partition.fetch.bytes",
                PARTITION_FETCH_MAX_BYTES.to_string(),
            ),
            // A partition whose queue is full is fetched again this soon after it drains,
            // rather than after librdkafka's default second.
            ("fetch.queue.backoff.ms", "20".into()),
            // librdkafka has one fetch in flight per broker: a fetch the broker holds open for
            // partitions with nothing new delays partitions whose queue just drained. 50 ms
            // instead of 500 doubles the rate of 2 KiB messages (`cargo bench --bench consume`).
            ("fetch.wait.max.ms", "50".into()),
            // Each partition's lag is read from librdkafka's statistics this often, so it keeps
            // moving while a partition's batches are stuck.
            ("statistics.interval.ms", STATISTICS_INTERVAL_MS.to_string()),
        ];
        if let Some(id) = &self.instance_id {
            tuning.push(("group.instance.id", id.clone()));
        }
        crate::kafka::client_config(
            crate::kafka::Role::Consumer,
            &self.brokers,
            Some(&self.group),
            &tuning,
            &self.kafka_options,
        )
    }
}

/// How often librdkafka reports its statistics, the source of `replayproof_consumer_lag`.
pub const STATISTICS_INTERVAL_MS: u64 = 5_000;
