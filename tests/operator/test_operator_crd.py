"""The CRD's schema and CEL rules, evaluated as the API server would (jsonschema + cel-python)."""
from __future__ import annotations

import copy
import pathlib
import random
import re

import celpy
import pytest
import yaml

from deepseek_pd.operator.crd import build_crd, root_schema
from deepseek_pd.operator.defaults import apply_defaults
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from deepseek_pd.operator.validation import validate_object

pytestmark = pytest.mark.timeout(60)
EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
EXAMPLES = [p for p in EXAMPLES if yaml.safe_load(p.read_text()).get("kind") == "DeepSeekDeployment"]


def _example(name: str) -> dict:
    return yaml.safe_load(next(p for p in EXAMPLES if p.name == name).read_text())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(path):
    obj = yaml.safe_load(path.read_text())
    assert validate_object(obj) == []
    DeploymentSpec.parse(obj["metadata"]["name"], "default", obj["spec"])


def test_there_are_a_gpu_and_a_cpu_example():
    assert {p.name for p in EXAMPLES} >= {"deepseek-v3-h200.yaml", "cpu-minimal.yaml"}


def _set(obj: dict, dotted: str, value) -> None:
    node = obj
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _drop(obj: dict, dotted: str) -> None:
    node = obj
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]


# (change, the field the error must name, words the message must contain)
BAD_SPECS = [
    ({"spec.decode.parallelism.dp": 7}, "spec.decode.parallelism", "tp * parallelism.dp"),
    ({"spec.prefill.parallelism.ep": 3}, "spec.prefill.parallelism.ep", "ep must be 1"),
    ({"spec.model.numRoutedExperts": 100}, "spec.decode.parallelism.ep", "numRoutedExperts"),
    ({"spec.decode.rolloutStrategy": {"maxSurge": 0, "maxUnavailable": "0%"}},
     "spec.decode.rolloutStrategy.maxUnavailable", "cannot both be 0"),
    ({"spec.decode.rolloutStrategy.maxSurge": "ten"}, "spec.decode.rolloutStrategy.maxSurge",
     "does not match"),
    ({"spec.prefill.replicas": -1}, "spec.prefill.replicas", "minimum"),
    ({"spec.prefill.replica": 2}, "spec.prefill", "unknown field"),
    ({"spec.decode.restartPolicy": "Always"}, "spec.decode.restartPolicy", "is not one of"),
    ({"spec.kvTransfer.backend": "grpc"}, "spec.kvTransfer.protocol", "needs backend mooncake"),
    ({"spec.model.source.huggingFace": {"id": "deepseek-ai/DeepSeek-V3"}}, "spec.model.source",
     "exactly one of"),
    ({"spec.decode.engineArgs": ["--tp=4"]}, "spec.decode.engineArgs", "must not set flags"),
    ({"spec.prefill.engineArgs": ["--advertise-host=10.1.2.3"]}, "spec.prefill.engineArgs", "must not set flags"),
    ({"spec.sharedMemorySize": "lots"}, "spec.sharedMemorySize", "does not match"),
    ({"metadata.name": "a-very-long-deployment-name-that-will-not-fit"}, "metadata.name", "at most 40"),
    ({"spec.router.workerDiscovery": "Selector", "spec.decode.port": 31000}, "spec.decode.port",
     "must be equal with router.workerDiscovery Selector"),
    ({"spec.router.workerDiscovery": "DNS"}, "spec.router.workerDiscovery", "is not one of"),
    ({"spec.router.workerDiscovery": "static"}, "spec.router.workerDiscovery", "is not one of"),
    ({"spec.prefill.deepepMode": "fast"}, "spec.prefill.deepepMode", "is not one of"),
]


@pytest.mark.parametrize("change,field,words", BAD_SPECS, ids=[f for _, f, _ in BAD_SPECS])
def test_bad_specs_are_rejected_naming_the_field(change, field, words):
    obj = _example("deepseek-v3-h200.yaml")
    assert validate_object(obj) == []
    for dotted, value in change.items():
        _set(obj, dotted, value)
    violations = validate_object(obj)
    assert violations, f"{change} was accepted"
    assert any(v.field == field and words in v.message for v in violations), violations


def test_static_discovery_allows_a_port_per_role_and_is_the_default():
    obj = _example("cpu-minimal.yaml")
    assert "workerDiscovery" not in obj["spec"].get("router", {})
    assert DeploymentSpec.parse("tiny", "default", obj["spec"]).router.worker_discovery == "Static"
    obj["spec"]["decode"]["port"] = random.randint(31000, 32000)
    assert validate_object(obj) == []


def test_missing_required_fields_are_rejected():
    obj = _example("cpu-minimal.yaml")
    _drop(obj, "spec.image")
    assert [v.field for v in validate_object(obj)] == ["spec"]
    assert "'image' is a required property" in validate_object(obj)[0].message


def test_deepep_on_cpu_is_rejected():
    obj = _example("cpu-minimal.yaml")
    obj["spec"]["decode"]["deepepMode"] = "low_latency"
    assert [v.field for v in validate_object(obj)] == ["spec.decode.deepepMode"]


