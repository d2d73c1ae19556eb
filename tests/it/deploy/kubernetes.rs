//! The manifests of `deploy/kubernetes/` are checked against the code that runs in them: each
//! role's arguments and configuration file parse as the binary parses them, its grace period
//! covers its worst-case stop, its probes are the ones it serves, and the PrometheusRule is
//! `deploy/alerts.yml`. (The test script validates them against the Kubernetes schemas with
//! kubernetes-validate and a security linter, checkov.)

use crate::harness::*;
use replayproof::cli::Command as Role;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Duration;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");

/// Every document of every manifest, as JSON, by file.
fn manifests() -> BTreeMap<String, Vec<Value>> {
    let script = r#"
import json, pathlib, sys, yaml
docs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.yaml")):
    docs[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
print(json.dumps(docs))
"#;
    let stdout = stdout_of(Command::new("python3").args(["-c", script, DIR]));
    serde_json::from_slice(&stdout).unwrap()
}

fn yaml_file_as_json(path: &str) -> Value {
    let script = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))";
    let stdout = stdout_of(Command::new("python3").args(["-c", script, path]));
    serde_json::from_slice(&stdout).unwrap()
}

/// The workloads (Deployment, StatefulSet, Job) by component.
fn workloads(all: &BTreeMap<String, Vec<Value>>) -> BTreeMap<String, Value> {
    all.values()
        .flatten()
        .filter(|d| ["Deployment", "StatefulSet", "Job"].contains(&d["kind"].as_str().unwrap()))
        .map(|d| {
            let component = d["metadata"]["labels"]["app.kubernetes.io/component"]
                .as_str()
                .unwrap()
                .to_owned();
            (component, d.clone())
        })
        .collect()
}

