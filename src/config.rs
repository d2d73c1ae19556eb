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
//! ```
//!
//! A setting is taken from the first of: the command's flag, its environment variable, the
//! file, the default. `${NAME}` anywhere in a string of the file is replaced by the environment
//! variable NAME, so secrets stay out of the file; an unset one is an error naming it.
//! `REPLAYPROOF_KAFKA_<PROPERTY>` sets a librdkafka property (`REPLAYPROOF_KAFKA_SASL_PASSWORD`
//! is `sasl.password`), over the file and under `--kafka-option`.
//!
//! The file's settings reach each command as flags put in front of the user's own (see
//! [`layer`]), so every command parses one command line and the precedence is the same for all.

use anyhow::{bail, Context as _};
use clap::{Arg, ArgAction, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The environment variable naming the file, as `--config` does.
pub const CONFIG_ENV: &str = "REPLAYPROOF_CONFIG";
/// The prefix of the environment variables that set librdkafka properties.
pub const KAFKA_ENV_PREFIX: &str = "REPLAYPROOF_KAFKA_";

/// The file's sections.
pub const SECTIONS: &[&str] = &["kafka", "database", "consume", "dispatch", "ingest"];

/// `[kafka]` keys that are replayproof's own flags; every other key is a librdkafka property.
const KAFKA_FLAGS: &[&str] = &["brokers", "topic", "group"];

/// Flags no section sets: the file itself, and what is a property list rather than a setting.
const NEVER_FROM_FILE: &[&str] = &["config", "kafka-option", "help", "version", "log-format"];

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
            if let Some(section) = legacy_section(&name) {
                // Before sections, the file held ingest's settings at its top level.
                let table = sections.entry(section.into()).or_default();
                anyhow::ensure!(
                    table.insert(name.clone(), value).is_none(),
                    "{}: `{name}` is given twice, at the top and in [{section}]",
                    path.display()
                );
                continue;
            }
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

/// The section a pre-sections top-level key of ingest's file belongs to.
fn legacy_section(key: &str) -> Option<&'static str> {
    match key {
        "brokers" | "topic" => Some("kafka"),
        "listen" | "max_body_bytes" | "produce_timeout_ms" | "sources" => Some("ingest"),
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
fn scalar(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        toml::Value::Datetime(d) => Some(d.to_string()),
        toml::Value::Array(_) | toml::Value::Table(_) => None,
    }
}

/// The librdkafka properties set by `REPLAYPROOF_KAFKA_*` variables, sorted by name.
pub fn kafka_env_properties(env: &dyn Env) -> Vec<(String, String, String)> {
    let mut props: Vec<_> = env
        .vars()
        .into_iter()
        .filter_map(|(name, value)| {
            let property = name.strip_prefix(KAFKA_ENV_PREFIX)?;
            (!property.is_empty()).then(|| {
                (
                    property.to_ascii_lowercase().replace('_', "."),
                    value,
                    name.clone(),
                )
            })
        })
        .collect();
    props.sort();
    props
}

pub use crate::secrets::{is_secret_property, redact_url, redacted};

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

// ---------------------------------------------------------------------------------- layering

/// Which section a flag of a command is read from, with its key there.
fn section_of(command_path: &[String], long: &str) -> Option<(&'static str, String)> {
    let key = long.replace('-', "_");
    if NEVER_FROM_FILE.contains(&long) {
        return None;
    }
    match long {
        "database-url" => return Some(("database", "url".into())),
        "header" => return Some(("dispatch", "headers".into())),
        "defer-source" => return Some(("consume", "defer_sources".into())),
        "schema"
        | "statement-timeout-ms"
        | "lock-timeout-ms"
        | "idle-in-transaction-timeout-ms" => return Some(("database", key)),
        // A replayed dead letter goes back to its own topic unless --topic says otherwise.
        "topic" if command_path.first().is_some_and(|c| c == "dead-letters") => return None,
        "brokers" | "topic" | "group" => return Some(("kafka", key)),
        _ => {}
    }
    match command_path.first().map(String::as_str) {
        Some(command @ ("consume" | "dispatch" | "ingest")) => {
            let section = SECTIONS.iter().find(|s| **s == command)?;
            Some((section, key))
        }
        _ => None,
    }
}

/// The subcommands named in `argv` (after the program's name), and the index in `argv` just
/// past the last of them, where the file's flags go.
fn command_path(root: &Command, argv: &[OsString]) -> (Vec<String>, usize) {
    let mut path = Vec::new();
    let mut cmd = root.clone();
    let mut insert_at = 1.min(argv.len());
    let mut i = 1;
    while i < argv.len() {
        let Some(token) = argv[i].to_str() else {
            i += 1;
            continue;
        };
        if token == "--" {
            break;
        }
        if let Some(long) = token.strip_prefix("--") {
            if !long.contains('=') && takes_value(&cmd, root, long) {
                i += 1;
            }
        } else if !token.starts_with('-') {
            if let Some(sub) = cmd.find_subcommand(token) {
                path.push(sub.get_name().to_owned());
                cmd = sub.clone();
                insert_at = i + 1;
            }
        }
        i += 1;
    }
    (path, insert_at)
}

fn takes_value(cmd: &Command, root: &Command, long: &str) -> bool {
    cmd.get_arguments()
        .chain(root.get_arguments())
        .find(|a| a.get_long() == Some(long))
        .is_some_and(|a| a.get_action().takes_values())
}

/// The command `path` names under `root`.
fn leaf<'a>(root: &'a Command, path: &[String]) -> &'a Command {
    path.iter().fold(root, |cmd, name| {
        cmd.find_subcommand(name)
            .expect("the path was read from this tree")
    })
}

