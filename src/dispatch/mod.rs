//! `replayproof dispatch`: delivers outbox operations under a lease.
//!
//! Each attempt sends the row's exact payload with its operation key as `Idempotency-Key`, with
//! a bounded timeout, and settles the row from the outcome. An operation that may already have
//! been applied (a timeout, a cut connection, a lease taken over from a vanished worker) is
//! `uncertain`: it is reconciled first when the row has a reconcile URL, and otherwise resent
//! with the same key. Never a new key.

mod answer;
#[cfg(feature = "cli")]
pub mod args;
mod credentials;
mod metrics;
pub mod outbound;
mod reconcile;
mod window;

pub use answer::MAX_RETRY_AFTER;
use answer::{location, may_start_request, settled};

pub use crate::destinations::{Destination, Destinations};
pub use credentials::{Credential, Credentials};
pub use metrics::DispatchMetrics;
pub use outbound::Outbound;

use crate::db::Db;
use crate::destinations::{self, BreakerChange, Verdict};
use crate::outbox::{self, Attempt, AttemptKind, Leased, OutboxState, Outcome, Settlement};
pub use crate::shutdown::Running;
use crate::telemetry::Health;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The dispatcher loop's heartbeat, as `/healthz` names it.
const LOOP: &str = "dispatch loop";
/// The health check of the outbox's database.
const DATABASE: &str = "database";

/// Operations leased at once, and so requests in flight at once (`--batch-size`).
/// The longest an answer's verdict waits to reach the destination's row.
const JUDGE_LIMIT: Duration = Duration::from_secs(2);

pub const DEFAULT_BATCH_SIZE: i64 = 32;
/// How long a lease keeps other workers off an operation (`--lease-secs`).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(300);
/// A request without an answer after this long is an uncertain outcome
/// (`--request-timeout-ms`).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_millis(10_000);
/// The first wait before an operation is sent again (`--backoff-ms`); it doubles.
pub const DEFAULT_BACKOFF: Duration = Duration::from_millis(1_000);
/// Where the doubling stops (`--max-backoff-ms`).
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_millis(300_000);
/// How often an idle worker looks for due operations (`--poll-ms`).
pub const DEFAULT_POLL: Duration = Duration::from_millis(500);
/// `/healthz` fails after the loop has not turned for this long.
pub const DEFAULT_UNHEALTHY_AFTER: Duration = Duration::from_secs(60);

/// How a dispatcher leases and sends.
#[derive(Debug, Clone)]
pub struct DispatchSettings {
    /// Names this worker in leases and attempts.
    pub worker: String,
    /// Rows leased at once, and so requests in flight at once.
    pub batch_size: i64,
    /// How long a lease lasts: longer than the slowest realistic request, shorter than anyone's
    /// patience with an operation whose worker died.
    pub lease: Duration,
    pub request_timeout: Duration,
    /// The pause when nothing is due.
    pub poll_interval: Duration,
    /// The first retry's delay; doubled for each further attempt, with jitter.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// How long the outbox may be unreadable before `/healthz` fails.
    pub unhealthy_after: Duration,
    /// Extra trusted roots, headers, credentials and signing of every request.
    pub outbound: Outbound,
    /// Each destination's limits and idempotency header.
    pub destinations: Destinations,
}

impl DispatchSettings {
    /// The longest a stop takes from SIGTERM to exit: the requests in flight (a reconcile and
    /// a delivery, each under the request timeout), then their records. A deployment's grace
    /// period (Kubernetes' `terminationGracePeriodSeconds`) must be longer.
    pub fn worst_case_stop(&self) -> Duration {
        self.request_timeout * 2 + Duration::from_secs(5)
    }

