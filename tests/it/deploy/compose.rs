//! The deployment files: the compose file against the Compose specification's JSON schema
//! (tests/fixtures/compose-spec.json), and everything they configure against the code.

use crate::harness::stdout_of;
use std::collections::BTreeSet;
use std::process::Command;

/// Validates a YAML file against the compose schema with Python's jsonschema and PyYAML
/// (scripts/test.sh installs them); returns the validation errors.
fn schema_errors(yaml: &str) -> Vec<String> {
    let script = r#"
import json, sys, yaml, jsonschema
schema = json.load(open("tests/fixtures/compose-spec.json"))
doc = yaml.safe_load(sys.stdin.read())
for e in jsonschema.Draft201909Validator(schema).iter_errors(doc):
    print(list(e.path), e.message)
"#;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(yaml.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the validator did not run (pip install jsonschema pyyaml): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

fn compose_text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docker-compose.yml")).unwrap()
}

#[test]
fn compose_file_follows_the_compose_specification() {
    assert_eq!(schema_errors(&compose_text()), Vec::<String>::new());
    // The validator does catch mistakes.
    let broken = compose_text().replace(
        "    image: postgres:16",
        "    image: postgres:16\n    restrat: always",
    );
    assert!(!schema_errors(&broken).is_empty());
    let broken = compose_text().replace("condition: service_healthy", "condition: when_ready");
    assert!(!schema_errors(&broken).is_empty());
}

/// The services that run replayproof, with their command and environment, read with the same
/// YAML parser (anchors and merge keys resolved) through Python.
fn replayproof_services() -> Vec<(String, Vec<String>, Vec<String>)> {
    let script = r#"
import json, sys, yaml
doc = yaml.safe_load(open("docker-compose.yml"))
out = []
for name, s in doc["services"].items():
    if s.get("image") == "replayproof:latest":
        out.append([name, s.get("command", []), sorted(s.get("environment", {}).keys())])
print(json.dumps(out))
"#;
    python_json(script)
}

#[test]
fn every_setting_a_service_gets_is_one_its_command_reads() {
    let services = replayproof_services();
    let names: BTreeSet<&str> = services.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(
        names,
        BTreeSet::from(["consume", "dispatch", "ingest", "migrate"])
    );
    for (name, command, env) in &services {
        let help = Command::new(env!("CARGO_BIN_EXE_replayproof"))
            .args(command)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            help.status.success(),
            "{name}: {command:?} is not a command"
        );
        let help = String::from_utf8_lossy(&help.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        for var in env
            .iter()
            .filter(|v| v.starts_with("REPLAYPROOF_") || *v == "DATABASE_URL")
        {
            assert!(
                help.contains(&format!("env: {var}")),
                "{name} sets {var}, which `{}` does not read",
                command.join(" ")
            );
        }
    }
}

#[test]
fn ingest_gets_every_secret_its_sources_file_names() {
    let services = replayproof_services();
    let (_, _, env) = services.iter().find(|(n, _, _)| n == "ingest").unwrap();
    let file = replayproof::ingest::config::FileConfig::load(std::path::Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/replayproof.example.toml"
    )))
    .unwrap();
    let sources = file
        .sources_with(|var| {
            env.contains(&var.to_owned())
                .then(|| "whsec_c2VjcmV0LW9mLWF0LWxlYXN0LTE2LWJ5dGVz".to_owned())
        })
        .unwrap();
    assert_eq!(sources.len(), 6);
}

