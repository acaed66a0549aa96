"""Pods the scheduler cannot place, reported on the Available condition.

A group whose pods ask for GPUs, RDMA devices or node labels that no node has never starts, and
nothing else in the status says why: its pods sit Pending with the scheduler's reason on their
`PodScheduled` condition. When the deployment is not Available, that reason becomes the
condition's own:

    Available=False  reason PodsUnschedulable
                     message "2 pod(s) cannot be scheduled; v3-prefill-0-0: 0/4 nodes are
                              available: 4 Insufficient nvidia.com/gpu."

Only the first pod's message is quoted (the others of one role say the same).
"""
from __future__ import annotations

from typing import Any

REASON = "PodsUnschedulable"


def unschedulable_pods(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(pod name, scheduler message) of every pod marked Unschedulable, by name."""
    out = []
    for pod in pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                    and condition.get("reason") == "Unschedulable":
                out.append((pod["metadata"]["name"], condition.get("message", "")))
    return sorted(out)


def explain_unavailable(status: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """`status` with Available's reason and message naming unschedulable pods, if any (the
    condition's status and transition time are unchanged)."""
    stuck = unschedulable_pods(pods)
    conditions = status.get("conditions") or []
    available = next((c for c in conditions if c.get("type") == "Available"), None)
    if not stuck or available is None or available.get("status") != "False":
        return status
    first, message = stuck[0]
    explained = {**available, "reason": REASON,
                 "message": f"{len(stuck)} pod(s) cannot be scheduled; {first}: {message}"}
    return {**status, "conditions": [explained if c is available else c for c in conditions]}
