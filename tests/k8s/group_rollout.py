"""A role's groups during a rollout, read from their pods, for the operator end-to-end test.

    watch = GroupWatch(kube, namespace, deployment, "decode", size=1)
    watch.sample()         one poll: which groups are ready, and which image each group's pods run
    watch.min_ready        the fewest ready groups any poll saw (the rollout's floor:
                           replicas - maxUnavailable)
    replacement_order(...) the groups in the order their new-image pods were created, each with
                           when it was created and when it became Ready (from the pods' own
                           timestamps, so a poll that missed a moment cannot hide an overlap)
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
GROUP_INDEX = "deepseek-pd.io/group-index"


def _time(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)


def _ready(pod: Obj) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


@dataclass
class GroupWatch:
    kube: Any  # kube_rest.Kube
    namespace: str
    deployment: str
    role: str
    size: int
    samples: list[dict[int, tuple[bool, frozenset[str]]]] = field(default_factory=list)

    def pods(self) -> list[Obj]:
        selector = f"deepseek-pd.io/deployment={self.deployment},deepseek-pd.io/role={self.role}"
        return [p for p in self.kube.list(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector)
                if not p["metadata"].get("deletionTimestamp")]

    def sample(self) -> dict[int, tuple[bool, frozenset[str]]]:
        """group -> (every rank exists and is Ready, the images its pods run)."""
        by_group: dict[int, list[Obj]] = {}
        for pod in self.pods():
            by_group.setdefault(int(pod["metadata"]["labels"][GROUP_INDEX]), []).append(pod)
        seen = {g: (len(pods) == self.size and all(_ready(p) for p in pods),
                    frozenset(c["image"] for p in pods for c in p["spec"]["containers"]))
                for g, pods in by_group.items()}
        self.samples.append(seen)
        return seen

    @property
    def min_ready(self) -> int:
        return min(sum(ready for ready, _ in s.values()) for s in self.samples)


def replacement_order(pods: list[Obj], image: str) -> list[tuple[int, datetime.datetime, datetime.datetime]]:
    """(group, first new-image pod created, last new-image pod Ready) for every group whose pods all
    run `image` and are Ready, ordered by creation."""
    by_group: dict[int, list[Obj]] = {}
    for pod in pods:
        by_group.setdefault(int(pod["metadata"]["labels"][GROUP_INDEX]), []).append(pod)
    order = []
    for group, members in by_group.items():
        if not all(c["image"] == image for p in members for c in p["spec"]["containers"]) or \
                not all(_ready(p) for p in members):
            continue
        created = min(_time(p["metadata"]["creationTimestamp"]) for p in members)
        ready = max(_time(c["lastTransitionTime"]) for p in members for c in p["status"]["conditions"]
                    if c["type"] == "Ready")
        order.append((group, created, ready))
    return sorted(order, key=lambda row: row[1])
