//! Retention: how long each table keeps its rows, checked against how long each kind of sender
//! redelivers, and the prune that deletes what is past it without reopening the hole.
//!
//! A claim is the only thing standing between a redelivery and a second effect, so it is kept at
//! least as long as its sender may deliver the event again. Each kind has a floor, the longest
//! redelivery its provider documents plus a margin ([`Kind::floor`]); a retention below it is
//! refused unless asked for, and then audited. A redelivery that still arrives after its key was
//! pruned is caught, for kinds whose deliveries carry the event's own time: its key is unknown
//! and it is older than its source's prune horizon, so it is recorded as an expired replay
//! ([`expired`]) instead of applied.

pub mod erase;
mod erase_search;
pub mod expired;
pub mod metrics;
pub mod prune;
pub mod round;

#[cfg(feature = "cli")]
pub mod args;
pub mod background;

use crate::ingest::config::Kind;
use std::collections::BTreeMap;
use std::time::Duration;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// The retention of a source not given one: Stripe's 30 days of manual resends, and a margin.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(35 * 24 * 3600);

impl Kind {
    /// The shortest retention that outlives every redelivery the provider documents, with a
    /// margin; None for `hmac`, whose sender is unknown, so its retention must be stated.
    ///
    /// - stripe: automatic retries for up to 3 days in live mode.
    /// - github: no automatic retries; redelivery by hand for 3 days (7 on GitHub Enterprise
    ///   Server), so 8 days.
    /// - shopify: 8 retries over 4 hours (since 2024-09-10).
    /// - slack: 3 retries within about 6 minutes.
    /// - standard-webhooks: Svix's automatic schedule ends after about 28 hours, but its
    ///   manual Resend and Recover send a message again, with its `webhook-id` and no time of
    ///   the event, for as long as Svix keeps its payload: 90 days by default. So 91 days.
    pub fn floor(self) -> Option<Duration> {
        match self {
            Self::Stripe => Some(4 * DAY),
            Self::Github => Some(8 * DAY),
            Self::Shopify => Some(DAY),
            Self::Slack => Some(DAY),
            Self::StandardWebhooks => Some(91 * DAY),
            Self::Hmac => None,
        }
    }

    /// Whether this kind's deliveries carry the event's own time, so a redelivery after its
    /// key was pruned is caught as an expired replay.
    pub fn carries_event_time(self) -> bool {
        matches!(self, Self::Stripe | Self::Shopify | Self::Slack)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::Github => "github",
            Self::Shopify => "shopify",
            Self::Slack => "slack",
            Self::StandardWebhooks => "standard-webhooks",
            Self::Hmac => "hmac",
        }
    }
}

/// The floor of a source whose kind is unknown (it is not in the configuration): the highest
/// of every kind's.
pub fn unknown_kind_floor() -> Duration {
    [
        Kind::Stripe,
        Kind::Github,
        Kind::Shopify,
        Kind::Slack,
        Kind::StandardWebhooks,
    ]
    .into_iter()
    .filter_map(Kind::floor)
    .max()
    .expect("kinds have floors")
}

/// How long each kind of row is kept. Claims follow their source's retention; the rest have one
/// lifetime each.
#[derive(Debug, Clone, PartialEq)]
pub struct Lifetimes {
    /// Claims of sources with no retention of their own.
    pub default: Duration,
    /// Each source's own retention, by name.
    pub sources: BTreeMap<String, SourceRetention>,
    /// Settled payloads (the ledger's rows, done and dead operations' bodies and answers,
    /// resolved expired replays'):
    /// after it only the key, the hash and the status remain.
    pub payload: Duration,
    /// Dead letters an operator replayed (the others are kept for the operator).
    pub dead_letter: Duration,
    /// Key conflicts, from when the payload was last seen.
    pub conflict: Duration,
    /// Attempts of operations that are done or dead.
    pub attempt: Duration,
    /// The replay guard's fingerprints: at least the longest replay window of any source.
    pub fingerprint: Duration,
    /// Operator audit rows.
    pub audit: Duration,
    /// Expired replays an operator applied or dropped.
    pub expired_replay: Duration,
}

/// One configured source: its kind, when known, and its retention, when stated.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceRetention {
    pub kind: Option<Kind>,
    pub retention: Option<Duration>,
    /// The replay guard's window, which the fingerprints must outlive.
    pub replay_window: Option<Duration>,
}

