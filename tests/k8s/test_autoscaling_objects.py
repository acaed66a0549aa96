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


def _spec(**decode: object) -> dict:
    import pathlib
    raw = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "examples" / "cpu-minimal.yaml").read_text())
    raw["spec"]["decode"].update(decode)
    # No node has this label: the session's process kubelet leaves these pods alone.
    raw["spec"]["scheduling"] = {"nodeSelector": {"deepseek-pd.io/test-node": f"none-{random.randrange(10**6)}"}}
    return raw["spec"]


@pytest.mark.parametrize("autoscaling, message", [
    ({**AUTO, "minReplicas": 4}, "decode.autoscaling.minReplicas must be <= maxReplicas"),
    ({**AUTO, "metrics": [{"name": "ttftP90Seconds", "target": 0.5}]}, 'Unsupported value: "ttftP90Seconds"'),
    ({**AUTO, "metrics": [{"name": "tpotP90Seconds", "target": 0}]}, "target must be > 0"),
])
def test_the_server_refuses_bad_autoscaling_with_its_message(admin_kube, dsd_path, autoscaling, message):  # noqa: F811
    with pytest.raises(KubeError) as refused:
        admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                     "metadata": {"name": f"bad{random.randrange(10**6)}"},
                                     "spec": _spec(autoscaling=autoscaling)})
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
