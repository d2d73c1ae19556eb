//! One configuration for every command: a TOML file of sections, environment variables, and
//! flags, in that order of strength.
//!
//! ```toml
//! [kafka]                     # brokers, topic, group, and any librdkafka property
//! brokers = "broker-1:9093"
//! "security.protocol" = "SASL_SSL"
//! "sasl.password" = "${KAFKA_PASSWORD}"
//!
//! [database]                  # url, schema and the session time limits
//! url = "postgres://replayproof:${PGPASSWORD}@db:5432/replayproof?sslmode=verify-full"
//!
//! [consume]                   # consume's flags by name: batch_size = 500, effect = ["ledger"]
//! [dispatch]                  # dispatch's flags: headers = { Authorization = "Bearer ${TOKEN}" }
//! [ingest]                    # ingest's flags, and its [[ingest.sources]]
//! [retention]                 # prune's lifetimes: default_retention = "35d", payload_retention
//! ```
//!
//! A setting is taken from the first of: the command's flag, its environment variable, the
//! file, the default. `${NAME}` anywhere in a string of the file is replaced by the environment
//! variable NAME, so secrets stay out of the file; an unset one is an error naming it.
//! `REPLAYPROOF_KAFKA_<PROPERTY>` sets a librdkafka property (`REPLAYPROOF_KAFKA_SASL_PASSWORD`
//! is `sasl.password`), over the file and under `--kafka-option`.
//!
//! Each of the file's values becomes the default of the flag it sets, once that flag's own
//! parser has accepted it (see [`layered`]): every command is read in one parse, the
//! precedence is the same for all, and `config check` prints what that parse gives.

use anyhow::{bail, Context as _};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The environment variable naming the file, as `--config` does.
pub const CONFIG_ENV: &str = "REPLAYPROOF_CONFIG";
/// The prefix of the environment variables that set librdkafka properties.
pub const KAFKA_ENV_PREFIX: &str = "REPLAYPROOF_KAFKA_";

/// The file's sections.
pub const SECTIONS: &[&str] = &[
    "kafka",
    "database",
    "consume",
    "dispatch",
    "ingest",
    "retention",
    "console",
];

/// The environment the file's `${NAME}` and `REPLAYPROOF_KAFKA_*` are read from.
pub trait Env {
    fn var(&self, name: &str) -> Option<String>;
    /// Every variable, for the `REPLAYPROOF_KAFKA_*` scan.
    fn vars(&self) -> Vec<(String, String)>;
}

/// The process's environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }

    fn vars(&self) -> Vec<(String, String)> {
        std::env::vars().collect()
    }
}

impl Env for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }

    fn vars(&self) -> Vec<(String, String)> {
        self.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

/// The configuration file, read and with `${NAME}` replaced.
#[derive(Debug, Clone, Default)]
pub struct ConfigFile {
    pub path: PathBuf,
    /// Each section's settings; `[kafka]`'s nested tables are flattened to dotted properties.
    sections: BTreeMap<String, toml::Table>,
}

impl ConfigFile {
    /// Reads `path`, replaces each `${NAME}` from `env`, and checks the sections' names.
    pub fn load(path: &Path, env: &dyn Env) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(path, &text, env)
    }

    /// [`ConfigFile::load`] from text already read.
    pub fn parse(path: &Path, text: &str, env: &dyn Env) -> anyhow::Result<Self> {
        let table: toml::Table =
            toml::from_str(text).with_context(|| format!("parsing {}", path.display()))?;
        let mut sections: BTreeMap<String, toml::Table> = BTreeMap::new();
        for (name, value) in table {
            let value =
                expand(value, env).with_context(|| format!("{} [{name}]", path.display()))?;
            match legacy_section(&name) {
                // Before sections, the file held ingest's settings at its top level.
                Some(section) => {
                    let table = sections.entry(section.into()).or_default();
                    anyhow::ensure!(
                        table.insert(name.clone(), value).is_none(),
                        "{}: `{name}` is given twice, at the top and in [{section}]",
                        path.display()
                    );
                }
                None => merge_section(&mut sections, path, name, value)?,
            }
        }
        if let Some(database) = sections.get_mut("database") {
            database_shards(database, path)?;
        }
        Ok(Self {
            path: path.to_owned(),
            sections,
        })
    }

    /// One section's settings; empty when the file has none.
    pub fn section(&self, name: &str) -> toml::Table {
        self.sections.get(name).cloned().unwrap_or_default()
    }

    /// The librdkafka properties of `[kafka]`, as text.
    pub fn kafka_properties(&self) -> Vec<(String, String)> {
        self.section("kafka")
            .into_iter()
            .filter(|(k, _)| !KAFKA_FLAGS.contains(&k.as_str()))
            .filter_map(|(k, v)| Some((k, scalar(&v)?)))
            .collect()
    }
}

