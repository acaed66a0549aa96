"""Gang scheduling and topology of the rendered groups (operator/pod_placement.py, gang_status.py):
the PodGroup each group gets (Kubernetes' in-tree scheduling.k8s.io/v1beta1, checked against the
1.37 OpenAPI schema by pdtest.schema_admission; tests/k8s/test_real_scheduler.py creates it on the
real server and has the real scheduler honour it), the schedulingGroup and scheduler on its pods,
the affinity terms read with the label-selector semantics against the pods' own labels, and the
GangScheduling condition; the live operator reports a cluster that serves no PodGroup."""
from __future__ import annotations

import copy
import datetime
import pathlib
import random

import pytest
import yaml
from test_operator_kopf import _condition, _deployment

from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.gang_status import WAIT_SECONDS, gang_state
from deepseek_pd.operator.pod_placement import POD_GROUP_API, build_pod_group, pod_groups_named, topology_dropped
from deepseek_pd.operator.spec import DeploymentSpec, InvalidSpecError
from pdtest.schema_admission import validate

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
LAYOUTS = [(1, 0), (2, 0), (4, 0), (2, 8)]  # (size, gpusPerPod) with a valid parallelism


def _spec(scheduling: dict, size: int = 2, gpus: int = 0) -> DeploymentSpec:
    raw = yaml.safe_load((EXAMPLES / "cpu-minimal.yaml").read_text())["spec"]
    raw["scheduling"] = scheduling
    for role in ("prefill", "decode"):
        raw[role].update(size=size, gpusPerPod=gpus, parallelism={}, deepepMode="none", replicas=3)
    return DeploymentSpec.parse("gangs", "llm", raw)


def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value = labels.get(e["key"])
        ok = {"In": value in e["values"], "NotIn": value not in e["values"], "Exists": e["key"] in labels}[e["operator"]]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("size, gpus", LAYOUTS)
def test_gang_renders_a_pod_group_per_group_with_min_count_the_groups_pods(size, gpus):
    spec = _spec({"gang": True}, size, gpus)
    for role in names.ROLES:
        for index in range(3):
            group = build_pod_group(spec, role, index)
            validate(group)
            assert group["apiVersion"] == POD_GROUP_API == "scheduling.k8s.io/v1beta1" and group["kind"] == "PodGroup"
            sts = build_group_statefulset(spec, role, index)
            validate(sts)
            assert group["spec"]["schedulingPolicy"]["gang"]["minCount"] == sts["spec"]["replicas"] == size  # pods
            pod = sts["spec"]["template"]
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": group["metadata"]["name"]}
            assert group["metadata"]["name"] == f"{sts['metadata']['name']}-{spec.role_revision(role)}"
            assert "schedulingConstraints" not in group["spec"]  # no topologyKey
            assert "schedulerName" not in pod["spec"]  # the cluster's default scheduler serves gangs
    named = _spec({"gang": True, "schedulerName": "volcano-ish"})
    assert build_group_statefulset(named, "decode", 0)["spec"]["template"]["spec"]["schedulerName"] == "volcano-ish"


@pytest.mark.parametrize("placement", ["Spread", "Pack"])
def test_topology_keeps_a_group_in_one_domain_and_places_groups_of_a_role(placement):
    """Spread: a hard topology spread constraint over the role's pods, one group's pods of skew
    (the filter kube-scheduler honours in every domain its gang search tries); Pack: preferred
    pod affinity to the role's other groups. Both keep the user's affinity terms."""
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}
    key = random.choice(["example.com/nvlink-domain", "topology.kubernetes.io/rack"])
    size = random.choice([1, 2, 4])
    spec = _spec({"topologyKey": key, "affinity": copy.deepcopy(user), "placement": placement}, size=size)
    sets = {(role, i): build_group_statefulset(spec, role, i) for role in names.ROLES for i in range(3)}
    pods = {k: sts["spec"]["template"] for k, sts in sets.items()}
    for (role, index), pod in pods.items():
        validate(sets[(role, index)])  # the 1.37 schema: topologySpreadConstraints' fields included
        affinity = pod["spec"]["affinity"]
        assert affinity["nodeAffinity"] == user["nodeAffinity"]  # the user's terms kept
        [together] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert together["topologyKey"] == key
        if placement == "Spread":
            [spread] = pod["spec"]["topologySpreadConstraints"]
            assert (spread["topologyKey"], spread["maxSkew"], spread["whenUnsatisfiable"], spread["nodeTaintsPolicy"]) \
                == (key, size, "DoNotSchedule", "Honor"), spread
            assert "podAntiAffinity" not in affinity and "preferredDuringSchedulingIgnoredDuringExecution" \
                not in affinity["podAffinity"]
            others = spread["labelSelector"]
        else:
            [near] = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert near["podAffinityTerm"]["topologyKey"] == key and "topologySpreadConstraints" not in pod["spec"]
            others = near["podAffinityTerm"]["labelSelector"]
        for other, labels in ((k, p["metadata"]["labels"]) for k, p in pods.items()):
            assert _matches(together["labelSelector"], labels) == (other == (role, index)), other
            # Spread counts the role's pods, its own group's too (they share one domain anyway).
            assert _matches(others, labels) == (other[0] == role and (placement == "Spread" or other[1] != index)), other
    assert spec.scheduling["affinity"] == user  # the shared spec was not changed


