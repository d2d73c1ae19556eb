//! Which flag each of the file's keys sets: the section a command's flag is read from, every
//! such flag of every command, and the refusal of a key that none reads.

use super::{ConfigFile, SECTIONS};
use anyhow::bail;
use clap::{Arg, Command};
use std::collections::BTreeMap;

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
    if long.ends_with("-retention") || matches!(long, "allow-below-floor" | "prune-batch") {
        return Some(("retention", key));
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
        | "idle-in-transaction-timeout-ms"
        | "buckets"
        | "citus-shards" => return Some(("database", key)),
        // A replayed dead letter goes back to its own topic unless --topic says otherwise.
        "topic" if command_path.first().is_some_and(|c| c == "dead-letters") => return None,
        "brokers" | "topic" | "group" => return Some(("kafka", key)),
        _ => {}
    }
    match command_path.first().map(String::as_str) {
        // A replay applies as `consume` does, from the same settings; its window is its own.
        Some("replay") => match long {
            "since" | "until" | "partition" | "dry-run" | "force" | "actor" | "reason" | "json" => {
                None
            }
            _ => Some(("consume", key)),
        },
        // A replay by time applies as `consume` does, from the same settings.
        Some("console") => match long {
            "listen" => Some(("console", key)),
            "effect" | "target-url" | "reconcile-url" | "max-attempts" | "effect-attempts"
            | "operation-key" => Some(("consume", key)),
            _ if long.starts_with("defer-") => Some(("consume", key)),
            _ => None,
        },
        Some(command @ ("consume" | "dispatch" | "ingest")) => {
            let section = SECTIONS.iter().find(|s| **s == command)?;
            Some((section, key))
        }
        _ => None,
    }
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
    let console = crate::console::FILE_KEYS.iter().map(|k| ("console", *k));
    for (section, table) in [
        ("ingest", "sources"),
        ("dispatch", "destinations"),
        ("dispatch", "credentials"),
    ]
    .into_iter()
    .chain(console)
    {
        known
            .entry((section, table.into()))
            .or_default()
            .push(section.into());
    }
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
