//! `replayproof config check`: the effective settings of every section with where each came
//! from (secrets redacted), the ingest sources with their secrets resolved, and whether each
//! command would start from the file and the environment alone.

use crate::config::{
    check_keys, file_flags, kafka_env_properties, layer, render_clap_error, ConfigFile, Env,
    FileFlag, SECTIONS,
};
use crate::ingest::config::FileConfig;
use crate::secrets::{redact_url, redacted};
use clap::Command;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::Path;

/// Where an effective setting came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Env(String),
    File,
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Env(name) => write!(f, "env {name}"),
            Self::File => f.write_str("file"),
            Self::Default => f.write_str("default"),
        }
    }
}

/// One effective setting, already redacted when it is a secret.
#[derive(Debug, Clone)]
pub struct Setting {
    pub key: String,
    pub value: String,
    pub source: Source,
}

/// The effective settings of every section, as `replayproof config check` prints them.
pub fn effective(
    root: &Command,
    file: Option<&ConfigFile>,
    env: &dyn Env,
) -> anyhow::Result<BTreeMap<&'static str, Vec<Setting>>> {
    if let Some(file) = file {
        check_keys(root, file)?;
    }
    let mut out: BTreeMap<&'static str, Vec<Setting>> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    for flag in file_flags(root) {
        if !seen.insert((flag.section, flag.key.clone())) {
            continue;
        }
        let Some((value, source)) = resolved(&flag, file, env) else {
            continue;
        };
        let key = flag.key;
        out.entry(flag.section)
            .or_default()
            .push(Setting { key, value, source });
    }
    // The environment's properties come after the file's, and replace them.
    let file_props = file.map(ConfigFile::kafka_properties).unwrap_or_default();
    let file_props = file_props.into_iter().map(|(k, v)| (k, v, Source::File));
    let env_props = kafka_env_properties(env)
        .into_iter()
        .map(|p| (p.key, p.value, Source::Env(p.variable)));
    let mut props: BTreeMap<String, Setting> = BTreeMap::new();
    for (key, value, source) in file_props.chain(env_props) {
        let value = literal(&redacted(&key, &value));
        props.insert(key.clone(), Setting { key, value, source });
    }
    out.entry("kafka").or_default().extend(props.into_values());
    for settings in out.values_mut() {
        settings.sort_by(|a, b| a.key.cmp(&b.key));
    }
    Ok(out)
}

/// A flag's effective value, redacted, and where it came from: the environment, the file or
/// its default; None when it has none.
fn resolved(
    flag: &FileFlag<'_>,
    file: Option<&ConfigFile>,
    env: &dyn Env,
) -> Option<(String, Source)> {
    let (section, key) = (flag.section, flag.key.as_str());
    let env_name = flag.arg.get_env().and_then(|n| n.to_str());
    if let Some((name, value)) = env_name.and_then(|n| Some((n, env.var(n)?))) {
        let value = literal(&redact_setting(section, key, &value));
        return Some((value, Source::Env(name.to_owned())));
    }
    if let Some(value) = file.and_then(|f| f.section(section).get(key).cloned()) {
        let value = match value {
            toml::Value::String(s) => toml::Value::String(redact_setting(section, key, &s)),
            toml::Value::Table(_) if !redact_setting(section, key, "").is_empty() => {
                toml::Value::String("<redacted>".into())
            }
            other => other,
        };
        return Some((value.to_string(), Source::File));
    }
    let default = flag.arg.get_default_values().first()?;
    Some((literal(&default.to_string_lossy()), Source::Default))
}

/// Text as a TOML literal: a number or boolean bare, anything else a quoted string.
fn literal(text: &str) -> String {
    if text.parse::<i64>().is_ok() || text == "true" || text == "false" {
        text.to_owned()
    } else {
        toml::Value::String(text.to_owned()).to_string()
    }
}

/// A setting's value with its secrets hidden: the database URL's password, the dispatcher's
/// header values and signing secret.
fn redact_setting(section: &str, key: &str, value: &str) -> String {
    match (section, key) {
        ("database", "url") | ("consume", "target_url") | ("consume", "reconcile_url") => {
            redact_url(value)
        }
        ("dispatch", "header") | ("dispatch", "headers") => "<redacted>".into(),
        _ => redacted(key, value),
    }
}

/// What `replayproof config check` prints, and how many problems it found.
pub struct Report {
    pub text: String,
    pub problems: usize,
}

/// The commands `config check` tries to start, each from the file and the environment alone.
const CHECKED_COMMANDS: &[&str] = &["migrate", "consume", "dispatch", "ingest", "status"];

/// `replayproof config check`: reads the file, replaces its variables, refuses unknown
/// sections and keys, parses every command from the file and the environment as it would
/// start, resolves the ingest sources' secrets, and renders the effective settings (secrets
/// redacted) with where each came from.
pub fn check(root: &Command, path: Option<&Path>, env: &dyn Env) -> anyhow::Result<Report> {
    let file = match path {
        Some(p) => Some(ConfigFile::load(p, env)?),
        None => None,
    };
    let settings = effective(root, file.as_ref(), env)?;
    let mut report = Report {
        text: String::new(),
        problems: 0,
    };
    report.settings(file.as_ref(), &settings)?;
    if let Some(f) = &file {
        report.ingest_sources(f, env)?;
    }
    report.database_tls(file.as_ref(), env)?;
    report.commands(root, path, env)?;
    Ok(report)
}