impl Default for Lifetimes {
    fn default() -> Self {
        Self {
            default: DEFAULT_RETENTION,
            sources: BTreeMap::new(),
            payload: 7 * DAY,
            dead_letter: 30 * DAY,
            conflict: 30 * DAY,
            attempt: 30 * DAY,
            fingerprint: 8 * DAY,
            audit: 365 * DAY,
            expired_replay: 30 * DAY,
        }
    }
}

/// The retention one source's claims are pruned under.
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    pub source: String,
    pub kind: Option<Kind>,
    pub retention: Duration,
    /// The floor it was checked against.
    pub floor: Option<Duration>,
}

impl Decided {
    /// Whether the retention is below the floor of its kind.
    pub fn below_floor(&self) -> bool {
        self.floor.is_some_and(|f| self.retention < f)
    }
}

/// Why prune refuses to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// An `hmac` source has no documented redelivery window, so its retention must be stated.
    #[error("source {0} is of kind hmac, whose sender's redeliveries are unknown: give it a retention (retention = \"35d\" in its [[ingest.sources]] entry, or --source-retention {0}=35d)")]
    Unstated(String),
    /// A retention below its kind's floor, without `--allow-below-floor`.
    #[error("source {name} keeps claims for {retention}, below the {floor} floor of its kind ({kind}): a redelivery after that would be applied again; pass --allow-below-floor to prune anyway (audited)")]
    BelowFloor {
        name: String,
        kind: String,
        retention: String,
        floor: String,
    },
    /// A retention shorter than the topic keeps its messages: a new group or an offset reset
    /// would replay messages whose keys are gone.
    #[error("source {name} keeps claims for {retention}, shorter than the topic {topic} keeps its records readable ({topic_retention}): a new group or an offset reset would replay events whose keys are gone; shorten the topic's retention.ms or segment.ms, or pass --allow-below-topic-retention (audited)")]
    BelowTopic {
        name: String,
        retention: String,
        topic: String,
        topic_retention: String,
    },
    /// Fingerprints kept for less than a source's replay window.
    #[error("fingerprints are kept for {lifetime}, shorter than the replay window of source {name} ({window}): a replayed capture would be taken for a new event")]
    FingerprintsTooShort {
        name: String,
        lifetime: String,
        window: String,
    },
}

