"""The REAL kube-scheduler (built from the same k8s.io/kubernetes module as the API server) places
pods, and the process kubelet only runs what it bound; the operator's gang pods go to it by
`spec.scheduling.schedulerName`. Gangs are Kubernetes' in-tree ones (scheduling.k8s.io/v1beta1
PodGroup, the scheduler's GangScheduling plugin, gate GenericWorkload: control_plane.py): a group
that cannot be placed whole binds no pod and binds whole once room appears, and a gang whose
scheduler nobody runs gets a clear condition.
"""
from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_autoscaling_objects import _spec
from test_weights_objects import _pass, dsd_path  # noqa: F401 - the CRD, installed or updated

from deepseek_pd.operator import gang_status, names
from deepseek_pd.operator.pod_placement import pod_group_name
from deepseek_pd.operator.spec import DeploymentSpec
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


def _node(name: str, cpu: str, gpus: int = 0, labels: dict | None = None) -> dict:
    capacity = {"cpu": cpu, "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, "deepseek-pd.io/test-node": name, **(labels or {})}}, "status": {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}]}}


def _set_node(admin_kube, name: str, cpu: str, gpus: int = 0, labels: dict | None = None) -> None:
    node = _node(name, cpu, gpus, labels)
    if admin_kube.get(f"/api/v1/nodes/{name}") is None:
        admin_kube.create("/api/v1/nodes", {k: v for k, v in node.items() if k != "status"})
    admin_kube.request("PATCH", f"/api/v1/nodes/{name}/status", {"status": node["status"]},
                       content_type="application/merge-patch+json")
    # The not-ready taint the API server puts on a new Node (no node lifecycle controller here).
    admin_kube.request("PATCH", f"/api/v1/nodes/{name}", {"spec": {"taints": None}},
                       content_type="application/merge-patch+json")


def _workers(admin_kube, dsd_path: str, name: str) -> list[dict]:
    pods = "/api/v1" + dsd_path.split(f"/apis/{names.API_VERSION}")[1].rsplit("/", 1)[0] + "/pods"
    return [p for p in admin_kube.list(pods) if (p["metadata"].get("labels") or {}).get(names.LABEL_DEPLOYMENT) == name
            and (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE)]  # not the router's pod


def _pod_groups(dsd_path: str) -> str:
    return "/apis/scheduling.k8s.io/v1beta1/namespaces/" + dsd_path.split("/namespaces/")[1].split("/")[0] + "/podgroups"


def _pod_group(name: str, namespace: str, spec: dict, role: str = "decode", index: int = 0) -> str:
    return pod_group_name(DeploymentSpec.parse(name, namespace, spec), role, index)


def _gang(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == gang_status.CONDITION)


def _start(admin_kube, dsd_path: str, prefix: str, spec: dict) -> str:
    """Creates a DeepSeekDeployment of `spec` under a fresh name, runs one operator pass; its name."""
    name = f"{prefix}{random.randrange(10**6)}"
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    _pass(admin_kube, dsd_path, name)
    return name


def _decode(admin_kube, dsd_path: str, name: str) -> list[dict]:
    return [p for p in _workers(admin_kube, dsd_path, name) if p["metadata"]["labels"][names.LABEL_ROLE] == "decode"]


@dataclass
class Domains:
    """Test nodes of one pool, each in a topology domain (the label `key`); the fixture deletes them."""

    admin_kube: Any
    pool: str
    key: str = "example.com/nvlink-domain"
    domain_of: dict[str, str] = field(default_factory=dict)  # node -> its domain's label value

    def add(self, node: str, domain: str, gpus: int) -> str:
        """A Ready node `<node>` of `gpus` GPUs in domain `domain` of this pool; its name."""
        name = f"{node}-{self.pool}"
        self.domain_of[name] = f"{self.pool}-{domain}"
        _set_node(self.admin_kube, name, "64", gpus=gpus,
                  labels={self.key: self.domain_of[name], "deepseek-pd.io/test-pool": self.pool})
        return name

    def scheduling(self, scheduler: str, gang: bool, **more: Any) -> dict:
        """A spec's `scheduling`: on this pool's nodes, by `scheduler`, grouped by the domain label."""
        return {"gang": gang, "schedulerName": scheduler, "topologyKey": self.key,
                "nodeSelector": {"deepseek-pd.io/test-pool": self.pool}, **more}


@pytest.fixture
def domains(admin_kube):
    made = Domains(admin_kube, f"pool-{random.randrange(10**6)}")
    yield made
    for node in made.domain_of:
        admin_kube.delete(f"/api/v1/nodes/{node}")


def test_a_gang_that_cannot_be_placed_whole_binds_no_pod_then_binds_whole(admin_kube, dsd_path, real_scheduler):  # noqa: F811
    """All or nothing, by kube-scheduler's GangScheduling plugin. Decode: one group of `size`
    ranks of 1 GPU; prefill: one pod of more GPUs than the node will ever have free at first.
    The node starts with a random 1..size-1 GPUs: room for some decode ranks, never all, so a
    scheduler placing pod by pod binds some ranks (what this control plane did before the gang
    API), and the gang binds none. No kubelet on the node: the binding is what is checked."""
    size = random.randint(2, 4)
    node = f"gang-node-{random.randrange(10**6)}"
    prefill_gpus = size + 1
    _set_node(admin_kube, node, "64", gpus=random.randint(1, size - 1))
    name = f"g{random.randrange(10**6)}"
    spec = _spec({"gpusPerPod": prefill_gpus}, size=size, gpusPerPod=1)
    spec["scheduling"] = {"gang": True, "schedulerName": real_scheduler,
                          "nodeSelector": {"deepseek-pd.io/test-node": node}}
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    status = _pass(admin_kube, dsd_path, name)  # creates the StatefulSets and PodGroups
    assert _gang(status)["reason"] != "PodGroupAPIMissing", status
    namespace = dsd_path.split("/namespaces/")[1].split("/")[0]
    group = names.group_name(name, "decode", 0)
    pod_group = admin_kube.get(f"{_pod_groups(dsd_path)}/{_pod_group(name, namespace, spec)}")
    assert pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"] == size, pod_group

    def refused() -> bool:
        pods = _workers(admin_kube, dsd_path, name)
        return len(pods) == size + 1 and all(_scheduled(p).get("reason") == "Unschedulable" for p in pods)
    wait_until(refused, 90, "the real scheduler's Unschedulable verdict on every worker",
               lambda: str([(p["metadata"]["name"], _scheduled(p)) for p in _workers(admin_kube, dsd_path, name)]))
    time.sleep(2)  # a rank bound by a pod-by-pod pass would show by now (binds take milliseconds)
    bound = [p["metadata"]["name"] for p in _workers(admin_kube, dsd_path, name) if p["spec"].get("nodeName")]
    assert bound == [], f"ranks bound while their gang cannot be placed whole: {bound}"
    gang = _gang(_pass(admin_kube, dsd_path, name))
    assert (gang["status"], gang["reason"]) == ("False", "GangWaitingForRoom"), gang
    assert group in gang["message"] and f"minCount ({size})" in gang["message"], gang  # kube-scheduler's words
    assert "Insufficient nvidia.com/gpu" in gang["message"], gang

    _set_node(admin_kube, node, "64", gpus=size + prefill_gpus)  # room for all: binds whole
    wait_until(lambda: all(p["spec"].get("nodeName") == node for p in _workers(admin_kube, dsd_path, name)), 90,
               "every worker bound once there is room",
               lambda: str([_scheduled(p) for p in _workers(admin_kube, dsd_path, name)]))
    gang = _gang(_pass(admin_kube, dsd_path, name))
    assert (gang["status"], gang["reason"]) == ("True", "PodGroupsPlaced"), gang
    admin_kube.delete(f"/api/v1/nodes/{node}")


def test_a_gang_with_a_topology_key_waits_for_one_domain_to_hold_it_whole(admin_kube, dsd_path, real_scheduler,  # noqa: F811
                                                                          domains):
    """Gang and topologyKey together: a decode group of 2 ranks of 1 GPU, and two nodes of 1 GPU
    in different domains. Both ranks fit in the cluster (one per node), and without the topology
    rule the gang would bind them there; with it the group must share a domain, which no node
    can give it, so no rank binds. A node of 1 GPU joining each domain: both ranks bind in one
    domain together, one on each of its nodes."""
    for domain in "ab":
        domains.add(f"topo-{domain}", domain, gpus=1)
    spec = _spec({"gpusPerPod": 3}, size=2, gpusPerPod=1)  # prefill never fits here: out of the way
    spec["scheduling"] = domains.scheduling(real_scheduler, gang=True)
    name = _start(admin_kube, dsd_path, "t", spec)

    def decode() -> list[dict]:
        return _decode(admin_kube, dsd_path, name)
    wait_until(lambda: len(decode()) == 2 and all(_scheduled(p).get("reason") == "Unschedulable" for p in decode()),
               90, "the real scheduler's Unschedulable verdict on both decode ranks",
               lambda: str([(p["metadata"]["name"], _scheduled(p)) for p in decode()]))
    time.sleep(2)
    assert [p["metadata"]["name"] for p in decode() if p["spec"].get("nodeName")] == []
    gang = _gang(_pass(admin_kube, dsd_path, name))
    assert (gang["status"], gang["reason"]) == ("False", "GangWaitingForRoom"), gang

    # A node of 1 GPU joins each domain: either now holds the group, over its two nodes.
    for domain in "ab":
        domains.add(f"topo-{domain}2", domain, gpus=1)

    def placed() -> list[str]:
        return [p["spec"].get("nodeName") or "" for p in decode()]
    wait_until(lambda: all(placed()) and len({domains.domain_of[n] for n in placed()}) == 1 and len(set(placed())) == 2,
               90, "both decode ranks bound in one domain, one per node", lambda: str([_scheduled(p) for p in decode()]))


def test_a_gang_with_a_topology_key_is_searched_for_a_domain_that_holds_it_whole(admin_kube, dsd_path,  # noqa: F811
                                                                                 real_scheduler, domains):
    """The PodGroup's schedulingConstraints.topology (gate TopologyAwareWorkloadScheduling): the
    user prefers domain A (node affinity), which has room for one rank of the 2-rank decode
    group; domain B has two nodes of 1 GPU. Pod affinity alone binds the first rank where the
    scores say (A) and the second then fits nowhere, every retry alike, so the group never
    starts (what the operator rendered before); the scheduler that searches the domains binds
    it whole in B. The condition names no fallback (this server keeps the field)."""
    domains.add("search-a", "a", gpus=1)
    in_b = [domains.add(node, "b", gpus=1) for node in ("search-b1", "search-b2")]
    spec = _spec({"gpusPerPod": 3}, size=2, gpusPerPod=1)  # prefill never fits here: out of the way
    prefer_a = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
        "matchExpressions": [{"key": domains.key, "operator": "In", "values": [f"{domains.pool}-a"]}]}}]}}
    spec["scheduling"] = domains.scheduling(real_scheduler, gang=True, affinity=prefer_a)
    name = _start(admin_kube, dsd_path, "s", spec)
    namespace = dsd_path.split("/namespaces/")[1].split("/")[0]
    pod_group = admin_kube.get(f"{_pod_groups(dsd_path)}/{_pod_group(name, namespace, spec)}")
    assert pod_group["spec"].get("schedulingConstraints") == {"topology": [{"key": domains.key}]}, pod_group

    def placed() -> list[str]:
        return [p["spec"].get("nodeName") or "" for p in _decode(admin_kube, dsd_path, name)]
    wait_until(lambda: len(placed()) == 2 and all(placed()), 20, "both decode ranks bound",
               lambda: str([(p["metadata"]["name"], _scheduled(p)) for p in _decode(admin_kube, dsd_path, name)]))
    assert sorted(placed()) == sorted(in_b), placed()
    gang = _gang(_pass(admin_kube, dsd_path, name))
    assert "pod affinity only" not in gang["message"], gang  # prefill still waits for room: only that


