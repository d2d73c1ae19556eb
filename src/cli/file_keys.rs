//! Which of the configuration file's keys each command reads: the section and key of each
//! flag, and the tables that the modules reading them declare. The configuration's parse
//! ([`crate::config::layered`]) takes them from here, so it names no command itself.

use crate::config::{FileKey, FileKeys};

/// The file's keys for replayproof's command line.
pub(crate) fn file_keys() -> FileKeys {
    let console = crate::console::FILE_KEYS.iter().map(|k| ("console", *k));
    FileKeys {
        section_of,
        tables: crate::ingest::config::FILE_TABLES
            .iter()
            .chain(crate::dispatch::args::FILE_TABLES)
            .copied()
            .chain(console)
            .collect(),
    }
}

/// Flags no section sets: the file itself, and what is a property list rather than a setting.
const NEVER_FROM_FILE: &[&str] = &["config", "kafka-option", "help", "version", "log-format"];

/// Which section a flag of a command is read from, with its key there.
fn section_of(command_path: &[String], long: &str) -> Option<FileKey> {
    let key = long.replace('-', "_");
    if NEVER_FROM_FILE.contains(&long) {
        return None;
    }
    if long.ends_with("-retention") || matches!(long, "allow-below-floor" | "prune-batch") {
        return Some(("retention", key));
    }
    match long {
        "database-url" => return Some(("database", "url".into())),
        "direct-database-url" => return Some(("database", "direct_url".into())),
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
        | "pooler"
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
            "listen" | "metrics-addr" => Some(("console", key)),
            "effect" | "target-url" | "reconcile-url" | "max-attempts" | "effect-attempts"
            | "operation-key" | "output-topic" | "input" | "source-name" | "route-attribute"
            | "outbox-type-header" => Some(("consume", key)),
            _ if long.starts_with("defer-") => Some(("consume", key)),
            _ => None,
        },
        Some(command @ ("consume" | "dispatch" | "ingest")) => {
            let section = crate::config::SECTIONS.iter().find(|s| **s == command)?;
            Some((section, key))
        }
        _ => None,
    }
}
