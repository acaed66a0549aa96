"""The REAL kube-scheduler (built from the same k8s.io/kubernetes module as the API server) places
pods, and the process kubelet only runs what it bound; the operator's gang pods go to it by
`spec.scheduling.schedulerName`, and a gang whose scheduler nobody runs gets a clear condition.

What is not shown here: all-or-nothing placement of a group. That needs the coscheduling plugin of
sigs.k8s.io/scheduler-plugins compiled into the scheduler, and the Go module proxy's newest
release of it (v0.34.7) is built against Kubernetes 1.34, not the 1.37 of this control plane
(docs/operations.md, "Gang scheduling"). The default plugins bind what fits, pod by pod.
"""
from __future__ import annotations

import random

import pytest
from test_autoscaling_objects import _spec
from test_weights_objects import _pass, dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.operator import gang_status, names
from pdtest.waiting import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _scheduled(pod: dict | None) -> dict:
    return next((c for c in ((pod or {}).get("status") or {}).get("conditions") or []
                 if c["type"] == "PodScheduled"), {})


def test_the_process_kubelet_runs_what_the_real_scheduler_binds(admin_kube, process_kubelet, real_scheduler):
    namespace = f"sched-{random.randrange(10**6)}"
    admin_kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    wait_until(lambda: admin_kube.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default"), 30,
               "no default ServiceAccount")
    api = f"/api/v1/namespaces/{namespace}/pods"
    admin_kube.create(api, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "once"},
                            "spec": {"schedulerName": real_scheduler, "restartPolicy": "Never",
                                     "containers": [{"name": "c", "image": "none",
                                                     "command": ["true"]}]}})
    pod = wait_until(lambda: (p := admin_kube.get(f"{api}/once")) and p["status"].get("phase") == "Succeeded" and p,
                     60, "the real scheduler's pod did not run to completion",
                     lambda: str(admin_kube.get(f"{api}/once")))
    assert pod["spec"]["nodeName"] == process_kubelet.name
    # The binding came from kube-scheduler (its Scheduled Event), not from the process kubelet.
    events = admin_kube.list(f"/api/v1/namespaces/{namespace}/events")
    assert any(e.get("reason") == "Scheduled" and (e.get("reportingComponent") or e.get("source", {}).get(
        "component")) == real_scheduler for e in events), events
    admin_kube.delete(f"/api/v1/namespaces/{namespace}")


def _node(name: str, cpu: str) -> dict:
    capacity = {"cpu": cpu, "memory": "64Gi", "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "deepseek-pd.io/test-node": name}}, "status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}]}}


def _set_node(admin_kube, name: str, cpu: str) -> None:
    node = _node(name, cpu)
    if admin_kube.get(f"/api/v1/nodes/{name}") is None:
        admin_kube.create("/api/v1/nodes", {k: v for k, v in node.items() if k != "status"})
    admin_kube.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": node["status"]},
                       content_type="application/merge-patch+json")
    # The not-ready taint the API server puts on a new Node (no node lifecycle controller here).
    admin_kube.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                       content_type="application/merge-patch+json")


def test_operator_gang_pods_wait_for_room_then_the_real_scheduler_binds_them(
        admin_kube, dsd_path, third_party_crds, real_scheduler):  # noqa: F811
    """No kubelet on this node: the scheduler's verdict is what is checked, nothing runs."""
    node = f"sched-node-{random.randrange(10**6)}"
    _set_node(admin_kube, node, "500m")  # each worker asks for 1 CPU: no room
    name = f"g{random.randrange(10**6)}"
    spec = _spec()
    spec["scheduling"] = {"gang": True, "schedulerName": real_scheduler,
                          "nodeSelector": {"deepseek-pd.io/test-node": node}}
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    _pass(admin_kube, dsd_path, name)  # creates the StatefulSets and PodGroups
    pods = dsd_path.split(f"/apis/{names.API_VERSION}")[1].rsplit("/", 1)[0]
    pods = f"/api/v1{pods}/pods"

    def workers() -> list[dict]:
        return [p for p in admin_kube.list(pods) if (p["metadata"].get("labels") or {}).get(names.LABEL_DEPLOYMENT) == name
                and (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE)]  # not the router's pod
    want = sum(spec[role].get("replicas", 1) * spec[role].get("size", 1) for role in names.ROLES)  # defaults: 1
    wait_until(lambda: len(workers()) == want and all(_scheduled(p).get("reason") == "Unschedulable" for p in workers()),
               60, "the real scheduler's Unschedulable verdict on every worker", lambda: str(workers()))
    message = _scheduled(workers()[0])["message"]
    assert "Insufficient cpu" in message, message  # kube-scheduler's own words
    status = _pass(admin_kube, dsd_path, name)
    gang = next(c for c in status["conditions"] if c["type"] == gang_status.CONDITION)
    assert (gang["status"], gang["reason"]) == ("True", "PodGroupsCreated"), gang
    assert any(real_scheduler in p["spec"].get("schedulerName", "") for p in workers())

    _set_node(admin_kube, node, "16")  # room appears: the scheduler retries on the node's update
    wait_until(lambda: all(p["spec"].get("nodeName") == node for p in workers()), 60,
               "every worker bound once there is room", lambda: str([_scheduled(p) for p in workers()]))
    admin_kube.delete(f"/api/v1/nodes/{node}")


def test_gang_with_no_scheduler_serving_it_gets_a_clear_condition(admin_kube, dsd_path, third_party_crds,  # noqa: F811
                                                                  monkeypatch):
    monkeypatch.setattr(gang_status, "WAIT_SECONDS", 1.0)  # the real wait is 60 s
    name = f"n{random.randrange(10**6)}"
    scheduler = f"nobody-{random.randrange(10**6)}"
    spec = _spec()
    spec["scheduling"] = {**spec["scheduling"], "gang": True, "schedulerName": scheduler}
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})

    def condition() -> dict:
        status = _pass(admin_kube, dsd_path, name)
        return next((c for c in status.get("conditions") or [] if c["type"] == gang_status.CONDITION
                     and c["reason"] == "NoSchedulerAnswers"), {})
    gang = wait_until(condition, 60, "GangScheduling=False NoSchedulerAnswers")
    assert gang["status"] == "False" and scheduler in gang["message"], gang
