"""Pure computation of `DeepSeekDeployment.status` from the role plans of one reconcile pass.

Phases:
    Pending      children created, nothing has been ready yet
    Progressing  a rollout or a scale change is in flight
    Available    every group of both roles and the router are ready on the current revision
    Degraded     a group failed (and was restarted), or groups are down outside of a rollout
A deployment without a router (router.replicas 0) is judged by its groups alone: its conditions say
"no router", and it is never Degraded for want of one. The Available condition needs at least
one ready group of each role that has replicas, whatever maxUnavailable allows: with the default
maxUnavailable 1, one replica's floor is 0 groups, and a deployment where nothing is ready serves
no request (it read Available before its first pod started, so the next pass called it Degraded).
    Failed       the spec is invalid (the InvalidSpec condition names the field), or its memory
                 plan does not fit the GPUs (MemoryPlanFits False, memory_plan.py)
Degraded also covers a model that cannot be made ready (ModelReady False with a failure reason).
Conditions keep their lastTransitionTime while their status does not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepseek_pd.operator.memory_plan import MemoryVerdict
from deepseek_pd.operator.model_status import ModelState
from deepseek_pd.operator.planner import RolePlan

MEMORY_CONDITION = "MemoryPlanFits"


@dataclass(frozen=True)
class RouterState:
    desired: int
    ready: int
    endpoint: str


def condition(type_: str, ok: bool | None, reason: str, message: str, generation: int | None,
              previous: dict[str, dict], now: str) -> dict[str, Any]:
    """One status condition (ok None: Unknown). Its lastTransitionTime stays the one in `previous`
    (conditions by type) while the status does not change, else becomes `now`.

    Example: condition("Available", True, "MinimumGroupsReady", "", 3, {}, "2026-12-06T15:00:00Z")
    -> {"type": "Available", "status": "True", ..., "lastTransitionTime": "2026-12-06T15:00:00Z",
        "observedGeneration": 3}"""
    status = "Unknown" if ok is None else "True" if ok else "False"
    before = previous.get(type_)
    since = before["lastTransitionTime"] if before and before.get("status") == status \
        and before.get("lastTransitionTime") else now
    entry = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}
    if generation is not None:
        entry["observedGeneration"] = generation
    return entry


def _by_type(conditions: list[dict] | None) -> dict[str, dict]:
    return {c.get("type", ""): c for c in conditions or []}


def _role_status(plan: RolePlan, revision: str) -> dict[str, Any]:
    return {"replicas": plan.replicas, "readyReplicas": plan.ready, "updatedReplicas": plan.updated,
            "ready": f"{plan.ready}/{plan.replicas}", "revision": revision}


def build_status(plans: dict[str, RolePlan], revisions: dict[str, str], floors: dict[str, int],
                 router: RouterState, generation: int | None, previous: dict[str, Any],
                 now: str, model: ModelState | None = None,
                 memory: MemoryVerdict | None = None) -> dict[str, Any]:
    """Status of a valid spec. `floors[role]` is replicas - maxUnavailable (the Available bar);
    `model`: the ModelReady condition (model_status.py), default Pending; `memory`: the
    MemoryPlanFits condition of a plan that did not refuse the spec (default: not planned)."""
    model = model or ModelState(False, "Pending", "no worker pod has started yet")
    memory = memory or MemoryVerdict(None, "NotPlanned", "")
    before = _by_type(previous.get("conditions"))
    router_ok = router.ready >= min(router.desired, 1)
    all_ready = router_ok and all(p.ready == p.replicas == p.updated and not p.rolling
                                  for p in plans.values())
    available = router_ok and all(p.ready >= max(floors[r], min(p.replicas, 1)) for r, p in plans.items())
    router_text = f"router {router.ready}/{router.desired} ready" if router.desired else "no router (router.replicas 0)"
    rolling = any(p.rolling for p in plans.values())
    restarted = {r: p.restarted for r, p in plans.items() if p.restarted}
    was_up = before.get("Available", {}).get("status") == "True" or \
        previous.get("phase") in ("Available", "Degraded", "Progressing")

    if model.failed:  # the workers cannot start: say why, rather than "Pending" forever
        phase, degraded_reason, degraded_message = "Degraded", "ModelNotReady", model.message
    elif restarted:
        phase, degraded_reason = "Degraded", "GroupRestarted"
        degraded_message = "; ".join(f"{role} group(s) {list(idx)} restarted after a pod failure"
                                     for role, idx in restarted.items())
    elif all_ready:
        phase, degraded_reason, degraded_message = "Available", "AsExpected", ""
    elif not was_up:  # first start: groups are being created or are loading weights
        phase, degraded_reason, degraded_message = "Pending", "AsExpected", ""
    elif rolling:
        phase, degraded_reason, degraded_message = "Progressing", "AsExpected", ""
    else:
        phase, degraded_reason = "Degraded", "GroupsNotReady"
        degraded_message = ", ".join(f"{r} {p.ready}/{p.replicas} groups ready" for r, p in plans.items())
        if not router_ok:
            degraded_message += f", {router_text}"

    summary = ", ".join(f"{r} {p.ready}/{p.replicas} ready, {p.updated} updated" for r, p in plans.items())
    conditions = [
        condition("Available", available, "MinimumGroupsReady" if available else "GroupsUnavailable",
                   f"{summary}; {router_text}", generation, before, now),
        condition("Progressing", rolling, "GroupsUpdating" if rolling else "Complete",
                   summary, generation, before, now),
        condition("Degraded", phase == "Degraded", degraded_reason, degraded_message, generation,
                   before, now),
        condition("InvalidSpec", False, "Valid", "", generation, before, now),
        condition("ModelReady", model.ready, model.reason, model.message, generation, before, now),
        condition(MEMORY_CONDITION, memory.status, memory.reason, memory.message, generation, before, now),
    ]
    status = {
        "phase": phase,
        "conditions": conditions,
        "routerEndpoint": router.endpoint,
        "routerReadyReplicas": router.ready,
        **{role: _role_status(plan, revisions[role]) for role, plan in plans.items()},
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def build_invalid_status(message: str, generation: int | None, previous: dict[str, Any],
                         now: str) -> dict[str, Any]:
    """Status of a spec the operator refuses: children are left as they are."""
    before = _by_type(previous.get("conditions"))
    kept = [c for t, c in before.items() if t in ("Available", "Progressing", "ModelReady", MEMORY_CONDITION)]
    conditions = kept + [
        condition("Degraded", True, "InvalidSpec", message, generation, before, now),
        condition("InvalidSpec", True, "InvalidSpec", message, generation, before, now),
    ]
    status: dict[str, Any] = {"phase": "Failed", "conditions": conditions}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def build_memory_refused_status(memory: MemoryVerdict, generation: int | None, previous: dict[str, Any],
                                now: str) -> dict[str, Any]:
    """Status of a valid spec whose memory plan does not fit: nothing is created for it, and
    children of an earlier spec are left as they are (as for an invalid spec)."""
    before = _by_type(previous.get("conditions"))
    kept = [c for t, c in before.items() if t in ("Available", "Progressing", "ModelReady")]
    conditions = kept + [
        condition("Degraded", True, "MemoryPlanDoesNotFit", memory.message, generation, before, now),
        condition("InvalidSpec", False, "Valid", "", generation, before, now),
        condition(MEMORY_CONDITION, False, memory.reason, memory.message, generation, before, now),
    ]
    status: dict[str, Any] = {"phase": "Failed", "conditions": conditions}
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def build_apply_error_status(message: str, generation: int | None, previous: dict[str, Any],
                             now: str) -> dict[str, Any]:
    """The API server refused a child (quota, admission webhook, RBAC): shown, retried next pass."""
    before = _by_type(previous.get("conditions"))
    kept = [c for t, c in before.items()
            if t in ("Available", "Progressing", "InvalidSpec", "ModelReady", MEMORY_CONDITION)]
    status: dict[str, Any] = {
        "phase": "Degraded",
        "conditions": kept + [condition("Degraded", True, "ApplyFailed", message, generation, before, now)],
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status
