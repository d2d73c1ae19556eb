//! `replayproof config check`: the effective settings of every section with where each came
//! from (secrets redacted), the ingest sources with their secrets resolved, whether each
//! command would start from the file and the environment alone, and (unless `--no-connect`)
//! whether what they would connect to answers ([`connect`]).

mod connect;
pub use connect::connect;

use crate::config::{
    file_flags, kafka_env_properties, layered_over, render_clap_error, ConfigFile, Env, LayerError,
    Layered, Source, SECTIONS,
};
use crate::ingest::config::FileConfig;
use crate::secrets::{redact_url, redacted};
use clap::{Arg, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;

/// One effective setting, already redacted when it is a secret.
#[derive(Debug, Clone)]
pub struct Setting {
    pub key: String,
    pub value: String,
    pub source: Source,
}

/// The effective settings of every section, as `replayproof config check` prints them: each
/// checked command read over the file and the environment by the parse it runs with
/// ([`crate::config::layered`]), with every flag optional so that a missing one hides none of
/// the others.
pub fn effective(
    root: &Command,
    file: Option<&ConfigFile>,
    env: &dyn Env,
) -> anyhow::Result<BTreeMap<&'static str, Vec<Setting>>> {
    let mut out: BTreeMap<&'static str, Vec<Setting>> = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    let flags = file_flags(root, &super::file_keys());
    for command in CHECKED_COMMANDS {
        let layered = every_flag_optional(root, command, file, env)?;
        for flag in flags.iter().filter(|f| f.path == [*command]) {
            if seen.contains(&(flag.section, flag.key.clone())) {
                continue;
            }
            let Some(setting) = setting(&layered, flag.arg, flag.section, &flag.key) else {
                continue;
            };
            seen.insert((flag.section, flag.key.clone()));
            out.entry(flag.section).or_default().push(setting);
        }
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

/// `command` with no flags, read over the file and the environment as it starts, with every
/// flag optional so that a missing one hides none of the others.
fn every_flag_optional(
    root: &Command,
    command: &str,
    file: Option<&ConfigFile>,
    env: &dyn Env,
) -> anyhow::Result<Layered> {
    let optional = root
        .clone()
        .mut_subcommand(command, |c| c.mut_args(|a| a.required(false)));
    let argv: Vec<OsString> = vec!["replayproof".into(), command.into()];
    match layered_over(optional, &super::file_keys(), file.cloned(), argv, env) {
        Ok(layered) => Ok(layered),
        Err(LayerError::Config(e)) => Err(e),
        Err(LayerError::Clap(e)) => anyhow::bail!("{}", render_clap_error(&e)),
    }
}

/// The effective value of `arg` in a parsed command, redacted, with where it came from; None
/// when it has none. A value from the file is shown as the file spells it.
fn setting(layered: &Layered, arg: &Arg, section: &str, key: &str) -> Option<Setting> {
    let refused = (layered.refused.iter()).any(|r| r.section == section && r.key == key);
    let source = match refused {
        true => Source::Refused,
        false => layered.source(arg)?,
    };
    let as_in_file = match source {
        Source::File | Source::Refused => layered.file.as_ref()?.section(section).get(key).cloned(),
        _ => None,
    };
    let value = match as_in_file {
        Some(toml::Value::String(s)) => literal(&redact_setting(section, key, &s)),
        Some(toml::Value::Table(_)) if !redact_setting(section, key, "").is_empty() => {
            literal("<redacted>")
        }
        Some(other) => other.to_string(),
        None => {
            let raw = layered.leaf().get_raw(arg.get_id().as_str())?;
            let texts: Vec<String> = raw
                .map(|v| literal(&redact_setting(section, key, &v.to_string_lossy())))
                .collect();
            match texts.len() {
                1 => texts.into_iter().next()?,
                _ => format!("[{}]", texts.join(", ")),
            }
        }
    };
    let key = key.to_owned();
    Some(Setting { key, value, source })
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
        ("database", "url" | "direct_url")
        | ("consume", "target_url")
        | ("consume", "reconcile_url") => redact_url(value),
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
const CHECKED_COMMANDS: &[&str] = &[
    "migrate", "consume", "dispatch", "ingest", "status", "console",
];

/// `replayproof config check`: reads the file, replaces its variables, refuses unknown
/// sections and keys, parses every command from the file and the environment as it would
/// start, resolves the ingest sources' secrets, and renders the effective settings (secrets
/// redacted) with where each came from.
pub fn check(root: &Command, file: Option<&ConfigFile>, env: &dyn Env) -> anyhow::Result<Report> {
    let settings = effective(root, file, env)?;
    let mut report = Report {
        text: String::new(),
        problems: 0,
    };
    report.settings(file, &settings)?;
    if let Some(f) = file {
        report.ingest_sources(f, env)?;
    }
    report.database_tls(root, file, env)?;
    report.commands(root, file, env)?;
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
    /// The URL is `migrate`'s, as its parse reads it: the flag's variable, else the file.
    fn database_tls(
        &mut self,
        root: &Command,
        file: Option<&ConfigFile>,
        env: &dyn Env,
    ) -> anyhow::Result<()> {
        let migrate = every_flag_optional(root, "migrate", file, env)?;
        let database_url = (migrate.leaf().get_raw("database_url").into_iter().flatten())
            .find_map(|url| url.to_str().map(str::to_owned));
        match database_url
            .as_deref()
            .and_then(crate::db::unverified_tls_of)
        {
            Some(warning) => Ok(writeln!(self.text, "\nwarning: [database] url: {warning}")?),
            None => Ok(()),
        }
    }

    /// Each command, parsed from the file and the environment alone as it would start.
    fn commands(
        &mut self,
        root: &Command,
        file: Option<&ConfigFile>,
        env: &dyn Env,
    ) -> std::fmt::Result {
        writeln!(
            self.text,
            "\n# Commands, started from the file and the environment alone:"
        )?;
        for command in CHECKED_COMMANDS {
            let configured = |f: &ConfigFile| !f.section("console").is_empty();
            if *command == "console" && !file.is_some_and(configured) {
                writeln!(self.text, "console: not configured (no [console] section)")?;
                continue;
            }
            let argv: Vec<OsString> = vec!["replayproof".into(), (*command).into()];
            let parsed = layered_over(root.clone(), &super::file_keys(), file.cloned(), argv, env);
            match parsed {
                Ok(layered) => match layered.refused.first() {
                    Some(refused) => {
                        let problem = anyhow::anyhow!("{}", refused.problem);
                        self.command_refused(command, &LayerError::Config(problem))?
                    }
                    None => match parsed_problem(&layered, file)
                        .or_else(|| own_problem(command, file, env))
                    {
                        Some(problem) => {
                            let problem = LayerError::Config(problem);
                            self.command_refused(command, &problem)?
                        }
                        None => writeln!(self.text, "{command}: ready")?,
                    },
                },
                Err(e) => self.command_refused(command, &e)?,
            }
        }
        Ok(())
    }

    /// What a command that would not start says: the settings it still needs, or its problem.
    fn command_refused(&mut self, command: &str, e: &LayerError) -> std::fmt::Result {
        if let LayerError::Clap(c) = e {
            if c.kind() == clap::error::ErrorKind::MissingRequiredArgument {
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
        }
        self.problems += 1;
        let first = e.to_string();
        let first = first
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("error: ");
        writeln!(self.text, "{command}: problem: {first}")
    }
}

/// What stops a command whose flags all parse, read into its arguments as the command reads
/// them: a value its types refuse, the console's settings, a built-in effect without the
/// setting it needs, or the relay's settings.
fn parsed_problem(layered: &Layered, file: Option<&ConfigFile>) -> Option<anyhow::Error> {
    use clap::FromArgMatches as _;
    match crate::cli::Args::from_arg_matches(&layered.matches) {
        Ok(args) => match &args.command {
            crate::cli::Command::Console(console) => console.settings(file).err(),
            crate::cli::Command::Migrate(migrate) => migrate.migrated().err(),
            crate::cli::Command::Consume(consume) => consume.built_in_problem(),
            crate::cli::Command::Dispatch(dispatch) => {
                let relay = dispatch.relay.settings("check", std::time::Duration::ZERO);
                relay.err()
            }
            _ => None,
        },
        Err(e) => Some(anyhow::anyhow!("{}", render_clap_error(&e))),
    }
}

/// What stops a command whose flags all parse: ingest without its sources, or with a secret
/// variable unset; dispatch with a destination or credential it cannot read.
fn own_problem(command: &str, file: Option<&ConfigFile>, env: &dyn Env) -> Option<anyhow::Error> {
    if command == "dispatch" {
        let section = file.map(|f| f.section("dispatch")).unwrap_or_default();
        return crate::destinations::Destinations::from_table(section.get("destinations"))
            .and(crate::dispatch::Credentials::from_table(
                section.get("credentials"),
            ))
            .err();
    }
    if command != "ingest" {
        return None;
    }
    let Some(file) = file else {
        return Some(anyhow::anyhow!(
            "ingest reads its sources from the configuration file"
        ));
    };
    let sources = FileConfig::from_config(file).and_then(|c| c.sources_with(|n| env.var(n)));
    match sources {
        Ok(sources) if sources.is_empty() => Some(anyhow::anyhow!("no [[ingest.sources]]")),
        Ok(_) => None,
        Err(e) => Some(anyhow::anyhow!("[ingest] sources: {e:#}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    /// Each setting `config check` prints for the file `text`, as `section key = value # source`.
    fn printed(text: &str) -> Vec<String> {
        let env = BTreeMap::<String, String>::new();
        let file = ConfigFile::parse(std::path::Path::new("c.toml"), text, &env).unwrap();
        let settings = effective(&crate::cli::Args::command(), Some(&file), &env).unwrap();
        settings
            .iter()
            .flat_map(|(section, list)| {
                list.iter()
                    .map(move |s| format!("{section} {} = {} # {}", s.key, s.value, s.source))
            })
            .collect()
    }

    #[test]
    fn the_settings_are_what_the_commands_parse_with_where_each_came_from() {
        let lines = printed(
            "[consume]\nmax_lane_bytes = 7\nassignor = \"random\"\n\
             target_url = \"https://u:pw-secret@h/x\"\n\
             defer_sources = { stripe = \"72h\" }\n\
             [dispatch]\nrequest_timeout_ms = 1500\n",
        );
        let has = |line: &str| {
            assert!(
                lines.iter().any(|l| l == line),
                "{line:?} not in {lines:#?}"
            );
        };
        has("consume max_lane_bytes = 7 # file");
        has("consume effect = \"ledger\" # default");
        has("consume defer_sources = { stripe = \"72h\" } # file");
        // The old spelling sets the duration, and is shown as it.
        has("dispatch request_timeout = \"1500ms\" # file");
        assert!(
            !lines.iter().any(|l| l.contains("request_timeout_ms")),
            "{lines:#?}"
        );
        // A value its flag refused is shown as refused, not as the default it leaves.
        has("consume assignor = \"random\" # file, refused (see the commands below)");
        let url = lines
            .iter()
            .find(|l| l.starts_with("consume target_url = "))
            .unwrap();
        assert!(
            url.ends_with("# file") && !url.contains("pw-secret"),
            "{url}"
        );
    }

    #[test]
    fn the_console_is_checked_when_the_file_configures_it() {
        let env = BTreeMap::<String, String>::new();
        let report = |text: &str| {
            let file = ConfigFile::parse(std::path::Path::new("c.toml"), text, &env).unwrap();
            check(&crate::cli::Args::command(), Some(&file), &env).unwrap()
        };
        let none = report("[kafka]\nbrokers = \"b:9092\"\n");
        assert!(
            none.text.contains("console: not configured"),
            "{}",
            none.text
        );
        let db = "[database]\nurl = \"postgres://u@db/x\"\n";
        let short = report(&format!("{db}[console]\nsession_key = \"short\"\n"));
        assert!(short.text.contains("console: problem:"), "{}", short.text);
        assert!(short.text.contains("at least 32"), "{}", short.text);
        let hash = crate::console::hash_password_with(
            "pw",
            argon2::Params::new(1024, 1, 1, None).unwrap(),
        )
        .unwrap();
        let fine = report(&format!(
            "{db}[console]\nsession_key = \"{}\"\nlisten = \"127.0.0.1:9999\"\n\
             [[console.users]]\nname = \"ann\"\nrole = \"operator\"\npassword_hash = \"{hash}\"\n",
            "k".repeat(40)
        ));
        assert!(fine.text.contains("console: ready"), "{}", fine.text);
        assert!(
            fine.text
                .contains("[console]\nlisten = \"127.0.0.1:9999\"    # file"),
            "{}",
            fine.text
        );
    }

    #[test]
    fn a_mistyped_console_key_is_refused() {
        let env = BTreeMap::<String, String>::new();
        let typo = ConfigFile::parse(
            std::path::Path::new("c.toml"),
            "[console]\nsesion_key = \"x\"\n",
            &env,
        )
        .unwrap();
        assert!(check(&crate::cli::Args::command(), Some(&typo), &env).is_err());
    }

    #[test]
    fn every_setting_of_the_file_is_read_by_a_checked_command() {
        let root = crate::cli::Args::command();
        let flags = file_flags(&root, &crate::cli::file_keys());
        let checked = |section: &str, key: &str| {
            flags.iter().any(|f| {
                f.path.len() == 1
                    && CHECKED_COMMANDS.contains(&f.path[0].as_str())
                    && (f.section, f.key.as_str()) == (section, key)
            })
        };
        // Hidden flags are the old spellings, shown as the durations they set.
        for flag in flags.iter().filter(|f| !f.arg.is_hide_set()) {
            assert!(
                checked(flag.section, &flag.key),
                "{:?}: [{}] {} is in no checked command",
                flag.path,
                flag.section,
                flag.key
            );
        }
    }

    #[test]
    fn dispatch_does_not_start_with_a_destination_or_credential_it_cannot_read() {
        let env = BTreeMap::<String, String>::new();
        let problem = |text: &str| {
            let file = ConfigFile::parse(std::path::Path::new("c.toml"), text, &env).unwrap();
            own_problem("dispatch", Some(&file), &env).map(|e| format!("{e:#}"))
        };
        let fine = "[dispatch.destinations.default]\nmax_concurrency = 4\n\
                    [dispatch.credentials.acme]\nheaders = { Authorization = \"Bearer k\" }\n\
                    origins = [\"https://a.com\"]\n";
        assert_eq!(problem(fine), None);
        let path = problem("[dispatch.destinations.\"https://a.com/v1\"]\nrate_per_sec = 1\n");
        assert!(path.is_some_and(|p| p.contains("origin only")));
        let reserved = problem(
            "[dispatch.credentials.x]\nheaders = { Host = \"h\" }\norigins = [\"https://a.com\"]\n",
        );
        assert!(reserved.is_some_and(|p| p.contains("set by replayproof")));
        let root = crate::cli::Args::command();
        let file = ConfigFile::parse(std::path::Path::new("c.toml"), fine, &env).unwrap();
        assert!(crate::config::check_keys(&root, &crate::cli::file_keys(), &file).is_ok());
    }
}
