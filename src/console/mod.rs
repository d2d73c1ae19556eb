//! `replayproof console`: the operator's pages in a browser. Every event's story, the overview
//! behind the alerts, and the operator's actions (retry, resolve, replay), behind a login.
//!
//! Pages are rendered on the server ([`maud`]); the browser needs no script. Every list pages by
//! keyset on an index, so a deep page of ten million claims costs what the first does. Every
//! action goes through the same functions as the command line ([`crate::operator`]) and writes
//! the same audit row, with the logged-in user as its actor.
//!
//! Security: no page and no data without a session (a redirect to `/login` otherwise); a
//! `viewer` reads and only an `operator` acts; sessions are signed cookies (`HttpOnly`,
//! `SameSite=Strict`, `Secure` behind TLS); each action carries a CSRF token bound to its
//! session; logins are rate-limited per address and per user name; passwords are argon2id.

mod actions;
pub mod args;
mod auth;
mod bulk;
mod charts;
mod dead_letters;
mod events_page;
mod expired;
mod form;
mod layout;
mod limiter;
mod overview;
mod pauses;
mod problem;
mod replay;
mod sessions;
mod story;
mod visibility;

pub use argon2::Params as HashParams;
pub use auth::{hash_password, hash_password_with, random_hex, Role, UserConfig};

use crate::effect::Registry;
use crate::operator::status::KafkaTarget;
use anyhow::Context as _;
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Where the console listens unless told otherwise: this machine only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9480";
/// The shortest session key: 32 bytes.
pub const MIN_SESSION_KEY_BYTES: usize = 32;
/// How long a login lasts.
pub const SESSION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(12 * 3600);
/// Rows on a page of a list.
pub const PAGE_ROWS: i64 = 50;
/// The most rows a bulk action previews and takes.
pub const BULK_LIMIT: i64 = 500;

/// The configuration file's `[console]` section, but for `listen` and `metrics_addr`, which are
/// `console`'s flags.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleFile {
    /// Signs the session cookies: at least 32 bytes, normally `"${CONSOLE_SESSION_KEY}"`.
    #[serde(default)]
    pub session_key: Option<String>,
    /// Whether a viewer sees payloads and raw bytes (operators always do).
    #[serde(default)]
    pub show_payloads_to_viewers: bool,
    #[serde(default)]
    pub users: Vec<UserConfig>,
    /// A header naming the user, set by an SSO proxy in front (`X-Forwarded-User`), believed
    /// only from `trusted_proxies`.
    #[serde(default)]
    pub auth_header: Option<String>,
    /// The addresses of the proxies whose `auth_header` is believed.
    #[serde(default)]
    pub trusted_proxies: Vec<IpAddr>,
    /// Read by the `--listen` flag.
    #[serde(default)]
    pub listen: Option<toml::Value>,
    /// Read by the `--metrics-addr` flag.
    #[serde(default)]
    pub metrics_addr: Option<toml::Value>,
}

/// The keys of `[console]`, besides `listen` and `metrics_addr`.
pub const FILE_KEYS: &[&str] = &[
    "session_key",
    "show_payloads_to_viewers",
    "users",
    "auth_header",
    "trusted_proxies",
];

impl ConsoleFile {
    /// The `[console]` section of the configuration file.
    pub fn from_config(file: &crate::config::ConfigFile) -> anyhow::Result<Self> {
        let section = file.section("console");
        let parsed: Self = toml::Value::Table(section)
            .try_into()
            .with_context(|| format!("{} [console]", file.path.display()))?;
        Ok(parsed)
    }
}

/// Everything the console runs with.
#[derive(Clone)]
pub struct ConsoleSettings {
    pub listen: SocketAddr,
    /// At least [`MIN_SESSION_KEY_BYTES`].
    pub session_key: Vec<u8>,
    pub users: Vec<UserConfig>,
    pub show_payloads_to_viewers: bool,
    pub auth_header: Option<String>,
    pub trusted_proxies: Vec<IpAddr>,
    /// The topic and group whose lag the overview shows, and where dead letters are replayed
    /// and the topic read again; None: no lag, no replay.
    pub kafka: Option<KafkaTarget>,
    /// Login attempts allowed per minute, per address and per user name.
    pub logins_per_minute: u32,
    /// The effects a replay by time applies, as `consume --effect` names them.
    pub effects: Vec<String>,
    /// The `http` effect's target, for a replay by time.
    pub http: Option<crate::effect::HttpOutbox>,
    /// The `kafka` effect's output topic, for a replay by time.
    pub kafka_output: Option<crate::effect::KafkaOutput>,
    /// How a replay by time retries a failing effect, as `consume --effect-attempts`.
    pub effect_retry: crate::consume::EffectRetry,
    /// How an event deferred in a replay by time waits, as `consume`'s `--defer-*`.
    pub defer: crate::consume::DeferSettings,
    /// How a replay by time reads the topic, as `consume --input`.
    pub input: crate::inputs::Input,
}

