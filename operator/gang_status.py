"""The GangScheduling condition: is `spec.scheduling.gang` served, and is every gang placed?

    True   PodGroupsPlaced      every group's PodGroup exists and no group waits for room (pods
                                not yet looked at by a scheduler for under WAIT_SECONDS count as
                                fine: the scheduler has not had its turn)
    False  PodGroupAPIMissing   the API server serves no scheduling.k8s.io/v1beta1 PodGroup (beta,
                                off by default in 1.37: its GenericWorkload gate and
                                --runtime-config): no PodGroup is created
    False  SchedulingGroupDropped  a current-revision worker pod has no spec.schedulingGroup:
                                the API server serves PodGroup with its GenericWorkload gate off,
                                so the pods are not gang-scheduled at all
    False  NoSchedulerAnswers   worker pods have waited WAIT_SECONDS for `schedulerName` and no
                                scheduler has written a PodScheduled condition on them
    False  GangWaitingForRoom   a group's pods are Unschedulable and none of them holds a node:
                                the gang did its job (no rank holds GPUs while others cannot
                                start); the message names the group and the scheduler's reason

With topologyKey, a PodGroup read back without its `schedulingConstraints` (an API server
whose TopologyAwareWorkloadScheduling gate is off drops it) adds TOPOLOGY_BY_AFFINITY to the
message: the groups still share a domain, by pod affinity, but the scheduler does not search
the domains for one that holds a group whole.

Worked example: decode group 0 of 2 pods of 1 GPU each, on a cluster with 1 free GPU:
    GangScheduling=False GangWaitingForRoom "group llm-decode-0 (2 pods) cannot be placed whole,
    so none of its pods holds a node: pod group is unschedulable, minCount (2) cannot be
    satisfied: 1 scheduled, 0 remaining, ... | 0/1 nodes are available: 1 Insufficient
    nvidia.com/gpu."   (kube-scheduler's words, from the pods' PodScheduled conditions)
"""
from __future__ import annotations

import datetime
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.pod_placement import DEFAULT_SCHEDULER, scheduler_name
from deepseek_pd.operator.spec import DeploymentSpec

CONDITION = "GangScheduling"
TOPOLOGY_BY_AFFINITY = (
    "; topologyKey is kept by pod affinity only: this API server dropped the PodGroups' "
    "schedulingConstraints.topology (turn on the alpha gate TopologyAwareWorkloadScheduling on "
    "kube-apiserver and kube-scheduler), so kube-scheduler follows the first rank's domain "
    "instead of searching the domains for one that holds the group whole")
WAIT_SECONDS = 60.0
Pod = dict[str, Any]


def _age(pod: Pod, now: datetime.datetime) -> float:
    created = pod["metadata"].get("creationTimestamp")
    if not created:
        return 0.0
    return (now - datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()


def _scheduled(pod: Pod) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"),
                None)


def _group(pod: Pod) -> tuple[str, int] | None:
    """(role, group index) of a worker pod; None for the router's and others'."""
    labels = pod["metadata"].get("labels") or {}
    role, index = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GROUP_INDEX)
    return (role, int(index)) if role and index is not None and index.isdigit() else None


def _shown(items: list[str]) -> str:
    return ", ".join(items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _waiting_for_room(spec: DeploymentSpec, workers: list[Pod]) -> str | None:
    """The message naming groups whose pods are all unbound and some Unschedulable; None if none."""
    groups: dict[tuple[str, int], list[Pod]] = {}
    for pod in workers:
        key = _group(pod)
        if key is not None:
            groups.setdefault(key, []).append(pod)
    stuck = []
    for (role, index), pods in sorted(groups.items()):
        refused = sorted((p for p in pods if (_scheduled(p) or {}).get("reason") == "Unschedulable"),
                         key=lambda p: p["metadata"]["name"])
        if refused and not any((p.get("spec") or {}).get("nodeName") for p in pods):
            # The ranks that would fit carry the gang's verdict ("minCount (4) cannot be satisfied:
            # 2 scheduled"), the others the nodes' reason ("Insufficient nvidia.com/gpu"): both shown.
            said = dict.fromkeys((_scheduled(p) or {}).get("message", "") for p in refused)
            stuck.append((names.group_name(spec.name, role, index), len(pods), " | ".join(filter(None, said))))
    if not stuck:
        return None
    group, count, message = stuck[0]
    more = f" ({len(stuck) - 1} more group(s) wait too)" if len(stuck) > 1 else ""
    return f"group {group} ({count} pods) cannot be placed whole, so none of its pods holds a node: {message}{more}"


def gang_state(spec: DeploymentSpec, pod_groups_served: bool, pods: list[Pod], revisions: dict[str, str],
               now: datetime.datetime, topology_dropped: bool = False) -> tuple[bool, str, str] | None:
    """(ok, reason, message) of the condition; None when gang scheduling is off. `revisions`:
    each role's current pod-template revision (older pods may predate `gang: true`);
    `topology_dropped`: the server dropped the PodGroups' topology (pod_placement.topology_dropped)."""
    if not spec.scheduling.get("gang"):
        return None
    scheduler = scheduler_name(spec) or DEFAULT_SCHEDULER
    if not pod_groups_served:
        return (False, "PodGroupAPIMissing",
                "spec.scheduling.gang needs Kubernetes' in-tree PodGroup (scheduling.k8s.io/v1beta1, "
                "beta in 1.37 and off by default): kube-apiserver --feature-gates=GenericWorkload=true "
                "--runtime-config=scheduling.k8s.io/v1beta1=true, and the same gate on the scheduler "
                f"{scheduler} (its GangScheduling plugin); this API server serves no PodGroup, so none "
                "was created")
    workers = [p for p in pods if _group(p) and not (p["metadata"].get("deletionTimestamp"))]
    current = [p for p in workers if (p["metadata"].get("labels") or {}).get(names.LABEL_REVISION)
               == revisions.get(p["metadata"]["labels"][names.LABEL_ROLE])]
    dropped = sorted(p["metadata"]["name"] for p in current if not (p.get("spec") or {}).get("schedulingGroup"))
    if dropped:
        return (False, "SchedulingGroupDropped",
                f"{_shown(dropped)} lost spec.schedulingGroup: this API server serves PodGroup but its "
                "GenericWorkload feature gate is off, so it drops the field and the pods are scheduled "
                "one by one, not as gangs; turn the gate on (kube-apiserver --feature-gates="
                "GenericWorkload=true)")
    waiting = sorted(p["metadata"]["name"] for p in workers
                     if (p.get("status") or {}).get("phase", "Pending") == "Pending"
                     and not (p.get("spec") or {}).get("nodeName")
                     and _scheduled(p) is None and _age(p, now) >= WAIT_SECONDS)
    if waiting:
        return (False, "NoSchedulerAnswers",
                f"{_shown(waiting)} waited over {WAIT_SECONDS:.0f} s for scheduler {scheduler}, which never "
                f"looked at them: is a scheduler of that name (with the GenericWorkload gate) running?")
    note = TOPOLOGY_BY_AFFINITY if topology_dropped else ""
    room = _waiting_for_room(spec, workers)
    if room:
        return False, "GangWaitingForRoom", room + note
    return True, "PodGroupsPlaced", f"one PodGroup per group, scheduled by {scheduler}; no group waits for room{note}"