/// Runs a Python script (PyYAML at hand) in the crate's folder and parses what it prints.
fn python_json<T: serde::de::DeserializeOwned>(script: &str) -> T {
    let stdout = stdout_of(
        Command::new("python3")
            .args(["-c", script])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    serde_json::from_slice(&stdout).unwrap()
}

/// The ingest service's environment as written, before interpolation.
fn ingest_environment() -> Vec<(String, String)> {
    let script = r#"
import json, yaml
doc = yaml.safe_load(open("docker-compose.yml"))
env = doc["services"]["ingest"]["environment"]
print(json.dumps(sorted([k, str(v)] for k, v in env.items())))
"#;
    python_json(script)
}

#[test]
fn every_role_exports_traces_where_the_environment_says_and_jaeger_is_a_profile() {
    let script = r#"
import json, yaml
doc = yaml.safe_load(open("docker-compose.yml"))
out = {}
for name, s in doc["services"].items():
    env = s.get("environment", {})
    out[name] = [str(env.get("OTEL_EXPORTER_OTLP_ENDPOINT")), s.get("profiles", [])]
print(json.dumps(out))
"#;
    let services: std::collections::BTreeMap<String, (String, Vec<String>)> = python_json(script);
    for role in ["ingest", "consume", "dispatch"] {
        // Passed through, empty when unset: nothing is exported then.
        assert_eq!(
            services[role].0, "${OTEL_EXPORTER_OTLP_ENDPOINT:-}",
            "{role}"
        );
    }
    assert_eq!(services["jaeger"].1, ["tracing"]);
    let header = compose_text();
    assert!(header.contains("OTEL_EXPORTER_OTLP_ENDPOINT=http://jaeger:4318"));
    assert!(header.contains("docker compose --profile tracing up"));
}

#[test]
fn compose_refuses_to_start_without_real_secrets() {
    let secrets: Vec<(String, String)> = ingest_environment()
        .into_iter()
        .filter(|(k, _)| k.contains("SECRET"))
        .collect();
    assert_eq!(secrets.len(), 6, "{secrets:?}");
    for (name, value) in secrets {
        // `${VAR:?message}`: Compose stops with the message when VAR is unset or empty.
        let required = format!("${{{name}:?");
        assert!(
            value.starts_with(&required)
                && value.ends_with('}')
                && value.len() > required.len() + 1,
            "{name} must be required with a message, not defaulted: {value}"
        );
        assert!(value.contains(&name), "the message names {name}: {value}");
    }
}

#[test]
fn dashboard_and_scrape_config_name_real_metrics() {
    let registry = prometheus::Registry::new();
    let consume = replayproof::consume::ConsumeMetrics::new(&registry).unwrap();
    replayproof::ingest::IngestMetrics::new(&registry).unwrap();
    let dispatch = replayproof::dispatch::DispatchMetrics::new(&registry).unwrap();
    // Vectors appear in a gather only once they have a sample.
    consume
        .events
        .with_label_values(&["github", "applied"])
        .inc();
    consume
        .committed_offset
        .with_label_values(&["webhooks", "0"])
        .set(1);
    consume
        .consumer_lag
        .with_label_values(&["webhooks", "0"])
        .set(1);
    consume
        .deferred
        .attempts
        .with_label_values(&["applied"])
        .inc();
    dispatch.attempts.with_label_values(&["done"]).inc();
    dispatch.operations.with_label_values(&["done"]).set(1);
    dispatch.destinations(&Default::default());
    let ingest_requests = registry.gather();
    let mut known: BTreeSet<String> = ingest_requests
        .iter()
        .map(|f| f.name().to_owned())
        .collect();
    known.insert("replayproof_ingest_requests_total".into());
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/grafana/dashboards/replayproof.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let exprs: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap())
        .map(|t| t["expr"].as_str().unwrap())
        .collect();
    assert!(exprs.len() >= 10);
    for expr in exprs {
        let metric = expr
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .find(|w| w.starts_with("replayproof_"))
            .unwrap_or_else(|| panic!("no replayproof metric in {expr}"));
        let base = metric.trim_end_matches("_bucket");
        assert!(
            known.contains(base),
            "the dashboard uses {metric}, which nothing exports"
        );
    }
}

#[test]
fn the_image_ships_a_stripped_binary_with_oci_labels_of_this_version() {
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    let cook = dockerfile.find("cargo chef cook").unwrap();
    let strip = dockerfile
        .find("CARGO_PROFILE_RELEASE_STRIP=symbols")
        .expect("the release build is stripped");
    assert!(
        strip < cook,
        "the dependencies are built with the same profile"
    );
    let version = format!("ARG VERSION={}", env!("CARGO_PKG_VERSION"));
    assert!(dockerfile.contains(&version), "{version}");
    for label in ["title", "description", "version", "revision", "licenses"] {
        let label = format!("org.opencontainers.image.{label}=");
        assert!(dockerfile.contains(&label), "{label}");
    }
}
