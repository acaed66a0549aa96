"""Autoscaling's API on a REAL kube-apiserver: the CRD's CEL refuses bad autoscaling specs with
their messages, decode's scale subresource drives spec.decode.replicas and reports the status
the operator writes (replicas, selector), and the operator's own pass writes status.autoscaling
through /status without the server pruning it."""
from __future__ import annotations

import asyncio
import random

import pytest
import yaml
from kube_rest import KubeError
from test_weights_objects import _pass, dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.operator import names

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
AUTO = {"minReplicas": 1, "maxReplicas": 3, "metrics": [{"name": "tpotP90Seconds", "target": 0.05}]}
PREFILL_AUTO = {"minReplicas": 1, "maxReplicas": 3, "metrics": [{"name": "ttftP90Seconds", "target": 0.5},
                                                                {"name": "queueDepthPerGroup", "target": 4}]}


def _spec(prefill: dict | None = None, **decode: object) -> dict:
    import pathlib
    raw = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "examples" / "cpu-minimal.yaml").read_text())
    raw["spec"]["decode"].update(decode)
    raw["spec"]["prefill"].update(prefill or {})
    # No node has this label: the session's process kubelet leaves these pods alone.
    raw["spec"]["scheduling"] = {"nodeSelector": {"deepseek-pd.io/test-node": f"none-{random.randrange(10**6)}"}}
    return raw["spec"]


@pytest.mark.parametrize("role, autoscaling, message", [
    ("decode", {**AUTO, "minReplicas": 4}, "decode.autoscaling.minReplicas must be <= maxReplicas"),
    ("decode", {**AUTO, "metrics": [{"name": "ttftP90Seconds", "target": 0.5}]}, 'Unsupported value: "ttftP90Seconds"'),
    ("decode", {**AUTO, "metrics": [{"name": "tpotP90Seconds", "target": 0}]}, "target must be > 0"),
    ("prefill", {**PREFILL_AUTO, "minReplicas": 4}, "prefill.autoscaling.minReplicas must be <= maxReplicas"),
    ("prefill", {**PREFILL_AUTO, "metrics": [{"name": "kvCacheUsage", "target": 0.8}]},
     'Unsupported value: "kvCacheUsage"'),
    ("prefill", {**PREFILL_AUTO, "metrics": [{"name": "p99Latency", "target": 0.8}]},
     'Unsupported value: "p99Latency"'),
    ("prefill", {**PREFILL_AUTO, "metrics": PREFILL_AUTO["metrics"] * 2}, "must have at most 2 items"),
])
def test_the_server_refuses_bad_autoscaling_with_its_message(admin_kube, dsd_path, role, autoscaling,  # noqa: F811
                                                             message):
    spec = _spec(autoscaling=autoscaling) if role == "decode" else _spec({"autoscaling": autoscaling})
    with pytest.raises(KubeError) as refused:
        admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                     "metadata": {"name": f"bad{random.randrange(10**6)}"}, "spec": spec})
    assert refused.value.status == 422 and message in str(refused.value), refused.value


def test_scale_subresource_and_autoscaling_status_round_trip(admin_kube, dsd_path):  # noqa: F811
    name = f"s{random.randrange(10**6)}"
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": _spec(autoscaling=AUTO)})
    status = _pass(admin_kube, dsd_path, name)  # the operator's pass, written through /status
    auto = status["autoscaling"]["decode"]["lastDecision"]
    assert auto["from"] == auto["to"] == 1 and auto["reason"].startswith("hold: groups are rolling out"), auto
    assert auto["readings"] == {}  # nothing read yet: no key (a null would delete it in a merge patch)
    assert status["decode"]["selector"] == f"{names.LABEL_DEPLOYMENT}={name},{names.LABEL_ROLE}=decode"

    scale = admin_kube.get(f"{dsd_path}/{name}/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    assert scale["status"]["selector"] == status["decode"]["selector"]
    replicas = random.randint(2, 3)  # what `kubectl scale` and an HPA send (within the autoscaler's bounds)
    admin_kube.merge_patch(f"{dsd_path}/{name}/scale", {"spec": {"replicas": replicas}})
    body = admin_kube.get(f"{dsd_path}/{name}")
    assert body["spec"]["decode"]["replicas"] == replicas and body["spec"]["prefill"]["replicas"] == 1
    status = _pass(admin_kube, dsd_path, name)
    assert admin_kube.get(f"{dsd_path}/{name}/scale")["status"]["replicas"] == status["decode"]["replicas"] == replicas


def test_prefill_autoscaling_status_round_trips(admin_kube, dsd_path):  # noqa: F811
    """Prefill's decision goes through the same machinery and /status as decode's."""
    name = f"p{random.randrange(10**6)}"
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": _spec({"autoscaling": PREFILL_AUTO})})
    status = _pass(admin_kube, dsd_path, name)
    assert set(status["autoscaling"]) == {"prefill"}
    auto = status["autoscaling"]["prefill"]["lastDecision"]
    assert auto["from"] == auto["to"] == 1 and auto["reason"].startswith("hold: groups are rolling out"), auto
    minimum = random.randint(2, 3)  # the bounds moved: followed at once, no window, no metric needed
    admin_kube.merge_patch(f"{dsd_path}/{name}", {"spec": {"prefill": {"autoscaling": {
        "minReplicas": minimum, "maxReplicas": 3}}}})
    for _ in range(3):  # a pass holds while the first groups are still being created
        status = _pass(admin_kube, dsd_path, name)
        if admin_kube.get(f"{dsd_path}/{name}")["spec"]["prefill"]["replicas"] == minimum:
            break
    assert admin_kube.get(f"{dsd_path}/{name}")["spec"]["prefill"]["replicas"] == minimum, status["autoscaling"]
