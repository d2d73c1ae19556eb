//! The deployment files: the compose file against the Compose specification's JSON schema
//! (tests/fixtures/compose-spec.json), and everything they configure against the code.

use crate::harness::{stdout_of, TestDb};
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
        BTreeSet::from(["console", "consume", "dispatch", "ingest", "migrate"])
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
fn ingest_gets_every_secret_its_sources_file_names_with_development_values() {
    let services = resolved_compose(&compose_text(), &[]).doc;
    let env = &services["services"]["ingest"]["environment"];
    let secret = |var: &str| env[var].as_str().map(str::to_owned);
    let example = || {
        replayproof::ingest::config::FileConfig::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/replayproof.example.toml"
        )))
        .unwrap()
    };
    // The values compose gives, once interpolated, are secrets each source's kind accepts.
    let sources = example().sources_with(secret).unwrap();
    assert_eq!(sources.len(), 6);
    // And each one is needed: without it, the ingress would not start.
    for name in ["STRIPE_WEBHOOK_SECRET", "ACME_WEBHOOK_SECRET"] {
        let without = example().sources_with(|var| (var != name).then(|| secret(var)).flatten());
        assert!(without.is_err(), "{name}");
    }
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
    for role in ["ingest", "consume", "dispatch", "console"] {
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

/// Compose's interpolation of a compose file, as `docker compose` does it before anything
/// runs: `$$` is a `$`; `${VAR}` and `$VAR` need VAR set; `${VAR:-default}` and
/// `${VAR-default}` fall back; `${VAR:?message}` and `${VAR?message}` stop compose when VAR is
/// unset; `${VAR:+text}` and `${VAR+text}` give text when it is set. Applied to every string
/// value (keys and comments are not interpolated) with only `env` set, as with nothing exported
/// and no .env file.
const INTERPOLATE: &str = r#"
import json, re, sys, yaml
env = dict(json.loads(sys.argv[1]))
errors, variables = [], {}
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
def interpolate(s):
    out, i = [], 0
    while i < len(s):
        if s[i] != "$":
            out.append(s[i]); i += 1; continue
        rest = s[i + 1:]
        if rest.startswith("$"):
            out.append("$"); i += 2; continue
        if rest.startswith("{"):
            end = s.find("}", i)
            body = s[i + 2:end] if end > 0 else ""
            m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", body, re.S)
            if end < 0 or not m or "$" in (m.group(3) or ""):
                errors.append("not an interpolation compose reads here: " + s[i:end + 1])
                return s
            name, op, arg = m.groups()
            i = end + 1
        else:
            m = NAME.match(rest)
            if not m:
                errors.append("a lone $ (write $$): " + s)
                return s
            name, op, arg = m.group(0), None, None
            i += 1 + len(name)
        value = env.get(name)
        variables.setdefault(name, arg if op in (":-", "-") else None)
        if op is None and value is None:
            errors.append(name + " is unset and has no default")
        elif op in (":?", "?") and not (value or (op == "?" and value is not None)):
            errors.append(name + " is required: " + (arg or ""))
        elif op == ":-":
            out.append(value if value else arg)
        elif op == "-":
            out.append(value if value is not None else arg)
        elif op == ":+":
            out.append(arg if value else "")
        elif op == "+":
            out.append(arg if value is not None else "")
        else:
            out.append(value or "")
    return "".join(out)
def walk(node):
    if isinstance(node, dict):
        return {k: walk(v) for k, v in node.items()}
    if isinstance(node, list):
        return [walk(v) for v in node]
    if isinstance(node, str):
        return interpolate(node)
    return node
doc = walk(yaml.safe_load(sys.stdin.read()))
print(json.dumps({"errors": errors, "variables": variables, "doc": doc}))
"#;

/// A compose file as Compose runs it with only `env` set.
#[derive(serde::Deserialize)]
struct Resolved {
    /// Why Compose would refuse to start.
    errors: Vec<String>,
    /// Every variable it reads, with its default when it has one.
    variables: std::collections::BTreeMap<String, Option<String>>,
    /// The file with every value interpolated (anchors and merge keys resolved).
    doc: serde_json::Value,
}

fn resolved_compose(yaml: &str, env: &[(&str, &str)]) -> Resolved {
    let env = serde_json::to_string(env).unwrap();
    let mut child = Command::new("python3")
        .args(["-c", INTERPOLATE, &env])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3");
    use std::io::Write as _;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(yaml.as_bytes()).unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the interpolation did not run");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `.env.example`'s variables and values, as Compose reads a `.env` file.
fn env_example(text: &str) -> std::collections::BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, value) = l
                .split_once('=')
                .unwrap_or_else(|| panic!("not NAME=value: {l}"));
            (name.trim().to_owned(), value.trim().to_owned())
        })
        .collect()
}

