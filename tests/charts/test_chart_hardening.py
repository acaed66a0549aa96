"""Pod hardening of everything the chart and the operator render, as checkov's Kubernetes checks
read it (FACTS: checkov 3.3 is how we read hardening). checkov itself does not install beside the
test dependencies (it pins packaging 23), so each check it runs is restated here by its id:

    CKV_K8S_9    a readiness probe on every long-running container (the helm test pod exits)
    CKV_K8S_38   automountServiceAccountToken: false; a token only where a container calls the API
    CKV_K8S_40   runAsUser >= 10000 (a uid no account of the node has)
    CKV2_K8S_6   every pod is selected by a NetworkPolicy
"""
from __future__ import annotations

import pathlib
import re

import pytest
import yaml
from test_chart_helm import _render, helm  # noqa: F401 - the helm fixture

from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.crd_spec import DEFAULT_RUN_AS_USER
from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.spec import DeploymentSpec

pytestmark = pytest.mark.timeout(180)
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"]
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
POD_KINDS = ("Pod", "Deployment", "StatefulSet")


def _operator_objects(example: str) -> list[dict]:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec = DeploymentSpec.parse(raw["metadata"]["name"], "llm", raw["spec"])
    return [*build_static_children(spec),
            *(build_group_statefulset(spec, role, 0) for role in ("prefill", "decode"))]


def _pod_spec(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def _pod_labels(obj: dict) -> dict:
    return obj["metadata"].get("labels", {}) if obj["kind"] == "Pod" else \
        obj["spec"]["template"]["metadata"].get("labels", {})


def _containers(pod: dict) -> list[dict]:
    return [*pod["containers"], *pod.get("initContainers", [])]


def _selects(policy: dict, obj: dict) -> bool:
    selector = policy["spec"]["podSelector"]
    labels = _pod_labels(obj)
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr  # the only operator the builders use
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.fixture(scope="module")
def rendered(helm) -> list[dict]:  # noqa: F811
    return [*_render(helm), *(o for e in EXAMPLES for o in _operator_objects(e))]


def _pods(rendered: list[dict]) -> list[dict]:
    return [o for o in rendered if o["kind"] in POD_KINDS]


def test_ckv_k8s_40_every_pod_runs_as_a_high_uid_the_image_has(rendered):
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^USER {DEFAULT_RUN_AS_USER}$", dockerfile, re.M), "the image's USER is the default uid"
    assert DEFAULT_RUN_AS_USER >= 10000
    for obj in _pods(rendered):
        pod = _pod_spec(obj)
        for container in _containers(pod):
            uid = (container.get("securityContext") or {}).get("runAsUser",
                                                               pod["securityContext"].get("runAsUser"))
            assert uid is not None and uid >= 10000, (obj["metadata"]["name"], container["name"], uid)
            assert pod["securityContext"]["runAsNonRoot"] is True


def test_ckv_k8s_38_service_account_tokens_only_where_the_api_is_called(rendered):
    for obj in _pods(rendered):
        pod, name = _pod_spec(obj), obj["metadata"]["name"]
        assert pod.get("automountServiceAccountToken") is False, name
        token_volumes = {v["name"] for v in pod.get("volumes", [])
                         if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
        for container in _containers(pod):
            mounted = {m["name"] for m in container.get("volumeMounts", [])} & token_volumes
            # Only the operator and `operator check` (the helm test) call the API server.
            calls_api = container.get("command") == ["deepseek-pd"] and container["args"][0] == "operator" \
                or container.get("command", [])[:3] == ["deepseek-pd", "operator", "check"]
            assert bool(mounted) == calls_api, (name, container["name"])
            if mounted:
                mount = next(m for m in container["volumeMounts"] if m["name"] in mounted)
                assert mount["mountPath"] == TOKEN_DIR and mount["readOnly"] is True
                volume = next(v for v in pod["volumes"] if v["name"] in mounted)["projected"]["sources"]
                token = next(s["serviceAccountToken"] for s in volume if "serviceAccountToken" in s)
                assert token["path"] == "token" and token["expirationSeconds"] <= 86400
                assert {"ca.crt", "namespace"} <= {i["path"] for s in volume for k in ("configMap", "downwardAPI")
                                                   for i in s.get(k, {}).get("items", [])}


def test_ckv_k8s_9_the_operator_has_a_readiness_probe_on_its_readiness_endpoint(rendered):
    operator = next(o for o in rendered if o["kind"] == "Deployment" and "operator" in
                    _pod_labels(o).get("app.kubernetes.io/component", ""))
    container = _pod_spec(operator)["containers"][0]
    probe = container["readinessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
    assert probe["path"] == "/readyz" and f"--readiness-port={port}" in container["args"]
    assert container["livenessProbe"]["httpGet"]["port"] != probe["port"]
    for obj in _pods(rendered):
        if obj["kind"] != "Pod":  # the helm test pod exits within seconds (a checkov skip says so)
            for c in _pod_spec(obj)["containers"]:
                assert "readinessProbe" in c, (obj["metadata"]["name"], c["name"])


def test_ckv2_k8s_6_every_pod_has_a_network_policy_and_the_operators_egress_is_api_and_dns(rendered):
    policies = [o for o in rendered if o["kind"] == "NetworkPolicy"]
    for obj in _pods(rendered):
        if obj["metadata"]["name"].endswith("-router"):
            continue  # the router takes client traffic from anywhere; its exposure is the Service's
        assert any(_selects(p, obj) and p["metadata"]["namespace"] == obj["metadata"]["namespace"]
                   for p in policies), obj["metadata"]["name"]
    chart = next(p for p in policies if p["metadata"]["namespace"] == "ops")
    assert chart["spec"]["policyTypes"] == ["Ingress", "Egress"]
    egress = chart["spec"]["egress"]
    ports = sorted((p["protocol"], p["port"], p.get("endPort")) for rule in egress for p in rule["ports"])
    # the API server, DNS, the workers' metrics ports (the autoscaler's scrapes) and decode's gRPC
    # port (a verified rollout's greedy requests)
    assert ports == [("TCP", 53, None), ("TCP", 443, None), ("TCP", 6443, None), ("TCP", 30000, None),
                     ("TCP", 30090, 30105), ("UDP", 53, None)]
    metrics = next(r for r in egress if any(p["port"] == 30090 for p in r["ports"]))
    assert metrics["to"] == [{"namespaceSelector": {}, "podSelector": {"matchExpressions": [
        {"key": names.LABEL_ROLE, "operator": "Exists"}]}}]
    dns = next(r for r in egress if any(p["port"] == 53 for p in r["ports"]))
    assert dns["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]


def test_the_api_server_addresses_narrow_the_operators_egress(helm):  # noqa: F811
    docs = _render(helm, "--set", "operator.networkPolicy.apiServer.cidrs={10.0.0.10/32}")
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    api = next(r for r in policy["spec"]["egress"] if any(p["port"] == 443 for p in r["ports"]))
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.10/32"}}]
    assert not any(d["kind"] == "NetworkPolicy" for d in
                   _render(helm, "--set", "operator.networkPolicy.enabled=false"))