impl ConsoleSettings {
    /// Settings from the `[console]` section, with the session key checked and every user's
    /// hash parsed.
    pub fn new(listen: SocketAddr, file: ConsoleFile) -> anyhow::Result<Self> {
        let key = file.session_key.context(
            "the console needs [console] session_key: at least 32 random bytes, normally \
             \"${CONSOLE_SESSION_KEY}\" (openssl rand -base64 48)",
        )?;
        crate::secrets::register(&key);
        anyhow::ensure!(
            key.len() >= MIN_SESSION_KEY_BYTES,
            "[console] session_key has {} bytes; it needs at least {MIN_SESSION_KEY_BYTES}",
            key.len()
        );
        let mut names = std::collections::HashSet::new();
        for user in &file.users {
            user.check()?;
            anyhow::ensure!(
                names.insert(user.name.clone()),
                "[[console.users]] names {:?} twice",
                user.name
            );
        }
        anyhow::ensure!(
            !file.users.is_empty(),
            "the console has no users: add [[console.users]] entries (replayproof console \
             hash-password makes their password_hash)"
        );
        if let Some(header) = &file.auth_header {
            http::HeaderName::try_from(header.as_str())
                .with_context(|| format!("[console] auth_header {header:?} is no header name"))?;
            anyhow::ensure!(
                !file.trusted_proxies.is_empty(),
                "[console] auth_header needs trusted_proxies: the addresses of the proxies that set it"
            );
        }
        Ok(Self {
            listen,
            session_key: key.into_bytes(),
            users: file.users,
            show_payloads_to_viewers: file.show_payloads_to_viewers,
            auth_header: file.auth_header,
            trusted_proxies: file.trusted_proxies,
            kafka: None,
            logins_per_minute: 10,
            effects: vec![crate::consume::args::DEFAULT_EFFECT.to_owned()],
            http: None,
            kafka_output: None,
            effect_retry: crate::consume::EffectRetry::default(),
            defer: crate::consume::DeferSettings::default(),
            input: crate::inputs::Input::default(),
        })
    }
}

/// The console's shared state: cheap to clone into every request.
#[derive(Clone)]
pub(crate) struct State(Arc<Inner>);

pub(crate) struct Inner {
    /// The operator's world: every database, the effects, the producer, the replay.
    desk: crate::operator::Desk,
    settings: ConsoleSettings,
    auth: auth::Auth,
    throughput: std::sync::Mutex<Option<overview::Sample>>,
}

impl std::ops::Deref for State {
    type Target = Inner;

    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl axum::extract::FromRef<State> for axum_extra::extract::cookie::Key {
    fn from_ref(state: &State) -> Self {
        state.auth.cookie_key.clone()
    }
}

/// The console's routes, over `shards` (a `Db` for one database), acting with
/// `registry`'s effects.
pub fn router(
    settings: ConsoleSettings,
    shards: impl Into<crate::shard::Shards>,
    registry: Registry,
) -> anyhow::Result<Router> {
    let desk = crate::operator::Desk::build(crate::operator::DeskSettings {
        shards: shards.into(),
        only: None,
        registry,
        kafka: settings.kafka.clone(),
        letters_to: None,
        replay: Some(crate::operator::ReplayEffects {
            effects: settings.effects.clone(),
            http: settings.http.clone(),
            kafka: settings.kafka_output.clone(),
            retry: settings.effect_retry,
            defer: settings.defer.clone(),
            input: settings.input.clone(),
        }),
    })?;
    let state = State(Arc::new(Inner {
        auth: auth::Auth::new(&settings)?,
        desk,
        settings,
        throughput: std::sync::Mutex::new(None),
    }));
    Ok(Router::new()
        .route("/login", get(auth::login_page).post(auth::login))
        .route("/logout", post(auth::logout))
        .route("/static/console.css", get(layout::stylesheet))
        .route("/", get(overview::overview))
        .route("/events", get(events_page::events))
        .route(
            "/events/retry",
            get(actions::bulk_retry_preview).post(actions::bulk_retry),
        )
        .route("/events/{key}", get(story::story))
        .route("/events/{key}/retry", post(actions::retry))
        .route("/events/{key}/resolve", post(actions::resolve))
        .route("/dead-letters", get(dead_letters::dead_letters))
        .route(
            "/dead-letters/replay",
            get(actions::bulk_replay_preview).post(actions::bulk_replay),
        )
        .route("/dead-letters/{id}", get(dead_letters::dead_letter))
        .route("/dead-letters/{id}/replay", post(actions::replay_letter))
        .route("/expired", get(expired::expired))
        .route("/destinations/pause", post(pauses::pause_destination))
        .route("/destinations/resume", post(pauses::resume_destination))
        .route("/sources/pause", post(pauses::pause_source))
        .route("/sources/resume", post(pauses::resume_source))
        .route(
            "/replay",
            get(replay::replay_form).post(replay::replay_topic),
        )
        .fallback(problem::not_found)
        .layer(axum::middleware::from_fn(layout::headers))
        .with_state(state))
}

/// A console bound to its address, not yet serving.
pub struct Console {
    listener: tokio::net::TcpListener,
    router: Router,
}

impl Console {
    /// Binds `settings.listen` and builds the routes.
    pub async fn bind(
        settings: ConsoleSettings,
        shards: impl Into<crate::shard::Shards>,
        registry: Registry,
    ) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("binding the console to {}", settings.listen))?;
        let router = router(settings, shards, registry)?;
        Ok(Self { listener, router })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `stop` is cancelled, then finishes the requests in flight.
    pub fn run_until_stopped(self, stop: CancellationToken) -> crate::shutdown::Running {
        crate::shutdown::Running::spawn(async move {
            let app = self
                .router
                .into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(self.listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await
                .context("serving the console")
        })
    }
}

/// Runs the console with `settings` until `stop` (a signal) is cancelled.
pub async fn run(
    settings: ConsoleSettings,
    shards: impl Into<crate::shard::Shards>,
    registry: Registry,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let console = Console::bind(settings, shards, registry).await?;
    tracing::info!(addr = %console.addr(), "The console is listening.");
    console.run_until_stopped(stop).stopped().await
}