fn env_example_text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/.env.example")).unwrap()
}

/// What is wrong between a compose file and an .env.example: a variable Compose would stop
/// on, one without a default, one .env.example does not list, or lists with another value.
fn env_problems(compose: &str, example: &str) -> Vec<String> {
    let resolved = resolved_compose(compose, &[]);
    let listed = env_example(example);
    let mut problems = resolved.errors;
    for (name, default) in &resolved.variables {
        match (default, listed.get(name)) {
            (_, None) => problems.push(format!("{name} is not in .env.example")),
            (Some(default), Some(value)) if default != value => problems.push(format!(
                "{name}: .env.example says {value:?}, the compose file's default is {default:?}"
            )),
            _ => {}
        }
    }
    for name in listed.keys() {
        if !resolved.variables.contains_key(name) {
            problems.push(format!(
                "{name} is in .env.example but the compose file never reads it"
            ));
        }
    }
    problems
}

#[test]
fn compose_starts_with_nothing_exported_and_env_example_lists_its_defaults() {
    let (compose, example) = (compose_text(), env_example_text());
    assert_eq!(env_problems(&compose, &example), Vec::<String>::new());
    // Every value is plain text: a `$` in .env would be interpolated again.
    assert!(!example
        .lines()
        .any(|l| !l.starts_with('#') && l.contains('$')));
    // The secrets are `replayproof dev`'s, so one signer serves both; the others and the
    // console's password say they are development ones.
    for (name, value) in env_example(&example) {
        let dev = replayproof::devkit::sources::DEV_SOURCES
            .iter()
            .find(|source| source.secret_env == name);
        match dev {
            Some(source) => assert_eq!(value, source.fallback, "{name}"),
            None if name.contains("SECRET") || name.starts_with("CONSOLE_") => {
                assert!(
                    value.contains("dev"),
                    "{name}={value} is not plainly for development"
                )
            }
            None => {}
        }
    }
    // A required variable, one without a default, one .env.example lacks or disagrees
    // with: each is caught.
    let required = compose.replace(
        "${GITHUB_WEBHOOK_SECRET:-dev-secret-for-replayproof}",
        "${GITHUB_WEBHOOK_SECRET:?set it}",
    );
    assert_ne!(required, compose);
    let problems = env_problems(&required, &example);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("GITHUB_WEBHOOK_SECRET is required")),
        "{problems:?}"
    );
    let bare = compose.replace(
        "${CONSOLE_PASSWORD:-dev-password-not-secret}",
        "${CONSOLE_PASSWORD}",
    );
    let problems = env_problems(&bare, &example);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("CONSOLE_PASSWORD is unset")),
        "{problems:?}"
    );
    let lacking: String = example
        .lines()
        .filter(|l| !l.starts_with("SLACK_SIGNING_SECRET="))
        .map(|l| format!("{l}\n"))
        .collect();
    let problems = env_problems(&compose, &lacking);
    assert_eq!(problems, ["SLACK_SIGNING_SECRET is not in .env.example"]);
    let other = example.replace(
        "CONSOLE_PASSWORD=dev-password-not-secret",
        "CONSOLE_PASSWORD=x",
    );
    assert_eq!(env_problems(&compose, &other).len(), 1);
    let lone = compose.replace("exec replayproof \"$$@\"", "exec replayproof \"$@\"");
    assert_ne!(lone, compose);
    assert!(!resolved_compose(&lone, &[]).errors.is_empty());
}

