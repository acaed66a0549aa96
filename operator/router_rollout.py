"""Whether the router has stopped sending requests to the groups it no longer lists.

A router with Static worker discovery learns which groups exist from its arguments, so retiring
a group (scale-down, a surge group after a rollout) changes the router Deployment, and router pods
still running the old arguments keep picking that group until the Deployment controller has
replaced them. The operator therefore deletes a retired group only once the router rollout that
dropped it is complete, judged the way `kubectl rollout status` does:

    pass 1  decode replicas 3 -> 2   router patched without group 2; group 2 kept  (old hash)
    pass 2                           new router pod registering workers; kept      (updated 0/1)
    pass 3                           new pod Ready, old pod gone               -> delete group 2

A rollout that cannot finish (new router pods that never become Ready) does not hold groups
forever: once the Deployment reports ProgressDeadlineExceeded they are deleted anyway.
"""
from __future__ import annotations

from typing import Any

from deepseek_pd.operator import names

# How long a router rollout may take before the Deployment reports ProgressDeadlineExceeded
# (the Kubernetes default, written out because scale-down waits on it).
PROGRESS_DEADLINE_SECONDS = 600


def router_rolled_out(deployment: dict[str, Any] | None, desired_hash: str) -> bool:
    """True when every router pod runs the manifest whose hash is `desired_hash` (or when the
    rollout has given up, or there is no router at all)."""
    if deployment is None:
        return True
    meta = deployment.get("metadata", {})
    if (meta.get("annotations") or {}).get(names.ANNOTATION_APPLIED_HASH) != desired_hash:
        return False  # being patched in this pass: its pods run older arguments
    status = deployment.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Progressing" and condition.get("reason") == "ProgressDeadlineExceeded":
            return True
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    return updated >= wanted and total == updated  # no pod with the old arguments is left
