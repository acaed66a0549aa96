"""Objects whose kinds come from third-party CRDs (ServiceMonitor; scheduler-plugins' PodGroup, which
the operator does not render: it uses Kubernetes' in-tree PodGroup, and it stays as a second CRD), judged by the real kube-apiserver with those CRDs installed (the pinned files of
scripts/third-party-crds.txt): what the operator renders is admitted, and the in-process check the
fast tests use (pdtest.schema_admission, on the same CRD files) gives the server's verdict on
random mutations of each kind, accepted and refused alike.
"""
from __future__ import annotations

import copy
import pathlib
import random

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kube_rest import KubeError

from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.spec import DeploymentSpec
from pdtest.crd_schemas import third_party_schemas
from pdtest.schema_admission import Refused, validate
from pdtest.seeding import examples

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTATIONS_PER_KIND = 60
# Values of every JSON type, on and past the bounds the two CRDs state (minimum 1, int32, patterns).
VALUES = [None, True, 0, 1, -1, 2**31, 1.5, "", "x", "15s", "1Gi", "-1", "2 Gi", "Ab", [], {}, ["x"], {"x": 1}]


def _service_monitor(example: str) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    raw["metrics"] = {"serviceMonitor": True}
    children = build_static_children(DeploymentSpec.parse("v3", "crds", raw))
    [monitor] = [c for c in children if c["kind"] == "ServiceMonitor"]
    return monitor


def _pod_group() -> dict:
    """A PodGroup as scheduler-plugins' coscheduling plugin documents it (not the operator's kind)."""
    return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
            "metadata": {"name": "v3-decode-0", "namespace": "crds", "labels": {"app": "v3"}},
            "spec": {"minMember": 2, "scheduleTimeoutSeconds": 60, "minResources": {"cpu": "2", "memory": "1Gi"}}}


def _places(value, path=()):
    """Every place under metadata and spec (status is the server's, ignored on create), but the
    namespace: the one the object is created in, not a field of its kind."""
    if isinstance(value, dict):
        for key, item in value.items():
            if (path or key in ("metadata", "spec")) and path + (key,) != ("metadata", "namespace"):
                yield path + (key,)
                yield from _places(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield path + (index,)
            yield from _places(item, path + (index,))


def _mutate(obj: dict, rng: random.Random) -> tuple[dict, str]:
    out = copy.deepcopy(obj)
    path = rng.choice(list(_places(out)))
    *parents, last = path
    parent = out
    for part in parents:
        parent = parent[part]
    action = rng.choice(["set", "set", "set", "drop", "unknown", "duplicate"])
    if action == "drop":
        del parent[last]
    elif action == "unknown" and isinstance(parent[last], dict):
        parent[last]["notAField"] = rng.choice(VALUES)
    elif action == "duplicate" and isinstance(parent[last], list) and parent[last]:
        parent[last].append(copy.deepcopy(parent[last][0]))
    else:
        action = "set"
        parent[last] = copy.deepcopy(rng.choice(VALUES))
    return out, f"{action} {'.'.join(map(str, path))}" + ("" if action == "drop" else f" -> {parent[last]!r}")


def _fast_verdict(obj: dict) -> str | None:
    try:
        validate(obj)
    except Refused as exc:
        return exc.message
    return None


def _server_verdict(crds, obj: dict) -> str | None:
    try:
        crds.admit(obj)
    except KubeError as exc:
        if exc.status not in (400, 422):  # 400: a field of the wrong JSON type in metadata
            raise
        return str(exc)
    return None


@pytest.mark.parametrize("example", ["cpu-minimal.yaml", "deepseek-v3-h200.yaml"])
def test_the_rendered_service_monitor_is_admitted_by_its_crd(third_party_crds, example):
    monitor = _service_monitor(example)
    stored = third_party_crds.admit(monitor)
    assert stored["spec"]["endpoints"] == monitor["spec"]["endpoints"], "the server pruned a field"
    validate(monitor)


@pytest.mark.hypothesis  # its @given is inside: `make fuzz` selects it by this mark
@pytest.mark.parametrize("kind", ["ServiceMonitor", "PodGroup"])
def test_the_fast_check_gives_the_servers_verdict(third_party_crds, kind):
    base = _service_monitor("cpu-minimal.yaml") if kind == "ServiceMonitor" else _pod_group()
    assert third_party_crds.knows(base) and third_party_schemas().knows(base)
    verdicts = {True: 0, False: 0}

    # Drawn by hypothesis: derandomized in CI, a mismatch `make fuzz` finds shrinks to its smallest.
    @settings(max_examples=examples(MUTATIONS_PER_KIND), suppress_health_check=[HealthCheck.too_slow])
    @given(st.randoms(use_true_random=False))
    def one(rng: random.Random) -> None:
        obj, what = _mutate(base, rng)
        server, fast = _server_verdict(third_party_crds, obj), _fast_verdict(obj)
        assert (server is None) == (fast is None), f"{what}: server {server!r}, in-process {fast!r}"
        verdicts[server is None] += 1

    one()
    assert verdicts[True] and verdicts[False], verdicts  # both verdicts were tried


def test_an_unknown_kind_fails_loudly(third_party_crds):
    stray = {"apiVersion": "example.com/v1", "kind": "Stray", "metadata": {"name": "s", "namespace": "crds"}}
    with pytest.raises(KeyError, match="no installed CRD defines example.com/v1 Stray"):
        third_party_crds.admit(stray)
    with pytest.raises(LookupError, match="no schema for example.com/v1 Stray"):
        validate(stray)
