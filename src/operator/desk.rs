//! The operator's desk: the world every operator path works in (the databases, the effects,
//! the dead-letter producer, the processor a replay by time applies with), assembled once by
//! [`Desk::build`]. The command line and the console each hold a `Desk` and nothing else of
//! it; every read and every change they offer is a call on it.

use super::events::{self, EventDetail, Resolution, Retry};
use super::search::{self, Page, Search};
use super::status::{self, KafkaTarget, Status};
use super::story::{self, Story};
use super::{dead_letters, expired, replay, Act, Change, OperatorError};
use crate::consume::{BatchProcessor, DeferSettings, EffectRetry};
use crate::db::Db;
use crate::effect::{BuiltIns, HttpOutbox, KafkaOutput, Registry};
use crate::shard::Shards;
use crate::sources::SourcePause;

/// How a replay by time applies its events: as `consume` would, with these effects.
#[derive(Clone, Default)]
pub struct ReplayEffects {
    /// The effects, as `consume --effect` names them.
    pub effects: Vec<String>,
    /// The `http` effect's target.
    pub http: Option<HttpOutbox>,
    /// The `kafka` effect's output topic.
    pub kafka: Option<KafkaOutput>,
    pub retry: EffectRetry,
    pub defer: DeferSettings,
    /// How the topic's messages are read, as `consume --input` reads them.
    pub input: crate::inputs::Input,
}

/// What a desk is built from.
pub struct DeskSettings {
    /// Every database.
    pub shards: Shards,
    /// The one database listings read instead of every shard (`--shard`).
    pub only: Option<Db>,
    pub registry: Registry,
    /// The brokers, topic and group: the lag, dead-letter replays and replays by time. None:
    /// no lag is shown and nothing is replayed.
    pub kafka: Option<KafkaTarget>,
    /// The topic dead letters are produced to instead of their own.
    pub letters_to: Option<String>,
    /// How a replay by time applies; None: no replay by time.
    pub replay: Option<ReplayEffects>,
}

/// The operator's world, assembled once.
pub struct Desk {
    shards: Shards,
    /// The databases a listing reads: every shard, or the one `--shard` names.
    listed: Vec<Db>,
    only: Option<Db>,
    registry: Registry,
    kafka: Option<KafkaTarget>,
    producer: Option<dead_letters::LetterProducer>,
    processor: Option<BatchProcessor>,
}

impl Desk {
    /// The desk `settings` describe: the producer connected and the replay's effects built.
    pub fn build(settings: DeskSettings) -> anyhow::Result<Self> {
        let DeskSettings {
            shards,
            only,
            registry,
            kafka,
            letters_to,
            replay,
        } = settings;
        let producer = match &kafka {
            Some(k) => Some(dead_letters::LetterProducer::new(
                &k.brokers, &k.options, letters_to,
            )?),
            None => None,
        };
        let processor = match (replay, &kafka) {
            (Some(r), Some(_)) => Some(
                BatchProcessor::new(
                    shards.clone(),
                    registry.build_with(
                        &r.effects,
                        BuiltIns {
                            http: r.http.as_ref(),
                            kafka: r.kafka.as_ref(),
                        },
                    )?,
                )
                .with_retry(r.retry)
                .with_defer(r.defer)
                .with_input(r.input),
            ),
            _ => None,
        };
        let listed = match &only {
            Some(pool) => vec![pool.clone()],
            None => shards.pools(),
        };
        Ok(Self {
            shards,
            listed,
            only,
            registry,
            kafka,
            producer,
            processor,
        })
    }

    /// The first database: every dead letter and the audit of a replay, and with one database
    /// everything.
    pub fn first(&self) -> &Db {
        self.shards.first()
    }

