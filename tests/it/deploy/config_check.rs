//! `replayproof config check` connects as the commands would, and reports every problem: a
//! database on a closed port, migrations not applied, a topic that is not there, a broker that
//! does not answer, a secret variable that is not set. `--no-connect` keeps the static check.

use crate::harness::*;
use std::process::Output;

/// `config check` of `file` (with `more` arguments), in an environment without the test's own
/// database or configuration variables.
fn check(file: &std::path::Path, more: &[&str]) -> (bool, String) {
    let out: Output = replayproof()
        .args(["config", "check", "--config"])
        .arg(file)
        .args(more)
        .env_remove("REPLAYPROOF_BROKERS")
        .env("CHECK_SET_SECRET", "a-secret-that-is-set")
        .output()
        .unwrap();
    (out.status.success(), printed(&out))
}

fn file_with(text: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("replayproof.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

const SOURCES: &str = r#"
[[ingest.sources]]
name = "github"
kind = "github"
secrets_env = ["CHECK_SET_SECRET"]
"#;

fn has_line(text: &str, starts: &str, contains: &str) {
    assert!(
        text.lines()
            .any(|l| l.starts_with(starts) && l.contains(contains)),
        "no line starting {starts:?} with {contains:?} in:\n{text}"
    );
}

#[test]
fn closed_ports_are_problems_of_every_command_that_needs_them_and_no_connect_skips_them() {
    let ((_db, db), (_broker, broker)) = (refusing_address(), refusing_address());
    let (db_port, broker_port) = (db.port(), broker.port());
    let (_dir, file) = file_with(&format!(
        "[kafka]\nbrokers = \"127.0.0.1:{broker_port}\"\ngroup = \"g\"\n\
         \"broker.address.family\" = \"v4\"\n\
         [database]\nurl = \"postgres://app:pw@127.0.0.1:{db_port}/app\"\n{SOURCES}"
    ));
    let (ok, text) = check(&file, &[]);
    assert!(!ok, "{text}");
    has_line(
        &text,
        &format!("database postgres://app:redacted@127.0.0.1:{db_port}/app (migrate, consume, dispatch, status): problem"),
        "refused",
    );
    has_line(
        &text,
        &format!("kafka 127.0.0.1:{broker_port} topic webhooks (consume, ingest): problem"),
        "no answer",
    );
    // Both problems reported, not only the first, and the password nowhere.
    assert!(!text.contains(":pw@"), "{text}");
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(ok, "{text}");
    for command in ["migrate", "consume", "dispatch", "ingest"] {
        has_line(&text, &format!("{command}: ready"), "");
    }
    assert!(!text.contains("# Connections"), "{text}");
}

#[test]
fn ingest_with_a_secret_variable_unset_is_not_ready() {
    let (_dir, file) = file_with(
        "[kafka]\nbrokers = \"127.0.0.1:1\"\n\
         [[ingest.sources]]\nname = \"github\"\nkind = \"github\"\n\
         secrets_env = [\"CHECK_UNSET_SECRET\"]\n",
    );
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(!ok, "{text}");
    has_line(&text, "ingest: problem", "CHECK_UNSET_SECRET");
    assert!(!text.contains("ingest: ready"), "{text}");
}

#[test]
fn the_kafka_effect_without_its_output_topic_and_a_relay_lease_too_short_are_problems() {
    let (_dir, file) = file_with(
        "[kafka]\nbrokers = \"127.0.0.1:1\"\ngroup = \"g\"\n\
         [database]\nurl = \"postgres://app@127.0.0.1:1/app\"\n\
         [consume]\neffect = \"ledger,kafka\"\n\
         [dispatch]\nrelay_lease = \"5s\"\nrelay_send_timeout = \"3s\"\n",
    );
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(!ok, "{text}");
    has_line(
        &text,
        "consume: problem",
        "--effect kafka needs --output-topic",
    );
    has_line(
        &text,
        "dispatch: problem",
        "must be longer than two send timeouts",
    );
    let (_dir, file) = file_with(&format!(
        "[kafka]\nbrokers = \"127.0.0.1:1\"\ngroup = \"g\"\n\
         [database]\nurl = \"postgres://app@127.0.0.1:1/app\"\n\
         [consume]\neffect = \"ledger,kafka\"\noutput_topic = \"clean\"\n{SOURCES}",
    ));
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(ok, "{text}");
    has_line(&text, "consume: ready", "");
    has_line(&text, "dispatch: ready", "");
}

/// An input's setting under another input is a problem, not silently ignored: a route attribute
/// under `envelope` would route nothing. `consume` refuses it at start with the same reason.
#[test]
fn an_inputs_setting_under_another_input_is_a_problem_and_consume_refuses_it() {
    let base = "[kafka]\nbrokers = \"127.0.0.1:1\"\ngroup = \"g\"\n\
                [database]\nurl = \"postgres://app@127.0.0.1:1/app\"\n";
    let (_dir, file) = file_with(&format!(
        "{base}[consume]\ninput = \"envelope\"\nroute_attribute = \"partitionkey\"\n"
    ));
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(!ok, "{text}");
    has_line(
        &text,
        "consume: problem",
        "route_attribute is read only with input = \"cloudevents\"",
    );
    let out = replayproof()
        .args(["consume", "--config"])
        .arg(&file)
        .env_remove("REPLAYPROOF_BROKERS")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", printed(&out));
    assert!(
        printed(&out).contains("route_attribute is read only"),
        "{}",
        printed(&out)
    );
    let (_dir, file) = file_with(&format!(
        "{base}[consume]\ninput = \"cloudevents\"\nroute_attribute = \"partitionkey\"\n{SOURCES}"
    ));
    let (ok, text) = check(&file, &["--no-connect"]);
    assert!(ok, "{text}");
    has_line(&text, "consume: ready", "");
}

/// A switch set in the file (`kafka_transactions = true`, `migrate = true`) is read as the flag,
/// by `config check`, by the command itself and by its `--help`.
#[test]
fn switches_set_in_the_file_are_read_and_shown() {
    let (_dir, file) = file_with(
        "[kafka]\nbrokers = \"127.0.0.1:1\"\ngroup = \"g\"\n\
         [database]\nurl = \"postgres://app@127.0.0.1:1/app\"\n\
         [consume]\nmigrate = true\n\
         [dispatch]\nkafka_transactions = true\n",
    );
    let (_, text) = check(&file, &["--no-connect"]);
    has_line(&text, "kafka_transactions = true", "# file");
    has_line(&text, "migrate = true", "# file");
    has_line(&text, "dispatch: ready", "");
    let help = replayproof()
        .args(["--config"])
        .arg(&file)
        .args(["dispatch", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success(), "{}", printed(&help));
    assert!(printed(&help).contains("--kafka-transactions"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unapplied_migrations_and_a_missing_topic_are_problems_until_they_are_fixed() {
    let kafka = TestKafka::for_processes();
    let db = TestDb::unmigrated().await;
    let topic = unique("webhooks");
    let write = |topic: &str| {
        file_with(&format!(
            "[kafka]\nbrokers = \"{}\"\ntopic = \"{topic}\"\ngroup = \"g\"\n\
             \"broker.address.family\" = \"v4\"\n\
             [database]\nurl = \"{}\"\n{SOURCES}",
            kafka.brokers(),
            db.url
        ))
    };
    let (dir, file) = write(&topic);
    let (ok, text) = tokio::task::spawn_blocking(move || check(&file, &[]))
        .await
        .unwrap();
    assert!(!ok, "{text}");
    has_line(&text, "database ", "migrations are not applied");
    has_line(&text, "kafka ", "the topic is not there");

    let migrated = replayproof()
        .args(["migrate", "--config"])
        .arg(dir.path().join("replayproof.toml"))
        .output()
        .unwrap();
    assert!(migrated.status.success(), "{migrated:?}");
    let created = kafka.topic(3).await;
    let (_dir, file) = write(&created);
    let (ok, text) = tokio::task::spawn_blocking(move || check(&file, &[]))
        .await
        .unwrap();
    assert!(ok, "{text}");
    has_line(&text, "database ", "migrations are applied");
    has_line(&text, "kafka ", "the topic has 3 partitions");
    for command in ["migrate", "consume", "dispatch", "ingest"] {
        has_line(&text, &format!("{command}: ready"), "");
    }
}
