"""One reconcile pass against an in-memory API: idempotence, steady state, refused writes."""
from __future__ import annotations

import asyncio
import datetime
import logging
import pathlib
import random
import uuid

import pytest
import yaml
from leader_urls import leader_urls, router_flags, router_worker_urls
from memory_api import MemoryApi

from deepseek_pd.operator import names
from deepseek_pd.operator.reconcile import Reconciler

pytestmark = pytest.mark.timeout(60)
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
LOG = logging.getLogger("test")


def _body(example: str = "deepseek-v3-h200.yaml") -> dict:
    body = yaml.safe_load((EXAMPLES / example).read_text())
    body["metadata"].update(namespace="llm", uid=str(uuid.uuid4()), generation=2)
    return body


def test_second_pass_writes_nothing_and_children_are_owned():
    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body()
    status = asyncio.run(reconciler.reconcile(body, LOG))
    assert status["phase"] == "Pending" and status["observedGeneration"] == 2
    created = {(k, n) for op, k, n in api.writes if op == "create"}
    expected_groups = {("StatefulSet", names.group_name("deepseek-v3", "prefill", i)) for i in range(2)}
    assert expected_groups <= created
    for obj in api.objects.values():
        ref = obj["metadata"]["ownerReferences"][0]
        assert ref["uid"] == body["metadata"]["uid"] and ref["controller"] is True
        assert obj["metadata"]["namespace"] == "llm"

    api.writes.clear()
    body["status"] = status
    again = asyncio.run(reconciler.reconcile(body, LOG))
    assert api.writes == []  # level-triggered and idempotent: a steady state issues no writes
    assert again["prefill"] == status["prefill"] and again["decode"] == status["decode"]
    body["status"] = again
    third = asyncio.run(reconciler.reconcile(body, LOG))
    assert third == again and api.writes == []  # conditions keep their transition times


def test_changed_router_policy_patches_only_the_router():
    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body()
    asyncio.run(reconciler.reconcile(body, LOG))
    api.writes.clear()
    body["spec"]["router"]["policy"] = "round_robin"
    asyncio.run(reconciler.reconcile(body, LOG))
    assert api.writes == [("patch", "Deployment", "deepseek-v3-router")]
    args = api.objects[("Deployment", "deepseek-v3-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--policy") + 1] == "round_robin"


def test_refused_child_becomes_a_degraded_condition():
    api = MemoryApi(refuse_kind="StatefulSet")
    status = asyncio.run(Reconciler(api).reconcile(_body("cpu-minimal.yaml"), LOG))
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert status["phase"] == "Degraded" and degraded["reason"] == "ApplyFailed"
    assert "admission webhook" in degraded["message"]


def test_invalid_spec_touches_nothing():
    api = MemoryApi()
    body = _body("cpu-minimal.yaml")
    body["spec"]["prefill"]["size"] = 0
    status = asyncio.run(Reconciler(api).reconcile(body, LOG))
    assert api.writes == [] and status["phase"] == "Failed"
    assert "spec.prefill.size" in next(c for c in status["conditions"] if c["type"] == "InvalidSpec")["message"]


def test_delete_children_removes_everything_labelled():
    api = MemoryApi()
    reconciler = Reconciler(api)
    asyncio.run(reconciler.reconcile(_body("cpu-minimal.yaml"), LOG))
    assert api.objects
    asyncio.run(reconciler.delete_children("llm", "tiny", LOG))
    assert api.objects == {}


def _router_access(api: MemoryApi) -> set[str]:
    return {k for (k, n) in api.objects if k in ("Role", "RoleBinding") and n == "tiny-router"}


def test_switching_worker_discovery_grants_and_revokes_pod_access():
    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body("cpu-minimal.yaml")
    body["spec"]["decode"]["replicas"] = random.randint(2, 4)
    asyncio.run(reconciler.reconcile(body, LOG))  # Static by default: no Role to begin with
    assert _router_access(api) == set()
    router = ("Deployment", names.router_name("tiny"))
    objects = list(api.objects.values())
    assert router_worker_urls(api.objects[router]) == {r: leader_urls(objects, r) for r in names.ROLES}

    body["spec"]["router"] = {"workerDiscovery": "Selector"}
    asyncio.run(reconciler.reconcile(body, LOG))
    assert _router_access(api) == {"Role", "RoleBinding"}
    assert router_flags(api.objects[router]).service_discovery
    assert api.objects[router]["spec"]["template"]["spec"]["automountServiceAccountToken"] is True

    api.writes.clear()
    body["spec"]["router"] = {"workerDiscovery": "Static"}
    asyncio.run(reconciler.reconcile(body, LOG))
    assert _router_access(api) == set()  # least privilege again, not just unused
    assert {("delete", "Role", "tiny-router"), ("delete", "RoleBinding", "tiny-router"),
            ("patch", "Deployment", "tiny-router")} == set(api.writes)
    assert not router_flags(api.objects[router]).service_discovery
    assert ("ServiceAccount", "tiny-router") in api.objects  # the pod still names it


def _roll_out_router(api: MemoryApi, name: str, generation: int) -> None:
    """Play the API server and the Deployment controller: every router pod runs `generation`."""
    router = api.objects[("Deployment", names.router_name(name))]
    router["metadata"]["generation"] = generation
    replicas = router["spec"]["replicas"]
    router["status"] = {"observedGeneration": generation, "replicas": replicas,
                        "updatedReplicas": replicas, "readyReplicas": replicas}


