"""Gang scheduling and topology of the rendered groups (operator/pod_placement.py, gang_status.py):
the PodGroup each group gets (checked against the spec schema scheduler-plugins publishes for
scheduling.x-k8s.io/v1alpha1 PodGroup, restated below), the pod-group label and scheduler on its
pods, the affinity terms read with the label-selector semantics against the pods' own labels,
and the GangScheduling condition; the live operator reports a cluster without the PodGroup CRD."""
from __future__ import annotations

import copy
import datetime
import pathlib
import random

import jsonschema
import pytest
import yaml
from test_operator_kopf import _condition, _deployment

from deepseek_pd.operator import names
from deepseek_pd.operator.build_workers import build_group_statefulset
from deepseek_pd.operator.gang_status import WAIT_SECONDS, gang_state
from deepseek_pd.operator.pod_placement import GANG_SCHEDULER, POD_GROUP_LABEL, build_pod_group
from deepseek_pd.operator.spec import DeploymentSpec

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
# The spec of podgroups.scheduling.x-k8s.io v1alpha1 (sigs.k8s.io/scheduler-plugins,
# config/crd/bases/scheduling.x-k8s.io_podgroups.yaml), as a plain JSON schema.
INT32 = {"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1}
POD_GROUP_SPEC = {"type": "object", "additionalProperties": False, "properties": {
    "minMember": {**INT32, "minimum": 1},
    "minResources": {"type": "object", "additionalProperties": {"type": ["integer", "string"]}},
    "scheduleTimeoutSeconds": INT32}}
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
def test_gang_renders_a_pod_group_per_group_with_min_member_the_groups_pods(size, gpus):
    spec = _spec({"gang": True}, size, gpus)
    for role in names.ROLES:
        for index in range(3):
            group = build_pod_group(spec, role, index)
            jsonschema.validate(group["spec"], POD_GROUP_SPEC)
            assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["kind"] == "PodGroup"
            sts = build_group_statefulset(spec, role, index)
            assert group["spec"]["minMember"] == sts["spec"]["replicas"] == size  # pods, not ranks
            pod = sts["spec"]["template"]
            assert pod["metadata"]["labels"][POD_GROUP_LABEL] == group["metadata"]["name"] == sts["metadata"]["name"]
            assert pod["spec"]["schedulerName"] == GANG_SCHEDULER
    named = _spec({"gang": True, "schedulerName": "volcano-ish"})
    assert build_group_statefulset(named, "decode", 0)["spec"]["template"]["spec"]["schedulerName"] == "volcano-ish"


def test_topology_keeps_a_group_in_one_domain_and_spreads_groups_of_a_role():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}}
    key = random.choice(["example.com/nvlink-domain", "topology.kubernetes.io/rack"])
    spec = _spec({"topologyKey": key, "affinity": copy.deepcopy(user)})
    pods = {(role, i): build_group_statefulset(spec, role, i)["spec"]["template"]
            for role in names.ROLES for i in range(3)}
    for (role, index), pod in pods.items():
        affinity = pod["spec"]["affinity"]
        assert affinity["nodeAffinity"] == user["nodeAffinity"]  # the user's terms kept
        [together] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        [apart] = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert together["topologyKey"] == apart["podAffinityTerm"]["topologyKey"] == key
        for other, labels in ((k, p["metadata"]["labels"]) for k, p in pods.items()):
            assert _matches(together["labelSelector"], labels) == (other == (role, index)), other
            assert _matches(apart["podAffinityTerm"]["labelSelector"], labels) == \
                (other[0] == role and other[1] != index), other
    assert spec.scheduling["affinity"] == user  # the shared spec was not changed


def test_without_gang_or_topology_the_pods_are_as_before():
    pod = build_group_statefulset(_spec({}), "decode", 1)["spec"]["template"]
    assert "schedulerName" not in pod["spec"] and "affinity" not in pod["spec"]
    assert POD_GROUP_LABEL not in pod["metadata"]["labels"]


def _pod(name: str, age_s: float, now: datetime.datetime, conditions: list[dict]) -> dict:
    created = (now - datetime.timedelta(seconds=age_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": name, "creationTimestamp": created, "labels": {names.LABEL_ROLE: "decode"}},
            "spec": {}, "status": {"phase": "Pending", "conditions": conditions}}


def test_gang_condition_names_a_missing_crd_and_a_scheduler_that_never_answers():
    now = datetime.datetime.now(datetime.timezone.utc)
    spec = _spec({"gang": True})
    assert gang_state(_spec({}), False, [], now) is None
    ok, reason, message = gang_state(spec, False, [], now)
    assert (ok, reason) == (False, "PodGroupCRDMissing") and "podgroups.scheduling.x-k8s.io" in message
    young = _pod("gangs-decode-0-0", WAIT_SECONDS / 2, now, [])
    assert gang_state(spec, True, [young], now)[:2] == (True, "PodGroupsCreated")
    old = _pod("gangs-decode-0-1", WAIT_SECONDS + 5, now, [])
    ok, reason, message = gang_state(spec, True, [young, old], now)
    assert (ok, reason) == (False, "NoSchedulerAnswers") and "gangs-decode-0-1" in message and GANG_SCHEDULER in message
    # A scheduler that found no room for the whole gang says so on the pods: the gang works.
    waiting = _pod("gangs-decode-0-1", WAIT_SECONDS * 3, now, [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}])
    assert gang_state(spec, True, [waiting], now)[:2] == (True, "PodGroupsCreated")


def test_live_operator_reports_gang_scheduling_without_the_pod_group_crd(cluster):
    """The emulated API server serves no PodGroup kind, as a cluster without scheduler-plugins."""
    body = _deployment("gang")
    body["spec"]["scheduling"] = {"gang": True}
    cluster.create(body)
    condition = cluster.wait_for("GangScheduling", lambda: _condition(cluster, "gang", "GangScheduling"))
    assert (condition["status"], condition["reason"]) == ("False", "PodGroupCRDMissing"), condition
    sts = cluster.wait_for("a decode group", lambda: cluster.get("StatefulSet", names.group_name("gang", "decode", 0)))
    assert sts["spec"]["template"]["spec"]["schedulerName"] == GANG_SCHEDULER  # its pods wait for it