def test_placement_changes_the_revision_only_with_a_topology_key():
    """Without topologyKey placement shapes no pod: its default (or a value) rolls nothing, so an
    operator upgrade that brings the field does not roll existing deployments."""
    key = "example.com/nvlink-domain"
    for role in names.ROLES:
        assert _spec({}).role_revision(role) == _spec({"placement": "Pack"}).role_revision(role)
        assert _spec({"topologyKey": key}).role_revision(role) != \
            _spec({"topologyKey": key, "placement": "Pack"}).role_revision(role)


def test_placement_defaults_to_spread_and_the_crd_refuses_others():
    assert _spec({"topologyKey": "example.com/nvlink-domain"}).scheduling["placement"] == "Spread"
    with pytest.raises(InvalidSpecError, match="placement"):
        _spec({"topologyKey": "example.com/nvlink-domain", "placement": random.choice(["spread", "Balanced", ""])})


def test_gang_with_topology_constrains_the_pod_group_and_a_new_revision_gets_a_new_one():
    """A PodGroup's spec is immutable: a size or topologyKey change (a new revision) names a new
    PodGroup rather than patching the old, and the pods of each revision name their own."""
    key = random.choice(["example.com/nvlink-domain", "topology.kubernetes.io/rack"])
    spec = _spec({"gang": True, "topologyKey": key})
    index = random.randrange(4)
    group = build_pod_group(spec, "decode", index)
    validate(group)
    assert group["spec"]["schedulingConstraints"] == {"topology": [{"key": key}]}
    pod = build_group_statefulset(spec, "decode", index)["spec"]["template"]["spec"]
    assert pod["schedulingGroup"]["podGroupName"] == group["metadata"]["name"]
    assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]  # kept: the fallback
    for changed in (_spec({"gang": True, "topologyKey": key}, size=4), _spec({"gang": True, "topologyKey": key + "x"})):
        assert build_pod_group(changed, "decode", index)["metadata"]["name"] != group["metadata"]["name"]
    assert build_pod_group(spec, "prefill", index)["metadata"]["name"] != group["metadata"]["name"]


def test_topology_dropped_reads_the_current_revisions_pod_groups_back():
    key = "example.com/nvlink-domain"
    spec = _spec({"gang": True, "topologyKey": key})
    kept = [build_pod_group(spec, role, i) for role in names.ROLES for i in range(2)]
    assert not topology_dropped(spec, []) and not topology_dropped(spec, kept)
    dropped = copy.deepcopy(kept)
    del dropped[random.randrange(len(dropped))]["spec"]["schedulingConstraints"]
    assert topology_dropped(spec, dropped)
    # An older revision's PodGroup (from before topologyKey) says nothing about this server.
    older = build_pod_group(_spec({"gang": True}), "decode", 0)
    assert not topology_dropped(spec, kept + [older])
    assert not topology_dropped(_spec({"gang": True}), dropped)  # no topologyKey: nothing to drop
    now = datetime.datetime.now(datetime.timezone.utc)
    ok, reason, message = gang_state(spec, True, [], REVISIONS, now, topology_dropped=True)
    assert (ok, reason) == (True, "PodGroupsPlaced") and "TopologyAwareWorkloadScheduling" in message, message
    assert "pod affinity only" not in gang_state(spec, True, [], REVISIONS, now)[2]


def test_pod_groups_named_by_statefulsets_are_kept():
    spec = _spec({"gang": True})
    sets = [build_group_statefulset(spec, role, i) for role in names.ROLES for i in range(2)]
    assert pod_groups_named(sets) == {build_pod_group(spec, r, i)["metadata"]["name"] for r in names.ROLES
                                      for i in range(2)}
    assert pod_groups_named([build_group_statefulset(_spec({}), "decode", 0)]) == set()


