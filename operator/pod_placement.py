"""Where a group's pods may go: gang scheduling (a PodGroup per group) and topology.

    spec.scheduling.gang: true      a PodGroup (scheduling.k8s.io/v1beta1, Kubernetes' in-tree
                                    gang scheduling, feature gate GenericWorkload) per group
                                    and revision, gang policy minCount = the group's pods; each pod
                                    names it in spec.schedulingGroup.podGroupName, and the
                                    scheduler's GangScheduling plugin binds all of them or none:
                                    a group that cannot be placed whole stays Pending instead of
                                    holding GPUs with half its ranks
    spec.scheduling.schedulerName   the worker pods' scheduler (default: the cluster's, which
                                    serves gangs once its GenericWorkload gate is on)
    spec.scheduling.topologyKey     one group in one domain (with gang, the PodGroup's topology
                                    constraint, below; and required pod affinity to the group's
                                    own pods on that key: the first pod places the group)
    spec.scheduling.placement       a role's groups relative to one another over those domains:
                                    Spread (default): failure domains, a hard topology spread
                                    constraint over the role's pods; Pack: as few domains as
                                    hold them, preferred pod affinity to the role's other groups

No `Workload` object: it holds PodGroup templates for a controller to stamp out, and the
operator is that controller (it creates each group's PodGroup itself, so `workloadRef` stays unset).
A PodGroup's spec is immutable (and guarded by a finalizer while pods name it), so it is named
after the group AND the role's revision: a new revision (a size or topologyKey change) gets a new
PodGroup, and the old one goes once no StatefulSet names it (reconcile.py).

With gang and topologyKey, the PodGroup also carries `schedulingConstraints.topology` (alpha gate
TopologyAwareWorkloadScheduling on the API server and the scheduler): kube-scheduler then tries
the group in each domain and binds it in one that holds it whole. The pod affinity stays too (it
agrees with the constraint, and it is all a server without the gate keeps: such a server drops
the field silently, and gang_status.py says so): by itself it only makes the scheduler follow
the first rank's domain, retrying with backoff, never searching the others.

Why Spread is a hard rule: the search compares the domains that hold a group by kube-scheduler's
placement scorers only (NodeResourcesFit with MostAllocated, fixed in 1.37; PodGroupPodsCount),
never by the pods' own scores, so a preferred anti-affinity between groups is ignored there and
the groups pack (tests/k8s/test_real_scheduler.py). A filter is honoured in every candidate
domain: the spread constraint (maxSkew = the group's pods, whenUnsatisfiable DoNotSchedule)
refuses a domain that already holds more of the role's pods than the emptiest eligible one, and
the same rule spreads pod-by-pod scheduling without gang. `nodeTaintsPolicy: Honor`: a domain
whose nodes are cordoned or NotReady (taints the pods do not tolerate) does not count as the
emptiest, so it does not hold the other groups back. Pack needs no filter with gang (the scorers
pack); the preferred affinity packs pod-by-pod scheduling.

Worked example: topologyKey example.com/nvlink-domain, decode groups of 2 pods, domains A and
B with room for several groups each. Spread (maxSkew 2): group 0 goes to A; a rank of group 1
in A would make A hold 3 of the role's pods against B's 0, a skew of 3 > 2, so group 1 goes to
B; group 2 may go to either (3 against 2); group 3 then must take the other domain (5 against
2 is refused): more groups than domains still schedule, balanced. Pack: group 1 joins group 0
in A while A has room. With
gang, decode group 0 (2 pods of 1 GPU) on a node with 1 free GPU: neither pod binds (the
default plugins alone would bind rank 0 and leave rank 1 Pending); at 2 free GPUs both bind.
"""
from __future__ import annotations

import copy
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.spec import DeploymentSpec

Manifest = dict[str, Any]
POD_GROUP_API = "scheduling.k8s.io/v1beta1"
DEFAULT_SCHEDULER = "default-scheduler"  # what the API server fills in for a pod that names none


def scheduler_name(spec: DeploymentSpec) -> str | None:
    """The worker pods' schedulerName; None: the cluster's default scheduler."""
    return spec.scheduling.get("schedulerName") or None