    /// The databases a listing reads, in order.
    pub fn databases(&self) -> &[Db] {
        &self.listed
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The brokers, topic and group, when the desk has them.
    pub fn kafka(&self) -> Option<&KafkaTarget> {
        self.kafka.as_ref()
    }

    /// The producer of dead letters' bytes; None without brokers.
    pub fn producer(&self) -> Option<&dead_letters::LetterProducer> {
        self.producer.as_ref()
    }

    /// What applies a replay by time; None without brokers or effects.
    pub fn processor(&self) -> Option<&BatchProcessor> {
        self.processor.as_ref()
    }

    /// The database holding `key`; None when no shard does.
    pub async fn holding(&self, key: &str) -> anyhow::Result<Option<Db>> {
        match &self.only {
            Some(pool) => Ok(Some(pool.clone())),
            None => self.shards.holding(key).await,
        }
    }

    /// The database holding `key`, refused when no shard does.
    pub async fn pool_for(&self, key: &str) -> anyhow::Result<Db> {
        self.holding(key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no shard holds the event {key}"))
    }

    /// The database holding `key`, or the first, where it is then not found.
    async fn pool_or_first(&self, key: &str) -> Result<Db, OperatorError> {
        Ok(self
            .holding(key)
            .await?
            .unwrap_or_else(|| self.first().clone()))
    }

    /// A page of the events `search` selects, over every database listed.
    pub async fn search(&self, search: &Search) -> Result<Page, OperatorError> {
        search::search_over(&self.listed, search).await
    }

    /// Everything known about one event.
    pub async fn show(&self, key: &str) -> Result<EventDetail, OperatorError> {
        events::show(&self.pool_or_first(key).await?, key).await
    }

    /// One event's story: its moments in order.
    pub async fn story(&self, key: &str) -> Result<Story, OperatorError> {
        story::of_event(&self.pool_or_first(key).await?, key).await
    }

    /// The whole system on one screen.
    pub async fn status(&self) -> anyhow::Result<Status> {
        status::gather(&self.shards.pools(), self.kafka.clone()).await
    }

    /// Settles `key`'s operations (or its failed claim) by hand.
    pub async fn resolve(
        &self,
        key: &str,
        operation: Option<&str>,
        to: Resolution,
        act: &Act,
    ) -> Result<Vec<Change>, OperatorError> {
        let pool = self.pool_or_first(key).await?;
        events::resolve(&pool, key, operation, to, act).await
    }

    /// Sends `key`'s operations again, or runs its failed effect again.
    pub async fn retry(
        &self,
        key: &str,
        retry: &Retry,
        act: &Act,
    ) -> Result<Vec<Change>, OperatorError> {
        let pool = self.pool_or_first(key).await?;
        events::retry(&pool, &self.registry, key, retry, act).await
    }

    /// Every listed database's events a bulk retry of `filter` takes, each with the database
    /// it is retried in.
    pub async fn to_retry(
        &self,
        filter: &events::RetryFilter,
    ) -> Result<Vec<(Db, String)>, OperatorError> {
        let mut keys = Vec::new();
        for pool in &self.listed {
            let found = events::to_retry(pool, filter).await?;
            keys.extend(found.into_iter().map(|key| (pool.clone(), key)));
        }
        Ok(keys)
    }

    /// [`Desk::retry`] in the database `pool`, where a bulk retry found the event.
    pub async fn retry_in(
        &self,
        pool: &Db,
        key: &str,
        retry: &Retry,
        act: &Act,
    ) -> Result<Vec<Change>, OperatorError> {
        events::retry(pool, &self.registry, key, retry, act).await
    }

    /// Applies the expired replay of `key` once, with `given` effects or the recorded ones.
    pub async fn apply_expired(
        &self,
        key: &str,
        given: Option<std::sync::Arc<dyn crate::effect::Effect>>,
        act: &Act,
    ) -> Result<Vec<Change>, OperatorError> {
        let pool = self.pool_or_first(key).await?;
        expired::apply(&pool, &self.registry, key, given, act).await
    }

    /// Drops the expired replay of `key`: never applied.
    pub async fn drop_expired(&self, key: &str, act: &Act) -> Result<Vec<Change>, OperatorError> {
        expired::drop(&self.pool_or_first(key).await?, key, act).await
    }

    /// Expired replays over every database listed, newest first; with `all`, those settled too.
    pub async fn expired(
        &self,
        all: bool,
        limit: i64,
    ) -> Result<Vec<crate::retention::expired::ExpiredReplay>, OperatorError> {
        Ok(crate::retention::expired::list_over(&self.listed, all, limit).await?)
    }

    /// The dead letters `search` selects, newest first (all on the first database).
    pub async fn letters(
        &self,
        search: &crate::claims::dead_letters::LetterSearch,
    ) -> Result<Vec<crate::claims::dead_letters::DeadLetterRow>, OperatorError> {
        Ok(crate::claims::dead_letters::search(self.first(), search).await?)
    }

    /// One dead letter.
    pub async fn letter(
        &self,
        id: i64,
    ) -> Result<crate::claims::dead_letters::DeadLetterRow, OperatorError> {
        dead_letters::show(self.first(), id).await
    }

    /// A dead letter's raw key and value; None once erased.
    pub async fn raw_letter(
        &self,
        id: i64,
    ) -> Result<Option<crate::claims::dead_letters::RawLetter>, OperatorError> {
        Ok(crate::claims::dead_letters::take(self.first(), id).await?)
    }

    /// The dead letters never replayed that `search` selects, to be replayed.
    pub async fn letters_to_replay(
        &self,
        search: &crate::claims::dead_letters::LetterSearch,
    ) -> Result<Vec<i64>, OperatorError> {
        let letters = dead_letters::to_replay(self.first(), search).await?;
        Ok(letters.into_iter().map(|l| l.id).collect())
    }

    /// Produces the dead letters `ids` again, each audited; refused without brokers.
    pub async fn replay_letters(
        &self,
        ids: &[i64],
        act: &Act,
    ) -> Result<dead_letters::Replayed, OperatorError> {
        let producer = self
            .producer()
            .ok_or_else(|| anyhow::anyhow!("replaying dead letters needs brokers"))?;
        Ok(dead_letters::replay_many(self.first(), ids, act, producer).await)
    }

    /// Reads `window` of the topic again through the claim path; refused without brokers.
    pub async fn replay_window(
        &self,
        window: &replay::Window,
        act: &Act,
    ) -> Result<replay::ReplayReport, OperatorError> {
        let processor = self
            .processor()
            .ok_or_else(|| anyhow::anyhow!("a replay by time needs brokers"))?;
        replay::replay(self.first(), processor, window, act).await
    }

    /// Where the destinations' shared state is: the first database, over every database.
    fn limits_home(&self) -> crate::destinations::LimitsHome {
        crate::destinations::LimitsHome::over(&self.shards.pools(), 0)
    }

    /// Every known destination: its pause, breaker, requests in flight and backlog.
    pub async fn destinations(
        &self,
    ) -> Result<Vec<crate::destinations::DestinationRow>, OperatorError> {
        Ok(crate::destinations::pauses::list(&self.limits_home()).await?)
    }

    /// Pauses the destination of `url` (its origin) until resumed, or for `until`; audited.
    pub async fn pause_destination(
        &self,
        url: &str,
        until: Option<std::time::Duration>,
        act: &Act,
    ) -> Result<Change, OperatorError> {
        let origin = destination_origin(url)?;
        Ok(crate::destinations::pauses::pause(self.first(), &origin, until, act).await?)
    }

    /// Resumes the destination of `url`; refused when it is not paused.
    pub async fn resume_destination(&self, url: &str, act: &Act) -> Result<Change, OperatorError> {
        let origin = destination_origin(url)?;
        crate::destinations::pauses::resume(self.first(), &origin, act)
            .await?
            .ok_or(OperatorError::NotPaused(origin))
    }

    /// What the consumers of the desk's topic (of every topic, with no brokers) did each
    /// minute since `since`.
    pub async fn activity(
        &self,
        since: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<crate::activity::Minute>, OperatorError> {
        let topic = self.kafka.as_ref().map(|k| k.topic.as_str());
        Ok(crate::activity::since(self.first(), topic, since).await?)
    }

    /// The paused sources.
    pub async fn paused_sources(&self) -> Result<Vec<SourcePause>, OperatorError> {
        Ok(crate::sources::pauses::list(self.first()).await?)
    }

    /// Pauses `source`: the consumers hold its events until it is resumed; audited.
    pub async fn pause_source(&self, source: &str, act: &Act) -> Result<Change, OperatorError> {
        let source = source_name(source)?;
        Ok(crate::sources::pauses::pause(self.first(), source, act).await?)
    }

    /// Whether any database holds a claim of `source`: a pause of a name no event carries
    /// (a typo) holds nothing.
    pub async fn source_seen(&self, source: &str) -> Result<bool, OperatorError> {
        for pool in self.shards.pools() {
            if crate::claims::source_seen(&pool, source.trim()).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Resumes `source`; refused when it is not paused.
    pub async fn resume_source(&self, source: &str, act: &Act) -> Result<Change, OperatorError> {
        let source = source_name(source)?;
        crate::sources::pauses::resume(self.first(), source, act)
            .await?
            .ok_or_else(|| OperatorError::NotPaused(format!("source {source}")))
    }
}

/// A source's name as events carry it; refused when empty or holding a character that does
/// not show: a control, a space, or an invisible format character (a zero-width space, a
/// direction override), which would make a name that looks like another.
fn source_name(name: &str) -> Result<&str, OperatorError> {
    let name = name.trim();
    let unseen = |c: char| {
        c.is_control()
            || c.is_whitespace()
            || matches!(c, '\u{ad}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
                | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
    };
    match !name.is_empty() && !name.chars().any(unseen) {
        true => Ok(name),
        false => Err(OperatorError::NotASource(name.escape_debug().to_string())),
    }
}

/// The origin of `url` as the outbox keys its destinations; refused unless http or https.
fn destination_origin(url: &str) -> Result<String, OperatorError> {
    match reqwest::Url::parse(url.trim()) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host_str().is_some() => {
            Ok(crate::outbox::origin(url.trim()))
        }
        _ => Err(OperatorError::NotAnOrigin(crate::secrets::redact_url(url))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_name_that_would_look_like_another_is_refused() {
        assert_eq!(source_name(" stripe ").unwrap(), "stripe");
        assert_eq!(source_name("shop-1_eu").unwrap(), "shop-1_eu");
        for unseen in [
            "",
            " ",
            "a\tb",
            "acme\u{200b}",
            "acme\u{202e}live",
            "a b",
            "\u{feff}acme",
        ] {
            assert!(source_name(unseen).is_err(), "{unseen:?}");
        }
    }

    #[test]
    fn a_refused_origin_shows_no_credential() {
        for given in ["u:pw@host", "ftp://u:pw@h/"] {
            let err = destination_origin(given).unwrap_err().to_string();
            assert!(!err.contains("pw"), "{err}");
        }
    }
}