/// Whether `argv` sets `--long` itself.
fn given(argv: &[OsString], long: &str) -> bool {
    let flag = format!("--{long}");
    let with_value = format!("--{long}=");
    argv.iter()
        .filter_map(|a| a.to_str())
        .any(|a| a == flag || a.starts_with(&with_value))
}

/// Where the file is: `--config` in `argv`, or [`CONFIG_ENV`].
pub fn config_path(argv: &[OsString], env: &dyn Env) -> Option<PathBuf> {
    let mut tokens = argv.iter().skip(1);
    while let Some(token) = tokens.next() {
        let Some(text) = token.to_str() else { continue };
        if text == "--" {
            break;
        }
        if text == "--config" {
            return tokens.next().map(PathBuf::from);
        }
        if let Some(path) = text.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    env.var(CONFIG_ENV)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// The command line with the file's settings and the `REPLAYPROOF_KAFKA_*` properties put in
/// as flags, after the subcommand's name and before the user's own flags, wherever neither a
/// flag nor the flag's environment variable already sets them. `--kafka-option`s are applied
/// in order, so the file's properties come first, then the environment's, then the user's.
pub fn layer(root: &Command, argv: Vec<OsString>, env: &dyn Env) -> anyhow::Result<Vec<OsString>> {
    let (path, insert_at) = command_path(root, &argv);
    let cmd = leaf(root, &path);
    let file = match config_path(&argv, env) {
        Some(p) => Some(ConfigFile::load(&p, env)?),
        None => None,
    };
    if let Some(file) = &file {
        check_keys(root, file)?;
    }
    let mut added: Vec<OsString> = Vec::new();
    let has = |long: &str| cmd.get_arguments().any(|a| a.get_long() == Some(long));
    if has("kafka-option") {
        let file_props = file.iter().flat_map(ConfigFile::kafka_properties);
        let env_props = kafka_env_properties(env)
            .into_iter()
            .map(|(k, v, _)| (k, v));
        for (k, v) in file_props.chain(env_props) {
            added.push("--kafka-option".into());
            added.push(format!("{k}={v}").into());
        }
    }
    if let Some(file) = &file {
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let Some((section, key)) = section_of(&path, long) else {
                continue;
            };
            let Some(value) = file.section(section).get(&key).cloned() else {
                continue;
            };
            let from_env = arg
                .get_env()
                .is_some_and(|name| name.to_str().and_then(|n| env.var(n)).is_some());
            if given(&argv, long) || from_env {
                continue;
            }
            added.extend(flag_values(arg, long, &value, section, &key)?);
        }
    }
    let mut out = argv;
    out.splice(insert_at..insert_at, added);
    Ok(out)
}

/// `value` from the file as `--long` arguments.
fn flag_values(
    arg: &Arg,
    long: &str,
    value: &toml::Value,
    section: &str,
    key: &str,
) -> anyhow::Result<Vec<OsString>> {
    let flag = || OsString::from(format!("--{long}"));
    let mut out = Vec::new();
    match value {
        toml::Value::Boolean(b) if matches!(arg.get_action(), ArgAction::SetTrue) => {
            if *b {
                out.push(flag());
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                let text = scalar(item).with_context(|| {
                    format!("[{section}] {key}: a list of plain values is expected")
                })?;
                out.extend([flag(), text.into()]);
            }
        }
        toml::Value::Table(table) => {
            for (k, v) in table {
                let text = scalar(v)
                    .with_context(|| format!("[{section}] {key}.{k}: a plain value is expected"))?;
                out.extend([flag(), format!("{k}={text}").into()]);
            }
        }
        other => {
            let text = scalar(other).expect("not an array or a table");
            out.extend([flag(), text.into()]);
        }
    }
    Ok(out)
}

/// Every flag of every command that a section sets: the command's path, the flag, and the
/// section and key it is read from.
pub(crate) fn file_flags(root: &Command) -> Vec<(Vec<String>, &Arg, &'static str, String)> {
    let mut flags = Vec::new();
    let mut stack: Vec<(Vec<String>, &Command)> = vec![(Vec::new(), root)];
    while let Some((path, cmd)) = stack.pop() {
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if let Some((section, key)) = section_of(&path, long) {
                flags.push((path.clone(), arg, section, key));
            }
        }
        for sub in cmd.get_subcommands() {
            let mut p = path.clone();
            p.push(sub.get_name().to_owned());
            stack.push((p, sub));
        }
    }
    flags
}