@pytest.mark.parametrize("gang", [True, False])
@pytest.mark.parametrize("placement", ["Spread", "Pack"])
def test_groups_of_a_role_spread_or_pack_over_domains_as_placement_says(admin_kube, dsd_path, real_scheduler,  # noqa: F811
                                                                       gang, placement):
    """Decode groups over two domains with room for two groups each. Spread: every domain gets a
    group, and a third group (more groups than domains) still schedules, one domain holding two.
    Pack: two groups share one domain. Both with and without gang: with it, kube-scheduler picks
    among the domains that hold a group by its placement scorers alone (NodeResourcesFit
    MostAllocated), which pack whatever the pods prefer, so Spread must be a filter it honours
    in every domain; before `placement`, the preferred anti-affinity between groups left gangs
    packed (and spread them without gang only as a preference)."""
    pool, key = f"pool-{random.randrange(10**6)}", "example.com/nvlink-domain"
    size = random.randint(1, 2)
    replicas = random.choice([2, 3]) if placement == "Spread" else 2
    nodes = {f"spread-{pool}-{d}": d for d in "ab"}
    for node, domain in nodes.items():
        _set_node(admin_kube, node, "64", gpus=2 * size, labels={key: f"{pool}-{domain}", "deepseek-pd.io/test-pool": pool})
    name = f"p{random.randrange(10**6)}"
    spec = _spec({"gpusPerPod": 2 * size + 1}, size=size, gpusPerPod=1, replicas=replicas)  # prefill out of the way
    spec["scheduling"] = {"gang": gang, "schedulerName": real_scheduler, "topologyKey": key, "placement": placement,
                          "nodeSelector": {"deepseek-pd.io/test-pool": pool}}
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    _pass(admin_kube, dsd_path, name)

    def decode() -> list[dict]:
        return [p for p in _workers(admin_kube, dsd_path, name) if p["metadata"]["labels"][names.LABEL_ROLE] == "decode"]
    pods = wait_until(lambda: (d := decode()) and len(d) == replicas * size and all(p["spec"].get("nodeName") for p in d)
                      and d, 30, "every decode rank bound",
                      lambda: str([(p["metadata"]["name"], _scheduled(p)) for p in decode()]))
    domains: dict[str, set[str]] = {}
    for pod in pods:
        domains.setdefault(pod["metadata"]["labels"][names.LABEL_GROUP_INDEX], set()).add(nodes[pod["spec"]["nodeName"]])
    assert sorted(len(d) for d in domains.values()) == [1] * replicas, domains  # each group in one domain
    per_domain = sorted(sum(d == {x} for d in domains.values()) for x in "ab")
    assert per_domain == ({2: [1, 1], 3: [1, 2]}[replicas] if placement == "Spread" else [0, 2]), domains
    for node in nodes:
        admin_kube.delete(f"/api/v1/nodes/{node}")


