"""A role's `eplb.initExpertLocation`: the CRD field, the pods it renders, and `serve` resolving the
rendered flags against the mounted file (the worker's own placement checks are the oracle)."""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import random

import pytest
import yaml

from deepseek_pd.cli import build_parser
from deepseek_pd.commands.serve import flags_from_args
from deepseek_pd.errors import UserError
from deepseek_pd.operator import names
from deepseek_pd.operator.build_eplb import MOUNT_DIR
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError

from pdtest.eplb_placement import random_placement
from pdtest.pod_inputs import container_env, expand
from pdtest.rendered_pods import RenderedDeployment

pytestmark = pytest.mark.timeout(120)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _raw(rng: random.Random, role: str, redundant: int = 0) -> dict:
    """cpu-minimal with 2-pod groups spreading the experts (dp 2, ep 2); `role` names a placement."""
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    for name in names.ROLES:
        raw[name].update(size=2, parallelism={"dp": 2, "ep": 2})
    raw[role]["eplb"] = {"initExpertLocation": {"configMapName": f"placement-{rng.randrange(1000)}",
                                                "key": f"{role}-{rng.randrange(1000)}.json"}}
    if redundant:
        raw[role]["engineArgs"] = list(raw[role].get("engineArgs") or []) + [f"--ep-num-redundant-experts={redundant}"]
    return raw


def _worker(spec: DeploymentSpec, role: str) -> tuple[dict, dict]:
    template = build_group_statefulset(spec, role, 0)["spec"]["template"]
    return template["spec"], template["spec"]["containers"][0]


def test_the_placement_is_mounted_from_its_config_map_and_named_to_serve() -> None:
    rng = random.Random()
    role = rng.choice(names.ROLES)
    other = next(r for r in names.ROLES if r != role)
    raw = _raw(rng, role)
    spec = DeploymentSpec.parse("demo", "llm", raw)
    wanted = raw[role]["eplb"]["initExpertLocation"]
    pod, container = _worker(spec, role)
    volume = next(v for v in pod["volumes"] if v.get("configMap", {}).get("name") == wanted["configMapName"])
    [item] = volume["configMap"]["items"]
    assert item["key"] == wanted["key"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    flag = container["args"].index("--init-expert-location")
    assert container["args"][flag + 1] == f"{mount['mountPath']}/{item['path']}"
    pod, container = _worker(spec, other)  # only the role that names a placement gets one
    assert "--init-expert-location" not in container["args"]
    assert not any(v.get("configMap", {}).get("name") == wanted["configMapName"] for v in pod["volumes"])
    # Naming (or renaming) a placement changes the role's pods, so its groups roll; the other's do not.
    del raw[role]["eplb"]
    without = DeploymentSpec.parse("demo", "llm", raw)
    assert without.role_revision(role) != spec.role_revision(role)
    assert without.role_revision(other) == spec.role_revision(other)


@pytest.mark.parametrize("change", ["flag-too", "bad-key", "no-name"])
def test_the_crd_refuses_a_second_placement_and_bad_names(change) -> None:
    rng = random.Random()
    role = rng.choice(names.ROLES)
    raw = _raw(rng, role)
    location = raw[role]["eplb"]["initExpertLocation"]
    if change == "flag-too":
        raw[role]["engineArgs"] = ["--init-expert-location=/models/placement.json"]
    elif change == "bad-key":
        location["key"] = "dir/placement.json"
    else:
        del location["configMapName"]
    with pytest.raises(InvalidSpecError, match="initExpertLocation|init-expert-location|configMapName|key"):
        DeploymentSpec.parse("demo", "llm", copy.deepcopy(raw))


def test_serve_resolves_the_rendered_flags_against_the_mounted_file(tmp_path) -> None:
    """Each pod's argv, expanded as the kubelet does, with the mount at a local directory: `serve`'s
    resolution loads the placement the ConfigMap holds; a placement the model cannot take stops it."""
    from deepseek_pd.model.config import ModelConfig
    from deepseek_pd.model.eplb.expert_location import moe_layer_ids
    from deepseek_pd.model.checkpoint.tiny import ensure_tiny_model
    from deepseek_pd.workers.serve.resolution import resolve_serve_config

    rng = random.Random()
    role = rng.choice(names.ROLES)
    model_dir = ensure_tiny_model()
    model = ModelConfig.from_hf(model_dir)
    redundant = 2 * rng.randint(0, 2)  # E + R must divide by ep 2
    spec = DeploymentSpec.parse("demo", "llm", _raw(rng, role, redundant))
    rows = random_placement(rng, model.n_routed_experts, redundant, len(moe_layer_ids(model)))
    mounted = tmp_path / "eplb"
    mounted.mkdir()
    rendered = RenderedDeployment(spec, pod_ip="10.0.3.7")
    group = names.group_selector(spec.name, role, 0)
    pods = [pod for pod in rendered.pods() if group.items() <= pod["metadata"]["labels"].items()]
    assert len(pods) == 2
    parser = build_parser()

    def resolve(pod: dict):
        container = pod["spec"]["containers"][0]
        argv = [expand(arg, container_env(rendered, pod, container, {})).replace(MOUNT_DIR, str(mounted))
                for arg in container["args"]]
        flags = dataclasses.replace(flags_from_args(parser.parse_args(argv)), model=str(model_dir))
        return resolve_serve_config(flags)

    item = next(v for v in pods[0]["spec"]["volumes"] if v["name"] == "expert-location")["configMap"]["items"][0]
    (mounted / item["path"]).write_text(json.dumps({"physical_to_logical_map": rows}))
    for pod in pods:
        runner = resolve(pod).runner
        assert runner.init_expert_location == str(mounted / item["path"])
        assert runner.expert_location(model).physical_to_logical == tuple(map(tuple, rows))
    rows[rng.randrange(len(rows))][0] = model.n_routed_experts  # not an expert of this model
    (mounted / item["path"]).write_text(json.dumps({"physical_to_logical_map": rows}))
    with pytest.raises(UserError, match=item["path"]):
        resolve(pods[0])
