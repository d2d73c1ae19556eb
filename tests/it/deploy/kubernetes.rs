//! The manifests of `deploy/kubernetes/` (the base and its components) are checked against the
//! code that runs in them: each role's arguments and configuration file parse as the binary
//! parses them, its grace period covers its worst-case stop, its probes are the ones it serves,
//! its memory limit covers what the shipped configuration lets it buffer, the migrations run
//! before each role that uses the database, and the PrometheusRule is `deploy/alerts.yml`.
//! (`kustomize.rs` renders them; the test script validates the renderings against the
//! Kubernetes schemas with kubernetes-validate and a security linter, checkov.)

use crate::harness::*;
use replayproof::cli::Command as Role;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");
/// The base: what `kubectl apply -k deploy/kubernetes` applies.
const BASE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes/base");
/// The image every replayproof container names, which `images:` rewrites.
const IMAGE: &str = "ghcr.io/replayproof/replayproof";

/// Every document of every manifest of the base and the components, as JSON, by path under
/// `deploy/kubernetes` (`base/consume.yaml`, `components/console/console.yaml`).
fn manifests() -> BTreeMap<String, Vec<Value>> {
    let script = r#"
import json, pathlib, sys
import yaml
root = pathlib.Path(sys.argv[1])
docs = {}
for path in sorted([*root.glob("base/*.yaml"), *root.glob("components/*/*.yaml")]):
    if path.name != "kustomization.yaml":
        docs[str(path.relative_to(root))] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
print(json.dumps(docs))
"#;
    let stdout = stdout_of(Command::new("python3").args(["-c", script, ROOT]));
    serde_json::from_slice(&stdout).unwrap()
}

fn yaml_file_as_json(path: &str) -> Value {
    let script = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))";
    let stdout = stdout_of(Command::new("python3").args(["-c", script, path]));
    serde_json::from_slice(&stdout).unwrap()
}

/// The workloads (Deployment, StatefulSet) by component.
fn workloads(all: &BTreeMap<String, Vec<Value>>) -> BTreeMap<String, Value> {
    all.values()
        .flatten()
        .filter(|d| ["Deployment", "StatefulSet"].contains(&d["kind"].as_str().unwrap()))
        .map(|d| {
            let component = d["metadata"]["labels"]["app.kubernetes.io/component"]
                .as_str()
                .unwrap()
                .to_owned();
            (component, d.clone())
        })
        .collect()
}

/// The container of a pod named `name`, among its containers or its init containers.
fn container<'v>(pod: &'v Value, list: &str, name: &str) -> &'v Value {
    pod[list]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {list} named {name}"))
}

