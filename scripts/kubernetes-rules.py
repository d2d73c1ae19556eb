#!/usr/bin/env python3
"""Writes deploy/kubernetes/components/monitoring/prometheusrule.yaml from deploy/alerts.yml, the one source of the
alerts: `python3 scripts/kubernetes-rules.py` after changing the alerts (a test checks that the
two agree)."""
import pathlib
import yaml


def block(dumper, text):
    """Multi-line expressions as literal blocks, as alerts.yml writes them."""
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


yaml.add_representer(str, block, Dumper=yaml.SafeDumper)

root = pathlib.Path(__file__).resolve().parent.parent
alerts = yaml.safe_load((root / "deploy" / "alerts.yml").read_text())
rule = {
    "apiVersion": "monitoring.coreos.com/v1",
    "kind": "PrometheusRule",
    "metadata": {
        "name": "replayproof",
        "namespace": "replayproof",
        # kube-prometheus-stack selects PrometheusRules labelled with its Helm release's name.
        "labels": {"app.kubernetes.io/part-of": "replayproof", "release": "kube-prometheus-stack"},
    },
    "spec": {"groups": alerts["groups"]},
}
header = (
    "# Generated from deploy/alerts.yml by scripts/kubernetes-rules.py; do not edit by hand.\n"
    "# For the Prometheus Operator; each alert's runbook_url is its section of docs/operations.md.\n"
)
text = yaml.safe_dump(rule, sort_keys=False, width=100, allow_unicode=True)
out = root / "deploy" / "kubernetes" / "components" / "monitoring" / "prometheusrule.yaml"
out.write_text(header + text)