/// The command line the container runs, read over the ConfigMap's file and an environment
/// with the Secret's variables, as the binary reads it.
fn parsed(container: &Value) -> replayproof::cli::Args {
    let mut argv: Vec<std::ffi::OsString> = vec!["replayproof".into()];
    argv.extend(["--config".into(), format!("{DIR}/replayproof.toml").into()]);
    for arg in container["args"].as_array().unwrap() {
        argv.push(arg.as_str().unwrap().into());
    }
    let env: BTreeMap<String, String> = [
        ("KAFKA_BROKERS", "kafka-0.kafka:9092"),
        ("DATABASE_URL", "postgres://replayproof@db:5432/replayproof"),
        ("GITHUB_WEBHOOK_SECRET", "a-secret"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    replayproof::cli::parse(argv, &env)
        .unwrap_or_else(|e| panic!("{argv_text}: {e}", argv_text = container["args"]))
}

#[test]
fn every_file_is_applied_by_the_kustomization() {
    let kustomization = yaml_file_as_json(&format!("{DIR}/kustomization.yaml"));
    let listed: BTreeSet<&str> = kustomization["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    let all = manifests();
    let files: BTreeSet<&str> = all
        .keys()
        .map(String::as_str)
        .filter(|f| *f != "kustomization.yaml")
        .collect();
    assert_eq!(listed, files);
    let generated = &kustomization["configMapGenerator"][0];
    assert_eq!(generated["name"], "replayproof-config");
    assert_eq!(generated["files"][0], "replayproof.toml");
    let tracing = &kustomization["configMapGenerator"][1];
    assert_eq!(tracing["name"], "replayproof-tracing");
    assert_eq!(tracing["envs"][0], "tracing.env");
}

/// `tracing.env`'s variables, `(name, value, commented out)`.
fn tracing_env() -> Vec<(String, String, bool)> {
    std::fs::read_to_string(format!("{DIR}/tracing.env"))
        .unwrap()
        .lines()
        .filter_map(|line| {
            let (commented, line) = match line.strip_prefix('#') {
                Some(rest) => (true, rest.trim()),
                None => (false, line.trim()),
            };
            let (name, value) = line.split_once('=')?;
            let name_like = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            name_like.then(|| (name.to_owned(), value.to_owned(), commented))
        })
        .collect()
}

#[test]
fn the_roles_that_make_spans_take_the_tracing_variables_and_export_nothing_until_they_are_set() {
    let roles = workloads(&manifests());
    for component in ["ingest", "consume", "dispatch"] {
        let container = &roles[component]["spec"]["template"]["spec"]["containers"][0];
        let maps: Vec<&str> = container["envFrom"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|from| from["configMapRef"]["name"].as_str())
            .collect();
        assert_eq!(maps, ["replayproof-tracing"], "{component}");
    }
    let vars = tracing_env();
    let active: Vec<_> = vars.iter().filter(|(_, _, commented)| !commented).collect();
    assert_eq!(
        active,
        Vec::<&(String, String, bool)>::new(),
        "nothing is exported by default"
    );
    // Each example names a variable the exporter reads, and set they export.
    let known = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        replayproof::telemetry::TRACES_FILTER_VAR,
    ];
    for (name, _, _) in &vars {
        assert!(known.contains(&name.as_str()), "{name} is read by nothing");
    }
    let examples: BTreeMap<&str, &str> = vars
        .iter()
        .map(|(name, value, _)| (name.as_str(), value.as_str()))
        .collect();
    assert!(replayproof::trace::otel::configured(&|name| examples
        .get(name)
        .map(|v| v.to_string())));
    let filter = examples[replayproof::telemetry::TRACES_FILTER_VAR];
    tracing_subscriber::EnvFilter::try_new(filter).unwrap();
}

#[test]
fn each_role_parses_fits_its_grace_period_and_is_probed_where_it_serves() {
    let all = manifests();
    let roles = workloads(&all);
    assert_eq!(
        roles.keys().map(String::as_str).collect::<Vec<_>>(),
        ["consume", "dispatch", "ingest", "migrate"]
    );
    for (component, workload) in &roles {
        let pod = &workload["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let args = parsed(container);
        let worst: Option<Duration> = match args.command {
            Role::Ingest(ingest) => Some(ingest.settings().unwrap().worst_case_stop()),
            Role::Consume(consume) => Some(consume.settings().worst_case_stop()),
            Role::Dispatch(dispatch) => Some(dispatch.settings(None).unwrap().worst_case_stop()),
            Role::Migrate(_) => None,
            other => panic!("{component} runs {other:?}"),
        };
        // Non-root, read-only, nothing to escalate, no token.
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{component}");
        assert_eq!(pod["automountServiceAccountToken"], false, "{component}");
        let security = &container["securityContext"];
        assert_eq!(security["readOnlyRootFilesystem"], true, "{component}");
        assert_eq!(security["allowPrivilegeEscalation"], false, "{component}");
        assert!(
            container["resources"]["limits"]["memory"].is_string(),
            "{component}"
        );
        let Some(worst) = worst else { continue };
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            worst < Duration::from_secs(grace),
            "{component}: a stop may take {worst:?}, the grace period is {grace} s"
        );
        // The probes are the ones it serves, on a port it declares.
        let ports: Vec<u64> = container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["containerPort"].as_u64().unwrap())
            .collect();
        for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
            let get = &container[probe]["httpGet"];
            assert_eq!(get["path"], path, "{component} {probe}");
            assert!(
                ports.contains(&get["port"].as_u64().unwrap()),
                "{component} {probe}"
            );
        }
    }
}

#[test]
fn the_consumers_are_a_statefulset_whose_pod_names_are_their_group_instance_ids() {
    let all = manifests();
    let consume = &workloads(&all)["consume"];
    assert_eq!(consume["kind"], "StatefulSet");
    let env = consume["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap();
    let instance = env
        .iter()
        .find(|e| e["name"] == "REPLAYPROOF_GROUP_INSTANCE_ID")
        .expect("static membership");
    assert_eq!(
        instance["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    let budget = all["consume.yaml"]
        .iter()
        .find(|d| d["kind"] == "PodDisruptionBudget")
        .expect("a disruption budget");
    assert_eq!(budget["spec"]["maxUnavailable"], 1);
}

#[test]
fn the_prometheus_rule_is_the_alerts_file() {
    let alerts = yaml_file_as_json(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/alerts.yml"));
    let all = manifests();
    let rule = &all["prometheusrule.yaml"][0];
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(
        rule["spec"]["groups"], alerts["groups"],
        "run `python3 scripts/kubernetes-rules.py` after changing deploy/alerts.yml"
    );
}