fn show(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

impl Lifetimes {
    /// The retention of every source in `seen` (the sources with claims) and every configured
    /// one, or the first refusal. Below-floor retentions pass when `allow_below_floor`; the
    /// caller audits them.
    pub fn decide(
        &self,
        seen: &[String],
        allow_below_floor: bool,
    ) -> Result<Vec<Decided>, Refusal> {
        self.check_fingerprints()?;
        let mut names: Vec<&String> = self.sources.keys().chain(seen).collect();
        names.sort();
        names.dedup();
        let mut decided = Vec::new();
        for name in names {
            let one = self.decide_one(name)?;
            if one.below_floor() && !allow_below_floor {
                return Err(Refusal::BelowFloor {
                    name: one.source,
                    kind: one.kind.map_or("unknown", Kind::as_str).into(),
                    retention: show(one.retention),
                    floor: show(one.floor.unwrap_or_default()),
                });
            }
            decided.push(one);
        }
        Ok(decided)
    }

    fn decide_one(&self, name: &str) -> Result<Decided, Refusal> {
        let configured = self.sources.get(name);
        let kind = configured.and_then(|s| s.kind);
        let stated = configured.and_then(|s| s.retention);
        if kind == Some(Kind::Hmac) && stated.is_none() {
            return Err(Refusal::Unstated(name.into()));
        }
        let floor = match kind {
            Some(kind) => kind.floor(),
            None => Some(unknown_kind_floor()),
        };
        // A source given no retention of its own keeps the default, or its kind's floor when
        // that is longer: only a stated retention can be below a floor.
        let unstated = floor.map_or(self.default, |f| f.max(self.default));
        Ok(Decided {
            source: name.into(),
            kind,
            retention: stated.unwrap_or(unstated),
            floor,
        })
    }

    fn check_fingerprints(&self) -> Result<(), Refusal> {
        for (name, source) in &self.sources {
            match source.replay_window {
                Some(window) if window > self.fingerprint => {
                    return Err(Refusal::FingerprintsTooShort {
                        name: name.clone(),
                        lifetime: show(self.fingerprint),
                        window: show(window),
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Kafka's own default `segment.ms`: a week.
pub const KAFKA_DEFAULT_SEGMENT: Duration = Duration::from_secs(7 * 24 * 3600);

/// Added to how long a topic keeps its records before claims may go: the broker deletes
/// expired segments only at its retention checks (`log.retention.check.interval.ms`, five
/// minutes by default), and clocks differ.
pub const TOPIC_MARGIN: Duration = Duration::from_secs(3600);

/// How long a topic keeps its records readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopicKeeps {
    /// Some record of every key stays: `retention.ms` is -1, or `cleanup.policy` compacts.
    Forever { compacted: bool },
    /// Records are deleted a whole segment at a time, once the segment's newest record is past
    /// `retention`, and a segment is closed after `segment` (`segment.ms`): a record stays
    /// readable for up to `retention + segment`.
    For {
        retention: Duration,
        segment: Duration,
    },
}

impl TopicKeeps {
    /// The shortest claims retention that outlives every record of the topic: `retention.ms`
    /// plus `segment.ms` plus [`TOPIC_MARGIN`]; None when no retention does.
    pub fn claims_floor(&self) -> Option<Duration> {
        match *self {
            Self::Forever { .. } => None,
            Self::For { retention, segment } => Some(retention + segment + TOPIC_MARGIN),
        }
    }

    fn said(&self) -> String {
        match *self {
            Self::Forever { compacted: true } => {
                "for ever: it is compacted (cleanup.policy=compact), so the newest record of \
                 every key stays"
                    .into()
            }
            Self::Forever { compacted: false } => "for ever (retention.ms -1)".into(),
            Self::For { retention, segment } => format!(
                "for up to {}: retention.ms {} plus segment.ms {}, as records go a segment at a \
                 time, plus a margin of {}",
                show(retention + segment + TOPIC_MARGIN),
                show(retention),
                show(segment),
                show(TOPIC_MARGIN)
            ),
        }
    }
}

/// Refuses a retention shorter than the topic keeps its records readable.
pub fn check_topic(decided: &[Decided], topic: &str, keeps: TopicKeeps) -> Result<(), Refusal> {
    let floor = keeps.claims_floor();
    for d in decided {
        if floor.is_none_or(|f| d.retention < f) {
            return Err(Refusal::BelowTopic {
                name: d.source.clone(),
                retention: show(d.retention),
                topic: topic.into(),
                topic_retention: keeps.said(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(name: &str, kind: Option<Kind>, retention: Option<Duration>) -> Lifetimes {
        let mut lifetimes = Lifetimes::default();
        lifetimes.sources.insert(
            name.into(),
            SourceRetention {
                kind,
                retention,
                replay_window: None,
            },
        );
        lifetimes
    }

    #[test]
    fn each_kind_below_its_floor_is_refused_and_passes_when_allowed() {
        for kind in [
            Kind::Stripe,
            Kind::Github,
            Kind::Shopify,
            Kind::Slack,
            Kind::StandardWebhooks,
        ] {
            let floor = kind.floor().unwrap();
            let below = with("s", Some(kind), Some(floor - Duration::from_secs(1)));
            let refused = below.decide(&[], false).unwrap_err();
            assert!(matches!(refused, Refusal::BelowFloor { .. }), "{kind:?}");
            assert!(refused.to_string().contains("--allow-below-floor"));
            let allowed = below.decide(&[], true).unwrap();
            assert!(allowed[0].below_floor());
            let at = with("s", Some(kind), Some(floor));
            assert!(!at.decide(&[], false).unwrap()[0].below_floor());
        }
    }

    #[test]
    fn the_floors_are_the_documented_windows_with_a_margin() {
        assert_eq!(Kind::Stripe.floor(), Some(4 * DAY));
        assert_eq!(Kind::Github.floor(), Some(8 * DAY));
        assert_eq!(Kind::Shopify.floor(), Some(DAY));
        assert_eq!(Kind::Slack.floor(), Some(DAY));
        assert_eq!(Kind::StandardWebhooks.floor(), Some(91 * DAY));
        assert_eq!(Kind::Hmac.floor(), None);
        assert_eq!(unknown_kind_floor(), 91 * DAY);
    }

    #[test]
    fn an_hmac_source_must_state_its_retention() {
        let unstated = with("custom", Some(Kind::Hmac), None);
        assert_eq!(
            unstated.decide(&[], true).unwrap_err(),
            Refusal::Unstated("custom".into())
        );
        let stated = with("custom", Some(Kind::Hmac), Some(Duration::from_secs(60)));
        assert_eq!(
            stated.decide(&[], false).unwrap()[0].retention,
            Duration::from_secs(60)
        );
    }

    #[test]
    fn a_source_seen_only_in_the_database_takes_the_default_or_the_highest_floor() {
        let lifetimes = Lifetimes {
            default: 7 * DAY,
            ..Lifetimes::default()
        };
        let decided = lifetimes.decide(&["old".into()], false).unwrap();
        assert_eq!(decided[0].retention, unknown_kind_floor());
        assert_eq!(decided[0].kind, None);
        let longer = Lifetimes {
            default: 100 * DAY,
            ..Lifetimes::default()
        };
        assert_eq!(
            longer.decide(&["old".into()], false).unwrap()[0].retention,
            100 * DAY
        );
    }

    #[test]
    fn a_standard_webhooks_source_keeps_its_claims_while_svix_can_resend_them() {
        // Svix's Resend and Recover keep the webhook-id and carry no event time: the claim is
        // the only guard for as long as Svix keeps the payload (90 days by default).
        let unstated = with("svix", Some(Kind::StandardWebhooks), None);
        assert_eq!(unstated.decide(&[], false).unwrap()[0].retention, 91 * DAY);
        let stated = with("svix", Some(Kind::StandardWebhooks), Some(35 * DAY));
        let refused = stated.decide(&[], false).unwrap_err();
        assert!(matches!(refused, Refusal::BelowFloor { .. }), "{refused}");
    }

    #[test]
    fn a_retention_shorter_than_the_topics_is_refused() {
        let decided = with("s", Some(Kind::Stripe), None)
            .decide(&[], false)
            .unwrap();
        let keeps = |retention, segment| TopicKeeps::For { retention, segment };
        assert!(check_topic(&decided, "t", keeps(7 * DAY, 7 * DAY)).is_ok());
        let refused = check_topic(&decided, "t", keeps(40 * DAY, DAY)).unwrap_err();
        assert!(matches!(refused, Refusal::BelowTopic { .. }));
        // A topic that keeps its messages forever can always be replayed from its start.
        let forever = TopicKeeps::Forever { compacted: false };
        assert!(check_topic(&decided, "t", forever).is_err());
    }

    #[test]
    fn a_topic_keeps_records_until_their_whole_segment_is_past_retention() {
        let decided = with("s", Some(Kind::Stripe), Some(35 * DAY))
            .decide(&[], false)
            .unwrap();
        let keeps = |retention, segment| TopicKeeps::For { retention, segment };
        // retention.ms alone fits under 35 days; with its week-long segments it does not.
        assert!(check_topic(&decided, "t", keeps(30 * DAY, Duration::ZERO)).is_ok());
        let refused = check_topic(&decided, "t", keeps(30 * DAY, 7 * DAY)).unwrap_err();
        assert!(
            refused.to_string().contains("segment.ms 7days"),
            "{refused}"
        );
        // Exactly retention + segment is not enough: the margin is needed too.
        assert!(check_topic(&decided, "t", keeps(28 * DAY, 7 * DAY)).is_err());
        assert!(check_topic(&decided, "t", keeps(28 * DAY, 7 * DAY - TOPIC_MARGIN)).is_ok());
        // A compacted topic keeps a record of every key for ever.
        let compacted = TopicKeeps::Forever { compacted: true };
        let refused = check_topic(&decided, "t", compacted).unwrap_err();
        assert!(refused.to_string().contains("compacted"), "{refused}");
    }

    #[test]
    fn fingerprints_must_outlive_every_replay_window() {
        let mut lifetimes = with("gh", Some(Kind::Github), None);
        lifetimes.sources.get_mut("gh").unwrap().replay_window = Some(10 * DAY);
        assert!(matches!(
            lifetimes.decide(&[], false).unwrap_err(),
            Refusal::FingerprintsTooShort { .. }
        ));
        lifetimes.fingerprint = 10 * DAY;
        assert!(lifetimes.decide(&[], false).is_ok());
    }
}