/// Every key the file's sections may hold, with the commands that read it.
fn known_keys(root: &Command) -> BTreeMap<(&'static str, String), Vec<String>> {
    let mut known: BTreeMap<(&'static str, String), Vec<String>> = BTreeMap::new();
    for (path, _, section, key) in file_flags(root) {
        known
            .entry((section, key))
            .or_default()
            .push(path.join(" "));
    }
    known
        .entry(("ingest", "sources".into()))
        .or_default()
        .push("ingest".into());
    known
}

/// Refuses a key that no command reads, so a typo is found at once.
pub(crate) fn check_keys(root: &Command, file: &ConfigFile) -> anyhow::Result<()> {
    let known = known_keys(root);
    for section in SECTIONS {
        for key in file.section(section).keys() {
            let ours = known.contains_key(&(*section, key.clone()));
            if ours || (*section == "kafka" && !KAFKA_FLAGS.contains(&key.as_str())) {
                continue;
            }
            let keys: Vec<&str> = known
                .keys()
                .filter(|(s, _)| s == section)
                .map(|(_, k)| k.as_str())
                .collect();
            bail!(
                "{}: [{section}] has no setting `{key}`; it has {}",
                file.path.display(),
                keys.join(", ")
            );
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------ config check

#[cfg(test)]
mod tests {
    use super::*;

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
            vec![(
                "sasl.username".into(),
                "app".into(),
                "REPLAYPROOF_KAFKA_SASL_USERNAME".into()
            )]
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

    /// The value a command would run with for the flag `id`, from `argv`, the file `text` and
    /// the process environment.
    fn resolved(argv: &[&str], text: &str, id: &str) -> String {
        use clap::CommandFactory as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, text).unwrap();
        let mut full: Vec<OsString> = vec!["replayproof".into()];
        full.extend(argv.iter().map(OsString::from));
        full.extend(["--config".into(), path.clone().into_os_string()]);
        let root = crate::cli::Args::command();
        let layered = layer(&root, full, &ProcessEnv).unwrap();
        let mut matches = root.try_get_matches_from(layered).unwrap();
        while let Some((_, sub)) = matches.remove_subcommand() {
            matches = sub;
        }
        let raw = matches.get_raw(id).expect("the flag has a value");
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
                "lease_secs",
                "--lease-secs",
                "REPLAYPROOF_LEASE_SECS",
                "[dispatch]\nlease_secs",
                "300",
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
                "statement_timeout_ms",
                "--statement-timeout-ms",
                "REPLAYPROOF_STATEMENT_TIMEOUT_MS",
                "[database]\nstatement_timeout_ms",
                "30000",
            ),
            (
                &["events", "list", db],
                "lock_timeout_ms",
                "--lock-timeout-ms",
                "REPLAYPROOF_LOCK_TIMEOUT_MS",
                "[database]\nlock_timeout_ms",
                "10000",
            ),
            (
                &["dead-letters", "list", db],
                "idle_in_transaction_timeout_ms",
                "--idle-in-transaction-timeout-ms",
                "REPLAYPROOF_IDLE_IN_TRANSACTION_TIMEOUT_MS",
                "[database]\nidle_in_transaction_timeout_ms",
                "30000",
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
            let value = |n: u32| {
                if numeric {
                    n.to_string()
                } else {
                    format!("g{n}")
                }
            };
            let file = if numeric {
                format!("{file_key} = {}\n", value(7))
            } else {
                format!("{file_key} = \"{}\"\n", value(7))
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
        let options = resolved(
            &[
                "consume",
                "--brokers=b",
                db,
                "--kafka-option",
                "client.rack=from-flag",
            ],
            "[kafka]\nclient.rack = \"from-file\"\n",
            "kafka_options",
        );
        std::env::remove_var("REPLAYPROOF_KAFKA_CLIENT_RACK");
        assert_eq!(
            options,
            "client.rack=from-file,client.rack=from-env,client.rack=from-flag"
        );
    }

    #[test]
    fn an_unknown_key_is_refused_with_the_section_s_keys() {
        use clap::CommandFactory as _;
        let root = crate::cli::Args::command();
        let file =
            ConfigFile::parse(Path::new("c.toml"), "[consume]\nbatch = 5\n", &env(&[])).unwrap();
        let err = check_keys(&root, &file).unwrap_err().to_string();
        assert!(err.contains("[consume] has no setting `batch`"), "{err}");
        assert!(err.contains("batch_size"), "{err}");
        let fine = ConfigFile::parse(
            Path::new("c.toml"),
            "[dispatch]\nheaders = { Authorization = \"x\" }\n[database]\nurl = \"postgres://h/d\"\n",
            &env(&[]),
        )
        .unwrap();
        check_keys(&root, &fine).unwrap();
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
