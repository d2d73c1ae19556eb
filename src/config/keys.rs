//! Which flag each of the file's keys sets: every flag of every command a section sets, as the
//! command line declares them ([`FileKeys`]), and the refusal of a key that none reads.

use super::{ConfigFile, SECTIONS};
use anyhow::bail;
use clap::{Arg, Command};
use std::collections::BTreeMap;

/// `[kafka]` keys that are replayproof's own flags; every other key is a librdkafka property.
pub(crate) const KAFKA_FLAGS: &[&str] = &["brokers", "topic", "group"];
/// The section of the file a flag is read from, and its key there.
pub type FileKey = (&'static str, String);

/// What the file may hold for one command line, as the command line declares it (the `cli`
/// module, which knows every command): the section and key each command's flag is read from,
/// and the keys no flag reads, tables their owners read themselves (`[ingest] sources`).
pub struct FileKeys {
    /// The section and key the flag `--long` of the command at `command_path` is read from;
    /// None for a flag no section sets.
    pub section_of: fn(command_path: &[String], long: &str) -> Option<FileKey>,
    /// Keys no flag reads, as (section, key), each declared by the module that reads it.
    pub tables: Vec<(&'static str, &'static str)>,
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
pub(crate) fn file_flags<'a>(root: &'a Command, keys: &FileKeys) -> Vec<FileFlag<'a>> {
    let mut flags = Vec::new();
    let mut stack: Vec<(Vec<String>, &Command)> = vec![(Vec::new(), root)];
    while let Some((path, cmd)) = stack.pop() {
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if let Some((section, key)) = (keys.section_of)(&path, long) {
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
fn known_keys(root: &Command, keys: &FileKeys) -> BTreeMap<(&'static str, String), Vec<String>> {
    let mut known: BTreeMap<(&'static str, String), Vec<String>> = BTreeMap::new();
    for FileFlag {
        path, section, key, ..
    } in file_flags(root, keys)
    {
        known
            .entry((section, key))
            .or_default()
            .push(path.join(" "));
    }
    for (section, table) in &keys.tables {
        known
            .entry((section, (*table).into()))
            .or_default()
            .push((*section).into());
    }
    known
}

/// Refuses a key that no command reads, so a typo is found at once.
pub(crate) fn check_keys(root: &Command, keys: &FileKeys, file: &ConfigFile) -> anyhow::Result<()> {
    let known = known_keys(root, keys);
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