def test_without_gang_or_topology_the_pods_are_as_before():
    pod = build_group_statefulset(_spec({}), "decode", 1)["spec"]["template"]
    assert "schedulerName" not in pod["spec"] and "affinity" not in pod["spec"]
    assert "schedulingGroup" not in pod["spec"]


def _pod(name: str, age_s: float, now: datetime.datetime, conditions: list[dict], index: int = 0,
         node: str | None = None, grouped: bool = True) -> dict:
    created = (now - datetime.timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    spec = {**({"schedulingGroup": {"podGroupName": f"gangs-decode-{index}"}} if grouped else {}),
            **({"nodeName": node} if node else {})}
    return {"metadata": {"name": name, "creationTimestamp": created,
                         "labels": {names.LABEL_ROLE: "decode", names.LABEL_GROUP_INDEX: str(index),
                                    names.LABEL_REVISION: "r1"}},
            "spec": spec, "status": {"phase": "Pending", "conditions": conditions}}


REVISIONS = {"prefill": "r1", "decode": "r1"}


def test_gang_condition_names_a_missing_api_a_dropped_group_and_a_scheduler_that_never_answers():
    now = datetime.datetime.now(datetime.timezone.utc)
    spec = _spec({"gang": True})
    assert gang_state(_spec({}), False, [], REVISIONS, now) is None
    ok, reason, message = gang_state(spec, False, [], REVISIONS, now)
    assert (ok, reason) == (False, "PodGroupAPIMissing") and "GenericWorkload" in message, message
    young = _pod("gangs-decode-0-0", WAIT_SECONDS / 2, now, [])
    assert gang_state(spec, True, [young], REVISIONS, now)[:2] == (True, "PodGroupsPlaced")
    old = _pod("gangs-decode-0-1", WAIT_SECONDS + 5, now, [])
    ok, reason, message = gang_state(spec, True, [young, old], REVISIONS, now)
    assert (ok, reason) == (False, "NoSchedulerAnswers") and "gangs-decode-0-1" in message and \
        "default-scheduler" in message, message
    # An API server with the API on but its gate off drops the field: the pods are no gang.
    ungrouped = _pod("gangs-decode-0-0", 1, now, [], grouped=False)
    ok, reason, message = gang_state(spec, True, [ungrouped], REVISIONS, now)
    assert (ok, reason) == (False, "SchedulingGroupDropped") and "gangs-decode-0-0" in message, message
    # ... but a pod of an older revision (from before `gang: true`) never had it.
    assert gang_state(spec, True, [ungrouped], {"prefill": "r1", "decode": "r2"}, now)[:2] == (True, "PodGroupsPlaced")


def test_gang_condition_names_the_group_that_waits_for_room_with_the_schedulers_words():
    """A group none of whose pods holds a node while some are Unschedulable waits for room
    (the messages are kube-scheduler's, as tests/k8s/test_real_scheduler.py reads them)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    spec = _spec({"gang": True})
    gang = "pod group is unschedulable, minCount (2) cannot be satisfied: 1 scheduled, 0 remaining"
    nodes = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    refused = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": m} for m in (gang, nodes)]
    waiting = [_pod(f"gangs-decode-1-{r}", WAIT_SECONDS * 3, now, [refused[r]], index=1) for r in range(2)]
    placed = [_pod(f"gangs-decode-0-{r}", WAIT_SECONDS * 3, now, [], node="n1") for r in range(2)]
    ok, reason, message = gang_state(spec, True, placed + waiting, REVISIONS, now)
    assert (ok, reason) == (False, "GangWaitingForRoom"), message
    assert "gangs-decode-1 (2 pods)" in message and gang in message and nodes in message, message
    assert "gangs-decode-0" not in message
    # One rank bound: not a waiting gang (a placed group's restarted rank waits like any pod).
    waiting[0]["spec"]["nodeName"] = "n1"
    assert gang_state(spec, True, placed + waiting, REVISIONS, now)[:2] == (True, "PodGroupsPlaced")


def test_live_operator_reports_gang_scheduling_without_the_pod_group_api(cluster):
    """The emulated API server serves no PodGroup kind, as a cluster with GenericWorkload off."""
    body = _deployment("gang")
    body["spec"]["scheduling"] = {"gang": True}
    cluster.create(body)
    condition = cluster.wait_for("GangScheduling", lambda: _condition(cluster, "gang", "GangScheduling"))
    assert (condition["status"], condition["reason"]) == ("False", "PodGroupAPIMissing"), condition
    sts = cluster.wait_for("a decode group", lambda: cluster.get("StatefulSet", names.group_name("gang", "decode", 0)))
    assert sts["spec"]["template"]["spec"]["schedulingGroup"]["podGroupName"].startswith(sts["metadata"]["name"] + "-")
