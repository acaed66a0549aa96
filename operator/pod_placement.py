"""Where a group's pods may go: gang scheduling (a PodGroup per group) and topology.

    spec.scheduling.gang: true      a PodGroup (scheduling.x-k8s.io/v1alpha1, the coscheduling
                                    plugin of sigs.k8s.io/scheduler-plugins) named after the group,
                                    minMember = the group's pods; the pods carry its label and
                                    go to `schedulerName` (default scheduler-plugins-scheduler),
                                    which binds all of them or none: a group that cannot be
                                    placed whole stays Pending instead of holding GPUs with half
                                    its ranks
    spec.scheduling.topologyKey     one group in one domain (required pod affinity to the
                                    group's own pods on that key; the first pod places the group),
                                    groups of a role apart (preferred anti-affinity to the role's
                                    other groups, so more groups than domains still schedule)

Worked example: topologyKey example.com/nvlink-domain, decode groups 0 and 1 of 2 pods each on
nodes of domains A and B: group 0's second pod must join its first pod's domain; group 1
prefers the domain without group 0.
"""
from __future__ import annotations

import copy
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

Manifest = dict[str, Any]
POD_GROUP_API = "scheduling.x-k8s.io/v1alpha1"
POD_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
GANG_SCHEDULER = "scheduler-plugins-scheduler"  # the name scheduler-plugins' install gives it
GANG_TIMEOUT_SECONDS = 600  # how long placed ranks wait for the rest before all are released


def scheduler_name(spec: DeploymentSpec) -> str | None:
    """The worker pods' schedulerName; None: the cluster's default scheduler."""
    return spec.scheduling.get("schedulerName") or (GANG_SCHEDULER if spec.scheduling.get("gang") else None)


def build_pod_group(spec: DeploymentSpec, role_name: str, index: int) -> Manifest:
    group = names.group_name(spec.name, role_name, index)
    return {
        "apiVersion": POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": {"name": group, "namespace": spec.namespace,
                     "labels": {**names.base_labels(spec.name, role_name),
                                **names.group_selector(spec.name, role_name, index)}},
        "spec": {"minMember": spec.role(role_name).size, "scheduleTimeoutSeconds": GANG_TIMEOUT_SECONDS},
    }


def place_group_pods(spec: DeploymentSpec, role_name: str, index: int, template: Manifest) -> Manifest:
    """The group's pod template with its gang label, scheduler and topology rules added; the
    user's scheduling.affinity is kept (copied, never changed: it is shared by every group)."""
    template = copy.deepcopy(template)
    pod = template["spec"]
    name = scheduler_name(spec)
    if name:
        pod["schedulerName"] = name
    if spec.scheduling.get("gang"):
        template["metadata"]["labels"][POD_GROUP_LABEL] = names.group_name(spec.name, role_name, index)
    key = spec.scheduling.get("topologyKey")
    if key:
        affinity = pod.setdefault("affinity", {})
        together = affinity.setdefault("podAffinity", {})
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append({
            "labelSelector": {"matchLabels": names.group_selector(spec.name, role_name, index)},
            "topologyKey": key})
        apart = affinity.setdefault("podAntiAffinity", {})
        apart.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append({
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": names.role_selector(spec.name, role_name),
                                  "matchExpressions": [{"key": names.LABEL_GROUP_INDEX, "operator": "NotIn",
                                                        "values": [str(index)]}]},
                "topologyKey": key}})
    return template
