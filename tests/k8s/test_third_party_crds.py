"""Objects whose kinds come from CRDs, judged by the real kube-apiserver with those CRDs installed:
the third-party ServiceMonitor (the pinned file of scripts/third-party-crds.txt) and the project's
own DeepSeekRoleScale (its CRD as the chart ships it). What the operator renders is admitted, and
the in-process check the fast tests use (pdtest.schema_admission, on the same CRD schemas) gives
the server's verdict on random mutations of each kind, accepted and refused alike. (The PodGroup
the operator renders is Kubernetes' in-tree kind: kubernetes-validate checks it in the fast tests,
and tests/k8s/test_real_scheduler.py creates it on the server.)
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
from test_weights_objects import apply_crd

from deepseek_pd.operator import names
from deepseek_pd.operator.reconcile import build_static_children
from deepseek_pd.operator.role_scale import build_role_scale, build_role_scale_crd
from deepseek_pd.operator.spec import DeploymentSpec
from pdtest.crd_schemas import third_party_schemas
from pdtest.schema_admission import Refused, own_schemas, validate
from pdtest.waiting import wait_until
from pdtest.seeding import examples

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTATIONS_PER_KIND = 60
# Values of every JSON type, on and past the bounds the two CRDs state (minimum 0, maximum 1000, enums, patterns).
VALUES = [None, True, 0, 1, -1, 2**31, 1.5, "", "x", "15s", "1Gi", "-1", "2 Gi", "Ab", [], {}, ["x"], {"x": 1}]


def _service_monitor(example: str) -> dict:
    raw = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    raw["metrics"] = {"serviceMonitor": True}
    children = build_static_children(DeploymentSpec.parse("v3", "crds", raw))
    [monitor] = [c for c in children if c["kind"] == "ServiceMonitor"]
    return monitor


def _role_scale() -> dict:
    """A DeepSeekRoleScale as the operator creates it."""
    return build_role_scale("v3", "crds", random.choice(names.ROLES), random.randint(0, 8))


def _own_crd_admission(admin_kube, crds, crd: dict):
    """The project's CRD installed (or updated to this build), and its server-side dry-run create."""
    apply_crd(admin_kube, crd)
    group, version, plural = crd["spec"]["group"], crd["spec"]["versions"][0]["name"], crd["spec"]["names"]["plural"]

    def admit(obj: dict) -> dict:
        meta = obj.get("metadata")
        namespace = (meta.get("namespace") if isinstance(meta, dict) else None) or "default"
        crds.ensure_namespace(namespace)
        return admin_kube.request("POST", f"/apis/{group}/{version}/namespaces/{namespace}/{plural}", obj,
                                  params={"dryRun": "All", "fieldValidation": "Strict"})
    wait_until(lambda: _served(admin_kube, f"/apis/{group}/{version}/namespaces/default/{plural}"), 30,
               f"CRD {crd['metadata']['name']} not served")
    return admit


def _served(admin_kube, path: str) -> bool:
    try:
        return admin_kube.list(path) is not None
    except KubeError:
        return False


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


def _server_verdict(admit, obj: dict) -> str | None:
    try:
        admit(obj)
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
@pytest.mark.parametrize("kind", ["ServiceMonitor", names.SCALE_KIND])
def test_the_fast_check_gives_the_servers_verdict(admin_kube, third_party_crds, kind):
    if kind == "ServiceMonitor":
        base, admit = _service_monitor("cpu-minimal.yaml"), third_party_crds.admit
        assert third_party_crds.knows(base) and third_party_schemas().knows(base)
    else:
        base, admit = _role_scale(), _own_crd_admission(admin_kube, third_party_crds, build_role_scale_crd())
        assert own_schemas().knows(base)
    verdicts = {True: 0, False: 0}

    # Drawn by hypothesis: derandomized in CI, a mismatch `make fuzz` finds shrinks to its smallest.
    @settings(max_examples=examples(MUTATIONS_PER_KIND), suppress_health_check=[HealthCheck.too_slow])
    @given(st.randoms(use_true_random=False))
    def one(rng: random.Random) -> None:
        obj, what = _mutate(base, rng)
        server, fast = _server_verdict(admit, obj), _fast_verdict(obj)
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