def pod_group_name(spec: DeploymentSpec, role_name: str, index: int) -> str:
    """`<group>-<role revision>`: the PodGroup of the group's current revision."""
    return f"{names.group_name(spec.name, role_name, index)}-{spec.role_revision(role_name)}"


def build_pod_group(spec: DeploymentSpec, role_name: str, index: int) -> Manifest:
    """The group's gang: the scheduler admits its pods only when all `size` of them fit (the
    plugin's own Permit timeout, 5 min, releases ranks that were placed while the rest never
    were), within one domain of `topologyKey` if set."""
    key = spec.scheduling.get("topologyKey")
    constraints = {"schedulingConstraints": {"topology": [{"key": key}]}} if key else {}
    return {
        "apiVersion": POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": {"name": pod_group_name(spec, role_name, index), "namespace": spec.namespace,
                     "labels": {**names.base_labels(spec.name, role_name),
                                **names.group_selector(spec.name, role_name, index)}},
        "spec": {"schedulingPolicy": {"gang": {"minCount": spec.role(role_name).size}}, **constraints},
    }


def pod_groups_named(statefulsets: list[Manifest]) -> set[str]:
    """The PodGroups the StatefulSets' pod templates name (kept while a group of an older
    revision still runs: its pods, and any that it recreates, wait for theirs)."""
    return {name for sts in statefulsets
            if (name := ((((sts.get("spec") or {}).get("template") or {}).get("spec") or {})
                         .get("schedulingGroup") or {}).get("podGroupName"))}


def topology_dropped(spec: DeploymentSpec, pod_groups: list[Manifest]) -> bool:
    """Did the API server drop the topology constraint of this revision's PodGroups (its
    TopologyAwareWorkloadScheduling gate is off)? False before any of them was read back."""
    key = spec.scheduling.get("topologyKey")
    if not (key and spec.scheduling.get("gang")):
        return False
    revisions = {role: spec.role_revision(role) for role in names.ROLES}
    current = [g for g in pod_groups
               if (role := (g["metadata"].get("labels") or {}).get(names.LABEL_ROLE)) in revisions
               and g["metadata"]["name"].endswith(f"-{revisions[role]}")]
    return any(not (g.get("spec") or {}).get("schedulingConstraints") for g in current)


def place_group_pods(spec: DeploymentSpec, role_name: str, index: int, template: Manifest) -> Manifest:
    """The group's pod template with its PodGroup, scheduler and topology rules added; the
    user's scheduling.affinity is kept (copied, never changed: it is shared by every group)."""
    template = copy.deepcopy(template)
    pod = template["spec"]
    name = scheduler_name(spec)
    if name:
        pod["schedulerName"] = name
    if spec.scheduling.get("gang"):
        pod["schedulingGroup"] = {"podGroupName": pod_group_name(spec, role_name, index)}
    key = spec.scheduling.get("topologyKey")
    if key:
        affinity = pod.setdefault("affinity", {})
        together = affinity.setdefault("podAffinity", {})
        together.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append({
            "labelSelector": {"matchLabels": names.group_selector(spec.name, role_name, index)},
            "topologyKey": key})
        if spec.scheduling["placement"] == "Spread":
            pod.setdefault("topologySpreadConstraints", []).append(_spread(spec, role_name, key))
        else:
            together.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append({
                "weight": 100, "podAffinityTerm": _other_groups(spec, role_name, index, key)})
    return template


def _spread(spec: DeploymentSpec, role_name: str, key: str) -> Manifest:
    # maxSkew counts pods: one group's worth lets a domain hold one group more than the emptiest,
    # never two, and a group's own ranks (all in one domain) never trip it.
    return {"maxSkew": spec.role(role_name).size, "topologyKey": key, "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": names.role_selector(spec.name, role_name)},
            "nodeTaintsPolicy": "Honor"}


def _other_groups(spec: DeploymentSpec, role_name: str, index: int, key: str) -> Manifest:
    return {"labelSelector": {"matchLabels": names.role_selector(spec.name, role_name),
                              "matchExpressions": [{"key": names.LABEL_GROUP_INDEX, "operator": "NotIn",
                                                    "values": [str(index)]}]},
            "topologyKey": key}
