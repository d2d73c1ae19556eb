//! The part of `replayproof config check` that reaches out, unless `--no-connect`: each
//! database the commands would use answers and has every migration applied, each broker
//! answers (TLS and SASL included, as the commands would connect) and has the topic with its
//! partitions, the consumer's HTTP target resolves, and the dispatcher's TLS settings load.
//! Every check runs, whatever the others found, and each problem names the commands it stops.

use crate::cli::{Args, Command};
use crate::config::{ConfigFile, Env};
use crate::secrets::redact_url;
use rdkafka::client::ClientContext;
use rdkafka::producer::{BaseProducer, Producer as _, ProducerContext};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

/// How long each connection may take before it counts as not answering.
const TIMEOUT: Duration = Duration::from_secs(10);

/// What one check found: a sentence, and whether it is a problem.
struct Finding {
    said: String,
    problem: bool,
}

impl Finding {
    fn fine(said: String) -> Self {
        Self {
            said,
            problem: false,
        }
    }

    fn problem(said: String) -> Self {
        Self {
            said,
            problem: true,
        }
    }
}

/// Brokers, a topic and the librdkafka options to reach them with.
type BrokerTarget = (String, String, Vec<(String, String)>);

/// What the commands that parsed would connect to, each with the commands that need it.
#[derive(Default)]
struct Targets {
    /// By database URL: the pool settings of the first command naming it, and the commands.
    databases: BTreeMap<String, (crate::args::DatabaseArgs, Vec<&'static str>)>,
    /// By (brokers, topic, options): the commands.
    brokers: BTreeMap<BrokerTarget, Vec<&'static str>>,
    /// The consumer's HTTP target and reconcile URLs.
    urls: Vec<(&'static str, String)>,
    /// The dispatcher's outbound settings, to build its HTTP client.
    dispatch: Option<crate::dispatch::DispatchSettings>,
}

/// Connects to everything the commands that parse from `file` and `env` would use, and appends
/// what it found to `text`; returns how many problems it found.
pub async fn connect(file: Option<&ConfigFile>, env: &dyn Env, text: &mut String) -> usize {
    let targets = targets(file, env);
    let mut findings = Vec::new();
    for (url, (database, commands)) in &targets.databases {
        let said = database_answers(database).await;
        findings.push(named("database", &redact_url(url), commands, said));
    }
    for ((brokers, topic, options), commands) in &targets.brokers {
        let (brokers, topic, options) = (brokers.clone(), topic.clone(), options.clone());
        let what = format!("{brokers} topic {topic}");
        let said = tokio::task::spawn_blocking(move || broker_answers(&brokers, &topic, &options))
            .await
            .unwrap_or_else(|e| Err(format!("the check panicked: {e}")));
        findings.push(named("kafka", &what, commands, said));
    }
    for (key, url) in &targets.urls {
        let said = resolves(url).await;
        findings.push(named(key, &redact_url(url), &["consume"], said));
    }
    if let Some(settings) = &targets.dispatch {
        let said = settings
            .outbound
            .client(settings.request_timeout)
            .map(|_| "the HTTP client's TLS settings load".to_owned())
            .map_err(|e| format!("{e:#}"));
        findings.push(named("outbound", "HTTP client", &["dispatch"], said));
    }
    let _ = writeln!(
        text,
        "\n# Connections, as the commands would make them (--no-connect skips them):"
    );
    if findings.is_empty() {
        let _ = writeln!(text, "nothing to connect to: no command parsed");
    }
    for f in &findings {
        let _ = writeln!(text, "{}", f.said);
    }
    findings.iter().filter(|f| f.problem).count()
}

/// A finding's line: what was checked, for which commands, and what came of it.
fn named(
    kind: &str,
    what: &str,
    commands: &[&'static str],
    said: Result<String, String>,
) -> Finding {
    let commands = commands.join(", ");
    match said {
        Ok(said) => Finding::fine(format!("{kind} {what} ({commands}): {said}")),
        Err(said) => Finding::problem(format!("{kind} {what} ({commands}): problem: {said}")),
    }
}

/// What each command that parses would connect to.
fn targets(file: Option<&ConfigFile>, env: &dyn Env) -> Targets {
    let mut targets = Targets::default();
    for command in ["migrate", "consume", "dispatch", "ingest", "status"] {
        let Some(args) = parsed(command, file, env) else {
            continue;
        };
        match args.command {
            Command::Migrate(migrate) => targets.database(migrate.database, "migrate"),
            Command::Consume(consume) => {
                let options = consume.kafka.options.kafka_options.clone();
                targets.broker(&consume.kafka.brokers, &consume.topic, options, "consume");
                for (key, url) in [
                    ("target_url", &consume.http.target_url),
                    ("reconcile_url", &consume.http.reconcile_url),
                ] {
                    if let Some(url) = url {
                        targets.urls.push((key, url.clone()));
                    }
                }
                targets.database(consume.database, "consume");
            }
            Command::Dispatch(dispatch) => {
                targets.dispatch = dispatch.settings(file).ok();
                targets.database(dispatch.database, "dispatch");
            }
            Command::Ingest(ingest) => {
                if let Ok(settings) = ingest.settings() {
                    let options = settings.kafka_options.clone();
                    targets.broker(&settings.brokers, &settings.topic, options, "ingest");
                }
            }
            Command::Status(status) => targets.database(status.database, "status"),
            _ => {}
        }
    }
    targets
}

impl Targets {
    /// Each database of the command once: every shard is checked on its own.
    fn database(&mut self, database: crate::args::DatabaseArgs, command: &'static str) {
        for url in &database.database_url {
            let one = crate::args::DatabaseArgs {
                database_url: vec![url.clone()],
                ..database.clone()
            };
            let entry = self
                .databases
                .entry(url.expose().to_owned())
                .or_insert_with(|| (one, Vec::new()));
            entry.1.push(command);
        }
    }

    fn broker(
        &mut self,
        brokers: &str,
        topic: &str,
        options: Vec<(String, String)>,
        command: &'static str,
    ) {
        let key = (brokers.to_owned(), topic.to_owned(), options);
        self.brokers.entry(key).or_default().push(command);
    }
}

/// `command` as it would start from the file and the environment alone; None when it would
/// not (the static check already said why).
fn parsed(command: &str, file: Option<&ConfigFile>, env: &dyn Env) -> Option<Args> {
    let mut argv: Vec<OsString> = vec!["replayproof".into()];
    if let Some(file) = file {
        argv.extend(["--config".into(), file.path.clone().into_os_string()]);
    }
    argv.push(command.into());
    crate::cli::parse(argv, env).ok()
}

/// Whether the database answers, and whether every migration is applied there.
async fn database_answers(database: &crate::args::DatabaseArgs) -> Result<String, String> {
    use sqlx::{ConnectOptions as _, Connection as _};
    // One connection with the commands' own options (TLS, schema, limits), made directly so
    // that a refusal says why rather than that a pool timed out.
    let pool = database.pool(1).map_err(|e| format!("{e:#}"))?;
    let options = pool.connect_options();
    let session = database.session.session();
    let asked = async {
        let mut connection = options.connect().await?;
        let answered = versions(&mut connection, &session).await;
        let _ = connection.close().await;
        answered
    };
    let (version, applied) = match tokio::time::timeout(TIMEOUT, asked).await {
        Err(_) => return Err(format!("no answer in {} s", TIMEOUT.as_secs())),
        Ok(Err(e)) => return Err(format!("it does not answer: {e}")),
        Ok(Ok(answered)) => answered,
    };
    let schema = &database.session.schema;
    let expected: Vec<i64> = crate::db::MIGRATOR.iter().map(|m| m.version).collect();
    let pending = expected.iter().filter(|v| !applied.contains(v)).count();
    match pending {
        0 => Ok(format!(
            "PostgreSQL {version} answers; all {} migrations are applied in schema {schema}",
            expected.len()
        )),
        n => Err(format!(
            "PostgreSQL {version} answers, but {n} of {} migrations are not applied in schema \
             {schema}: run `replayproof migrate`",
            expected.len()
        )),
    }
}

/// The server's version and the migrations applied, in a transaction as the commands begin
/// theirs (behind a pooler, with the schema and limits set in it); no migrations table means
/// none applied.
async fn versions(
    connection: &mut sqlx::PgConnection,
    session: &crate::db::Session,
) -> Result<(String, Vec<i64>), sqlx::Error> {
    let mut tx = session.begin_on(connection).await?;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut *tx)
        .await?;
    let migrated: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *tx)
        .await?;
    let applied = match migrated {
        true => {
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&mut *tx)
                .await?
        }
        false => Vec::new(),
    };
    tx.commit().await?;
    Ok((version, applied))
}