impl Report {
    /// The effective settings, section by section, each with where it came from.
    fn settings(
        &mut self,
        file: Option<&ConfigFile>,
        settings: &BTreeMap<&'static str, Vec<Setting>>,
    ) -> std::fmt::Result {
        let text = &mut self.text;
        match file {
            Some(f) => writeln!(text, "# {} (secrets redacted)", f.path.display())?,
            None => writeln!(
                text,
                "# no configuration file: the environment and defaults (secrets redacted)"
            )?,
        }
        for section in SECTIONS {
            writeln!(text, "\n[{section}]")?;
            let Some(list) = settings.get(section) else {
                continue;
            };
            let width = list
                .iter()
                .map(|s| s.key.len() + s.value.len())
                .max()
                .unwrap_or(0)
                + 6;
            for s in list {
                let key = match s.key.contains('.') {
                    true => format!("{:?}", s.key),
                    false => s.key.clone(),
                };
                let line = format!("{key} = {}", s.value);
                writeln!(text, "{line:<width$} # {}", s.source)?;
            }
        }
        Ok(())
    }

    /// The ingest sources, each with its secrets resolved from the environment.
    fn ingest_sources(&mut self, f: &ConfigFile, env: &dyn Env) -> std::fmt::Result {
        let resolved = FileConfig::from_config(f).and_then(|c| {
            c.sources_with(|name| env.var(name))?;
            Ok(c)
        });
        let c = match resolved {
            Ok(c) => c,
            Err(e) => {
                self.problems += 1;
                return writeln!(self.text, "\nproblem: [ingest] sources: {e:#}");
            }
        };
        let raw = f.section("ingest");
        let raw = raw.get("sources").and_then(toml::Value::as_array);
        for (source, table) in c.sources.iter().zip(raw.into_iter().flatten()) {
            let kind = table
                .get("kind")
                .map(toml::Value::to_string)
                .unwrap_or_default();
            writeln!(
                self.text,
                "\n[[ingest.sources]]\nname = {:?}\nkind = {kind}\nsecrets_env = {:?}   # each one set",
                source.name, source.secrets_env
            )?;
        }
        Ok(())
    }

    /// A warning when the database URL does not verify the server it connects to.
    fn database_tls(&mut self, file: Option<&ConfigFile>, env: &dyn Env) -> std::fmt::Result {
        let database_url = env.var("DATABASE_URL").or_else(|| {
            file?
                .section("database")
                .get("url")?
                .as_str()
                .map(str::to_owned)
        });
        match database_url
            .as_deref()
            .and_then(crate::db::unverified_tls_of)
        {
            Some(warning) => writeln!(self.text, "\nwarning: [database] url: {warning}"),
            None => Ok(()),
        }
    }

    /// Each command, parsed from the file and the environment alone as it would start.
    fn commands(&mut self, root: &Command, path: Option<&Path>, env: &dyn Env) -> std::fmt::Result {
        writeln!(
            self.text,
            "\n# Commands, started from the file and the environment alone:"
        )?;
        for command in CHECKED_COMMANDS {
            let mut argv: Vec<OsString> = vec!["replayproof".into(), (*command).into()];
            if let Some(p) = path {
                argv.extend(["--config".into(), p.as_os_str().to_owned()]);
            }
            let parsed = layer(root, argv, env).and_then(|argv| {
                root.clone()
                    .try_get_matches_from(argv)
                    .map_err(anyhow::Error::from)
            });
            match parsed {
                Ok(_) => writeln!(self.text, "{command}: ready")?,
                Err(e) => self.command_refused(command, &e)?,
            }
        }
        Ok(())
    }

    /// What a command that would not start says: the settings it still needs, or its problem.
    fn command_refused(&mut self, command: &str, e: &anyhow::Error) -> std::fmt::Result {
        let clap = e.downcast_ref::<clap::Error>();
        if let Some(c) =
            clap.filter(|c| c.kind() == clap::error::ErrorKind::MissingRequiredArgument)
        {
            let missing: Vec<String> = c
                .context()
                .filter(|(k, _)| *k == clap::error::ContextKind::InvalidArg)
                .map(|(_, v)| v.to_string())
                .collect();
            let missing = missing.join(", ");
            return writeln!(
                self.text,
                "{command}: needs {missing} (a flag, its variable or the file)"
            );
        }
        self.problems += 1;
        let first = match clap {
            Some(c) => render_clap_error(c),
            None => crate::secrets::scrub(&format!("{e:#}")).into_owned(),
        };
        let first = first
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("error: ");
        writeln!(self.text, "{command}: problem: {first}")
    }
}