/// An environment with the Secrets' variables, as the pods get them.
fn secret_env() -> BTreeMap<String, String> {
    [
        ("KAFKA_BROKERS", "kafka-0.kafka:9092"),
        ("DATABASE_URL", "postgres://replayproof@db:5432/replayproof"),
        ("GITHUB_WEBHOOK_SECRET", "a-secret"),
        (
            "CONSOLE_SESSION_KEY",
            "0123456789abcdef0123456789abcdef0123",
        ),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// The command line the container runs, read over the configuration file `config` and an
/// environment with the Secrets' variables, as the binary reads it.
fn parsed(container: &Value, config: &Path) -> replayproof::cli::Args {
    let mut argv: Vec<std::ffi::OsString> = vec!["replayproof".into()];
    argv.extend(["--config".into(), config.as_os_str().to_owned()]);
    for arg in container["args"].as_array().unwrap() {
        argv.push(arg.as_str().unwrap().into());
    }
    replayproof::cli::parse(argv, &secret_env())
        .unwrap_or_else(|e| panic!("{argv_text}: {e}", argv_text = container["args"]))
}

/// Where each ConfigMap the manifests mount comes from, in the repository.
fn config_map_dir(name: &str) -> PathBuf {
    match name {
        "replayproof-config" | "replayproof-tracing" => PathBuf::from(BASE),
        "replayproof-console" => PathBuf::from(format!("{ROOT}/components/console")),
        other => panic!("a ConfigMap {other} that no kustomization generates"),
    }
}

/// The configuration file a container reads (`REPLAYPROOF_CONFIG`), made as its pod makes it:
/// the pod's volumes are the repository's files (ConfigMaps) or a scratch directory
/// (emptyDir), and the pod's init containers that run a command run it over them, with each
/// mount path standing for its volume's directory.
fn config_file(workload: &Value, container: &Value, scratch: &Path) -> PathBuf {
    let pod = &workload["spec"]["template"]["spec"];
    let volumes: BTreeMap<&str, PathBuf> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let dir = match v["configMap"]["name"].as_str() {
                Some(map) => config_map_dir(map),
                None => scratch.join(v["name"].as_str().unwrap()),
            };
            std::fs::create_dir_all(&dir).unwrap();
            (v["name"].as_str().unwrap(), dir)
        })
        .collect();
    let local = |c: &Value, text: &str| -> String {
        let mut mounts: Vec<(&str, &PathBuf)> = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|m| {
                let dir = &volumes[m["name"].as_str().unwrap()];
                (m["mountPath"].as_str().unwrap(), dir)
            })
            .collect();
        // The longest first: /etc/replayproof-console before /etc/replayproof.
        mounts.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
        let mut text = text.to_owned();
        for (path, dir) in mounts {
            text = text.replace(path, dir.to_str().unwrap());
        }
        text
    };
    for init in pod["initContainers"].as_array().into_iter().flatten() {
        let Some(command) = init["command"].as_array() else {
            continue;
        };
        let command: Vec<String> = command
            .iter()
            .map(|a| local(init, a.as_str().unwrap()))
            .collect();
        let status = Command::new(&command[0])
            .args(&command[1..])
            .status()
            .unwrap();
        assert!(status.success(), "{command:?}");
    }
    let env = container["env"].as_array().unwrap();
    let config = env
        .iter()
        .find(|e| e["name"] == "REPLAYPROOF_CONFIG")
        .expect("REPLAYPROOF_CONFIG");
    PathBuf::from(local(container, config["value"].as_str().unwrap()))
}

