"""The GangScheduling condition: is there a scheduler that serves `spec.scheduling.gang`?

    True   PodGroupsCreated     the PodGroups exist and every pending worker pod has been looked
                                at by its scheduler (or none is pending)
    False  PodGroupCRDMissing   the API server serves no PodGroup kind: sigs.k8s.io/scheduler-
                                plugins is not installed; no PodGroup is created
    False  NoSchedulerAnswers   worker pods have waited WAIT_SECONDS for `schedulerName` and no
                                scheduler has written a PodScheduled condition on them: nothing
                                runs under that name

A pod that a scheduler found no room for has PodScheduled=False/Unschedulable: that is the gang
working (the whole group waits), reported by pod_scheduling.py, not here.
"""
from __future__ import annotations

import datetime
from typing import Any

from deepseek_pd.operator import names
from deepseek_pd.operator.pod_placement import scheduler_name
from deepseek_pd.operator.spec import DeploymentSpec

CONDITION = "GangScheduling"
WAIT_SECONDS = 60.0


def _age(pod: dict[str, Any], now: datetime.datetime) -> float:
    created = pod["metadata"].get("creationTimestamp")
    if not created:
        return 0.0
    return (now - datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds()


def gang_state(spec: DeploymentSpec, pod_groups_served: bool, pods: list[dict[str, Any]],
               now: datetime.datetime) -> tuple[bool, str, str] | None:
    """(ok, reason, message) of the condition; None when gang scheduling is off."""
    if not spec.scheduling.get("gang"):
        return None
    scheduler = scheduler_name(spec)
    if not pod_groups_served:
        return (False, "PodGroupCRDMissing",
                f"spec.scheduling.gang needs the PodGroup CRD (podgroups.scheduling.x-k8s.io) and a "
                f"scheduler named {scheduler} running the coscheduling plugin of sigs.k8s.io/"
                f"scheduler-plugins; this API server serves no PodGroup, so none was created and the "
                f"worker pods wait for {scheduler}")
    waiting = sorted(p["metadata"]["name"] for p in pods
                     if (p["metadata"].get("labels") or {}).get(names.LABEL_ROLE)
                     and (p.get("status") or {}).get("phase", "Pending") == "Pending"
                     and not (p["spec"] or {}).get("nodeName")
                     and not any(c.get("type") == "PodScheduled" for c in (p.get("status") or {}).get("conditions") or [])
                     and _age(p, now) >= WAIT_SECONDS)
    if waiting:
        shown = ", ".join(waiting[:3]) + (f" and {len(waiting) - 3} more" if len(waiting) > 3 else "")
        return (False, "NoSchedulerAnswers",
                f"{shown} waited over {WAIT_SECONDS:.0f} s for scheduler {scheduler}, which never looked "
                f"at them: is a scheduler of that name (with the coscheduling plugin) running?")
    return True, "PodGroupsCreated", f"one PodGroup per group, scheduled by {scheduler}"
