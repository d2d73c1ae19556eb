//! The two rules every dispatcher follows for a destination, both pure: what it admits now, by
//! an operator's pause, its limits (concurrency, rate), its circuit breaker and a 429's pause
//! ([`admit`]), and what
//! an answer does to its breaker and pause ([`transition`]). Both read and give the
//! destination's shared row; [`super::lease_within_limits`] and [`super::record_health`] hold
//! its lock around them.

use chrono::{DateTime, Utc};
use std::time::Duration;

/// The limits of one destination, as `[dispatch.destinations]` configures them.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Requests in flight to the origin at once, across every dispatcher; None for no limit.
    pub max_concurrency: Option<u32>,
    /// Requests started per second, across every dispatcher; None for no limit.
    pub rate_per_sec: Option<f64>,
    /// Retryable failures in a row that open the circuit breaker; None for no breaker.
    pub breaker_failures: Option<u32>,
    /// How long the breaker stays open before one probe request is let through.
    pub breaker_open: Duration,
}

/// How long an open breaker waits before its probe, unless configured.
pub const DEFAULT_BREAKER_OPEN: Duration = Duration::from_secs(30);

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_concurrency: None,
            rate_per_sec: None,
            breaker_failures: None,
            breaker_open: DEFAULT_BREAKER_OPEN,
        }
    }
}

/// A circuit breaker's position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, sqlx::Type, serde::Serialize)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum Breaker {
    /// Requests go out.
    Closed,
    /// None go out until it half-opens.
    Open,
    /// One probe is out; its answer closes or reopens the breaker.
    HalfOpen,
}

impl Breaker {
    /// Every position.
    pub const ALL: [Self; 3] = [Self::Closed, Self::Open, Self::HalfOpen];

    /// The position as stored and as the metric's label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half_open",
        }
    }
}

/// An operator's pause of a destination (`destinations pause`): nothing is admitted while it
/// holds, so its operations stay due and spend no attempt.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Pause {
    /// Who paused it.
    pub by: String,
    /// Why, as the audit row has it.
    pub reason: String,
    /// When.
    pub at: DateTime<Utc>,
    /// When it ends by itself (`--until`); None: when it is resumed.
    pub until: Option<DateTime<Utc>>,
}

impl Pause {
    /// Whether the pause still holds at `now`.
    pub fn holds(&self, now: DateTime<Utc>) -> bool {
        self.until.is_none_or(|until| until > now)
    }
}

/// An origin's shared state, as read under its row lock.
#[derive(Debug, Clone)]
pub struct DestinationState {
    /// An operator's pause, while it holds or after it ended by itself.
    pub pause: Option<Pause>,
    /// The breaker's position.
    pub breaker: Breaker,
    /// When an open breaker lets its probe through.
    pub open_until: Option<DateTime<Utc>>,
    /// When a half-open breaker's probe is taken for lost, and another may go.
    pub probe_until: Option<DateTime<Utc>>,
    /// A 429's wait: nothing starts before then.
    pub paused_until: Option<DateTime<Utc>>,
    /// The rate's schedule: the earliest start of the next request.
    pub next_start_at: DateTime<Utc>,
}

/// The rate limit schedules starts at most this far ahead of now: a worker waits for its
/// start, and a worker that dies wastes no more than this much of the rate.
pub const RATE_HORIZON: Duration = Duration::from_secs(1);

/// What the limits admit now.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    /// How many operations may be leased.
    pub count: usize,
    /// When the first may start (the rate's schedule); each further one `spacing` later.
    pub first_start: DateTime<Utc>,
    /// The rate's spacing between starts; zero without a rate.
    pub spacing: chrono::Duration,
    /// The breaker half-opens: the one admitted operation is its probe.
    pub probe: bool,
}

impl Admission {
    fn none(now: DateTime<Utc>) -> Self {
        Self {
            count: 0,
            first_start: now,
            spacing: chrono::Duration::zero(),
            probe: false,
        }
    }

    /// When the `i`th admitted operation may start.
    pub fn start(&self, i: usize) -> DateTime<Utc> {
        self.first_start + self.spacing * i32::try_from(i).unwrap_or(i32::MAX)
    }
}

