"""Scraping what the operator renders: every port a worker rank or the router will serve metrics on
is a named container port, a Service port, the annotations' port, and (optionally) a
ServiceMonitor endpoint; with `metrics.enabled: false` none of it is rendered.

Oracle: the rendered argv parsed by the real `deepseek-pd serve` parser (and the port each local
rank derives from it, `MetricsConfig.for_local_rank`), and the router argv read flag by flag.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import pathlib
import random

import pytest
import yaml
from test_operator_reconcile import LOG, MemoryApi, _body

from deepseek_pd.commands import serve
from deepseek_pd.operator import names
from deepseek_pd.operator.build_metrics import build_service_monitor, metrics_ingress
from deepseek_pd.operator.build_router import build_router_deployment, build_router_service
from deepseek_pd.operator.build_workers import build_group_service, build_group_statefulset
from deepseek_pd.operator.kube import ApiError
from deepseek_pd.operator.reconcile import Reconciler, build_static_children
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.workers.metrics.server import MetricsConfig
from pdtest.schema_admission import Refused, validate

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _raw(rng: random.Random) -> dict:
    raw = yaml.safe_load((EXAMPLES / rng.choice(["deepseek-v3-h200.yaml", "cpu-minimal.yaml"])).read_text())["spec"]
    for role in ("prefill", "decode"):
        gpus, size = rng.choice([0, 1, 2, 8]), rng.choice([1, 2])
        raw[role].update(replicas=rng.randint(1, 2), size=size, gpusPerPod=gpus,
                         parallelism={"tp": size * max(gpus, 1), "dp": 1, "ep": 1},
                         deepepMode="none" if not gpus else "auto", engineArgs=[])
    raw.get("model", {}).pop("numRoutedExperts", None)
    raw["metrics"] = {"port": rng.randrange(17001, 27000),  # above Mooncake's port range
                       "routerPort": rng.randrange(40000, 50000)}
    return raw


def _serve_args(argv: list[str]) -> argparse.Namespace:
    """The worker's argv as `serve` parses it, after the kubelet's $(VAR) expansion (rank 0)."""
    env = {"$(LWS_WORKER_INDEX)": "0", "$(LWS_LEADER_ADDRESS)": "leader.example"}
    expanded = []
    for arg in argv:
        for var, value in env.items():
            arg = arg.replace(var, value)
        expanded.append(arg)
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    return parser.parse_args(expanded)


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} given {args.count(flag)} times"
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("trial", range(4))
def test_every_metrics_port_is_declared_annotated_and_served(trial):
    rng = random.Random()
    spec = DeploymentSpec.parse("v3", "llm", _raw(rng))
    for role_name in names.ROLES:
        role = spec.role(role_name)
        sts = build_group_statefulset(spec, role_name, 0)
        pod = sts["spec"]["template"]
        container = pod["spec"]["containers"][0]
        args = _serve_args(container["args"])
        assert args.metrics_port == spec.metrics.port and args.metrics_host is None  # binds --host 0.0.0.0
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        config = MetricsConfig("0.0.0.0", args.metrics_port)
        ranks = max(role.gpus_per_pod, 1)
        served = [config.for_local_rank(k).port for k in range(ranks)]
        declared = [ports["metrics"]] + [ports[f"metrics-r{k}"] for k in range(1, ranks)]
        assert served == declared
        assert len(set(ports.values())) == len(ports), f"two container ports share a number: {ports}"
        assert not any(name.startswith("metrics-r") and int(name[9:]) >= ranks for name in ports)
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == ports["metrics"]
        service_ports = {p["name"]: p["targetPort"] for p in build_group_service(spec, role_name, 0)["spec"]["ports"]}
        assert all(service_ports[name] == number for name, number in ports.items() if name.startswith("metrics"))
    router = build_router_deployment(spec)
    rpod = router["spec"]["template"]
    rcontainer = rpod["spec"]["containers"][0]
    rports = {p["name"]: p["containerPort"] for p in rcontainer["ports"]}
    assert int(_flag(rcontainer["args"], "--prometheus-port")) == rports["metrics"] == spec.metrics.router_port
    assert _flag(rcontainer["args"], "--prometheus-host") == "0.0.0.0"
    assert int(rpod["metadata"]["annotations"]["prometheus.io/port"]) == rports["metrics"]
    assert "metrics" in {p["targetPort"] for p in build_router_service(spec)["spec"]["ports"]}
    assert build_service_monitor(spec) is None  # off by default
    for manifest in build_static_children(spec) + [build_group_statefulset(spec, "decode", 0)]:
        validate(manifest)


def test_service_monitor_reaches_every_rank_and_the_router():
    rng = random.Random()
    raw = _raw(rng)
    raw["metrics"]["serviceMonitor"] = True
    spec = DeploymentSpec.parse("v3", "llm", raw)
    monitor = build_service_monitor(spec)
    assert monitor in build_static_children(spec)
    assert monitor["spec"]["selector"]["matchLabels"] == {names.LABEL_DEPLOYMENT: "v3"}
    endpoints = {e["port"] for e in monitor["spec"]["endpoints"]}
    services = [build_router_service(spec)] + [build_group_service(spec, r, 0) for r in names.ROLES]
    metrics_ports = {p["name"] for s in services for p in s["spec"]["ports"] if p["name"].startswith("metrics")}
    assert endpoints == metrics_ports
    for service in services:  # the monitor's selector picks every one of them
        assert service["metadata"]["labels"][names.LABEL_DEPLOYMENT] == "v3"
    validate(monitor)  # prometheus-operator's own CRD (pdtest.schema_admission)


@pytest.mark.parametrize("field,value", [("interval", "15 seconds"), ("port", 9), ("notAField", "x")])
def test_the_crd_check_refuses_a_bad_service_monitor(field, value):
    """The in-process check of pdtest.schema_admission is able to refuse (tests/k8s holds it to the
    server's verdict): an interval outside the CRD's pattern, a wrong type, an unknown field."""
    raw = _raw(random.Random())
    raw["metrics"]["serviceMonitor"] = True
    monitor = build_service_monitor(DeploymentSpec.parse("v3", "llm", raw))
    monitor["spec"]["endpoints"][0][field] = value
    with pytest.raises(Refused, match="spec.endpoints.0"):
        validate(monitor)


def test_metrics_disabled_renders_no_port_flag_or_annotation():
    raw = _raw(random.Random())
    raw["metrics"] = {"enabled": False, "serviceMonitor": True}
    spec = DeploymentSpec.parse("v3", "llm", raw)
    pod = build_group_statefulset(spec, "prefill", 0)["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert _serve_args(container["args"]).metrics_port is None
    assert not [p for p in container["ports"] if p["name"].startswith("metrics")]
    assert not [k for k in pod["metadata"]["annotations"] if k.startswith("prometheus.io")]
    router = build_router_deployment(spec)["spec"]["template"]
    assert "--prometheus-port" not in router["spec"]["containers"][0]["args"]
    assert build_service_monitor(spec) is None


def test_engine_args_may_not_set_the_metrics_port():
    raw = copy.deepcopy(_raw(random.Random()))
    raw["decode"]["engineArgs"] = ["--metrics-port=1234"]
    with pytest.raises(InvalidSpecError, match="engineArgs"):
        DeploymentSpec.parse("v3", "llm", raw)


class _NoPrometheusOperator(MemoryApi):
    """A cluster without the ServiceMonitor CRD: listing or creating one answers 404."""

    async def list(self, kind, namespace, labels):
        if kind == "ServiceMonitor":
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return await super().list(kind, namespace, labels)


def test_reconcile_creates_and_removes_the_service_monitor_and_works_without_its_crd():
    plain = _NoPrometheusOperator()
    status = asyncio.run(Reconciler(plain).reconcile(_body("cpu-minimal.yaml"), LOG))
    assert status["phase"] != "Degraded" and not [k for k, _ in plain.objects if k == "ServiceMonitor"]

    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body("cpu-minimal.yaml")
    body["spec"]["metrics"] = {"serviceMonitor": True}
    asyncio.run(reconciler.reconcile(body, LOG))
    monitor = api.objects[("ServiceMonitor", "tiny")]
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == body["metadata"]["uid"]
    api.writes.clear()
    asyncio.run(reconciler.reconcile(body, LOG))
    assert api.writes == []  # steady state
    body["spec"]["metrics"] = {"serviceMonitor": False}
    asyncio.run(reconciler.reconcile(body, LOG))
    assert ("delete", "ServiceMonitor", "tiny") in api.writes and ("ServiceMonitor", "tiny") not in api.objects


@pytest.mark.parametrize("field", ["prefill.port", "prefill.bootstrapPort", "decode.port", "routerPort"])
def test_a_metrics_port_on_another_port_is_refused(field):
    rng = random.Random()
    raw = _raw(rng)
    role, _, key = field.rpartition(".")
    ranks = max(raw[role]["gpusPerPod"], 1) if role else 1
    if role:
        raw[role][key] = raw["metrics"]["port"] + rng.randrange(ranks)  # inside the pod's metrics ports
    else:
        raw["metrics"]["routerPort"] = raw.setdefault("router", {}).get("port", 8000)
    with pytest.raises(InvalidSpecError, match="metrics"):
        DeploymentSpec.parse("v3", "llm", raw)
    raw["metrics"]["enabled"] = False
    DeploymentSpec.parse("v3", "llm", raw)  # no metrics ports: no clash


def test_metrics_ingress_opens_exactly_the_metrics_ports():
    rng = random.Random()
    raw = _raw(rng)
    spec = DeploymentSpec.parse("v3", "llm", raw)
    (rule,) = metrics_ingress(spec)
    declared = {p["containerPort"] for r in names.ROLES
                for p in build_group_statefulset(spec, r, 0)["spec"]["template"]["spec"]["containers"][0]["ports"]
                if p["name"].startswith("metrics")}
    (port,) = rule["ports"]
    assert set(range(port["port"], port.get("endPort", port["port"]) + 1)) == declared
    assert "from" not in rule  # any source by default: the annotations invite any Prometheus
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    raw["metrics"]["allowFrom"] = [peer]
    assert metrics_ingress(DeploymentSpec.parse("v3", "llm", raw))[0]["from"] == [peer]
    raw["metrics"]["enabled"] = False
    assert metrics_ingress(DeploymentSpec.parse("v3", "llm", raw)) == []