@pytest.mark.parametrize("deepep", [None, "low_latency"], ids=["valid", "deepep-on-cpu"])
def test_the_object_is_converted_to_cel_once_not_once_per_rule(monkeypatch, deepep):
    """The CEL rules share one conversion of the object (celpy.json_to_cel): .spec and .spec.decode
    carry several rules each, and converting once per rule was most of the CEL time of a reconcile
    pass. The verdicts are the other tests' (deepep on CPU: test_deepep_on_cpu_is_rejected)."""
    spec_schema = root_schema()["properties"]["spec"]
    for node in (spec_schema, spec_schema["properties"]["decode"]):
        assert len(node.get("x-kubernetes-validations", [])) > 1
    convert, calls = celpy.json_to_cel, []
    monkeypatch.setattr(celpy, "json_to_cel", lambda value: calls.append(value) or convert(value))
    obj = _example("cpu-minimal.yaml")
    if deepep:
        obj["spec"]["decode"]["deepepMode"] = deepep
    assert [v.field for v in validate_object(obj)] == (["spec.decode.deepepMode"] if deepep else [])
    assert len(calls) == 1 and set(calls[0]) >= {"metadata", "spec"}  # the whole object's


def test_parse_raises_invalid_spec_with_every_violation():
    obj = _example("cpu-minimal.yaml")
    obj["spec"]["prefill"]["parallelism"] = {"tp": 2}
    obj["spec"]["decode"]["size"] = 0
    with pytest.raises(InvalidSpecError) as info:
        DeploymentSpec.parse("tiny", "default", obj["spec"])
    assert "spec.decode.size" in str(info.value)


def test_random_valid_parallelism_is_accepted_and_tp_defaults_to_world_over_dp():
    rng = random.Random()
    for _ in range(20):
        size, gpus = rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
        world = size * gpus
        dp = rng.choice([d for d in range(1, world + 1) if world % d == 0])
        ep = rng.choice(sorted({1, world}))  # the workers replicate experts or spread them over every rank
        obj = _example("cpu-minimal.yaml")
        obj["spec"]["decode"].update(size=size, gpusPerPod=gpus, parallelism={"dp": dp, "ep": ep})
        assert validate_object(obj) == [], (size, gpus, dp, ep)
        spec = DeploymentSpec.parse("tiny", "default", obj["spec"])
        assert spec.decode.parallelism.tp * dp == world


def test_defaults_fill_nested_objects_without_overwriting():
    spec = {"model": {"source": {"pvc": {"claimName": "w"}}}, "image": "i",
            "decode": {"rolloutStrategy": {"maxSurge": 2}}}
    out = apply_defaults(root_schema()["properties"]["spec"], spec)
    assert out["decode"]["rolloutStrategy"] == {"maxSurge": 2, "maxUnavailable": 1, "verify": True}
    assert out["prefill"]["replicas"] == 1 and out["kvTransfer"]["backend"] == "mooncake"
    assert spec["decode"]["rolloutStrategy"] == {"maxSurge": 2}  # input untouched


def test_crd_has_status_subresource_short_name_and_printer_columns():
    crd = build_crd()
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["dsd"]
    assert version["subresources"] == {"status": {}, "scale": {  # kubectl scale / HPA drive decode
        "specReplicasPath": ".spec.decode.replicas", "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector"}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Prefill", "Decode", "Model", "Memory", "Router", "Age"]
    paths = [c["jsonPath"] for c in version["additionalPrinterColumns"]]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    for path in paths[:-1]:  # each column points at a field the status schema declares
        node = status
        for part in re.sub(r"\[\?\(@\.type==\"(\w+)\"\)\]", r"[\1]", path).split(".")[2:]:
            field, _, condition = part.partition("[")
            node = node["properties"][field]
            if condition:  # conditions[?(@.type=="X")]: a declared condition type
                node = node["items"]
                assert condition.rstrip("]") in node["properties"]["type"]["enum"]


def _all_nodes(node, path="root"):
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _all_nodes(child, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _all_nodes(node[key], f"{path}.{key}")


def test_schema_is_structural():
    """Every node has a type (or is int-or-string / preserved) and descriptions on spec fields."""
    for path, node in _all_nodes(root_schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string") \
            or node.get("x-kubernetes-preserve-unknown-fields"), path
        if path.startswith("root.spec") and ".items" not in path and ".additionalProperties" not in path:
            assert node.get("description"), f"{path} has no description"
    # Defaults must themselves be valid: the fully defaulted minimal spec validates.
    obj = copy.deepcopy(_example("cpu-minimal.yaml"))
    assert validate_object(obj) == []


@pytest.mark.parametrize("parallelism, want", [
    ({}, (1, None)),  # DP attention over every rank: what an unset CR always meant
    ({"tp": 2}, (2, 2)),  # attention TP asked for; dp follows
    ({"tp": 2, "dp": 2}, (2, 2)),
    ({"dp": 2}, (None, 2)),  # tp follows from dp, as before
], ids=["unset", "tp-only", "tp-and-dp", "dp-only"])
def test_parallelism_defaults_render_dp_attention_unless_tp_is_asked_for(parallelism, want):
    obj = _example("cpu-minimal.yaml")
    size, gpus = 2, 2
    obj["spec"]["decode"].update(size=size, gpusPerPod=gpus, parallelism={**parallelism, "ep": 1})
    obj["spec"]["decode"]["deepepMode"] = "none"
    assert validate_object(obj) == []
    par = DeploymentSpec.parse("tiny", "default", obj["spec"]).decode.parallelism
    tp, dp = want
    tp = size * gpus // dp if tp is None else tp
    dp = size * gpus // tp if dp is None else dp
    assert (par.tp, par.dp) == (tp, dp)


def test_tp_that_does_not_divide_the_group_is_rejected():
    obj = _example("cpu-minimal.yaml")
    obj["spec"]["decode"].update(size=1, gpusPerPod=2, parallelism={"tp": 4, "ep": 1}, deepepMode="none")
    assert [v.field for v in validate_object(obj)] == ["spec.decode.parallelism"]