    pub fn new(worker: &str) -> Self {
        Self {
            worker: worker.into(),
            batch_size: DEFAULT_BATCH_SIZE,
            lease: DEFAULT_LEASE,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            poll_interval: DEFAULT_POLL,
            backoff_base: DEFAULT_BACKOFF,
            backoff_max: DEFAULT_MAX_BACKOFF,
            unhealthy_after: DEFAULT_UNHEALTHY_AFTER,
            outbound: Outbound::default(),
            destinations: Destinations::default(),
        }
    }
}

/// A dispatcher: leases due operations and delivers them until `shutdown`, then finishes the
/// requests in flight and returns. Its fields are private: every completion goes through the
/// lease check of [`crate::outbox`].
pub struct Dispatcher {
    settings: DispatchSettings,
    pool: Db,
    /// The databases whose outbox gauges this loop reports: its own; with shards, every
    /// database for the first shard's loop and none for the others.
    gauges: Vec<Db>,
    /// Where the destinations' limits are kept and counted: its own database alone; with
    /// shards, the first shard's rows over every database's leases.
    limits: destinations::LimitsHome,
    /// The names of its health checks: its loop's heartbeat and its database's.
    checks: (&'static str, &'static str),
    metrics: DispatchMetrics,
    /// What `/healthz` says: the loop's heartbeat, and whether the outbox can be read.
    health: Health,
    http: reqwest::Client,
}