def test_static_scale_down_waits_for_the_router_to_stop_listing_the_groups():
    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body("cpu-minimal.yaml")
    before, after = random.randint(2, 4), 1
    body["spec"]["decode"]["replicas"] = before
    asyncio.run(reconciler.reconcile(body, LOG))
    _roll_out_router(api, "tiny", 1)
    retired = {names.group_name("tiny", "decode", i) for i in range(after, before)}

    body["spec"]["decode"]["replicas"] = after
    asyncio.run(reconciler.reconcile(body, LOG))
    router = api.objects[("Deployment", names.router_name("tiny"))]
    assert len(router_worker_urls(router)["decode"]) == after  # the router drops them first...
    api.objects[("Deployment", names.router_name("tiny"))]["metadata"]["generation"] = 2
    for _ in range(2):  # ...and while its new pods are not all there, the groups stay reachable
        status = asyncio.run(reconciler.reconcile(body, LOG))
        assert retired <= {n for k, n in api.objects if k == "StatefulSet"}
        assert retired <= {n for k, n in api.objects if k == "Service"}
        assert status["phase"] != "Available"

    _roll_out_router(api, "tiny", 2)
    asyncio.run(reconciler.reconcile(body, LOG))
    assert not retired & {n for k, n in api.objects if k in ("StatefulSet", "Service")}


def test_router_rollout_judgement():
    from deepseek_pd.operator.router_rollout import router_rolled_out

    def deployment(hash_: str, generation: int, **status) -> dict:
        return {"metadata": {"generation": generation, "annotations": {names.ANNOTATION_APPLIED_HASH: hash_}},
                "spec": {"replicas": 2}, "status": status}

    done = {"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2}
    assert router_rolled_out(None, "h")
    assert router_rolled_out(deployment("h", 3, **done), "h")
    assert not router_rolled_out(deployment("old", 3, **done), "h")
    assert not router_rolled_out(deployment("h", 4, **done), "h")  # controller has not seen it yet
    assert not router_rolled_out(deployment("h", 3, **{**done, "replicas": 3}), "h")  # old pod left
    assert not router_rolled_out(deployment("h", 3, **{**done, "updatedReplicas": 1, "replicas": 1}), "h")
    stuck = {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]}
    assert router_rolled_out(deployment("h", 3, **stuck), "h")  # a stuck rollout does not hold forever


def test_scale_down_keeps_the_groups_a_draining_router_pod_still_streams_from():
    """The Deployment controller stops counting a router pod once it is deleted, but the pod
    drains the streams it accepted for up to its grace period: a retired group goes only when no
    router pod, terminating ones included, names it any more."""
    api = MemoryApi()
    reconciler = Reconciler(api)
    body = _body("cpu-minimal.yaml")
    before, after = random.randint(2, 4), 1
    body["spec"]["decode"]["replicas"] = before
    asyncio.run(reconciler.reconcile(body, LOG))
    router_key = ("Deployment", names.router_name("tiny"))
    old_template = api.objects[router_key]["spec"]["template"]
    draining = {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "tiny-router-old-x1", "namespace": "llm",
                             "labels": dict(old_template["metadata"]["labels"]),
                             # deleted now, grace running: deletionTimestamp = deletion + grace
                             "deletionTimestamp": (datetime.datetime.now(datetime.timezone.utc)
                                                   + datetime.timedelta(seconds=190)).isoformat()},
                "spec": old_template["spec"], "status": {"phase": "Running"}}
    api.objects[("Pod", draining["metadata"]["name"])] = draining
    retired = {names.group_name("tiny", "decode", i) for i in range(after, before)}

    body["spec"]["decode"]["replicas"] = after
    asyncio.run(reconciler.reconcile(body, LOG))
    _roll_out_router(api, "tiny", 2)  # the controller reports the rollout done: the old pod is terminating
    for _ in range(2):
        asyncio.run(reconciler.reconcile(body, LOG))
        assert retired <= {n for k, n in api.objects if k == "StatefulSet"}

    del api.objects[("Pod", draining["metadata"]["name"])]  # drained and gone
    asyncio.run(reconciler.reconcile(body, LOG))
    assert not retired & {n for k, n in api.objects if k in ("StatefulSet", "Service")}


def test_a_router_pod_past_its_grace_period_holds_no_group():
    """A terminating router pod whose grace has run out (its node lost, say) streams nothing: it
    must not hold a retired group forever."""
    from deepseek_pd.operator.router_rollout import groups_still_named

    now = datetime.datetime.now(datetime.timezone.utc)
    url = {i: f"grpc://g{i}:30000" for i in range(3)}

    def pod(deleted_at: datetime.datetime | None, indices: list[int]) -> dict:
        meta = {"name": "r"} | ({"deletionTimestamp": deleted_at.isoformat()} if deleted_at else {})
        return {"metadata": meta, "spec": {"containers": [{"args": [url[i] for i in indices]}]}}

    grace = datetime.timedelta(seconds=random.randint(1, 300))
    assert groups_still_named([pod(now + grace, [1, 2])], [1, 2], url.get, now) == {1, 2}  # draining
    assert groups_still_named([pod(now - grace, [1, 2])], [1, 2], url.get, now) == frozenset()  # past it
    assert groups_still_named([pod(None, [2]), pod(now - grace, [1])], [1, 2], url.get, now) == {2}