/// Adds the section `name` of the file at `path` to `sections`, refusing what is not a known
/// section and a key also given at the top level.
fn merge_section(
    sections: &mut BTreeMap<String, toml::Table>,
    path: &Path,
    name: String,
    value: toml::Value,
) -> anyhow::Result<()> {
    let toml::Value::Table(table) = value else {
        bail!(
            "{}: `{name}` is not a section; the sections are {}",
            path.display(),
            SECTIONS.join(", ")
        );
    };
    anyhow::ensure!(
        SECTIONS.contains(&name.as_str()),
        "{}: unknown section [{name}]; the sections are {}",
        path.display(),
        SECTIONS.join(", ")
    );
    let table = if name == "kafka" {
        flatten(table)
    } else {
        table
    };
    let merged = sections.entry(name.clone()).or_default();
    for (key, value) in table {
        anyhow::ensure!(
            merged.insert(key.clone(), value).is_none(),
            "{}: `{key}` is given twice, at the top and in [{name}]",
            path.display()
        );
    }
    Ok(())
}

/// `[database] shards = [...]` is the list `--database-url` repeats; `url` its one-shard form.
fn database_shards(database: &mut toml::Table, path: &Path) -> anyhow::Result<()> {
    if let Some(shards) = database.remove("shards") {
        anyhow::ensure!(
            !database.contains_key("url"),
            "{}: [database] gives both url and shards; shards lists every database, the first \
             included",
            path.display()
        );
        database.insert("url".into(), shards);
    }
    Ok(())
}

/// The section a pre-sections top-level key of ingest's file belongs to.
fn legacy_section(key: &str) -> Option<&'static str> {
    match key {
        "brokers" | "topic" => Some("kafka"),
        "listen" | "max_body_bytes" | "produce_timeout" | "produce_timeout_ms" | "sources" => {
            Some("ingest")
        }
        _ => None,
    }
}

/// `security = { protocol = "ssl" }` (how TOML reads `security.protocol = "ssl"`) becomes
/// `"security.protocol" = "ssl"`.
fn flatten(table: toml::Table) -> toml::Table {
    let mut flat = toml::Table::new();
    for (key, value) in table {
        match value {
            toml::Value::Table(inner) => {
                for (k, v) in flatten(inner) {
                    flat.insert(format!("{key}.{k}"), v);
                }
            }
            other => {
                flat.insert(key, other);
            }
        }
    }
    flat
}

/// Replaces `${NAME}` in every string of `value` with the variable NAME; `$${` is a literal `${`.
fn expand(value: toml::Value, env: &dyn Env) -> anyhow::Result<toml::Value> {
    Ok(match value {
        toml::Value::String(s) => toml::Value::String(expand_str(&s, env)?),
        toml::Value::Array(items) => toml::Value::Array(
            items
                .into_iter()
                .map(|v| expand(v, env))
                .collect::<anyhow::Result<_>>()?,
        ),
        toml::Value::Table(table) => toml::Value::Table(
            table
                .into_iter()
                .map(|(k, v)| Ok((k, expand(v, env)?)))
                .collect::<anyhow::Result<_>>()?,
        ),
        other => other,
    })
}