/// What `limits` admit for an origin in `state` at `now` with `in_flight` requests out, when
/// the worker has room for `room`: the one rule every dispatcher follows.
pub fn admit(
    state: &DestinationState,
    limits: &Limits,
    now: DateTime<Utc>,
    in_flight: i64,
    room: usize,
) -> Admission {
    if state.pause.as_ref().is_some_and(|p| p.holds(now)) {
        return Admission::none(now);
    }
    if state.paused_until.is_some_and(|t| t > now) {
        return Admission::none(now);
    }
    let probe = match state.breaker {
        Breaker::Closed => false,
        Breaker::Open if state.open_until.is_some_and(|t| t > now) => return Admission::none(now),
        Breaker::HalfOpen if state.probe_until.is_some_and(|t| t > now) => {
            return Admission::none(now)
        }
        Breaker::Open | Breaker::HalfOpen => true,
    };
    let mut count = if probe { room.min(1) } else { room };
    if let Some(max) = limits.max_concurrency {
        let left = i64::from(max).saturating_sub(in_flight).max(0);
        count = count.min(usize::try_from(left).unwrap_or(0));
    }
    let mut admission = Admission {
        count,
        probe,
        ..Admission::none(now)
    };
    if let Some(rate) = limits.rate_per_sec.filter(|r| *r > 0.0) {
        let spacing = chrono::Duration::from_std(Duration::from_secs_f64(1.0 / rate))
            .unwrap_or(chrono::Duration::MAX);
        let first = state.next_start_at.max(now);
        let horizon = now + chrono::Duration::from_std(RATE_HORIZON).unwrap_or_default();
        let slots = if first > horizon {
            0
        } else {
            let ahead = (horizon - first).num_microseconds().unwrap_or(i64::MAX);
            let step = spacing.num_microseconds().unwrap_or(i64::MAX).max(1);
            usize::try_from(ahead / step + 1).unwrap_or(usize::MAX)
        };
        admission.count = admission.count.min(slots);
        admission.first_start = first;
        admission.spacing = spacing;
    }
    admission
}

/// What an answer says of its destination's health.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    /// It answered (2xx, 4xx, a redirect): the breaker closes.
    Answering,
    /// A retryable failure: 5xx, a refused connection, no answer.
    Failing,
    /// A 429: nothing starts to it before this long has passed.
    SlowDown(Duration),
    /// Says nothing of the destination (the request could not be built).
    Unknown,
}

/// What happened to the breaker when an answer was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerChange {
    /// As it was.
    Unchanged,
    /// It opened: the destination gets nothing until its probe.
    Opened,
    /// It closed: the destination answers again.
    Closed,
}

impl BreakerChange {
    /// What moving the breaker from `before` to `after` did.
    pub fn between(before: Breaker, after: Breaker) -> Self {
        match after {
            Breaker::Open if before != Breaker::Open => Self::Opened,
            Breaker::Closed if before != Breaker::Closed => Self::Closed,
            _ => Self::Unchanged,
        }
    }
}

/// An origin's health as its row keeps it: what the answers so far made of its breaker and
/// its pause.
#[derive(Debug, Clone, PartialEq)]
pub struct Health {
    /// The breaker's position.
    pub breaker: Breaker,
    /// Retryable failures in a row; any other answer resets it.
    pub consecutive_failures: i32,
    /// When the breaker last opened.
    pub opened_at: Option<DateTime<Utc>>,
    /// When an open breaker lets its probe through.
    pub open_until: Option<DateTime<Utc>>,
    /// When a half-open breaker's probe is taken for lost.
    pub probe_until: Option<DateTime<Utc>>,
    /// A 429's wait: nothing starts before then.
    pub paused_until: Option<DateTime<Utc>>,
}

/// What an answer's `verdict` at `now` makes of an origin's `health` under `limits`: the
/// breaker's one rule. None when the answer changes nothing worth writing.
///
/// - An answer (2xx, 4xx, a redirect) closes the breaker and resets the failures.
/// - A retryable failure counts; with a breaker configured, it opens the breaker for
///   `breaker_open` when it is the failed probe of a half-open breaker or the
///   `breaker_failures`th in a row. An open breaker stays as it opened.
/// - A 429 pauses the origin until its wait has passed, never shortening a longer pause.
/// - Any answer but an unknown one ends a probe: the next is decided by the breaker.
pub fn transition(
    health: &Health,
    limits: &Limits,
    verdict: Verdict,
    now: DateTime<Utc>,
) -> Option<Health> {
    match verdict {
        Verdict::Unknown => None,
        Verdict::Answering => (health.breaker != Breaker::Closed
            || health.consecutive_failures != 0)
            .then(|| Health {
                breaker: Breaker::Closed,
                consecutive_failures: 0,
                open_until: None,
                probe_until: None,
                ..health.clone()
            }),
        Verdict::Failing => Some(failed(health, limits, now)),
        Verdict::SlowDown(wait) => Some(Health {
            paused_until: health.paused_until.max(Some(now + chrono_duration(wait))),
            probe_until: None,
            ..health.clone()
        }),
    }
}

