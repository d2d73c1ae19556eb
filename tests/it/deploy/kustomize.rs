//! The manifests rendered with kustomize, base and every component, applied twice.
//!
//! Each rendering is what `kubectl apply -k` sends: the base (`deploy/kubernetes`), the base
//! with each component, and the example overlay. The second apply after a configuration edit
//! or a new image tag must be accepted: no field Kubernetes refuses to change on an object that
//! outlives the apply may differ, and every pod must roll. No cluster is needed: the renderings
//! are compared as the API server would compare them.

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");
/// The image every replayproof container names, which `images:` rewrites.
const IMAGE: &str = "ghcr.io/replayproof/replayproof";
/// The kinds of the base: every cluster serves them, with or without an operator.
const CORE_KINDS: &[&str] = &[
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "Service",
    "Deployment",
    "StatefulSet",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
];

/// `kubectl kustomize dir`, each object as JSON.
fn kustomize(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("kubectl renders deploy/kubernetes (`kubectl kustomize`); install it: {e}")
        });
    assert!(
        out.status.success(),
        "kubectl kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let script = "import json, sys, yaml\n\
                  print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d is not None]))";
    let mut python = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    python.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let json = python.wait_with_output().unwrap();
    assert!(json.status.success());
    serde_json::from_slice(&json.stdout).unwrap()
}

/// `from`'s files copied under `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A copy of `deploy/kubernetes` to edit and render, with a kustomization per component
/// (`with-NAME/`: the base and that component, with the image the base names, as an overlay
/// of your own would set it).
struct Tree {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl Tree {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kubernetes");
        copy_tree(Path::new(ROOT), &root);
        Self { _dir: dir, root }
    }

