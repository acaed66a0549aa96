"""The chart's Grafana dashboard asks only for series the workers export, and helm ships it unchanged.

Oracle for the queries: a `WorkerMetrics` fed one observation of every kind, scraped; each
`deepseek_pd:*` name in a panel's PromQL must be one of its sample names, and each label a
selector or `by (...)` names must be on that series (or be one Prometheus adds at scrape time).
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deepseek_pd.workers.engine.interface import Loads
from deepseek_pd.workers.metrics.worker_metrics import MetricLabels, WorkerMetrics

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "dashboards" / "deepseek-pd.json"
SCRAPE_LABELS = {"namespace", "pod", "le", "instance", "job", "service"}  # added by Prometheus (le: buckets)


def _exported() -> dict[str, set[str]]:
    metrics = WorkerMetrics(MetricLabels("decode", "m", 0))
    metrics.watch_loads(lambda: Loads(1, 2, 3, 4, cached_pages=1))
    metrics.watch_paths("decode", lambda: {"cuda_graph": 1, "eager": 1})
    metrics.watch_paths("extend", lambda: {"cuda_graph": 1, "eager": 1})
    metrics.observe_request("stop", 3, 2, 1, 0.1, 0.2)
    metrics.count_failed_request("internal")
    metrics.observe_step("decode", 0.01, 2, 2)
    metrics.observe_prefix_cache(4, 2)
    metrics.observe_kv_transfer("grpc", 10, 0.1)
    metrics.count_kv_transfer_failure("grpc", "unavailable")
    metrics.observe_inter_token_latency([0.01, 0.02])
    metrics.count_handshake_failure("unauthenticated")
    metrics.observe_speculative(6, 4, [3, 2])
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_query_names_exported_series_and_labels():
    exported = _exported()
    queries = _queries()
    assert len(queries) >= 10
    for wanted in ("inter_token_latency_seconds_bucket", "bootstrap_handshake_failures_total",
                   "spec_draft_tokens_total", "spec_accepted_tokens_total", "spec_accept_length_count"):
        assert any("deepseek_pd:" + wanted in expr for expr in queries), f"no panel charts {wanted}"
    for expr in queries:
        for name, matchers in re.findall(r"(deepseek_pd:[a-z_]+)\{([^}]*)\}", expr):
            assert name in exported, f"{name} is not exported (query {expr!r})"
            for label in re.findall(r"([a-z_]+)\s*=~?", matchers):
                assert label in exported[name] | SCRAPE_LABELS, f"{name} has no label {label!r}"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert any(label in labels for labels in exported.values()) or label in SCRAPE_LABELS, label


@pytest.fixture(scope="module")
def helm() -> pathlib.Path:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_k8s_tools.sh")], check=True,
                         capture_output=True, text=True, timeout=170)
    return pathlib.Path(out.stdout.strip().splitlines()[-1]) / "helm" / "helm"


def _render(helm: pathlib.Path, *extra: str) -> list[dict]:
    result = subprocess.run([str(helm), "template", "deepseek", str(ROOT / "charts"), "--namespace", "ops", *extra],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_the_chart_ships_the_dashboard_only_when_asked(helm):
    assert not [d for d in _render(helm) if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    docs = _render(helm, "--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.namespace=monitoring",
                   "--set", "grafanaDashboard.labels.team=llm")
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "dashboard" in d["metadata"]["name"]]
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["labels"]["team"] == "llm"
    assert json.loads(config_map["data"]["deepseek-pd.json"]) == json.loads(DASHBOARD.read_text())
