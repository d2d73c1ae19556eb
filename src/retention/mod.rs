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
pub mod expired;
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
    /// - standard-webhooks: Svix's schedule ends after about 28 hours.
    pub fn floor(self) -> Option<Duration> {
        match self {
            Self::Stripe => Some(4 * DAY),
            Self::Github => Some(8 * DAY),
            Self::Shopify => Some(DAY),
            Self::Slack => Some(DAY),
            Self::StandardWebhooks => Some(2 * DAY),
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
    /// Settled payloads (the ledger's rows, done operations' bodies, resolved expired replays'):
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
    #[error("source {name} keeps claims for {retention}, shorter than the topic {topic} keeps messages ({topic_retention}): a new group or an offset reset would replay events whose keys are gone; shorten the topic's retention.ms or pass --allow-below-topic-retention (audited)")]
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
        Ok(Decided {
            source: name.into(),
            kind,
            retention: stated.unwrap_or(self.default),
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

/// Refuses a retention shorter than the topic keeps its messages (`None`: forever).
pub fn check_topic(
    decided: &[Decided],
    topic: &str,
    topic_retention: Option<Duration>,
) -> Result<(), Refusal> {
    for d in decided {
        if topic_retention.is_none_or(|t| d.retention < t) {
            return Err(Refusal::BelowTopic {
                name: d.source.clone(),
                retention: show(d.retention),
                topic: topic.into(),
                topic_retention: topic_retention.map_or("forever".into(), show),
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
        assert_eq!(Kind::StandardWebhooks.floor(), Some(2 * DAY));
        assert_eq!(Kind::Hmac.floor(), None);
        assert_eq!(unknown_kind_floor(), 8 * DAY);
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
    fn a_source_seen_only_in_the_database_takes_the_default_and_the_highest_floor() {
        let mut lifetimes = Lifetimes {
            default: 7 * DAY,
            ..Lifetimes::default()
        };
        let refused = lifetimes.decide(&["old".into()], false).unwrap_err();
        assert!(matches!(refused, Refusal::BelowFloor { ref name, .. } if name == "old"));
        lifetimes.default = 8 * DAY;
        let decided = lifetimes.decide(&["old".into()], false).unwrap();
        assert_eq!(decided[0].retention, 8 * DAY);
        assert_eq!(decided[0].kind, None);
    }

    #[test]
    fn a_retention_shorter_than_the_topics_is_refused() {
        let decided = with("s", Some(Kind::Stripe), None)
            .decide(&[], false)
            .unwrap();
        assert!(check_topic(&decided, "t", Some(7 * DAY)).is_ok());
        let refused = check_topic(&decided, "t", Some(40 * DAY)).unwrap_err();
        assert!(matches!(refused, Refusal::BelowTopic { .. }));
        // A topic that keeps its messages forever can always be replayed from its start.
        assert!(check_topic(&decided, "t", None).is_err());
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