def test_spread_does_not_count_a_cordoned_domain(admin_kube, dsd_path, real_scheduler):  # noqa: F811
    """Spread's constraint honours taints (nodeTaintsPolicy Honor): a domain whose nodes are
    cordoned (the taint a cordon puts on a node) is no eligible domain, so two groups share the
    one left rather than wait for the cordoned one to come back (with the constraint's default,
    Ignore, the empty cordoned domain would count and refuse the second group). Gang or not, at
    random: the rule is the same in both."""
    pool, key = f"pool-{random.randrange(10**6)}", "example.com/nvlink-domain"
    nodes = {f"cordon-{pool}-{d}": d for d in "ab"}
    for node, domain in nodes.items():
        _set_node(admin_kube, node, "64", gpus=2, labels={key: f"{pool}-{domain}", "deepseek-pd.io/test-pool": pool})
    cordoned = f"cordon-{pool}-b"
    admin_kube.request("PATCH", f"/api/v1/nodes/{cordoned}", {"spec": {"unschedulable": True, "taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}, content_type="application/merge-patch+json")
    name = f"c{random.randrange(10**6)}"
    spec = _spec({"gpusPerPod": 3}, size=1, gpusPerPod=1, replicas=2)  # prefill out of the way
    spec["scheduling"] = {"gang": random.random() < 0.5, "schedulerName": real_scheduler, "topologyKey": key,
                          "nodeSelector": {"deepseek-pd.io/test-pool": pool}}  # placement: Spread, the default
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    _pass(admin_kube, dsd_path, name)

    def decode() -> list[dict]:
        return [p for p in _workers(admin_kube, dsd_path, name) if p["metadata"]["labels"][names.LABEL_ROLE] == "decode"]
    pods = wait_until(lambda: (d := decode()) and len(d) == 2 and all(p["spec"].get("nodeName") for p in d) and d,
                      30, "both decode groups bound in the domain left",
                      lambda: str([(p["metadata"]["name"], _scheduled(p)) for p in decode()]))
    assert {p["spec"]["nodeName"] for p in pods} == {f"cordon-{pool}-a"}, pods
    for node in nodes:
        admin_kube.delete(f"/api/v1/nodes/{node}")


def test_a_gang_survives_a_new_revision_its_pod_group_being_immutable(admin_kube, dsd_path):  # noqa: F811
    """A PodGroup's spec is immutable: a size or topologyKey change patched in place answers 422
    and the pass ends ApplyFailed (what it did before). Each revision gets its own PodGroup; the
    old one goes once no StatefulSet names it."""
    name = f"r{random.randrange(10**6)}"
    size = random.randint(1, 3)
    spec = _spec(size=size)
    spec["scheduling"] = {**spec["scheduling"], "gang": True}
    admin_kube.create(dsd_path, {"apiVersion": names.API_VERSION, "kind": names.KIND,
                                 "metadata": {"name": name}, "spec": spec})
    _pass(admin_kube, dsd_path, name)
    namespace = dsd_path.split("/namespaces/")[1].split("/")[0]
    old = _pod_group(name, namespace, spec)
    changed = copy.deepcopy(spec)
    if random.random() < 0.5:
        changed["decode"]["size"] = size + 1
    else:
        changed["scheduling"]["topologyKey"] = "example.com/nvlink-domain"
    admin_kube.merge_patch(f"{dsd_path}/{name}", {"spec": changed})
    status = _pass(admin_kube, dsd_path, name)
    assert not [c for c in status["conditions"] if c["type"] == "Degraded" and c["status"] == "True"], status
    new = admin_kube.get(f"{_pod_groups(dsd_path)}/{_pod_group(name, namespace, changed)}")
    assert new["spec"]["schedulingPolicy"]["gang"]["minCount"] == changed["decode"]["size"], new
    assert new["spec"].get("schedulingConstraints", {}).get("topology") == (
        [{"key": changed["scheduling"]["topologyKey"]}] if "topologyKey" in changed["scheduling"] else None), new
    sts = admin_kube.get(f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{names.group_name(name, 'decode', 0)}")
    assert sts["spec"]["template"]["spec"]["schedulingGroup"]["podGroupName"] == new["metadata"]["name"]
    _pass(admin_kube, dsd_path, name)  # no StatefulSet names the old one now
    gone = admin_kube.get(f"{_pod_groups(dsd_path)}/{old}")
    assert gone is None or gone["metadata"].get("deletionTimestamp"), gone


def test_gang_with_no_scheduler_serving_it_gets_a_clear_condition(admin_kube, dsd_path, monkeypatch):  # noqa: F811
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