impl Dispatcher {
    /// Checks the settings and builds the HTTP client; reports to `health` once running.
    pub fn build(
        settings: DispatchSettings,
        pool: Db,
        metrics: DispatchMetrics,
        health: Health,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            settings.lease > settings.request_timeout * 2,
            "the lease ({} ms) must be longer than two request timeouts ({} ms each): one attempt \
             may reconcile and then deliver, and both must end before the lease does",
            settings.lease.as_millis(),
            settings.request_timeout.as_millis()
        );
        let http = settings.outbound.client(settings.request_timeout)?;
        metrics.destinations(&settings.destinations);
        Ok(Self {
            settings,
            gauges: vec![pool.clone()],
            limits: destinations::LimitsHome::single(&pool),
            pool,
            checks: (LOOP, DATABASE),
            metrics,
            health,
            http,
        })
    }

    /// The loop of shard `shard` of `databases` (every database, in order): the first reports
    /// the gauges of them all, and each names its health checks after its shard.
    pub fn on_shard(mut self, shard: usize, databases: &[Db]) -> Self {
        self.gauges = match shard {
            0 => databases.to_vec(),
            _ => Vec::new(),
        };
        self.limits = destinations::LimitsHome::over(databases, shard);
        if databases.len() > 1 {
            // Named once per process and shard, for the process's life.
            let name =
                |check: &str| &*Box::leak(format!("{check} (shard {shard})").into_boxed_str());
            self.checks = (name(LOOP), name(DATABASE));
        }
        self
    }

    /// Dispatches on the runtime until `shutdown` is cancelled; see [`Dispatcher::run`].
    pub fn run_until_stopped(self, shutdown: CancellationToken) -> Running {
        Running::spawn(async move { self.run(shutdown).await })
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &DispatchSettings {
        &self.settings
    }

    /// Leases due operations and delivers them until `shutdown` is cancelled, then finishes the
    /// requests in flight.
    pub async fn run(&self, shutdown: CancellationToken) -> anyhow::Result<()> {
        tracing::info!(worker = %self.settings.worker, lease_secs = self.settings.lease.as_secs(), "Dispatching the outbox.");
        let mut last_refresh = Instant::now() - Duration::from_secs(60);
        let mut failing_since: Option<Instant> = None;
        while !shutdown.is_cancelled() {
            self.health.beat(self.checks.0, self.stuck_after());
            if !self.gauges.is_empty() && last_refresh.elapsed() >= self.gauge_interval() {
                if let Err(e) = self
                    .metrics
                    .refresh(&self.gauges, &self.settings.destinations)
                    .await
                {
                    tracing::warn!(error = %e, "Could not read the outbox gauges.");
                }
                last_refresh = Instant::now();
            }
            let sent = match self.dispatch_once().await {
                Ok(n) => {
                    failing_since = None;
                    self.health.report(self.checks.1, None);
                    n
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Leasing from the outbox failed; retrying.");
                    let since = *failing_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= self.settings.unhealthy_after {
                        let problem = format!(
                            "the outbox has been unreadable for {} s: {e}",
                            since.elapsed().as_secs()
                        );
                        self.health.report(self.checks.1, Some(problem));
                    }
                    0
                }
            };
            if sent == 0 {
                tokio::select! {
                    _ = shutdown.cancelled() => {}
                    _ = tokio::time::sleep(self.settings.poll_interval) => {}
                }
            }
        }
        self.health.forget(self.checks.0);
        tracing::info!(worker = %self.settings.worker, "The dispatcher stopped.");
        Ok(())
    }

    /// How long one turn of the loop may take before `/healthz` calls it stuck: a full batch of
    /// requests (reconcile and delivery each), plus the database's own limits.
    fn stuck_after(&self) -> Duration {
        self.settings.request_timeout * 2
            + self.settings.poll_interval
            + self.settings.unhealthy_after
    }

    /// Often enough that a stuck lease shows within one lease.
    fn gauge_interval(&self) -> Duration {
        (self.settings.lease / 4).clamp(Duration::from_millis(200), Duration::from_secs(15))
    }

    /// Leases one batch and delivers it; returns how many rows it leased. Each origin with due
    /// operations gets what its limits admit ([`destinations::lease_within_limits`]), in a fresh
    /// random order each turn so that no origin waits behind another.
    pub async fn dispatch_once(&self) -> sqlx::Result<usize> {
        // Measured before the lease is asked for, so the local deadline is never later than
        // the one the database holds.
        let lease_deadline = Instant::now() + self.settings.lease;
        let mut origins = outbox::due_origins(&self.pool).await?;
        fastrand::shuffle(&mut origins);
        let mut leased = Vec::new();
        let mut failure = None;
        let batch = usize::try_from(self.settings.batch_size).unwrap_or(1);
        for origin in origins {
            let room = batch.saturating_sub(leased.len());
            if room == 0 {
                break;
            }
            let limits = &self.settings.destinations.of(&origin).limits;
            let worker = &self.settings.worker;
            let lease = self.settings.lease;
            let home = &self.limits;
            match destinations::lease_within_limits(
                &self.pool, home, &origin, limits, worker, room, lease,
            )
            .await
            {
                Ok(admitted) => leased.extend(admitted),
                // What was leased already is sent; the error is reported after.
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let n = leased.len();
        let attempts = leased.into_iter().map(|admitted| async move {
            tokio::time::sleep(admitted.wait).await;
            let row = &admitted.row;
            if admitted.probe {
                tracing::info!(destination = %row.origin, operation = %row.operation_key, "Sending one probe to a destination whose circuit breaker was open.");
            }
            if let Err(e) = self.attempt(row, lease_deadline).await {
                // The lease expires and another attempt follows: nothing is lost.
                tracing::warn!(operation = %row.operation_key, error = %e, "Could not record an attempt.");
            }
        });
        futures_util::future::join_all(attempts).await;
        match failure {
            Some(e) if n == 0 => Err(e),
            Some(e) => {
                tracing::warn!(error = %e, "Leasing for a destination failed; the rest of the batch was sent.");
                Ok(n)
            }
            None => Ok(n),
        }
    }

    /// One attempt: a reconcile when the operation may already have been applied, then the
    /// delivery, both within the lease. A delivery is never started with less than a request
    /// timeout left on the lease: the row would be taken over with the request still in flight.
    async fn attempt(&self, row: &Leased, lease_deadline: Instant) -> sqlx::Result<()> {
        if row.may_have_been_applied() {
            match &row.reconcile_url {
                Some(url) => {
                    if let Some(settled) = self.reconcile(row, url, lease_deadline).await? {
                        return Ok(settled);
                    }
                }
                // Past the window only a reconcile may clear a resend.
                None if self.past_window(row) => return self.hold(row, lease_deadline).await,
                None => {}
            }
        }
        crate::stallpoint!("dispatch::before_delivery");
        if !may_start_request(
            lease_deadline,
            Instant::now(),
            self.settings.request_timeout,
        ) {
            return self.give_back(row, lease_deadline).await;
        }
        let started_at = chrono::Utc::now();
        let timer = Instant::now();
        let span = crate::trace::dispatch_span(
            &row.operation_key,
            &row.method,
            &row.origin,
            row.traceparent.as_deref(),
        );
        let sending = async {
            match self.request(row) {
                Err(why) => (
                    Outcome::Unsendable,
                    settled(
                        OutboxState::Failed,
                        None,
                        Some(format!(
                            "the request could not be built, so nothing was sent: {why}"
                        )),
                    ),
                    Verdict::Unknown,
                ),
                Ok(request) => match request.body(row.payload.clone()).send().await {
                    Ok(response) => self.classify_response(row, response).await,
                    Err(e) => self.classify_error(row, &e),
                },
            }
        };
        let (outcome, settlement, verdict) = tracing::Instrument::instrument(sending, span).await;
        self.judge(row, verdict).await;
        let attempt =
            self.attempt_record(AttemptKind::Deliver, started_at, timer.elapsed(), outcome);
        self.settle(row, &settlement, &attempt, lease_deadline)
            .await
    }

    /// The request of one operation, to be sent: its method, content type and headers, the
    /// destination's idempotency header, the credential it names, the trace context and the
    /// signature. Errors say why it cannot be sent, now or ever.
    fn request(&self, row: &Leased) -> Result<reqwest::RequestBuilder, String> {
        let destination = self.settings.destinations.of(&row.origin);
        let method = reqwest::Method::from_bytes(row.method.as_bytes())
            .map_err(|_| format!("{:?} is not an HTTP method", row.method))?;
        let mut request = self
            .http
            .request(method, &row.destination)
            .header(reqwest::header::CONTENT_TYPE, &row.content_type)
            .header(&destination.idempotency_header, &row.operation_key);
        for (name, value) in &row.headers.0 {
            let lower = name.to_ascii_lowercase();
            if outbox::RESERVED_HEADERS.contains(&lower.as_str())
                || lower == destination.idempotency_header.as_str()
                || outbox::SECRET_HEADERS.contains(&lower.as_str())
            {
                return Err(format!("the operation's own {name} header is not allowed"));
            }
            request = request.header(name, value);
        }
        let credentials = &self.settings.outbound.credentials;
        for header in credentials.headers_for(row.credential.as_deref(), &row.destination)? {
            request = request.header(header.name.clone(), header.value.clone());
        }
        if let Some(traceparent) = crate::trace::outgoing(row.traceparent.as_deref()) {
            request = request.header("traceparent", traceparent);
        }
        for (name, value) in self
            .settings
            .outbound
            .signature_headers(&row.operation_key, &row.payload)
        {
            request = request.header(name, value);
        }
        Ok(request)
    }

    /// Records what an answer says of its destination, for the breaker and the pause every
    /// dispatcher follows. A failure to record it is logged: the limits are advisory, the
    /// operation's own record is not.
    async fn judge(&self, row: &Leased, verdict: Verdict) {
        let destination = self.settings.destinations.of(&row.origin);
        let first = &self.limits.first;
        // Never long: the operation's own record waits behind it, and the lease runs.
        let recording =
            destinations::record_health(first, &row.origin, &destination.limits, verdict);
        let recorded = tokio::time::timeout(JUDGE_LIMIT, recording).await;
        match recorded.unwrap_or(Err(sqlx::Error::PoolTimedOut)) {
            Ok(BreakerChange::Opened) => {
                tracing::warn!(destination = %row.origin, open_for = ?destination.limits.breaker_open, "Opened the circuit breaker of a destination that keeps failing; its operations wait.");
            }
            Ok(BreakerChange::Closed) => {
                tracing::info!(destination = %row.origin, "Closed the circuit breaker of a destination that answers again.");
            }
            Ok(BreakerChange::Unchanged) => {}
            Err(e) => {
                tracing::warn!(destination = %row.origin, error = %e, "Could not record a destination's health.");
            }
        }
    }

    fn attempt_record(
        &self,
        kind: AttemptKind,
        started_at: chrono::DateTime<chrono::Utc>,
        duration: Duration,
        outcome: Outcome,
    ) -> Attempt<'_> {
        Attempt {
            worker: &self.settings.worker,
            kind,
            started_at,
            duration,
            outcome,
        }
    }

    /// Ends an attempt that did not send its delivery because too little of the lease was left:
    /// the row goes back as it was (uncertain if it may have been applied, else retryable), due
    /// at once, for an attempt with a fresh lease.
    async fn give_back(&self, row: &Leased, lease_deadline: Instant) -> sqlx::Result<()> {
        let state = if row.may_have_been_applied() {
            OutboxState::Uncertain
        } else {
            OutboxState::Retryable
        };
        let settlement = Settlement {
            next_attempt_at: Some(chrono::Utc::now()),
            ..settled(
                state,
                None,
                Some("not sent: less than a request timeout was left on the lease".into()),
            )
        };
        tracing::warn!(operation = %row.operation_key, "Too little of the lease was left to send a delivery; giving it back.");
        let attempt = self.attempt_record(
            AttemptKind::Deliver,
            chrono::Utc::now(),
            Duration::ZERO,
            Outcome::LeaseShort,
        );
        self.settle(row, &settlement, &attempt, lease_deadline)
            .await
    }

    /// Asks the downstream whether the operation exists: yes settles it as done without
    /// resending; no (404) lets the delivery go ahead; anything else leaves it uncertain.
    async fn reconcile(
        &self,
        row: &Leased,
        url: &str,
        lease_deadline: Instant,
    ) -> sqlx::Result<Option<()>> {
        let started_at = chrono::Utc::now();
        let timer = Instant::now();
        let result = self.ask_reconcile(row, url).await;
        let status = result.as_ref().ok().map(|r| r.status().as_u16());
        let (outcome, settlement) = match status {
            Some(s) if (200..300).contains(&s) => (
                Outcome::ReconciledDone,
                settled(OutboxState::Done, Some(i32::from(s)), None),
            ),
            Some(404) => return Ok(None),
            _ => {
                let error = match &result {
                    Err(e) => Some(format!("reconcile: {e}")),
                    Ok(r) if r.status().is_redirection() => Some(format!(
                        "reconcile: redirected to {}; redirects are not followed",
                        location(r)
                    )),
                    Ok(_) => None,
                };
                (
                    Outcome::ReconcileUnknown,
                    Settlement {
                        next_attempt_at: Some(self.next_attempt(row, None)),
                        ..settled(
                            row.unless_out_of_attempts(OutboxState::Uncertain),
                            status.map(i32::from),
                            error,
                        )
                    },
                )
            }
        };
        let attempt =
            self.attempt_record(AttemptKind::Reconcile, started_at, timer.elapsed(), outcome);
        self.settle(row, &settlement, &attempt, lease_deadline)
            .await?;
        Ok(Some(()))
    }

    /// Records the attempt and settles the row. A request whose answer came back is never sent
    /// again for want of its record: a failed record is tried again while the lease lasts, and
    /// one PostgreSQL refuses is settled without the parts it refused.
    async fn settle(
        &self,
        row: &Leased,
        settlement: &Settlement,
        attempt: &Attempt<'_>,
        lease_deadline: Instant,
    ) -> sqlx::Result<()> {
        self.metrics
            .attempts
            .with_label_values(&[attempt.outcome.as_str()])
            .inc();
        self.metrics.latency.observe(attempt.duration.as_secs_f64());
        let settlement = &self.windowed(row, settlement, attempt.outcome, attempt.started_at);
        let applied = self
            .record(row, settlement, attempt, lease_deadline)
            .await?;
        if !applied {
            tracing::warn!(operation = %row.operation_key, token = row.fencing_token, "The lease was taken over; this attempt's outcome changed nothing.");
        } else if settlement.state != OutboxState::Done {
            tracing::info!(operation = %row.operation_key, state = %settlement.state, status = ?settlement.status, error = ?settlement.error, "An attempt did not complete the operation.");
        }
        Ok(())
    }
}

impl Dispatcher {
    /// [`outbox::complete`], tried again with backoff while the lease lasts when the database
    /// fails; when PostgreSQL refuses the record itself (a data error), the row is settled with
    /// plain texts, and at worst without its attempt record.
    async fn record(
        &self,
        row: &Leased,
        settlement: &Settlement,
        attempt: &Attempt<'_>,
        lease_deadline: Instant,
    ) -> sqlx::Result<bool> {
        let mut backoff = Duration::from_millis(100);
        loop {
            let error = match outbox::complete(&self.pool, row, settlement, attempt).await {
                Ok(applied) => return Ok(applied),
                Err(e) => e,
            };
            if crate::db::is_data_error(&error) {
                return self.record_plainly(row, settlement, attempt, &error).await;
            }
            if Instant::now() + backoff >= lease_deadline {
                return Err(error);
            }
            tracing::warn!(operation = %row.operation_key, error = %error, retry_in_ms = backoff.as_millis() as u64, "Could not record an attempt; trying again before the lease ends.");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// The record PostgreSQL refused, kept to what it can always store: the state, the status,
    /// and why the rest is missing.
    async fn record_plainly(
        &self,
        row: &Leased,
        settlement: &Settlement,
        attempt: &Attempt<'_>,
        refusal: &sqlx::Error,
    ) -> sqlx::Result<bool> {
        let why = format!("the attempt's answer could not be recorded: {refusal}");
        tracing::error!(operation = %row.operation_key, error = %refusal, "PostgreSQL refused an attempt's record; settling the operation without its answer.");
        let plain = Settlement {
            error: Some(why),
            response: None,
            ..settlement.clone()
        };
        match outbox::complete(&self.pool, row, &plain, attempt).await {
            Err(e) if crate::db::is_data_error(&e) => {
                outbox::complete_unrecorded(&self.pool, row, &plain).await
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_starts_only_with_a_full_timeout_left_on_the_lease() {
        let now = Instant::now();
        let timeout = Duration::from_secs(10);
        assert!(may_start_request(
            now + Duration::from_secs(11),
            now,
            timeout
        ));
        assert!(!may_start_request(
            now + Duration::from_secs(10),
            now,
            timeout
        ));
        assert!(!may_start_request(
            now + Duration::from_secs(3),
            now,
            timeout
        ));
        assert!(!may_start_request(
            now,
            now + Duration::from_secs(1),
            timeout
        ));
    }

    #[tokio::test]
    async fn a_lease_shorter_than_two_request_timeouts_is_refused() {
        let metrics = DispatchMetrics::new(&prometheus::Registry::new()).unwrap();
        let pool =
            crate::db::Db::from(sqlx::PgPool::connect_lazy("postgres://localhost/none").unwrap());
        let settings = |lease_ms, timeout_ms| DispatchSettings {
            lease: Duration::from_millis(lease_ms),
            request_timeout: Duration::from_millis(timeout_ms),
            ..DispatchSettings::new("w")
        };
        let refused = Dispatcher::build(
            settings(1500, 1000),
            pool.clone(),
            metrics.clone(),
            Health::default(),
        );
        assert!(refused.is_err());
        assert!(Dispatcher::build(settings(2500, 1000), pool, metrics, Health::default()).is_ok());
    }
}