/// Records what librdkafka reports while the check's client connects: a TLS handshake or a
/// SASL login that fails says so here, not in the metadata request's error.
#[derive(Default)]
struct Heard(Mutex<Vec<String>>);

impl ClientContext for Heard {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        let mut heard = self.0.lock().expect("heard lock");
        if heard.len() < 3 {
            heard.push(format!("{error}: {reason}"));
        }
    }

    fn log(&self, _level: rdkafka::config::RDKafkaLogLevel, _fac: &str, _log_message: &str) {}
}

impl ProducerContext for Heard {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}

/// Whether the brokers answer and have `topic`, with its partitions.
fn broker_answers(
    brokers: &str,
    topic: &str,
    options: &[(String, String)],
) -> Result<String, String> {
    // Asking for a topic's metadata must not create it.
    let tuning = [("allow.auto.create.topics", "false".to_owned())];
    let config =
        crate::kafka::client_config(crate::kafka::Role::Reader, brokers, None, &tuning, options)
            .map_err(|e| format!("{e:#}"))?;
    // A producer's poll serves the error callbacks that say why a connection failed.
    let client: BaseProducer<Heard> = config
        .create_with_context(Heard::default())
        .map_err(|e| format!("creating a client: {e}"))?;
    let metadata = client.client().fetch_metadata(Some(topic), TIMEOUT);
    if metadata.is_err() {
        client.poll(Duration::from_millis(200));
    }
    let heard = client.context().0.lock().expect("heard lock").join("; ");
    let metadata = metadata.map_err(|e| match heard.is_empty() {
        true => format!("no answer: {e}"),
        false => format!("no answer: {e} ({heard})"),
    })?;
    let found = metadata.topics().iter().find(|t| t.name() == topic);
    match found {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(format!(
            "the brokers answer; the topic has {} partitions",
            t.partitions().len()
        )),
        Some(t) => Err(format!(
            "the brokers answer, but the topic is not there ({:?}): create it",
            t.error()
        )),
        None => Err("the brokers answer, but the topic is not there: create it".into()),
    }
}

/// Whether the host of `url` resolves.
async fn resolves(url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    let host = parsed.host_str().ok_or("the URL has no host")?;
    let port = parsed.port_or_known_default().unwrap_or(443);
    let looked_up = tokio::time::timeout(TIMEOUT, tokio::net::lookup_host((host, port))).await;
    match looked_up {
        Ok(Ok(mut addrs)) => match addrs.next() {
            Some(addr) => Ok(format!("{host} resolves to {addr}")),
            None => Err(format!("{host} resolves to no address")),
        },
        Ok(Err(e)) => Err(format!("{host} does not resolve: {e}")),
        Err(_) => Err(format!("{host} did not resolve in {} s", TIMEOUT.as_secs())),
    }
}
