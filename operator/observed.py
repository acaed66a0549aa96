"""What exists in the cluster for one role, reduced to the facts the planner decides on.

A group's state comes from its StatefulSet (its revision annotation says which template it runs)
and its pods (phase, readiness, restarts). Pods being deleted are ignored: they are on their way
out, and counting them would make a group restart twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_pd.operator import names


@dataclass(frozen=True)
class PodState:
    name: str
    rank: int
    revision: str
    phase: str
    ready: bool
    restarts: int

    @property
    def failed(self) -> bool:
        """A pod that died or restarted: its group's collective state (NCCL, KV) is gone."""
        return self.phase == "Failed" or self.restarts > 0

    @classmethod
    def from_pod(cls, pod: dict[str, Any]) -> PodState:
        meta = pod.get("metadata", {})
        status = pod.get("status", {}) or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions", []) or [])
        restarts = sum(int(c.get("restartCount", 0) or 0)
                       for c in status.get("containerStatuses", []) or [])
        name = meta.get("name", "")
        labels = meta.get("labels", {}) or {}
        rank_text = labels.get(names.LABEL_POD_INDEX) or name.rsplit("-", 1)[-1]
        return cls(
            name=name,
            rank=int(rank_text) if rank_text.isdigit() else -1,
            revision=labels.get(names.LABEL_REVISION, ""),
            phase=status.get("phase", "Pending"),
            ready=ready and status.get("phase") == "Running",
            restarts=restarts,
        )


@dataclass(frozen=True)
class GroupState:
    """One group: `revision` is what its StatefulSet was built from; `terminating` while it goes."""

    index: int
    revision: str
    terminating: bool
    pods: tuple[PodState, ...]

    def is_ready(self, size: int) -> bool:
        """Every rank exists, runs the group's revision and is Ready."""
        ranks = {p.rank for p in self.pods if p.ready and p.revision == self.revision}
        return not self.terminating and ranks == set(range(size))

    @property
    def failed_pods(self) -> tuple[PodState, ...]:
        return tuple(p for p in self.pods if p.failed)


def _is_terminating(obj: dict[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def _group_index(obj: dict[str, Any]) -> int | None:
    text = (obj.get("metadata", {}).get("labels", {}) or {}).get(names.LABEL_GROUP_INDEX, "")
    return int(text) if text.isdigit() else None


def groups_of_role(role: str, statefulsets: list[dict], pods: list[dict]) -> dict[int, GroupState]:
    """Groups of one role, keyed by index, from the objects listed with our deployment label."""
    def of_role(obj: dict) -> bool:
        return (obj.get("metadata", {}).get("labels", {}) or {}).get(names.LABEL_ROLE) == role

    pods_by_group: dict[int, list[PodState]] = {}
    for pod in pods:
        index = _group_index(pod)
        if of_role(pod) and index is not None and not _is_terminating(pod):
            pods_by_group.setdefault(index, []).append(PodState.from_pod(pod))
    groups = {}
    for sts in statefulsets:
        index = _group_index(sts)
        if not of_role(sts) or index is None:
            continue
        revision = (sts["metadata"].get("annotations", {}) or {}).get(names.ANNOTATION_REVISION, "")
        pods_of_group = tuple(sorted(pods_by_group.get(index, []), key=lambda p: p.rank))
        groups[index] = GroupState(index, revision, _is_terminating(sts), pods_of_group)
    return groups