/// The console service as Compose would start it: its entrypoint, command and environment,
/// interpolated with nothing exported.
fn console_service() -> (Vec<String>, Vec<(String, String)>, Vec<String>) {
    let doc = resolved_compose(&compose_text(), &[]).doc;
    let console = &doc["services"]["console"];
    let strings = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    };
    let mut argv = strings(&console["entrypoint"]);
    argv.extend(strings(&console["command"]));
    let env = console["environment"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect();
    (argv, env, strings(&console["ports"]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_service_starts_with_its_compose_settings_and_prints_a_login_that_works() {
    let (argv, env, ports) = console_service();
    assert_eq!(ports, ["127.0.0.1:9480:9480"]);
    let listen = env
        .iter()
        .find(|(k, _)| k == "REPLAYPROOF_CONSOLE_LISTEN")
        .unwrap();
    assert_eq!(listen.1, "0.0.0.0:9480", "the published port");
    // The service's own command and environment, with only the addresses of the compose
    // network replaced by the test's: the database, the broker and a free port.
    let db = TestDb::new().await;
    let kafka = crate::harness::TestKafka::for_processes();
    let port = crate::harness::free_port();
    let tmp = tempfile::tempdir().unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_replayproof"))
        .parent()
        .unwrap();
    let mut cmd = tokio::process::Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .env_clear()
        .envs(env.iter().cloned())
        .env("DATABASE_URL", &db.url)
        .env("REPLAYPROOF_BROKERS", kafka.brokers())
        .env("REPLAYPROOF_CONSOLE_LISTEN", format!("127.0.0.1:{port}"))
        // The image has replayproof on its PATH, in /usr/local/bin.
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("TMPDIR", tmp.path())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut console = cmd.spawn().expect("the console's entrypoint");
    let mut stdout = tokio::io::BufReader::new(console.stdout.take().unwrap());
    let mut printed = String::new();
    use tokio::io::AsyncBufReadExt as _;
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stdout.read_line(&mut printed),
    )
    .await
    .expect("the console prints its login")
    .unwrap();
    assert!(
        printed.starts_with("Console: http://localhost:9480/ user dev, password "),
        "{printed}"
    );
    let password = printed
        .split("password ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap();
    assert_eq!(password, "dev-password-not-secret");
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    crate::harness::wait_for(
        "the login page",
        std::time::Duration::from_secs(30),
        || async {
            http.get(format!("{base}/login"))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
    let login = |password: &'static str| {
        http.post(format!("{base}/login"))
            .form(&[("username", "dev"), ("password", password)])
            .send()
    };
    assert_eq!(
        login("dev-password-not-secret").await.unwrap().status(),
        303
    );
    assert_ne!(login("another-password").await.unwrap().status(), 303);
    // Its health check asks the page the test just read; its lag is the consumers' group's,
    // and a replay by time from it applies what they apply.
    let doc = resolved_compose(&compose_text(), &[]).doc;
    for setting in [
        "REPLAYPROOF_GROUP",
        "REPLAYPROOF_EFFECT",
        "REPLAYPROOF_TOPIC",
    ] {
        let of = |service: &str| doc["services"][service]["environment"][setting].clone();
        assert_eq!(of("console"), of("consume"), "{setting}");
        assert!(of("console").is_string(), "{setting}");
    }
    let check = doc["services"]["console"]["healthcheck"]["test"].to_string();
    assert!(
        check.contains("probe") && check.contains("127.0.0.1:9480/login"),
        "{check}"
    );
    console.start_kill().unwrap();
    console.wait().await.unwrap();
}

#[test]
fn every_role_with_a_metrics_port_is_a_prometheus_target_each_replica_of_it() {
    let script = r#"
import json, yaml
doc = yaml.safe_load(open("deploy/prometheus.yml"))
jobs = {}
for job in doc["scrape_configs"]:
    targets = [t for c in job.get("static_configs", []) for t in c["targets"]]
    dns = [(n, c.get("type"), c["port"]) for c in job.get("dns_sd_configs", []) for n in c["names"]]
    jobs[job["job_name"]] = [targets, dns]
print(json.dumps(jobs))
"#;
    type Jobs = std::collections::BTreeMap<String, (Vec<String>, Vec<(String, String, u16)>)>;
    let jobs: Jobs = python_json(script);
    let doc = resolved_compose(&compose_text(), &[]).doc;
    let mut scraped = BTreeSet::new();
    for (name, command, _) in replayproof_services() {
        let service = &doc["services"][&name];
        if service["restart"] == "no" {
            continue; // one-shot: migrate
        }
        let help = stdout_of(
            Command::new(env!("CARGO_BIN_EXE_replayproof"))
                .args(&command)
                .arg("--help"),
        );
        if !String::from_utf8_lossy(&help).contains("env: REPLAYPROOF_METRICS_ADDR") {
            continue; // serves no metrics
        }
        let addr = service["environment"]["REPLAYPROOF_METRICS_ADDR"]
            .as_str()
            .unwrap_or_else(|| {
                panic!("{name} serves its metrics on 127.0.0.1, out of Prometheus' reach")
            });
        let (host, port) = addr.rsplit_once(':').unwrap();
        assert_eq!(
            host, "0.0.0.0",
            "{name}: Prometheus reaches it from another container"
        );
        let port: u16 = port.parse().unwrap();
        let job = format!("replayproof-{name}");
        let (targets, dns) = jobs.get(&job).unwrap_or_else(|| panic!("no job {job}"));
        // By name, every replica: the service's A records, or a target for a single one.
        let by_dns = dns.contains(&(name.clone(), "A".to_owned(), port));
        let by_target = targets.contains(&format!("{name}:{port}"));
        assert!(
            by_dns || (by_target && name != "consume"),
            "{job}: {targets:?} {dns:?}"
        );
        scraped.insert(job);
    }
    assert!(scraped.len() >= 3, "{scraped:?}");
    // No job watches a target that does not exist: the alert on `up` would page for it.
    assert_eq!(jobs.keys().cloned().collect::<BTreeSet<_>>(), scraped);
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

/// The shell of each `RUN` of the Dockerfile's `stage`, continuation lines joined.
fn dockerfile_runs(dockerfile: &str, stage: &str) -> Vec<String> {
    let mut runs = Vec::new();
    let (mut current, mut instruction) = (String::new(), String::new());
    for line in dockerfile.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        instruction.push_str(line.trim_end().trim_end_matches('\\'));
        instruction.push(' ');
        if line.trim_end().ends_with('\\') {
            continue;
        }
        let whole = std::mem::take(&mut instruction);
        if let Some(from) = whole.strip_prefix("FROM ") {
            current = from.split(" AS ").nth(1).unwrap_or("").trim().to_owned();
        } else if let Some(run) = whole.strip_prefix("RUN ") {
            if current == stage {
                runs.push(run.trim().to_owned());
            }
        }
    }
    runs
}

/// What the Dockerfile's plan and build stages run for `bin` (None: the ARG's default) in a
/// crate whose examples are `examples`: every cargo command, and the file it installs. cargo is
/// a stand-in that writes each binary where cargo's release build leaves it.
fn dockerfile_build(bin: Option<&str>, examples: &[&str]) -> (Vec<String>, Result<String, String>) {
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    let default = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("ARG BIN="))
        .expect("ARG BIN=<default> before the first FROM");
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("examples")).unwrap();
    for example in examples {
        std::fs::write(dir.path().join(format!("examples/{example}.rs")), "").unwrap();
    }
    let stub = dir.path().join("stub");
    std::fs::create_dir_all(&stub).unwrap();
    let cargo = r#"#!/bin/sh
echo "$*" >> cargo.log
[ "$1 $2" = "chef prepare" ] && echo '{}' > recipe.json
if [ "$1" = build ]; then
  out=""
  while [ $# -gt 0 ]; do
    case "$1" in --example) out="target/release/examples/$2";; --bin) out="target/release/$2";; esac
    shift
  done
  mkdir -p "$(dirname "$out")" && echo "$out" > "$out"
fi
exit 0
"#;
    std::fs::write(stub.join("cargo"), cargo).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(stub.join("cargo"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", stub.display(), std::env::var("PATH").unwrap());
    let mut outcome = Ok(String::new());
    for run in dockerfile_runs(&dockerfile, "plan")
        .into_iter()
        .chain(dockerfile_runs(&dockerfile, "build"))
    {
        let out = Command::new("sh")
            .args(["-c", &run])
            .current_dir(dir.path())
            .env("PATH", &path)
            .env("BIN", bin.unwrap_or(default))
            .output()
            .unwrap();
        if !out.status.success() {
            outcome = Err(String::from_utf8_lossy(&out.stderr).into_owned());
            break;
        }
    }
    let log = std::fs::read_to_string(dir.path().join("cargo.log")).unwrap_or_default();
    let installed = outcome.and_then(|_| {
        std::fs::read_to_string(dir.path().join("image-binary")).map_err(|e| e.to_string())
    });
    (
        log.lines().map(str::to_owned).collect(),
        installed.map(|s| s.trim().to_owned()),
    )
}

/// The crate's targets as cargo names them: (kind, name).
fn cargo_targets() -> BTreeSet<(String, String)> {
    let out = stdout_of(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "metadata",
                "--no-deps",
                "--format-version",
                "1",
                "--offline",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out).unwrap();
    metadata["packages"][0]["targets"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| {
            let name = t["name"].as_str().unwrap().to_owned();
            t["kind"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |k| (k.as_str().unwrap().to_owned(), name.clone()))
        })
        .collect()
}

#[test]
fn the_image_builds_the_binary_bin_names_and_cooks_what_that_build_needs() {
    let examples: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/examples"))
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_str()?
                .strip_suffix(".rs")
                .map(str::to_owned)
        })
        .collect();
    let examples: Vec<&str> = examples.iter().map(String::as_str).collect();
    let targets = cargo_targets();
    // The default: replayproof, a [[bin]], cooked and built alike.
    let (cargo, installed) = dockerfile_build(None, &examples);
    assert_eq!(
        cargo,
        [
            "chef prepare --recipe-path recipe.json",
            "chef cook --release --locked --bin replayproof --recipe-path recipe.json",
            "build --release --locked --bin replayproof",
        ]
    );
    assert_eq!(installed.unwrap(), "target/release/replayproof");
    assert!(targets.contains(&("bin".into(), "replayproof".into())));
    // The orders example: built with --example, its dependencies (dev-dependencies included)
    // cooked with --examples.
    let (cargo, installed) = dockerfile_build(Some("orders"), &examples);
    assert_eq!(
        cargo[1..],
        [
            "chef cook --release --locked --examples --recipe-path recipe.json",
            "build --release --locked --example orders",
        ]
    );
    assert_eq!(installed.unwrap(), "target/release/examples/orders");
    assert!(targets.contains(&("example".into(), "orders".into())));
    // An application's own crate, with no example of that name: its [[bin]].
    let (cargo, installed) = dockerfile_build(Some("payments"), &[]);
    assert_eq!(cargo[2], "build --release --locked --bin payments");
    assert_eq!(installed.unwrap(), "target/release/payments");
    // What cannot be a target's name is refused before anything is built.
    let (cargo, installed) = dockerfile_build(Some("orders\"; echo"), &examples);
    assert!(installed.unwrap_err().contains("is not a target's name"));
    assert_eq!(cargo.len(), 1, "{cargo:?}");
    // Installed where the entrypoint and the health checks look.
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(dockerfile.contains("COPY --from=build /src/image-binary /usr/local/bin/replayproof"));
    assert!(dockerfile.contains("ENTRYPOINT [\"/usr/local/bin/replayproof\"]"));
}

/// docs/library.md's fenced blocks of `lang`.
fn library_blocks(lang: &str) -> Vec<String> {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/library.md")).unwrap();
    let fence = format!("```{lang}\n");
    doc.split(&fence)
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap().to_owned())
        .collect()
}