#[test]
fn every_file_is_applied_by_its_kustomization() {
    let all = manifests();
    let mut dirs: Vec<String> = vec!["base".into()];
    for entry in std::fs::read_dir(format!("{ROOT}/components")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        dirs.push(format!("components/{name}"));
    }
    for dir in &dirs {
        let kustomization = yaml_file_as_json(&format!("{ROOT}/{dir}/kustomization.yaml"));
        let listed: BTreeSet<String> = kustomization["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| format!("{dir}/{}", r.as_str().unwrap()))
            .collect();
        let files: BTreeSet<String> = all
            .keys()
            .filter(|f| Path::new(f).parent() == Some(Path::new(dir)))
            .cloned()
            .collect();
        assert_eq!(listed, files, "{dir}");
    }
    let base = yaml_file_as_json(&format!("{BASE}/kustomization.yaml"));
    let generated = &base["configMapGenerator"][0];
    assert_eq!(generated["name"], "replayproof-config");
    assert_eq!(generated["files"][0], "replayproof.toml");
    let tracing = &base["configMapGenerator"][1];
    assert_eq!(tracing["name"], "replayproof-tracing");
    assert_eq!(tracing["envs"][0], "tracing.env");
    // `kubectl apply -k deploy/kubernetes` applies the base.
    let top = yaml_file_as_json(&format!("{ROOT}/kustomization.yaml"));
    assert_eq!(top["resources"], serde_json::json!(["base"]));
}

/// `tracing.env`'s variables, `(name, value, commented out)`.
fn tracing_env() -> Vec<(String, String, bool)> {
    std::fs::read_to_string(format!("{BASE}/tracing.env"))
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
        let pod = &roles[component]["spec"]["template"]["spec"];
        let container = container(pod, "containers", component);
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

/// Non-root, read-only, nothing to escalate, a memory limit: every container, init or not.
fn assert_locked_down(component: &str, pod: &Value) {
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{component}");
    assert_eq!(pod["securityContext"]["runAsUser"], 10001, "{component}");
    assert_eq!(pod["automountServiceAccountToken"], false, "{component}");
    let init = pod["initContainers"].as_array().into_iter().flatten();
    for container in pod["containers"].as_array().unwrap().iter().chain(init) {
        let name = &container["name"];
        let security = &container["securityContext"];
        assert_eq!(
            security["readOnlyRootFilesystem"], true,
            "{component} {name}"
        );
        assert_eq!(
            security["allowPrivilegeEscalation"], false,
            "{component} {name}"
        );
        assert_eq!(
            security["capabilities"]["drop"],
            serde_json::json!(["ALL"]),
            "{component} {name}"
        );
        assert!(
            container["resources"]["limits"]["memory"].is_string(),
            "{component} {name}"
        );
    }
}

/// The probes are `paths` (liveness, readiness), on a port the container declares.
fn assert_probed(component: &str, container: &Value, paths: [&str; 2]) {
    let ports: Vec<u64> = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    for (probe, path) in ["livenessProbe", "readinessProbe"].into_iter().zip(paths) {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{component} {probe}");
        assert!(
            ports.contains(&get["port"].as_u64().unwrap()),
            "{component} {probe}"
        );
    }
}

/// The port the role's configuration has it serve `name` on is the container's port of that
/// name, and when it is the metrics port, the one `probes` ask, the one its Service names
/// `metrics`, and one its NetworkPolicy admits.
fn served_at(
    component: &str,
    all: &[Value],
    container: &Value,
    (port, name): (u16, &str),
    probes: &[&str],
) {
    let port = u64::from(port);
    let declared = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64());
    assert_eq!(declared, Some(port), "{component}: containerPort {name}");
    if name != "metrics" {
        return;
    }
    for probe in probes {
        let asked = container[probe]["httpGet"]["port"].as_u64();
        assert_eq!(asked, Some(port), "{component} {probe}");
    }
    let object = format!("replayproof-{component}");
    let of = |kind: &'static str| -> Vec<&Value> {
        all.iter()
            .filter(|o| o["kind"] == kind && o["metadata"]["name"] == object.as_str())
            .collect()
    };
    for service in of("Service") {
        let named = service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "metrics")
            .unwrap_or_else(|| panic!("{component}: a Service port named metrics"));
        assert_eq!(
            named["targetPort"],
            Value::from(name),
            "{component} Service"
        );
    }
    let admitted: Vec<u64> = of("NetworkPolicy")
        .into_iter()
        .flat_map(|policy| {
            policy["spec"]["ingress"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .flat_map(|rule| rule["ports"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p["port"].as_u64())
        .collect();
    assert!(
        admitted.contains(&port),
        "{component}: NetworkPolicy admits {admitted:?}"
    );
}

const BOTH_PROBES: [&str; 2] = ["livenessProbe", "readinessProbe"];

#[test]
fn each_role_parses_fits_its_grace_period_and_is_probed_where_it_serves() {
    let all = manifests();
    let flat: Vec<Value> = all.values().flatten().cloned().collect();
    let roles = workloads(&all);
    assert_eq!(
        roles.keys().map(String::as_str).collect::<Vec<_>>(),
        ["console", "consume", "dispatch", "ingest"]
    );
    let scratch = tempfile::tempdir().unwrap();
    for (component, workload) in &roles {
        let pod = &workload["spec"]["template"]["spec"];
        assert_locked_down(component, pod);
        let container = container(pod, "containers", component);
        let config = config_file(workload, container, &scratch.path().join(component));
        let worst: Option<Duration> = match parsed(container, &config).command {
            Role::Ingest(ingest) => {
                let settings = ingest.settings().unwrap();
                let metrics = settings.metrics_listen.expect("ingest's metrics address");
                // The ingress answers its probes where it takes webhooks.
                let listen = settings.listen.port();
                served_at(component, &flat, container, (listen, "http"), &[]);
                served_at(
                    component,
                    &flat,
                    container,
                    (metrics.port(), "metrics"),
                    &[],
                );
                for probe in BOTH_PROBES {
                    let asked = container[probe]["httpGet"]["port"].as_u64();
                    assert_eq!(asked, Some(u64::from(listen)), "{component} {probe}");
                }
                Some(settings.worst_case_stop())
            }
            Role::Consume(consume) => {
                let at = (consume.metrics_addr.port(), "metrics");
                served_at(component, &flat, container, at, &BOTH_PROBES);
                Some(consume.settings().worst_case_stop())
            }
            Role::Dispatch(dispatch) => {
                let at = (dispatch.metrics_addr.port(), "metrics");
                served_at(component, &flat, container, at, &BOTH_PROBES);
                Some(dispatch.settings(None).unwrap().worst_case_stop())
            }
            Role::Console(console) => {
                let env = secret_env();
                let file = replayproof::config::ConfigFile::load(&config, &env).unwrap();
                console.settings(Some(&file)).unwrap();
                // Alive when its metrics server answers (where REPLAYPROOF_METRICS_ADDR puts
                // it), ready when its login page does.
                assert_probed(component, container, ["/livez", "/login"]);
                let metrics = container["env"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|e| e["name"] == "REPLAYPROOF_METRICS_ADDR")
                    .and_then(|e| e["value"].as_str())
                    .expect("the console's REPLAYPROOF_METRICS_ADDR");
                let at: std::net::SocketAddr = metrics.parse().unwrap();
                let probes = ["livenessProbe"];
                served_at(component, &flat, container, (at.port(), "metrics"), &probes);
                let listen = console.listen.port();
                served_at(component, &flat, container, (listen, "console"), &[]);
                let ready = container["readinessProbe"]["httpGet"]["port"].as_u64();
                assert_eq!(ready, Some(u64::from(listen)), "{component} readinessProbe");
                None
            }
            other => panic!("{component} runs {other:?}"),
        };
        let Some(worst) = worst else { continue };
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            worst < Duration::from_secs(grace),
            "{component}: a stop may take {worst:?}, the grace period is {grace} s"
        );
        assert_probed(component, container, ["/livez", "/readyz"]);
    }
}

#[test]
fn every_role_that_uses_the_database_migrates_first_with_its_own_image_and_secret() {
    let all = manifests();
    assert!(
        all.values().flatten().all(|d| d["kind"] != "Job"),
        "a Job's pod template cannot change on the next apply"
    );
    let roles = workloads(&all);
    for component in ["consume", "dispatch", "console"] {
        let pod = &roles[component]["spec"]["template"]["spec"];
        let role = container(pod, "containers", component);
        let migrate = container(pod, "initContainers", "migrate");
        assert_eq!(migrate["image"], role["image"], "{component}");
        assert_eq!(migrate["imagePullPolicy"], role["imagePullPolicy"]);
        let secrets = |c: &Value| -> Vec<Value> {
            c["envFrom"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|from| from.get("secretRef").is_some())
                .cloned()
                .collect()
        };
        // The Secret's variables: DATABASE_URL, and DIRECT_DATABASE_URL behind a pooler.
        assert_eq!(secrets(migrate), secrets(role), "{component}");
        assert_eq!(
            secrets(migrate),
            [serde_json::json!({"secretRef": {"name": "replayproof"}})]
        );
        let scratch = tempfile::tempdir().unwrap();
        let config = config_file(&roles[component], migrate, scratch.path());
        // A pod of an older release (a rollback, a restart mid-update) starts over a database
        // a newer release migrated.
        match parsed(migrate, &config).command {
            Role::Migrate(args) => assert!(args.allow_newer, "{component}: migrate --allow-newer"),
            other => panic!("{component} runs {other:?} first"),
        }
    }
    // ingest never touches the database.
    let ingest = &roles["ingest"]["spec"]["template"]["spec"];
    assert!(ingest["initContainers"].is_null());
}

#[test]
fn the_consumers_are_a_statefulset_whose_pod_names_are_their_group_instance_ids() {
    let all = manifests();
    let consume = &workloads(&all)["consume"];
    assert_eq!(consume["kind"], "StatefulSet");
    let pod = &consume["spec"]["template"]["spec"];
    let env = container(pod, "containers", "consume")["env"]
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
    let budget = all["base/consume.yaml"]
        .iter()
        .find(|d| d["kind"] == "PodDisruptionBudget")
        .expect("a disruption budget");
    assert_eq!(budget["spec"]["maxUnavailable"], 1);
}

#[test]
fn every_workload_has_a_disruption_budget_that_lets_a_drain_evict_unready_pods() {
    let all = manifests();
    let budgets: BTreeMap<String, &Value> = all
        .values()
        .flatten()
        .filter(|d| d["kind"] == "PodDisruptionBudget")
        .map(|d| {
            let selected = &d["spec"]["selector"]["matchLabels"];
            let component = selected["app.kubernetes.io/component"].as_str().unwrap();
            (component.to_owned(), d)
        })
        .collect();
    let roles = workloads(&all);
    assert_eq!(
        budgets.keys().collect::<Vec<_>>(),
        roles.keys().collect::<Vec<_>>()
    );
    for (component, budget) in budgets {
        assert_eq!(
            budget["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow",
            "{component}: while PostgreSQL is down every pod is unready, and a drain must go on"
        );
        let template = &roles[&component]["spec"]["template"]["metadata"]["labels"];
        for (label, value) in budget["spec"]["selector"]["matchLabels"]
            .as_object()
            .unwrap()
        {
            assert_eq!(&template[label], value, "{component}");
        }
    }
}

#[test]
fn the_images_of_the_components_are_the_base_release() {
    let base = yaml_file_as_json(&format!("{BASE}/kustomization.yaml"));
    let pinned = &base["images"][0];
    assert_eq!(pinned["name"], IMAGE);
    let release = format!("{IMAGE}:{}", pinned["newTag"].as_str().unwrap());
    for (component, workload) in workloads(&manifests()) {
        let pod = &workload["spec"]["template"]["spec"];
        let init = pod["initContainers"].as_array().into_iter().flatten();
        for c in pod["containers"].as_array().unwrap().iter().chain(init) {
            let image = c["image"].as_str().unwrap();
            if image.starts_with(IMAGE) {
                assert_eq!(image, release, "{component} {}", c["name"]);
            }
        }
    }
}

#[test]
fn the_prometheus_rule_is_the_alerts_file() {
    let alerts = yaml_file_as_json(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/alerts.yml"));
    let all = manifests();
    let rule = &all["components/monitoring/prometheusrule.yaml"][0];
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(
        rule["spec"]["groups"], alerts["groups"],
        "run `python3 scripts/kubernetes-rules.py` after changing deploy/alerts.yml"
    );
    // kube-prometheus-stack's default selectors match its Helm release's name.
    let monitor = &all["components/monitoring/servicemonitor.yaml"][0];
    for object in [rule, monitor] {
        assert_eq!(
            object["metadata"]["labels"]["release"],
            "kube-prometheus-stack"
        );
    }
}

const MIB: u64 = 1 << 20;
/// A process before any work: its runtime, librdkafka's threads, TLS, its pools (ingest holds
/// about 30 MiB at rest, docs/ingest.md; a consumer 44 MiB, docs/performance.md).
const AT_REST: u64 = 64 * MIB;
/// hyper's buffers for one connection, at most (docs/ingest.md).
const CONNECTION_BUFFERS: u64 = 400 * 1024;
/// A batch is held twice: its messages, and the events parsed from them.
const BATCH_COPIES: u64 = 2;
/// How far above what its role can buffer a memory limit stays.
const HEADROOM: f64 = 1.25;

/// `512Mi`, `1Gi` in bytes.
fn quantity(text: &str) -> u64 {
    let units = [("Ki", 1 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)];
    for (suffix, unit) in units {
        if let Some(n) = text.strip_suffix(suffix) {
            return n.parse::<u64>().unwrap() * unit;
        }
    }
    text.parse().unwrap()
}

/// The role `args` (`["ingest"]`) as the shipped file configures it.
fn shipped(args: &[&str]) -> replayproof::cli::Args {
    let container = serde_json::json!({ "args": args });
    parsed(&container, &Path::new(BASE).join("replayproof.toml"))
}

/// The largest record a sender's body can become (the ingress's `message.max.bytes`).
fn record_bytes() -> u64 {
    let Role::Ingest(ingest) = shipped(&["ingest"]).command else {
        unreachable!()
    };
    let producer = ingest.settings().unwrap().producer_config().unwrap();
    producer.get("message.max.bytes").unwrap().parse().unwrap()
}

/// What the role of `args` can hold in memory with the shipped file, at most.
fn buffered(args: &[&str]) -> u64 {
    let record = record_bytes();
    match shipped(args).command {
        Role::Ingest(ingest) => {
            let s = ingest.settings().unwrap();
            let body = s.max_body_bytes as u64;
            // Every connection reading a body; every request in flight holding its body and
            // its record until the broker answers.
            AT_REST
                + s.max_connections as u64 * (CONNECTION_BUFFERS + body)
                + s.max_in_flight as u64 * (body + record)
        }
        Role::Consume(consume) => {
            let s = consume.settings();
            // Per partition: librdkafka's prefetch and the fetch response it came in, the
            // lane's queue (its budget, and the message that crossed it), and the batch in
            // flight, which the lane filled within the same budget.
            let lane = s.max_lane_bytes as u64 + record;
            let batch = lane.min(s.batch_size as u64 * record);
            let prefetch = replayproof::consume::QUEUED_MAX_KBYTES as u64 * 1024
                + replayproof::consume::FETCH_MAX_BYTES as u64;
            // A member owns at most as many partitions as its pool has connections.
            let partitions = consume.db_pool_size as u64;
            AT_REST + partitions * (prefetch + lane + BATCH_COPIES * batch)
        }
        Role::Dispatch(dispatch) => {
            // A leased batch: each operation's payload and request body, and the excerpt of
            // its answer; the relay's batch of output records with the kafka effect.
            let excerpt = 4 * replayproof::outbox::RESPONSE_EXCERPT_CHARS as u64;
            let outbox = dispatch.batch_size as u64 * (2 * record + excerpt);
            let Role::Consume(consume) = shipped(&["consume"]).command else {
                unreachable!()
            };
            let relay = match consume.effects.iter().any(|e| e == "kafka") {
                true => dispatch.relay.relay_batch_size as u64 * record,
                false => 0,
            };
            AT_REST + outbox + relay
        }
        Role::Console(_) => {
            // A replay by time: its reader's prefetch (librdkafka's defaults) and a batch.
            let defaults = rdkafka::ClientConfig::new().create_native_config().unwrap();
            let default = |key: &str| -> u64 { defaults.get(key).unwrap().parse().unwrap() };
            let prefetch =
                default("queued.max.messages.kbytes") * 1024 + default("fetch.max.bytes");
            let batch = replayproof::operator::replay::REPLAY_BATCH as u64 * record;
            AT_REST + prefetch + BATCH_COPIES * batch
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn each_memory_limit_covers_what_its_role_can_buffer_with_the_shipped_file() {
    let roles = workloads(&manifests());
    for (component, workload) in &roles {
        let pod = &workload["spec"]["template"]["spec"];
        let resources = &container(pod, "containers", component)["resources"];
        let limit = quantity(resources["limits"]["memory"].as_str().unwrap());
        let request = quantity(resources["requests"]["memory"].as_str().unwrap());
        let needed = buffered(&[component.as_str()]);
        assert!(
            limit as f64 >= HEADROOM * needed as f64,
            "{component}: the limit is {} MiB, it can buffer {} MiB (docs/kubernetes.md, Memory)",
            limit / MIB,
            needed / MIB
        );
        assert!(request <= limit, "{component}");
    }
}

/// The anchors GitHub gives a Markdown file's headings: lower-case, punctuation dropped, spaces
/// as `-`, and `-1`, `-2` after a repeated one.
fn github_anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        }
        let Some(heading) = line.strip_prefix('#').filter(|_| !fenced) else {
            continue;
        };
        let text = heading.trim_start_matches('#').trim();
        let slug: String = text
            .to_lowercase()
            .chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect();
        let n = seen.entry(slug.clone()).or_insert(0);
        anchors.insert(match *n {
            0 => slug,
            n => format!("{slug}-{n}"),
        });
        *n += 1;
    }
    anchors
}

#[test]
fn every_alert_links_to_its_own_section_of_the_operations_guide() {
    let alerts = yaml_file_as_json(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/alerts.yml"));
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let anchors = github_anchors(&guide);
    let prefix = "https://github.com/replayproof/replayproof/blob/main/docs/operations.md#";
    let mut linked = BTreeSet::new();
    for group in alerts["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let alert = rule["alert"].as_str().unwrap();
            let url = rule["annotations"]["runbook_url"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert} has no runbook_url"));
            let anchor = url
                .strip_prefix(prefix)
                .unwrap_or_else(|| panic!("{alert}: {url} is not in docs/operations.md"));
            assert!(anchors.contains(anchor), "{alert}: no section #{anchor}");
            assert!(linked.insert(anchor), "{alert} shares #{anchor}");
            // Its own section: the heading is the alert's name.
            assert_eq!(anchor, alert.to_lowercase(), "{alert}");
        }
    }
    assert_eq!(linked.len(), 18);
}
