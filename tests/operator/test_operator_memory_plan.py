"""The MemoryPlanFits condition end to end: the real kopf operator against the emulated API server,
and one reconcile pass against a client that refuses every write."""
from __future__ import annotations

import asyncio
import copy
import logging
import pathlib

import jsonschema
import pytest
import yaml

from deepseek_pd.operator import names
from deepseek_pd.operator.crd import status_schema
from deepseek_pd.operator.memory_plan import MemoryVerdict
from deepseek_pd.operator.planner import RolePlan
from deepseek_pd.operator.reconcile import Reconciler
from deepseek_pd.operator.status import RouterState, build_status
from deepseek_pd.operator.validation import _to_json_schema

pytestmark = [pytest.mark.timeout(120)]
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _v3_on_one_node(name: str, *engine_args: str) -> dict:
    """examples/deepseek-v3-h200.yaml with prefill on one 8-GPU node."""
    body = yaml.safe_load((EXAMPLES / "deepseek-v3-h200.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm", "generation": 1}
    body["spec"]["prefill"].update(size=1, parallelism={"tp": 1, "dp": 8, "ep": 8}, engineArgs=list(engine_args))
    return body


def _condition(cluster, name: str, type_: str) -> dict:
    status = (cluster.get(names.KIND, name) or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def _children(cluster, name: str) -> set[tuple[str, str]]:
    kinds = ("StatefulSet", "Deployment", "Service", "ConfigMap", "ServiceAccount", "Secret", "NetworkPolicy")
    return {(k, n) for k in kinds for n in cluster.names(k) if n.startswith(f"{name}-") or n == name}


def test_a_plan_that_does_not_fit_creates_nothing_until_it_fits(cluster):
    name = "nofit"
    cluster.create(_v3_on_one_node(name, "--engine-opt", "fp8_backend=dequant"))
    cond = cluster.wait_for("MemoryPlanFits False", lambda: _condition(cluster, name, "MemoryPlanFits")
                            .get("status") == "False" and _condition(cluster, name, "MemoryPlanFits"))
    assert cond["reason"] == "DoesNotFit"
    assert "prefill (8 rank(s), bfloat16 weights)" in cond["message"] and "of 123.0 GiB per rank" in cond["message"]
    status = cluster.get(names.KIND, name)["status"]
    assert status["phase"] == "Failed"
    assert _condition(cluster, name, "Degraded")["reason"] == "MemoryPlanDoesNotFit"
    assert _condition(cluster, name, "InvalidSpec")["status"] == "False"
    assert not _children(cluster, name)

    cluster.patch(names.KIND, name, {"spec": {"prefill": {"engineArgs": []}}})  # FP8 weights kept
    cluster.wait_for("children once it fits", lambda: cluster.get("StatefulSet", names.group_name(name, "prefill", 0)))
    cond = cluster.wait_for("MemoryPlanFits True", lambda: _condition(cluster, name, "MemoryPlanFits")
                            .get("status") == "True" and _condition(cluster, name, "MemoryPlanFits"))
    assert cond["reason"] == "Fits" and "prefill (8 rank(s), FP8 weights)" in cond["message"]


def test_a_cpu_deployment_reports_not_applicable(cluster):
    name = "cpu-plan"
    body = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "llm"}
    cluster.create(body)
    cond = cluster.wait_for("MemoryPlanFits", lambda: _condition(cluster, name, "MemoryPlanFits") or None)
    assert (cond["status"], cond["reason"]) == ("True", "NotApplicable")


class _ReadOnlyApi:
    """An empty cluster that fails the test on any write."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    async def list(self, kind, namespace, labels):
        self.reads.append(kind)
        return []

    async def get(self, kind, namespace, name):
        return None

    async def create(self, manifest):
        raise AssertionError(f"created {manifest['kind']} {manifest['metadata']['name']}")

    async def patch(self, kind, namespace, name, patch):
        raise AssertionError(f"patched {kind} {name}")

    async def delete(self, kind, namespace, name):
        raise AssertionError(f"deleted {kind} {name}")


def test_the_plan_is_decided_before_the_cluster_is_read_or_written():
    api = _ReadOnlyApi()
    body = _v3_on_one_node("direct", "--engine-opt=fp8_backend=dequant")
    status = asyncio.run(Reconciler(api).reconcile(copy.deepcopy(body), logging.getLogger("test")))
    assert status["phase"] == "Failed" and api.reads == []
    memory = next(c for c in status["conditions"] if c["type"] == "MemoryPlanFits")
    assert (memory["status"], memory["observedGeneration"]) == ("False", 1)
    _valid_status(status)


def _valid_status(status: dict) -> None:
    """What the API server checks on a status write (the emulator does not): the CRD's schema."""
    jsonschema.validate(status, _to_json_schema(status_schema()))


@pytest.mark.parametrize("memory", [MemoryVerdict(True, "Fits", "ok"), MemoryVerdict(None, "GpuUnknown", "?")])
def test_every_status_with_the_condition_is_one_the_crd_accepts(memory):
    plan = RolePlan((), 1, 0, 0, False, (), frozenset({0}), frozenset({0}))
    status = build_status({"prefill": plan, "decode": plan}, {"prefill": "a", "decode": "b"},
                          {"prefill": 0, "decode": 0}, RouterState(1, 0, "http://r"), 3, {}, "2026-01-01T00:00:00Z",
                          memory=memory)
    _valid_status(status)
    assert {c["type"]: c["status"] for c in status["conditions"]}["MemoryPlanFits"] == \
        {True: "True", None: "Unknown"}[memory.status]
