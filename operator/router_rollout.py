"""Whether the router has stopped sending requests to the groups it no longer lists.

A router with Static worker discovery learns which groups exist from its arguments, so retiring
a group (scale-down, a surge group after a rollout) changes the router Deployment, and router pods
still running the old arguments keep picking that group until the Deployment controller has
replaced them. The operator therefore deletes a retired group only once the router rollout that
dropped it is complete, judged the way `kubectl rollout status` does:

    pass 1  decode replicas 3 -> 2   router patched without group 2; group 2 kept  (old hash)
    pass 2                           new router pod registering workers; kept      (updated 0/1)
    pass 3                           new pod Ready, old pod terminating        (drains; kept)
    pass 4                           old pod gone                              -> delete group 2

"Old pod gone" is read from the pods, not from the Deployment's status: the Deployment controller
stops counting a pod the moment it is deleted, while the pod itself goes on serving the streams it
had accepted for up to its grace period (the router drains on SIGTERM). Deleting the group then
would cut those streams mid-answer, so a retired group is kept while any router pod, terminating
or not, still names it in its arguments.

A rollout that cannot finish (new router pods that never become Ready) does not hold groups
forever: once the Deployment reports ProgressDeadlineExceeded they are deleted anyway.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable
from typing import Any

from deepseek_pd.operator import names

# How long a router rollout may take before the Deployment reports ProgressDeadlineExceeded
# (the Kubernetes default, written out because scale-down waits on it).
PROGRESS_DEADLINE_SECONDS = 600


def rollout_gave_up(deployment: dict[str, Any] | None) -> bool:
    """The Deployment controller reports that the router rollout cannot finish."""
    status = (deployment or {}).get("status") or {}
    return any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
               for c in status.get("conditions") or [])


def router_rolled_out(deployment: dict[str, Any] | None, desired_hash: str) -> bool:
    """True when the Deployment controller counts only router pods that run the manifest whose
    hash is `desired_hash` (or when the rollout has given up, or there is no router at all).
    Terminating pods are not counted: see `groups_still_named`."""
    if deployment is None:
        return True
    meta = deployment.get("metadata", {})
    if (meta.get("annotations") or {}).get(names.ANNOTATION_APPLIED_HASH) != desired_hash:
        return False  # being patched in this pass: its pods run older arguments
    status = deployment.get("status") or {}
    if rollout_gave_up(deployment):
        return True
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    return updated >= wanted and total == updated  # no pod with the old arguments is left


def is_router_pod(pod: dict[str, Any]) -> bool:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(names.LABEL_COMPONENT) == "router"


def _past_its_grace(pod: dict[str, Any], now: datetime.datetime) -> bool:
    """A deleted pod whose grace period has run out (deletionTimestamp is the deletion time plus the
    grace): its kubelet has killed it, or is gone with its node, so it streams nothing any more."""
    stamp = (pod.get("metadata") or {}).get("deletionTimestamp")
    if not stamp:
        return False
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) < now


def groups_still_named(router_pods: Iterable[dict[str, Any]], indices: Iterable[int],
                       url_of: Callable[[int], str], now: datetime.datetime | None = None) -> frozenset[int]:
    """The groups among `indices` whose worker URL (`url_of(index)`) some router pod, a
    terminating one included, still has in its arguments: it may still stream from them. A pod
    past its grace period does not count (a lost node would otherwise hold the groups forever)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    named: set[str] = set()
    for pod in router_pods:
        if _past_its_grace(pod, now):
            continue
        for container in ((pod.get("spec") or {}).get("containers") or []):
            named.update(container.get("command") or [])
            named.update(container.get("args") or [])
    return frozenset(i for i in indices if url_of(i) in named)
