"""`decode.speculative` on a REAL kube-apiserver: the CRD's schema and CEL refuse bad settings with
their messages, an unset one is defaulted to 0 (off), and one operator pass renders
`--speculative-num-steps` into both roles' StatefulSets (a decode group of two pods, DP attention and
EP), which the server stores."""
from __future__ import annotations

import pathlib
import random

import pytest
import yaml
from kube_rest import KubeError
from test_weights_objects import _pass, dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.model.speculative.rules import MAX_SPECULATIVE_NUM_STEPS
from deepseek_pd.operator import names
from deepseek_pd.workers.serve.flags import ServeFlags

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _body(name: str, speculative: dict | None, **decode: object) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / "cpu-minimal.yaml").read_text())
    raw["spec"]["decode"].update(decode)
    if speculative is not None:
        raw["spec"]["decode"]["speculative"] = speculative
    # No node has this label: the session's process kubelet leaves these pods alone.
    raw["spec"]["scheduling"] = {"nodeSelector": {"deepseek-pd.io/test-node": f"none-{random.randrange(10**6)}"}}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name}, "spec": raw["spec"]}


@pytest.mark.parametrize("speculative, decode, message", [
    ({"numSteps": MAX_SPECULATIVE_NUM_STEPS + 1}, {}, "should be less than or equal to 8"),
    ({"numSteps": -1}, {}, "should be greater than or equal to 0"),
    ({"numSteps": 2, "draft": "mtp"}, {}, 'unknown field "spec.decode.speculative.draft"'),
    (None, {"engineArgs": ["--speculative-num-steps=2"]}, "engineArgs must not set flags the operator manages"),
])
def test_the_server_refuses_bad_speculation_with_its_message(admin_kube, dsd_path, speculative, decode, message):  # noqa: F811
    with pytest.raises(KubeError) as refused:
        admin_kube.request("POST", dsd_path, _body(f"bad{random.randrange(10**6)}", speculative, **decode),
                           params={"fieldValidation": "Strict"})
    # 422: schema or CEL; 400: strict decoding of an unknown field
    assert refused.value.status in (400, 422) and message in str(refused.value), refused.value


def _serve_steps(statefulset: dict) -> int:
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [arg.replace("$(LWS_WORKER_INDEX)", "0") for arg in args]  # as the kubelet expands it in pod 0
    return ServeFlags.from_argv(args[args.index("serve") + 1:]).speculative_num_steps


def test_defaults_and_both_roles_rendered_on_the_server(admin_kube, dsd_path):  # noqa: F811
    off = f"off{random.randrange(10**6)}"
    admin_kube.create(dsd_path, _body(off, None))
    assert admin_kube.get(f"{dsd_path}/{off}")["spec"]["decode"]["speculative"] == {"numSteps": 0}
    steps = random.randint(1, MAX_SPECULATIVE_NUM_STEPS)
    on = f"on{random.randrange(10**6)}"
    admin_kube.request("POST", dsd_path, _body(on, {"numSteps": steps}, size=2, parallelism={"ep": 2}),
                       params={"fieldValidation": "Strict"})
    _pass(admin_kube, dsd_path, on)
    namespace = dsd_path.split("/")[-2]
    stored = {s["metadata"]["labels"][names.LABEL_ROLE]: s
              for s in admin_kube.list(f"/apis/apps/v1/namespaces/{namespace}/statefulsets",
                                       labelSelector=f"{names.LABEL_DEPLOYMENT}={on}")}
    assert set(stored) == {"prefill", "decode"}, stored.keys()
    assert {role: _serve_steps(s) for role, s in stored.items()} == {"prefill": steps, "decode": steps}
    for name in (off, on):
        admin_kube.delete(f"{dsd_path}/{name}")


def test_the_server_takes_speculation_with_an_eplb_placement(admin_kube, dsd_path):  # noqa: F811
    """The MTP layer's MoE has its own row in a placement (model/eplb/expert_location.py): the CRD
    no longer refuses `decode.speculative` next to `eplb.initExpertLocation` (it did until session 9)."""
    name = f"speceplb{random.randrange(10**6)}"
    placement = {"initExpertLocation": {"configMapName": "placement", "key": "p.json"}}
    admin_kube.request("POST", dsd_path, _body(name, {"numSteps": 2}, size=2, parallelism={"ep": 2}, eplb=placement),
                       params={"fieldValidation": "Strict"})
    assert admin_kube.get(f"{dsd_path}/{name}")["spec"]["decode"]["eplb"] == placement
    admin_kube.delete(f"{dsd_path}/{name}")