/// `${VAR}` expansion (`$${` for a literal `${`) of one string.
pub fn expand_str(s: &str, env: &dyn Env) -> anyhow::Result<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(literal) = after.strip_prefix("${") {
            out.push_str("${");
            rest = literal;
        } else if let Some(open) = after.strip_prefix('{') {
            let end = open
                .find('}')
                .with_context(|| format!("`${{` without a closing `}}` in {s:?}"))?;
            let name = &open[..end];
            anyhow::ensure!(
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "`${{{name}}}` is not an environment variable's name"
            );
            let value = env
                .var(name)
                .with_context(|| format!("environment variable {name} is not set"))?;
            out.push_str(&value);
            rest = &open[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// A TOML value as one flag value, when it is a scalar.
pub(crate) fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(d) => Some(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

/// A librdkafka property set by a `REPLAYPROOF_KAFKA_*` variable.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct EnvProperty {
    /// The property's name, `sasl.username` for `REPLAYPROOF_KAFKA_SASL_USERNAME`.
    pub key: String,
    pub value: String,
    /// The variable it came from.
    pub variable: String,
}

/// The librdkafka properties set by `REPLAYPROOF_KAFKA_*` variables, sorted by name.
pub fn kafka_env_properties(env: &dyn Env) -> Vec<EnvProperty> {
    let mut props: Vec<_> = env
        .vars()
        .into_iter()
        .filter_map(|(variable, value)| {
            let property = variable.strip_prefix(KAFKA_ENV_PREFIX)?;
            let key = property.to_ascii_lowercase().replace('_', ".");
            (!property.is_empty()).then_some(EnvProperty {
                key,
                value,
                variable,
            })
        })
        .collect();
    props.sort();
    props
}

pub use crate::secrets::{is_secret_property, redact_url, redacted};

mod keys;
mod layer;
#[cfg(test)]
pub(crate) use keys::check_keys;
pub(crate) use keys::{file_flags, KAFKA_FLAGS};
pub use keys::{FileKey, FileKeys};
pub(crate) use layer::layered_over;
pub use layer::{config_path, layered, LayerError, Layered, Source};

/// Flags whose values may carry a secret: a refused value of one is never echoed.
const SECRET_FLAGS: &[&str] = &[
    "--database-url",
    "--header",
    "--signing-secret",
    "--kafka-option",
    "--target-url",
    "--reconcile-url",
];

/// A clap error as it may be printed. clap quotes the value it refused, and a value given to a
/// flag that carries secrets (a database URL with a password, a header with a token) must not
/// be printed: it is replaced, and every registered secret is scrubbed from the rest.
pub fn render_clap_error(error: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let mut text = error.render().to_string();
    let arg = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => arg.as_str(),
        _ => "",
    };
    let secret_flag = SECRET_FLAGS.iter().any(|f| arg.starts_with(f))
        || is_secret_property(arg)
        || arg.contains("key");
    if let Some(ContextValue::String(value)) = error.get(ContextKind::InvalidValue) {
        if secret_flag && !value.is_empty() {
            text = text.replace(value.as_str(), crate::secrets::REDACTED);
        }
    }
    crate::secrets::scrub(&text).into_owned()
}

#[cfg(test)]
#[allow(clippy::too_many_lines)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn variables_are_replaced_and_a_missing_one_is_named() {
        let e = env(&[("A", "x"), ("B_2", "y")]);
        assert_eq!(expand_str("${A}-${B_2}", &e).unwrap(), "x-y");
        assert_eq!(expand_str("$${A} costs $5", &e).unwrap(), "${A} costs $5");
        let err = expand_str("Bearer ${TOKEN}", &e).unwrap_err();
        assert!(err.to_string().contains("TOKEN is not set"), "{err}");
        assert!(expand_str("${A", &e).is_err());
        assert!(expand_str("${A-B}", &e).is_err());
    }

    #[test]
    fn kafka_properties_come_from_dotted_or_quoted_keys_and_the_environment() {
        let text = r#"
            [kafka]
            brokers = "b:9093"
            security.protocol = "SASL_SSL"
            "sasl.mechanism" = "SCRAM-SHA-512"
            "sasl.password" = "${PW}"
        "#;
        let e = env(&[("PW", "s3cret"), ("REPLAYPROOF_KAFKA_SASL_USERNAME", "app")]);
        let file = ConfigFile::parse(Path::new("x.toml"), text, &e).unwrap();
        let props = file.kafka_properties();
        assert!(props.contains(&("security.protocol".into(), "SASL_SSL".into())));
        assert!(props.contains(&("sasl.password".into(), "s3cret".into())));
        assert!(!props.iter().any(|(k, _)| k == "brokers"));
        assert_eq!(
            kafka_env_properties(&e),
            vec![EnvProperty {
                key: "sasl.username".into(),
                value: "app".into(),
                variable: "REPLAYPROOF_KAFKA_SASL_USERNAME".into()
            }]
        );
    }

    #[test]
    fn the_old_top_level_ingest_keys_still_read() {
        let text = "brokers = \"b:1\"\nlisten = \"0.0.0.0:1\"\n[[sources]]\nname = \"s\"\n";
        let file = ConfigFile::parse(Path::new("x.toml"), text, &env(&[])).unwrap();
        assert_eq!(file.section("kafka")["brokers"].as_str(), Some("b:1"));
        assert!(file.section("ingest").contains_key("sources"));
        let twice = "brokers = \"b:1\"\n[kafka]\nbrokers = \"b:2\"\n";
        assert!(ConfigFile::parse(Path::new("x.toml"), twice, &env(&[])).is_err());
        let unknown = "[consumer]\nbatch_size = 1\n";
        let err = ConfigFile::parse(Path::new("x.toml"), unknown, &env(&[])).unwrap_err();
        assert!(
            err.to_string().contains("unknown section [consumer]"),
            "{err}"
        );
    }

    /// The arguments of `argv` and `--config` with the file `text`.
    pub(crate) fn with_file(argv: &[&str], text: &str) -> (tempfile::TempDir, Vec<OsString>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        let mut full: Vec<OsString> = vec!["replayproof".into()];
        full.extend(argv.iter().map(OsString::from));
        full.extend(["--config".into(), path.into_os_string()]);
        (dir, full)
    }

    /// The value a command would run with for the flag `id`, from `argv`, the file `text` and
    /// the process environment.
    fn resolved(argv: &[&str], text: &str, id: &str) -> String {
        use clap::CommandFactory as _;
        let (_dir, full) = with_file(argv, text);
        let layered = layered(
            crate::cli::Args::command(),
            &crate::cli::file_keys(),
            full,
            &ProcessEnv,
        )
        .unwrap();
        let raw = layered.leaf().get_raw(id).expect("the flag has a value");
        raw.map(|v| v.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Flag, then environment, then file, then default: for a setting of every command.
    #[test]
    fn precedence_is_flag_then_environment_then_file_then_default_for_every_command() {
        static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _env = ENV.lock().unwrap();
        let db = "--database-url=postgres://u@h/d";
        // (command, needed args, flag id, flag, variable, file section and key, default, values)
        type Case<'a> = (&'a [&'a str], &'a str, &'a str, &'a str, &'a str, &'a str);
        let cases: &[Case] = &[
            (
                &["consume", "--brokers=b", db],
                "batch_size",
                "--batch-size",
                "REPLAYPROOF_BATCH_SIZE",
                "[consume]\nbatch_size",
                "500",
            ),
            (
                &["dispatch", db],
                "lease",
                "--lease",
                "REPLAYPROOF_LEASE",
                "[dispatch]\nlease",
                "5m",
            ),
            (
                &["ingest"],
                "max_in_flight",
                "--max-in-flight",
                "REPLAYPROOF_MAX_IN_FLIGHT",
                "[ingest]\nmax_in_flight",
                "1024",
            ),
            (
                &["migrate", db],
                "statement_timeout",
                "--statement-timeout",
                "REPLAYPROOF_STATEMENT_TIMEOUT",
                "[database]\nstatement_timeout",
                "30s",
            ),
            (
                &["events", "list", db],
                "lock_timeout",
                "--lock-timeout",
                "REPLAYPROOF_LOCK_TIMEOUT",
                "[database]\nlock_timeout",
                "10s",
            ),
            (
                &["dead-letters", "list", db],
                "idle_in_transaction_timeout",
                "--idle-in-transaction-timeout",
                "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT",
                "[database]\nidle_in_transaction_timeout",
                "30s",
            ),
            (
                &["status", db],
                "group",
                "--group",
                "REPLAYPROOF_GROUP",
                "[kafka]\ngroup",
                "replayproof",
            ),
        ];
        for (argv, id, flag, var, file_key, default) in cases {
            let numeric = id != &"group";
            let duration = default.ends_with(['s', 'm']) && default.starts_with(char::is_numeric);
            let value = |n: u32| match (numeric, duration) {
                (_, true) => format!("{n}s"),
                (true, false) => n.to_string(),
                (false, _) => format!("g{n}"),
            };
            let file = match numeric && !duration {
                true => format!("{file_key} = {}\n", value(7)),
                false => format!("{file_key} = \"{}\"\n", value(7)),
            };
            std::env::remove_var(var);
            assert_eq!(&resolved(argv, "", id), default, "{argv:?}: the default");
            assert_eq!(
                resolved(argv, &file, id),
                value(7),
                "{argv:?}: the file over the default"
            );
            std::env::set_var(var, value(8));
            assert_eq!(
                resolved(argv, &file, id),
                value(8),
                "{argv:?}: the variable over the file"
            );
            let with_flag: Vec<String> = argv
                .iter()
                .map(|a| a.to_string())
                .chain([format!("{flag}={}", value(9))])
                .collect();
            let with_flag: Vec<&str> = with_flag.iter().map(String::as_str).collect();
            assert_eq!(
                resolved(&with_flag, &file, id),
                value(9),
                "{argv:?}: the flag over all"
            );
            std::env::remove_var(var);
        }
        // librdkafka properties: --kafka-option, then REPLAYPROOF_KAFKA_*, then [kafka], in the
        // order they are applied (the last one set wins).
        std::env::set_var("REPLAYPROOF_KAFKA_CLIENT_RACK", "from-env");
        let (_dir, argv) = with_file(
            &[
                "consume",
                "--brokers=b",
                db,
                "--kafka-option",
                "client.rack=from-flag",
            ],
            "[kafka]\nclient.rack = \"from-file\"\n",
        );
        let args = crate::cli::parse(argv, &ProcessEnv).unwrap();
        std::env::remove_var("REPLAYPROOF_KAFKA_CLIENT_RACK");
        let crate::cli::Command::Consume(consume) = args.command else {
            unreachable!("a consume command")
        };
        let options: Vec<String> = (consume.kafka.options.kafka_options.iter())
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        assert_eq!(
            options.join(","),
            "client.rack=from-file,client.rack=from-env,client.rack=from-flag"
        );
    }

    /// The lease a `dispatch` started with `argv` and the file `text` gets.
    fn lease(argv: &[&str], text: &str) -> Result<std::time::Duration, String> {
        let mut full = vec!["dispatch", "--database-url=postgres://u@h/d"];
        full.extend(argv);
        let (_dir, full) = with_file(&full, text);
        let args = crate::cli::parse(full, &ProcessEnv).map_err(|e| e.to_string())?;
        match args.command {
            crate::cli::Command::Dispatch(d) => {
                Ok(d.settings(None).map_err(|e| e.to_string())?.lease)
            }
            _ => unreachable!("a dispatch command"),
        }
    }

    #[test]
    fn a_duration_is_humantime_and_its_old_spelling_still_sets_it_with_the_same_precedence() {
        let secs = std::time::Duration::from_secs;
        assert_eq!(lease(&[], ""), Ok(secs(300)));
        assert_eq!(lease(&["--lease", "90s"], ""), Ok(secs(90)));
        assert_eq!(lease(&["--lease-secs", "60"], ""), Ok(secs(60)));
        assert_eq!(lease(&[], "[dispatch]\nlease = \"2m\"\n"), Ok(secs(120)));
        assert_eq!(lease(&[], "[dispatch]\nlease_secs = 45\n"), Ok(secs(45)));
        // A flag in either spelling wins over the file in either.
        assert_eq!(
            lease(&["--lease", "90s"], "[dispatch]\nlease_secs = 45\n"),
            Ok(secs(90))
        );
        assert_eq!(
            lease(&["--lease-secs", "60"], "[dispatch]\nlease = \"2m\"\n"),
            Ok(secs(60))
        );
        // Both spellings at once, or a bare number in the new one, is refused.
        let both = lease(&["--lease", "90s", "--lease-secs", "60"], "").unwrap_err();
        assert!(both.contains("cannot be used with"), "{both}");
        let bare = lease(&["--lease", "300"], "").unwrap_err();
        assert!(bare.contains("a duration such as"), "{bare}");
        let absurd = lease(&["--lease", "100years"], "").unwrap_err();
        assert!(absurd.contains("is not between 1s and 7days"), "{absurd}");
    }

    #[test]
    fn an_unknown_key_is_refused_with_the_section_s_keys() {
        use clap::CommandFactory as _;
        let root = crate::cli::Args::command();
        let file =
            ConfigFile::parse(Path::new("c.toml"), "[consume]\nbatch = 5\n", &env(&[])).unwrap();
        let err = check_keys(&root, &crate::cli::file_keys(), &file)
            .unwrap_err()
            .to_string();
        assert!(err.contains("[consume] has no setting `batch`"), "{err}");
        assert!(err.contains("batch_size"), "{err}");
        let fine = ConfigFile::parse(
            Path::new("c.toml"),
            "[dispatch]\nheaders = { Authorization = \"x\" }\n[database]\nurl = \"postgres://h/d\"\n",
            &env(&[]),
        )
        .unwrap();
        check_keys(&root, &crate::cli::file_keys(), &fine).unwrap();
    }

    #[test]
    fn secrets_are_redacted() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
        ] {
            assert_eq!(redacted(key, "x"), "<redacted>", "{key}");
        }
        assert_eq!(redacted("sasl.username", "app"), "app");
        let url = redact_url("postgres://app:hunter2@db:5432/x?sslmode=require&password=p2");
        assert!(!url.contains("hunter2") && !url.contains("p2"), "{url}");
        assert!(url.contains("sslmode=require"), "{url}");
    }
}