#[test]
fn the_library_guide_depends_on_this_version_and_its_path_form_resolves() {
    let manifest = library_blocks("toml")
        .into_iter()
        .find(|b| b.contains("[dependencies]") && b.contains("replayproof = "))
        .expect("a Cargo.toml with replayproof among its dependencies");
    let git = format!(
        "replayproof = {{ git = \"https://github.com/replayproof/replayproof\", tag = \"v{}\" }}",
        env!("CARGO_PKG_VERSION")
    );
    assert!(manifest.lines().any(|l| l == git), "{manifest}");
    let path = "# replayproof = { path = \"../replayproof\" }";
    assert!(manifest.lines().any(|l| l == path), "{manifest}");
    // The crate as written, with the path form: replayproof checked out next to it.
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(env!("CARGO_MANIFEST_DIR"), dir.path().join("replayproof")).unwrap();
    let name: toml::Table = toml::from_str(&manifest).unwrap();
    let name = name["package"]["name"].as_str().unwrap().to_owned();
    let crate_dir = dir.path().join(&name);
    std::fs::create_dir_all(crate_dir.join("src")).unwrap();
    std::fs::write(crate_dir.join("src/main.rs"), "fn main() {}\n").unwrap();
    let with_path = manifest.replace(&git, "").replace(path, &path[2..]);
    std::fs::write(crate_dir.join("Cargo.toml"), with_path).unwrap();
    let metadata = stdout_of(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["metadata", "--format-version", "1", "--offline"])
            .current_dir(&crate_dir),
    );
    let metadata: serde_json::Value = serde_json::from_slice(&metadata).unwrap();
    let resolved: Vec<&str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"] == "replayproof")
        .map(|p| p["version"].as_str().unwrap())
        .collect();
    assert_eq!(resolved, [env!("CARGO_PKG_VERSION")]);
    // Its image is built with the same name, through the Dockerfile's BIN.
    let shell = library_blocks("sh").join("\n");
    assert!(
        shell.contains(&format!("docker build --build-arg BIN={name} ")),
        "{shell}"
    );
    assert!(
        shell.contains("docker build --build-arg BIN=orders "),
        "{shell}"
    );
    assert!(
        shell.contains(&format!("cargo run -- dev --effect {name}")),
        "{shell}"
    );
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile")).unwrap();
    assert!(dockerfile.lines().any(|l| l.starts_with("ARG BIN=")));
    // The lines to replace are the Dockerfile's own.
    for copy in library_blocks("dockerfile").concat().lines() {
        let file = copy.split_whitespace().nth(1).unwrap();
        assert!(dockerfile.contains(&format!("COPY {file}")), "{copy}");
    }
    // Prometheus finds dev where dev serves its metrics.
    let scrape = library_blocks("yaml").concat();
    let target = format!("[\"{}\"]", replayproof::devkit::dev::DEFAULT_METRICS_ADDR);
    assert!(scrape.contains(&target), "{scrape}");
}