/// `health` after one more retryable failure at `now`.
fn failed(health: &Health, limits: &Limits, now: DateTime<Utc>) -> Health {
    let consecutive_failures = health.consecutive_failures.saturating_add(1);
    let trips = limits.breaker_failures.is_some_and(|n| {
        health.breaker == Breaker::HalfOpen || i64::from(consecutive_failures) >= i64::from(n)
    });
    let mut after = Health {
        consecutive_failures,
        probe_until: None,
        ..health.clone()
    };
    if trips && health.breaker != Breaker::Open {
        after.breaker = Breaker::Open;
        after.opened_at = Some(now);
        after.open_until = Some(now + chrono_duration(limits.breaker_open));
    }
    after
}

fn chrono_duration(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + ms).unwrap()
    }

    fn closed() -> DestinationState {
        DestinationState {
            pause: None,
            breaker: Breaker::Closed,
            open_until: None,
            probe_until: None,
            paused_until: None,
            next_start_at: at(-1_000_000),
        }
    }

    #[test]
    fn concurrency_admits_only_what_is_left_across_every_dispatcher() {
        let limits = Limits {
            max_concurrency: Some(4),
            ..Limits::default()
        };
        assert_eq!(admit(&closed(), &limits, at(0), 0, 32).count, 4);
        assert_eq!(admit(&closed(), &limits, at(0), 3, 32).count, 1);
        assert_eq!(admit(&closed(), &limits, at(0), 4, 32).count, 0);
        assert_eq!(admit(&closed(), &limits, at(0), 9, 32).count, 0);
        assert_eq!(
            admit(&closed(), &Limits::default(), at(0), 99, 32).count,
            32
        );
    }

    #[test]
    fn the_rate_schedules_starts_evenly_and_never_more_than_a_second_ahead() {
        let limits = Limits {
            rate_per_sec: Some(10.0),
            ..Limits::default()
        };
        let a = admit(&closed(), &limits, at(0), 0, 100);
        assert_eq!(a.count, 11, "now, then every 100 ms up to a second ahead");
        assert_eq!(a.start(0), at(0));
        assert_eq!(a.start(10), at(1_000));
        // The next turn continues the schedule where the last ended.
        let later = DestinationState {
            next_start_at: a.start(11),
            ..closed()
        };
        let b = admit(&later, &limits, at(50), 0, 100);
        assert_eq!((b.count, b.start(0)), (0, at(1_100)));
        let b = admit(&later, &limits, at(100), 0, 100);
        assert_eq!((b.count, b.start(0)), (1, at(1_100)));
    }

    #[test]
    fn an_open_breaker_admits_nothing_then_one_probe_and_a_429_pauses() {
        let open = DestinationState {
            breaker: Breaker::Open,
            open_until: Some(at(30_000)),
            ..closed()
        };
        let limits = Limits::default();
        assert_eq!(admit(&open, &limits, at(29_999), 0, 32).count, 0);
        let probe = admit(&open, &limits, at(30_000), 0, 32);
        assert_eq!((probe.count, probe.probe), (1, true));
        let probing = DestinationState {
            breaker: Breaker::HalfOpen,
            probe_until: Some(at(60_000)),
            ..closed()
        };
        assert_eq!(admit(&probing, &limits, at(40_000), 0, 32).count, 0);
        assert_eq!(
            admit(&probing, &limits, at(60_000), 0, 32).count,
            1,
            "a lost probe"
        );
        let paused = DestinationState {
            paused_until: Some(at(5_000)),
            ..closed()
        };
        assert_eq!(admit(&paused, &limits, at(4_999), 0, 32).count, 0);
        assert_eq!(admit(&paused, &limits, at(5_000), 0, 32).count, 32);
    }

    #[test]
    fn an_operators_pause_admits_nothing_until_it_ends_whatever_the_breaker() {
        let pause = |until| Pause {
            by: "ana".into(),
            reason: "maintenance".into(),
            at: at(0),
            until,
        };
        let limits = Limits::default();
        let paused = DestinationState {
            pause: Some(pause(None)),
            ..closed()
        };
        assert_eq!(admit(&paused, &limits, at(0), 0, 32).count, 0);
        assert_eq!(admit(&paused, &limits, at(86_400_000), 0, 32).count, 0);
        let probing = DestinationState {
            breaker: Breaker::Open,
            open_until: Some(at(0)),
            ..paused.clone()
        };
        assert_eq!(
            admit(&probing, &limits, at(1_000), 0, 32).count,
            0,
            "no probe either"
        );
        let until = DestinationState {
            pause: Some(pause(Some(at(5_000)))),
            ..closed()
        };
        assert_eq!(admit(&until, &limits, at(4_999), 0, 32).count, 0);
        assert_eq!(
            admit(&until, &limits, at(5_000), 0, 32).count,
            32,
            "it ended by itself"
        );
    }

    fn healthy() -> Health {
        Health {
            breaker: Breaker::Closed,
            consecutive_failures: 0,
            opened_at: None,
            open_until: None,
            probe_until: None,
            paused_until: None,
        }
    }

    fn breaking_after(n: u32) -> Limits {
        Limits {
            breaker_failures: Some(n),
            breaker_open: Duration::from_secs(30),
            ..Limits::default()
        }
    }

    #[test]
    fn failures_in_a_row_open_the_breaker_once_for_its_open_time() {
        let limits = breaking_after(3);
        let mut health = healthy();
        for _ in 0..2 {
            health = transition(&health, &limits, Verdict::Failing, at(0)).unwrap();
            assert_eq!(health.breaker, Breaker::Closed);
        }
        let opened = transition(&health, &limits, Verdict::Failing, at(10)).unwrap();
        assert_eq!(opened.breaker, Breaker::Open);
        assert_eq!(opened.consecutive_failures, 3);
        assert_eq!(opened.opened_at, Some(at(10)));
        assert_eq!(opened.open_until, Some(at(30_010)));
        assert_eq!(
            BreakerChange::between(health.breaker, opened.breaker),
            BreakerChange::Opened
        );
        let again = transition(&opened, &limits, Verdict::Failing, at(20)).unwrap();
        assert_eq!(
            (again.breaker, again.opened_at, again.open_until),
            (Breaker::Open, Some(at(10)), Some(at(30_010))),
            "an open breaker stays as it opened"
        );
        assert_eq!(
            BreakerChange::between(opened.breaker, again.breaker),
            BreakerChange::Unchanged
        );
    }

    #[test]
    fn without_a_breaker_failures_only_count() {
        let mut health = healthy();
        for _ in 0..100 {
            health = transition(&health, &Limits::default(), Verdict::Failing, at(0)).unwrap();
        }
        assert_eq!(
            (health.breaker, health.consecutive_failures),
            (Breaker::Closed, 100)
        );
    }

    #[test]
    fn a_failed_probe_reopens_and_an_answer_closes() {
        let limits = breaking_after(5);
        let probing = Health {
            breaker: Breaker::HalfOpen,
            consecutive_failures: 5,
            opened_at: Some(at(0)),
            probe_until: Some(at(60_000)),
            ..healthy()
        };
        let reopened = transition(&probing, &limits, Verdict::Failing, at(40_000)).unwrap();
        assert_eq!(reopened.breaker, Breaker::Open);
        assert_eq!(reopened.open_until, Some(at(70_000)));
        assert_eq!(reopened.probe_until, None);
        let closed = transition(&probing, &limits, Verdict::Answering, at(40_000)).unwrap();
        assert_eq!(
            closed,
            Health {
                opened_at: Some(at(0)),
                ..healthy()
            }
        );
        assert_eq!(
            BreakerChange::between(probing.breaker, closed.breaker),
            BreakerChange::Closed
        );
        assert_eq!(
            transition(&healthy(), &limits, Verdict::Answering, at(0)),
            None,
            "a healthy origin's answer writes nothing"
        );
        assert_eq!(transition(&probing, &limits, Verdict::Unknown, at(0)), None);
    }

    #[test]
    fn a_429_pauses_without_shortening_a_longer_pause_or_moving_the_breaker() {
        let limits = breaking_after(1);
        let slow = |secs| Verdict::SlowDown(Duration::from_secs(secs));
        let paused = transition(&healthy(), &limits, slow(5), at(0)).unwrap();
        assert_eq!(paused.paused_until, Some(at(5_000)));
        assert_eq!(paused.breaker, Breaker::Closed);
        let kept = transition(&paused, &limits, slow(1), at(1_000)).unwrap();
        assert_eq!(kept.paused_until, Some(at(5_000)), "the longer pause holds");
        let longer = transition(&paused, &limits, slow(10), at(1_000)).unwrap();
        assert_eq!(longer.paused_until, Some(at(11_000)));
    }
}