    fn components(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.root.join("components"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    /// The base's image tag, from its kustomization.
    fn base_tag(&self) -> String {
        let text = std::fs::read_to_string(self.root.join("base/kustomization.yaml")).unwrap();
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with("newTag:"))
            .expect("the base pins a tag");
        line.split_once(':')
            .unwrap()
            .1
            .trim()
            .trim_matches('"')
            .to_owned()
    }

    /// Every rendering, by name: `base`, `overlay`, `with-NAME` for each component.
    fn render(&self) -> BTreeMap<String, Vec<Value>> {
        let mut all = BTreeMap::new();
        all.insert("base".to_owned(), kustomize(&self.root));
        all.insert(
            "overlay".to_owned(),
            kustomize(&self.root.join("overlays/example")),
        );
        for name in self.components() {
            let dir = self.root.join(format!("with-{name}"));
            std::fs::create_dir_all(&dir).unwrap();
            let kustomization = format!(
                "resources: [../base]\ncomponents: [../components/{name}]\n\
                 images:\n  - name: {IMAGE}\n    newTag: \"{}\"\n",
                self.base_tag()
            );
            std::fs::write(dir.join("kustomization.yaml"), kustomization).unwrap();
            all.insert(format!("with-{name}"), kustomize(&dir));
        }
        all
    }

    /// Replaces `from` by `to` in the file `path` of the tree, which must hold it once.
    fn edit(&self, path: &str, from: &str, to: &str) {
        let path = self.root.join(path);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.matches(from).count(), 1, "{from:?} in {path:?}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
    }
}

fn kind(object: &Value) -> &str {
    object["kind"].as_str().unwrap()
}

/// An object's identity on the cluster: its group and kind, namespace and name.
fn identity(object: &Value) -> String {
    let api = object["apiVersion"].as_str().unwrap();
    let group = api.rsplit_once('/').map_or("", |(group, _)| group);
    let meta = &object["metadata"];
    format!(
        "{group}/{}/{}/{}",
        kind(object),
        meta["namespace"].as_str().unwrap_or(""),
        meta["name"].as_str().unwrap()
    )
}

const WORKLOADS: &[&str] = &["Deployment", "StatefulSet", "DaemonSet"];

/// Every container of a workload, init containers too.
fn containers(workload: &Value) -> Vec<&Value> {
    let pod = &workload["spec"]["template"]["spec"];
    let init = pod["initContainers"].as_array().into_iter().flatten();
    pod["containers"]
        .as_array()
        .unwrap()
        .iter()
        .chain(init)
        .collect()
}

#[test]
fn the_base_needs_no_operator_and_every_rendering_resolves_its_references() {
    let all = Tree::new().render();
    assert_eq!(
        all.keys().map(String::as_str).collect::<Vec<_>>(),
        ["base", "overlay", "with-console", "with-monitoring"]
    );
    for object in &all["base"] {
        assert!(
            CORE_KINDS.contains(&kind(object)),
            "the base holds {}, which a cluster without its operator refuses",
            identity(object)
        );
        let api = object["apiVersion"].as_str().unwrap();
        assert!(!api.starts_with("monitoring.coreos.com/"), "{api}");
    }
    for (rendering, objects) in &all {
        let names: Vec<String> = objects.iter().map(identity).collect();
        for object in objects {
            if kind(object) != "Namespace" {
                assert_eq!(
                    object["metadata"]["namespace"], "replayproof",
                    "{rendering}"
                );
            }
            if !WORKLOADS.contains(&kind(object)) {
                continue;
            }
            // Each ConfigMap a pod mounts or reads exists under its generated name.
            let pod = &object["spec"]["template"]["spec"];
            let mut maps: Vec<&str> = pod["volumes"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|v| v["configMap"]["name"].as_str())
                .collect();
            for c in containers(object) {
                let from = c["envFrom"].as_array().into_iter().flatten();
                maps.extend(from.filter_map(|f| f["configMapRef"]["name"].as_str()));
            }
            for map in maps {
                let id = format!("/ConfigMap/replayproof/{map}");
                assert!(names.contains(&id), "{rendering}: {map} is not rendered");
            }
        }
    }
    // The components bring their objects; kube-prometheus-stack selects the monitoring ones.
    for rendering in ["overlay", "with-monitoring"] {
        for monitoring in ["ServiceMonitor", "PrometheusRule"] {
            let object = all[rendering]
                .iter()
                .find(|o| kind(o) == monitoring)
                .unwrap_or_else(|| panic!("{rendering} has no {monitoring}"));
            assert_eq!(
                object["metadata"]["labels"]["release"],
                "kube-prometheus-stack"
            );
        }
    }
    for rendering in ["overlay", "with-console"] {
        let console = |k: &str| {
            all[rendering]
                .iter()
                .any(|o| kind(o) == k && o["metadata"]["name"] == "replayproof-console")
        };
        for k in [
            "Deployment",
            "Service",
            "NetworkPolicy",
            "PodDisruptionBudget",
        ] {
            assert!(console(k), "{rendering} has no console {k}");
        }
    }
}

#[test]
fn the_overlays_image_reaches_every_replayproof_container_of_the_base_and_the_components() {
    let all = Tree::new().render();
    let mut seen = 0;
    for workload in all["overlay"]
        .iter()
        .filter(|o| WORKLOADS.contains(&kind(o)))
    {
        for c in containers(workload) {
            let image = c["image"].as_str().unwrap();
            assert!(
                !image.starts_with(IMAGE),
                "{} runs {image}",
                identity(workload)
            );
            if image.starts_with("registry.example.com/") {
                assert_eq!(image, "registry.example.com/you/app:1.0");
                seen += 1;
            }
        }
    }
    // ingest, consume and its migrations, dispatch and its, the console, its file and its.
    assert_eq!(seen, 8);
}

#[test]
fn every_disruption_budget_of_every_rendering_lets_a_drain_evict_unready_pods() {
    for (rendering, objects) in Tree::new().render() {
        let budgets: Vec<&Value> = objects
            .iter()
            .filter(|o| kind(o) == "PodDisruptionBudget")
            .collect();
        let workloads = objects.iter().filter(|o| WORKLOADS.contains(&kind(o)));
        assert_eq!(budgets.len(), workloads.count(), "{rendering}");
        for budget in budgets {
            assert_eq!(
                budget["spec"]["unhealthyPodEvictionPolicy"],
                "AlwaysAllow",
                "{rendering}: {}",
                identity(budget)
            );
        }
    }
}

/// What the API server refuses to change on an object that stays: a second `kubectl apply`
/// of `after` over `before` fails on any of these.
fn assert_accepted_over(before: &[Value], after: &[Value], what: &str) {
    let old: BTreeMap<String, &Value> = before.iter().map(|o| (identity(o), o)).collect();
    for object in after {
        assert!(
            !["Job", "CronJob"].contains(&kind(object)),
            "{what}: {} has a pod template Kubernetes will not update in place",
            identity(object)
        );
        let Some(previous) = old.get(&identity(object)) else {
            continue;
        };
        let id = identity(object);
        let same = |path: &str| {
            let field = |o: &Value| o.pointer(path).cloned().unwrap_or(Value::Null);
            assert_eq!(field(previous), field(object), "{what}: {id} {path}");
        };
        match kind(object) {
            "Deployment" | "DaemonSet" => same("/spec/selector"),
            // The API server refuses a change to any field of a StatefulSet's spec but these.
            "StatefulSet" => {
                let updatable = [
                    "replicas",
                    "ordinals",
                    "template",
                    "updateStrategy",
                    "persistentVolumeClaimRetentionPolicy",
                    "minReadySeconds",
                ];
                let rest = |o: &Value| {
                    let mut spec = o["spec"].as_object().cloned().unwrap_or_default();
                    spec.retain(|field, _| !updatable.contains(&field.as_str()));
                    spec
                };
                assert_eq!(rest(previous), rest(object), "{what}: {id} spec");
            }
            "Service" => {
                same("/spec/clusterIP");
                same("/spec/type");
            }
            "ConfigMap" | "Secret" if object["immutable"] == true => {
                same("/data");
                same("/binaryData");
            }
            _ => {}
        }
    }
}

/// Every workload of `after` has a new pod template: its pods roll.
fn assert_every_pod_rolls(before: &[Value], after: &[Value], what: &str) {
    let old: BTreeMap<String, &Value> = before.iter().map(|o| (identity(o), o)).collect();
    let workloads: Vec<&Value> = after
        .iter()
        .filter(|o| WORKLOADS.contains(&kind(o)))
        .collect();
    assert!(!workloads.is_empty(), "{what}");
    for workload in workloads {
        let id = identity(workload);
        let previous = old
            .get(&id)
            .unwrap_or_else(|| panic!("{what}: {id} is new"));
        assert_ne!(
            previous["spec"]["template"], workload["spec"]["template"],
            "{what}: {id} does not roll"
        );
    }
}

/// Renders the tree, edits it with `edit`, renders again, and checks that each rendering
/// applies over the one before and rolls every pod.
fn assert_applies_twice(what: &str, edit: impl FnOnce(&Tree)) {
    let tree = Tree::new();
    let before = tree.render();
    edit(&tree);
    let after = tree.render();
    for (rendering, objects) in &after {
        let what = format!("{what}, {rendering}");
        assert_accepted_over(&before[rendering], objects, &what);
        assert_every_pod_rolls(&before[rendering], objects, &what);
    }
}

#[test]
fn a_second_apply_after_a_configuration_edit_is_accepted_and_rolls_every_pod() {
    assert_applies_twice("a configuration edit", |tree| {
        tree.edit(
            "base/replayproof.toml",
            "shutdown_grace = \"20s\"",
            "shutdown_grace = \"15s\"",
        );
    });
}

#[test]
fn a_second_apply_with_a_new_image_tag_is_accepted_and_rolls_every_pod() {
    assert_applies_twice("a new image tag", |tree| {
        let tag = tree.base_tag();
        tree.edit(
            "base/kustomization.yaml",
            &format!("newTag: \"{tag}\""),
            "newTag: \"0.99.0\"",
        );
        tree.edit(
            "overlays/example/kustomization.yaml",
            "newTag: \"1.0\"",
            "newTag: \"1.1\"",
        );
    });
}