#[test]
fn the_licenses_are_the_ones_cargo_toml_and_the_image_name() {
    let read = |file: &str| {
        std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
    };
    assert_eq!(env!("CARGO_PKG_LICENSE"), "MIT OR Apache-2.0");
    let dockerfile = read("Dockerfile");
    assert!(dockerfile.contains(&format!(
        "org.opencontainers.image.licenses=\"{}\"",
        env!("CARGO_PKG_LICENSE")
    )));
    let license = read("LICENSE");
    for named in ["LICENSE-APACHE", "LICENSE-MIT", "MIT OR Apache-2.0"] {
        assert!(license.contains(named), "LICENSE names {named}");
    }
    assert!(read("LICENSE-MIT").contains("Permission is hereby granted, free of charge"));
    // The Apache License's own text, as the crates we build on ship it (serde's).
    let metadata = stdout_of(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["metadata", "--format-version", "1", "--offline"])
            .current_dir(env!("CARGO_MANIFEST_DIR")),
    );
    let metadata: serde_json::Value = serde_json::from_slice(&metadata).unwrap();
    let serde = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "serde")
        .unwrap();
    let dir = std::path::Path::new(serde["manifest_path"].as_str().unwrap())
        .parent()
        .unwrap();
    let apache = std::fs::read_to_string(dir.join("LICENSE-APACHE")).unwrap();
    assert!(apache.contains("Apache License") && apache.contains("Version 2.0, January 2004"));
    assert_eq!(read("LICENSE-APACHE"), apache);
}

#[test]
fn the_changelog_has_an_unreleased_section_and_one_for_this_version() {
    let changelog =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/CHANGELOG.md")).unwrap();
    let headings: Vec<&str> = changelog.lines().filter(|l| l.starts_with("## ")).collect();
    assert_eq!(headings[0], "## [Unreleased]");
    let version = format!("## [{}] - ", env!("CARGO_PKG_VERSION"));
    assert!(
        headings.iter().any(|h| h.starts_with(&version)),
        "{headings:?}"
    );
    // Each heading's link is given, as Keep a Changelog writes them.
    for heading in &headings {
        let name = heading[3..].split(']').next().unwrap();
        assert!(
            changelog.contains(&format!("\n{name}]: https://")),
            "{name}"
        );
    }
}
