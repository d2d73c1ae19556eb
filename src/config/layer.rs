//! The precedence of settings (flag, environment, file, default): the file's settings are put in
//! as flags before the command line is parsed, and the file's keys are checked against the
//! commands' flags.

use super::{kafka_env_properties, scalar, ConfigFile, Env, CONFIG_ENV, SECTIONS};
use anyhow::{bail, Context as _};
use clap::{Arg, ArgAction, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;

/// `[kafka]` keys that are replayproof's own flags; every other key is a librdkafka property.
pub(crate) const KAFKA_FLAGS: &[&str] = &["brokers", "topic", "group"];
/// Flags no section sets: the file itself, and what is a property list rather than a setting.
const NEVER_FROM_FILE: &[&str] = &["config", "kafka-option", "help", "version", "log-format"];

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
        | "statement-timeout"
        | "statement-timeout-ms"
        | "lock-timeout"
        | "lock-timeout-ms"
        | "idle-in-transaction-timeout"
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

/// The flags that spell the same setting as `arg`, `arg` included: a duration and its old
/// `…-ms` or `…-secs` spelling, which conflict with each other.
fn spellings<'c>(cmd: &'c Command, arg: &'c Arg) -> Vec<&'c Arg> {
    let mut all = vec![arg];
    all.extend(cmd.get_arg_conflicts_with(arg));
    let conflicting_with_it = cmd.get_arguments().filter(|other| {
        cmd.get_arg_conflicts_with(other)
            .iter()
            .any(|a| a.get_id() == arg.get_id())
    });
    all.extend(conflicting_with_it);
    all
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
            .map(|p| (p.key, p.value));
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
            // A setting spelled two ways (a duration and its old `…-ms` or `…-secs` flag) is
            // one setting: the file's value of either yields to a flag or variable of either.
            let set_elsewhere = spellings(cmd, arg).into_iter().any(|a| {
                let from_env = a
                    .get_env()
                    .is_some_and(|name| name.to_str().and_then(|n| env.var(n)).is_some());
                from_env || a.get_long().is_some_and(|long| given(&argv, long))
            });
            if set_elsewhere {
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

/// A flag a file's key can set: the command it belongs to, the flag, and its section and key.
pub(crate) struct FileFlag<'a> {
    pub(crate) path: Vec<String>,
    pub(crate) arg: &'a Arg,
    pub(crate) section: &'static str,
    pub(crate) key: String,
}

/// Every flag of every command that a section sets: the command's path, the flag, and the
/// section and key it is read from.
pub(crate) fn file_flags(root: &Command) -> Vec<FileFlag<'_>> {
    let mut flags = Vec::new();
    let mut stack: Vec<(Vec<String>, &Command)> = vec![(Vec::new(), root)];
    while let Some((path, cmd)) = stack.pop() {
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if let Some((section, key)) = section_of(&path, long) {
                let path = path.clone();
                flags.push(FileFlag {
                    path,
                    arg,
                    section,
                    key,
                });
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
    for FileFlag {
        path, section, key, ..
    } in file_flags(root)
    {
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
